"""KV pages, the radix prefix cache, admission, preemption and abort."""

from __future__ import annotations

import pytest
from test_engine_helpers import VOCAB, checkpoint, hf_greedy, prompts

from openai_frontend.generation import to_openai_error
from openai_frontend.triton_client import TritonError
from tritonllm.config import EngineConfig
from tritonllm.engine import LLMEngine
from tritonllm.engine.cache_manager import CacheManager, PageAllocator
from tritonllm.engine.radix_cache import RadixCache
from tritonllm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def make_engine(**kwargs) -> LLMEngine:
    kwargs.setdefault("page_size", 4)
    kwargs.setdefault("num_pages", 256)
    return LLMEngine(EngineConfig(model=checkpoint("qwen3"), **kwargs))


# ---- allocator and radix tree --------------------------------------------------------------
def test_a_full_cache_is_evicted_in_slices_not_one_tree_walk_per_page():
    """With every page held by the radix cache, allocating the pool again page by page walks
    the tree about 64 times (1/64 of the pool per eviction), not once per page: each walk costs
    O(cached pages), so per-page walks made a full cache quadratic (seen on the H200 profile)."""
    from tritonllm.engine.request import Request

    tree = RadixCache(page_size=1)
    cache = CacheManager(1 + 640, 1, tree, max_requests=9)
    alloc = cache.allocator
    for i in range(640):  # 640 one-page prompts, unlocked: all evictable
        tree.insert([10_000 + i], alloc.alloc(1))
    assert alloc.num_free == 0 and tree.num_evictable_pages == 640
    walks = 0
    evict = tree.evict

    def counted(n):
        nonlocal walks
        walks += 1
        return evict(n)

    tree.evict = counted
    req = Request("r", [1], GREEDY, arrival=0, stop_ids=frozenset())
    for n in range(1, 641):
        assert cache.grow(req, n, reserve=0)
    assert len(req.pages) == 640 and len(set(req.pages)) == 640
    assert walks <= 640 // cache.evict_batch + 1 and cache.evict_batch == 10


def test_without_a_prefix_cache_every_released_page_returns_to_the_free_list():
    """`NoPrefixCache` plugs into the same cache manager: a request's pages, full ones
    included, all go back to the free list, and nothing is ever cached or evicted."""
    from tritonllm.engine.prefix_cache import NoPrefixCache
    from tritonllm.engine.request import Request

    cache = CacheManager(1 + 8, 2, NoPrefixCache(), max_requests=2)
    req = Request("r", [1, 2, 3, 4, 5], GREEDY, arrival=0, stop_ids=frozenset())
    cache.match_prefix(req)
    assert req.pages == [] and req.num_computed == 0
    assert cache.grow(req, 5, reserve=0) and len(req.pages) == 3
    assert not cache.grow(req, 5 + 2 * 6, reserve=0)  # 9 pages wanted, 8 usable: nothing taken
    assert len(req.pages) == 3 and cache.num_free_pages == 5
    req.num_computed = 5
    cache.cache_prefix(req)
    assert req.num_tree_pages == 0 and cache.prefix_cache.num_pages == 0
    cache.release(req)
    assert req.pages == [] and req.page_row == -1
    assert cache.num_free_pages == cache.num_available_pages == cache.num_usable_pages == 8


def test_allocator_never_hands_out_page_zero_and_refuses_overdraw():
    alloc = PageAllocator(5)
    assert alloc.num_usable == 4 and alloc.alloc(5) is None and alloc.num_free == 4
    pages = alloc.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4] and alloc.alloc(1) is None
    alloc.free(pages[:2])
    assert alloc.num_free == 2
    with pytest.raises(ValueError):
        alloc.free([0])


def test_radix_match_insert_lock_and_lru_eviction():
    alloc = PageAllocator(16)
    tree = RadixCache(page_size=2)
    a = [1, 2, 3, 4, 5, 6]
    pages_a = alloc.alloc(3)
    node_a, tree_pages = tree.insert(a, pages_a)
    assert tree_pages == pages_a and tree.num_pages == 3
    # The whole prompt is never matched: at least one token must be computed.
    assert tree.match_prefix(a)[1] == pages_a[:2]
    assert tree.match_prefix(a + [7])[1] == pages_a
    assert tree.match_prefix([1, 2, 9, 9, 9])[1] == pages_a[:1]
    # Same prefix computed again elsewhere: the tree keeps its own pages.
    dup = alloc.alloc(2)
    _, tp = tree.insert([1, 2, 3, 4], dup)
    assert tp == pages_a[:2]
    alloc.free(dup)
    # A second branch, touched later than branch a.
    b = [1, 2, 8, 8]
    pages_b = alloc.alloc(1)
    node_b, _ = tree.insert(b, [pages_a[0]] + pages_b)
    tree.lock(node_a)
    assert tree.num_evictable_pages == 1  # only b's leaf: a's path is locked
    assert tree.evict(10) == pages_b and tree.match_prefix(b + [0])[1] == pages_a[:1]
    tree.unlock(node_a)
    # The two deepest pages of a, leaf first; the caller (the cache manager) frees them.
    assert tree.evict(2) == [pages_a[2], pages_a[1]]
    assert tree.match_prefix(a + [7])[1] == pages_a[:1]


# ---- engine-level caching -------------------------------------------------------------------
def test_second_turn_reuses_cached_prefix_and_matches_cold_run():
    first = prompts([30], seed=1)[0]
    engine = make_engine()
    reply = engine.generate([first], GREEDY)[0]
    second = first + reply + prompts([5], seed=2)[0]
    engine.add_request("turn2", second, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    cached = outs[0].cached_tokens
    assert cached >= len(first) // 4 * 4
    assert cached <= len(second) - 1 and cached % 4 == 0
    warm = [t for o in outs for t in o.new_token_ids]
    cold = make_engine(enable_prefix_cache=False).generate([second], GREEDY)[0]
    assert warm == cold == hf_greedy(checkpoint("qwen3"), second, 16)[0]


def test_identical_prompts_share_pages_while_running():
    engine = make_engine()
    prompt = prompts([17], seed=4)[0]
    engine.add_request("a", prompt, GREEDY)
    outs = engine.step()  # prefill a; its full prompt pages enter the radix cache
    engine.add_request("b", prompt, GREEDY)
    outs += engine.step() + engine.step()
    b_first = next(o for o in outs if o.request_id == "b")
    assert b_first.cached_tokens == 16  # 4 full pages; the last token is recomputed
    res = {"a": [], "b": []}
    for o in outs:
        res[o.request_id] += o.new_token_ids
    while engine.has_unfinished():
        for o in engine.step():
            res[o.request_id] += o.new_token_ids
    assert res["a"] == res["b"] == hf_greedy(checkpoint("qwen3"), prompt, 16)[0]


def test_many_requests_with_few_pages_all_complete_correctly():
    """32 requests, KV pages for about 3 at a time: admission waits, decodes preempt; every
    request still produces transformers' greedy ids."""
    ps = prompts([3 + (i * 7) % 20 for i in range(32)], seed=5)
    expected = [hf_greedy(checkpoint("qwen3"), p, 16)[0] for p in ps]
    for prefix_cache in (True, False):
        engine = make_engine(num_pages=1 + 30, enable_prefix_cache=prefix_cache)
        outs = engine.generate(ps, GREEDY)
        assert outs == expected
        stats = engine.stats()
        assert stats.max_batch_size_seen > 1 and stats.num_preemptions > 0
        assert stats.free_pages + stats.evictable_pages == stats.total_pages


def test_abort_frees_pages_at_once_and_reports_abort():
    engine = make_engine(enable_prefix_cache=False)
    for i, p in enumerate(prompts([9, 13, 6], seed=6)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    stats = engine.stats()
    assert stats.num_running == 3 and stats.max_batch_size_seen == 3
    used = stats.used_pages
    assert engine.abort("r1") is True
    after = engine.stats()
    assert after.used_pages < used and after.num_running == 2
    assert engine.abort("r1") is False and engine.abort("nope") is False
    outs = engine.step()
    final = [o for o in outs if o.request_id == "r1"]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason == "abort"
    assert final[0].new_token_ids == []
    assert all(o.request_id != "r1" for o in engine.step())
    engine.abort("r0")
    engine.abort("r2")
    assert engine.stats().free_pages == engine.stats().total_pages
    # A waiting request can be aborted too.
    engine.add_request("w", prompts([5])[0], GREEDY)
    assert engine.abort("w") and engine.stats().num_waiting == 0


def test_abort_with_prefix_cache_unreferences_shared_pages():
    engine = make_engine()
    engine.add_request("a", prompts([20], seed=7)[0], SamplingParams(max_tokens=30))
    engine.step()
    engine.step()
    assert engine.stats().evictable_pages == 0  # locked by the running request
    engine.abort("a")
    stats = engine.stats()
    assert stats.cached_pages > 0 and stats.evictable_pages == stats.cached_pages
    assert stats.free_pages + stats.evictable_pages == stats.total_pages


def test_add_request_rejects_what_can_never_run():
    engine = make_engine(num_pages=9, max_model_len=64)  # 8 usable pages of 4 = 32 tokens
    with pytest.raises(ValueError, match=r"max_model_len \(64\)"):
        engine.add_request("a", [1] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="needs 10 KV pages.*has 8") as too_big:
        engine.add_request("b", [1] * 30, SamplingParams(max_tokens=11))
    # The sidecar reports a request the KV pool can never hold as OpenAI's too-long error.
    error = to_openai_error(TritonError(f"in ensemble 'llm', {too_big.value.wire()}"), "prompt")
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "prompt")
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("c", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("d", [VOCAB], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("e", [1], SamplingParams(temperature=-1))
    engine.add_request("f", [1] * 30, SamplingParams(max_tokens=3))  # exactly 8 pages
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("f", [1], SamplingParams())
    assert engine.stats().num_waiting == 1


def test_n_expands_into_child_requests():
    engine = make_engine()
    prompt = prompts([10], seed=8)[0]
    outs = engine.generate([prompt], SamplingParams(max_tokens=8, n=3, seed=11, ignore_eos=True))
    assert len(outs) == 3 and all(len(o) == 8 for o in outs)
    engine.add_request("p", prompt, SamplingParams(max_tokens=8, n=2))
    assert engine.abort("p")
    outs = engine.step()
    assert {(o.request_id, o.index) for o in outs} == {("p", 0), ("p", 1)}
    assert [o.request_finished for o in outs] == [False, True]  # the last choice ends it
    assert not engine.has_unfinished()


def test_max_tokens_none_runs_to_the_context_limit():
    """max_tokens=None (OpenAI chat without a limit) generates until max_model_len."""
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint("qwen3", True)), page_size=4, num_pages=64, max_model_len=40
        )
    )
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    engine.check_request(prompt, params)
    [ids] = engine.generate([prompt], params)
    assert len(ids) == 40 - len(prompt)
    with pytest.raises(ValueError, match="no room"):
        engine.check_request(list(range(40)), params)


def test_generator_input_max_tokens_absent_means_no_limit():
    import numpy as np

    from tritonllm.serving.inputs import generate_request

    def params(**inputs):
        return generate_request({"input_ids": np.array([1], np.int32), **inputs}).params

    assert params().max_tokens is None
    # One encoding of "no limit": absent. 0 is a number: no output token (prefill only).
    assert params(max_tokens=np.array([0], dtype=np.int32)).max_tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        params(max_tokens=np.array([-1], dtype=np.int32))
