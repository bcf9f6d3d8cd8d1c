"""A client that goes away mid-request makes the sidecar abort the request in the generator:
its KV pages are free again within 2 s (checked on tritonserver's ``tritonllm_*`` metrics), and
the request ends in Triton: the ``llm`` ensemble releases it (its inference statistics count it
a success) and tritonserver shuts down without an inference left in flight."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest
from frontend_fixtures import start_sidecar, stop_process
from openai_helpers import engine_idle, wait_for_gauges

# The ensemble the sidecar streams from (openai_frontend --triton-model's default).
SIDECAR_MODEL = "llm_fused"
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
MESSAGES = [{"role": "user", "content": "Write a very long story."}]


def _inference_counts(server, model: str) -> tuple[int, int]:
    """``(success, fail)`` of ``model``'s inference statistics (Triton's HTTP endpoint; a
    restricted API: the request carries the server's admin key).

    An ensemble counts a success only when it releases the request (its last step finished);
    an ensemble request that failed counts a failure when its error response is sent, released
    or not.
    """
    url = f"http://{server.http_url}/v2/models/{model}/stats"
    request = urllib.request.Request(url, headers=server.admin_headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        (stats,) = json.loads(response.read())["model_stats"]
    counts = stats["inference_stats"]
    return counts["success"]["count"], counts["fail"]["count"]


def _wait_for_counts(server, model: str, want: tuple[int, int], timeout_s: float):
    deadline = time.monotonic() + timeout_s
    counts = _inference_counts(server, model)
    while counts != want and time.monotonic() < deadline:
        time.sleep(0.05)
        counts = _inference_counts(server, model)
    return counts


def _generating(gauges):
    return gauges["tritonllm_requests_running"] >= 1 and gauges["tritonllm_kv_pages_used"] >= 1


def _assert_aborted_then_serving(sidecar):
    gauges = wait_for_gauges(sidecar.metrics_url, engine_idle, timeout_s=2.0)
    assert engine_idle(gauges), gauges
    # Nothing keeps generating in the background after the abort.
    produced = gauges["tritonllm_generated_tokens_total"]
    assert (
        wait_for_gauges(sidecar.metrics_url, lambda g: False, 0.3)[
            "tritonllm_generated_tokens_total"
        ]
        == produced
    )
    client = openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model=sidecar.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert response.usage.completion_tokens == 3


def test_closing_a_stream_aborts_the_generation(sidecar):
    # The session's sidecar may still be ending an earlier file's requests (CI, 2026-12-07:
    # not idle at once); one that never ends fails here.
    gauges = wait_for_gauges(sidecar.metrics_url, engine_idle, timeout_s=30.0)
    assert engine_idle(gauges), gauges
    client = openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=sidecar.model_name,
        messages=MESSAGES,
        stream=True,
        max_tokens=2000,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 10:
            break
    gauges = wait_for_gauges(sidecar.metrics_url, _generating, timeout_s=2.0)
    assert _generating(gauges), gauges
    stream.close()
    _assert_aborted_then_serving(sidecar)


def test_non_stream_client_timeout_aborts_the_generation(sidecar, triton_server):
    """A non-streaming client that gives up (read timeout) also frees the generator, and its
    ``llm`` request completes in Triton."""
    body = {"model": sidecar.model_name, "messages": MESSAGES, **LONG}
    success, fail = _inference_counts(triton_server, SIDECAR_MODEL)

    try:
        httpx.post(f"{sidecar.base_url}/chat/completions", json=body, timeout=1.0)
        raise AssertionError("2000 tokens should take longer than the 1 s client timeout")
    except httpx.ReadTimeout:
        pass
    counts = _wait_for_counts(triton_server, SIDECAR_MODEL, (success + 1, fail), timeout_s=5.0)
    assert counts == (success + 1, fail), f"llm (success, fail): {counts}, was {(success, fail)}"
    _assert_aborted_then_serving(sidecar)


def _disconnect(base_url: str, model: str, endpoint: str, n: int = 1, chunks: int = 5) -> None:
    """Open a long stream on ``endpoint`` (``chat`` or ``completions``), read ``chunks``
    chunks, then close the connection."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    common = {"model": model, "stream": True, "n": n, "extra_body": {"ignore_eos": True}}
    if endpoint == "chat":
        stream = client.chat.completions.create(messages=MESSAGES, max_tokens=2000, **common)
    else:
        stream = client.completions.create(prompt="Once upon a time", max_tokens=2000, **common)
    for i, _ in enumerate(stream):
        if i == chunks:
            break
    stream.close()


@pytest.mark.parametrize(("endpoint", "n"), [("chat", 1), ("chat", 2), ("completions", 1)])
def test_disconnected_stream_ends_its_llm_request(sidecar, triton_server, endpoint, n):
    """The ``llm`` ensemble request of a stream whose client went away completes: the ensemble
    releases it (one success, no failure) once the generator's final response went through.

    A cancelled ensemble request instead fails (Triton 2.51's ensemble then never releases it:
    an inference in flight until shutdown)."""
    success, fail = _inference_counts(triton_server, SIDECAR_MODEL)
    _disconnect(sidecar.base_url, sidecar.model_name, endpoint, n=n)
    counts = _wait_for_counts(triton_server, SIDECAR_MODEL, (success + 1, fail), timeout_s=5.0)
    assert counts == (success + 1, fail), f"llm (success, fail): {counts}, was {(success, fail)}"
    assert engine_idle(wait_for_gauges(sidecar.metrics_url, engine_idle, timeout_s=2.0))


def _read_all(base_url: str, model: str, max_tokens: int) -> int:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        stream=True,
        max_tokens=max_tokens,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    return [chunk.usage for chunk in stream if chunk.usage][0].completion_tokens


@pytest.mark.slow
def test_server_shuts_down_with_nothing_in_flight_after_disconnects(tiny_model_dir, tmp_path):
    """The direct observable: after clients went away mid-stream (while another stream runs),
    tritonserver stops on SIGTERM without waiting for an inference in flight and unloads every
    model, the generator included (then its Python stub exits and frees its shared memory)."""
    from tritonllm.triton_server import TritonServer

    log_path = tmp_path / "tritonserver.log"
    server = TritonServer(
        model_path=tiny_model_dir, env={"TRITONLLM_DEVICE": "cpu"}, log_path=log_path
    )
    server.start(timeout=300)
    sidecar = None
    try:
        model = Path(tiny_model_dir).name
        sidecar, base_url = start_sidecar(
            server.grpc_url, model, tmp_path / "sidecar.log", control_secret=server.control_secret
        )
        # The sidecar's /health sent llm (not this ensemble) one probe generation before it answered 200.
        before = _inference_counts(server, SIDECAR_MODEL)
        completed: list[int] = []
        background = threading.Thread(
            target=lambda: completed.append(_read_all(base_url, model, max_tokens=800))
        )
        background.start()
        disconnects = [("chat", 1), ("chat", 2), ("completions", 1)] * 3
        for endpoint, n in disconnects:
            _disconnect(base_url, model, endpoint, n=n)
        background.join(timeout=120)
        # The background stream completes too.
        want = (before[0] + len(disconnects) + 1, before[1])
        counts = _wait_for_counts(server, SIDECAR_MODEL, want, timeout_s=5.0)
    finally:
        if sidecar is not None:
            stop_process(sidecar)
        start = time.monotonic()
        server.stop(timeout=20.0)  # SIGTERM; SIGKILL after 20 s
        stopped_s = time.monotonic() - start
    log = log_path.read_text(errors="replace")
    assert not re.search(r"has \d+ in-flight inferences", log), log[-3000:]
    assert "Found 0 model versions that have in-flight inferences" in log, log[-3000:]
    for name in ("llm", "llm_fused", "tokenizer", "generator", "detokenizer", "ensemble"):
        assert f"successfully unloaded '{name}'" in log, log[-3000:]
    assert server.process.returncode != -signal.SIGKILL, f"killed after {stopped_s:.1f} s"
    assert completed == [800]
    assert counts == want, f"llm (success, fail): {counts}"


def test_a_sidecar_without_the_control_secret_falls_back_to_llm(triton_server, tmp_path):
    """A sidecar started without the server's control secret can neither abort nor hold a
    lease; it then streams from llm, whose detokenizer step stops the generation of a
    disconnected stream (through llm_fused that generation would run to max_tokens)."""
    log_path = tmp_path / "sidecar.log"
    no_secret = {"TRITONLLM_CONTROL_SECRET": ""}
    process, base_url = start_sidecar(triton_server.grpc_url, "tiny", log_path, env=no_secret)
    try:
        fused = _inference_counts(triton_server, SIDECAR_MODEL)
        _disconnect(base_url, "tiny", "chat")
        gauges = wait_for_gauges(triton_server.metrics_url, engine_idle, timeout_s=5.0)
        assert engine_idle(gauges), gauges
        assert _inference_counts(triton_server, SIDECAR_MODEL) == fused  # not through llm_fused
    finally:
        stop_process(process)
    assert "refused this sidecar's lease" in log_path.read_text()
