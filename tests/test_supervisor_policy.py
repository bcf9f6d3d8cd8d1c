"""``tritonllm.supervisor.Supervisor``'s failure policy, with stand-in processes (seconds, not
minutes): a ``sleep`` for tritonserver and a small HTTP server for the sidecar's ``/health``,
whose answer the test sets. The real processes are supervised in ``test_supervision.py``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tritonllm.supervisor import Backoff, SupervisePolicy, Supervisor, check_health
from tritonllm.triton_server import free_port, start_process_group, stop_process_group

# A /health server: answers the status code written in the file argv[2] (200 when absent;
# "503 failed" also says backend_failed), or never answers while that file says "hang". SIGINT
# stops it as it stops the real sidecar (uvicorn sets its own handler): a process started from a
# background shell inherits SIGINT ignored, and each teardown then waited 15 s for it.
FAKE_SIDECAR = r"""
import http.server, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
status_file = Path(sys.argv[2])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        text = status_file.read_text().strip() if status_file.exists() else "200"
        if text == "hang":
            time.sleep(30)
        failed = text.endswith("failed")  # e.g. "503 failed": backend_failed
        code = int(text.split()[0]) if text.split() and text.split()[0].isdigit() else 200
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b'{"status": "fake %d", "backend_failed": %s}'
                         % (code, b"true" if failed else b"false"))
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


class FakeTriton:
    """Stands in for ``TritonServer``: a ``sleep`` in its own process group."""

    starts = 0

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.log_path = Path("/dev/null")

    def start(self, timeout: float) -> FakeTriton:
        FakeTriton.starts += 1
        self.process = start_process_group(["sleep", "300"])
        return self

    def stop(self, timeout: float = 20.0) -> None:
        stop_process_group(self.process, timeout)


@pytest.fixture
def supervised(tmp_path):
    """``make(policy) -> (supervisor, status_file)``; everything is stopped afterwards."""
    made: list[Supervisor] = []

    def make(**policy) -> tuple[Supervisor, Path]:
        port, status = free_port(), tmp_path / f"status-{len(made)}"
        command = [sys.executable, "-c", FAKE_SIDECAR, str(port), str(status)]
        defaults = dict(
            backoff_initial_s=0.2,
            health_interval_s=0.1,
            unhealthy_timeout_s=0.5,
            health_answer_timeout_s=5.0,
        )
        supervisor = Supervisor(
            FakeTriton,
            command,
            f"http://127.0.0.1:{port}/health",
            SupervisePolicy(**{**defaults, **policy}),
            startup_timeout_s=30,
        )
        made.append(supervisor)
        supervisor.start()
        return supervisor, status

    yield make
    for supervisor in made:
        supervisor.stop(graceful=False)
        for thread in threads.pop(id(supervisor), []):
            thread.join(30)
        supervisor.stop(graceful=False)  # what a restart in progress may have started


threads: dict[int, list[threading.Thread]] = {}


def _run_in_thread(supervisor: Supervisor) -> dict:
    """Run ``supervisor.run()`` on a thread; the returned dict gets its result or error."""
    result: dict = {}

    def run() -> None:
        try:
            result["status"] = supervisor.run()
        except Exception as exc:  # noqa: BLE001 (the test reads it)
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    threads.setdefault(id(supervisor), []).append(thread)
    thread.start()
    return result


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_backoff_doubles_up_to_its_cap_and_resets_after_good_health():
    backoff = Backoff(initial_s=1.0, max_s=5.0, reset_s=60.0)
    assert [backoff.next_delay() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.healthy(100.0)
    backoff.healthy(130.0)
    assert backoff.next_delay() == 5.0  # healthy for 30 s only
    backoff.healthy(200.0)
    backoff.healthy(260.0)
    assert backoff.next_delay() == 1.0


def test_on_failure_exit_returns_1_when_tritonserver_dies(supervised):
    supervisor, _ = supervised(on_failure="exit")
    os.kill(supervisor.triton.process.pid, signal.SIGKILL)
    started = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - started < 5


def test_a_dead_tritonserver_is_restarted_with_growing_backoff(supervised):
    supervisor, _ = supervised()
    result = _run_in_thread(supervisor)
    for restart in (1, 2):
        old = supervisor.triton
        os.kill(old.process.pid, signal.SIGKILL)
        assert _wait(lambda o=old: supervisor.triton is not o and supervisor.triton.process)
        assert supervisor.backoff["tritonserver"].restarts == restart
        assert _wait(lambda: check_health(supervisor.health_url, 2).ok)
    assert supervisor.triton.process.poll() is None and not result


def test_a_dead_sidecar_is_restarted(supervised):
    supervisor, _ = supervised()
    result = _run_in_thread(supervisor)
    old = supervisor.sidecar
    os.kill(old.pid, signal.SIGKILL)
    assert _wait(
        lambda: supervisor.sidecar is not old and check_health(supervisor.health_url, 2).ok
    )
    assert supervisor.backoff["tritonserver"].restarts == 0 and not result


def test_a_503_health_restarts_tritonserver_and_no_answer_restarts_the_sidecar(supervised):
    supervisor, status = supervised()
    result = _run_in_thread(supervisor)
    first_triton, first_sidecar = supervisor.triton, supervisor.sidecar
    status.write_text("503")  # the sidecar answers: the backend is broken
    assert _wait(lambda: supervisor.triton is not first_triton)
    assert supervisor.sidecar is first_sidecar
    status.write_text("200")
    assert _wait(lambda: supervisor.backoff["tritonserver"].restarts == 1)
    time.sleep(1.0)  # the restart's own wait for health is over
    status.write_text("hang")  # the sidecar itself stopped answering
    assert _wait(lambda: supervisor.sidecar is not first_sidecar, 60)
    status.write_text("200")
    assert _wait(lambda: check_health(supervisor.health_url, 2).ok) and not result


def test_a_backend_failure_restarts_tritonserver_before_the_unhealthy_timeout(supervised):
    """/health saying backend_failed (an error answer: a dead stub) restarts tritonserver after
    failed_timeout_s; a plain 503 (slow, restarting) still waits for unhealthy_timeout_s."""
    supervisor, status = supervised(unhealthy_timeout_s=60.0, failed_timeout_s=0.5)
    result = _run_in_thread(supervisor)
    first = supervisor.triton
    status.write_text("503")
    time.sleep(2.0)
    assert supervisor.triton is first  # not yet: 60 s for a plain 503
    status.write_text("503 failed")
    assert _wait(lambda: supervisor.triton is not first, 10)
    status.write_text("200")
    assert _wait(lambda: check_health(supervisor.health_url, 2).ok) and not result


def test_a_backend_failure_that_comes_and_goes_still_restarts_tritonserver(supervised):
    """/health alternating between backend_failed and 200 (one of two generator stubs stopped:
    the probes land on either) restarts tritonserver once failed_timeout_s has passed since the
    first failure; a single failure followed by good health for that long is forgotten."""
    supervisor, status = supervised(unhealthy_timeout_s=60.0, failed_timeout_s=1.0)
    result = _run_in_thread(supervisor)
    first = supervisor.triton
    status.write_text("503 failed")  # once, then good health: forgotten
    time.sleep(0.3)
    status.write_text("200")
    time.sleep(2.5)
    assert supervisor.triton is first
    stop = threading.Event()

    def alternate() -> None:
        while not stop.is_set():
            for text in ("503 failed", "200"):
                status.write_text(text)
                time.sleep(0.15)

    flapping = threading.Thread(target=alternate, daemon=True)
    flapping.start()
    try:
        assert _wait(lambda: supervisor.triton is not first, 10)
    finally:
        stop.set()
        flapping.join()
    status.write_text("200")
    assert _wait(lambda: check_health(supervisor.health_url, 2).ok) and not result


def test_the_supervisors_lines_say_when(capsys):
    from tritonllm import supervisor

    supervisor.log("tritonserver failed for 11 s: fake")
    line = capsys.readouterr().out
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ tritonserver failed for 11 s: fake\n", line
    )
