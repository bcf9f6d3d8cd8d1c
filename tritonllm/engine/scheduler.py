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
  (~14 ms for Qwen3-0.6B on the H200 host, `benchmarks/prefill_host.py`), so under a steady
  trickle of arrivals one prefill per arrival starves the decode steps (on the H200, online
  at concurrency 256: 19,026 tok/s without the delay, 22,437 with 8 steps; BENCHMARKS.md).
  The wait ends early when the waiting prompts fill a prefill batch (`max_prefill_tokens`),
  when nothing decodes, and never holds back a prompt that is part-way through chunked
  prefill. The idea is vLLM's `scheduler_delay_factor`
  (delay the next prompt batch by a multiple of the last prompt latency), counted in steps.
- A prefill batch takes at most `max_prefill_tokens` tokens (chunked prefill). Requests that
  are part-way through their prompt go first, then the waiting queue in FIFO order; a long
  prompt is split and continues in later prefill steps.
- Admission needs free pages for the scheduled chunk (after evicting unreferenced radix-cache
  pages), plus one spare page per decoding request, so that decodes crossing a page boundary
  rarely have to preempt. Admission stops at the first request that does not fit (FIFO, no
  overtaking) or at `max_running_requests`.
- A decode that crosses a page boundary takes one page. If none is left even after
  eviction, the newest running request is preempted: its computed pages go to the radix cache
  (or are freed), and it returns to the front of the waiting queue, to be recomputed later
  with its generated tokens appended to the prompt (mostly from the prefix cache).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from tritonllm.engine.kv_cache import PageAllocator
from tritonllm.engine.radix_cache import RadixCache
from tritonllm.engine.request import Request, RequestStatus


class HostPageTable:
    """Host mirror of the page lists of requests that hold pages: one zero-padded row each.

    Row `req.page_row` holds `req.pages` followed by zeros. The scheduler writes a row whenever
    it changes a request's pages (a decode step changes at most one page per request, and most
    change none), so the model runner gets a batch's `[B, width]` page table with one numpy
    gather instead of a copy per request. The idea is SGLang's `req_to_token` pool and vLLM
    v1's `BlockTable`: per-request page rows that persist across steps.

    Attributes:
        rows: `[num_rows, num_cols]` int32 page ids; rows and columns grow on demand
            (doubling), so no request is ever refused a row (a few MB at 256 requests of 2,560
            pages).
    """

    def __init__(self, num_rows: int, num_cols: int = 64) -> None:
        self.rows = np.zeros((max(num_rows, 1), max(num_cols, 1)), dtype=np.int32)
        self._free = list(range(self.rows.shape[0] - 1, -1, -1))  # pop() hands out row 0 first

    def write(self, req: Request, start: int = 0) -> None:
        """Copy `req.pages[start:]` into columns `start..` of its row (taking a row first if it
        has none). Pages are only ever appended or replaced in place, never dropped, except
        all at once through `release`."""
        n = len(req.pages)
        if req.page_row < 0:
            if not self._free:
                self._grow(rows=2 * self.rows.shape[0])
            req.page_row = self._free.pop()
        if n > self.rows.shape[1]:
            self._grow(cols=max(n, 2 * self.rows.shape[1]))
        self.rows[req.page_row, start:n] = req.pages[start:]

    def release(self, req: Request) -> None:
        """Zero `req`'s row and give it back (its pages are gone)."""
        if req.page_row >= 0:
            self.rows[req.page_row] = 0
            self._free.append(req.page_row)
            req.page_row = -1

    def gather(self, reqs: list[Request], width: int, out: np.ndarray) -> None:
        """Fill `out` (`[len(reqs), width]` int32) with the first `width` columns of each
        request's row: its pages, zero-padded. `width` (pages) may not exceed the table's
        columns, which always cover the most pages any request holds."""
        index = np.fromiter((r.page_row for r in reqs), dtype=np.intp, count=len(reqs))
        self.rows[:, :width].take(index, axis=0, out=out)

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        old_rows, old_cols = self.rows.shape
        grown = np.zeros((rows or old_rows, cols or old_cols), dtype=np.int32)
        grown[:old_rows, :old_cols] = self.rows
        self.rows = grown
        self._free.extend(range(grown.shape[0] - 1, old_rows - 1, -1))


@dataclass
class ScheduledBatch:
    """One step's work: `reqs[i]` runs `extend_lens[i]` new tokens starting at its
    `num_computed`. `is_decode`: all extend lens are 1 and every request samples.
    `page_table`: the scheduler's host mirror of the requests' pages."""

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
    """Owns the waiting queue, the running set and every request's KV pages."""

    def __init__(
        self,
        allocator: PageAllocator,
        radix: RadixCache | None,
        page_size: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        prefill_delay_steps: int = 0,
    ) -> None:
        self.allocator = allocator
        self.radix = radix
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # One row per running request, plus the one being admitted.
        self.page_table = HostPageTable(max_running_requests + 1)
        self._last_was_prefill = False
        self.prefill_delay_steps = prefill_delay_steps
        self._waited_steps = 0  # decode steps run while new requests waited (admission delay)
        self.num_preemptions = 0
        # Eviction walks the whole radix tree (O(cached pages)): when the pool is full, free a
        # slice of it per walk (1/64) rather than one page per allocation, so a full cache
        # costs one walk per ~1/64 of the pool instead of one per new page.
        self.evict_batch = max(1, allocator.num_usable // 64)

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
        """Remove a running request and release its pages (full pages go to the radix cache)."""
        self._release(req)
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
        for req in partial:
            if budget == 0:
                break
            extend = min(req.num_pending, budget)
            if not self._grow(req, req.num_computed + extend, reserve=0):
                # No overtaking: new requests must not take the pages this one waits for.
                budget = 0
                break
            reqs.append(req)
            extends.append(extend)
            budget -= extend
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            self._match_prefix(req)
            extend = min(req.num_pending, budget)
            if not self._grow(req, req.num_computed + extend, reserve=num_decoding):
                self._release(req)
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if not req.admitted_once:
                req.cached_tokens = req.num_computed
                req.admitted_once = True
            reqs.append(req)
            extends.append(extend)
            budget -= extend
        if not reqs:
            return None
        return ScheduledBatch(reqs, extends, is_decode=False, page_table=self.page_table)

    def _schedule_decode(self, decoding: list[Request]) -> ScheduledBatch | None:
        """Give each decoding request the slot of its next token (oldest first, preempting the
        newest when pages run out); `decoding` are the running requests that decode."""
        ps = self.page_size
        kept: list[Request] = []
        for req in sorted(decoding, key=attrgetter("arrival")):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted to make room for an older request
            if req.num_computed < len(req.pages) * ps:
                kept.append(req)  # the usual case: its last page has room for the token
                continue
            while not self._grow(req, req.num_computed + 1, reserve=0):
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
        # list scheduling, Graham 1969). Measured on an H200, FlashInfer decode at batch 150
        # with contexts 100..2047: 75% -> 89% of copy bandwidth on its CUDA-core kernels, 90% ->
        # 93% on the tensor-core ones used at that batch size (kernels/bench_attention.py).
        # (A stable sort: reverse=True keeps equal contexts in arrival order.)
        kept.sort(key=attrgetter("num_computed"), reverse=True)
        return ScheduledBatch(kept, [1] * len(kept), is_decode=True, page_table=self.page_table)

    def preempt(self, req: Request) -> None:
        """Release a running request's pages and requeue it first, to be recomputed."""
        self._release(req)
        self.running.remove(req)
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ---- pages ---------------------------------------------------------------------------
    def num_free_pages(self) -> int:
        """Pages free now or reclaimable by eviction."""
        evictable = self.radix.num_evictable_pages if self.radix else 0
        return self.allocator.num_free + evictable

    def _alloc(self, n: int, reserve: int) -> list[int] | None:
        if n + reserve > self.num_free_pages():
            return None
        short = n - self.allocator.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(max(short, self.evict_batch))
        return self.allocator.alloc(n)

    def _grow(self, req: Request, num_tokens: int, reserve: int) -> bool:
        """Give `req` pages for its first `num_tokens` tokens; False if not enough pages."""
        need = math.ceil(num_tokens / self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self._alloc(need, reserve)
        if pages is None:
            return False
        start = len(req.pages)
        req.pages.extend(pages)
        self.page_table.write(req, start)
        return True

    def _match_prefix(self, req: Request) -> None:
        if self.radix is None or req.pages:
            return
        node, pages = self.radix.match_prefix(req.token_ids)
        self.radix.lock(node)
        req.tree_node, req.pages = node, list(pages)
        self.page_table.write(req)
        req.num_tree_pages = len(pages)
        req.num_computed = len(pages) * self.page_size

    def cache_prefix(self, req: Request) -> None:
        """Put `req`'s computed full pages into the radix cache and lock them for it (after its
        prefill, so concurrent requests with the same prompt prefix can share them)."""
        if self.radix is None:
            return
        num_full = req.num_computed // self.page_size
        if num_full <= req.num_tree_pages:
            return
        node, tree_pages = self.radix.insert(req.token_ids, req.pages[:num_full])
        duplicates = [p for p, t in zip(req.pages[:num_full], tree_pages, strict=True) if p != t]
        self.radix.lock(node)
        self.radix.unlock(req.tree_node)
        self.allocator.free(duplicates)
        if duplicates:
            req.pages[:num_full] = tree_pages
            self.page_table.write(req)
        req.tree_node, req.num_tree_pages = node, num_full

    def _release(self, req: Request) -> None:
        """Return `req`'s pages: full computed pages to the radix cache, the rest freed."""
        if self.radix is None:
            self.allocator.free(req.pages)
        else:
            num_full = req.num_computed // self.page_size
            _, tree_pages = self.radix.insert(req.token_ids, req.pages[:num_full])
            owned = req.pages[num_full:]
            duplicates = [
                p for p, t in zip(req.pages[:num_full], tree_pages, strict=True) if p != t
            ]
            self.radix.unlock(req.tree_node)
            self.allocator.free(duplicates + owned)
        req.pages, req.num_computed = [], 0
        self.page_table.release(req)
        req.tree_node, req.num_tree_pages = None, 0
