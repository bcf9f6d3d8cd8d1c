"""Tensor parallelism through a real tritonserver: the generator with
TRITONLLM_TENSOR_PARALLEL_SIZE=2 on CPU (gloo), its engine in two rank processes.

Oracles: the engine at tensor-parallel size 1 on the same checkpoint and settings (greedy ids,
compared honestly at near-ties: `tp_helpers`), the kernel's process table for the ranks.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import SERVER_ENV
from test_engine_process import _wait_gone
from test_tp_engine import rank_environment
from tp_helpers import assert_same_greedy, run_client

from tritonllm.config import EngineConfig
from tritonllm.distributed import MULTICAST_OFF_ENV
from tritonllm.engine import EngineThread, LLMEngine

pytest.importorskip("tritonclient.grpc")

TIE_MARGIN = 1e-4
NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "Hello world", "1, 2, 3, 4,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir, tmp_path_factory):
    """tritonserver whose generator splits the tiny Qwen3 across two ranks."""
    from tritonllm.triton_server import TritonServer

    log = tmp_path_factory.mktemp("logs") / "tritonserver-tp2.log"
    env = {**SERVER_ENV, "TRITONLLM_TENSOR_PARALLEL_SIZE": "2"}
    server = TritonServer(model_path=tiny_model_dir, env=env, log_path=log)
    try:  # stopped also when it fails to start (its stubs may be running)
        yield server.start(timeout=float(os.environ.get("TRITONLLM_TEST_SERVER_TIMEOUT", "300")))
    finally:
        server.stop()


def _ranks(pgid: int) -> dict[str, int]:
    """Live rank processes of process group `pgid`, by `comm` (rank 0: the engine process)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, fields = stat.read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        parts = fields.split()
        name = comm.split("(", 1)[1]
        if int(parts[2]) == pgid and parts[0] != "Z" and name.startswith("tritonllm-"):
            found[name] = int(stat.parent.name)
    return found


def test_tp2_generator_streams_the_greedy_ids_of_tp1(tp_server, tokenizer):
    """Greedy requests streamed concurrently from the generator (input_ids in, output_ids
    out) equal the size-1 engine's on the same settings; both ranks run in their own
    processes, started with NVLink multicast off."""
    from test_triton_models import Stream

    ranks = _ranks(tp_server.process.pid)
    assert set(ranks) == {"tritonllm-engin", "tritonllm-tp1"}, ranks
    for pid in ranks.values():
        env = rank_environment(pid)
        assert {key: env.get(key) for key in MULTICAST_OFF_ENV} == MULTICAST_OFF_ENV
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    config = EngineConfig(
        model=str(tp_server.model_path),
        device="cpu",
        page_size=int(SERVER_ENV["TRITONLLM_PAGE_SIZE"]),
        num_pages=int(SERVER_ENV["TRITONLLM_NUM_PAGES"]),
    )
    reference = EngineThread(LLMEngine(config))
    try:
        expected = run_client(reference, prompts, NEW_TOKENS)
    finally:
        reference.shutdown()
    stream = Stream(tp_server.grpc_url)
    try:
        sent = [
            stream.send(
                "generator",
                {"input_ids": p, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
            )
            for p in prompts
        ]
        responses = stream.collect(len(sent))
    finally:
        stream.close()
    got = [[int(t) for r in responses[rid] for t in r["output_ids"]] for rid in sent]
    assert assert_same_greedy(expected, got, TIE_MARGIN, 0) == len(prompts) * NEW_TOKENS


def test_every_rank_exits_when_tritonserver_is_killed(tp_server):
    """SIGKILL of tritonserver: its stubs exit by themselves and take both ranks with them
    (`PR_SET_PDEATHSIG`) within 15 s. Runs last: it kills the server."""
    pid = tp_server.process.pid
    ranks = _ranks(pid)
    assert len(ranks) == 2, ranks
    os.kill(pid, signal.SIGKILL)
    tp_server.process.wait(timeout=10)
    deadline = time.monotonic() + 15.0
    left = {
        name: p
        for name, p in ranks.items()
        if not _wait_gone(p, timeout=max(0.0, deadline - time.monotonic()))
    }
    assert not left, f"outlived tritonserver by 15 s: {left}"
