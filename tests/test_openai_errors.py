"""Bad requests get OpenAI-shaped 4xx errors from the real sidecar, and it keeps serving."""

from __future__ import annotations

import gzip
import json
import select
import socket

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(sidecar):
    return openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)


def _chat(model, **kwargs):
    return dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kwargs)


def _assert_still_serving(client, model):
    response = client.chat.completions.create(**_chat(model))
    assert response.choices[0].finish_reason in ("length", "stop")


def _error_body(exc: openai.APIStatusError) -> dict:
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


CASES = {
    "empty messages": (lambda m: dict(model=m, messages=[], max_tokens=2), 400, "messages"),
    "max_tokens 0": (lambda m: _chat(m) | {"max_tokens": 0}, 400, "max_tokens"),
    "negative max_tokens": (lambda m: _chat(m) | {"max_tokens": -5}, 400, "max_tokens"),
    "temperature 3": (lambda m: _chat(m, temperature=3.0), 400, "temperature"),
    "top_p 1.5": (lambda m: _chat(m, top_p=1.5), 400, "top_p"),
    "n 17": (lambda m: _chat(m, n=17), 400, "n"),
    "top_logprobs without logprobs": (lambda m: _chat(m, top_logprobs=2), 400, "top_logprobs"),
    "unknown model": (lambda m: _chat("no-such-model"), 404, "model"),
    "min_tokens > max_tokens (engine check)": (
        lambda m: _chat(m, extra_body={"min_tokens": 10}),
        400,
        "min_tokens",
    ),
    "text part without text": (
        lambda m: dict(
            model=m, messages=[{"role": "user", "content": [{"type": "text"}]}], max_tokens=2
        ),
        400,
        "messages.0.content.0.text",
    ),
    "an empty stop string": (lambda m: _chat(m, stop=["\n", ""]), 400, "stop"),
    "stop token id past the vocabulary (engine check)": (
        lambda m: _chat(m, extra_body={"stop_token_ids": [2, 10_000_000]}),
        400,
        "stop_token_ids",
    ),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_openai_error_then_service_continues(client, sidecar, case, stream):
    make, status, param = CASES[case]
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(stream=stream, **make(sidecar.model_name))
    assert info.value.status_code == status
    error = _error_body(info.value)
    assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"
    _assert_still_serving(client, sidecar.model_name)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_context_is_400(client, sidecar, stream):
    """The engine's max_model_len rejection surfaces as OpenAI's context_length_exceeded."""
    prompt = "hello " * 5000
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=sidecar.model_name, prompt=prompt, max_tokens=4, stream=stream
        )
    error = _error_body(info.value)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    _assert_still_serving(client, sidecar.model_name)


@pytest.mark.parametrize(
    "body",
    [b'{"model": "x", "messages": [', b"not json at all", b"[1, 2, 3]"],
)
def test_malformed_body_is_openai_400(client, sidecar, body):
    response = httpx.post(
        f"{sidecar.base_url}/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    _assert_still_serving(client, sidecar.model_name)


def test_health_reports_triton_ready(sidecar):
    response = httpx.get(f"{sidecar.root_url}/health")
    assert response.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "field",
    ["content", "model", "stop"],
)
def test_lone_surrogate_is_openai_400(client, sidecar, field, stream):
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"), which is no valid Unicode text."""
    body = _chat(sidecar.model_name, stream=stream)
    if field == "content":
        body["messages"][0]["content"] = "a\ud800b"
    elif field == "model":
        body["model"] = "\ud800"
    else:
        body["stop"] = ["\ud800"]
    payload = json.dumps(body, ensure_ascii=True)  # keeps the surrogate as a \\ud800 escape
    response = httpx.post(
        f"{sidecar.base_url}/chat/completions",
        content=payload.encode(),
        headers={"content-type": "application/json"},
    )
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    _assert_still_serving(client, sidecar.model_name)


def test_oversized_body_is_413_without_reading_it(client, sidecar):
    from openai_frontend.app import DEFAULT_MAX_REQUEST_BYTES

    content = "x" * (DEFAULT_MAX_REQUEST_BYTES + 1)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=sidecar.model_name, messages=[{"role": "user", "content": content}]
        )
    assert info.value.status_code == 413
    assert _error_body(info.value)["code"] == "request_too_large"
    _assert_still_serving(client, sidecar.model_name)


@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_a_compressed_body_is_415_naming_its_encoding(client, sidecar, encoding):
    """QA found a gzip body called "not valid UTF-8". The sidecar decodes no compressed bodies
    (neither does OpenAI's API): any Content-Encoding but identity is a 415 naming it, and an
    explicit identity is served."""
    body = json.dumps({"model": sidecar.model_name, "prompt": "hi", "max_tokens": 1}).encode()
    sent = gzip.compress(body) if encoding == "gzip" else body
    url = f"{sidecar.base_url}/completions"
    response = httpx.post(
        url,
        content=sent,
        headers={"content-encoding": encoding, "content-type": "application/json"},
    )
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and encoding in error["message"]
    plain = httpx.post(
        url,
        content=body,
        headers={"content-encoding": "identity", "content-type": "application/json"},
    )
    assert plain.status_code == 200, plain.text
    _assert_still_serving(client, sidecar.model_name)


def _post_chunked(base_url: str, path: str, body_size: int, timeout_s: float = 60.0):
    """POST a JSON completion request of ``body_size`` bytes with ``Transfer-Encoding: chunked``
    (no Content-Length), 256 KiB a chunk, stopping early once the server answers.

    Returns:
        (status, JSON body, body bytes handed to the socket before the answer came).
    """
    url = httpx.URL(base_url)
    head = b'{"model": "no-such-model", "max_tokens": 1, "prompt": "'
    tail = b'"}'
    filler = b"x" * (256 << 10)
    sent = 0
    with socket.create_connection((url.host, url.port), timeout=timeout_s) as sock:
        sock.sendall(
            f"POST {url.path}{path} HTTP/1.1\r\nHost: {url.host}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        pieces = [head] + [filler] * ((body_size - len(head) - len(tail)) // len(filler)) + [tail]
        try:
            for piece in pieces:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server has answered; a client like curl stops sending here
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    head_text, _, body = response.partition(b"\r\n\r\n")
    status = int(head_text.split(b" ", 2)[1])
    return status, json.loads(body), sent


def test_chunked_oversized_body_is_413_as_it_arrives(client, sidecar):
    """A body without Content-Length is counted as it arrives: the 413 (an OpenAI error) comes
    once the limit is passed, long before the client has sent all of a body 16x the limit."""
    from openai_frontend.app import DEFAULT_MAX_REQUEST_BYTES

    total = 16 * DEFAULT_MAX_REQUEST_BYTES
    status, body, sent = _post_chunked(sidecar.base_url, "/completions", total)
    assert status == 413, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "request_too_large"
    # The socket buffers hold a few MiB beyond what the server read; never the whole body.
    assert sent < total // 2
    _assert_still_serving(client, sidecar.model_name)


def test_chunked_body_within_the_limit_is_served(client, sidecar):
    def chunks():
        body = json.dumps({"model": sidecar.model_name, "prompt": "hello", "max_tokens": 2})
        yield body[:10].encode()
        yield body[10:].encode()

    response = httpx.post(
        f"{sidecar.base_url}/completions",
        content=chunks(),  # an iterator: httpx sends it chunked, without Content-Length
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert 1 <= response.json()["usage"]["completion_tokens"] <= 2


def test_error_messages_do_not_echo_huge_values(client, sidecar):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**_chat(sidecar.model_name, stop=["y" * 10_000]))
    assert len(_error_body(info.value)["message"]) < 400


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_sampling_values_are_refused(value):
    from tritonllm.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=value)


def test_backend_errors_read_like_openai_validation_errors(client, sidecar):
    """Engine rejections carry no Triton routing prefix and name the parameter."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            **_chat(sidecar.model_name, stop=[str(i) for i in range(17)])
        )
    error = _error_body(info.value)
    assert error["message"] == "stop must be at most 16 strings, got 17"
    assert error["param"] == "stop"


def test_an_in_band_stream_error_about_the_constraint_names_the_clients_field():
    """A constraint that fails after the 200 (QA: llguidance's lexer limit hit mid-stream) is
    sent in-band naming the field the client sent (``guided_regex``), as the same error before
    the 200 is, not the backend's ``structured_outputs.regex``."""
    import asyncio

    from openai_frontend.errors import OpenAIError
    from openai_frontend.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatCompletionRequest,
        DeltaMessage,
        Usage,
    )
    from openai_frontend.routes.sse import ChunkEncoder, _body
    from openai_frontend.structured import rename_param

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "guided_regex": "a+"}
    )

    class Gen:
        usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)

        def close(self):
            """Nothing to release: no backend generation behind this stand-in."""

    async def events():
        yield '{"choices":[]}'
        param = "structured_outputs.regex"
        raise OpenAIError(f"{param} failed while generating: too many states", param=param)

    async def sent():
        chunk = ChatCompletionChunk(
            id="c", model="m", choices=[ChatChunkChoice(delta=DeltaMessage())]
        )
        encoder = ChunkEncoder(chunk, include_usage=False)
        rename = lambda exc: rename_param(exc, body, None)  # noqa: E731
        return [e async for e in _body(Gen(), events(), encoder, rename)]

    chunks = asyncio.run(sent())
    error = json.loads(chunks[1])["error"]
    assert (error["param"], error["code"]) == ("guided_regex", None)
    assert error["message"].startswith("guided_regex failed while generating")
