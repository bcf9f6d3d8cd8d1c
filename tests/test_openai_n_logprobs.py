"""``n`` and logprobs through the real sidecar and tritonserver, with the ``openai`` client.

Oracles: single-choice requests with seed + i for choice i (the engine's documented ``n``
semantics), Hugging Face transformers' float32 log_softmax at every generated position, OpenAI's
chat and legacy completions logprobs formats, and the engine's KV gauges for aborts.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch
from openai_helpers import chat_prompt_ids, engine_idle, strict_json, wait_for_gauges

PROMPT = "The quick brown fox jumps over the lazy dog because"
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
TOL = 1e-4


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)


def _token_id(tokenizer, token_bytes: list[int]) -> int:
    """The id whose bytes are ``token_bytes`` (the tokenizer's own byte-level vocabulary)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_encoder = bytes_to_unicode()
    token_id = tokenizer.convert_tokens_to_ids("".join(byte_encoder[b] for b in token_bytes))
    assert token_id is not None and token_id != tokenizer.unk_token_id, token_bytes
    return token_id


def _stream_choices(chunks, n: int):
    """Per choice index: (text, finish reasons seen, logprob entries) of a streamed chat."""
    texts, reasons, entries = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index].append(choice.finish_reason)
            if choice.logprobs is not None:
                entries[choice.index] += choice.logprobs.content
    return texts, reasons, entries, usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n_choices_equal_single_requests_with_seed_plus_i(client, sidecar, stream):
    common = dict(model=sidecar.model_name, messages=MESSAGES, max_tokens=10, temperature=1.0)
    singles = [client.chat.completions.create(seed=21 + i, **common) for i in range(3)]
    expected = [s.choices[0].message.content for s in singles]
    completion_tokens = sum(s.usage.completion_tokens for s in singles)
    if stream:
        chunks = client.chat.completions.create(
            n=3, seed=21, stream=True, stream_options={"include_usage": True}, **common
        )
        texts, reasons, _, usage = _stream_choices(chunks, 3)
        assert texts == expected
        assert reasons == [[s.choices[0].finish_reason] for s in singles]  # one finish each
    else:
        response = client.chat.completions.create(n=3, seed=21, **common)
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert [c.message.content for c in response.choices] == expected
        assert [c.finish_reason for c in response.choices] == [
            s.choices[0].finish_reason for s in singles
        ]
        usage = response.usage
    assert usage.completion_tokens == completion_tokens
    assert usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completions_greedy_n_choices_are_identical(client, sidecar, stream):
    kwargs = dict(model=sidecar.model_name, prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    single = client.completions.create(**{**kwargs, "n": 1}).choices[0].text
    if stream:
        texts = ["", ""]
        finishes = [[], []]
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason:
                    finishes[choice.index].append(choice.finish_reason)
        assert finishes == [["length"], ["length"]]
    else:
        response = client.completions.create(**kwargs)
        texts = [c.text for c in response.choices]
        assert response.usage.completion_tokens == 16
    assert texts == [single, single]


def _check_chat_entries(entries, prompt_ids, k, tokenizer, hf_logprobs):
    ids = [_token_id(tokenizer, e.bytes) for e in entries]
    expected = hf_logprobs(prompt_ids, ids)
    for i, entry in enumerate(entries):
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="replace")
        assert math.isclose(entry.logprob, float(expected[i, ids[i]]), abs_tol=TOL)
        assert len(entry.top_logprobs) == k
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(
            torch.tensor(values), expected[i].topk(k).values, atol=TOL, rtol=0
        )
    return ids


def test_chat_greedy_logprobs_match_transformers(client, sidecar, tokenizer, hf_logprobs):
    kwargs = dict(
        model=sidecar.model_name,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == response.usage.completion_tokens == 12
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGES)
    ids = _check_chat_entries(entries, prompt_ids, 3, tokenizer, hf_logprobs)
    # Greedy: the chosen token is the most likely alternative, and the ids are HF's argmax.
    assert all(e.top_logprobs[0].token == e.token for e in entries)
    assert ids == hf_logprobs(prompt_ids, ids).argmax(dim=-1).tolist()
    content = choice.message.content
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == content
    if all(e.token == bytes(e.bytes).decode("utf-8", "strict") for e in entries):
        assert "".join(e.token for e in entries) == content
    # Streamed: the same entries, spread over the chunks.
    _, _, streamed, _ = _stream_choices(client.chat.completions.create(stream=True, **kwargs), 1)
    assert [(e.token, e.bytes) for e in streamed[0]] == [(e.token, e.bytes) for e in entries]
    for a, b in zip(streamed[0], entries, strict=True):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-6)


def test_chat_logprobs_without_top_logprobs_has_empty_alternatives(client, sidecar):
    response = client.chat.completions.create(
        model=sidecar.model_name, messages=MESSAGES, max_tokens=3, logprobs=True, seed=3
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == 3 and all(e.top_logprobs == [] for e in entries)
    assert all(e.logprob <= 0 for e in entries)
    plain = client.chat.completions.create(
        model=sidecar.model_name, messages=MESSAGES, max_tokens=2
    )
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_completions_legacy_logprobs_format(client, sidecar, tokenizer, hf_logprobs, stream):
    kwargs = dict(model=sidecar.model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    if stream:
        tokens, values, tops, offsets = [], [], [], []
        for chunk in client.completions.create(stream=True, **kwargs):
            lp = chunk.choices[0].logprobs
            if lp is not None:
                tokens += lp.tokens
                values += lp.token_logprobs
                tops += lp.top_logprobs
                offsets += lp.text_offset
    else:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        tokens, values, tops, offsets = (
            lp.tokens,
            lp.token_logprobs,
            lp.top_logprobs,
            lp.text_offset,
        )
    assert len(tokens) == len(values) == len(tops) == len(offsets) == 8
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(8)]
    for token, value, top in zip(tokens, values, tops, strict=True):
        assert top[token] == value  # the chosen token is among its top_logprobs
        assert max(top.values()) == value  # greedy: it is the most likely
        assert 1 <= len(top) <= 3
    full = client.completions.create(**{**kwargs, "logprobs": None}).choices[0].text
    if all("\ufffd" not in t for t in tokens):
        assert "".join(tokens) == full
    # Logprob values against transformers' own greedy ids for this prompt (the row after the
    # appended placeholder 0 predicts the next token).
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    hf_ids: list[int] = []
    for _ in range(8):
        hf_ids.append(int(hf_logprobs(prompt_ids, [*hf_ids, 0])[-1].argmax()))
    expected = hf_logprobs(prompt_ids, hf_ids).gather(1, torch.tensor(hf_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(values), expected, atol=TOL, rtol=0)


def _stop_at(tokens: list[str], inside: bool) -> tuple[str, int]:
    """(a 3-character stop string that first occurs at the start of a token, or one character
    into a token; how many tokens the returned text then has entries for). Searched before the
    first token that holds part of a character (its text holds U+FFFD)."""
    whole = next((k for k, t in enumerate(tokens) if "\ufffd" in t), len(tokens))
    text = "".join(tokens[:whole])
    for k in range(whole // 3, whole - 1):
        start = sum(len(t) for t in tokens[:k]) + inside
        stop = text[start : start + 3]
        if len(stop) == 3 and text.find(stop) == start and len(tokens[k]) > inside:
            return stop, k + inside
    raise AssertionError(f"no stop string found in {tokens}")


@pytest.mark.parametrize("inside", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_end_with_the_text_a_stop_string_cut(client, sidecar, stream, inside):
    """OpenAI's logprobs cover the returned text: with a stop string, the tokens that lie
    wholly after the cut have no entries, a token straddling it keeps its entry; usage still
    counts every generated token. Oracle: the same greedy request without the stop."""
    base = dict(model=sidecar.model_name, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
    full = client.completions.create(**base).choices[0]
    stop, kept = _stop_at(full.logprobs.tokens, inside)
    generated = next(k + 1 for k in range(24) if stop in "".join(full.logprobs.tokens[: k + 1]))
    kwargs = dict(base, stop=[stop])
    if stream:
        tokens, out_text = [], ""
        chunks = list(
            client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        )
        for chunk in chunks:
            for choice in chunk.choices:
                out_text += choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        response = client.completions.create(**kwargs)
        choice = response.choices[0]
        tokens, out_text, usage, finish = (
            choice.logprobs.tokens,
            choice.text,
            response.usage,
            choice.finish_reason,
        )
    assert finish == "stop"
    assert out_text == full.text[: full.text.index(stop)]
    assert tokens == full.logprobs.tokens[:kept]
    assert usage.completion_tokens == generated


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_leave_out_the_stop_token(client, sidecar, tokenizer, stream):
    """The EOS that ended a chat choice is no part of its content: no logprobs entry (OpenAI's
    content covers the returned text), while usage counts it. The choice may sample only EOS."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    kwargs = dict(
        model=sidecar.model_name,
        messages=MESSAGES,
        max_tokens=4,
        logprobs=True,
        extra_body={"allowed_token_ids": [eos]},
    )
    if stream:
        chunks = client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
        texts, reasons, entries, usage = _stream_choices(chunks, 1)
        content, reason, entries = texts[0], reasons[0], entries[0]
    else:
        response = client.chat.completions.create(**kwargs)
        (choice,) = response.choices
        content, reason, entries = choice.message.content, [choice.finish_reason], None
        entries, usage = choice.logprobs.content, response.usage
    assert (content, reason, entries) == ("", ["stop"], [])
    assert usage.completion_tokens == 1


def _chat_raw(sidecar, body: dict, stream: bool) -> tuple[str, list[dict]]:
    """(content, logprobs entries) of a chat request sent with httpx; every body and SSE event
    must be 200 and strict JSON (the openai client's parser would accept NaN)."""
    url = f"{sidecar.base_url}/chat/completions"
    with httpx.Client(timeout=60) as http:
        response = http.post(url, json={**body, "model": sidecar.model_name, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        (choice,) = strict_json(response.text)["choices"]
        return choice["message"]["content"], choice["logprobs"]["content"]
    content, entries = "", []
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for choice in strict_json(event)["choices"]:
            content += choice["delta"].get("content") or ""
            entries += (choice.get("logprobs") or {}).get("content") or []
    return content, entries


@pytest.mark.parametrize("stream", [False, True])
def test_a_tiny_temperature_with_logprobs_is_greedy_and_valid_json(sidecar, stream):
    """temperature 1e-40 (in OpenAI's [0, 2]; 1 / T overflows float32) is greedy: 200, strict
    JSON, the same content and logprobs as temperature 0, every logprob a finite number <= 0
    (it was a 500, "Out of range float values are not JSON compliant", or "logprob":NaN)."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 8,
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 7,
        "ignore_eos": True,
    }
    content, entries = _chat_raw(sidecar, {**body, "temperature": 1e-40}, stream)
    greedy_content, greedy_entries = _chat_raw(sidecar, {**body, "temperature": 0}, stream)
    assert content == greedy_content and len(entries) == len(greedy_entries) == 8

    def values(entries):  # each token's logprob, then its alternatives'
        return [
            v for e in entries for v in [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]
        ]

    def tokens(entries):
        return [[e["token"]] + [t["token"] for t in e["top_logprobs"]] for e in entries]

    assert tokens(entries) == tokens(greedy_entries)
    # (a prefix-cache hit may change the last bits: the second request reuses the first's KV)
    torch.testing.assert_close(
        torch.tensor(values(entries)), torch.tensor(values(greedy_entries)), atol=1e-5, rtol=0
    )
    assert all(math.isfinite(v) and v <= 0 for v in values(entries))
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)  # the argmax


def test_a_masked_tokens_logprob_is_the_vllm_floor(sidecar, tokenizer):
    """A token no constraint allows has logprob -inf, which JSON cannot carry: it is reported
    as -9999.0, as vLLM's server does, in strict JSON."""
    allowed = tokenizer.encode(" the a", add_special_tokens=False)[:2]
    body = {
        "messages": MESSAGES,
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
        "allowed_token_ids": allowed,
        "ignore_eos": True,
    }
    for stream in (False, True):
        _, entries = _chat_raw(sidecar, body, stream)
        assert len(entries) == 2
        for entry in entries:
            values = [t["logprob"] for t in entry["top_logprobs"]]
            assert values[2:] == [-9999.0, -9999.0] and values[1] > -9999.0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 17}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_out_of_range_n_and_logprobs_are_400(client, sidecar, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=sidecar.model_name, messages=MESSAGES, max_tokens=2, **extra
        )
    assert info.value.response.json()["error"]["param"] == param


def test_closing_an_n_stream_frees_every_choice(client, sidecar):
    # Earlier tests' requests may still be ending (a closed generation is aborted in the
    # background): start from an idle engine.
    assert engine_idle(wait_for_gauges(sidecar.metrics_url, engine_idle, timeout_s=5.0))
    stream = client.chat.completions.create(
        model=sidecar.model_name,
        messages=MESSAGES,
        stream=True,
        n=3,
        max_tokens=2000,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    seen = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.delta.content)
        if seen == {0, 1, 2}:
            break

    def generating(gauges):  # all three choices hold KV pages
        return gauges["tritonllm_requests_running"] == 3 and gauges["tritonllm_kv_pages_used"] > 0

    gauges = wait_for_gauges(sidecar.metrics_url, generating, timeout_s=2.0)
    assert generating(gauges), gauges
    stream.close()
    gauges = wait_for_gauges(sidecar.metrics_url, engine_idle, timeout_s=2.0)
    assert engine_idle(gauges), gauges


def test_legacy_completion_logprobs_from_chat_entries():
    from openai_frontend.logprobs import completion_logprobs

    def entry(token, value, top):
        alternatives = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]
        return {
            "token": token,
            "logprob": value,
            "bytes": list(token.encode()),
            "top_logprobs": alternatives,
        }

    entries = [
        entry("Hi", -0.5, [("Hi", -0.5), ("Yo", -1.0)]),
        entry(" there", -2.0, [(" you", -0.1)]),
    ]
    logprobs, offset = completion_logprobs(entries, text_offset=4)
    assert logprobs == {
        "tokens": ["Hi", " there"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"Hi": -0.5, "Yo": -1.0}, {" you": -0.1, " there": -2.0}],
        "text_offset": [4, 6],
    }
    assert offset == 12
    assert completion_logprobs(None, 3) == (None, 3)


def test_backend_logprobs_json_never_yields_a_non_finite_number():
    """Should the backend send NaN or an infinity (Python's json reads and writes them; JSON has
    none), the sidecar reads them as the backend's floor would: -9999.0, or 0 for +inf."""
    from openai_frontend.logprobs import backend_entries

    raw = (
        '[{"token": "a", "logprob": NaN, "bytes": [97], "top_logprobs": ['
        '{"token": "a", "logprob": -Infinity, "bytes": [97]}, '
        '{"token": "b", "logprob": Infinity, "bytes": [98]}]}]'
    )
    (entry,) = backend_entries(raw)
    assert entry["logprob"] == -9999.0
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-9999.0, 0.0]
    json.dumps(entry, allow_nan=False)  # strict JSON again
    assert backend_entries('[{"logprob": -0.25}]') == [{"logprob": -0.25}]
    with pytest.raises(ValueError):
        backend_entries("[{")


def _chat_ids(client, sidecar, tokenizer, **extra) -> list[int]:
    """The token ids of a greedy 6-token chat answer to MESSAGES (read from its logprobs)."""
    response = client.chat.completions.create(
        model=sidecar.model_name,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
        **extra,
    )
    return [_token_id(tokenizer, e.bytes) for e in response.choices[0].logprobs.content]


def test_logit_bias_bans_and_forces_tokens_as_transformers_predicts(
    client, sidecar, tokenizer, hf_logprobs
):
    """OpenAI's logit_bias through the sidecar and tritonserver: -100 on the token greedy
    answers first bans it everywhere, and each biased answer is the argmax of transformers'
    logits plus the bias at every position; +100 forces a token on chat and completions."""
    plain = _chat_ids(client, sidecar, tokenizer)
    banned = _chat_ids(client, sidecar, tokenizer, logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned
    bias = torch.zeros(hf_logprobs(chat_prompt_ids(tokenizer, MESSAGES), plain).shape[-1])
    bias[plain[0]] = -100
    expected = hf_logprobs(chat_prompt_ids(tokenizer, MESSAGES), banned) + bias
    assert banned == expected.argmax(dim=-1).tolist()

    fox = tokenizer.encode(" fox", add_special_tokens=False)[0]
    forced = _chat_ids(client, sidecar, tokenizer, logit_bias={str(fox): 100})
    assert forced == [fox] * 6
    completion = client.completions.create(
        model=sidecar.model_name, prompt=PROMPT, max_tokens=3, logit_bias={str(fox): 100}
    )
    assert completion.choices[0].text == tokenizer.decode([fox] * 3)


@pytest.mark.parametrize(
    ("bias", "fragment"),
    [
        ({"fox": 1}, "token ids"),  # refused by the sidecar
        ({"7": 100.5}, "[-100, 100]"),  # refused by the sidecar
        ({"1000000000": 1}, "logit_bias token ids must be in [0, "),  # by the engine, via Triton
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(client, sidecar, bias, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=sidecar.model_name, messages=MESSAGES, max_tokens=2, logit_bias=bias
        )
    error = info.value.response.json()["error"]
    assert (error["param"], error["code"]) == ("logit_bias", "invalid_value")
    assert fragment in error["message"]
