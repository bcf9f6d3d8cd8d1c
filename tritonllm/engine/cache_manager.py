"""Who holds which KV page: `CacheManager`, the one owner of page allocation.

Every page of the pool (`engine.kv_cache.KVCache`) is, at any time, in exactly one place: on
the free list (`PageAllocator`), in the prefix cache (`engine.prefix_cache.PrefixCache`: the
radix tree, or `NoPrefixCache`), or held by a running request (`Request.pages`, mirrored row by
row in `HostPageTable`); a request may also use prefix-cache pages, which it locks. Only the
`CacheManager` moves pages between those places: the scheduler asks it for pages (`grow`), for
a request's cached prefix at admission (`match_prefix`), and to give a request's pages back
(`release`); the engine has it cache a prefilled prompt (`cache_prefix`). Page 0 is never
handed out (the padding target of page tables and CUDA graphs).
"""

from __future__ import annotations

import math

import numpy as np

from tritonllm.engine.prefix_cache import PrefixCache
from tritonllm.engine.request import Request


class PageAllocator:
    """Free list of page ids 1..num_pages-1 (page 0 is reserved).

    Freed pages are reused last-in first-out, which keeps recently touched memory warm.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out (all but page 0)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages; None (and nothing taken) if fewer than `n` are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool. Freeing page 0 or an out-of-range id is a bug.

        Raises:
            ValueError: a page id outside 1..num_pages-1.
        """
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"cannot free page {p} (valid: 1..{self.num_pages - 1})")
        self._free.extend(pages)


class HostPageTable:
    """Host mirror of the page lists of requests that hold pages: one zero-padded row each.

    Row `req.page_row` holds `req.pages` followed by zeros. The cache manager writes a row
    whenever it changes a request's pages (a decode step changes at most one page per request,
    and most change none), so the model runner gets a batch's `[B, width]` page table with one
    numpy gather instead of a copy per request. The idea is SGLang's `req_to_token` pool and
    vLLM v1's `BlockTable`: per-request page rows that persist across steps.

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


class CacheManager:
    """Allocates, caches and frees the KV pages of requests (see the module docstring).

    Args:
        num_pages: pages in the pool, page 0 included.
        page_size: tokens per page.
        prefix_cache: the prefix cache (`NoPrefixCache()` for none); it must be empty.
        max_requests: requests expected to hold pages at once (the page table's initial rows;
            it grows beyond that on demand).

    Attributes:
        allocator: the free list.
        prefix_cache: the prefix cache.
        page_table: the requests' page rows, for the model runner.
        evict_batch: pages evicted per walk of the prefix cache when the free list runs short.
    """

    def __init__(
        self, num_pages: int, page_size: int, prefix_cache: PrefixCache, max_requests: int
    ) -> None:
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = prefix_cache
        self.page_size = page_size
        self.page_table = HostPageTable(max_requests)
        # Eviction walks the whole radix tree (O(cached pages)): when the pool is full, free a
        # slice of it per walk (1/64) rather than one page per allocation, so a full cache
        # costs one walk per ~1/64 of the pool instead of one per new page.
        self.evict_batch = max(1, self.allocator.num_usable // 64)

    # ---- accounting ------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (the pool less page 0)."""
        return self.allocator.num_usable

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list."""
        return self.allocator.num_free

    @property
    def num_available_pages(self) -> int:
        """Pages free now or reclaimable by evicting the prefix cache."""
        return self.allocator.num_free + self.prefix_cache.num_evictable_pages

    # ---- a request's pages -------------------------------------------------------------------
    def grow(self, req: Request, num_tokens: int, reserve: int) -> bool:
        """Give `req` pages for its first `num_tokens` tokens, leaving `reserve` pages
        available for others; False (nothing taken) if there are not enough."""
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

    def match_prefix(self, req: Request) -> None:
        """Start a request that holds no pages from its longest cached prefix (under its cache
        salt, `params.cache_salt`): lock those pages for it and count their tokens as computed.
        No-op if it holds pages already."""
        if req.pages:
            return
        node, pages = self.prefix_cache.match_prefix(req.token_ids, req.params.cache_salt)
        self.prefix_cache.lock(node)
        req.tree_node, req.pages = node, list(pages)
        self.page_table.write(req)
        req.num_tree_pages = len(pages)
        req.num_computed = len(pages) * self.page_size

    def cache_prefix(self, req: Request) -> None:
        """Put `req`'s computed full pages into the prefix cache and lock them for it (after
        its prefill, so concurrent requests with the same prompt prefix can share them)."""
        num_full = req.num_computed // self.page_size
        if num_full <= req.num_tree_pages:
            return
        salt = req.params.cache_salt
        node, cached = self.prefix_cache.insert(req.token_ids, req.pages[:num_full], salt)
        # Where the cache already held a page for the same tokens, it keeps its own: ours is
        # a duplicate, freed here, and the request switches to the cache's page.
        duplicates = [p for p, c in zip(req.pages[: len(cached)], cached, strict=True) if p != c]
        self.prefix_cache.lock(node)
        self.prefix_cache.unlock(req.tree_node)
        self.allocator.free(duplicates)
        if duplicates:
            req.pages[: len(cached)] = cached
            self.page_table.write(req)
        req.tree_node, req.num_tree_pages = node, len(cached)

    def release(self, req: Request) -> None:
        """Take all of `req`'s pages back: its full computed pages go to the prefix cache, the
        rest (and duplicates of pages the cache already holds) to the free list."""
        num_full = req.num_computed // self.page_size
        _, cached = self.prefix_cache.insert(
            req.token_ids, req.pages[:num_full], req.params.cache_salt
        )
        kept = set(cached)
        self.prefix_cache.unlock(req.tree_node)
        self.allocator.free([p for p in req.pages if p not in kept])
        req.pages, req.num_computed = [], 0
        self.page_table.release(req)
        req.tree_node, req.num_tree_pages = None, 0

    def _alloc(self, n: int, reserve: int) -> list[int] | None:
        if n + reserve > self.num_available_pages:
            return None
        short = n - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.prefix_cache.evict(max(short, self.evict_batch)))
        return self.allocator.alloc(n)
