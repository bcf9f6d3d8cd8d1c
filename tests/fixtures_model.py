"""Session fixtures for the offline tokenizer and tiny checkpoints of every architecture.

``tests/conftest.py`` already provides ``tiny_model_dir`` (tiny Qwen3) and ``tokenizer`` (loaded
from it). These add the in-memory built tokenizer and tiny qwen2/llama checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The Qwen3 fast tokenizer built in memory from ``qwen.tiktoken`` (not via save/load)."""
    from tritonllm.tokenization.qwen_tokenizer import build_qwen3_tokenizer

    return build_qwen3_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[[str], Path]:
    """``factory(arch)`` -> dir of the tiny seed-0 checkpoint of ``arch`` (qwen3, qwen2, llama).

    Each arch is built once a session, on first request.
    """
    from tritonllm.build_model import build_model

    built: dict[str, Path] = {}

    def factory(arch: str) -> Path:
        if arch not in built:
            out = tmp_path_factory.mktemp("models") / f"tiny-{arch}"
            built[arch] = build_model(out, shape="tiny", arch=arch, seed=0)
        return built[arch]

    return factory
