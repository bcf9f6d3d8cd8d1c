"""Helpers for the scheduler tests (no tests here): a `Scheduler` over a fresh page pool, and
the engine's part played after each step.

The scheduler tests drive a `Scheduler` directly and play the engine's part after each step
(`advance`): `num_computed` grows by the extend lengths, each request that reaches the end of
its tokens gets a sampled id, prefilled prompts enter the radix cache, and requests that reach
`max_tokens` finish.
"""

from __future__ import annotations

import itertools

from test_engine_helpers import prompts

from tritonllm.engine.cache_manager import CacheManager
from tritonllm.engine.radix_cache import RadixCache
from tritonllm.engine.request import Request
from tritonllm.engine.scheduler import ScheduledBatch, Scheduler
from tritonllm.sampling_params import SamplingParams

PAGE_SIZE = 4
SAMPLED_ID = 5  # the id the simulated engine "samples" (any valid id will do)
_arrivals = itertools.count()
_prompt_seeds = itertools.count(100)


def make_scheduler(
    delay: int,
    max_prefill_tokens: int = 16,
    num_pages: int = 512,
    max_running: int = 64,
    mixed: bool = False,
) -> Scheduler:
    """A scheduler over a fresh page pool (`num_pages` usable pages of `PAGE_SIZE` tokens) with
    a radix cache, as `LLMEngine` builds it; `mixed`: mixed prefill/decode steps."""
    cache = CacheManager(1 + num_pages, PAGE_SIZE, RadixCache(PAGE_SIZE), max_running + 1)
    return Scheduler(
        cache,
        max_running_requests=max_running,
        max_prefill_tokens=max_prefill_tokens,
        prefill_delay_steps=delay,
        mixed_steps=mixed,
    )


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 1000) -> Request:
    """Queue a new greedy request `rid` with a random prompt of `prompt_len` tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = prompts([prompt_len], seed=next(_prompt_seeds))[0]
    req = Request(rid, prompt, params, arrival=next(_arrivals), stop_ids=frozenset())
    sched.add(req)
    return req


def advance(sched: Scheduler, batch: ScheduledBatch) -> None:
    """Play the engine's part for a scheduled `batch` (`LaunchedStep.commit` +
    `LLMEngine._process`): advance `num_computed` by the extend lengths, append a sampled id
    to each request that reaches the end of its tokens, cache the prefix of prefilled ones and
    finish those that reached `max_tokens`."""
    sampling = [(i, req) for i, req in enumerate(batch.reqs) if batch.samples(i)]
    for req, ext in zip(batch.reqs, batch.extend_lens, strict=True):
        req.num_computed += ext
    for i, req in sampling:
        req.token_ids.append(SAMPLED_ID)
        if i < batch.num_prefill_rows:
            sched.cache.cache_prefix(req)
        if req.num_output_tokens >= req.params.max_tokens:
            sched.abort(req)  # what the engine does for a finished request


def step(sched: Scheduler) -> ScheduledBatch | None:
    """Schedule one step and apply it (see `advance`); returns the batch."""
    batch = sched.schedule()
    if batch is not None:
        advance(sched, batch)
    return batch


def kind(batch: ScheduledBatch | None) -> str:
    """The batch's kind: "prefill", "mixed", "decode" or "idle" (no batch)."""
    if batch is None:
        return "idle"
    if batch.is_decode:
        return "decode"
    return "mixed" if batch.is_mixed else "prefill"


def ids(batch: ScheduledBatch) -> set[str]:
    """The request ids in `batch`."""
    return {r.request_id for r in batch.reqs}


def start_decoding(sched: Scheduler, rids: tuple[str, ...] = ("a", "b")) -> list[Request]:
    """Admit requests `rids` (nothing decodes yet, so at once) and run one decode step, so
    they are decoding and the last step was a decode step."""
    reqs = [add(sched, rid, 6) for rid in rids]
    first = step(sched)
    assert kind(first) == "prefill" and ids(first) == set(rids)
    assert kind(step(sched)) == "decode"
    assert all(r.is_decoding for r in reqs)
    return reqs


def assert_pages_balanced(sched: Scheduler) -> None:
    """With nothing running, every page is free or held (unlocked) by the radix cache."""
    assert not sched.running and not sched.waiting
    assert sched.cache.num_available_pages == sched.cache.num_usable_pages
