"""Helpers shared by the OpenAI sidecar integration tests (tests/test_openai_*.py) and the
Triton ones that check what they send on."""

from __future__ import annotations

import json
import re
import time
import urllib.request


def engine_gauges(metrics_url: str) -> dict[str, float]:
    """The ``tritonllm_*`` values on tritonserver's Prometheus endpoint."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return {k: float(v) for k, v in re.findall(r"^(tritonllm_\w+)\{[^}]*\} (\S+)$", text, re.M)}


def wait_for_gauges(metrics_url: str, predicate, timeout_s: float) -> dict[str, float]:
    """Poll the gauges until ``predicate(gauges)`` holds; return them (last seen on timeout)."""
    deadline = time.monotonic() + timeout_s
    gauges = engine_gauges(metrics_url)
    while not predicate(gauges) and time.monotonic() < deadline:
        time.sleep(0.05)
        gauges = engine_gauges(metrics_url)
    return gauges


def engine_idle(gauges: dict[str, float]) -> bool:
    return gauges["tritonllm_requests_running"] == 0 and gauges["tritonllm_kv_pages_used"] == 0


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """Prompt ids by Hugging Face's own chat template rendering (the oracle for usage)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def strict_json(text: str):
    """``text`` parsed as JSON proper: NaN and Infinity, which Python's ``json`` reads (and a
    client's parser refuses), fail the test."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON: {text}")

    return json.loads(text, parse_constant=refuse)
