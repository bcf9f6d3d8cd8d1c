"""The launcher's process stays small, and helpers to drive a launcher as an operator would.

The launcher's supervision and drain with real processes are tried in
``tests/test_scale_out.py`` (a killed generator stub, a restart, SIGTERM under load, SIGKILL),
its failure policy with stand-in processes in ``tests/test_supervisor_policy.py``, and its
clean stops in ``tests/test_launch.py``.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from test_launch import _read_until

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

    def wait_for(self, text: str | tuple[str, ...], timeout_s: float) -> str:
        """Wait for a line containing ``text`` (or one of a tuple's texts); returns the output
        so far."""
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


def test_launcher_builds_the_default_model_without_importing_torch(tmp_path, monkeypatch):
    """Building the built-in model runs in a child process: the launcher never imports torch or
    transformers (the serve path imports nothing else lazily but tempfile). The child builds the
    tiny Qwen3 here (same ``--out`` interface) to keep the test short."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import tritonllm.launch as launch\n"
        f"launch.DEFAULT_MODEL_DIR = Path({str(tmp_path / 'tiny')!r})\n"
        "launch.DEFAULT_MODEL_BUILDER = ('-m', 'tritonllm.build_model', '--shape', 'tiny')\n"
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
