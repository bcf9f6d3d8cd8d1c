"""A generator stub that dies mid-stream: Triton never answers its requests in flight, so the
sidecar's idle timeout ends them with an error instead of leaving the client waiting forever.

Runs its own tritonserver (the test kills a stub of it) and a sidecar with a 3 s idle timeout.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest
from conftest import SERVER_ENV

from tritonllm.launch import sidecar_command
from tritonllm.triton_server import (
    TritonServer,
    free_port,
    start_process_group,
    stop_process_group,
    wait_http_ok,
)

IDLE_TIMEOUT_S = 3.0


def _stub_pid(pgid: int, model: str) -> int:
    """The pid of the Python backend stub of `model` in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[2]) != pgid or fields[0] == "Z" or len(argv) < 2:
            continue
        if b"triton_python_backend_stub" in argv[0] and f"/{model}/".encode() in argv[1]:
            return int(stat.parent.name)
    raise LookupError(f"no stub of {model} in process group {pgid}")


def _assert_private_regions(pid: int, prefix: str) -> None:
    """Process ``pid`` (tritonserver) has shared-memory regions under ``prefix``, in its own
    view of /dev/shm, that no other user can read: where it runs in a mount namespace of its own
    (``processes.private_shm_command``), its /dev/shm is a tmpfs nobody else sees; else the
    regions themselves are 0600 (``processes.restrict_shm_regions``)."""
    regions = list(Path(f"/proc/{pid}/root/dev/shm").glob(f"{prefix}*"))
    assert regions, f"no shared-memory region {prefix}* in tritonserver's /dev/shm"
    if os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
        assert not list(Path("/dev/shm").glob(f"{prefix}*")), "private regions seen outside"
    else:
        assert all(r.stat().st_mode & 0o077 == 0 for r in regions), regions


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_stream_whose_generator_died_ends_with_an_error(tiny_model_dir, tmp_path):
    """A stream whose generator stub is SIGKILLed ends with an error within the idle timeout
    (+10 s), never hangs. Usually Triton sends nothing more, and the sidecar's health watch
    (a probe through llm fails) or else its idle timeout ends the stream; sometimes (1 of 3
    full-suite runs in a QA pass) Triton closes the gRPC stream instead, which the sidecar
    reports as the backend being unavailable: any of these ends the stream."""
    server = TritonServer(
        model_path=tiny_model_dir, env=dict(SERVER_ENV), log_path=tmp_path / "tritonserver.log"
    )
    sidecar = None
    try:
        server.start(timeout=float(os.environ.get("TRITONLLM_TEST_SERVER_TIMEOUT", "300")))
        port = free_port()
        command = sidecar_command(server.grpc_url, port, model_name="tiny")
        command.append(f"--stream-idle-timeout={IDLE_TIMEOUT_S}")
        sidecar = start_process_group(command, tmp_path / "sidecar.log")
        wait_http_ok(f"http://127.0.0.1:{port}/health", 120, sidecar, "sidecar")
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=1900,
            stream=True,
        )
        chunks = iter(stream)
        next(chunks)  # streaming
        # The stubs' shared memory lives under this server's own prefix, out of others' reach
        # (a /dev/shm of the server's own, or regions of mode 0600) ...
        _assert_private_regions(server.process.pid, server.shm_prefix)
        os.kill(_stub_pid(server.process.pid, "generator"), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as ended:
            for _ in chunks:
                pass
        assert ended.value.code in ("service_unavailable", "timeout"), ended.value
        assert time.monotonic() - killed < IDLE_TIMEOUT_S + 10
    finally:
        stop_process_group(sidecar, 10.0)
        server.stop()
    # ... and a killed stub's regions do not outlive the server.
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))
