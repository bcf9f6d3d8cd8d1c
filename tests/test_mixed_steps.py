"""Mixed prefill/decode steps (`EngineConfig.mixed_steps`, `engine/scheduler.py`).

- Policy: a step with prefill work carries every decoding request as a one-token row (prefill
  rows first), so no decode step is lost to a prefill and a long prompt's chunks run back to
  back; a step without admissible prefill work (nothing waiting, the admission delay, no pages)
  is a decode batch, which replays a CUDA graph on GPU.
- Token budget: the prompt rows of a step get `max_prefill_tokens` less the decode rows, never
  less than half of it; the admission delay's fill rule uses that share.
- Greedy ids equal transformers' with requests arriving while others decode, long prompts
  chunked beside decoding requests, overlap scheduling on and off, the prefix cache on and off.
- Mixed steps on and off give identical outputs for every sampling path (seeded sampling,
  penalties, logprobs, n > 1, stop tokens, min_tokens, preemption), and through the triton
  backend's extend kernel (Triton's interpreter on CPU) the torch backend's greedy ids.
- GPU (marked `gpu`): with CUDA graphs, overlap scheduling and the triton / flashinfer backends,
  mixed steps give the same greedy ids as without.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from scheduler_helpers import (
    add,
    assert_pages_balanced,
    ids,
    kind,
    make_scheduler,
    start_decoding,
    step,
)
from test_engine_helpers import checkpoint, hf_greedy, prompts
from test_gpu_engine import (
    BF16_GAP,
    _engine,
    _release,
    assert_same_outputs,
    assert_same_until_low_margin,
    checkpoint_hd128,
    greedy_workload,
    mixed_workload,
    needs_flashinfer,
    run_all,
)
from test_gpu_engine import ids as output_ids

import kernels  # before anything imports triton: on CPU it selects Triton's interpreter
from tritonllm.config import EngineConfig
from tritonllm.engine import LLMEngine
from tritonllm.engine.request import Request, RequestStatus
from tritonllm.engine.scheduler import Scheduler
from tritonllm.sampling_params import SamplingParams
from tritonllm.triton_config import engine_config


# ---- the policy, on the scheduler alone ---------------------------------------------------------
def test_a_prefill_step_carries_every_decoding_request_as_a_one_token_row():
    sched = make_scheduler(0, max_prefill_tokens=64, mixed=True)
    a, b = start_decoding(sched)
    add(sched, "new", 5)
    batch = step(sched)
    assert kind(batch) == "mixed" and not batch.is_decode
    assert batch.reqs[0].request_id == "new"  # prefill rows first, then the decode rows
    assert ids(batch) == {"a", "b", "new"} and batch.extend_lens == [5, 1, 1]
    assert batch.num_decode_rows == 2 and batch.num_prefill_tokens == 5
    assert all(r.num_output_tokens == 3 for r in (a, b))  # no decode step was lost
    assert kind(step(sched)) == "decode"  # nothing left to prefill: a (graph-able) decode batch


def test_a_long_prompt_is_chunked_in_consecutive_steps_beside_the_decode_rows():
    sched = make_scheduler(1000, max_prefill_tokens=16, mixed=True)
    decoding = start_decoding(sched)
    long = add(sched, "long", 40)  # fills a batch: admitted at once
    plan = [(kind(b), b.extend_lens) for b in (step(sched) for _ in range(4))]
    # 16 - 2 decode rows = 14 prompt tokens per step, then the rest; a and b ride along.
    assert plan == [
        ("mixed", [14, 1, 1]),
        ("mixed", [14, 1, 1]),
        ("mixed", [12, 1, 1]),
        ("decode", [1, 1, 1]),
    ]
    assert all(r.num_output_tokens == 2 + 4 for r in decoding)
    assert long.num_output_tokens == 2


def test_a_short_prompt_is_admitted_beside_a_long_prompts_chunks():
    """A short prompt that arrives while a long one is part-way through its chunks goes in the
    next step (the long one's chunk shrinks to half the budget), not after its last chunk."""
    sched = make_scheduler(0, max_prefill_tokens=16, mixed=True)
    long = add(sched, "long", 100)
    assert step(sched).extend_lens == [16]
    short = add(sched, "short", 3, max_tokens=1)
    batch = step(sched)
    assert [r.request_id for r in batch.reqs] == ["long", "short"]
    assert batch.extend_lens == [8, 3]
    assert short.status == RequestStatus.FINISHED
    assert step(sched).extend_lens == [16]  # nothing waits: the whole budget again
    assert long.num_computed == 16 + 8 + 16


@pytest.mark.parametrize(
    ("budget", "num_decoding", "share"),
    [(16, 0, 16), (16, 3, 13), (16, 8, 8), (16, 12, 8), (7, 5, 4), (1, 4, 1)],
)
def test_prompt_rows_get_the_budget_less_the_decode_rows_but_at_least_half(
    budget, num_decoding, share
):
    mixed = make_scheduler(0, max_prefill_tokens=128, mixed=True)
    rids = tuple(f"d{i}" for i in range(num_decoding))
    if rids:
        start_decoding(mixed, rids)
    mixed.max_prefill_tokens = budget
    assert mixed.prefill_budget(num_decoding) == share
    plain = make_scheduler(0, max_prefill_tokens=budget, mixed=False)
    assert plain.prefill_budget(num_decoding) == budget  # without mixed steps: all of it
    # In a step: the long prompt's chunk is that share, beside every decode row.
    add(mixed, "long", 3 * budget + 5)
    batch = step(mixed)
    assert batch.extend_lens == [share] + [1] * num_decoding
    if num_decoding <= budget // 2:
        assert batch.num_tokens <= budget  # the budget holds, decode rows counted in


@pytest.mark.parametrize("delay", [1, 3])
def test_the_admission_delay_runs_decode_batches_then_one_mixed_step(delay):
    sched = make_scheduler(delay, max_prefill_tokens=64, mixed=True)
    start_decoding(sched)
    new = add(sched, "new", 5)
    for _ in range(delay):
        batch = step(sched)
        assert kind(batch) == "decode" and new.status == RequestStatus.WAITING
    batch = step(sched)
    assert kind(batch) == "mixed" and ids(batch) == {"a", "b", "new"}


def test_the_fill_rule_counts_the_decode_rows():
    """Budget 16 beside 2 decode rows: waiting prompts of 14 tokens fill the step, 13 do not."""
    full = make_scheduler(100, max_prefill_tokens=16, mixed=True)
    start_decoding(full)
    add(full, "x", 9)
    add(full, "y", 5)
    assert kind(step(full)) == "mixed"
    short = make_scheduler(100, max_prefill_tokens=16, mixed=True)
    start_decoding(short)
    add(short, "x", 9)
    add(short, "y", 4)
    assert kind(step(short)) == "decode"


def test_without_pages_for_an_admission_the_step_is_a_decode_batch():
    # 6 usable pages of 4 tokens: a and b hold 2 each; "new" needs 3 more plus a spare page per
    # decoding request, so it waits until they finish.
    sched = make_scheduler(0, max_prefill_tokens=64, num_pages=6, mixed=True)
    a, b = (add(sched, rid, 6, max_tokens=4) for rid in ("a", "b"))
    assert kind(step(sched)) == "prefill"
    new = add(sched, "new", 9, max_tokens=2)
    kinds = [kind(step(sched)) for _ in range(3)]
    assert kinds == ["decode"] * 3 and a.status == b.status == RequestStatus.FINISHED
    assert new.status == RequestStatus.WAITING
    assert [kind(step(sched)) for _ in range(3)] == ["prefill", "decode", "idle"]
    assert_pages_balanced(sched)


def expected_mixed_kind(sched: Scheduler, wait_clock: int, delay: int) -> str:
    """The step kind the mixed policy prescribes (enough pages and request slots assumed):
    a mixed step when something can be admitted (a prefill step when nothing decodes), unless
    requests decode, no prompt is part-way through prefill, the waiting prompts do not fill the
    step's prompt share and the queue has waited fewer than `delay` decode steps."""
    num_decoding = sum(r.is_decoding for r in sched.running)
    partial = any(not r.is_decoding for r in sched.running)
    if not sched.waiting and not partial:
        return "decode" if num_decoding else "idle"
    pending = sum(r.num_pending for r in sched.waiting)
    share = sched.prefill_budget(num_decoding)
    if num_decoding and not partial and pending < share and wait_clock < delay:
        return "decode"
    return "mixed" if num_decoding else "prefill"


@pytest.mark.parametrize(("max_prefill_tokens", "num_pages"), [(24, 512), (1000, 512), (24, 40)])
@pytest.mark.parametrize("delay", [0, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_follow_the_mixed_policy_and_every_request_finishes(
    delay, seed, max_prefill_tokens, num_pages
):
    """Random arrivals (prompts of 1..14 tokens, 1..20 output tokens). With enough pages every
    step has the prescribed kind, carries every decoding request (no decode step is lost),
    keeps the prompt rows within their share, and (with a budget that never runs out) no
    request waits more than `delay` decode steps. With 40 pages requests are preempted. In all
    cases every request finishes with all its tokens and every page comes back."""
    rng = random.Random(seed)
    sched = make_scheduler(
        delay, max_prefill_tokens=max_prefill_tokens, num_pages=num_pages, mixed=True
    )
    roomy = num_pages == 512
    reqs: list[Request] = []
    wait_clock, max_wait, waited = 0, 0, {}
    for t in range(500):
        if t < 250:
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
                if not sched.waiting:
                    wait_clock = 0
                req = add(sched, f"r{len(reqs)}", rng.randint(1, 14), rng.randint(1, 20))
                reqs.append(req)
                waited[req.request_id] = 0
        want = expected_mixed_kind(sched, wait_clock, delay)
        decoding = {r.request_id for r in sched.running if r.is_decoding}
        batch = step(sched)
        if roomy:
            assert kind(batch) == want, f"step {t}"
        if batch is None:
            continue
        if roomy:
            assert decoding <= ids(batch), f"step {t}: a decoding request lost its step"
        assert batch.num_prefill_tokens <= sched.prefill_budget(batch.num_decode_rows)
        if batch.is_decode:
            for req in sched.waiting:
                waited[req.request_id] += 1
                max_wait = max(max_wait, waited[req.request_id])
            if sched.waiting:
                wait_clock += 1
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    if roomy:
        assert sched.num_preemptions == 0
        if max_prefill_tokens == 1000:
            assert max_wait <= delay
    else:
        assert sched.num_preemptions > 0
    assert_pages_balanced(sched)


# ---- configuration -------------------------------------------------------------------------------
def test_mixed_steps_default_on_and_are_read_from_the_environment(tmp_path):
    assert EngineConfig(model="/nonexistent/model").mixed_steps
    assert EngineConfig(model="/nonexistent/model", device="cuda").mixed_steps
    env = {"TRITONLLM_MODEL": str(tmp_path), "TRITONLLM_DEVICE": "cpu"}
    assert engine_config({}, env).mixed_steps
    assert not engine_config({}, {**env, "TRITONLLM_MIXED_STEPS": "false"}).mixed_steps
    assert not engine_config({"mixed_steps": "off"}, env).mixed_steps
    with pytest.raises(ValueError, match="MIXED_STEPS"):
        engine_config({}, {**env, "TRITONLLM_MIXED_STEPS": "sometimes"})


# ---- the engine against transformers -------------------------------------------------------------
MAX_TOKENS = 10
# (engine step at which it arrives, request id, prompt length); max_prefill_tokens is 16.
ARRIVALS = [
    (0, "r0", 6),
    (0, "r1", 3),
    (2, "r2", 9),  # r0 and r1 decode
    (3, "r3", 30),  # chunked beside the decode rows
    (4, "r4", 5),
    (8, "r5", 14),  # r5 and r6 repeat r2's and r3's prompts: prefix-cache hits
    (9, "r6", 22),
    (11, "r7", 1),
]


@functools.cache
def arrival_prompts() -> dict[str, list[int]]:
    ps = prompts([n for _, _, n in ARRIVALS], seed=11)
    ps[5] = ps[2] + ps[5][9:]
    ps[6] = ps[3][:22]
    return {rid: p for (_, rid, _), p in zip(ARRIVALS, ps, strict=True)}


def arrival_reference(rid: str) -> list[int]:
    return hf_greedy_cached(tuple(arrival_prompts()[rid]), MAX_TOKENS)


@functools.cache
def hf_greedy_cached(prompt: tuple[int, ...], max_new: int) -> list[int]:
    return hf_greedy(checkpoint("qwen3"), list(prompt), max_new)[0]


def run_arrivals(engine: LLMEngine, arrivals=ARRIVALS, params=None) -> dict[str, list]:
    """Add each request of `arrivals` at its step; step until all finish. Returns each request's
    outputs; records in `engine.batch_kinds` the kind of every scheduled batch."""
    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    schedule = engine.scheduler.schedule
    engine.batch_kinds = []

    def recording_schedule():
        batch = schedule()
        engine.batch_kinds.append(kind(batch))
        return batch

    engine.scheduler.schedule = recording_schedule
    all_prompts = arrival_prompts()
    outs: dict[str, list] = {}
    t = 0
    while t <= arrivals[-1][0] or engine.has_unfinished():
        for _, rid, _ in (a for a in arrivals if a[0] == t):
            engine.add_request(rid, all_prompts[rid], params)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        t += 1
        assert t < 300, "engine did not finish"
    return outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_arrivals_during_decode_and_chunked_prompts_match_transformers(overlap, prefix_cache):
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint("qwen3"),
            page_size=4,
            num_pages=256,
            max_prefill_tokens=16,
            enable_prefix_cache=prefix_cache,
            overlap_schedule=overlap,
        )
    )
    assert engine.scheduler.mixed_steps
    outs = run_arrivals(engine)
    for rid in arrival_prompts():
        assert [t for o in outs[rid] for t in o.new_token_ids] == arrival_reference(rid), rid
        assert outs[rid][-1].finish_reason == "length"
    stats = engine.stats()
    assert stats.num_mixed_steps >= 4 and "mixed" in engine.batch_kinds
    assert "decode" in engine.batch_kinds  # decode-only steps remain between arrivals
    # r3's 30 tokens run in back-to-back mixed steps (16 - decode rows each).
    cached = {rid: outs[rid][-1].cached_tokens for rid in ("r5", "r6")}
    if prefix_cache:
        assert cached == {"r5": 8, "r6": 20}  # whole pages of r2's and r3's prompts
    else:
        assert cached == {"r5": 0, "r6": 0}
    assert stats.num_running == stats.num_waiting == 0
    assert stats.free_pages + stats.evictable_pages == stats.total_pages


DELAY_ARRIVALS = [
    (0, "r0", 12),
    (0, "r1", 5),
    (3, "r2", 7),
    (5, "r3", 9),
    (6, "r4", 3),
    (6, "r5", 11),
    (9, "r6", 40),
    (15, "r7", 6),
]


@pytest.mark.parametrize("delay", [0, 4])
def test_admission_delay_with_mixed_steps_keeps_the_greedy_ids(delay):
    """The arrivals of `test_scheduler_delay`'s engine test (budget 32), with mixed steps."""
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint("qwen3"),
            page_size=4,
            num_pages=256,
            max_prefill_tokens=32,
            prefill_delay_steps=delay,
        )
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ps = prompts([n for _, _, n in DELAY_ARRIVALS], seed=3)
    all_prompts = {rid: p for (_, rid, _), p in zip(DELAY_ARRIVALS, ps, strict=True)}
    first: dict[str, int] = {}
    got: dict[str, list[int]] = {rid: [] for rid in all_prompts}
    t = 0
    while t <= DELAY_ARRIVALS[-1][0] or engine.has_unfinished():
        for _, rid, _ in (a for a in DELAY_ARRIVALS if a[0] == t):
            engine.add_request(rid, all_prompts[rid], params)
        for o in engine.step():
            if o.new_token_ids:
                first.setdefault(o.request_id, t)
            got[o.request_id] += o.new_token_ids
        t += 1
    for rid, prompt in all_prompts.items():
        assert got[rid] == hf_greedy_cached(tuple(prompt), 12), rid
    if delay == 0:
        # Every arrival joins the next step (no decode step first: its decode rows ride along);
        # r6's 40 tokens: 26 beside 6 decode rows, then 14.
        expected = {"r2": 3, "r3": 5, "r4": 6, "r5": 6, "r6": 10, "r7": 15}
    else:
        # r2..r5 wait until their 30 tokens fill the share beside r0 and r1 (32 - 2), at step
        # 6; r6 fills one at once; r7 waits 4 decode steps (15..18).
        expected = {"r2": 6, "r3": 6, "r4": 6, "r5": 6, "r6": 10, "r7": 19}
    assert first == {"r0": 0, "r1": 0, **expected}


@pytest.mark.parametrize(("num_pages", "budget"), [(512, 12), (30, 7)])
def test_mixed_steps_on_and_off_give_identical_outputs_for_every_sampling_path(num_pages, budget):
    """Seeded sampling, penalties, logprobs, n > 1, stop tokens and min_tokens, chunked prompts
    (and with 30 pages of 4, preemption): mixed steps with overlap scheduling against neither."""
    model = checkpoint("qwen3")
    common = dict(num_pages=num_pages, max_prefill_tokens=budget, device="cpu")
    plain = _engine(model, mixed_steps=False, overlap_schedule=False, **common)
    work = mixed_workload(output_ids(run_all(plain, mixed_workload())))
    expected = run_all(plain, work)
    assert plain.stats().num_mixed_steps == 0
    mixed = _engine(model, mixed_steps=True, overlap_schedule=True, **common)
    got = run_all(mixed, work)
    assert_same_outputs(got, expected, 1e-4)
    stats = mixed.stats()
    assert stats.num_mixed_steps > 0
    if num_pages == 30:
        assert stats.num_preemptions > 0
    assert stats.free_pages + stats.evictable_pages == stats.total_pages


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_mixed_steps_through_the_triton_backend_give_the_torch_backends_greedy_ids():
    """The triton backend's extend kernel (Triton's interpreter on CPU) with a mixed batch's
    one-token rows beside prompt chunks, against the torch backend without mixed steps."""
    pytest.importorskip("triton")
    if not kernels.interpreting():
        pytest.skip("CPU runs need Triton's interpreter (TRITON_INTERPRET=1)")
    work = {
        f"t{i}": (p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts([3, 13, 5], seed=5))
    }
    common = dict(device="cpu", max_prefill_tokens=6)
    reference = _engine(checkpoint("qwen3"), attention_backend="torch", mixed_steps=False, **common)
    expected = output_ids(run_all(reference, work))
    engine = _engine(checkpoint("qwen3"), attention_backend="triton", mixed_steps=True, **common)
    assert output_ids(run_all(engine, work)) == expected
    assert engine.stats().num_mixed_steps > 0


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("triton", "float32"), pytest.param("flashinfer", "bfloat16", marks=needs_flashinfer)],
)
def test_mixed_steps_with_cuda_graphs_and_overlap_give_the_same_greedy_ids(backend, dtype):
    """Greedy requests (top-2 logprobs for the margins, stop tokens, min_tokens) on a 40-page
    pool with a 9-token budget, so that the longer prompts are chunked while the first ones
    decode: decode-only steps replay graphs, mixed steps run eagerly; float32 ids are identical,
    bfloat16 ids up to a sub-resolution margin."""
    common = dict(
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        cuda_graph=True,
        cuda_graph_max_bs=16,
        overlap_schedule=True,
        num_pages=40,
        max_prefill_tokens=9,
    )
    model = checkpoint_hd128()
    plain = _engine(model, mixed_steps=False, **common)
    work = greedy_workload(output_ids(run_all(plain, greedy_workload())))
    expected = run_all(plain, work)
    _release(plain)
    mixed = _engine(model, mixed_steps=True, **common)
    got = run_all(mixed, work)
    if dtype == "float32":
        assert output_ids(got) == output_ids(expected)
    else:
        assert assert_same_until_low_margin(got, expected, BF16_GAP) >= 20
    stats = mixed.stats()
    assert stats.num_mixed_steps > 0 and mixed.runner.graph_runner.num_replays > 0
    assert stats.free_pages + stats.evictable_pages == stats.total_pages
    _release(mixed)
