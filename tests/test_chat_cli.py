"""``python -m tritonllm.chat`` (``make chat``) under a pseudo-terminal, against the real service.

Oracles: the same conversation sent to the OpenAI API at temperature 0 (the streamed reply must
be its answer, so the history really is sent), tritonserver's ``tritonllm_*`` gauges (Ctrl-C
aborts the generation and frees its KV pages), and the processes left (none).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import openai
import pytest
from openai_helpers import engine_gauges, engine_idle, wait_for_gauges

from tritonllm.triton_server import free_port

pexpect = pytest.importorskip("pexpect")  # a dev dependency; GPU hosts may lack it

REPO_ROOT = Path(__file__).resolve().parent.parent
STATS = re.compile(r"\[(\d+) tokens, ([\d.]+) tokens/s, TTFT ([\d.]+) s, finish_reason (\w+)\]")
PROMPT = "> "
# Greedy SmolLM2 keeps writing this story far past 2,000 tokens (it loops), so the reply is
# still being generated when the test presses Ctrl-C.
LONG_PROMPT = "Write a very long story about a dragon, at least 2000 words."


def spawn_chat(*args: str, timeout: float = 180) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable,
        ["-m", "tritonllm.chat", *args],
        cwd=str(REPO_ROOT),
        encoding="utf-8",
        timeout=timeout,
        dimensions=(50, 200),
    )


def say(child: pexpect.spawn, text: str) -> tuple[str, re.Match]:
    """Send one line; return the reply as printed and the stats line's match."""
    child.expect_exact(PROMPT)
    child.sendline(text)
    child.expect_exact(text)  # the terminal's echo of the line
    child.expect(STATS)
    reply = child.before.replace("\r\n", "\n").strip("\n")
    return reply, child.match


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

        child.expect_exact(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
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


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_chat_starts_a_service_when_none_runs_and_stops_it(tiny_model_dir):
    port = free_port()
    ports = " ".join(f"--{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics"))
    child = spawn_chat(
        f"--url=http://127.0.0.1:{port}/v1",
        f"--model={tiny_model_dir}",
        f"--serve-args={ports}",
        "--max-tokens=4",
        timeout=300,
    )
    try:
        child.expect(r"no service at \S+: starting one \(log: (\S+)\)")
        log = Path(child.match.group(1))
        child.expect(r"chatting with tiny-qwen3")
        _, stats = say(child, "Hello")
        assert stats.group(1) == "4" and stats.group(4) == "length"
        pids = [
            re.search(rf"{name} pid (\d+)", log.read_text())[1]
            for name in ("tritonserver", "sidecar")
        ]
        child.expect_exact(PROMPT)
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=120)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # the service it started is gone
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
        ).models.list()
