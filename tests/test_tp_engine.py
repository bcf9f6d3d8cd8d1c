"""Tensor parallelism in the engine on CPU (gloo): one process per rank behind `EngineProcess`.

Oracles: the same engine at tensor-parallel size 1 (greedy ids and logprobs, compared honestly
at near-ties: `tp_helpers`), the unsplit layers on the same weights, and the kernel's process
table for the ranks' lifetime. SmolLM2 (9 query / 3 KV heads, split unevenly) at TP=2 runs in
`test_tp_triton`, through tritonserver: its ids and logprobs against the same size-1 engine.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import threading

import pytest
import torch
from test_engine_helpers import checkpoint
from test_engine_thread import TIMEOUT, Collector
from tp_helpers import TIE_MARGIN, assert_same_greedy, run_client

from tritonllm.config import EngineConfig
from tritonllm.distributed import MULTICAST_OFF_ENV
from tritonllm.engine import EngineProcess, EngineThread, LLMEngine
from tritonllm.sampling_params import SamplingParams

NEW_TOKENS = 24


def _tiny_config(model_dir, tp: int) -> EngineConfig:
    """Small pages, a small prefill budget (prompts are chunked) and overlap scheduling on
    (placeholders in the inputs: the sampled ids must reach every rank's future map)."""
    return EngineConfig(
        model=str(model_dir),
        page_size=4,
        num_pages=512,
        max_prefill_tokens=48,
        overlap_schedule=True,
        tensor_parallel_size=tp,
    )


def _tiny_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(19)
    shared = torch.randint(10, 150000, (20,), generator=gen).tolist()  # a cached prefix
    lengths = [3, 9, 40, 17, 70, 1, 25, 12]
    return [
        (shared if i % 2 else []) + torch.randint(10, 150000, (n,), generator=gen).tolist()
        for i, n in enumerate(lengths)
    ]


@pytest.fixture(scope="module")
def tiny_tp2(tiny_model_dir):
    """The tiny Qwen3 split across two ranks (rank 0 in `EngineProcess`'s child)."""
    engine = EngineProcess(_tiny_config(tiny_model_dir, 2))
    yield engine
    engine.shutdown()


def test_tp2_gives_the_greedy_ids_and_logprobs_of_tp1_on_the_tiny_qwen3(tiny_model_dir, tiny_tp2):
    """Two waves of prompts (the second reuses cached prefixes), chunked prefill, mixed
    prefill/decode steps and overlap scheduling: TP=2 equals TP=1 id for id (no near-tie in these runs), logprobs to 1e-4."""
    prompts = _tiny_prompts()
    reference = EngineThread(LLMEngine(_tiny_config(tiny_model_dir, 1)))
    try:
        expected = [run_client(reference, prompts, NEW_TOKENS) for _ in range(2)]
    finally:
        reference.shutdown()
    for wave in expected:
        got = run_client(tiny_tp2, prompts, NEW_TOKENS)
        compared = assert_same_greedy(
            wave, [r.ids for r in got], TIE_MARGIN, 0, [r.logprobs for r in got]
        )
        assert compared == len(prompts) * NEW_TOKENS
    stats = tiny_tp2.stats()
    assert stats.num_prefill_steps > 2 and stats.max_batch_size_seen == len(prompts)
    assert stats.num_mixed_steps > 0  # decode rows rode along in prefill steps
    assert stats.cached_pages > 0 and tiny_tp2.is_alive()


def rank_environment(pid: int) -> dict[str, str]:
    """The environment process `pid` was started with (`/proc/PID/environ`)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {key.decode(): value.decode(errors="replace") for key, value in pairs}


def test_every_rank_starts_with_nvlink_multicast_off(tiny_tp2):
    ranks = [tiny_tp2.pid, *_pids_named("tritonllm-tp1")]
    assert len(ranks) == 2
    for pid in ranks:
        env = rank_environment(pid)
        assert {key: env.get(key) for key in MULTICAST_OFF_ENV} == MULTICAST_OFF_ENV, pid


def _pids_named(name: str) -> list[int]:
    """Live children of this process whose `comm` is `name`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                comm, fields = f.read().rsplit(")", 1)
        except OSError:
            continue
        parts = fields.split()
        if parts[0] != "Z" and int(parts[1]) == os.getpid() and comm.endswith(f"({name}"):
            found.append(int(entry))
    return found


def test_a_killed_worker_rank_fails_requests_in_flight_and_the_engine(tiny_tp2):
    """SIGKILL of rank 1 mid-generation: the request ends with an "error" output naming the
    rank, `is_alive()` turns False, rank 0 is gone too, later submits raise. Runs last in this
    module: it ends the shared engine."""
    (worker,) = _pids_named("tritonllm-tp1")
    started = threading.Event()
    sink = Collector()

    def on_output(out):
        sink(out)
        started.set()

    tiny_tp2.submit(
        "victim", [5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True), on_output
    )
    assert started.wait(TIMEOUT)
    os.kill(worker, signal.SIGKILL)
    sink.wait(["victim"])
    last = sink.outputs["victim"][-1]
    assert last.finish_reason == "error"
    assert "tensor-parallel rank 1: killed by SIGKILL" in last.error
    assert not tiny_tp2.is_alive()
    assert tiny_tp2._process.exitcode is not None  # rank 0 went with it
    with pytest.raises(RuntimeError, match="engine process died .*tensor-parallel rank 1"):
        tiny_tp2.submit("later", [1, 2], SamplingParams(max_tokens=2), sink)


# ---- one rank's process group, collectives and layers (two forked processes) ----------------


def _rank_checks(rank: int, store_path: str, results) -> None:
    """Rank `rank` of 2: join the group through `init_tensor_parallel` (recording the
    environment at the moment torch.distributed initialises), then run the collectives and the
    parallel layers; puts a dict of what it saw into `results`."""
    import torch.distributed as dist

    from tritonllm.distributed import Span, init_tensor_parallel
    from tritonllm.layers import Linear
    from tritonllm.layers.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

    for key in MULTICAST_OFF_ENV:
        os.environ.pop(key, None)
    seen: dict[str, str | None] = {}
    real_init = dist.init_process_group

    def recording_init(*args, **kwargs):
        seen.update({key: os.environ.get(key) for key in MULTICAST_OFF_ENV})
        return real_init(*args, **kwargs)

    dist.init_process_group = recording_init
    tp = init_tensor_parallel(rank, 2, store_path, "cpu")
    out: dict = {"env": seen, "backend": dist.get_backend()}
    out["gather"] = tp.all_gather(torch.full((2, 3), float(rank))).tolist()
    out["broadcast"] = tp.broadcast(torch.tensor([rank + 7])).tolist()
    out["min"] = tp.min_int(10 - rank)
    # Layers against their unsplit versions on the same seeded weights.
    gen = torch.Generator().manual_seed(0)
    vocab, hidden, inner = 1001, 16, 24  # uneven vocabulary: rows 0..500 and 501..1000
    emb = torch.randn(vocab, hidden, generator=gen)
    down = torch.randn(hidden, inner, generator=gen)
    x = torch.randn(5, inner, generator=gen)
    ids = torch.tensor([0, 500, 501, 1000, 77])
    rows = -(-vocab // 2)
    span = Span(rank * rows, min(vocab, (rank + 1) * rows))
    with torch.no_grad():
        embedding = VocabParallelEmbedding(span, rows, hidden, tp)
        embedding.weight.zero_()
        embedding.weight[: span.size] = emb[span.start : span.stop]
        out["embed_exact"] = torch.equal(embedding(ids), emb[ids])
        head = ParallelLMHead(hidden, rows, vocab, tp)
        head.weight.copy_(embedding.weight)
        h = torch.randn(3, hidden, generator=gen)
        out["head_err"] = (head(h) - h @ emb.T).abs().max().item()
        cols = Span(rank * inner // 2, (rank + 1) * inner // 2)
        row_parallel = RowParallelLinear(cols.size, hidden, True, tp)
        row_parallel.weight.copy_(down[:, cols.start : cols.stop])
        full = Linear(inner, hidden, bias=True)
        full.weight.copy_(down)
        if row_parallel.bias is not None:  # rank 0 only
            row_parallel.bias.fill_(0.5)
        full.bias.fill_(0.5)
        out["has_bias"] = row_parallel.bias is not None
        out["row_err"] = (row_parallel(x[:, cols.start : cols.stop]) - full(x)).abs().max().item()
    results.put((rank, out))


def test_ranks_join_with_multicast_off_and_their_layers_equal_the_unsplit_ones(tmp_path):
    """Each rank has NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
    NVSHMEM_DISABLE_NVLS=1 in its environment when torch.distributed initialises (gloo on CPU);
    the collectives move what they should; the vocabulary-parallel embedding is exact, the LM
    head and the row-parallel projection (bias added once) equal the unsplit layers."""
    # fork, not the engine's spawn: it saves two interpreter start-ups (seconds on 2 cores), and
    # the ranks' tensors are too small for torch's intra-op thread pool, which fork breaks.
    ctx = multiprocessing.get_context("fork")
    store = tmp_path / "store"
    store.touch()
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank_checks, args=(r, str(store), results)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        seen = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for p in ranks:
            p.join(30)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank, out in seen.items():
        assert out["env"] == MULTICAST_OFF_ENV, rank
        assert out["backend"] == "gloo"
        assert out["gather"] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
        assert out["broadcast"] == [7] and out["min"] == 9
        assert out["embed_exact"] and out["head_err"] < 1e-5 and out["row_err"] < 1e-4
        assert out["has_bias"] == (rank == 0)


def test_a_tensor_parallel_size_the_heads_cannot_split_fails_the_start_with_the_reason(
    tiny_model_dir,
):
    config = dataclasses.replace(_tiny_config(tiny_model_dir, 1), tensor_parallel_size=5)
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size must be in 1\.\.4"):
        EngineProcess(config)


def test_an_in_process_engine_refuses_a_tensor_parallel_size():
    """Only `EngineProcess` starts ranks: `LLMEngine` (and so `EngineThread`) with a size above
    1 fails rather than silently holding the whole model."""
    config = EngineConfig(model=checkpoint("qwen3"), page_size=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 runs one process per rank"):
        LLMEngine(config)
