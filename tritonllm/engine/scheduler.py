"""Continuous batching: which requests run in the next step, and their KV pages.

Policy with mixed steps (`mixed_steps`; decodes piggybacking on chunked prefills, the batching
of SARATHI (Agrawal et al. 2023), SGLang's `enable_mixed_chunk` and vLLM v1's unified token
budget):

- A step is a *decode* batch (every decoding request adds one token; a CUDA graph where one is
  captured) or a *mixed* batch: a prefill/extend batch (new prompts, prompt chunks,
  recomputation of preempted requests) whose forward also carries every decoding request as a
  one-token extend row (eager; rows: the prefill rows first, then the decode rows, longest
  context first). No decode step is lost to a prefill, so prefill may run in consecutive steps
  (a long prompt's chunks back to back) and requests decode in every step.
- Token budget: `max_prefill_tokens` per step, the decode rows counted in (one token each, as
  SGLang's `mixed_with_decode_tokens` and vLLM's `max_num_batched_tokens` count them): the
  prompt chunks get `max_prefill_tokens - decode rows`, but never less than half the budget
  (`prefill_budget`). So the budget holds whenever the decode rows take at most half of it
  (always at the defaults, 512 (CPU) / 16,384 (CUDA) tokens against at most 256 decode
  rows), and where they take more, prefill still advances at least at the average rate of
  the alternation below (a full budget every other step) instead of being starved by
  decoding requests.
- Admission delay (`prefill_delay_steps`, 0 = off): while requests decode, new requests may
  wait up to that many decode steps so that arrivals batch into fewer prefill steps. An eager
  forward costs about the same host time whatever its size (`benchmarks/prefill_host.py`), and
  a mixed step is one, where the decode step it replaces would have replayed a CUDA graph in a
  fraction of that time; so under a steady trickle of arrivals one mixed step per arrival
  would still slow every decoding request down (BENCHMARKS.md, "Host time of an eager prefill
  step"). The wait ends early when the waiting prompts fill a step's prefill budget, when
  nothing decodes, and never holds back a prompt that is part-way through chunked prefill. The
  idea is vLLM's `scheduler_delay_factor` (delay the next prompt batch by a multiple of the
  last prompt latency), counted in steps.
- Prefill rows: requests part-way through their prompt go first, then the waiting queue in
  FIFO order; a long prompt is split and continues in later steps. While a request waits that
  could be admitted, the part-way prompts take at most half the budget, so that one long
  prompt does not hold back every short one behind it until its last chunk (QA: on CPU a
  6,000-token prompt kept the health probe out for 20 s); its chunks then run at half the
  budget, and any of that half the waiting prompts do not use is left unused in that step.
- A request that scores its prompt (prompt logprobs, `engine/prompt_logprobs.py`) takes no
  prefix from the prefix cache, and the chunks of such requests add up to at most
  `MAX_SCORED_TOKENS_PER_STEP` tokens per step (each of their tokens computes logits).
- Pages: the decode rows take theirs first (oldest first; a decode that crosses a page
  boundary takes one page, and if none is left even after eviction the newest running request
  is preempted: its computed pages go to the prefix cache (or are freed), and it returns to the
  front of the waiting queue, to be recomputed later with its generated tokens appended to the
  prompt, mostly from the prefix cache). Admission then needs free pages for the scheduled
  chunk (after evicting unreferenced prefix-cache pages), plus one spare page per decoding
  request, so that decodes crossing a page boundary rarely have to preempt. Admission stops at
  the first request that does not fit (FIFO, no overtaking) or at `max_running_requests`; when
  nothing can be admitted the step is a plain decode batch.

Nothing else changes for a decode row in a mixed batch: under overlap scheduling its input id
is the in-flight step's placeholder, resolved on the device (`FutureMap.resolve`); the rows
that sample are each prefill row that reaches the end of its prompt, then every decode row, so
logprobs, penalties, seeds and the n > 1 children are per row as in a decode batch; a decode
row that stops (EOS, stop ids, max_tokens) is finished when its sample is processed, and only
the prefill rows' prompts enter the prefix cache then (a decode row's pages do at release).

Without mixed steps (`mixed_steps=False`, for A/B; mini-sglang's policy, one batch kind per
step): a step is either a prefill/extend batch (at most `max_prefill_tokens` prompt tokens) or
a decode batch. Prefill is preferred while requests can be admitted, but never twice in a row
when requests are decoding: after a prefill step a decode step runs, so running requests
advance at least every other step. The admission delay applies in the same way.
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
    `num_computed`.

    Attributes:
        reqs: the batch's requests, prefill rows first, then decode rows.
        extend_lens: new tokens per row (1 for a decode row).
        is_decode: a decode batch: every row is a decode row (and samples).
        page_table: the cache manager's host mirror of the requests' pages.
        num_decode_rows: how many rows, at the end of `reqs`, are decode rows (one token, the
            last sampled one, and they sample): all of them in a decode batch (set here), 0 in
            a prefill-only batch, both kinds of rows in a mixed batch.
    """

    reqs: list[Request]
    extend_lens: list[int]
    is_decode: bool
    page_table: HostPageTable
    num_decode_rows: int = 0

    def __post_init__(self) -> None:
        if self.is_decode:
            self.num_decode_rows = len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def num_prefill_rows(self) -> int:
        """Rows of prompt chunks (or recomputation), at the front of `reqs`."""
        return len(self.reqs) - self.num_decode_rows

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the prefill rows (prompt chunks, recomputation)."""
        return self.num_tokens - self.num_decode_rows

    @property
    def is_mixed(self) -> bool:
        """A prefill/extend batch that also carries decode rows."""
        return 0 < self.num_decode_rows < len(self.reqs)

    def samples(self, i: int) -> bool:
        """Whether request i reaches the end of its tokens this step (so it samples)."""
        return self.reqs[i].num_computed + self.extend_lens[i] == len(self.reqs[i].token_ids)


class Scheduler:
    """Owns the waiting queue and the running set; asks `cache` for every KV page.

    Args:
        cache: the cache manager (pages, prefix cache, page table).
        max_running_requests: most requests admitted at once.
        max_prefill_tokens: the token budget of a step's prefill/extend work (with mixed steps
            the decode rows count in; see `prefill_budget`).
        prefill_delay_steps: the admission delay (decode steps; module docstring).
        mixed_steps: decoding requests ride along in prefill/extend steps (module docstring);
            False: one batch kind per step.
    """

    def __init__(
        self,
        cache: CacheManager,
        max_running_requests: int,
        max_prefill_tokens: int,
        prefill_delay_steps: int = 0,
        mixed_steps: bool = False,
    ) -> None:
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.mixed_steps = mixed_steps
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._last_was_prefill = False
        self.prefill_delay_steps = prefill_delay_steps
        self._waited_steps = 0  # decode steps run while new requests waited (admission delay)
        self.num_preemptions = 0
        # What the scheduled batches held (`EngineStats`): the most decode rows of one step, the
        # batches with prefill rows, their prompt tokens, and the mixed ones among them.
        self.max_decode_rows = 0
        self.num_prefill_steps = self.prefill_tokens = self.num_mixed_steps = 0

    @property
    def page_table(self) -> HostPageTable:
        """The requests' page rows (the cache manager's), which each batch carries."""
        return self.cache.page_table

    def prefill_budget(self, num_decode_rows: int) -> int:
        """Prompt tokens a step may schedule beside `num_decode_rows` decode rows (tokens):
        `max_prefill_tokens`, less the decode rows with mixed steps, but never less than half
        of it (rounded up; module docstring)."""
        budget = self.max_prefill_tokens
        if not self.mixed_steps:
            return budget
        return max(budget - num_decode_rows, (budget + 1) // 2)

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
        delayed = (
            bool(decoding)
            and not partial
            and self._delays_admission(self.prefill_budget(len(decoding)))
        )
        if self.mixed_steps:
            batch = self._schedule_mixed(decoding) if has_prefills and not delayed else None
            if batch is None and decoding:
                batch = self._schedule_decode(decoding)
        else:
            batch = self._schedule_alternating(decoding, has_prefills, delayed)
        if batch is not None:
            self.max_decode_rows = max(self.max_decode_rows, batch.num_decode_rows)
            if batch.num_prefill_rows:
                self.num_prefill_steps += 1
                self.prefill_tokens += batch.num_prefill_tokens
                self.num_mixed_steps += batch.is_mixed
                if not self.waiting:
                    self._waited_steps = 0
            else:
                self._waited_steps = self._waited_steps + 1 if self.waiting else 0
        return batch

    def _schedule_mixed(self, decoding: list[Request]) -> ScheduledBatch | None:
        """Decode rows (their pages first, preempting if need be) and the prefill rows that the
        budget left by them and the pages allow, as one batch; a decode batch when no prefill
        row fits, None when nothing runs."""
        decode = self._schedule_decode(decoding) if decoding else None
        rows = decode.reqs if decode is not None else []
        prefill = self._schedule_prefill(self.prefill_budget(len(rows)))
        if prefill is None or decode is None:
            return prefill or decode
        return ScheduledBatch(
            prefill.reqs + rows,
            prefill.extend_lens + decode.extend_lens,
            is_decode=False,
            page_table=self.page_table,
            num_decode_rows=len(rows),
        )

    def _schedule_alternating(
        self, decoding: list[Request], has_prefills: bool, delayed: bool
    ) -> ScheduledBatch | None:
        """Without mixed steps: a prefill batch or a decode batch (module docstring)."""
        if has_prefills and not (self._last_was_prefill and decoding) and not delayed:
            batch = self._schedule_prefill(self.max_prefill_tokens)
            if batch is not None:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        batch = self._schedule_decode(decoding) if decoding else None
        if batch is None and has_prefills:
            # Decodes were all preempted (or none existed): use the step for prefill.
            batch = self._schedule_prefill(self.max_prefill_tokens)
        return batch

    def _delays_admission(self, budget: int) -> bool:
        """Whether the waiting requests should wait for another decode step (admission delay,
        see the module docstring): fewer than `prefill_delay_steps` decode steps have run since
        they started waiting and their prompts do not fill a step's prefill `budget`."""
        if self._waited_steps >= self.prefill_delay_steps:
            return False
        pending = 0
        for req in self.waiting:
            pending += req.num_pending
            if pending >= budget:
                return False
        return True

    def _schedule_prefill(self, budget: int) -> ScheduledBatch | None:
        """Prefill rows of at most `budget` tokens: partly prefilled requests first, then
        admissions from the waiting queue (module docstring); None if none fits."""
        reqs: list[Request] = []
        extends: list[int] = []
        num_decoding = sum(r.is_decoding for r in self.running)
        partial = sorted((r for r in self.running if not r.is_decoding), key=lambda r: r.arrival)
        scored = MAX_SCORED_TOKENS_PER_STEP  # the logits rows left for scoring requests
        # While a request waits that could be admitted, the part-way prompts leave it half the
        # budget: a long prompt's chunks do not hold back the short prompts behind it.
        admissible = self.waiting and len(self.running) < self.max_running_requests
        reserved = budget // 2 if admissible else 0
        for req in partial:
            if budget - reserved <= 0:
                break
            extend = min(req.num_pending, budget - reserved)
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
