"""The inference engine: paged KV cache, radix prefix cache, continuous batching, sampling.

The names below are imported on first use (PEP 562), so a torch-free module of this package
(``stop_strings``, ``request_limits``) can be imported by the tokenizer and detokenizer stubs
without importing the engine, and so torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tritonllm.engine.client import EngineClient
    from tritonllm.engine.engine import LLMEngine
    from tritonllm.engine.engine_process import EngineProcess
    from tritonllm.engine.engine_thread import EngineThread
    from tritonllm.engine.request import RequestOutput
    from tritonllm.engine.stats import EngineStats

_HOMES = {
    "EngineClient": "tritonllm.engine.client",
    "EngineProcess": "tritonllm.engine.engine_process",
    "EngineStats": "tritonllm.engine.stats",
    "EngineThread": "tritonllm.engine.engine_thread",
    "LLMEngine": "tritonllm.engine.engine",
    "RequestOutput": "tritonllm.engine.request",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "EngineClient",
    "EngineProcess",
    "EngineStats",
    "EngineThread",
    "LLMEngine",
    "RequestOutput",
]
