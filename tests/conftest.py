"""Shared pytest fixtures: the tiny offline checkpoint and a real tritonserver serving it, and
the trained default model (``smollm2_fixtures.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from frontend_fixtures import sidecar  # noqa: F401  (the OpenAI sidecar fixture)
from smollm2_fixtures import smollm2_dir, smollm2_service, smollm2_tokenizer  # noqa: F401


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint (offline tokenizer + seeded random weights), built once a session."""
    from tritonllm.build_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", shape="tiny", arch="qwen3")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The Hugging Face fast tokenizer of the tiny checkpoint."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_logprobs(tiny_model_dir):
    """``(prompt_ids, new_ids) -> [len(new_ids), vocab]`` float32 log_softmax of transformers'
    logits (the oracle) at the positions that predicted ``new_ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def run(prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([prompt_ids + new_ids]), use_cache=False).logits[0].float()
        return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)

    return run


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir):
    """``hf_greedy(prompt_ids, n)``: n greedy ids from Hugging Face transformers (no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def generate(prompt_ids: list[int], n: int) -> list[int]:
        ids = list(prompt_ids)
        for _ in range(n):  # no KV cache: the tiny model recomputes the prefix in microseconds
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        return ids[len(prompt_ids) :]

    return generate


# Engine settings for the served test model: small pages so prompts span several of them, and a
# KV pool small enough that the cache accounting is observable.
SERVER_ENV = {
    "TRITONLLM_PAGE_SIZE": "8",
    "TRITONLLM_NUM_PAGES": "1024",
    "TRITONLLM_DEVICE": "cpu",
}


@pytest.fixture(scope="session")
def triton_server(tiny_model_dir, tmp_path_factory):
    """A real tritonserver on free localhost ports serving the project's model repository."""
    from tritonllm.triton_server import TritonServer

    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    server = TritonServer(model_path=tiny_model_dir, env=dict(SERVER_ENV), log_path=log)
    try:
        server.start(timeout=float(os.environ.get("TRITONLLM_TEST_SERVER_TIMEOUT", "300")))
    except RuntimeError:
        server.stop()
        raise
    yield server
    server.stop()
    if os.environ.get("TRITONLLM_SHOW_SERVER_LOG"):
        print(server.log_tail())
