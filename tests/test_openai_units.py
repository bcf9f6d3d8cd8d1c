"""Sidecar pieces that need no tritonserver: stop strings, tensor encoding, request mapping, and
the HTTP error contract in front of an unreachable Triton."""

from __future__ import annotations

import json
import re
import time
import types
import typing

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from tritonclient.grpc import InferInput, InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from openai_frontend import create_app
from openai_frontend.errors import OpenAIError
from openai_frontend.extensions import OPENAI_FIELDS
from openai_frontend.generation import to_openai_error
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.sampling import chat_inputs, completion_inputs
from openai_frontend.structured import constraint_inputs
from openai_frontend.triton_client import InputSpec, TritonError, encode_tensor, parse_chunk
from tritonllm.contract.errors import ErrorCode, encode_error
from tritonllm.triton_server import free_port


@pytest.mark.parametrize(
    ("value", "spec", "dtype"),
    [
        ("héllo", InputSpec("BYTES", (1,)), "BYTES"),
        ([3, 1, 4], InputSpec("INT32", (-1,)), "INT32"),
        (7, InputSpec("INT64", (1,)), "INT64"),
        (0.5, InputSpec("FP32", (1,)), "FP32"),
        (True, InputSpec("BOOL", (1,)), "BOOL"),
        (5, InputSpec("INT32", (-1, 1)), "INT32"),
    ],
)
def test_encode_tensor_matches_tritonclient(value, spec, dtype):
    """Our raw tensor bytes and shapes equal what tritonclient's InferInput would send."""
    tensor, raw = encode_tensor("x", value, spec)
    values = value if isinstance(value, list) else [value]
    if dtype == "BYTES":
        array = np.array([v.encode() for v in values], dtype=np.object_)
    else:
        array = np.array(
            values,
            dtype={"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}[
                dtype
            ],
        )
    array = array.reshape(list(tensor.shape))
    reference = InferInput("x", list(array.shape), dtype)
    reference.set_data_from_numpy(array)
    assert raw == reference._get_content()
    assert list(tensor.shape) == list(reference.shape())
    assert tensor.datatype == dtype


@pytest.mark.parametrize("count_dtype", [np.int32, np.int64])
def test_parse_chunk_matches_tritonclient_infer_result(count_dtype):
    """Each output's first element reads as tritonclient's InferResult.as_numpy reads it."""
    response = service_pb2.ModelInferResponse()
    outputs = {
        "text_output": np.array(["héllo €".encode()], dtype=np.object_),
        "finish_reason": np.array([b"stop"], dtype=np.object_),
        "num_input_tokens": np.array([17], dtype=count_dtype),
        "num_output_tokens": np.array([3], dtype=count_dtype),
        "cached_tokens": np.array([16], dtype=count_dtype),
    }
    for name, array in outputs.items():
        dtype = "BYTES" if array.dtype == np.object_ else str(array.dtype).upper()
        response.outputs.add(name=name, datatype=dtype, shape=[1])
        raw = serialize_byte_tensor(array).item() if dtype == "BYTES" else array.tobytes()
        response.raw_output_contents.append(raw)
    chunk = parse_chunk(response)
    reference = InferResult(response)
    assert chunk.text == reference.as_numpy("text_output")[0].decode()
    assert chunk.finish_reason == reference.as_numpy("finish_reason")[0].decode()
    for name in ("num_input_tokens", "num_output_tokens", "cached_tokens"):
        assert getattr(chunk, name) == int(reference.as_numpy(name)[0])
    # An ensemble response without outputs (the empty final one) reads as nothing at all.
    empty = parse_chunk(service_pb2.ModelInferResponse())
    assert (empty.text, empty.finish_reason, empty.num_output_tokens) == ("", "", 0)


FULL_SPECS = {
    name: InputSpec("FP32", (1,))
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "ignore_eos",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "stream",
        "enable_thinking",
    )
}


def test_chat_inputs_send_only_given_fields():
    req = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        max_completion_tokens=5,
        temperature=0,
        top_k=3,
        stop_token_ids=[7],
        chat_template_kwargs={"enable_thinking": False},
    )
    inputs = chat_inputs(req, FULL_SPECS, backend_stream=False)
    assert inputs == {
        "messages": json.dumps(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        ),
        "max_tokens": 5,
        "temperature": 0.0,
        "top_k": 3,
        "stop_token_ids": [7],
        "stream": False,
        "enable_thinking": False,
    }


@pytest.mark.parametrize(
    ("extra", "sent"),
    [
        ({}, {"json": {"type": "boolean"}}),
        ({"guided_decoding_backend": "auto"}, {"json": {"type": "boolean"}}),
        (
            {"guided_decoding_backend": "guidance"},
            {"backend": "guidance", "json": {"type": "boolean"}},
        ),
    ],
)
def test_guided_decoding_backend_guidance_travels_with_the_constraint(extra, sent):
    """``guidance`` asks for llguidance on every mask, so it reaches the generator as the
    constraint's ``backend`` (which `StructuredOutputs` honours); ``auto`` leaves the choice
    to the generator."""
    req = CompletionRequest(prompt="x", guided_json={"type": "boolean"}, **extra)
    inputs = constraint_inputs(req, {"structured_outputs": InputSpec("BYTES", (1,))})
    assert json.loads(inputs["structured_outputs"]) == sent


def test_unsupported_fields_are_400_unless_noop():
    specs = {"max_tokens": InputSpec("INT32", (1,))}
    base = {"messages": [{"role": "user", "content": "hi"}]}
    # No-op values of inputs the backend lacks are accepted silently.
    chat_inputs(
        ChatCompletionRequest(**base, presence_penalty=0.0, repetition_penalty=1.0, logit_bias={}),
        specs,
        backend_stream=True,
    )
    for extra in (
        {"presence_penalty": 0.5},
        {"top_k": 2},
        {"logprobs": True},
        {"n": 2},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"logit_bias": {"50256": -100}},
    ):
        with pytest.raises(OpenAIError) as info:
            chat_inputs(ChatCompletionRequest(**base, **extra), specs, backend_stream=True)
        assert info.value.status == 400
    # A backend without the inputs refuses echo, logprobs and token-id prompts.
    for extra, prompt in (
        ({"echo": True}, "x"),
        ({"logprobs": 1}, "x"),
        ({"prompt": [1, 2]}, [1, 2]),
        ({"logit_bias": {"7": 5.0}}, "x"),
    ):
        request = CompletionRequest(**{"prompt": "x", **extra})
        with pytest.raises(OpenAIError) as info:
            completion_inputs(request, specs, True, prompt)
        assert info.value.status == 400


def test_triton_errors_map_to_openai_statuses_by_code():
    def backend(code, message, param=None):
        return TritonError(f"in ensemble 'llm', {encode_error(code, message, param)}")

    too_long = backend(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt (5000 tokens) ...", "prompt")
    error = to_openai_error(too_long, "messages")
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    top_p = to_openai_error(backend(ErrorCode.INVALID_VALUE, "top_p must be ...", "top_p"), "x")
    assert (top_p.status, top_p.code, top_p.param) == (400, "invalid_value", "top_p")
    assert to_openai_error(TritonError("connection refused", unavailable=True), "x").status == 503
    # The backend's own failures (a dead engine) are not the client's fault.
    dead = to_openai_error(backend(ErrorCode.INTERNAL_ERROR, "the engine process died"), "x")
    assert (dead.status, dead.type, dead.param) == (500, "server_error", None)
    gone = to_openai_error(backend(ErrorCode.ENGINE_UNAVAILABLE, "not running"), "x")
    assert (gone.status, gone.code) == (503, "service_unavailable")
    # An error without the wire form is Triton's own (a stub that died): a server error, even
    # when its words look like a client's mistake.
    triton = to_openai_error(TritonError("Stub process is not healthy: invalid value"), "x")
    assert (triton.status, triton.type) == (500, "server_error")
    # Chat names the logprob count top_logprobs.
    logprobs = backend(ErrorCode.INVALID_VALUE, "logprobs must be ...", "logprobs")
    assert to_openai_error(logprobs, "messages").param == "top_logprobs"
    assert to_openai_error(logprobs, "prompt").param == "logprobs"
    # The tokenizer's enable_thinking input comes from chat_template_kwargs.
    thinking = backend(ErrorCode.UNSUPPORTED_PARAMETER, "no such option", "enable_thinking")
    assert to_openai_error(thinking, "messages").param == "chat_template_kwargs.enable_thinking"


@pytest.fixture(scope="module")
def offline_app():
    """The app in front of a port where no Triton listens."""
    with TestClient(create_app(f"127.0.0.1:{free_port()}", "tiny")) as client:
        yield client


def _assert_openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny", "messages": []}, "messages"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
            "temperature",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": -0.1}, "top_p"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "tiny"}, "messages"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2**40},
            "max_tokens",
        ),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "stop_token_ids": [-1],
            },
            "stop_token_ids.0",
        ),
    ],
)
def test_invalid_bodies_are_openai_400s(offline_app, body, param):
    error = _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


_JSON = "application/json"
_BODY = b'{"model": "tiny", "prompt": "x"}'


@pytest.mark.parametrize(
    ("content", "content_type", "code", "says"),
    [
        (b'{"prompt": "x",', _JSON, "invalid_json", "at line 1 column 16 (character 15)"),
        (b'{\n "prompt": "x",\n "n": 2,,\n}', _JSON, "invalid_json", "at line 3 column 9"),
        (b'{"prompt": "\xff"}', _JSON, "invalid_json", "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, _JSON, "invalid_json", "nested too deeply"),
        (_BODY, "text/plain", "invalid_type", "Content-Type: application/json"),
        (b"prompt=x", "application/x-www-form-urlencoded", "invalid_type", "Content-Type"),
        (_BODY, None, "invalid_type", "Content-Type: application/json"),
        (b'[{"prompt": "x"}]', _JSON, "invalid_type", "got an array"),
        (b'"x"', _JSON, "invalid_type", "got a string"),
        (b"7", _JSON, "invalid_type", "got a number"),
        (b"null", _JSON, "invalid_type", "got null"),
        (b"", _JSON, "invalid_type", "no body"),
    ],
)
def test_a_body_that_is_no_json_object_is_an_openai_400(
    offline_app, content, content_type, code, says
):
    """OpenAI's error body, invalid_request_error, saying that the body must be a JSON object
    (and where malformed JSON failed to parse); the code tells malformed JSON (invalid_json)
    from a body of another type or not sent as JSON (invalid_type), never pydantic's words."""
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        error = _assert_openai_error(offline_app.post(path, content=content, headers=headers), 400)
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            code,
            None,
        )
        assert "JSON object" in error["message"] and says in error["message"], error


@pytest.mark.parametrize(
    "body", [{}, {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}]
)
def test_tokenize_needs_exactly_one_of_prompt_and_messages(offline_app, body):
    """QA: a JSON object that breaks /tokenize's rule was called "no JSON object, got a
    number"; it is the rule's own 400."""
    error = _assert_openai_error(offline_app.post("/tokenize", json=body), 400)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")
    assert "exactly one of prompt or messages" in error["message"], error


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ({"n": 16, "max_tokens": 1024}, True),  # QA: 1,048,576 tokens in one request
        ({"n": 2, "max_tokens": 129}, True),  # 64 x 2 x 129 = 16,512
        ({"n": 16}, False),  # 64 x 16 x the default 16 = 16,384: the cap itself
        ({"n": 2, "max_tokens": 128}, False),
    ],
)
def test_a_list_of_prompts_shares_the_output_token_cap(offline_app, extra, refused):
    """Each prompt of a list is a generation of its own, which the generator holds to
    ``n x max_tokens <= 16384``; the request as a whole is held to it too."""
    body = {"model": "tiny", "prompt": ["hi"] * 64, **extra}
    response = offline_app.post("/v1/completions", json=body)
    if refused:
        error = _assert_openai_error(response, 400)
        assert (error["code"], error["param"]) == ("invalid_value", "max_tokens")
        assert "64 prompts" in error["message"]
    else:
        _assert_openai_error(response, 503)  # past the check: no Triton listens


def test_unknown_model_is_404_model_not_found(offline_app):
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    error = _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 404)
    assert error["code"] == "model_not_found"
    assert offline_app.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_answers_refused_before_routing_are_counted_under_their_route():
    """QA: 413 and 415 answers on /v1/chat/completions were counted as ``route="unmatched"``:
    the body limits (and the API key check) answer before FastAPI's routing has set the route.
    They carry the route they were sent to; a path no route serves stays ``unmatched``. (No
    lifespan: nothing here reaches a route that calls Triton.)"""
    from prometheus_client import REGISTRY

    chat = "/v1/chat/completions"
    client = TestClient(create_app("127.0.0.1:9", "tiny", max_request_bytes=64, api_keys=("k",)))

    def count(route: str, status: int) -> float:
        labels = {"route": route, "status": str(status)}
        return REGISTRY.get_sample_value("openai_requests_total", labels) or 0.0

    key = {"Authorization": "Bearer k"}
    cases = [
        (chat, 413, {"content": b"x" * 65, "headers": key}),
        (chat, 415, {"content": b"{}", "headers": {**key, "Content-Encoding": "gzip"}}),
        (chat, 401, {"json": {}}),
        ("/v1/no-such-route", 404, {"json": {}, "headers": key}),
    ]
    for path, status, request in cases:
        route = path if status != 404 else "unmatched"
        before, unmatched = count(route, status), count("unmatched", status)
        assert client.post(path, **request).status_code == status
        assert count(route, status) == before + 1, (path, status)
        if route != "unmatched":
            assert count("unmatched", status) == unmatched, (path, status)


def test_unreachable_triton_is_503_and_unhealthy(offline_app):
    body = {"model": "tiny", "prompt": "hello"}
    _assert_openai_error(offline_app.post("/v1/completions", json=body), 503)
    assert offline_app.get("/health").status_code == 503


def test_chat_without_max_tokens_asks_for_the_whole_context():
    """OpenAI chat: an omitted limit means "until EOS or the context ends" (the backend's
    absent max_tokens, its one encoding of no limit); legacy completions keep OpenAI's default
    of 16, sent explicitly."""
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" not in chat_inputs(chat, FULL_SPECS, backend_stream=True)
    completion = CompletionRequest(prompt="hi")
    assert completion_inputs(completion, FULL_SPECS, True, "hi")["max_tokens"] == 16


# --- strict request types: OpenAI answers a wrong-typed JSON value with a 400, never coerces it --

_CHAT = {"messages": [{"role": "user", "content": "hi"}]}
_COMPLETION = {"prompt": "hi"}
_MODELS = {"chat": (ChatCompletionRequest, _CHAT), "completion": (CompletionRequest, _COMPLETION)}
# (endpoint, field, a valid value, values lax pydantic would coerce into a valid one).
_BAD_INT = [True, False, 2.0, "2"]
_BAD_FLOAT = [True, False, "0.5", "1", float("nan"), float("inf"), float("-inf")]
_BAD_BOOL = ["yes", "true", "1", 1, 0, 1.0]
STRICT_FIELDS = [
    *[
        (endpoint, name, 2, _BAD_INT)
        for endpoint in ("chat", "completion")
        for name in ("max_tokens", "n", "seed", "top_k", "min_tokens")
    ],
    ("chat", "max_completion_tokens", 2, _BAD_INT),
    ("chat", "top_logprobs", 2, _BAD_INT),
    ("completion", "logprobs", 2, _BAD_INT),
    ("completion", "best_of", 2, _BAD_INT),
    *[
        (endpoint, name, 1, _BAD_FLOAT)
        for endpoint in ("chat", "completion")
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "min_p",
            "repetition_penalty",
        )
    ],
    *[
        (endpoint, name, True, _BAD_BOOL)
        for endpoint in _MODELS
        for name in ("stream", "ignore_eos")
    ],
    ("chat", "logprobs", True, _BAD_BOOL),
    ("chat", "parallel_tool_calls", True, _BAD_BOOL),
    ("chat", "store", False, _BAD_BOOL),
    ("completion", "echo", True, _BAD_BOOL),
    ("completion", "add_special_tokens", True, _BAD_BOOL),
]


def _types(annotation) -> set:
    """The types an annotation is built from, containers included (``list[int] | None`` →
    {list, int, NoneType}; ``Annotated`` metadata dropped)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None:
        return {annotation}
    if origin is typing.Annotated:
        return _types(args[0])
    own = set() if origin in (typing.Union, types.UnionType) else {origin}
    return own.union(*(_types(a) for a in args))


@pytest.mark.parametrize("endpoint", list(_MODELS))
def test_every_scalar_request_field_is_covered_by_the_strictness_tests(endpoint):
    """A bool / int / float field added to a request model must join STRICT_FIELDS (and so be
    checked for strictness below)."""
    model, _ = _MODELS[endpoint]
    scalar = {
        name
        for name, info in model.model_fields.items()
        if _types(info.annotation) & {bool, int, float}
        and not _types(info.annotation) & {list, dict}
    }
    assert scalar == {name for e, name, _, _ in STRICT_FIELDS if e == endpoint}


@pytest.mark.parametrize(("endpoint", "field", "good", "bad_values"), STRICT_FIELDS)
def test_scalar_fields_refuse_wrong_json_types(endpoint, field, good, bad_values):
    """Validated from a dict, as FastAPI does: the valid value parses to its type, every
    coercible wrong-typed value is an error located at the field."""
    model, base = _MODELS[endpoint]
    parsed = getattr(model.model_validate({**base, field: good}), field)
    assert parsed == good
    assert type(parsed) is (float if bad_values is _BAD_FLOAT else type(good))
    for bad in bad_values:
        with pytest.raises(ValidationError) as info:
            model.model_validate({**base, field: bad})
        assert [e["loc"] for e in info.value.errors()] == [(field,)], bad


def test_float_fields_take_json_integers_and_keep_their_bounds():
    body = json.dumps(
        {
            **_CHAT,
            "temperature": 0,
            "top_p": 1,
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "min_p": 0,
            "repetition_penalty": 3,
            "logit_bias": {"7": -100},
        }
    )
    req = ChatCompletionRequest.model_validate_json(body)
    values = [
        req.temperature,
        req.top_p,
        req.presence_penalty,
        req.frequency_penalty,
        req.min_p,
        req.repetition_penalty,
        req.logit_bias["7"],
    ]
    assert values == [0.0, 1.0, -2.0, 2.0, 0.0, 3.0, -100.0]
    assert all(type(v) is float for v in values)
    for field, value in (("temperature", 3), ("top_p", 1.01), ("presence_penalty", -3)):
        with pytest.raises(ValidationError) as info:
            ChatCompletionRequest.model_validate({**_CHAT, field: value})
        assert info.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("bad", [True, "7", 7.0])
def test_token_ids_refuse_booleans_strings_and_floats(bad):
    for make, loc in (
        (lambda: ChatCompletionRequest(**_CHAT, stop_token_ids=[1, bad]), ("stop_token_ids", 1)),
        (lambda: CompletionRequest(prompt=[1, bad]), None),
        (lambda: CompletionRequest(prompt=[[1], [bad]]), None),
    ):
        with pytest.raises(ValidationError) as info:
            make()
        if loc:
            assert info.value.errors()[0]["loc"] == loc
        else:  # no member of the prompt union matches
            assert {e["loc"][0] for e in info.value.errors()} == {"prompt"}


def test_previously_valid_requests_still_parse():
    chat = ChatCompletionRequest.model_validate(
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None},
            ],
            "max_tokens": 5,
            "max_completion_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "n": 2,
            "seed": -(2**63),
            "stop": ["\n", "END"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "presence_penalty": 0.5,
            "frequency_penalty": 0,
            "user": "me",
            "logit_bias": {},
            "top_k": -1,
            "min_p": 0.05,
            "ignore_eos": False,
            "stop_token_ids": [0, 2**31 - 1],
            "repetition_penalty": 1.1,
            "min_tokens": 0,
            "logprobs": True,
            "top_logprobs": 20,
            "tools": None,
            "response_format": {"type": "text"},
            "chat_template_kwargs": {"enable_thinking": False},
            "unknown_extension": 1,
        }
    )
    assert (chat.n, chat.seed, chat.stream, chat.include_usage) == (2, -(2**63), True, True)
    assert (chat.stop_token_ids, chat.top_logprobs, chat.wants_logprobs) == (
        [0, 2**31 - 1],
        20,
        True,
    )
    assert chat.messages[1].content[0].text == "hi" and chat.stop_strings == ("\n", "END")
    for prompt in ("x", ["x", "y"], [1, 2], [[1, 2], [3]]):
        assert CompletionRequest(prompt=prompt).prompt == prompt
    for empty in ([], [[1], []]):  # no prompt to complete: a 400, as OpenAI answers
        with pytest.raises(ValueError):
            CompletionRequest(prompt=empty)
    completion = CompletionRequest.model_validate(
        {"prompt": "x", "logprobs": 0, "echo": False, "best_of": 3, "n": 3, "suffix": None}
    )
    assert (completion.logprobs, completion.echo, completion.best_of) == (0, False, 3)
    assert completion.wants_logprobs


@pytest.mark.parametrize(
    ("path", "extra", "param", "code"),
    [
        ("/v1/chat/completions", {"stream": "yes"}, "stream", "bool_type"),
        ("/v1/chat/completions", {"max_tokens": True}, "max_tokens", "int_type"),
        ("/v1/chat/completions", {"n": 2.0}, "n", "int_type"),
        ("/v1/chat/completions", {"n": True}, "n", "int_type"),
        ("/v1/chat/completions", {"logprobs": "true"}, "logprobs", "bool_type"),
        ("/v1/chat/completions", {"temperature": True}, "temperature", "float_type"),
        ("/v1/chat/completions", {"top_p": "0.5"}, "top_p", "float_type"),
        (
            "/v1/chat/completions",
            {"stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "bool_type",
        ),
        ("/v1/chat/completions", {"stop_token_ids": [3, True]}, "stop_token_ids.1", "int_type"),
        ("/v1/chat/completions", {"logit_bias": {"7": False}}, "logit_bias.7", "float_type"),
        ("/v1/completions", {"echo": "1"}, "echo", "bool_type"),
        ("/v1/completions", {"logprobs": True}, "logprobs", "int_type"),
        ("/v1/completions", {"best_of": 1.0}, "best_of", "int_type"),
        ("/v1/completions", {"stream": 1}, "stream", "bool_type"),
        # Union fields: the param names the field, not the union member tried ("prompt.str").
        ("/v1/completions", {"prompt": [1, True]}, "prompt", None),
        ("/v1/completions", {"prompt": 5}, "prompt", None),
        ("/v1/chat/completions", {"stop": 5}, "stop", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
            None,
        ),
    ],
)
def test_wrong_typed_fields_are_openai_400s_naming_the_field(offline_app, path, extra, param, code):
    base = _CHAT if path == "/v1/chat/completions" else _COMPLETION
    error = _assert_openai_error(offline_app.post(path, json={**base, **extra}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert f"'{param}'" in error["message"]
    if code:
        assert error["code"] == code


@pytest.mark.parametrize(
    ("messages", "extra", "param"),
    [
        ([{"role": "user", "content": "x"}], {"stop": ["a", 3]}, "stop"),
        # pydantic: messages.0.content.str (a type mismatch), then
        # messages.0.content.list[ContentPart].0.type (missing): the member that matched wins
        ([{"role": "user", "content": [{"text": "x"}]}], {}, "messages.0.content.0.type"),
        ([{"role": "user", "content": "x"}, {"role": 7}], {}, "messages.1.role"),
        # missing in the body
        ([{"role": "user", "content": "x"}, {"content": "x"}], {}, "messages.1.role"),
    ],
)
def test_nested_and_union_errors_name_the_field(offline_app, messages, extra, param):
    """The param keeps the body's keys and indices (and a missing field's name) and drops the
    union member pydantic tried."""
    body = {"messages": messages, **extra}
    error = _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {
                **_CHAT,
                "temperature": 1,
                "top_p": 1,
                "presence_penalty": 0,
                "repetition_penalty": 1,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        ("/v1/completions", {"prompt": "hi", "temperature": 0, "min_p": 0, "logprobs": 1}),
    ],
)
def test_json_integers_for_float_fields_pass_validation(offline_app, path, body):
    """Past validation the offline app answers 503 (Triton unreachable), not 400."""
    _assert_openai_error(offline_app.post(path, json=body), 503)


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
@pytest.mark.parametrize("content", ["missing", None])
def test_a_message_without_content_is_400_unless_from_the_assistant(offline_app, role, content):
    message = {"role": role} if content == "missing" else {"role": role, "content": content}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, message]}
    error = _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith("messages.1")
    assert f"'{role}' message needs content" in error["message"]


def test_a_tool_message_without_tool_call_id_is_400(offline_app):
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    body = {"model": "tiny", "messages": messages}
    error = _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith("messages.1")
    assert "tool_call_id" in error["message"]
    messages[1]["tool_call_id"] = "call_1"  # with it, validation passes (then 503: no Triton)
    _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 503)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_is_400_saying_so(offline_app, value):
    """Python's JSON parser reads NaN / Infinity; they are not numbers OpenAI accepts."""
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": %s}'
    response = offline_app.post(
        "/v1/chat/completions",
        content=body % value,
        headers={"content-type": "application/json"},
    )
    error = _assert_openai_error(response, 400)
    assert error["param"] == "temperature" and "finite" in error["message"]


@pytest.mark.parametrize(
    ("prompt", "param", "says"),
    [
        ([-1], "prompt.0", "greater than or equal to 0"),
        ([[5, 2**31]], "prompt.0.1", "less than or equal to 2147483647"),
        ({"text": "hi"}, "prompt", "valid string"),
    ],
)
def test_a_bad_prompt_reports_the_union_member_it_matched(offline_app, prompt, param, says):
    """A token-id prompt with an id out of range names the id's range, not "a valid string"
    (the str member's error, which pydantic lists first)."""
    body = {"model": "tiny", "prompt": prompt}
    error = _assert_openai_error(offline_app.post("/v1/completions", json=body), 400)
    assert error["param"] == param and says in error["message"], error


def test_an_assistant_message_may_leave_content_out():
    for message in ({"role": "assistant"}, {"role": "assistant", "content": None}):
        request = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}, message]}
        )
        assert request.messages[1].content is None


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        # An unknown key inside stream_options is refused by name, like a top-level one.
        (
            "/v1/chat/completions",
            {
                "stream": True,
                "stream_options": {"include_usage": True, "include_usages": True},
            },
            "stream_options.include_usages",
        ),
        # OpenAI requires json_schema.name, of at most 64 of [a-zA-Z0-9_-].
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "has space!"}}},
            "response_format.json_schema.name",
        ),
        # OpenAI's rule for a function's name too (QA 2026-12-07: "", "bad name!" and a
        # 100-character name were accepted).
        *[
            (
                "/v1/chat/completions",
                {"tools": [{"type": "function", "function": {"name": name}}]},
                "tools.0.function.name",
            )
            for name in ("", "bad name!", "f" * 65)
        ],
    ],
)
def test_values_openai_refuses_are_400s_naming_the_field(offline_app, path, extra, param):
    """QA 2026-12-06: these were accepted (an unknown stream_options key, a json_schema
    without a name or with a name OpenAI refuses)."""
    base = _CHAT if path == "/v1/chat/completions" else _COMPLETION
    error = _assert_openai_error(offline_app.post(path, json={**base, **extra}), 400)
    assert error["param"] == param


def test_an_assistant_refusal_part_is_its_text():
    """OpenAI's history of a refused turn (QA 2026-12-07: a 400 here): the refusal is the
    assistant message's text; elsewhere a refusal part is still refused."""
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, refusal])
    sent = json.loads(chat_inputs(req, FULL_SPECS, backend_stream=False)["messages"])
    assert sent[1] == {"role": "assistant", "content": "I can't."}
    from_user = {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}
    with pytest.raises(OpenAIError) as raised:
        chat_inputs(ChatCompletionRequest(messages=[from_user]), FULL_SPECS, backend_stream=False)
    assert raised.value.param == "messages.0.content"


def test_a_valid_json_schema_name_passes_validation(offline_app):
    """A name OpenAI takes is not refused (no backend here: 503)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "out_1-A", "schema": {}}}
    response = offline_app.post("/v1/chat/completions", json={**_CHAT, "response_format": fmt})
    assert response.status_code == 503, response.text


@pytest.mark.parametrize(("best_of", "code"), [(1, "invalid_value"), (3, "unsupported_parameter")])
def test_best_of_must_be_n(best_of, code):
    """OpenAI requires best_of >= n (QA: best_of 1 with n 2 was accepted); above n it is not
    served here."""
    request = CompletionRequest(prompt="hi", n=2, best_of=best_of)
    with pytest.raises(OpenAIError) as raised:
        completion_inputs(request, FULL_SPECS, True, "hi")
    assert raised.value.param == "best_of" and raised.value.code == code
    ok = CompletionRequest(prompt="hi", best_of=1)
    assert completion_inputs(ok, FULL_SPECS, True, "hi")["text_input"] == "hi"


# --- OpenAI's optional fields: null is the default; service options; what is not served -------

# OpenAI's API reference: the optional fields of each endpoint it marks nullable (null: "not
# set", the default). Those this server does not serve are refused only when given a value.
OPENAI_NULLABLE = {
    "chat": (
        "audio frequency_penalty function_call functions logit_bias logprobs max_completion_tokens"
        " max_tokens metadata modalities n parallel_tool_calls prediction presence_penalty"
        " prompt_cache_key reasoning_effort response_format safety_identifier seed service_tier"
        " stop store stream stream_options"
        " temperature tool_choice tools top_logprobs top_p user verbosity web_search_options"
    ).split(),
    "completion": (
        "best_of echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed"
        " stop stream stream_options suffix temperature top_p user"
    ).split(),
}
_INPUTS = {
    "chat": lambda req: chat_inputs(req, FULL_SPECS, backend_stream=False),
    "completion": lambda req: completion_inputs(req, FULL_SPECS, False, "hi"),
}


@pytest.mark.parametrize("endpoint", list(_MODELS))
def test_null_is_the_default_of_every_optional_field(endpoint):
    """Every declared field that is not required reads JSON null as its default (QA: "n",
    "stream" and "echo" null were 400s); a required one given null stays an error."""
    model, base = _MODELS[endpoint]
    optional = [name for name, info in model.model_fields.items() if not info.is_required()]
    assert {"n", "stream", "stream_options", "stop", "max_tokens"} <= set(optional)
    nulls = model.model_validate({**base, **dict.fromkeys(optional)})
    assert nulls == model.model_validate(base)
    for name in optional:
        one = model.model_validate({**base, name: None})
        assert getattr(one, name) == model.model_fields[name].get_default(
            call_default_factory=True
        ), name
    assert (nulls.n, nulls.stream) == (1, False)
    for required in set(model.model_fields) - set(optional):
        with pytest.raises(ValidationError):
            model.model_validate({**base, required: None})
    options = {"include_usage": None, "include_obfuscation": None}
    streamed = model.model_validate({**base, "stream": True, "stream_options": options})
    assert streamed.include_usage is False


@pytest.mark.parametrize("endpoint", list(_MODELS))
def test_openais_nullable_fields_given_null_are_requests_without_them(endpoint, offline_app):
    """Each field OpenAI documents as nullable, null, changes nothing: the same backend inputs
    as the bare request (declared or not: ``audio``, ``functions``, ... null are no 400s), and
    the app takes the body past validation (no Triton here: 503)."""
    model, base = _MODELS[endpoint]
    given = dict.fromkeys(OPENAI_NULLABLE[endpoint])
    inputs = _INPUTS[endpoint]
    assert inputs(model.model_validate({**base, **given})) == inputs(model.model_validate(base))
    for name in given:
        assert inputs(model.model_validate({**base, name: None})) == inputs(
            model.model_validate(base)
        ), name
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    _assert_openai_error(offline_app.post(path, json={**base, **given}), 503)


@pytest.mark.parametrize(
    "extra",
    [
        {"store": False},
        {"metadata": {}},
        {"service_tier": "auto"},
        {"service_tier": "default"},
        {"modalities": ["text"]},
        {"stream": True, "stream_options": {"include_obfuscation": False}},
        {"safety_identifier": "user-7f3a", "prompt_cache_key": "support-bot-v2"},
    ],
)
def test_service_options_at_values_this_server_honours_are_served(extra):
    """Nothing stored, one tier, text out, no stream padding, no end-user monitoring, a prefix
    cache that needs no key: the request is the same as without them (safety_identifier and
    prompt_cache_key, which the openai SDK sends as it sends ``user``, were 400s)."""
    streamed = {"stream": True} if "stream" in extra else {}
    bare = chat_inputs(ChatCompletionRequest(**_CHAT, **streamed), FULL_SPECS, True)
    assert chat_inputs(ChatCompletionRequest(**_CHAT, **extra), FULL_SPECS, True) == bare


@pytest.mark.parametrize(
    ("extra", "param", "code", "says"),
    [
        ({"store": True}, "store", "unsupported_value", "store true"),
        ({"service_tier": "flex"}, "service_tier", "unsupported_value", 'service_tier "flex"'),
        ({"service_tier": "priority"}, "service_tier", "unsupported_value", '"priority"'),
        ({"service_tier": "scale"}, "service_tier", "unsupported_value", '"scale"'),
        ({"modalities": ["text", "audio"]}, "modalities", "unsupported_value", '"audio"]'),
        ({"modalities": ["audio"]}, "modalities", "unsupported_value", 'modalities ["audio"]'),
        ({"metadata": {"team": "a"}}, "metadata", "unsupported_parameter", "stored"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
            "unsupported_value",
            "stream_options.include_obfuscation true",
        ),
    ],
)
def test_service_options_this_server_cannot_honour_are_400s_naming_field_and_value(
    extra, param, code, says
):
    request = ChatCompletionRequest(**_CHAT, **extra)
    with pytest.raises(OpenAIError) as raised:
        chat_inputs(request, FULL_SPECS, backend_stream=True)
    error = raised.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert says in error.message, error.message


@pytest.mark.parametrize(
    ("metadata", "param", "code"),
    [
        ({f"k{i}": "v" for i in range(17)}, "metadata", "too_long"),
        ({"k" * 65: "v"}, "metadata." + "k" * 65, "string_too_long"),
        ({"k": "v" * 513}, "metadata.k", "string_too_long"),
        ({"k": 1}, "metadata.k", "string_type"),
        (["k", "v"], "metadata", "dict_type"),
    ],
)
def test_metadata_has_openais_shape(offline_app, metadata, param, code):
    """At most 16 string pairs, keys of at most 64 characters, values of at most 512: a
    malformed ``metadata`` is an invalid request before it is refused as unserved."""
    body = {**_CHAT, "metadata": metadata}
    error = _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 400)
    assert (error["param"], error["code"]) == (param, code), error
    widest = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert ChatCompletionRequest(**_CHAT, metadata=widest).metadata == widest


@pytest.mark.parametrize("endpoint", list(_MODELS))
@pytest.mark.parametrize("field", sorted(OPENAI_FIELDS))
def test_openai_fields_this_server_does_not_serve_are_refused_by_name(endpoint, field):
    """Given a value, each is a 400 unsupported_parameter naming it; null is no 400."""
    model, base = _MODELS[endpoint]
    with pytest.raises(OpenAIError) as raised:
        _INPUTS[endpoint](model.model_validate({**base, field: {"x": 1}}))
    error = raised.value
    assert (error.status, error.param, error.code) == (400, field, "unsupported_parameter")
    assert error.message.startswith(f"{field} is not supported"), error.message
    _INPUTS[endpoint](model.model_validate({**base, field: None}))


def test_functions_and_function_call_are_refused_pointing_to_tools():
    for field, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        request = ChatCompletionRequest(**_CHAT, **{field: [{"name": "f"}]})
        with pytest.raises(OpenAIError) as raised:
            chat_inputs(request, FULL_SPECS, backend_stream=False)
        assert raised.value.param == field
        assert f"give {instead} instead" in raised.value.message, raised.value.message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stop", ["", [""], ["a", ""], "x" * 257, ["a", "x" * 257]])
def test_empty_and_overlong_stop_strings_are_400s(offline_app, path, stop):
    """The contract's 1..256 characters, checked by the sidecar too (QA: "" and [""] were
    accepted and silently dropped, while the engine refuses them)."""
    base = _CHAT if path == "/v1/chat/completions" else _COMPLETION
    error = _assert_openai_error(offline_app.post(path, json={**base, "stop": stop}), 400)
    assert (error["param"], error["code"]) == ("stop", "invalid_value"), error
    assert "1..256 characters" in error["message"]
    # At the bounds the body passes validation (then 503: no Triton here).
    for fine in ("x", "x" * 256, ["a", "x" * 256]):
        _assert_openai_error(offline_app.post(path, json={**base, "stop": fine}), 503)


def test_the_model_cards_created_is_the_same_every_call(offline_app, monkeypatch):
    """``created`` is when the sidecar started, not the time of each call (QA: it changed on
    every GET)."""
    first = offline_app.get("/v1/models").json()["data"][0]["created"]
    assert 0 < first <= time.time()
    monkeypatch.setattr(time, "time", lambda: first + 1000.0)
    assert offline_app.get("/v1/models").json()["data"][0]["created"] == first
    assert offline_app.get("/v1/models/tiny").json()["created"] == first


def test_detokenize_of_no_tokens_is_the_empty_text(offline_app):
    """vLLM answers ``{"prompt": ""}`` (QA: this was a 400); no tokenizer needed for it."""
    response = offline_app.post("/detokenize", json={"model": "tiny", "tokens": []})
    assert response.status_code == 200 and response.json() == {"prompt": ""}
    other = offline_app.post("/detokenize", json={"model": "other", "tokens": []})
    assert _assert_openai_error(other, 404)["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"x": 1}, "token ids"),
        ({"-1": 1}, "token ids"),
        ({"7.0": 1}, "token ids"),
        ({"٣": 1}, "token ids"),  # a digit, but not a decimal ASCII one
        ({"7": 1, "007": 2}, "distinct"),
        ({"7": 100.5}, r"in \[-100, 100\]"),
        ({"7": -101}, r"in \[-100, 100\]"),
        ({str(i): 1 for i in range(301)}, "at most 300 entries"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_logit_bias_is_a_400_naming_it(offline_app, path, bias, message):
    """OpenAI's rules: keys are token ids in decimal, biases in [-100, 100], at most 300."""
    base = _CHAT if path == "/v1/chat/completions" else _COMPLETION
    body = {**base, "logit_bias": bias}
    error = _assert_openai_error(offline_app.post(path, json=body), 400)
    assert (error["param"], error["code"]) == ("logit_bias", "invalid_value")
    assert re.search(message, error["message"]), error["message"]


def test_logit_bias_is_sent_as_a_json_object_with_canonical_keys():
    specs = {**FULL_SPECS, "logit_bias": InputSpec("BYTES", (1,))}
    bias = {"007": -100, "50": 100, "3": 0.5}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logit_bias=bias)
    sent = json.loads(chat_inputs(chat, specs, backend_stream=True)["logit_bias"])
    assert sent == {"7": -100.0, "50": 100.0, "3": 0.5}
    completion = CompletionRequest(prompt="x", logit_bias={str(i): 1 for i in range(300)})
    sent = json.loads(completion_inputs(completion, specs, True, "x")["logit_bias"])
    assert len(sent) == 300
    # An empty object is no bias: nothing is sent.
    empty = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logit_bias={})
    assert "logit_bias" not in chat_inputs(empty, specs, backend_stream=True)
