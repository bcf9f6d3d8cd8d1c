"""Continuous batching: which requests run in the next step, and their KV pages.

Policy (one batch kind per step, like mini-sglang):

- A step is either a *prefill/extend* batch (new prompts, prompt chunks, recomputation of
  preempted requests) or a *decode* batch (every decoding request adds one token).
- Prefill is preferred while requests can be admitted, so new requests get a low TTFT, but
  never twice in a row when requests are decoding: after a prefill step, a decode step runs,
  so running requests advance at least every other step.
- Admission delay (`prefill_delay_steps`, 0 = off): while requests decode, new requests may
  wait up to that many decode steps so that arrivals batch into fewer, larger prefill steps.
  A prefill step that is not a CUDA graph costs about the same host time whatever its size
  (`benchmarks/prefill_host.py`), so under a steady trickle of arrivals one prefill per
  arrival starves the decode steps (BENCHMARKS.md, "Host time of an eager prefill step" and
  "Online: one eager prefill step per arrival starved the decode steps").
  The wait ends early when the waiting prompts fill a prefill batch (`max_prefill_tokens`),
  when nothing decodes, and never holds back a prompt that is part-way through chunked
  prefill. The idea is vLLM's `scheduler_delay_factor`
  (delay the next prompt batch by a multiple of the last prompt latency), counted in steps.
- A prefill batch takes at most `max_prefill_tokens` tokens (chunked prefill). Requests that
  are part-way through their prompt go first, then the waiting queue in FIFO order; a long
  prompt is split and continues in later prefill steps.
- A request that scores its prompt (prompt logprobs, `engine/prompt_logprobs.py`) takes no
  prefix from the prefix cache, and the chunks of such requests add up to at most
  `MAX_SCORED_TOKENS_PER_STEP` tokens per step (each of their tokens computes logits).
- Admission needs free pages for the scheduled chunk (after evicting unreferenced prefix-cache
  pages), plus one spare page per decoding request, so that decodes crossing a page boundary
  rarely have to preempt. Admission stops at the first request that does not fit (FIFO, no
  overtaking) or at `max_running_requests`.
- A decode that crosses a page boundary takes one page. If none is left even after
  eviction, the newest running request is preempted: its computed pages go to the prefix cache
  (or are freed), and it returns to the front of the waiting queue, to be recomputed later
  with its generated tokens appended to the prompt (mostly from the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from tritonllm.engine.cache_manager import CacheManager, HostPageTable
from tritonllm.engine.prompt_logprobs import MAX_SCORED_TOKENS_PER_STEP
from tritonllm.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step's work: `reqs[i]` runs `extend_lens[i]` new tokens starting at its
    `num_computed`. `is_decode`: all extend lens are 1 and every request samples.
    `page_table`: the cache manager's host mirror of the requests' pages."""

    reqs: list[Request]
    extend_lens: list[int]
    is_decode: bool
    page_table: HostPageTable

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def samples(self, i: int) -> bool:
        """Whether request i reaches the end of its tokens this step (so it samples)."""
        return self.reqs[i].num_computed + self.extend_lens[i] == len(self.reqs[i].token_ids)


class Scheduler:
    """Owns the waiting queue and the running set; asks `cache` for every KV page.

    Args:
        cache: the cache manager (pages, prefix cache, page table).
        max_running_requests: most requests admitted at once.
        max_prefill_tokens: the token budget of a prefill/extend step.
        prefill_delay_steps: the admission delay (decode steps; module docstring).
    """

    def __init__(
        self,
        cache: CacheManager,
        max_running_requests: int,
        max_prefill_tokens: int,
        prefill_delay_steps: int = 0,
    ) -> None:
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._last_was_prefill = False
        self.prefill_delay_steps = prefill_delay_steps
        self._waited_steps = 0  # decode steps run while new requests waited (admission delay)
        self.num_preemptions = 0

    @property
    def page_table(self) -> HostPageTable:
        """The requests' page rows (the cache manager's), which each batch carries."""
        return self.cache.page_table

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        """Drop `req` wherever it is; its pages are released at once."""
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
            if not self.waiting:
                self._waited_steps = 0  # the next arrival waits its full admission delay
        elif req.status == RequestStatus.RUNNING:
            self.finish(req)
        req.status = RequestStatus.FINISHED

    def finish(self, req: Request) -> None:
        """Remove a running request and release its pages (full pages go to the prefix
        cache)."""
        self.cache.release(req)
        self.running.remove(req)
        req.status = RequestStatus.FINISHED

    # ---- step planning -----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Plan the next step (see the module docstring); None when there is nothing to run."""
        decoding = [r for r in self.running if r.is_decoding]
        partial = len(decoding) < len(self.running)
        has_prefills = bool(self.waiting) or partial
        if (
            has_prefills
            and not (self._last_was_prefill and decoding)
            and not (decoding and not partial and self._delays_admission())
        ):
            batch = self._schedule_prefill()
            if batch is not None:
                self._last_was_prefill = True
                if not self.waiting:
                    self._waited_steps = 0
                return batch
        self._last_was_prefill = False
        batch = self._schedule_decode(decoding) if decoding else None
        if batch is not None:
            self._waited_steps = self._waited_steps + 1 if self.waiting else 0
        if batch is None and has_prefills:
            # Decodes were all preempted (or none existed): use the step for prefill.
            batch = self._schedule_prefill()
            if batch is not None and not self.waiting:
                self._waited_steps = 0
        return batch

    def _delays_admission(self) -> bool:
        """Whether the waiting requests should wait for another decode step (admission delay,
        see the module docstring): fewer than `prefill_delay_steps` decode steps have run since
        they started waiting and their prompts do not fill a prefill batch."""
        if self._waited_steps >= self.prefill_delay_steps:
            return False
        pending = 0
        for req in self.waiting:
            pending += req.num_pending
            if pending >= self.max_prefill_tokens:
                return False
        return True

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_prefill_tokens
        reqs: list[Request] = []
        extends: list[int] = []
        num_decoding = sum(r.is_decoding for r in self.running)
        partial = sorted((r for r in self.running if not r.is_decoding), key=lambda r: r.arrival)
        scored = MAX_SCORED_TOKENS_PER_STEP  # the logits rows left for scoring requests
        for req in partial:
            if budget == 0:
                break
            extend = min(req.num_pending, budget)
            if req.scores_prompt:
                extend = min(extend, scored)
                if extend == 0:
                    continue
                scored -= extend
            if not self.cache.grow(req, req.num_computed + extend, reserve=0):
                # No overtaking: new requests must not take the pages this one waits for.
                budget = 0
                break
            reqs.append(req)
            extends.append(extend)
            budget -= extend
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            extend = min(req.num_pending, budget)
            if req.scores_prompt:  # every prompt position must run: no cached prefix
                extend = min(extend, scored)
                if extend == 0:
                    break
                scored -= extend
            else:
                self.cache.match_prefix(req)
                extend = min(req.num_pending, budget)
            if not self.cache.grow(req, req.num_computed + extend, reserve=num_decoding):
                self.cache.release(req)
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if not req.admitted_once:
                req.cached_tokens = req.num_computed
                req.admitted_once = True
                req.scheduled_time = time.monotonic()
            reqs.append(req)
            extends.append(extend)
            budget -= extend
        if not reqs:
            return None
        return ScheduledBatch(reqs, extends, is_decode=False, page_table=self.page_table)

    def _schedule_decode(self, decoding: list[Request]) -> ScheduledBatch | None:
        """Give each decoding request the slot of its next token (oldest first, preempting the
        newest when pages run out); `decoding` are the running requests that decode."""
        ps = self.cache.page_size
        kept: list[Request] = []
        for req in sorted(decoding, key=attrgetter("arrival")):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted to make room for an older request
            if req.num_computed < len(req.pages) * ps:
                kept.append(req)  # the usual case: its last page has room for the token
                continue
            while not self.cache.grow(req, req.num_computed + 1, reserve=0):
                victim = max(self.running, key=attrgetter("arrival"))
                self.preempt(victim)
                if victim is req:
                    break
                if victim in kept:
                    kept.remove(victim)
            if req.status == RequestStatus.RUNNING:
                kept.append(req)
        if not kept:
            return None
        # Longest context first (ties: oldest first). Attention kernels hand out one work item
        # per sequence (and head) in batch order; starting the longest ones first leaves short
        # ones for the tail instead of a few long stragglers (longest-processing-time-first
        # list scheduling, Graham 1969). FlashInfer's decode on uneven contexts gained from it
        # (BENCHMARKS.md, "Decode attention with uneven contexts").
        # (A stable sort: reverse=True keeps equal contexts in arrival order.)
        kept.sort(key=attrgetter("num_computed"), reverse=True)
        return ScheduledBatch(kept, [1] * len(kept), is_decode=True, page_table=self.page_table)

    def preempt(self, req: Request) -> None:
        """Release a running request's pages and requeue it first, to be recomputed."""
        self.cache.release(req)
        self.running.remove(req)
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
