"""Sidecar pieces that need no tritonserver: stop strings, tensor encoding, request mapping, and
the HTTP error contract in front of an unreachable Triton."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tritonclient.grpc import InferInput, InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from openai_frontend import create_app
from openai_frontend.errors import OpenAIError
from openai_frontend.generation import to_openai_error
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.sampling import chat_inputs, completion_inputs
from openai_frontend.triton_client import InputSpec, TritonError, encode_tensor, parse_chunk
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
        {"tools": [{"type": "function"}]},
        {"logit_bias": {"50256": -100}},
    ):
        with pytest.raises(OpenAIError) as info:
            chat_inputs(ChatCompletionRequest(**base, **extra), specs, backend_stream=True)
        assert info.value.status == 400
    for extra in (
        {"echo": True},
        {"logprobs": 1},
        {"prompt": [1, 2]},
        {"prompt": ["a", "b"]},
        {"logit_bias": {"7": 5.0}},
    ):
        with pytest.raises(OpenAIError):
            completion_inputs(CompletionRequest(**{"prompt": "x", **extra}), specs, True)


def test_triton_errors_map_to_openai_statuses():
    too_long = TritonError("generator: prompt has 5000 tokens, exceeds the context length 4096")
    assert to_openai_error(too_long, "messages").code == "context_length_exceeded"
    assert to_openai_error(too_long, "messages").status == 400
    assert (
        to_openai_error(TritonError("generator: top_p must be in (0, 1]"), "prompt").status == 400
    )
    assert to_openai_error(TritonError("connection refused", unavailable=True), "x").status == 503
    # The generator marks the server's own failures (a dead engine): not the client's fault.
    dead = TritonError(
        "in ensemble 'llm', generator: internal error: the engine process died (killed by SIGKILL)"
    )
    assert (to_openai_error(dead, "x").status, to_openai_error(dead, "x").type) == (
        500,
        "server_error",
    )


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
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
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


def test_malformed_json_is_openai_400(offline_app):
    response = offline_app.post(
        "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
    )
    _assert_openai_error(response, 400)


def test_unknown_model_is_404_model_not_found(offline_app):
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    error = _assert_openai_error(offline_app.post("/v1/chat/completions", json=body), 404)
    assert error["code"] == "model_not_found"
    assert offline_app.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_unreachable_triton_is_503_and_unhealthy(offline_app):
    body = {"model": "tiny", "prompt": "hello"}
    _assert_openai_error(offline_app.post("/v1/completions", json=body), 503)
    assert offline_app.get("/health").status_code == 503


def test_chat_without_max_tokens_asks_for_the_whole_context():
    """OpenAI chat: an omitted limit means "until EOS or the context ends" (backend: 0);
    legacy completions keep OpenAI's default of 16 (the backend default, so nothing is sent)."""
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat_inputs(chat, FULL_SPECS, backend_stream=True)["max_tokens"] == 0
    completion = CompletionRequest(prompt="hi")
    assert "max_tokens" not in completion_inputs(completion, FULL_SPECS, backend_stream=True)
