"""Admission delay of the continuous-batching scheduler (`prefill_delay_steps`).

While requests decode, new waiting requests wait up to `prefill_delay_steps` decode steps so
that arrivals share one prefill step. The wait ends early when the waiting prompts fill a
prefill batch (`max_prefill_tokens`) or when nothing decodes, and a prompt part-way through
chunked prefill is never held back. With a delay of 0 the scheduler behaves as before: prefill
whenever something can be admitted, but never two prefill steps in a row while requests decode.

Without mixed steps (`Scheduler(mixed_steps=False)`, `EngineConfig(mixed_steps=False)`): the
alternation of prefill and decode steps; `test_mixed_steps.py` has the policy with them.
"""

from __future__ import annotations

import itertools
import random

import pytest
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

from tritonllm.config import CUDA_PREFILL_DELAY_STEPS, EngineConfig
from tritonllm.engine import LLMEngine
from tritonllm.engine.request import Request, RequestStatus
from tritonllm.engine.scheduler import Scheduler
from tritonllm.sampling_params import SamplingParams
from tritonllm.triton_config import engine_config


# ---- the delay --------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [0, 1, 3])
def test_new_request_waits_delay_decode_steps_then_prefills(delay):
    sched = make_scheduler(delay)
    decoding = start_decoding(sched)
    new = add(sched, "new", 5)
    for i in range(delay):
        batch = step(sched)
        assert kind(batch) == "decode", f"step {i} of the delay"
        assert ids(batch) == {"a", "b"} and new.status == RequestStatus.WAITING
    batch = step(sched)
    assert kind(batch) == "prefill" and ids(batch) == {"new"}
    assert batch.extend_lens == [5] and new.status == RequestStatus.RUNNING
    # Then the usual alternation: a decode step for everyone, the new request included.
    batch = step(sched)
    assert kind(batch) == "decode" and ids(batch) == {"a", "b", "new"}
    assert all(r.num_output_tokens == 2 + delay + 1 for r in decoding)
    assert new.num_output_tokens == 2


@pytest.mark.parametrize("delay", [1, 3])
def test_the_mandatory_decode_after_a_prefill_counts_toward_the_delay(delay):
    """A request that arrives just after a prefill waits `delay` decode steps in all, the
    decode step that must follow the prefill being the first of them."""
    sched = make_scheduler(delay)
    add(sched, "a", 6)
    assert kind(step(sched)) == "prefill"
    add(sched, "new", 5)
    kinds = [kind(step(sched)) for _ in range(delay + 1)]
    assert kinds == ["decode"] * delay + ["prefill"]


def test_arrivals_during_the_delay_share_one_prefill_step():
    sched = make_scheduler(3, max_prefill_tokens=64)
    start_decoding(sched)
    add(sched, "x", 3)
    assert kind(step(sched)) == "decode"
    add(sched, "y", 4)
    assert kind(step(sched)) == "decode"
    add(sched, "z", 2)
    assert kind(step(sched)) == "decode"
    # The delay runs from the first arrival: all three join one prefill step now.
    batch = step(sched)
    assert kind(batch) == "prefill" and ids(batch) == {"x", "y", "z"}
    assert sorted(batch.extend_lens) == [2, 3, 4]


def test_delay_zero_admits_at_the_next_step_unless_a_prefill_just_ran():
    """The old behaviour: prefill at once when the last step was a decode step, and one decode
    step first when it was a prefill step."""
    sched = make_scheduler(0)
    start_decoding(sched)
    add(sched, "x", 3)
    batch = step(sched)
    assert kind(batch) == "prefill" and ids(batch) == {"x"}
    add(sched, "y", 3)
    assert [kind(step(sched)) for _ in range(2)] == ["decode", "prefill"]


@pytest.mark.parametrize("prompt_lens", [[16], [9, 7], [4, 4, 4, 5]])
def test_waiting_prompts_that_fill_a_prefill_batch_are_admitted_without_waiting(prompt_lens):
    sched = make_scheduler(100, max_prefill_tokens=16)
    start_decoding(sched)
    reqs = [add(sched, f"w{i}", n) for i, n in enumerate(prompt_lens)]
    batch = step(sched)
    assert kind(batch) == "prefill"
    assert ids(batch) == {r.request_id for r in reqs}
    assert batch.num_tokens == 16  # the last prompt may be cut (chunked prefill)


def test_waiting_prompts_one_token_short_of_a_batch_still_wait():
    sched = make_scheduler(3, max_prefill_tokens=16)
    start_decoding(sched)
    add(sched, "x", 8)
    add(sched, "y", 7)
    assert [kind(step(sched)) for _ in range(3)] == ["decode"] * 3
    # A late arrival fills the batch: the wait ends at once.
    sched2 = make_scheduler(3, max_prefill_tokens=16)
    start_decoding(sched2)
    add(sched2, "x", 8)
    add(sched2, "y", 7)
    assert kind(step(sched2)) == "decode"
    add(sched2, "z", 1)
    batch = step(sched2)
    assert kind(batch) == "prefill" and ids(batch) == {"x", "y", "z"}


def test_nothing_decoding_admits_at_once_even_with_a_large_delay():
    sched = make_scheduler(1000)
    first = add(sched, "a", 6, max_tokens=3)
    batch = step(sched)
    assert kind(batch) == "prefill" and ids(batch) == {"a"}
    # A request that waits while "a" decodes is admitted as soon as "a" finishes.
    add(sched, "b", 5)
    assert kind(step(sched)) == "decode"  # a's 2nd token
    assert kind(step(sched)) == "decode"  # a's 3rd and last token
    assert first.status == RequestStatus.FINISHED and not sched.running
    batch = step(sched)
    assert kind(batch) == "prefill" and ids(batch) == {"b"}


def test_only_partly_prefilled_requests_running_do_not_delay_admission():
    """A request part-way through its prompt is running but not decoding: nothing decodes, so
    a new arrival is admitted at once (with the chunk's leftover budget)."""
    sched = make_scheduler(1000, max_prefill_tokens=16)
    long = add(sched, "long", 20)
    batch = step(sched)
    assert kind(batch) == "prefill" and batch.extend_lens == [16]
    add(sched, "short", 3)
    batch = step(sched)
    assert kind(batch) == "prefill" and ids(batch) == {"long", "short"}
    assert batch.extend_lens == [4, 3] and long.is_decoding


def test_a_chunked_prompt_continues_after_the_decode_step_without_waiting():
    sched = make_scheduler(1000, max_prefill_tokens=16)
    start_decoding(sched)
    long = add(sched, "long", 40)  # 40 >= 16: admitted at once, in chunks of 16, 16, 8
    plan = []
    for _ in range(6):
        batch = step(sched)
        plan.append((kind(batch), batch.extend_lens if not batch.is_decode else None))
    assert plan == [
        ("prefill", [16]),
        ("decode", None),
        ("prefill", [16]),
        ("decode", None),
        ("prefill", [8]),
        ("decode", None),
    ]
    assert long.is_decoding and long.num_output_tokens == 2


def test_the_delay_restarts_for_the_next_arrival():
    delay = 3
    sched = make_scheduler(delay)
    start_decoding(sched)
    add(sched, "x", 3)
    kinds = [kind(step(sched)) for _ in range(delay + 2)]
    assert kinds == ["decode"] * delay + ["prefill", "decode"]
    assert not sched.waiting
    add(sched, "y", 3)
    kinds = [kind(step(sched)) for _ in range(delay + 1)]
    assert kinds == ["decode"] * delay + ["prefill"]
    # And again for an arrival right after that prefill (its decode step counts).
    add(sched, "z", 3)
    kinds = [kind(step(sched)) for _ in range(delay + 1)]
    assert kinds == ["decode"] * delay + ["prefill"]


def test_a_request_admitted_early_by_a_full_batch_resets_the_delay():
    """The fill rule admits everything waiting; the next lone arrival waits the full delay."""
    delay = 3
    sched = make_scheduler(delay, max_prefill_tokens=16)
    start_decoding(sched)
    add(sched, "x", 5)
    assert kind(step(sched)) == "decode"
    add(sched, "y", 11)  # 5 + 11 = 16 fills the batch
    assert kind(step(sched)) == "prefill"
    add(sched, "z", 3)
    kinds = [kind(step(sched)) for _ in range(delay + 1)]
    assert kinds == ["decode"] * delay + ["prefill"]


def test_a_decode_step_with_an_empty_queue_resets_the_delay():
    """A waiting request aborted part-way through its delay: once a decode step has run with
    nothing waiting, the next arrival waits the full delay again."""
    delay = 4
    sched = make_scheduler(delay)
    start_decoding(sched)
    gone = add(sched, "gone", 3)
    assert [kind(step(sched)) for _ in range(3)] == ["decode"] * 3
    sched.abort(gone)
    assert kind(step(sched)) == "decode"
    add(sched, "x", 3)
    kinds = [kind(step(sched)) for _ in range(delay + 1)]
    assert kinds == ["decode"] * delay + ["prefill"]


def test_an_arrival_right_after_the_waiting_requests_were_aborted_waits_the_full_delay():
    """Aborting every waiting request restarts the delay at once: a request added before the
    next step does not inherit the aborted requests' wait."""
    delay = 4
    sched = make_scheduler(delay)
    start_decoding(sched)
    gone = add(sched, "gone", 3)
    assert [kind(step(sched)) for _ in range(3)] == ["decode"] * 3
    sched.abort(gone)
    add(sched, "x", 3)
    kinds = [kind(step(sched)) for _ in range(delay + 1)]
    assert kinds == ["decode"] * delay + ["prefill"]


# ---- random traces against the policy -----------------------------------------------------------
def expected_kind(sched: Scheduler, last_kind: str, wait_clock: int, delay: int) -> str:
    """The step kind the policy prescribes (enough pages and request slots assumed):
    prefill when something can be admitted, unless the last step was a prefill and requests
    decode, or requests decode, no prompt is part-way through prefill, the waiting prompts do
    not fill a batch and the waiting queue has been non-empty for fewer than `delay` decode
    steps (`wait_clock`)."""
    decoding = any(r.is_decoding for r in sched.running)
    partial = any(not r.is_decoding for r in sched.running)
    if not sched.waiting and not partial:
        return "decode" if decoding else "idle"
    if last_kind == "prefill" and decoding:
        return "decode"
    pending = sum(r.num_pending for r in sched.waiting)
    if decoding and not partial and pending < sched.max_prefill_tokens and wait_clock < delay:
        return "decode"
    return "prefill"


@pytest.mark.parametrize("max_prefill_tokens", [24, 1000])
@pytest.mark.parametrize("delay", [0, 2, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_follow_the_policy_and_every_request_finishes(
    delay, seed, max_prefill_tokens
):
    """Random arrivals (prompts of 1..14 tokens, 1..20 output tokens): every step has the kind
    the policy prescribes and every request finishes. With a prefill budget that never runs
    out, no request waits more than `delay` decode steps (1 at delay 0: the decode step after
    a prefill); with a budget of 24 tokens, requests behind a full batch may wait longer."""
    rng = random.Random(seed)
    sched = make_scheduler(delay, max_prefill_tokens=max_prefill_tokens)
    reqs: list[Request] = []
    last_kind, wait_clock = "idle", 0
    max_wait = 0  # most decode steps any request waited for its admission
    waited: dict[str, int] = {}
    for t in range(400):
        if t < 250:
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
                if not sched.waiting:
                    wait_clock = 0
                req = add(sched, f"r{len(reqs)}", rng.randint(1, 14), rng.randint(1, 20))
                reqs.append(req)
                waited[req.request_id] = 0
        want = expected_kind(sched, last_kind, wait_clock, delay)
        batch = step(sched)
        assert kind(batch) == want, f"step {t}"
        last_kind = kind(batch)
        if last_kind == "decode":
            for req in sched.waiting:
                waited[req.request_id] += 1
                max_wait = max(max_wait, waited[req.request_id])
            if sched.waiting:
                wait_clock += 1
    assert sched.num_preemptions == 0
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    if max_prefill_tokens == 1000:
        assert max_wait <= max(delay, 1)  # 1: the decode step after a prefill
        if delay > 1:
            assert max_wait == delay  # some request did wait the full delay
    assert_pages_balanced(sched)


# ---- configuration -------------------------------------------------------------------------------
def test_engine_config_default_delay_depends_on_the_device():
    cpu = EngineConfig(model="/nonexistent/model")
    assert cpu.prefill_delay_steps == 0
    for device in ("cuda", "cuda:1"):
        cuda = EngineConfig(model="/nonexistent/model", device=device)
        assert cuda.prefill_delay_steps == CUDA_PREFILL_DELAY_STEPS == 8
        assert "model_config" not in cuda.__dict__  # the model directory was never read
    explicit = EngineConfig(model="/nonexistent/model", device="cuda", prefill_delay_steps=0)
    assert explicit.prefill_delay_steps == 0
    assert EngineConfig(model="/nonexistent/model", prefill_delay_steps=3).prefill_delay_steps == 3


def test_engine_config_default_prefill_budget_depends_on_the_device():
    from tritonllm.config import CPU_MAX_PREFILL_TOKENS, CUDA_MAX_PREFILL_TOKENS

    assert EngineConfig(model="/nonexistent/model").max_prefill_tokens == CPU_MAX_PREFILL_TOKENS
    assert CPU_MAX_PREFILL_TOKENS == 512  # short CPU steps: a long prompt holds up nothing
    cuda = EngineConfig(model="/nonexistent/model", device="cuda")
    assert cuda.max_prefill_tokens == CUDA_MAX_PREFILL_TOKENS == 16384
    explicit = EngineConfig(model="/nonexistent/model", device="cuda", max_prefill_tokens=512)
    assert explicit.max_prefill_tokens == 512
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        EngineConfig(model="/nonexistent/model", max_prefill_tokens=0)
    config = engine_config({}, {"TRITONLLM_MAX_PREFILL_TOKENS": "4096", "TRITONLLM_DEVICE": "cpu"})
    assert config.max_prefill_tokens == 4096


def test_engine_config_rejects_a_negative_or_unbounded_delay():
    from tritonllm.config import MAX_PREFILL_DELAY_STEPS

    with pytest.raises(ValueError, match="prefill_delay_steps"):
        EngineConfig(model="/nonexistent/model", prefill_delay_steps=-1)
    with pytest.raises(ValueError, match="prefill_delay_steps"):
        EngineConfig(model="/nonexistent/model", device="cuda", prefill_delay_steps=-3)
    with pytest.raises(ValueError, match=f"0..{MAX_PREFILL_DELAY_STEPS}"):
        EngineConfig(model="/nonexistent/model", prefill_delay_steps=10**20)
    config = EngineConfig(model="/nonexistent/model", prefill_delay_steps=MAX_PREFILL_DELAY_STEPS)
    assert config.prefill_delay_steps == MAX_PREFILL_DELAY_STEPS


def test_delay_is_read_from_the_environment_and_the_parameters(tmp_path):
    env = {"TRITONLLM_MODEL": str(tmp_path), "TRITONLLM_DEVICE": "cpu"}
    assert engine_config({}, env).prefill_delay_steps == 0
    assert engine_config({}, {**env, "TRITONLLM_PREFILL_DELAY_STEPS": "5"}).prefill_delay_steps == 5
    params = {"prefill_delay_steps": "2"}
    assert engine_config(params, env).prefill_delay_steps == 2
    config = engine_config(params, {**env, "TRITONLLM_PREFILL_DELAY_STEPS": "5"})
    assert config.prefill_delay_steps == 5  # the environment wins
    cuda = {**env, "TRITONLLM_DEVICE": "cuda", "TRITONLLM_PREFILL_DELAY_STEPS": "none"}
    assert engine_config({}, cuda).prefill_delay_steps == CUDA_PREFILL_DELAY_STEPS
    with pytest.raises(ValueError, match="PREFILL_DELAY_STEPS"):
        engine_config({}, {**env, "TRITONLLM_PREFILL_DELAY_STEPS": "soon"})
    with pytest.raises(ValueError, match="prefill_delay_steps"):
        engine_config({}, {**env, "TRITONLLM_PREFILL_DELAY_STEPS": "-1"})


# ---- end to end ------------------------------------------------------------------------------------
MAX_TOKENS = 12
# (engine step at which it arrives, request id, prompt length); max_prefill_tokens is 32.
ARRIVALS = [
    (0, "r0", 12),
    (0, "r1", 5),
    (3, "r2", 7),  # r0 and r1 decode
    (5, "r3", 9),
    (6, "r4", 3),
    (6, "r5", 11),
    (9, "r6", 40),  # longer than a prefill batch: admitted at once, in two chunks
    (15, "r7", 6),
]


def run_engine(delay: int) -> tuple[dict[str, list[int]], dict[str, int], LLMEngine]:
    """Run `ARRIVALS` through a CPU engine with `prefill_delay_steps=delay`; returns each
    request's generated ids, the step of its first token, and the engine."""
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint("qwen3"),
            page_size=4,
            num_pages=256,
            max_prefill_tokens=32,
            prefill_delay_steps=delay,
            mixed_steps=False,
        )
    )
    assert engine.scheduler.prefill_delay_steps == delay
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lengths = [length for _, _, length in ARRIVALS]
    all_prompts = {
        rid: p for (_, rid, _), p in zip(ARRIVALS, prompts(lengths, seed=3), strict=True)
    }
    out: dict[str, list[int]] = {rid: [] for rid in all_prompts}
    first_step: dict[str, int] = {}
    finished: set[str] = set()
    for t in itertools.count():
        for _, rid, _ in (a for a in ARRIVALS if a[0] == t):
            engine.add_request(rid, all_prompts[rid], params)
        if t > ARRIVALS[-1][0] and not engine.has_unfinished():
            break
        for o in engine.step():
            if o.new_token_ids:
                first_step.setdefault(o.request_id, t)
            out[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.finish_reason == "length" and o.num_output_tokens == MAX_TOKENS
                finished.add(o.request_id)
        assert t < 200, "engine did not finish"
    assert finished == set(all_prompts)
    return out, first_step, engine


def test_engine_with_delay_generates_the_same_greedy_ids_and_batches_prefills():
    delayed, delayed_first, delayed_engine = run_engine(4)
    eager, eager_first, eager_engine = run_engine(0)
    assert all(len(ids) == MAX_TOKENS for ids in delayed.values())
    assert delayed == eager
    all_prompts = prompts([a[2] for a in ARRIVALS], seed=3)
    for (_, rid, _), prompt in zip(ARRIVALS, all_prompts, strict=True):
        assert delayed[rid] == hf_greedy(checkpoint("qwen3"), prompt, MAX_TOKENS)[0], rid
    # Delay 0: r2 at once, r3 at once (the last step was a decode), r4/r5 after the decode
    # step that follows r3's prefill, r6's chunks at 9 and 11, r7 at once.
    assert eager_first == {"r0": 0, "r1": 0, "r2": 3, "r3": 5, "r4": 7, "r5": 7, "r6": 11, "r7": 15}
    # Delay 4: r2..r5 wait for decode steps 3..6 and share the prefill of step 7; r6 fills a
    # batch (chunks at 9 and 11); r7 arrives while r6 decodes and waits 15..18.
    assert delayed_first == {
        "r0": 0, "r1": 0, "r2": 7, "r3": 7, "r4": 7, "r5": 7, "r6": 11, "r7": 19,
    }  # fmt: skip
    assert delayed_engine.stats().num_prefill_steps < eager_engine.stats().num_prefill_steps
    for engine in (delayed_engine, eager_engine):
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.free_pages + stats.evictable_pages == stats.total_pages
