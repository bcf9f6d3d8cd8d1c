"""Tensor parallelism through a real tritonserver: the generator with
TRITONLLM_TENSOR_PARALLEL_SIZE=2 on CPU (gloo) serving the default model, SmolLM2-135M-Instruct
(9 query / 3 KV heads, split unevenly), its engine in two rank processes.

Oracles: the engine at tensor-parallel size 1 on the same checkpoint and settings (greedy ids
and logprobs, compared honestly at near-ties: `tp_helpers`), the tokenizer's own decoding for the ensemble's
text, the kernel's process table for the ranks.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from test_engine_process import _wait_gone
from test_tp_engine import rank_environment
from tp_helpers import (
    SMOLLM2_CHATS,
    SMOLLM2_TOKENS,
    TIE_MARGIN,
    assert_same_greedy,
    reference_runs,
    smollm2_config,
    smollm2_prompts,
)

from tritonllm.distributed import MULTICAST_OFF_ENV, ModelShard, Span

pytest.importorskip("tritonclient.grpc")


@pytest.fixture(scope="module")
def tp_server(smollm2_dir, tmp_path_factory):
    """tritonserver whose generator splits SmolLM2 across two ranks (the engine settings of
    `smollm2_config`)."""
    from tritonllm.triton_server import TritonServer

    config = smollm2_config(smollm2_dir)
    env = {
        "TRITONLLM_DEVICE": "cpu",
        "TRITONLLM_PAGE_SIZE": str(config.page_size),
        "TRITONLLM_NUM_PAGES": str(config.num_pages),
        "TRITONLLM_TENSOR_PARALLEL_SIZE": "2",
    }
    log = tmp_path_factory.mktemp("logs") / "tritonserver-tp2.log"
    server = TritonServer(model_path=smollm2_dir, env=env, log_path=log)
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


def test_tp2_server_gives_the_greedy_ids_logprobs_and_text_of_tp1(tp_server, smollm2_tokenizer):
    """SmolLM2's 9 query / 3 KV heads split unevenly (rank 0: KV heads 0-1 with query heads
    0-5, rank 1: KV head 2 with 6-8). Chat prompts streamed concurrently from the generator
    (input_ids in, output_ids and their logprobs out) equal the size-1 engine's greedy ids up to
    a float32 near-tie (top-2 margin under 1e-4; at most one sequence reaches one), logprobs to
    1e-4; one chat through the `llm` ensemble (template, TP=2 generator, detokenizer) gives
    their text; both ranks run in their own processes, started with NVLink multicast off."""
    from test_triton_models import Stream

    config = smollm2_config(tp_server.model_path)
    rank0, rank1 = (ModelShard.of(config.model_config, r, 2).heads for r in (0, 1))
    assert (rank0.q, rank0.kv) == (Span(0, 6), Span(0, 2))
    assert (rank1.q, rank1.kv) == (Span(6, 9), Span(2, 3))
    ranks = _ranks(tp_server.process.pid)
    assert set(ranks) == {"tritonllm-engin", "tritonllm-tp1"}, ranks
    for pid in ranks.values():
        env = rank_environment(pid)
        assert {key: env.get(key) for key in MULTICAST_OFF_ENV} == MULTICAST_OFF_ENV
    prompts = smollm2_prompts(smollm2_tokenizer)
    expected = reference_runs(config, prompts, SMOLLM2_TOKENS)
    greedy = {"max_tokens": SMOLLM2_TOKENS, "temperature": 0.0, "ignore_eos": True}
    stream = Stream(tp_server.grpc_url)
    try:
        sent = [
            stream.send("generator", {"input_ids": p, "logprobs": 1, **greedy}) for p in prompts
        ]
        chat = stream.send("llm", {"messages": json.dumps(SMOLLM2_CHATS[0]), **greedy})
        responses = stream.collect(len(sent) + 1)
    finally:
        stream.close()
    got = [[int(t) for r in responses[rid] for t in r["output_ids"]] for rid in sent]
    logprobs = [[float(v) for r in responses[rid] for v in r["output_logprobs"]] for rid in sent]
    compared = assert_same_greedy(expected, got, TIE_MARGIN, 1, logprobs)
    assert compared >= (len(prompts) - 1) * SMOLLM2_TOKENS
    # The ensemble's chat is the first prompt: its text is the reference's, up to a near-tie.
    ref = expected[0]
    cut = next((k for k, m in enumerate(ref.margins()) if m < TIE_MARGIN), len(ref.ids))
    text = "".join(r["text_output"][0].decode() for r in responses[chat])
    ref_text = smollm2_tokenizer.decode(ref.ids[:cut], skip_special_tokens=True)
    assert text == ref_text if cut == len(ref.ids) else text.startswith(ref_text)


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
    print(f"\nranks gone {time.monotonic() - deadline + 15.0:.1f} s after the kill")
    assert not left, f"outlived tritonserver by 15 s: {left}"
