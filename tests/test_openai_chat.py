"""/v1/chat/completions and /v1/models through the real sidecar and tritonserver, with the
official ``openai`` client."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai_helpers import chat_prompt_ids

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)


def _stream(client, model, **kwargs):
    chunks = list(client.chat.completions.create(model=model, stream=True, **kwargs))
    return chunks, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_models_lists_the_served_model(client, sidecar):
    ids = [m.id for m in client.models.list()]
    assert ids == [sidecar.model_name]
    assert client.models.retrieve(sidecar.model_name).id == sidecar.model_name


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 1234}])
def test_stream_concatenation_equals_non_stream(client, sidecar, sampling):
    """Same seed (or greedy) → the streamed deltas join to exactly the non-streamed content."""
    kwargs = dict(messages=MESSAGES, max_tokens=24, **sampling)
    full = client.chat.completions.create(model=sidecar.model_name, **kwargs)
    chunks, streamed = _stream(client, sidecar.model_name, **kwargs)
    assert streamed == full.choices[0].message.content
    assert len(streamed) > 0
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"


def test_top_p_zero_samples_the_most_likely_token_alone(client, sidecar):
    """OpenAI takes top_p in [0, 1]: 0, nucleus sampling's limit p -> 0, keeps only the most
    likely token, so hot sampling (two choices) answers what greedy decoding answers."""
    kwargs = dict(model=sidecar.model_name, messages=MESSAGES, max_tokens=12)
    greedy = client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content
    sampled = client.chat.completions.create(temperature=2.0, top_p=0, n=2, seed=7, **kwargs)
    assert [c.message.content for c in sampled.choices] == [greedy, greedy]


def test_stream_chunk_protocol(client, sidecar, tokenizer):
    """Role first, content deltas, finish_reason last, then a usage-only chunk; one id."""
    chunks, _ = _stream(
        client,
        sidecar.model_name,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].id.startswith("chatcmpl-")
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices[:-1]] == [None] * (
        len(with_choices) - 1
    )
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES))


def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(client, sidecar, tokenizer):
    """vLLM's ``stream_options.continuous_usage_stats`` (aiperf's ``--per-chunk-usage``; it
    was a 400): every chunk with a choice carries the prompt's tokens and the tokens sent so
    far, 0 in the role chunk, rising to max_tokens, and the usage-only last chunk agrees;
    without ``include_usage`` there is no usage-only chunk."""
    prompt_tokens = len(chat_prompt_ids(tokenizer, MESSAGES))
    for include_usage in (True, False):
        options = {"include_usage": include_usage, "continuous_usage_stats": True}
        chunks, _ = _stream(
            client,
            sidecar.model_name,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream_options=options,
        )
        with_choices = [c for c in chunks if c.choices]
        assert all(c.usage is not None for c in with_choices)
        assert {c.usage.prompt_tokens for c in with_choices} == {prompt_tokens}
        counts = [c.usage.completion_tokens for c in with_choices]
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6
        assert all(
            c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in chunks
        )
        # A content chunk counts its own tokens: each one's count is above the one before.
        content = [c for c in with_choices if c.choices[0].delta.content]
        assert len({c.usage.completion_tokens for c in content}) == len(content)
        if include_usage:
            assert chunks[-1].choices == [] and chunks[-1].usage == with_choices[-1].usage
        else:
            assert chunks[-1].choices


def test_non_stream_usage_and_length(client, sidecar, tokenizer):
    """usage counts the HF-rendered prompt and exactly max_tokens when the limit ends it."""
    response = client.chat.completions.create(
        model=sidecar.model_name, messages=MESSAGES, max_completion_tokens=7, temperature=0
    )
    assert response.id.startswith("chatcmpl-")
    assert response.choices[0].finish_reason == "length"
    usage = response.usage
    assert usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES))
    assert usage.completion_tokens == 7
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_a_message_without_tool_calls_has_no_tool_calls_key(client, sidecar):
    """OpenAI leaves ``tool_calls`` out of a message that has none (not ``null``), so strict
    clients that read it as an array never see a null; QA found ``"tool_calls": null``."""
    raw = client.chat.completions.with_raw_response.create(
        model=sidecar.model_name, messages=MESSAGES, max_tokens=4, temperature=0
    )
    message = raw.http_response.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert "tool_calls" not in message, message


def test_repeated_prompt_reports_cached_tokens(client, sidecar):
    messages = [{"role": "user", "content": "Tell me about the history of paged attention. " * 4}]
    for _ in range(2):
        response = client.chat.completions.create(
            model=sidecar.model_name, messages=messages, max_tokens=2, temperature=0
        )
    cached = response.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= response.usage.prompt_tokens


def test_stop_token_ids_finish_with_stop(client, sidecar, tokenizer):
    """Stopping on a token the model greedily emits ends the request early with "stop"."""
    kwargs = dict(model=sidecar.model_name, messages=MESSAGES, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stop_id = tokenizer.encode(full, add_special_tokens=False)[2]
    response = client.chat.completions.create(**kwargs, extra_body={"stop_token_ids": [stop_id]})
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 16
    text = response.choices[0].message.content
    assert full.startswith(text)
    assert text.endswith(tokenizer.decode([stop_id]))
    _, streamed = _stream(
        client,
        sidecar.model_name,
        **{k: v for k, v in kwargs.items() if k != "model"},
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert streamed == text


def test_stop_strings_cut_before_the_match(client, sidecar):
    kwargs = dict(model=sidecar.model_name, messages=MESSAGES, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    response = client.chat.completions.create(**kwargs, stop=[stop])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == full[: full.index(stop)]
    # The engine stopped at the match instead of running on to max_tokens.
    assert response.usage.completion_tokens < 16
    # Streaming gives the same text and never shows part of the stop string.
    _, streamed = _stream(
        client, sidecar.model_name, messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop]
    )
    assert streamed == full[: full.index(stop)]


def test_enable_thinking_false_changes_the_prompt(client, sidecar):
    """chat_template_kwargs.enable_thinking reaches the template (Qwen3 pre-fills a think block)."""
    base = dict(model=sidecar.model_name, messages=MESSAGES, max_tokens=1, temperature=0)
    on = client.chat.completions.create(**base)
    off = client.chat.completions.create(
        **base, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_eight_concurrent_streams_complete(sidecar):
    """Eight simultaneous streaming chats all finish, each with its own full content."""

    async def run():
        client = openai.AsyncOpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)

        async def one(i):
            messages = [{"role": "user", "content": f"Count to {i + 3}."}]
            stream = await client.chat.completions.create(
                model=sidecar.model_name,
                messages=messages,
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return messages, text, chunks

        results = await asyncio.gather(*(one(i) for i in range(8)))
        await client.close()
        return results

    results = asyncio.run(run())
    assert len({chunks[0].id for _, _, chunks in results}) == 8
    client = openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)
    for messages, text, chunks in results:
        assert chunks[-1].usage.completion_tokens == 20
        alone = client.chat.completions.create(
            model=sidecar.model_name, messages=messages, max_tokens=20, temperature=0
        )
        assert text == alone.choices[0].message.content


def test_chat_without_max_tokens_is_not_cut_at_a_default(client, sidecar, tokenizer):
    """Omitted max_tokens runs until a stop condition (OpenAI), not to a small default."""
    kwargs = dict(model=sidecar.model_name, messages=MESSAGES, temperature=0)
    full = client.chat.completions.create(**kwargs, max_tokens=48).choices[0].message.content
    ids = tokenizer.encode(full)
    # The shortest stop string that first occurs after the ~30th token of the continuation.
    start = len(tokenizer.decode(ids[:30]))
    stop = next(
        full[start : start + n]
        for n in range(3, 40)
        if full.index(full[start : start + n]) == start
    )
    response = client.chat.completions.create(**kwargs, stop=[stop])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == full[: full.index(stop)]
    assert response.usage.completion_tokens > 16
