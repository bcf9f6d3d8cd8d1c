"""Greedy decoding through the engine equals transformers' greedy decoding, token for token.

All prompts run as one continuous batch, across page sizes where prompts end exactly on and
just past page boundaries, with the prefix cache on and off and with chunked prefill (whose
later chunks run in mixed steps, beside the requests that already decode).
"""

from __future__ import annotations

import functools

import pytest
from test_engine_helpers import checkpoint, hf_greedy, prompts

from tritonllm.config import EngineConfig
from tritonllm.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams

# 1 token to > 3 pages of 8; 4/8/16 end on a page boundary (page size 4 and 8), 5/9/17 just past.
LENGTHS = [1, 3, 4, 5, 8, 9, 16, 17, 30]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@functools.cache
def reference(arch: str, tie: bool) -> list[list[int]]:
    path = checkpoint(arch, tie)
    return [hf_greedy(path, p, NEW_TOKENS)[0] for p in prompts(LENGTHS)]


def run_engine(arch: str, tie: bool, **kwargs) -> tuple[list[list[int]], LLMEngine]:
    kwargs.setdefault("num_pages", 512)
    engine = LLMEngine(EngineConfig(model=checkpoint(arch, tie), **kwargs))
    return engine.generate(prompts(LENGTHS), GREEDY), engine


CASES = [
    # arch, tied lm_head, page size, prefix cache, max_prefill_tokens
    ("qwen3", True, 4, True, 8192),
    ("qwen3", True, 8, False, 7),  # chunked: 30-token prompt over 5 steps
    ("qwen2", False, 8, True, 8192),
    ("qwen2", False, 4, False, 5),
    ("llama", True, 4, True, 6),
    ("llama", True, 8, False, 8192),
]


@pytest.mark.parametrize(("arch", "tie", "page_size", "prefix_cache", "budget"), CASES)
def test_greedy_matches_transformers(arch, tie, page_size, prefix_cache, budget):
    outs, engine = run_engine(
        arch, tie, page_size=page_size, enable_prefix_cache=prefix_cache, max_prefill_tokens=budget
    )
    assert outs == reference(arch, tie)
    stats = engine.stats()
    assert stats.max_batch_size_seen == len(LENGTHS)  # all decoded as one batch
    if budget < sum(LENGTHS):  # chunked: the decoding requests rode along in prefill steps
        assert stats.num_mixed_steps > 0
    assert stats.num_running == stats.num_waiting == 0


def test_greedy_stops_at_eos_and_stop_token_ids():
    arch, tie = "qwen3", True
    ref = reference(arch, tie)
    engine = LLMEngine(EngineConfig(model=checkpoint(arch, tie), page_size=4, num_pages=256))
    # Use a token the model does produce as a stop token: the output ends right after it.
    stop = ref[0][5]
    first = ref[0].index(stop)
    out = engine.generate(
        prompts(LENGTHS)[:1],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[stop]),
    )[0]
    assert out == ref[0][: first + 1]
    # min_tokens masks the stop token until then, so the output diverges from greedy there
    # or stops later; it must not stop before min_tokens.
    out = engine.generate(
        prompts(LENGTHS)[:1],
        SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[stop], min_tokens=first + 2
        ),
    )[0]
    assert len(out) >= first + 2 and stop not in out[: first + 2]
