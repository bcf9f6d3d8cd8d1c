"""The prefix cache interface (`PrefixCache`) and the cache that keeps nothing (`NoPrefixCache`).

A prefix cache maps page-aligned token prefixes to the KV pages that hold them, so a new
request can skip computing a prefix that an earlier one computed. The engine's cache manager
(`engine.cache_manager.CacheManager`) is its only caller: it hands the cache pages of computed
prefixes, gets back which of them the cache now owns, and frees whatever the cache gives up.
`EngineConfig.enable_prefix_cache=False` plugs in `NoPrefixCache`, so the manager and the
scheduler run the same code with or without prefix caching. The radix tree
(`engine.radix_cache.RadixCache`) is the real one.

Nodes are opaque handles: `match_prefix` and `insert` return one, `lock`/`unlock` take it back.
None stands for "no node" (nothing cached, nothing locked).

A cache salt (`SamplingParams.cache_salt`, vLLM's request field of the same name) names the
namespace a prefix lives in: prefixes are shared only between requests of the same salt (None
and "" are the shared, unsalted namespace), so tenants with different salts never share a page
and never learn from `cached_tokens` or from latency what another tenant's prompts hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

# An opaque handle to a cached prefix (a `RadixNode` for the radix cache), or None.
PrefixNode = Any


class PrefixCache(ABC):
    """Page-granular prefix cache. Pages it owns go back to the caller only through `evict`."""

    @property
    @abstractmethod
    def num_pages(self) -> int:
        """Pages the cache owns (locked or not)."""

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Owned pages no running request uses: what `evict` can give back."""

    @abstractmethod
    def match_prefix(
        self, token_ids: list[int], salt: str | None = None
    ) -> tuple[PrefixNode, list[int]]:
        """The longest cached page-aligned prefix of `token_ids` under `salt` (module doc) that
        leaves at least one token uncached (the last prompt token must run through the model to
        give logits).

        Returns:
            (its node, the pages of the prefix in order); `(None, [])` when nothing matches
            (the radix cache returns its root node then). Does not lock.
        """

    @abstractmethod
    def insert(
        self, token_ids: list[int], pages: list[int], salt: str | None = None
    ) -> tuple[PrefixNode, list[int]]:
        """Offer `pages` (one per full page of `token_ids`, in order) to the cache, under
        `salt`.

        Returns:
            (the node of the prefix the cache now holds, the cache's pages for it, in order).
            The cache may keep its own page where it already held one for the same tokens, and
            may keep fewer pages than offered (`NoPrefixCache` keeps none). Offered pages that
            are not in the returned list remain the caller's.
        """

    @abstractmethod
    def lock(self, node: PrefixNode) -> None:
        """Pin `node`'s pages (and its ancestors'): a running request uses them. None: no-op."""

    @abstractmethod
    def unlock(self, node: PrefixNode) -> None:
        """Undo one `lock(node)`; None is a no-op."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Give up to `num_pages` unlocked pages back (least recently used first); the caller
        frees them. Returns those pages."""


class NoPrefixCache(PrefixCache):
    """A prefix cache that caches nothing (`EngineConfig.enable_prefix_cache=False`)."""

    @property
    def num_pages(self) -> int:
        return 0

    @property
    def num_evictable_pages(self) -> int:
        return 0

    def match_prefix(
        self, token_ids: list[int], salt: str | None = None
    ) -> tuple[PrefixNode, list[int]]:
        return None, []

    def insert(
        self, token_ids: list[int], pages: list[int], salt: str | None = None
    ) -> tuple[PrefixNode, list[int]]:
        return None, []

    def lock(self, node: PrefixNode) -> None:
        pass

    def unlock(self, node: PrefixNode) -> None:
        pass

    def evict(self, num_pages: int) -> list[int]:
        return []
