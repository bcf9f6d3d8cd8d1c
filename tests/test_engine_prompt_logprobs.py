"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and prefill-only requests
(``max_tokens=0``) against transformers' log-softmax on the same checkpoint: across chunked
prefill, with the prefix cache warm for the same prompt, with overlap scheduling, batched with
requests that do not score, and with n choices."""

from __future__ import annotations

import pytest
import torch
from test_engine_helpers import checkpoint, hf_greedy, hf_logits, prompts

from tritonllm.config import EngineConfig
from tritonllm.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams

K = 3


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def expected_scores(prompt: list[int]) -> torch.Tensor:
    """`[P - 1, vocab]` transformers' log-softmax at the positions that predict tokens 1..P-1."""
    return torch.log_softmax(hf_logits(checkpoint("qwen3"), prompt)[:-1], dim=-1)


def assert_scores(out, prompt: list[int]) -> None:
    expected = expected_scores(prompt)
    targets = torch.tensor(prompt[1:])
    chosen = expected.gather(1, targets[:, None]).squeeze(1)
    assert len(out.prompt_logprobs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs), chosen, rtol=0, atol=1e-4)
    for row, top in enumerate(out.prompt_top_logprobs):
        ref_vals, ref_ids = expected[row].topk(K)
        assert list(top) == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), ref_vals, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("budget", "overlap"),
    [(8192, False), (7, False), (5, True)],  # 7 and 5: a 30-token prompt over several chunks
)
def test_prompt_logprobs_match_transformers_across_chunks(budget, overlap):
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint("qwen3"),
            page_size=4,
            num_pages=512,
            max_prefill_tokens=budget,
            overlap_schedule=overlap,
        )
    )
    scored, plain = prompts([30, 9], seed=21)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = run(engine, {"s": (scored, params), "p": (plain, greedy)})
    first = outs["s"][0]
    assert_scores(first, scored)
    assert all(o.prompt_logprobs is None for o in outs["s"][1:])  # reported once
    assert all(o.prompt_logprobs is None for o in outs["p"])
    # Scoring changes nothing about generation, its own or its neighbour's.
    path = checkpoint("qwen3")
    assert [t for o in outs["s"] for t in o.new_token_ids] == hf_greedy(path, scored, 4)[0]
    assert [t for o in outs["p"] for t in o.new_token_ids] == hf_greedy(path, plain, 4)[0]


def test_scoring_takes_no_prefix_from_the_cache_and_max_tokens_zero_generates_nothing():
    engine = LLMEngine(EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=512))
    prompt = prompts([21], seed=22)[0]
    warm = run(engine, {"w": (prompt, SamplingParams(max_tokens=2, temperature=0.0))})["w"]
    assert warm[-1].finished
    assert engine.stats().cached_pages >= 5  # the prompt's full pages are cached now
    params = SamplingParams(max_tokens=0, prompt_logprobs=K)
    (out,) = run(engine, {"z": (prompt, params)})["z"]
    assert out.finished and out.finish_reason == "length"
    assert out.new_token_ids == [] and out.num_output_tokens == 0
    assert out.cached_tokens == 0  # it computed every position itself
    assert_scores(out, prompt)
    assert out.queue_time_s is not None and out.queue_time_s >= 0
    # The same request without scores does take the cached prefix.
    (plain,) = run(engine, {"c": (prompt, SamplingParams(max_tokens=0))})["c"]
    assert plain.cached_tokens >= 20 and plain.new_token_ids == []
    assert plain.prompt_logprobs is None
    assert engine.stats().num_running == 0


def test_every_choice_reports_its_scores_and_a_one_token_prompt_has_none():
    engine = LLMEngine(EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=512))
    prompt = prompts([6], seed=23)[0]
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=3, n=2, prompt_logprobs=K)
    outs = run(engine, {"n": (prompt, params)})["n"]
    firsts = {}
    for out in outs:
        firsts.setdefault(out.index, out)
    assert set(firsts) == {0, 1}
    for out in firsts.values():
        assert_scores(out, prompt)
    (single,) = run(
        engine, {"one": ([prompt[0]], SamplingParams(max_tokens=0, prompt_logprobs=0))}
    )["one"]
    assert single.prompt_logprobs == [] and single.prompt_top_logprobs == []
