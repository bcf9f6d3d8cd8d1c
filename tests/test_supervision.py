"""Supervision and drain under ``python -m tritonllm.launch``, tried as an operator would.

One launcher (short health timings) goes through the failures of issue 17 in turn:

1. the launcher process is small: no torch or transformers in it;
2. the generator's stub is SIGKILLed with streams in flight: they fail at once (not after the
   300 s idle timeout), ``/health`` turns 503, and the launcher restarts tritonserver;
3. SIGTERM with streams in flight: new requests and ``/health`` get 503, the streams finish
   whole, the launcher exits 0 and no process is left.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_launch import _kill_marked, _marked_env, _read_until, _wait_none_marked
from test_openai_backend_death import _stub_pid

from tritonllm.triton_server import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")

MESSAGES = [{"role": "user", "content": "Hello"}]


class Launcher:
    """A launcher process whose output lines are collected on a thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tritonllm.launch", *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def wait_for(self, text: str, timeout_s: float) -> str:
        """Wait for a line containing ``text``; returns the output so far."""
        found = _read_until(self.lines, self.output, text, timeout_s)
        log = "".join(self.output)
        assert found, f"no {text!r} within {timeout_s} s:\n{log[-4000:]}"
        return log

    def triton_pid(self) -> int:
        return int(re.findall(r"tritonserver pid (\d+)", "".join(self.output))[-1])


def _stream(client: openai.OpenAI, max_tokens: int):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip


def _consume(client, max_tokens, started: threading.Barrier, results: queue.Queue) -> None:
    """Read one stream to its end; puts ("ok", finish_reason, completion tokens) or
    ("error", exception, seconds from the first chunk to the error)."""
    first = None
    finish, usage = None, None
    try:
        for chunk in _stream(client, max_tokens):
            if first is None:
                first = time.monotonic()
                started.wait(60)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        results.put(("ok", finish, usage.completion_tokens if usage else None))
    except Exception as exc:  # noqa: BLE001 (reported to the test thread)
        results.put(("error", exc, time.monotonic() - (first or time.monotonic())))


def _start_streams(client, n: int, max_tokens: int) -> queue.Queue:
    started, results = threading.Barrier(n + 1), queue.Queue()
    for _ in range(n):
        threading.Thread(
            target=_consume, args=(client, max_tokens, started, results), daemon=True
        ).start()
    started.wait(60)  # every stream has its first chunk
    return results


def _small_process(pid: int) -> tuple[bool, int]:
    """(no torch library mapped, resident memory in MiB) of process ``pid``."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    return "libtorch" not in maps and "torch/lib" not in maps, rss_kib // 1024


def test_launcher_restarts_a_broken_service_and_drains_on_sigterm(tiny_model_dir):
    env, entry = _marked_env()
    port = free_port()
    args = [f"--model={tiny_model_dir}", "--model-name=tiny", f"--port={port}"]
    args += [f"--{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics")]
    args += ["--unhealthy-timeout=3", "--health-interval=0.5", "--drain-timeout=60"]
    launcher = Launcher(args, env)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        launcher.wait_for("Ctrl-C", 300)

        # 1. The launcher holds neither torch nor transformers (their libraries, their memory).
        no_torch, rss_mib = _small_process(launcher.process.pid)
        assert no_torch and rss_mib < 150, rss_mib

        # 2. A SIGKILLed generator stub: Triton never answers its requests in flight again. The
        # sidecar's watch fails them at once with a 503 (the idle timeout is 300 s here).
        results = _start_streams(client, 3, max_tokens=1900)
        os.kill(_stub_pid(launcher.triton_pid(), "generator"), signal.SIGKILL)
        ends = [results.get(timeout=60) for _ in range(3)]
        for kind, error, seconds in ends:
            assert kind == "error" and error.code == "service_unavailable", ends
            assert seconds < 15, ends
        health = httpx.get(f"{base}/health", timeout=30)
        assert health.status_code == 503, health.text
        launcher.wait_for("tritonserver unhealthy for", 30)
        launcher.wait_for("tritonserver restarted; healthy", 300)
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert reply.usage.completion_tokens == 4

        # 3. SIGTERM drains: the streams in flight finish whole; new requests get 503.
        results = _start_streams(client, 3, max_tokens=300)
        launcher.process.send_signal(signal.SIGTERM)
        launcher.wait_for("draining", 30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the sidecar gets the SIGTERM a moment later
            if httpx.get(f"{base}/health", timeout=10).status_code == 503:
                break
            time.sleep(0.05)
        refused = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4},
            timeout=30,
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "service_unavailable"
        ends = [results.get(timeout=120) for _ in range(3)]
        assert ends == [("ok", "length", 300)] * 3, ends
        assert launcher.process.wait(60) == 0
        assert _wait_none_marked(entry, 30) == {}
    finally:
        if launcher.process.poll() is None:
            launcher.process.terminate()
            try:
                launcher.process.wait(90)
            except subprocess.TimeoutExpired:
                launcher.process.kill()
        _kill_marked(entry)


def test_launcher_builds_the_default_model_without_importing_torch(tmp_path, monkeypatch):
    """Building the built-in model runs in a child process: the launcher never imports torch or
    transformers (the serve path imports nothing else lazily but tempfile)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import tritonllm.launch as launch\n"
        f"launch.DEFAULT_MODEL_DIR = Path({str(tmp_path / 'tiny')!r})\n"
        "model = launch.resolve_model(None)\n"
        "launch.parse_args([])\n"
        "assert Path(model, 'config.json').is_file(), model\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print('heavy:', heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "heavy: []" in result.stdout, result.stdout
