"""The sidecar's chat page (``GET /``) in headless Chromium, against the real service.

Debian's ``chromium`` (``.ci/run`` installs it) driven by Playwright, never Playwright's own
browser download. Oracles: the OpenAI API's own answer to the same request at temperature 0,
the request headers the page sends, and tritonserver's ``tritonllm_*`` gauges for Stop.
Screenshots are kept under ``test-artifacts/`` (git-ignored).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import openai
import pytest
from openai_helpers import engine_gauges, engine_idle, wait_for_gauges

REPO_ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO_ROOT / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Greedy SmolLM2 writes this story for far more than 2,000 tokens (test_chat_cli.py).
LONG_PROMPT = "Write a very long story about a dragon, at least 2000 words."
STATS = re.compile(r"(\d+) tokens, ([\d.]+) tokens/s, TTFT ([\d.]+) s, finish_reason (\w+)")


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, smollm2_service):
    """A fresh page (own context: empty localStorage) on the sidecar's root URL."""
    context = browser.new_context(viewport={"width": 1100, "height": 700})
    page = context.new_page()
    page.goto(smollm2_service.root_url + "/")
    page.wait_for_function(
        "document.getElementById('model-name').textContent === 'smollm2-135m-instruct'"
    )
    yield page
    context.close()


def set_field(page, selector: str, value: str) -> None:
    page.fill(selector, value)
    page.dispatch_event(selector, "change")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def wait_reply_done(page, index: int) -> str:
    """The stats line of the ``index``-th reply, once the reply finished."""
    page.wait_for_function(
        "(i) => { const s = document.querySelectorAll('.stats')[i];"
        " return s && /finish_reason|stopped|^$/.test(s.textContent)"
        " && document.getElementById('stop').disabled; }",
        arg=index,
        timeout=120_000,
    )
    return page.locator(".stats").nth(index).inner_text()


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def test_page_is_one_self_contained_file(smollm2_service):
    import urllib.request

    with urllib.request.urlopen(smollm2_service.root_url + "/", timeout=10) as response:
        assert response.headers["content-type"].startswith("text/html")
        html = response.read().decode()
    # Nothing loaded from elsewhere: no external scripts, styles, fonts or images.
    assert not re.search(r"""(src|href)=["'](https?:)?//""", html)
    assert "@import" not in html and "url(" not in html


def test_page_streams_a_conversation_with_tokens_per_s(page, smollm2_service):
    requests = []
    page.on("request", lambda r: requests.append(r) if "/v1/chat/completions" in r.url else None)
    set_field(page, "#temperature", "0")
    set_field(page, "#max-tokens", "64")
    question = "What is the capital of France?"
    send(page, question)
    stats = STATS.fullmatch(wait_reply_done(page, 0))
    assert stats and stats.group(4) == "stop" and float(stats.group(2)) > 0
    reply = page.locator(".msg.assistant").nth(0).inner_text()
    client = openai.OpenAI(base_url=smollm2_service.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": question}]

    def answer(messages):
        response = client.chat.completions.create(
            model=smollm2_service.model_name, messages=messages, temperature=0, max_tokens=64
        )
        return response.choices[0].message.content, response.usage.completion_tokens

    assert (reply, int(stats.group(1))) == answer(messages) and "Paris" in reply
    # The second turn carries the first: the page keeps the conversation.
    follow_up = "And of Italy?"
    send(page, follow_up)
    assert STATS.fullmatch(wait_reply_done(page, 1))
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
    assert page.locator(".msg.assistant").nth(1).inner_text() == answer(messages)[0]
    body = requests[-1].post_data_json
    assert body["stream"] is True and body["messages"] == messages and body["temperature"] == 0
    assert "authorization" not in requests[-1].headers  # no key set: no header
    screenshot(page, "chat-page.png")


def test_api_key_is_sent_as_bearer(page):
    seen = []
    page.on("request", lambda r: seen.append((r.url, r.headers.get("authorization"))))
    set_field(page, "#api-key", "sk-test-123")  # the page lists the models again with it
    set_field(page, "#max-tokens", "4")
    send(page, "Hi")
    assert STATS.fullmatch(wait_reply_done(page, 0))
    api = [(url, auth) for url, auth in seen if "/v1/" in url]
    assert {url.rsplit("/v1/", 1)[1] for url, _ in api} == {"models", "chat/completions"}
    assert all(auth == "Bearer sk-test-123" for _, auth in api), api


def test_stop_aborts_the_generation_and_frees_its_kv(page, smollm2_service):
    metrics = smollm2_service.metrics_url
    assert engine_idle(engine_gauges(metrics))
    set_field(page, "#temperature", "0")
    set_field(page, "#max-tokens", "2000")
    send(page, LONG_PROMPT)
    page.wait_for_function(
        "document.querySelector('.msg.assistant').textContent.length > 20", timeout=120_000
    )
    running = wait_for_gauges(metrics, lambda g: g["tritonllm_requests_running"] == 1, 30)
    assert running["tritonllm_kv_pages_used"] >= 1
    page.click("#stop")
    stats = wait_reply_done(page, 0)
    assert stats.startswith("stopped after") and "generation aborted" in stats
    idle = wait_for_gauges(metrics, engine_idle, 30)
    assert engine_idle(idle), idle
    assert (
        idle["tritonllm_generated_tokens_total"] - running["tritonllm_generated_tokens_total"]
        < 2000
    )
    screenshot(page, "chat-page-stopped.png")
    # The page goes on after a stop.
    set_field(page, "#max-tokens", "64")
    send(page, "What is the capital of France?")
    assert STATS.fullmatch(wait_reply_done(page, 1)).group(4) == "stop"
