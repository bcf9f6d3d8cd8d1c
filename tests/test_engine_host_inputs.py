"""The host-side inputs of a step, built with numpy from per-request state, equal what a plain
per-request Python construction gives.

- `paged_kv_args` (FlashInfer's page list, CUDA-graph padding included) against a per-sequence
  slicing of the page table;
- the scheduler's `HostPageTable` rows against each request's `pages`, step after step, through
  preemption, the prefix cache and chunked prefill;
- every batch of `ModelRunner.build_inputs` (ids, positions, K/V slots, page table, lengths,
  logits rows) against a per-request reference, with and without overlap scheduling, and the
  decode batch order (longest context first, ties oldest first).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_engine_helpers import checkpoint, prompts

from tritonllm.attention.flashinfer_backend import paged_kv_args
from tritonllm.config import EngineConfig
from tritonllm.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams


def reference_kv_args(table: torch.Tensor, seq_lens: list[int], page_size: int, padding: int):
    """FlashInfer's CSR page list, one sequence at a time; padding rows: one token on page 0."""
    indptr, indices, last = [0], [], []
    for b, n in enumerate(seq_lens):
        pages = math.ceil(n / page_size)
        indices += table[b, :pages].tolist()
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size)
    for _ in range(padding):
        indices.append(0)
        indptr.append(indptr[-1] + 1)
        last.append(1)
    return indptr, indices, last


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_args_match_per_sequence_page_lists(page_size):
    rng = random.Random(page_size)
    for _ in range(50):
        batch = rng.randint(1, 24)
        seq_lens = [rng.randint(1, 300) for _ in range(batch)]
        width = max(math.ceil(n / page_size) for n in seq_lens) + rng.randint(0, 2)
        table = torch.randint(1, 5000, (batch, width), dtype=torch.int32)
        padding = rng.choice([0, rng.randint(1, 9)])
        args = paged_kv_args(table, seq_lens, page_size, padding)
        indptr, indices, last = reference_kv_args(table, seq_lens, page_size, padding)
        assert args.kv_indptr.tolist() == indptr
        assert args.kv_indices.tolist() == indices
        assert args.kv_last_page_len.tolist() == last
        for t in (args.kv_indptr, args.kv_indices, args.kv_last_page_len):
            assert t.dtype == torch.int32 and t.device.type == "cpu"


def _workload(engine: LLMEngine, seed: int) -> None:
    """Prompts sharing prefixes (prefix cache hits), long enough to chunk, greedy and sampled."""
    rng = random.Random(seed)
    shared = prompts([24], seed=seed)[0]
    for i, own in enumerate(prompts([rng.randint(1, 20) for _ in range(12)], seed=seed + 1)):
        params = SamplingParams(
            max_tokens=rng.randint(1, 40),
            temperature=rng.choice([0.0, 0.8]),
            ignore_eos=True,
            n=2 if i % 5 == 0 else 1,
        )
        engine.add_request(f"r{i}", shared[: rng.randint(0, 24)] + own, params)


def _check_page_rows(engine: LLMEngine) -> None:
    table = engine.scheduler.page_table
    used = set()
    for req in engine._requests.values():
        if not req.pages:
            assert req.page_row == -1
            continue
        row = table.rows[req.page_row].tolist()
        assert row == req.pages + [0] * (len(row) - len(req.pages))
        used.add(req.page_row)
    free = [i for i in range(table.rows.shape[0]) if i not in used]
    assert not table.rows[free].any()  # released rows are zero


@pytest.mark.parametrize("overlap", [False, True])
def test_host_page_table_mirrors_request_pages(overlap):
    """Few pages (preemption), page size 2, the prefix cache and chunked prefill: after every
    step each request's row holds exactly its pages, and every other row is zero."""
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint("qwen3"),
            page_size=2,
            num_pages=48,
            max_prefill_tokens=16,
            max_running_requests=6,
            overlap_schedule=overlap,
        )
    )
    _workload(engine, seed=1)
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            cached += out.cached_tokens
        _check_page_rows(engine)
    assert engine.stats().num_preemptions > 0 and cached > 0  # both paths were taken


def _reference_inputs(runner, batch) -> dict[str, list]:
    """The forward inputs of `batch`, request by request, in plain Python."""
    ps = runner.page_size
    future = runner.future.ids.tolist()
    ref = {k: [] for k in ("ids", "positions", "slots", "seq_lens", "prefix", "cu", "logits")}
    ref["cu"].append(0)
    seq_lens = [r.num_computed + e for r, e in zip(batch.reqs, batch.extend_lens, strict=True)]
    width = max(math.ceil(n / ps) for n in seq_lens)
    rows, sample_reqs = [], []
    for r, ext, n in zip(batch.reqs, batch.extend_lens, seq_lens, strict=True):
        for p in range(r.num_computed, n):
            t = r.token_ids[p]
            ref["ids"].append(t if t >= 0 else future[-t - 1])
            ref["positions"].append(p)
            ref["slots"].append(r.pages[p // ps] * ps + p % ps)
        ref["seq_lens"].append(n)
        ref["prefix"].append(r.num_computed)
        ref["cu"].append(ref["cu"][-1] + ext)
        rows.append(r.pages[:width] + [0] * (width - min(len(r.pages), width)))
        if n == len(r.token_ids):
            sample_reqs.append(r)
            ref["logits"].append(ref["cu"][-1] - 1)
    ref["table"] = rows
    ref["logits"] = ref["logits"] or [0]
    ref["sample_reqs"] = sample_reqs
    return ref


@pytest.mark.parametrize("overlap", [False, True])
def test_build_inputs_match_per_request_reference(overlap):
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint("qwen3"),
            page_size=4,
            num_pages=40,
            max_prefill_tokens=24,
            max_running_requests=8,
            overlap_schedule=overlap,
        )
    )
    runner = engine.runner
    build = runner.build_inputs
    kinds = set()

    def checked(batch, before_upload=None):
        fwd = build(batch, before_upload)
        ref = _reference_inputs(runner, batch)
        meta = fwd.meta
        assert fwd.input_ids.tolist() == ref["ids"]
        assert fwd.positions.tolist() == ref["positions"]
        assert meta.out_cache_loc.tolist() == ref["slots"]
        assert meta.page_table.tolist() == ref["table"]
        assert meta.seq_lens.tolist() == meta.seq_lens_cpu == ref["seq_lens"]
        assert meta.extend_lens.tolist() == meta.extend_lens_cpu == batch.extend_lens
        assert meta.prefix_lens.tolist() == ref["prefix"]
        assert meta.cu_extend_lens.tolist() == ref["cu"]
        assert fwd.logits_indices.tolist() == ref["logits"]
        assert all(a is b for a, b in zip(fwd.sample_reqs, ref["sample_reqs"], strict=True))
        assert meta.is_decode == batch.is_decode
        if batch.is_decode:  # longest context first, ties oldest first
            order = sorted(batch.reqs, key=lambda r: (-r.num_computed, r.arrival))
            assert all(a is b for a, b in zip(batch.reqs, order, strict=True))
        kinds.add((batch.is_decode, len(batch.reqs) > 1))
        return fwd

    runner.build_inputs = checked
    _workload(engine, seed=2)
    while engine.has_unfinished():
        engine.step()
    assert {(True, True), (False, True)} <= kinds  # batched decode and prefill both checked
