"""No client-supplied text can change an error's status or code.

An error's class travels as a code in the contract's wire form (``tritonllm.contract.errors``)
and the sidecar maps the code, never the wording. Property tests over generated strings, many
of them built from the words a text search would trip on and from forged wire objects, go
through the real code that builds the message (the generator's core and the tokenizer's prompt
rendering), the text Triton puts in front of it, and the sidecar's mapping; a few cases go
through the real server.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_generator_core import RecordingEngine, Sink

from openai_frontend import create_app, generation
from openai_frontend.generation import backend_error, to_openai_error
from openai_frontend.triton_client import TritonError
from tritonllm.contract import limits
from tritonllm.contract.errors import MARKER, ErrorCode, RequestError, decode_error, encode_error
from tritonllm.serving.generator_core import GeneratorCore
from tritonllm.tokenization.chat import validate_messages
from tritonllm.triton_server import free_port

# Words and fragments that would sway a classifier reading the message, and forged wire
# objects of other classes.
TRAPS = [
    "internal error",
    "exceeds",
    "context length",
    "max_model_len",
    "too long",
    "unavailable",
    "stub process",
    "not ready",
    "unknown model",
    "top_p must be",
    MARKER,
    encode_error(ErrorCode.INTERNAL_ERROR, "forged"),
    encode_error(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "forged", "prompt"),
    '{"code":"engine_unavailable","param":null,"message":"x"}',
    '"}',
    "\\",
    "\n",
    "in ensemble 'llm', ",
]
client_text = st.one_of(
    st.text(max_size=60),
    st.lists(st.one_of(st.sampled_from(TRAPS), st.text(max_size=8)), max_size=6).map("".join),
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def through_triton(message: str, prompt_param: str = "prompt"):
    """The OpenAI error a model's error message becomes once Triton routed it to the sidecar."""
    return to_openai_error(TritonError(f"in ensemble 'llm', {message}"), prompt_param)


@pytest.fixture(scope="module")
def core():
    core = GeneratorCore(RecordingEngine(), lambda *a: None, lambda: True, print, print).start()
    yield core
    core.finalize()


def generator_error(core, inputs) -> str:
    sink = Sink()
    core.execute("r", {"input_ids": np.array([1, 2], np.int32), **inputs}, "", sink)
    (message,) = sink.errors
    return message


def strings(values) -> np.ndarray:
    return np.array([v.encode("utf-8", "surrogatepass") for v in values], dtype=object)


@SETTINGS
@given(text=client_text)
def test_stop_strings_never_change_the_class_of_too_many_stops(core, text):
    message = generator_error(
        core, {"stop": strings([text or "x"] * (limits.MAX_STOP_STRINGS + 1))}
    )
    error = through_triton(message)
    assert (error.status, error.code, error.param) == (400, "invalid_value", "stop")


@SETTINGS
@given(text=client_text)
def test_a_long_stop_string_is_an_invalid_value_whatever_it_says(core, text):
    long = (text or "y") * (limits.MAX_STOP_STRING_CHARS + 1)
    error = through_triton(generator_error(core, {"stop": strings([long])}))
    assert (error.status, error.code, error.param) == (400, "invalid_value", "stop")
    assert len(error.message) < 400  # the value is quoted shortened


@SETTINGS
@given(text=client_text)
def test_sampling_parameter_names_and_values_never_change_the_class(core, text):
    """A vLLM-style JSON key the service does not know is refused by name, and a bad value of
    a known key is an invalid value, whatever the text."""
    unknown = json.dumps({f"x{text}": text}).encode()
    error = through_triton(
        generator_error(core, {"sampling_parameters": np.array([unknown], object)})
    )
    assert (error.status, error.code) == (400, "unsupported_parameter")
    bad_value = json.dumps({"top_p": f"{text}!"}).encode()
    error = through_triton(
        generator_error(core, {"sampling_parameters": np.array([bad_value], object)})
    )
    assert (error.status, error.code, error.param) == (
        400,
        "invalid_value",
        "sampling_parameters.top_p",
    )


@SETTINGS
@given(role=client_text, name=client_text, content=client_text)
def test_chat_message_text_never_changes_the_class(role, name, content):
    """What the tokenizer answers for an invalid message (a role it does not know; any name
    and content), once it crossed to the sidecar."""
    messages = [{"role": f"{role}?", "name": name, "content": content}]
    with pytest.raises(RequestError) as info:
        validate_messages(messages)
    error = through_triton(info.value.wire(), "messages")
    assert (error.status, error.code, error.param) == (400, "invalid_value", "messages")


@SETTINGS
@given(text=client_text)
def test_server_faults_stay_server_faults_whatever_they_quote(text):
    """An engine failure whose message quotes client text is still a 500 / 503."""
    assert through_triton(encode_error(ErrorCode.INTERNAL_ERROR, text)).status == 500
    assert through_triton(encode_error(ErrorCode.ENGINE_UNAVAILABLE, text)).status == 503
    # Text without a wire object of its own (Triton's own errors) is a server error.
    if decode_error(text) is None:
        assert through_triton(text).status == 500


@SETTINGS
@given(text=client_text)
def test_decoding_returns_exactly_what_was_encoded(text):
    for code in ErrorCode:
        wire = encode_error(code, text, text or None)
        assert decode_error(f"in ensemble 'llm', {wire}") == decode_error(wire)
        decoded = decode_error(wire)
        assert (decoded.code, decoded.param, decoded.message) == (code, text or None, text)


@pytest.fixture(scope="module")
def offline_app():
    with TestClient(create_app(f"127.0.0.1:{free_port()}", "tiny")) as client:
        yield client


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=client_text)
def test_a_model_name_never_changes_the_class_of_its_404(offline_app, model):
    if model == "tiny":
        return
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    response = offline_app.post("/v1/chat/completions", json=body)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=client_text)
def test_a_body_that_is_no_json_object_is_classed_by_its_form_not_its_text(offline_app, text):
    """Malformed JSON is invalid_json, and JSON of another type or text not sent as JSON is
    invalid_type, whatever the text says."""
    json_type = {"content-type": "application/json"}
    cases = [
        (b"{" + json.dumps(text).encode(), json_type, "invalid_json"),  # a key without a value
        (json.dumps([text]).encode(), json_type, "invalid_type"),
        (json.dumps(text).encode(), json_type, "invalid_type"),
        (
            f"x{text}".encode("utf-8", "surrogatepass"),
            {"content-type": "text/plain"},
            "invalid_type",
        ),
    ]
    for content, headers, code in cases:
        response = offline_app.post("/v1/completions", content=content, headers=headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", code), content


# --- through the real server ----------------------------------------------------------------
ADVERSARIAL = [
    "internal error: exceeds the context length",
    "backend unavailable: stub process not ready",
    encode_error(ErrorCode.INTERNAL_ERROR, "forged", None),
]


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)


def test_adversarial_stop_strings_through_the_server(client, sidecar):
    stops = (ADVERSARIAL * 6)[: limits.MAX_STOP_STRINGS + 1]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=sidecar.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stop=stops,
        )
    error = info.value.response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "invalid_value",
        "stop",
        "invalid_request_error",
    )
    # The same words as valid stop strings: served normally.
    response = client.chat.completions.create(
        model=sidecar.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stop=ADVERSARIAL,
    )
    assert response.choices[0].finish_reason in ("length", "stop")


def test_adversarial_prompt_and_names_through_the_server(client, sidecar):
    """A too-long prompt made of the trap words is still context_length_exceeded; a message
    name made of them changes nothing."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=sidecar.model_name, prompt=" ".join(ADVERSARIAL) * 400, max_tokens=4
        )
    assert info.value.response.json()["error"]["code"] == "context_length_exceeded"
    response = client.chat.completions.create(
        model=sidecar.model_name,
        messages=[{"role": "user", "content": ADVERSARIAL[0], "name": ADVERSARIAL[2]}],
        max_tokens=2,
    )
    assert response.choices[0].finish_reason in ("length", "stop")
    bad = httpx.post(
        f"{sidecar.base_url}/chat/completions",
        json={"model": ADVERSARIAL[1], "messages": [{"role": "user", "content": "x"}]},
    )
    assert (bad.status_code, bad.json()["error"]["code"]) == (404, "model_not_found")


def _backend_error(message: str, healthy: bool | None, delay_s: float = 0.0):
    """``backend_error`` of a Triton error with ``message``, the health check answering
    ``healthy`` after ``delay_s`` (None: no health check)."""
    asked = []

    async def backend_ok() -> bool:
        asked.append(True)
        await asyncio.sleep(delay_s)
        return bool(healthy)

    check = None if healthy is None else backend_ok
    error = asyncio.run(backend_error(TritonError(message), "prompt", check))
    return error, bool(asked)


DEAD_STUB = "in ensemble 'llm_fused', Stub process 'generator_0_1' is not healthy."


def test_tritons_own_error_is_a_503_while_the_backend_is_unhealthy():
    error, asked = _backend_error(DEAD_STUB, healthy=False)
    assert asked and (error.status, error.code) == (503, "service_unavailable")


def test_tritons_own_error_is_a_500_while_the_backend_is_healthy_or_the_check_is_slow(
    monkeypatch,
):
    assert _backend_error(DEAD_STUB, healthy=True)[0].status == 500
    assert _backend_error(DEAD_STUB, healthy=None)[0].status == 500
    monkeypatch.setattr(generation, "BACKEND_CHECK_S", 0.01)
    assert _backend_error(DEAD_STUB, healthy=False, delay_s=1.0)[0].status == 500


def test_a_classified_backend_error_keeps_its_class_whatever_the_health():
    wire = encode_error(ErrorCode.INVALID_VALUE, "temperature must be at least 0")
    error, asked = _backend_error(f"in ensemble 'llm', {wire}", healthy=False)
    assert not asked and error.status == 400


def test_a_server_fault_that_repeats_is_logged_now_and_then(caplog):
    """A dead engine fails every request with the same code: one warning (and the count at
    the next one), not a line per request."""
    from openai_frontend import errors

    errors._BACKEND_ERROR_LOGS.clear()
    wire = decode_error(encode_error(ErrorCode.ENGINE_UNAVAILABLE, "the engine process died"))
    assert wire is not None
    with caplog.at_level("WARNING", logger=errors.log.name):
        for _ in range(50):
            assert errors.from_backend(wire, "prompt").status == 503
    lines = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 1 and "engine_unavailable" in lines[0].getMessage()
