"""Structured outputs and tool calls through the real service (tritonserver + sidecar, the
tiny random-weight Qwen3, the openai SDK and LangChain as clients):

- 20 generated JSON schemas as ``response_format`` ``json_schema``: every output parses and
  validates, streamed and not, greedy and sampled, batched with unconstrained requests whose
  outputs equal their outputs alone; vLLM's guided_regex / guided_choice / guided_grammar and
  ``structured_outputs`` match.
- An invalid schema, pattern or tool parameters schema is a 400 naming the client's field (a
  tool's parameters schema with any ``tool_choice``).
- ``tool_choice`` named / ``required``: the arguments validate against the tool's parameters
  schema, non-streamed as ``message.tool_calls`` and streamed as OpenAI's deltas (id, type and
  name first, then argument fragments), with OpenAI's finish_reason; ``parallel_tool_calls``
  false gives one call; a history with assistant tool calls and tool results is rendered;
  a ``required`` array cut by ``max_tokens`` is the content (finish_reason ``length``, no
  tool_calls), streamed and not; a cut named call keeps its incomplete arguments; a
  ``response_format`` given with a forced choice gives way to it (vLLM's own constraint fields
  still conflict); a forced function without ``parameters`` is called with ``{}``.
- The openai SDK's ``chat.completions.parse`` and LangChain's ``with_structured_output``
  (json_schema and function_calling) and ``bind_tools`` return valid objects.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from structured_helpers import generated_schemas

SCHEMAS = generated_schemas(20)
MAX_TOKENS = 400  # far above what the bounded schemas need: their outputs end by the grammar

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.base_url, api_key="x", max_retries=0, timeout=300)


def _aclient(sidecar):
    return openai.AsyncOpenAI(base_url=sidecar.base_url, api_key="x", max_retries=0, timeout=300)


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


async def _text(aclient, stream: bool, **kwargs) -> tuple[str, str | None]:
    if not stream:
        response = await aclient.chat.completions.create(**kwargs)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, reason = [], None
    async for chunk in await aclient.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


def test_generated_schemas_validate_batched_with_unchanged_neighbours(sidecar):
    model = sidecar.model_name

    def plain(i):
        return _text(
            aclient,
            False,
            model=model,
            max_tokens=12,
            seed=100 + i,
            messages=[{"role": "user", "content": f"Tell me something, {i}"}],
            temperature=0.0 if i % 2 else 0.9,
        )

    async def main():
        alone = [await plain(i) for i in range(4)]
        jobs = [
            _text(
                aclient,
                k % 2 == 1,
                model=model,
                max_tokens=MAX_TOKENS,
                seed=k,
                messages=[{"role": "user", "content": f"Give me JSON #{k}"}],
                response_format=_format(schema),
                temperature=(0.0, 1.0)[k // 2 % 2],
            )
            for k, schema in enumerate(SCHEMAS)
        ]
        results = await asyncio.gather(*jobs, *(plain(i) for i in range(4)))
        return alone, results[: len(jobs)], results[len(jobs) :]

    aclient = _aclient(sidecar)
    alone, constrained, batched = asyncio.run(main())
    for k, (text, reason) in enumerate(constrained):
        assert reason == "stop", (k, text)
        jsonschema.validate(json.loads(text), SCHEMAS[k])
    assert batched == alone


def test_guided_regex_choice_grammar_and_structured_outputs_match(sidecar):
    cases = [
        ({"guided_regex": r"[a-z]{2,5}-[0-9]{2}"}, r"[a-z]{2,5}-[0-9]{2}"),
        ({"guided_choice": ["yes", "no", "maybe so"]}, r"yes|no|maybe so"),
        ({"guided_grammar": 'root ::= "n=" [0-9] [0-9]?'}, r"n=[0-9]{1,2}"),
        ({"structured_outputs": {"regex": r"[A-Z]{3}"}}, r"[A-Z]{3}"),
    ]

    async def main():
        aclient = _aclient(sidecar)
        return await asyncio.gather(
            *(
                _text(
                    aclient,
                    i % 2 == 0,
                    model=sidecar.model_name,
                    messages=USER,
                    max_tokens=50,
                    temperature=0.8,
                    seed=i,
                    extra_body=extra,
                )
                for i, (extra, _) in enumerate(cases)
            )
        )

    for (text, reason), (extra, pattern) in zip(asyncio.run(main()), cases, strict=True):
        assert reason == "stop" and re.fullmatch(pattern, text), (extra, text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": _format({"type": "no-such-type"})},
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"guided_regex": "[a-z"}}, "guided_regex"),
        # valid, but beyond llguidance's lexer limits at the first token (a fresh-user QA case)
        ({"extra_body": {"guided_regex": "b{500000}"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
        ({"extra_body": {"guided_grammar": "root ::= root"}}, "guided_grammar"),
        # integers that crashed the generator's stub (SIGSEGV in llguidance 1.9.1)
        ({"extra_body": {"guided_json": {"enum": [-(2**63)]}}}, "guided_json"),
        # QA: dropped as if absent; nothing could be sampled (vLLM refuses it too)
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
        # its matcher builds grew the generator past 9 GB (validation took it at once)
        ({"extra_body": {"guided_json": {"type": "integer", "multipleOf": 2**31}}}, "guided_json"),
        (
            {"extra_body": {"guided_grammar": 'start: %json{"const": -9223372036854775808}'}},
            "guided_grammar",
        ),
        ({"extra_body": {"guided_json": {"type": "object"}, "guided_regex": "a"}}, "guided_regex"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": 5}}},
                        },
                    }
                ],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        # two tools of one name: a call could not say which it means (any tool_choice)
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f"}},
                    {"type": "function", "function": {"name": "g"}},
                    {"type": "function", "function": {"name": "f", "parameters": {}}},
                ]
            },
            "tools[2].function.name",
        ),
    ],
)
def test_an_invalid_constraint_is_a_400_naming_the_field(client, sidecar, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=sidecar.model_name, messages=USER, max_tokens=5, **extra
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert "structured_outputs." not in info.value.body["message"], info.value.body  # its name
    assert "<state>" not in info.value.body["message"], info.value.body  # no parser internals


@pytest.mark.parametrize("conflict", [False, True])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_constraint_failing_while_generating_names_the_field_with_n_choices(
    client, sidecar, tokenizer, route, conflict
):
    """QA: with ``n`` > 1 and no stream, a constraint that broke after the first token failed
    naming the backend's ``structured_outputs.regex``: the error reached the client from
    collecting the choices, which did not rename it (n=1 and streams did). And allowed token ids
    that leave no token the grammar allows failed as a server fault; now a 400 naming them.
    Both break at a later token (the first is sent before): llguidance's lexer limit four
    tokens in (after "x" and up to 3 letters), and allowed ids that allow "7" but no "a"."""
    kwargs = {"model": sidecar.model_name, "max_tokens": 5, "n": 2, "temperature": 1.0}
    if conflict:
        (seven,) = tokenizer.encode("7", add_special_tokens=False)
        kwargs["extra_body"] = {"guided_regex": "7a+", "allowed_token_ids": [seven]}
        field, message = "allowed_token_ids", "allowed_token_ids leaves no token to sample"
    else:
        kwargs["extra_body"] = {"guided_regex": "x[a-z]{1,3}(c{100000})"}
        field, message = "guided_regex", "guided_regex failed while generating"
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(messages=USER, **kwargs)
        else:
            client.completions.create(prompt="say", **kwargs)
    assert info.value.body["param"] == field, info.value.body
    assert info.value.body["message"].startswith(message), info.value.body
    # the service goes on
    ok = client.completions.create(
        model=sidecar.model_name, prompt="say", max_tokens=2, temperature=0
    )
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_an_invalid_tool_parameters_schema_is_a_400_with_any_tool_choice(
    client, sidecar, tool_choice
):
    """OpenAI refuses an invalid function parameters schema also when no choice forces the
    tool (nothing compiles it then): checked against the JSON Schema meta-schema."""
    bad = {"type": "object", "properties": {"days": {"type": "integer", "minimum": "one"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": bad}}]
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=sidecar.model_name, messages=USER, max_tokens=2, tools=tools, **extra
        )
    body = info.value.body
    assert info.value.status_code == 400 and body["code"] == "invalid_value", body
    assert body["param"] == "tools[1].function.parameters", body
    assert "properties.days.minimum" in body["message"], body  # where in the schema


@pytest.mark.parametrize(
    "root", [{"type": "string", "maxLength": 10}, {"type": ["object", "null"]}]
)
def test_a_tool_parameters_schema_of_another_root_type_is_a_400(client, sidecar, root):
    """QA: a named function whose ``parameters`` was a string schema was called with
    ``"arguments": "\\"https://en\\""``; OpenAI refuses a root that is no object schema."""
    for extra in ({}, {"tool_choice": {"type": "function", "function": {"name": "f"}}}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=sidecar.model_name,
                messages=USER,
                max_tokens=2,
                tools=[{"type": "function", "function": {"name": "f", "parameters": root}}],
                **extra,
            )
        body = info.value.body
        assert body["param"] == "tools[0].function.parameters", body
        assert body["code"] == "invalid_value" and 'type "object"' in body["message"], body


def test_a_tool_parameters_schema_without_a_type_is_called_with_an_object(client, sidecar):
    """A root without ``type`` is generated as an object schema: the arguments are an object."""
    parameters = {
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
        "additionalProperties": False,
    }
    (c,) = client.chat.completions.create(
        model=sidecar.model_name,
        messages=USER,
        tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        tool_choice={"type": "function", "function": {"name": "f"}},
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=11,
    ).choices
    assert c.finish_reason == "stop", c
    arguments = json.loads(c.message.tool_calls[0].function.arguments)
    assert isinstance(arguments, dict) and 0 <= arguments["a"] <= 99, arguments


def _check_calls(calls, parallel: bool) -> None:
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_choices_validate_non_streamed(client, sidecar, choice):
    tool_choice = (
        {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    )
    raw = client.chat.completions.with_raw_response.create(
        model=sidecar.model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        n=2,
    )
    response = raw.parse()
    for wire in raw.http_response.json()["choices"]:  # content null, the calls present
        assert wire["message"]["content"] is None and len(wire["message"]["tool_calls"]) == 1
    for c in response.choices:
        _check_calls(c.message.tool_calls, parallel=False)
        assert c.message.content is None
        assert c.finish_reason == ("stop" if choice == "named" else "tool_calls")
        if choice == "named":
            assert c.message.tool_calls[0].function.name == "get_time"


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_stream_as_openai_deltas(client, sidecar, choice):
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}}
        if choice == "named"
        else "required"
    )
    stream = client.chat.completions.create(
        model=sidecar.model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        choice_ = chunk.choices[0]
        assert not choice_.delta.content
        for d in choice_.delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta: id, type and name
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments}
            else:  # then only argument fragments
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        if choice_.finish_reason:
            reasons.append(choice_.finish_reason)
    assert reasons == ["stop" if choice == "named" else "tool_calls"]
    assert sorted(calls) == list(range(len(calls))) and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    if choice == "named":
        assert [c["name"] for c in calls.values()] == ["get_weather"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_choice_wins_over_response_format(client, sidecar, choice, stream):
    """QA: an agent of the OpenAI Agents SDK with an ``output_type`` and
    ``tool_choice="required"`` sends ``response_format`` json_schema with the forced choice,
    which OpenAI and vLLM take (response_format shapes content; a forced call has none); it was
    a 400. The forced call's constraint applies, the calls validate."""
    tool_choice = (
        {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    )
    kwargs = dict(
        model=sidecar.model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice=tool_choice,
        response_format=_format({"type": "object", "properties": {"answer": {"type": "string"}}}),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    if not stream:
        c = client.chat.completions.create(**kwargs).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        reason = c.finish_reason
    else:
        with client.chat.completions.stream(**kwargs) as s:
            final = s.get_final_completion()
        calls = [
            (t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls
        ]
        reason = final.choices[0].finish_reason
    assert reason == ("stop" if choice == "named" else "tool_calls")
    assert calls and (choice == "required" or [n for n, _ in calls] == ["get_time"])
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMS[name])


@pytest.mark.parametrize("parameters", [None, {}])
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_function_without_parameters_is_called_with_no_arguments(
    client, sidecar, choice, parameters
):
    """QA: a forced function without ``parameters`` was constrained to any JSON object, and the
    random model wrote keys of its own until max_tokens (never a whole call). OpenAI: omitting
    ``parameters`` defines a function with an empty parameter list, so its arguments are
    ``{}``."""
    function: dict = {"name": "now", "description": "The current time."}
    if parameters is not None:
        function["parameters"] = parameters
    tool_choice = (
        {"type": "function", "function": {"name": "now"}} if choice == "named" else "required"
    )
    (c,) = client.chat.completions.create(
        model=sidecar.model_name,
        messages=USER,
        tools=[{"type": "function", "function": function}],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=1.0,
        seed=5,
    ).choices
    assert c.finish_reason == ("stop" if choice == "named" else "tool_calls"), c
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("now", {})
    ]


def test_vllm_constraints_still_conflict_with_a_forced_tool_choice(client, sidecar):
    """Only OpenAI's response_format gives way to a forced call; a constraint of vLLM's own
    fields with one is still a 400 naming it, and an invalid tool schema under a forced choice
    with a response_format names the tool's parameters."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=sidecar.model_name,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "[0-9]+"}},
        )
    assert info.value.body["param"] == "structured_outputs", info.value.body
    assert "cannot be combined" in info.value.body["message"], info.value.body
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=sidecar.model_name,
            messages=USER,
            tools=[{"type": "function", "function": {"name": "f", "parameters": bad}}],
            tool_choice={"type": "function", "function": {"name": "f"}},
            response_format={"type": "json_object"},
            max_tokens=5,
        )
    assert info.value.body["param"] == "tools[0].function.parameters", info.value.body


# Tools whose calls are ASCII JSON (enums and integers), so the token texts join to the output.
DAYS = {
    "type": "object",
    "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["days"],
    "additionalProperties": False,
}
ASCII_TOOLS = [
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
    {"type": "function", "function": {"name": "get_days", "parameters": DAYS}},
]


def _required_call(client, sidecar, seed, max_tokens, stream=False):
    """A ``required`` choice sampled with ``seed``: (calls as (name, arguments) pairs, content,
    finish_reason, token texts, or None streamed)."""
    kwargs = dict(
        model=sidecar.model_name,
        messages=USER,
        tools=ASCII_TOOLS,
        tool_choice="required",
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
    )
    if not stream:
        (c,) = client.chat.completions.create(logprobs=True, **kwargs).choices
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        tokens = [t.token for t in c.logprobs.content]
        return calls, c.message.content, c.finish_reason, tokens
    calls, content, reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = (d.function.name, "")
            calls[d.index] = (calls[d.index][0], calls[d.index][1] + d.function.arguments)
        reason = chunk.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], content, reason, None


def test_a_required_array_cut_by_max_tokens_is_its_content(client, sidecar):
    """A tool-call array cut by max_tokens (finish_reason "length") loses nothing it generated,
    as OpenAI keeps a cut output: it is no list of calls, so its text is the content and there
    are no tool_calls, cut inside the first call or after a complete one, streamed and not.
    Oracle: the same seeded request uncut (its output starts with the cut one's tokens)."""
    for seed in range(32):  # a seed whose array has two calls or more
        full_calls, _, reason, tokens = _required_call(client, sidecar, seed, MAX_TOKENS)
        if len(full_calls) >= 2:
            break
    assert reason == "tool_calls" and len(full_calls) >= 2, (seed, full_calls)
    items = [f'{{"name": "{name}", "parameters": {args}}}' for name, args in full_calls]
    # The compact JSON of the grammar (the stop token the grammar then allowed has no entry).
    assert "".join(tokens) == "[" + ", ".join(items) + "]", tokens
    first_end = 1 + len(items[0])
    ends = [len("".join(tokens[:k])) for k in range(len(tokens) + 1)]
    cuts = [
        next(k for k, end in enumerate(ends) if end >= first_end // 2),  # in the first call
        next(k for k, end in enumerate(ends) if end >= first_end + 4),  # in the second
    ]
    for k in cuts:
        calls, content, reason, cut_tokens = _required_call(client, sidecar, seed, k)
        assert cut_tokens == tokens[:k]  # the oracle's premise: a prefix of the uncut output
        assert (calls, content, reason) == ([], "".join(tokens[:k]), "length"), k
        streamed = _required_call(client, sidecar, seed, k, stream=True)
        assert streamed[:3] == ([], content, "length"), k


def test_tool_call_history_is_rendered_into_the_prompt(client, sidecar):
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and 21 degrees"},
    ]

    def prompt_tokens(messages):
        return client.chat.completions.create(
            model=sidecar.model_name, messages=messages, tools=TOOLS, max_tokens=1
        ).usage.prompt_tokens

    base, full = prompt_tokens(USER), prompt_tokens(history)
    # The call and its result are in the prompt (not dropped): dozens of tokens more.
    assert full > base + 20


class Weather(BaseModel):
    city: str = Field(min_length=1, max_length=10)
    days: int = Field(ge=1, le=7)
    sunny: bool


def test_openai_sdk_parse_returns_the_pydantic_model(client, sidecar):
    completion = client.chat.completions.parse(
        model=sidecar.model_name, messages=USER, response_format=Weather, max_tokens=MAX_TOKENS
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather)


def test_langchain_structured_output_and_bound_tools(sidecar):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=sidecar.model_name,
        base_url=sidecar.base_url,
        api_key="x",
        max_retries=0,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(Weather, method=method).invoke("Weather in Rome?")
        assert isinstance(result, Weather), method
    message = llm.bind_tools(TOOLS, tool_choice="required").invoke("Weather in Rome?")
    assert message.tool_calls
    for call in message.tool_calls:
        jsonschema.validate(call["args"], PARAMS[call["name"]])


def test_a_named_call_cut_by_max_tokens_keeps_its_arguments_as_streamed(client, sidecar):
    """A named choice cut by max_tokens: its call with the arguments generated so far (the
    same text its stream sent), not content; finish_reason "length"."""
    kwargs = dict(
        model=sidecar.model_name,
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=3,
        temperature=0.0,
    )
    (c,) = client.chat.completions.create(**kwargs).choices
    assert c.finish_reason == "length" and c.message.content is None
    ((name, arguments),) = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    streamed = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for d in chunk.choices[0].delta.tool_calls or []:
            streamed += d.function.arguments
    assert name == "get_time" and arguments == streamed and arguments.startswith("{")
