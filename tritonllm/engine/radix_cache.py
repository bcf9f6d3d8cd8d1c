"""Page-granular radix prefix cache, after SGLang's RadixAttention (Zheng et al., 2023).

A tree whose edges are full pages of token ids: the path from the root to a node spells a
page-aligned token prefix, and each node owns the KV page holding its page of tokens. A new
request reuses the pages of its longest cached page-aligned prefix. Each node has a reference
count: a running request locks the node of its deepest cached page, which pins the whole path
(pages of a running request are never evicted). Unreferenced leaves are evicted in LRU order
when the page allocator runs dry; the cache manager frees the pages they give back.

Simplification against SGLang: one node per page (no edge compression), which keeps matching
and splitting trivial; depth is at most max_model_len / page_size.

A cache salt (`PrefixCache`, module doc) is part of the first page's key, so requests of
different salts branch apart at the root and never share a page; the key of every later page
is its tokens alone (its path from the root already holds the salt).
"""

from __future__ import annotations

import heapq
import itertools

from tritonllm.engine.prefix_cache import PrefixCache


class RadixNode:
    __slots__ = ("key", "page", "parent", "children", "ref_count", "last_access")

    def __init__(self, key: tuple[int, ...], page: int, parent: RadixNode | None) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.ref_count = 0
        self.last_access = 0


class RadixCache(PrefixCache):
    """Maps page-aligned token prefixes to KV pages (`PrefixCache`; its nodes are `RadixNode`s).

    Pages inserted into the tree belong to it: they leave it only through `evict`.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = RadixNode((), 0, None)
        self.root.ref_count = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self._num_pages = 0  # pages owned by the tree
        self.num_locked_pages = 0  # pages on paths locked by running requests

    @property
    def num_pages(self) -> int:
        """Pages owned by the tree."""
        return self._num_pages

    def _keys(self, token_ids: list[int], num_pages: int, salt: str | None):
        ps = self.page_size
        for i in range(num_pages):
            page = tuple(token_ids[i * ps : (i + 1) * ps])
            # A salted first key holds a str, so it never equals an unsalted (all-int) key.
            yield (salt, *page) if i == 0 and salt else page

    def match_prefix(
        self, token_ids: list[int], salt: str | None = None
    ) -> tuple[RadixNode, list[int]]:
        """Longest cached page-aligned prefix of `token_ids` under `salt` that leaves >= 1 token
        uncached (the last prompt token must run through the model to give logits).

        Returns the deepest matched node (the root if none) and its path's pages, in order.
        Touches the path for LRU. Does not lock: call `lock(node)` to keep the pages.
        """
        max_pages = (len(token_ids) - 1) // self.page_size
        node, pages, now = self.root, [], next(self._clock)
        for key in self._keys(token_ids, max_pages, salt):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            node.last_access = now
            pages.append(node.page)
        return node, pages

    def insert(
        self, token_ids: list[int], pages: list[int], salt: str | None = None
    ) -> tuple[RadixNode, list[int]]:
        """Cache `pages` (one per full page of `token_ids`, in order) under `salt`.

        Where the tree already holds a page for the same prefix (another request computed it
        too), the tree's page wins.

        Returns:
            (deepest node, the tree's pages for the prefix). Pages in `pages` that are not in
            the returned list are duplicates the caller still owns and must free.
        """
        node, out, now = self.root, [], next(self._clock)
        for key, page in zip(self._keys(token_ids, len(pages), salt), pages, strict=True):
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key, page, node)
                node.children[key] = child
                self._num_pages += 1  # a new node starts unreferenced
            node = child
            node.last_access = now
            out.append(node.page)
        return node, out

    def lock(self, node: RadixNode | None) -> None:
        """Pin `node` and its ancestors (a running request uses their pages); None or the
        root is a no-op."""
        while node is not None and node is not self.root:
            if node.ref_count == 0:
                self.num_locked_pages += 1
            node.ref_count += 1
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        """Undo one `lock(node)`; None or the root is a no-op."""
        while node is not None and node is not self.root:
            node.ref_count -= 1
            assert node.ref_count >= 0, "radix cache unlock without lock"
            if node.ref_count == 0:
                self.num_locked_pages -= 1
            node = node.parent

    @property
    def num_evictable_pages(self) -> int:
        return self._num_pages - self.num_locked_pages

    def evict(self, num_pages: int) -> list[int]:
        """Drop up to `num_pages` unreferenced leaves, least recently used first (a parent left
        childless and unreferenced becomes a leaf in turn).

        Returns their pages, which the caller frees.
        """
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.ref_count == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            freed.append(node.page)
            self._num_pages -= 1
            if parent is not self.root and not parent.children and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node
