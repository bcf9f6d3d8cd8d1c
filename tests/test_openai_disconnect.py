"""A client that goes away mid-request makes the sidecar abort the request in the generator:
its KV pages are free again within 2 s (checked on tritonserver's ``tritonllm_*`` metrics)."""

from __future__ import annotations

import httpx
import openai
from openai_helpers import engine_gauges, engine_idle, wait_for_gauges

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


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
    assert engine_idle(engine_gauges(sidecar.metrics_url))
    client = openai.OpenAI(base_url=sidecar.base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=sidecar.model_name,
        messages=[{"role": "user", "content": "Write a very long story."}],
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


def test_non_stream_client_timeout_aborts_the_generation(sidecar):
    """A non-streaming client that gives up (read timeout) also frees the generator."""
    body = {
        "model": sidecar.model_name,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        **LONG,
    }

    try:
        httpx.post(f"{sidecar.base_url}/chat/completions", json=body, timeout=1.0)
        raise AssertionError("2000 tokens should take longer than the 1 s client timeout")
    except httpx.ReadTimeout:
        pass
    _assert_aborted_then_serving(sidecar)
