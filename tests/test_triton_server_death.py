"""tritonserver itself dies (SIGKILL: the OOM killer, an operator): its Python backend stubs exit
by themselves, the generator's included, so no orphan keeps the engine's memory.

A stub exits when its health thread sees the parent gone, unless another of its threads is
blocked in a call to the dead parent. The generator's sender thread used to be, in its 50 ms
metrics update (Triton 2.51's Python backend never answers such a call), and the stub then
lived on for good, re-parented to init (a QA pass, 2026-11-30). Each case runs its own
tritonserver.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SERVER_ENV
from test_engine_process import _alive, _wait_gone

from tritonllm.triton_server import TritonServer

REPO_ROOT = Path(__file__).resolve().parent.parent


def _group_members(pgid: int) -> dict[int, str]:
    """Live processes of process group `pgid`: pid -> command line (up to 400 chars: a stub's
    command line names its model directory after a checkout path of any length)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found[int(stat.parent.name)] = argv.decode(errors="replace")[:400]
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("engine_process", ["0", "1"], ids=["engine-thread", "engine-process"])
def test_stubs_and_engine_exit_when_tritonserver_is_killed(
    tiny_model_dir, tmp_path, engine_process
):
    env = {**SERVER_ENV, "TRITONLLM_ENGINE_PROCESS": engine_process}
    server = TritonServer(model_path=tiny_model_dir, env=env, log_path=tmp_path / "triton.log")
    try:
        server.start(timeout=float(os.environ.get("TRITONLLM_TEST_SERVER_TIMEOUT", "300")))
        pid = server.process.pid
        time.sleep(0.5)  # the generator's sender thread has been updating metrics meanwhile
        members = _group_members(pid)
        others = {p: cmd for p, cmd in members.items() if p != pid}
        stubs = [cmd for cmd in others.values() if "triton_python_backend_stub" in cmd]
        for model in ("tokenizer", "generator", "detokenizer", "ensemble"):
            assert any(f"/{model}/" in cmd for cmd in stubs), (model, members)
        os.kill(pid, signal.SIGKILL)
        # Reaped, as its parent (init, a supervisor) would: a stub takes a zombie parent for a
        # live one.
        server.process.wait(timeout=10)
        left = {p: cmd for p, cmd in others.items() if not _wait_gone(p, timeout=15.0)}
        assert not left, f"outlived tritonserver by 15 s: {left}"
    finally:
        server.stop()


def test_orphan_watch_ends_a_process_whose_parent_died_even_with_a_thread_stuck():
    """`exit_when_orphaned`: a child whose parent is SIGKILLed exits within its grace time
    although its main thread never returns (a stand-in for a pb_utils call to the dead
    tritonserver), and not while the parent lives."""
    child_code = (
        "import os, threading\n"
        "from tritonllm.serving.orphan_watch import exit_when_orphaned\n"
        "exit_when_orphaned(os.getppid(), interval_s=0.1, grace_s=0.5, exit_code=7)\n"
        "print(os.getpid(), flush=True)\n"
        "threading.Event().wait()  # stuck for good\n"
    )
    parent_code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child_code!r}])\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    child_pid = -1
    try:
        child_pid = int(parent.stdout.readline())
        time.sleep(1.0)
        assert _alive(child_pid)  # the parent lives: the watch leaves the child alone
        parent.kill()
        parent.wait(10)
        assert _wait_gone(child_pid, timeout=10.0), "the orphan outlived its parent by 10 s"
    finally:
        parent.kill()
        if child_pid > 0 and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
