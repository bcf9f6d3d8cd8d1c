"""/v1/completions through the real sidecar and tritonserver, checked against Hugging Face
transformers' greedy generation on the same tiny checkpoint."""

from __future__ import annotations

import openai
import pytest
import torch

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model_dir, tokenizer):
    """``(prompt, n) -> (prompt ids, n greedy new ids)`` by transformers' own ``generate``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    def run(prompt: str, n: int) -> tuple[list[int], list[int]]:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        return ids, out[0, len(ids) :].tolist()

    return run


def test_greedy_completion_matches_transformers(client, sidecar, tokenizer, hf_greedy):
    """Text, finish_reason and usage equal HF generate's greedy continuation, decoded by HF."""
    prompt_ids, new_ids = hf_greedy(PROMPT, 12)
    response = client.completions.create(
        model=sidecar.model_name, prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert response.id.startswith("cmpl-")
    choice = response.choices[0]
    assert choice.text == tokenizer.decode(new_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(prompt_ids) + 12


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_stream_concatenation_equals_non_stream(client, sidecar, sampling):
    kwargs = dict(model=sidecar.model_name, prompt=PROMPT, max_tokens=20, **sampling)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.id for c in chunks} == {chunks[0].id}


def test_stream_usage_chunk(client, sidecar, tokenizer):
    chunks = list(
        client.completions.create(
            model=sidecar.model_name,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=False))


def test_continuous_usage_stats_sum_every_prompt_and_choice(client, sidecar, tokenizer):
    """With two prompts and n=2, each chunk's usage is both prompts' tokens and the tokens
    of the four choices sent so far; the last chunk with a choice counts them all."""
    prompts = [PROMPT, PROMPT + " again"]
    chunks = list(
        client.completions.create(
            model=sidecar.model_name,
            prompt=prompts,
            n=2,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    with_choices = [c for c in chunks if c.choices]
    assert {c.usage.prompt_tokens for c in with_choices} == {prompt_tokens}
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 16
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_stop_token_id_ends_with_stop(client, sidecar, tokenizer, hf_greedy):
    """stop_token_ids on the 4th greedy token: "stop" after exactly 4 tokens (stop id included)."""
    _, new_ids = hf_greedy(PROMPT, 8)
    stop_id = new_ids[3]
    first = new_ids.index(stop_id)
    response = client.completions.create(
        model=sidecar.model_name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == first + 1
    assert response.choices[0].text == tokenizer.decode(new_ids[: first + 1])


def test_stop_string_streamed_and_not(client, sidecar, tokenizer, hf_greedy):
    _, new_ids = hf_greedy(PROMPT, 16)
    full = tokenizer.decode(new_ids, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    kwargs = dict(model=sidecar.model_name, prompt=PROMPT, max_tokens=16, temperature=0)
    response = client.completions.create(stop=stop, **kwargs)
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
