"""The ``sidecar`` fixture: the real OpenAI sidecar process in front of ``triton_server``.

Import it in ``tests/conftest.py`` with ``from frontend_fixtures import sidecar  # noqa: F401``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sidecar:
    """A running ``python -m openai_frontend`` process.

    Attributes:
        base_url: the OpenAI base URL (``http://127.0.0.1:PORT/v1``).
        model_name: the served model name (the tiny model directory's basename).
        metrics_url: the tritonserver metrics endpoint behind it (``tritonllm_*`` gauges).
        log_path: the sidecar's stdout/stderr.
    """

    process: subprocess.Popen
    base_url: str
    model_name: str
    metrics_url: str
    log_path: Path

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:]


def start_sidecar(
    grpc_url: str,
    model_name: str,
    log_path: Path,
    timeout_s: float = 60.0,
    control_secret: str | None = None,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
):
    """Start the sidecar on a free port and wait until ``/health`` answers 200.

    ``control_secret``: the server's (``TritonServer.control_secret``), for the sidecar's
    aborts; ``extra_args``: more sidecar flags; ``env``: more environment variables.

    Raises:
        RuntimeError: it exited or was not healthy within ``timeout_s`` seconds.
    """
    from tritonllm.triton_server import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "openai_frontend",
        f"--triton-url={grpc_url}",
        f"--model-name={model_name}",
        f"--port={port}",
        "--log-level=info",
        *extra_args,
    ]
    environment = {**os.environ, **(env or {})}
    if control_secret is not None:
        environment["TRITONLLM_CONTROL_SECRET"] = control_secret
    log = open(log_path, "wb")  # noqa: SIM115 (kept open for the process' lifetime)
    process = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=environment,
    )
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sidecar exited:\n{log_path.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return process, f"http://127.0.0.1:{port}/v1"
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    stop_process(process)
    raise RuntimeError(f"sidecar not healthy after {timeout_s} s:\n{log_path.read_text()}")


def start_sidecar_without_triton(
    log_path: Path, extra_args: tuple[str, ...] = (), timeout_s: float = 60.0
) -> tuple[subprocess.Popen, int]:
    """Start the sidecar on a free port with no tritonserver behind it (its gRPC URL a free
    port): for what the sidecar answers alone (body and header limits, CORS, the drain).
    Returns ``(process, port)`` once the port takes connections; stop it with
    ``stop_process``.

    Raises:
        RuntimeError: it exited or did not listen within ``timeout_s`` seconds.
    """
    from tritonllm.triton_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "openai_frontend", f"--port={port}", "--model-name=tiny"]
    cmd += [f"--triton-url=127.0.0.1:{free_port()}", *extra_args]
    log = open(log_path, "wb")  # noqa: SIM115 (kept open for the process' lifetime)
    process = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sidecar exited:\n{log_path.read_text(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            time.sleep(0.2)
    stop_process(process)
    raise RuntimeError(f"sidecar not listening after {timeout_s} s:\n{log_path.read_text()}")


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL after ``timeout_s`` seconds."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="session")
def sidecar(triton_server, tiny_model_dir, tmp_path_factory):
    """The OpenAI sidecar (a real process) serving the tiny model through ``triton_server``."""
    log_path = tmp_path_factory.mktemp("logs") / "sidecar.log"
    process, base_url = start_sidecar(
        triton_server.grpc_url,
        Path(tiny_model_dir).name,
        log_path,
        control_secret=triton_server.control_secret,
    )
    running = Sidecar(
        process, base_url, Path(tiny_model_dir).name, triton_server.metrics_url, log_path
    )
    yield running
    stop_process(process)
    if os.environ.get("TRITONLLM_SHOW_SERVER_LOG"):
        print(running.log_tail())
