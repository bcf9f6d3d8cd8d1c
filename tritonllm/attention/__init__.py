"""Attention backends behind one interface, chosen by name (`EngineConfig.attention_backend`).

`ATTENTION_BACKENDS` maps a name to its class. GPU backends are imported lazily by
`get_attention_backend`, so a CPU process never imports flashinfer or triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tritonllm.attention.base import AttentionBackend, AttentionMetadata

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}

# name → module that registers it on import (imported only when that backend is asked for).
_LAZY_MODULES = {
    "torch": "tritonllm.attention.torch_backend",
    "flashinfer": "tritonllm.attention.flashinfer_backend",
    "triton": "tritonllm.attention.triton_backend",
}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: `@register_backend("torch")` adds the class to ATTENTION_BACKENDS."""

    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        ATTENTION_BACKENDS[name] = cls
        return cls

    return wrap


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`, importing its module on first use.

    Raises:
        ValueError: unknown name.
        ImportError: the backend's dependencies (e.g. flashinfer) are missing.
    """
    if name not in ATTENTION_BACKENDS and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    if name not in ATTENTION_BACKENDS:
        known = sorted(set(ATTENTION_BACKENDS) | set(_LAZY_MODULES))
        raise ValueError(f"unknown attention_backend {name!r}; known: {', '.join(known)}")
    return ATTENTION_BACKENDS[name]


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "get_attention_backend",
    "register_backend",
]
