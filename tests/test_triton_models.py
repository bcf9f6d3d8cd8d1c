"""The Triton model repository on a real tritonserver: the ``llm`` ensemble and ``generator``.

Oracles: Hugging Face transformers' greedy decoding of the tiny checkpoint (text and token
counts), Triton's own protocols (gRPC streaming, HTTP generate / generate_stream), and the
engine's KV accounting exported as ``tritonllm_*`` metrics.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.request
import uuid

import numpy as np
import pytest
import requests

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Hello world",
    "1, 2, 3, 4,",
    "Once upon a time",
    "你好，世界",
    "def fibonacci(n):",
    "The quick brown fox",
    "Triton Inference Server",
]
DTYPES = {
    "seed": np.int64,
    "stop_token_ids": np.int32,
    "max_tokens": np.int32,
    "top_k": np.int32,
    "min_tokens": np.int32,
    "input_ids": np.int32,
    "logprobs": np.int32,
}
BOOLS = {"stream", "ignore_eos", "enable_thinking", "health_probe", "exclude_input_in_output"}


def _infer_inputs(inputs: dict) -> list:
    """tritonclient inputs from plain values (dtype by input name, as in the model configs)."""
    out = []
    for name, value in inputs.items():
        if isinstance(value, str):
            array = np.array([value.encode()], dtype=np.object_)
        elif name in BOOLS:
            array = np.array([bool(value)], dtype=bool)
        elif name in DTYPES:
            array = np.asarray(value if isinstance(value, list) else [value], dtype=DTYPES[name])
        else:
            array = np.array([value], dtype=np.float32)
        tensor = grpcclient.InferInput(name, list(array.shape), _triton_dtype(array))
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def _triton_dtype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


class Stream:
    """One gRPC bidirectional stream; responses of each request id collected until final."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, model: str, inputs: dict, request_id: str = "") -> str:
        request_id = request_id or uuid.uuid4().hex
        self.client.async_stream_infer(
            model, _infer_inputs(inputs), request_id=request_id, enable_empty_final_response=True
        )
        return request_id

    def next(self, timeout: float = 60.0) -> tuple[str, dict | None, bool]:
        """(request id, outputs or None for the empty final response, final) of one response.

        Raises:
            InferenceServerException: the server answered with an error.
        """
        result, error = self.results.get(timeout=timeout)
        if error is not None:
            raise error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        outputs = {o.name: result.as_numpy(o.name) for o in response.outputs} or None
        return response.id, outputs, final

    def collect(self, count: int = 1, timeout: float = 60.0) -> dict[str, list[dict]]:
        """Outputs of each request until ``count`` requests sent their final response."""
        done: dict[str, list[dict]] = {}
        finished = 0
        while finished < count:
            request_id, outputs, final = self.next(timeout)
            done.setdefault(request_id, [])
            if outputs is not None:
                done[request_id].append(outputs)
            finished += final
        return done

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _text(responses: list[dict]) -> str:
    return "".join(r["text_output"][0].decode() for r in responses)


def _last(responses: list[dict], name: str):
    value = responses[-1][name][0]
    return value.decode() if isinstance(value, bytes) else int(value)


def metric(server, name: str) -> float:
    """The value of a ``tritonllm_*`` custom metric on the server's metrics port."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"metric {name} not exported")


def wait_metric(server, name: str, want, timeout: float) -> float:
    """Poll ``name`` until it equals ``want`` (or ``want(value)`` holds); return the value."""
    check = want if callable(want) else (lambda value: value == want)
    start = time.monotonic()
    while not check(value := metric(server, name)):
        assert time.monotonic() - start < timeout, f"{name} = {value} after {timeout} s"
        time.sleep(0.02)
    return value


@pytest.fixture
def stream(triton_server):
    s = Stream(triton_server.grpc_url)
    yield s
    s.close(cancel=False)


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_grpc_stream_equals_non_stream_equals_hf_greedy(stream, tokenizer, hf_greedy):
    prompt, n = PROMPTS[0], 12
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = tokenizer.decode(hf_greedy(prompt_ids, n), skip_special_tokens=True)

    rid = stream.send("llm", {"text_input": prompt, "max_tokens": n, **GREEDY})
    streamed = stream.collect()[rid]
    assert len(streamed) > 1  # streamed in pieces, the last one final
    assert [_last(streamed[: i + 1], "finish_reason") for i in range(len(streamed))][:-1] == [
        ""
    ] * (len(streamed) - 1)
    assert _text(streamed) == expected
    assert _last(streamed, "finish_reason") == "length"
    assert _last(streamed, "num_input_tokens") == len(prompt_ids)
    assert _last(streamed, "num_output_tokens") == n

    rid = stream.send("llm", {"text_input": prompt, "max_tokens": n, "stream": False, **GREEDY})
    whole = stream.collect()[rid]
    assert len(whole) == 1
    assert _text(whole) == expected
    assert _last(whole, "num_output_tokens") == n


def test_chat_messages_go_through_the_chat_template(stream, tokenizer, hf_greedy):
    from tritonllm.tokenization.chat import render_prompt

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt_ids = render_prompt(tokenizer, messages=messages, enable_thinking=False)
    expected = tokenizer.decode(hf_greedy(prompt_ids, 8), skip_special_tokens=True)
    rid = stream.send(
        "llm",
        {"messages": json.dumps(messages), "enable_thinking": False, "max_tokens": 8, **GREEDY},
    )
    responses = stream.collect()[rid]
    assert _last(responses, "num_input_tokens") == len(prompt_ids)
    assert _text(responses) == expected


def test_http_generate_stream_and_generate(triton_server, tokenizer, hf_greedy):
    prompt, n = PROMPTS[3], 10
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = tokenizer.decode(hf_greedy(prompt_ids, n), skip_special_tokens=True)
    body = {"text_input": prompt, "max_tokens": n, **GREEDY}
    base = f"http://{triton_server.http_url}/v2/models/llm"

    with requests.post(f"{base}/generate_stream", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        events = [
            json.loads(line[len("data:") :])
            for line in r.iter_lines(decode_unicode=True)
            if line.startswith("data:")
        ]
    assert "".join(e["text_output"] for e in events) == expected
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["num_output_tokens"] == n

    r = requests.post(f"{base}/generate", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == expected
    assert r.json()["num_input_tokens"] == len(prompt_ids)


def test_abort_control_request_frees_kv_at_once(triton_server, stream, tokenizer):
    rid = stream.send(
        "llm",
        {"text_input": PROMPTS[5], "max_tokens": 2000, **GREEDY},
        request_id=f"abort-{uuid.uuid4().hex}",
    )
    _, first, _ = stream.next()
    assert first["finish_reason"][0] == b""
    wait_metric(triton_server, "tritonllm_kv_pages_used", lambda pages: pages > 0, timeout=2.0)

    control = Stream(triton_server.grpc_url)
    try:
        control.send(
            "generator", {"abort_request_id": rid, "control_secret": triton_server.control_secret}
        )
        assert control.collect()  # one empty final response
    finally:
        control.close()

    outputs = [first]
    while True:
        _, out, final = stream.next(timeout=10)
        if out is not None:
            outputs.append(out)
        if final:
            break
    assert _last(outputs, "finish_reason") == "abort"
    assert _last(outputs, "num_output_tokens") < 2000
    wait_metric(triton_server, "tritonllm_kv_pages_used", 0, timeout=2.0)
    wait_metric(triton_server, "tritonllm_requests_running", 0, timeout=2.0)

    rid = stream.send("llm", {"text_input": PROMPTS[0], "max_tokens": 4, **GREEDY})
    assert _last(stream.collect()[rid], "finish_reason") == "length"


def test_abort_that_arrives_before_its_request_ends_it(triton_server, stream):
    rid = f"early-{uuid.uuid4().hex}"
    control = Stream(triton_server.grpc_url)
    try:
        control.send(
            "generator", {"abort_request_id": rid, "control_secret": triton_server.control_secret}
        )
        control.collect()
    finally:
        control.close()
    stream.send("llm", {"text_input": PROMPTS[1], "max_tokens": 2000, **GREEDY}, request_id=rid)
    responses = stream.collect(timeout=10)[rid]
    assert _last(responses, "finish_reason") == "abort"
    assert _last(responses, "num_output_tokens") == 0


def test_cancelled_generator_stream_is_aborted(triton_server, tokenizer):
    cancelled = Stream(triton_server.grpc_url)
    ids = tokenizer.encode(PROMPTS[6], add_special_tokens=False)
    cancelled.send("generator", {"input_ids": ids, "max_tokens": 2000, **GREEDY})
    _, first, _ = cancelled.next()
    assert len(first["output_ids"]) >= 1
    cancelled.close(cancel=True)
    wait_metric(triton_server, "tritonllm_kv_pages_used", 0, timeout=3.0)
    wait_metric(triton_server, "tritonllm_requests_running", 0, timeout=1.0)


def test_concurrent_streams_batch_and_match_hf(triton_server, stream, tokenizer, hf_greedy):
    n = 16
    sent = {}
    for prompt in PROMPTS:
        rid = stream.send("llm", {"text_input": prompt, "max_tokens": n, **GREEDY})
        sent[rid] = prompt
    results = stream.collect(count=len(PROMPTS))
    assert set(results) == set(sent)
    for rid, prompt in sent.items():
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert _text(results[rid]) == tokenizer.decode(
            hf_greedy(prompt_ids, n), skip_special_tokens=True
        ), prompt
        assert _last(results[rid], "finish_reason") == "length"
    assert metric(triton_server, "tritonllm_batch_size_max") > 1
    assert metric(triton_server, "tritonllm_generated_tokens_total") >= n * len(PROMPTS)
    # Time counters: the engine thread did work and used CPU for it; the sender answered.
    busy = wait_metric(triton_server, "tritonllm_engine_busy_seconds_total", bool, timeout=2.0)
    assert 0 < metric(triton_server, "tritonllm_engine_cpu_seconds_total") <= busy * 1.05 + 0.01
    assert metric(triton_server, "tritonllm_engine_steps_total") >= n
    assert metric(triton_server, "tritonllm_engine_gpu_wait_seconds_total") <= busy
    assert 0 < metric(triton_server, "tritonllm_engine_output_seconds_total") <= busy
    assert metric(triton_server, "tritonllm_responses_total") >= len(PROMPTS)
    assert (
        1
        <= metric(triton_server, "tritonllm_engine_prefill_steps_total")
        < metric(triton_server, "tritonllm_engine_steps_total")
    )
    assert metric(triton_server, "tritonllm_engine_prefill_tokens_total") >= len(PROMPTS)
    assert metric(triton_server, "tritonllm_sender_busy_seconds_total") > 0


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"max_tokens": 4}, "text_input or messages"),
        ({"messages": "[{not json", "max_tokens": 4}, "messages is not valid JSON"),
        ({"messages": '[{"role": "robot", "content": "x"}]'}, "role"),
        ({"text_input": "hi", "temperature": -1.0}, "temperature"),
        ({"text_input": "hi", "top_p": 1.5}, "top_p"),
        ({"text_input": "hello " * 3000, "max_tokens": 4}, "max_model_len"),
    ],
    ids=["no-text", "bad-json", "bad-role", "negative-temperature", "top-p-above-one", "too-long"],
)
def test_bad_input_fails_that_request_only(stream, inputs, message):
    stream.send("llm", inputs)
    with pytest.raises(InferenceServerException, match=message):
        stream.next()
    rid = stream.send("llm", {"text_input": "Hello", "max_tokens": 2, **GREEDY})
    assert _last(stream.collect()[rid], "num_output_tokens") == 2


def test_generator_without_input_ids_is_an_error(stream):
    stream.send("generator", {"max_tokens": 2})
    with pytest.raises(InferenceServerException, match="input_ids is required"):
        stream.next()


DETOKENIZER_BASE = [
    ("output_ids", "INT32", [1], [10]),
    ("prefix_ids", "INT32", [0], []),
    ("finish_reason", "BYTES", [1], [""]),
    ("num_output_tokens", "INT32", [1], [1]),
]


@pytest.mark.parametrize(
    ("model", "inputs", "code"),
    [
        ("tokenizer", [("messages", "BYTES", [1], ["[{not json"])], "invalid_input"),
        ("tokenizer", [("input_ids", "INT32", [1], [10**9])], "invalid_value"),
        (
            "detokenizer",
            [
                ("output_ids", "INT32", [1], [10**8]),
                ("prefix_ids", "INT32", [0], []),
                ("finish_reason", "BYTES", [1], [""]),
                ("num_output_tokens", "INT32", [1], [1]),
            ],
            "invalid_value",
        ),
        # QA (stop 39): these three were 500s with a bare KeyError / ValueError as message.
        (
            "detokenizer",
            [*DETOKENIZER_BASE, ("output_logprobs", "FP32", [1], [-0.5])],
            "invalid_input",
        ),
        (
            "detokenizer",
            [
                *DETOKENIZER_BASE,
                ("output_logprobs", "FP32", [1], [-0.5]),
                ("top_logprob_ids", "INT32", [3], [1, 2, 3]),
                ("top_logprobs", "FP32", [2], [-1.0, -2.0]),
            ],
            "invalid_input",
        ),
        ("detokenizer", [*DETOKENIZER_BASE, ("trim_chars", "INT32", [1], [-3])], "invalid_value"),
    ],
    ids=[
        "tokenizer-bad-json",
        "tokenizer-id-out-of-range",
        "detokenizer-id-out-of-range",
        "detokenizer-logprobs-without-top",
        "detokenizer-top-lengths-differ",
        "detokenizer-negative-trim",
    ],
)
def test_a_request_fault_on_a_direct_call_is_a_client_error(triton_server, model, inputs, code):
    """QA: a KServe ``/infer`` (or gRPC ``ModelInfer``) of the tokenizer or detokenizer with a
    bad input answered HTTP 500 / ``INTERNAL`` (the Python backend's default error code), which
    tells clients and their retry policies that the server failed; Triton's own input checks
    answer 400. A request's fault is now ``INVALID_ARG``: 400 and ``INVALID_ARGUMENT``."""
    body = {
        "inputs": [
            {"name": name, "datatype": dtype, "shape": shape, "data": data}
            for name, dtype, shape, data in inputs
        ]
    }
    url = f"http://{triton_server.http_url}/v2/models/{model}/infer"
    response = requests.post(url, json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert f'"code":"{code}"' in response.json()["error"]
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    tensors = []
    for name, dtype, shape, data in inputs:
        tensor = grpcclient.InferInput(name, shape, dtype)
        numpy_type = {"BYTES": object, "INT32": np.int32, "FP32": np.float32}[dtype]
        tensor.set_data_from_numpy(np.array(data, dtype=numpy_type))
        tensors.append(tensor)
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, tensors)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    client.close()
