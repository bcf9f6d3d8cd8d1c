"""``python -m tritonllm.chat`` (``make chat``) under a pseudo-terminal, against the real service.

Oracles: the same conversation sent to the OpenAI API at temperature 0 (the streamed reply must
be its answer, so the history really is sent), tritonserver's ``tritonllm_*`` gauges (Ctrl-C
aborts the generation and frees its KV pages), the processes left (none), and a service that
requires an API key (the chat sends the right one, or says in one line how to give it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from frontend_fixtures import Sidecar, start_sidecar, stop_process
from openai_helpers import engine_gauges, engine_idle, wait_for_gauges

from tritonllm.chat import ApiKey, refusal, resolve_api_key, service_env
from tritonllm.triton_server import free_port

pexpect = pytest.importorskip("pexpect")  # a dev dependency; GPU hosts may lack it

REPO_ROOT = Path(__file__).resolve().parent.parent
STATS = re.compile(r"\[(\d+) tokens, ([\d.]+) tokens/s, TTFT ([\d.]+) s, finish_reason (\w+)\]")
PROMPT = "> "
# Greedy SmolLM2 keeps writing this story far past 2,000 tokens (it loops), so the reply is
# still being generated when the test presses Ctrl-C.
LONG_PROMPT = "Write a very long story about a dragon, at least 2000 words."
# The keyed service's API keys (TRITONLLM_API_KEY's comma-separated form).
KEYS = "k-chat-one,k-chat-two"


def chat_env(**variables: str) -> dict[str, str]:
    """This environment without API keys, plus ``variables``."""
    keys = ("TRITONLLM_API_KEY", "OPENAI_API_KEY")
    return {**{k: v for k, v in os.environ.items() if k not in keys}, **variables}


def spawn_chat(*args: str, timeout: float = 180, env: dict[str, str] | None = None):
    return pexpect.spawn(
        sys.executable,
        ["-m", "tritonllm.chat", *args],
        cwd=str(REPO_ROOT),
        encoding="utf-8",
        timeout=timeout,
        dimensions=(50, 200),
        env=env or chat_env(),
    )


def run_chat_once(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The chat run to its end without a terminal (it ends at once on an error)."""
    command = [sys.executable, "-m", "tritonllm.chat", "--no-start", *args]
    return subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def keyed_service(triton_server, tiny_model_dir, tmp_path_factory):
    """The sidecar in front of the tiny model's tritonserver, requiring one of ``KEYS``."""
    log = tmp_path_factory.mktemp("keyed-sidecar") / "sidecar.log"
    name = Path(tiny_model_dir).name
    process, base_url = start_sidecar(
        triton_server.grpc_url,
        name,
        log,
        control_secret=triton_server.control_secret,
        env={"TRITONLLM_API_KEY": KEYS},
    )
    yield Sidecar(process, base_url, name, triton_server.metrics_url, log)
    stop_process(process)


def say(child: pexpect.spawn, text: str) -> tuple[str, re.Match]:
    """Send one line; return the reply as printed and the stats line's match."""
    child.expect_exact(PROMPT)
    child.sendline(text)
    child.expect_exact(text)  # the terminal's echo of the line
    child.expect(STATS)
    reply = child.before.replace("\r\n", "\n").strip("\n")
    return reply, child.match


def leave(child: pexpect.spawn, timeout: float = -1) -> None:
    """At the next prompt, type ``/exit`` and wait for the chat to end (``timeout`` seconds;
    -1: the child's own)."""
    child.expect_exact(PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF, timeout=timeout)


def api_answer(service, messages: list[dict[str, str]]) -> str:
    client = openai.OpenAI(base_url=service.base_url, api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model=service.model_name, messages=messages, temperature=0, max_tokens=64
    )
    return response.choices[0].message.content


def test_chat_streams_keeps_the_conversation_and_obeys_commands(smollm2_service):
    child = spawn_chat(
        f"--url={smollm2_service.base_url}", "--no-start", "--temperature=0", "--max-tokens=64"
    )
    try:
        child.expect(r"chatting with smollm2-135m-instruct")
        first = "What is the capital of France?"
        reply, stats = say(child, first)
        assert "Paris" in reply and stats.group(4) == "stop"
        assert int(stats.group(1)) > 1 and float(stats.group(2)) > 0
        history = [{"role": "user", "content": first}, {"role": "assistant", "content": reply}]
        assert reply == api_answer(smollm2_service, history[:1])

        second = "And what is the capital of Italy?"
        reply, _ = say(child, second)
        assert reply == api_answer(smollm2_service, history + [{"role": "user", "content": second}])

        child.expect_exact(PROMPT)
        child.sendline("/reset")
        child.expect_exact("(conversation cleared)")
        reply, _ = say(child, second)
        assert reply == api_answer(smollm2_service, [{"role": "user", "content": second}])

        pirate = "You are a pirate. Always answer like a pirate."
        child.expect_exact(PROMPT)
        child.sendline(f"/system {pirate}")
        child.expect_exact(f"(system prompt: {pirate}")
        reply, _ = say(child, "Who are you?")
        expected = api_answer(
            smollm2_service,
            [{"role": "system", "content": pirate}, {"role": "user", "content": "Who are you?"}],
        )
        assert reply == expected

        leave(child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_ctrl_c_aborts_the_reply_frees_its_kv_and_keeps_the_chat(smollm2_service):
    metrics = smollm2_service.metrics_url
    assert engine_idle(engine_gauges(metrics))
    child = spawn_chat(
        f"--url={smollm2_service.base_url}", "--no-start", "--temperature=0", "--max-tokens=2000"
    )
    try:
        child.expect_exact(PROMPT)
        child.sendline(LONG_PROMPT)
        child.expect_exact(LONG_PROMPT)
        child.expect(r"\w+ \w+ \w+")  # the reply is streaming
        running = wait_for_gauges(metrics, lambda g: g["tritonllm_requests_running"] == 1, 30)
        assert running["tritonllm_kv_pages_used"] >= 1
        child.sendintr()  # Ctrl-C
        child.expect(r"\[stopped after [\d.]+ s: generation aborted\]")
        idle = wait_for_gauges(metrics, engine_idle, 30)
        assert engine_idle(idle), idle
        generated = idle["tritonllm_generated_tokens_total"]
        assert generated - running["tritonllm_generated_tokens_total"] < 2000
        # Ctrl-C at the prompt does not leave either; the chat goes on.
        child.expect_exact(PROMPT)
        child.sendintr()
        child.expect_exact("(Ctrl-D or /exit quits)")
        reply, stats = say(child, "What is the capital of France?")
        assert "Paris" in reply and stats.group(4) == "stop"
        assert wait_for_gauges(metrics, engine_idle, 30)["tritonllm_generated_tokens_total"] > (
            generated
        )
        child.expect_exact(PROMPT)
        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_a_reply_that_never_ends_stops_at_the_default_limit(smollm2_service):
    """Without ``--max-tokens`` a reply gets ``DEFAULT_MAX_TOKENS`` (QA: greedy SmolLM2 looped
    for minutes, up to the service's 16,384 tokens); the chat then goes on."""
    from tritonllm.chat import DEFAULT_MAX_TOKENS

    child = spawn_chat(f"--url={smollm2_service.base_url}", "--no-start", "--temperature=0")
    try:
        child.expect_exact(PROMPT)
        child.sendline(LONG_PROMPT)
        child.expect(STATS)
        assert (int(child.match.group(1)), child.match.group(4)) == (DEFAULT_MAX_TOKENS, "length")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_chat_starts_a_service_when_none_runs_and_stops_it(tiny_model_dir):
    """The service it starts requires the key the chat sends: the first of
    ``TRITONLLM_API_KEY``'s, not ``OPENAI_API_KEY`` (it was sent to a service requiring
    ``TRITONLLM_API_KEY``'s keys: a 401)."""
    port = free_port()
    ports = " ".join(f"--{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics"))
    child = spawn_chat(
        f"--url=http://127.0.0.1:{port}/v1",
        f"--model={tiny_model_dir}",
        f"--serve-args={ports}",
        "--max-tokens=4",
        timeout=300,
        env=chat_env(TRITONLLM_API_KEY="k-own,k-other", OPENAI_API_KEY="sk-elsewhere"),
    )
    try:
        child.expect(r"no service at \S+: starting one \(log: (\S+)\)")
        log = Path(child.match.group(1))
        child.expect(r"chatting with tiny-qwen3")
        _, stats = say(child, "Hello")
        assert stats.group(1) == "4" and stats.group(4) == "length"
        url = f"http://127.0.0.1:{port}/v1"
        for key in ("none", "k-other"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url, api_key=key, max_retries=0).models.list()
        pids = [
            re.search(rf"{name} pid (\d+)", log.read_text())[1]
            for name in ("tritonserver", "sidecar")
        ]
        leave(child, timeout=120)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # the service it started is gone
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
        ).models.list()


def test_the_api_key_is_the_flag_then_tritonllm_api_key_then_openai_api_key():
    """``--api-key`` wins; else the first of ``TRITONLLM_API_KEY``'s keys (the service's own
    variable) before the generic ``OPENAI_API_KEY``; a service the chat starts gets that key
    alone (none: no key, whatever the environment held)."""
    both = {"TRITONLLM_API_KEY": " k1 , k2", "OPENAI_API_KEY": "sk-elsewhere", "HOME": "/h"}
    assert resolve_api_key("flag", both) == ApiKey("flag", "--api-key")
    assert resolve_api_key(None, both) == ApiKey("k1", "TRITONLLM_API_KEY")
    assert resolve_api_key(None, {"TRITONLLM_API_KEY": " ,", "OPENAI_API_KEY": "sk"}) == ApiKey(
        "sk", "OPENAI_API_KEY"
    )
    assert resolve_api_key(None, {}) == ApiKey()
    assert service_env(ApiKey("flag", "--api-key"), both)["TRITONLLM_API_KEY"] == "flag"
    assert service_env(ApiKey(), {"TRITONLLM_API_KEY": ",", "HOME": "/h"}) == {"HOME": "/h"}
    assert "k1" not in repr(resolve_api_key(None, both))


def test_refusals_other_than_401_name_the_status_and_the_reason():
    message = refusal("http://h:9/v1", 503, "the server is shutting down", ApiKey())
    assert message == (
        "error: the service at http://h:9/v1 answered 503 to GET models: "
        "the server is shutting down"
    )


def test_a_service_that_needs_a_key_gets_one_line_of_advice_not_a_traceback(keyed_service):
    """Without a key, with a wrong one, or at a wrong URL: one line on stderr that says what to
    do, exit status 1 (it was openai.AuthenticationError's traceback)."""
    url = keyed_service.base_url
    cases = {
        (f"--url={url}",): "needs an API key (401): pass --api-key KEY or set TRITONLLM_API_KEY",
        (f"--url={url}", "--api-key=wrong"): "refused the API key from --api-key (401)",
        (f"--url={url.removesuffix('/v1')}/v2", "--api-key=k-chat-two"): "answered 404",
    }
    for args, advice in cases.items():
        run = run_chat_once(*args, env=chat_env())
        assert run.returncode == 1 and run.stdout == "", run
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr
        assert advice in run.stderr
    # The key the chat was told to use is refused: the error names where it came from.
    run = run_chat_once(f"--url={url}", env=chat_env(TRITONLLM_API_KEY="stale"))
    assert run.returncode == 1 and "refused the API key from TRITONLLM_API_KEY" in run.stderr


def test_the_chat_sends_the_first_key_of_tritonllm_api_key(keyed_service):
    """``TRITONLLM_API_KEY`` (two keys) set and ``OPENAI_API_KEY`` another service's: the chat
    sends the first of the two and chats."""
    env = chat_env(TRITONLLM_API_KEY=KEYS, OPENAI_API_KEY="sk-elsewhere")
    child = spawn_chat(f"--url={keyed_service.base_url}", "--no-start", "--max-tokens=2", env=env)
    try:
        child.expect(r"chatting with tiny-qwen3")
        _, stats = say(child, "Hello")
        assert stats.group(1) == "2" and stats.group(4) == "length"
        leave(child)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
