"""Stop strings inside the engine: the output ends just before the stop string, no token that
carries part of it is released, and the request's KV pages are freed at once."""

from __future__ import annotations

import pytest
import torch

from tritonllm.config import EngineConfig
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.stop_strings import apply_trim
from tritonllm.sampling_params import SamplingParams
from tritonllm.tokenization.detokenizer import Detokenizer

torch.set_num_threads(1)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(
        EngineConfig(model=str(tiny_model_dir), device="cpu", page_size=4, num_pages=256)
    )


@pytest.fixture(scope="module")
def greedy(engine, tokenizer):
    """Greedy continuation of PROMPT (ids and text) without stop strings."""
    prompt = tokenizer.encode(PROMPT)
    ids = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    return prompt, ids[0], tokenizer.decode(ids[0], skip_special_tokens=True)


def run_streaming(engine, tokenizer, prompt, params):
    """Feed outputs through the stateless detokenizer as the Triton pipeline does."""
    detok = Detokenizer(tokenizer)
    engine.add_request("r", prompt, params)
    released, text, final = [], "", None
    while final is None:
        for out in engine.step():
            delta = detok.delta(released[-8:], out.new_token_ids, out.finished)
            text += apply_trim(delta, out.trim_chars)
            released += out.new_token_ids
            if out.finished:
                final = out
    return text, released, final


def test_multi_token_stop_string_ends_output_before_it(engine, tokenizer, greedy):
    prompt, ids, text = greedy
    # A stop string that spans several tokens, starting in the middle of the continuation.
    start = len(tokenizer.decode(ids[:10], skip_special_tokens=True))
    stop = text[start : start + 12]
    assert len(tokenizer.encode(stop)) > 1
    expected = text[: text.find(stop)]
    used_before = engine.stats().used_pages
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    out_text, released, final = run_streaming(engine, tokenizer, prompt, params)
    assert out_text == expected
    assert final.finish_reason == "stop"
    # Generation stopped right at the match, well before max_tokens.
    assert final.num_output_tokens < 40
    assert stop not in out_text
    # Released ids never reach past the token where the match starts.
    assert len(released) <= 11
    # Every generated id counts (OpenAI's and vLLM's completion tokens), also those after the
    # match's start that are never released.
    done = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))
    assert final.num_output_tokens == done + 1 > len(released)
    # Running pages were released (only the radix cache may keep some).
    stats = engine.stats()
    assert stats.num_running == 0
    assert stats.used_pages - stats.cached_pages <= used_before


def test_stop_string_inside_one_token(engine, tokenizer, greedy):
    prompt, ids, text = greedy
    # A generated token with at least 3 characters; stop on its last 2 characters.
    pieces = [tokenizer.decode([t]) for t in ids]
    i = next((k for k, p in enumerate(pieces) if len(p.strip()) >= 3), None)
    assert i is not None, "the seeded continuation has a multi-character token"
    piece = pieces[i]
    prefix = tokenizer.decode(ids[:i], skip_special_tokens=True)
    stop = piece[-2:]
    expected = text[: text.find(stop)]
    assert len(expected) >= len(prefix)  # the match is in token i or earlier
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    out_text, _, final = run_streaming(engine, tokenizer, prompt, params)
    assert out_text == expected
    assert final.finish_reason == "stop"


def test_no_match_releases_everything(engine, tokenizer, greedy):
    prompt, ids, text = greedy
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=["\x00never"])
    out_text, released, final = run_streaming(engine, tokenizer, prompt, params)
    assert released == ids
    assert out_text == text
    assert final.finish_reason == "length"


@pytest.mark.parametrize(
    "stop", [[""], ["x"] * 17, ["y" * 257]], ids=["empty", "too-many", "too-long"]
)
def test_invalid_stop_strings_are_refused(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)
