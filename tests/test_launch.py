"""``python -m tritonllm.launch`` (``make serve``): both servers come up, answer, and Ctrl-C stops
them with no process left behind."""

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

import openai

from tritonllm.launch import resolve_model, served_name
from tritonllm.triton_server import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def _process_group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hub_ids_pass_through_and_dirs_resolve(tmp_path):
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert served_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    model = tmp_path / "my-model"
    model.mkdir()
    assert resolve_model(str(model)) == str(model.resolve())
    assert served_name(resolve_model(str(model))) == "my-model"


def test_launch_serves_then_sigint_stops_everything(tiny_model_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "tritonllm.launch", f"--model={tiny_model_dir}", f"--port={port}"]
    cmd += [f"--{kind}-port={free_port()}" for kind in ("grpc", "http", "metrics")]
    process = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True).start()
    output: list[str] = []
    try:
        deadline = time.monotonic() + 300
        # The banner ends with the Ctrl-C hint, after the URL and the curl example.
        while time.monotonic() < deadline and process.poll() is None:
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            if "Ctrl-C" in output[-1]:
                break
        found = re.search(r"OpenAI base URL: (\S+)", "".join(output))
        base_url = found.group(1) if found else None
        assert base_url == f"http://127.0.0.1:{port}/v1", "".join(output)
        log = "".join(output)
        triton_pid = int(re.search(r"tritonserver pid (\d+)", log).group(1))
        sidecar_pid = int(re.search(r"sidecar pid (\d+)", log).group(1))
        assert "curl " in log

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        response = client.chat.completions.create(
            model=Path(tiny_model_dir).name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
        )
        assert response.usage.completion_tokens == 4

        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        assert not _alive(triton_pid) and not _alive(sidecar_pid)
        # tritonserver's Python backend stubs live in its process group: none may survive.
        assert _process_group_members(triton_pid) == []
        assert _process_group_members(sidecar_pid) == []
    finally:
        # On a failure above, still let the launcher stop its children (SIGKILL would orphan them).
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
