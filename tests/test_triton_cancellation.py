"""A Triton gRPC client that cancels its stream stops the generation and frees its KV cache.

Through the ``llm`` ensemble (Triton 2.51 marks the detokenizer requests that follow a
cancellation as cancelled; the detokenizer then aborts the generation, ARCHITECTURE.md
"Platform facts") and through TensorRT-LLM's ``ensemble`` entry (a BLS model that sees the
cancellation itself). Oracle: the engine's gauges on the metrics port (0 running requests,
0 used KV pages within 2 s) and Triton's own statistics (the ensemble request completed rather
than staying in flight); other requests, including one under the same empty request id, run on.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
from test_triton_conventions import trtllm_inputs
from test_triton_models import GREEDY, PROMPTS, Stream, metric, wait_metric

grpcclient = pytest.importorskip("tritonclient.grpc")

FREED_WITHIN_S = 2.0
LONG = {"max_tokens": 2000, **GREEDY}


def _llm_completed(server) -> int:
    """Ensemble requests Triton finished (success or failure): a leaked one never counts.
    Statistics are a restricted Triton API: the call carries the server's admin key."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    reply = client.get_inference_statistics("llm", headers=server.grpc_admin_headers, as_json=True)
    stats = reply["model_stats"][0]
    client.close()
    counts = stats["inference_stats"]
    return int(counts["success"].get("count", 0)) + int(counts["fail"].get("count", 0))


def _wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - start


def _cancel_while_generating(server, stream: Stream) -> None:
    stream.next()  # generating
    wait_metric(server, "tritonllm_kv_pages_used", lambda pages: pages > 0, timeout=5.0)
    stream.close(cancel=True)


def _freed(server) -> bool:
    running = metric(server, "tritonllm_requests_running")
    return running == 0 and metric(server, "tritonllm_kv_pages_used") == 0


@pytest.mark.parametrize("request_id", ["cancel-me", ""], ids=["named", "empty-id"])
def test_cancelled_llm_stream_frees_its_kv_within_2_s(triton_server, request_id):
    completed = _llm_completed(triton_server)
    stream = Stream(triton_server.grpc_url)
    _send(stream, {"text_input": PROMPTS[3], **LONG}, request_id)
    _cancel_while_generating(triton_server, stream)
    _wait_for(lambda: _freed(triton_server), FREED_WITHIN_S, "0 running, 0 KV pages")
    # Triton released the ensemble request (a leak would stay "in flight" forever).
    _wait_for(lambda: _llm_completed(triton_server) == completed + 1, 10.0, "llm completion")


def test_a_cancellation_ends_only_its_own_request(triton_server):
    """Two clients with the same empty request id: cancelling one leaves the other running to
    its end."""
    other = Stream(triton_server.grpc_url)
    _send(other, {"text_input": PROMPTS[0], "max_tokens": 40, **GREEDY}, "")
    cancelled = Stream(triton_server.grpc_url)
    _send(cancelled, {"text_input": PROMPTS[3], **LONG}, "")
    _cancel_while_generating(triton_server, cancelled)
    outputs = []
    while True:
        _, out, final = other.next(timeout=60)
        if out is not None:
            outputs.append(out)
        if final:
            break
    other.close()
    assert outputs[-1]["finish_reason"][0] == b"length"
    assert int(outputs[-1]["num_output_tokens"][0]) == 40
    _wait_for(lambda: _freed(triton_server), FREED_WITHIN_S, "0 running, 0 KV pages")


def test_the_generator_health_probe_aborts_nothing(triton_server):
    stream = Stream(triton_server.grpc_url)
    rid = stream.send("llm", {"text_input": PROMPTS[1], "max_tokens": 30, **GREEDY})
    stream.next()
    probe = Stream(triton_server.grpc_url)
    try:
        probe.send("generator", {"health_probe": True}, request_id=rid)  # even the same id
        # One final response, carrying only the engine's context limit and its step count
        # (the engine has run steps: a request of 30 tokens is under way).
        (answer,) = probe.collect()[rid]
        assert set(answer) == {"max_model_len", "engine_steps"}
        assert int(answer["max_model_len"].item()) > 0 and int(answer["engine_steps"].item()) > 0
    finally:
        probe.close()
    outputs = stream.collect()[rid]
    stream.close()
    assert outputs[-1]["finish_reason"][0] == b"length"


def test_cancelled_trtllm_stream_frees_its_kv_within_2_s(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    # end_id: a token the greedy tiny model does not reach, so the generation runs on.
    inputs = trtllm_inputs(PROMPTS[2], 2000, True, end_id=np.array([[151935]], np.int32))
    client.async_stream_infer("ensemble", inputs, request_id="trt-cancel")
    result, error = responses.get(timeout=60)
    assert error is None, error
    wait_metric(triton_server, "tritonllm_kv_pages_used", lambda pages: pages > 0, timeout=5.0)
    client.stop_stream(cancel_requests=True)
    client.close()
    _wait_for(lambda: _freed(triton_server), FREED_WITHIN_S, "0 running, 0 KV pages")


def _send(stream: Stream, values: dict, request_id: str) -> None:
    """``Stream.send`` with the given request id, empty ones included."""
    from test_triton_models import _infer_inputs

    stream.client.async_stream_infer(
        "llm", _infer_inputs(values), request_id=request_id, enable_empty_final_response=True
    )
