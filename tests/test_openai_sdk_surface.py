"""The OpenAI surface SDKs and evaluation tools use, through the real sidecar and tritonserver
(the shared session fixtures): completions with list and token-id prompts, ``echo`` with the
prompt's logprobs (checked against transformers' float32 log_softmax), ``max_tokens: 0`` (how
lm-evaluation-harness scores), the async client, vLLM's extension fields (each honoured, or refused with a
400 naming it), ``stream_options`` only with ``stream``, ``/tokenize`` (with tools) /
``/detokenize`` / ``/version``, the model card's ``max_model_len`` and the sidecar's
``/metrics``."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openai_frontend.extensions import VLLM_FIELDS
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest

PROMPTS = ["The quick brown fox", "Once upon a time there"]
TOL = 1e-4


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(sidecar):
    with httpx.Client(base_url=sidecar.base_url.removesuffix("/v1"), timeout=60) as session:
        yield session


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_list_and_token_prompts_give_prompt_major_choices(client, sidecar, tokenizer, stream):
    """A list of strings, a token-id list and a list of token-id lists each complete like
    single requests; choice index = prompt index * n + i; usage sums the prompts."""
    common = dict(model=sidecar.model_name, max_tokens=6, temperature=0)
    singles = [client.completions.create(prompt=p, **common).choices[0].text for p in PROMPTS]
    token_prompts = [_ids(tokenizer, p) for p in PROMPTS]
    for prompt in (PROMPTS, token_prompts):
        if stream:
            texts = {}
            for chunk in client.completions.create(prompt=prompt, n=2, stream=True, **common):
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
            got = [texts[i] for i in range(4)]
        else:
            response = client.completions.create(prompt=prompt, n=2, **common)
            assert [c.index for c in response.choices] == [0, 1, 2, 3]
            got = [c.text for c in response.choices]
            assert response.usage.prompt_tokens == sum(len(t) for t in token_prompts)
            assert response.usage.completion_tokens == 4 * 6
        assert got == [singles[0], singles[0], singles[1], singles[1]]
    one = client.completions.create(prompt=token_prompts[0], **common)
    assert one.choices[0].text == singles[0]


def test_echo_with_logprobs_scores_the_prompt_like_transformers(
    client, sidecar, tokenizer, hf_logprobs
):
    """echo + logprobs: the text starts with the prompt, the logprobs with the prompt's tokens,
    the first null, the others transformers' log_softmax; max_tokens=0 (lm-evaluation-harness'
    loglikelihood request) gives exactly the prompt."""
    prompt_ids = _ids(tokenizer, PROMPTS[0])
    for max_tokens in (0, 3):
        response = client.completions.create(
            model=sidecar.model_name,
            prompt=prompt_ids,
            max_tokens=max_tokens,
            temperature=0,
            echo=True,
            logprobs=2,
        )
        choice = response.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(PROMPTS[0])
        assert len(lp.tokens) == len(prompt_ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
        new_ids = _ids(tokenizer, choice.text)[len(prompt_ids) :]
        oracle = hf_logprobs(prompt_ids[:1], prompt_ids[1:] + new_ids)
        targets = prompt_ids[1:] + new_ids
        for j, value in enumerate(lp.token_logprobs[1:]):
            assert abs(value - float(oracle[j, targets[j]])) < TOL
            assert len(lp.top_logprobs[j + 1]) >= 2
        assert response.usage.completion_tokens == max_tokens
    echoed = client.completions.create(
        model=sidecar.model_name, prompt=PROMPTS[1], max_tokens=0, echo=True
    )
    assert echoed.choices[0].text == PROMPTS[1] and echoed.choices[0].logprobs is None


def test_echo_streams_the_prompt_logprobs_first(client, sidecar, tokenizer):
    chunks = list(
        client.completions.create(
            model=sidecar.model_name,
            prompt=PROMPTS[0],
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=0,
            stream=True,
        )
    )
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices else [])]
    values = [
        v for c in chunks for v in (c.choices[0].logprobs.token_logprobs if c.choices else [])
    ]
    assert len(tokens) == len(_ids(tokenizer, PROMPTS[0])) + 3
    assert values[0] is None and all(v is not None for v in values[1:])
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(PROMPTS[0])


def test_async_client_chat_and_completions(sidecar):
    async def run():
        client = openai.AsyncOpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model=sidecar.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            n=2,
            logprobs=True,
            top_logprobs=1,
            # end-user and cache hints newer SDK users send (they were 400s)
            user="u-1",
            safety_identifier="u-1-hash",
            prompt_cache_key="support-bot",
        )
        completion = client.completions.create(
            model=sidecar.model_name, prompt=PROMPTS, max_tokens=4, temperature=0
        )
        stream = await client.completions.create(
            model=sidecar.model_name, prompt=PROMPTS[0], max_tokens=4, stream=True
        )
        streamed = [c async for c in stream]
        return (*await asyncio.gather(chat, completion), streamed)

    chat, completion, streamed = asyncio.run(run())
    assert len(chat.choices) == 2 and all(len(c.logprobs.content) == 4 for c in chat.choices)
    assert [c.index for c in completion.choices] == [0, 1]
    assert streamed[-1].choices[0].finish_reason == "length"


ENDPOINTS = {
    "/v1/completions": (CompletionRequest, {"prompt": "hi"}),
    "/v1/chat/completions": (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "hi"}]},
    ),
}
# Completions' own echo / add_special_tokens (tested above and in test_openai_completions).
COMPLETIONS_OWN = {"echo", "add_special_tokens"}
# vLLM fields the request models declare (so ``check_extensions`` never refuses them): a valid
# value, an invalid one, and the (param, code) of the invalid one's 400. Type and range errors
# are the request model's (pydantic's codes); schemas, patterns and grammars are validated by
# the generator (llguidance), whose error names the client's field. What the constraints do to
# the output is tested in test_structured_outputs, the salt's isolation in test_security.
HONOURED = {
    "allowed_token_ids": ("ALLOWED", "OUT_OF_VOCAB", ("allowed_token_ids", "invalid_value")),
    "bad_words": (["fox"], 5, ("bad_words", "list_type")),
    "cache_salt": ("tenant-a", "", ("cache_salt", "string_too_short")),
    "guided_choice": (["yes", "no"], "yes", ("guided_choice", "list_type")),
    "guided_decoding_backend": (
        "guidance",
        "xgrammar",
        ("guided_decoding_backend", "unsupported_parameter"),
    ),
    "guided_grammar": (
        'root ::= "n=" [0-9]',
        "root ::= undefined_rule",
        ("guided_grammar", "invalid_value"),
    ),
    "guided_json": ({"type": "object"}, {"type": 5}, ("guided_json", "invalid_value")),
    "guided_regex": ("[a-z]{2}", "[a-z", ("guided_regex", "invalid_value")),
    "structured_outputs": (
        {"regex": "[a-z]{2}"},
        {"regex": "[a-z"},
        ("structured_outputs.regex", "invalid_value"),
    ),
}


def test_the_honoured_vllm_fields_are_the_declared_ones():
    """Every vLLM field a request model declares has its honour test below, and every other
    one is refused by ``check_extensions`` (the table stays the whole list of vLLM's names)."""
    for model, _ in ENDPOINTS.values():
        declared = {f for f in VLLM_FIELDS if f in model.model_fields} - COMPLETIONS_OWN
        assert declared == set(HONOURED), model.__name__


def _refused_value(noop):
    if isinstance(noop, bool):
        return not noop
    if isinstance(noop, int | float):
        return noop + 1
    if isinstance(noop, list):
        return ["x"]
    return {"x": 1}


@pytest.mark.parametrize("field", sorted(set(VLLM_FIELDS) - set(HONOURED)))
def test_every_unserved_vllm_extension_is_refused_by_name(http, sidecar, field):
    """Each vLLM field the service does not serve: its no-op value is accepted, any other value
    is a 400 unsupported_parameter naming it (none silently ignored)."""
    noop = VLLM_FIELDS[field]
    for path, (model, body) in ENDPOINTS.items():
        if field in model.model_fields:
            continue  # completions declares and honours echo / add_special_tokens
        base = {"model": sidecar.model_name, "max_tokens": 1, **body}
        response = http.post(path, json={**base, field: _refused_value(noop)})
        assert response.status_code == 400, (path, field, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (field, "unsupported_parameter")
        if isinstance(noop, bool | int | float | list):
            assert http.post(path, json={**base, field: noop}).status_code == 200, (path, field)


@pytest.mark.parametrize("field", sorted(HONOURED))
def test_every_served_vllm_extension_is_honoured(http, sidecar, tokenizer, field):
    """Each vLLM field the service serves, on both endpoints: a valid value completes (the
    token mask and the choice and regex constraints visibly shape the text), an invalid one is
    a 400 naming the field with its error code."""
    valid, invalid, expected = HONOURED[field]
    allowed = _ids(tokenizer, " fox")[-1]
    valid = [allowed] if valid == "ALLOWED" else valid
    # A valid int32 past every vocabulary: the engine's range check, not the request model's.
    invalid = [2**31 - 1] if invalid == "OUT_OF_VOCAB" else invalid
    for path, (_, body) in ENDPOINTS.items():
        base = {"model": sidecar.model_name, "max_tokens": 8, "temperature": 0, **body}
        response = http.post(path, json={**base, field: valid})
        assert response.status_code == 200, (path, field, response.text)
        result = response.json()
        choice = result["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        if field == "allowed_token_ids":
            count = result["usage"]["completion_tokens"]
            assert count >= 1 and text == tokenizer.decode([allowed] * count), text
        elif field == "guided_choice":
            assert text in valid and choice["finish_reason"] == "stop", text
        elif field in ("guided_regex", "structured_outputs"):
            assert re.fullmatch("[a-z]{2}", text) and choice["finish_reason"] == "stop", text
        response = http.post(path, json={**base, field: invalid})
        assert response.status_code == 400, (path, field, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == expected, (path, error)


@pytest.mark.parametrize("field", ["frobnicate", "max_output_tokens", "logit_bias_v2"])
def test_a_field_nobody_declares_is_refused_by_name(http, sidecar, field):
    """A field that is neither a request model's nor vLLM's is a 400 naming it, as OpenAI's
    "Unrecognized request argument" (never silently ignored); the service answers after it."""
    for path, (_, body) in ENDPOINTS.items():
        base = {"model": sidecar.model_name, "max_tokens": 1, **body}
        response = http.post(path, json={**base, field: 1})
        assert response.status_code == 400, (path, field, response.text)
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (field, "unsupported_parameter"), error
        assert http.post(path, json=base).status_code == 200


def test_stream_options_only_with_stream(http, sidecar):
    body = {"model": sidecar.model_name, "prompt": "hi", "max_tokens": 1}
    refused = http.post("/v1/completions", json={**body, "stream_options": {"include_usage": 1}})
    assert refused.status_code == 400
    options = {"stream_options": {"include_usage": True}}
    response = http.post("/v1/completions", json={**body, **options})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
    streamed = http.post("/v1/completions", json={**body, **options, "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


def test_tokenize_detokenize_version_and_model_card(http, sidecar, tokenizer, tiny_model_dir):
    """/tokenize gives the tokenizer's ids (a chat through the chat template with the
    generation prompt), /detokenize their text, /v1/models the context limit."""
    model = sidecar.model_name
    text = PROMPTS[0]
    tokens = http.post("/tokenize", json={"model": model, "prompt": text}).json()
    assert tokens["tokens"] == tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"model": model, "messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = http.post("/detokenize", json={"model": model, "tokens": tokens["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(tokens["tokens"])}
    bad = http.post("/detokenize", json={"model": model, "tokens": [len(tokenizer) + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/detokenize", json={"model": model, "tokens": []}).json() == {"prompt": ""}
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    import tritonllm

    assert http.get("/version").json() == {"version": tritonllm.__version__}
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == model and card["root"] == model
    assert card["max_model_len"] == tokens["max_model_len"] > 0
    time.sleep(1.1)  # created is the sidecar's start, not the time of the call
    assert http.get(f"/v1/models/{model}").json()["created"] == card["created"] <= time.time()


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tokenize_renders_tools_as_a_chat_completion_does(http, client, sidecar, tokenizer):
    """vLLM's /tokenize takes tools: the ids are the prompt a chat completion with the same
    tools feeds the model (its prompt_tokens; the tokenizer model's renderer). A tool's
    invalid schema is refused as the chat endpoint refuses it; tools need messages."""
    from tritonllm.tokenization.chat import encode_chat

    model, messages = sidecar.model_name, [{"role": "user", "content": "Weather in Rome?"}]
    body = {"model": model, "messages": messages, "tools": [WEATHER_TOOL]}
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    ids = response.json()["tokens"]
    assert ids == encode_chat(tokenizer, messages, tools=[WEATHER_TOOL])
    chat = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=1
    )
    plain = http.post("/tokenize", json={"model": model, "messages": messages}).json()["tokens"]
    assert len(ids) == chat.usage.prompt_tokens > len(plain)
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    bad = http.post("/tokenize", json={**body, "tools": [bad_tool]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tools[0].function.parameters"
    with_prompt = http.post("/tokenize", json={"model": model, "prompt": "x", "tools": []})
    assert with_prompt.status_code == 400 and with_prompt.json()["error"]["param"] == "tools"


def test_metrics_count_requests_tokens_and_latencies(http, client, sidecar):
    def scrape():
        text = http.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    route = (("route", "/v1/completions"), ("status", "200"))
    before = scrape()
    chunks = list(
        client.completions.create(
            model=sidecar.model_name, prompt=PROMPTS[0], max_tokens=5, stream=True
        )
    )
    assert chunks

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    # The request is counted once its last byte is sent, which the client may see before the
    # server's middleware has run past that send: poll briefly.
    deadline = time.monotonic() + 10
    while True:
        after = scrape()
        if delta("openai_requests_total", route) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert delta("openai_requests_total", route) == 1
    assert delta("openai_generation_tokens_total") == 5
    assert delta("openai_prompt_tokens_total") > 0
    assert delta("openai_time_to_first_token_seconds_count") == 1
    assert delta("openai_inter_token_latency_seconds_count") == 4
    e2e = (("route", "/v1/completions"),)
    assert delta("openai_e2e_request_latency_seconds_count", e2e) == 1
    assert after[("openai_requests_in_flight", ())] == 0  # idle; the scrape is not counted


def test_generator_exports_latency_histograms_to_triton(client, sidecar):
    """The generator's Triton custom metrics include the TTFT / ITL / queue / e2e histograms
    (observed on their own thread after the sender thread's tick, so polled). The request
    streams at least two responses with tokens, so that it has an inter-token gap of its own
    (run alone, a 3-token request could come back in one coalesced response: no ITL sample)."""
    stream = client.completions.create(
        model=sidecar.model_name,
        prompt=PROMPTS[1],
        max_tokens=32,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c for c in stream if c.choices and c.choices[0].text]
    assert len(chunks) >= 2, chunks
    names = (
        "tritonllm_time_to_first_token_seconds_count",
        "tritonllm_inter_token_latency_seconds_count",
        "tritonllm_request_queue_time_seconds_count",
        "tritonllm_e2e_request_latency_seconds_count",
    )
    counts: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(sidecar.metrics_url, timeout=10).text
        counts = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name in names
        }
        if len(counts) == len(names) and all(v > 0 for v in counts.values()):
            break
        time.sleep(0.2)
    assert set(counts) == set(names) and all(v > 0 for v in counts.values()), counts


def _ttft_count(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tritonllm_time_to_first_token_seconds_count"
    )


def test_health_probe_generations_are_no_latency_samples(client, sidecar, triton_server):
    """Generations whose request id is the sidecar's probe prefix (``health-``) add no TTFT
    sample (QA: on an idle server the probes, one every few seconds, were most of the TTFT /
    end-to-end samples); a client's request still adds one."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from tritonllm.contract.tensors import HEALTH_PROBE_ID_PREFIX

    def settled() -> float:  # the count once a tick has passed with nothing new
        last, deadline = _ttft_count(sidecar.metrics_url), time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(1.5)
            now = _ttft_count(sidecar.metrics_url)
            if now == last:
                return now
            last = now
        return last

    before = settled()
    grpc = grpcclient.InferenceServerClient(triton_server.grpc_url)
    done: list = []
    grpc.start_stream(callback=lambda result, error: done.append(error or result))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"health"], dtype=object))
    tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
    tokens.set_data_from_numpy(np.array([1], np.int32))
    for i in range(3):
        grpc.async_stream_infer("llm", [text, tokens], request_id=f"{HEALTH_PROBE_ID_PREFIX}t{i}")
    grpc.stop_stream()
    grpc.close()
    assert not [d for d in done if isinstance(d, Exception)], done
    assert settled() == before
    client.completions.create(model=sidecar.model_name, prompt=PROMPTS[1], max_tokens=2)
    deadline = time.monotonic() + 30
    while _ttft_count(sidecar.metrics_url) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert settled() == before + 1
