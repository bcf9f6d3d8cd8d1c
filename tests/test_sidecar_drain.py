"""A SIGTERM drain that runs out of time (``openai_frontend/drain.py``): the generations still
in flight are aborted while the server still runs, so each stream ends with finish_reason
"abort" (and ``[DONE]``), never cut off without one. QA found streams cut off so: the server
set uvicorn's exit flag before aborting, and sse-starlette, which watches that flag, closed
some streams before their abort reached them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import types
from pathlib import Path

import openai
import uvicorn
from frontend_fixtures import start_sidecar, stop_process
from openai_helpers import engine_idle, wait_for_gauges
from test_supervision import _start_streams

from openai_frontend import drain as drain_module
from openai_frontend.drain import DrainState, server_class


def test_streams_left_when_the_drain_expires_end_with_abort(
    triton_server, tiny_model_dir, tmp_path
):
    process, base_url = start_sidecar(
        triton_server.grpc_url,
        Path(tiny_model_dir).name,
        tmp_path / "sc.log",
        control_secret=triton_server.control_secret,
        extra_args=("--workers=2", "--drain-timeout=1"),
    )
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        streams = 6
        results = _start_streams(client, streams, max_tokens=600)  # not done within the drain
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(60) == 0
        ends = [results.get(timeout=10) for _ in range(streams)]
        assert all(end[0] == "ok" and end[1] in ("abort", "length", "stop") for end in ends), ends
        assert any(end[1] == "abort" for end in ends), ends
    finally:
        stop_process(process)
        wait_for_gauges(triton_server.metrics_url, engine_idle, 120)


class FakeSidecar:
    """`server_class`'s uvicorn server over a bare ASGI app whose state holds a stand-in for
    the sidecar's ``ServerState`` (its generations in flight, ``live``, and their abort) and a
    `DrainState`; ``calls`` records each abort with what uvicorn's exit flag was then."""

    def __init__(self, live: set[str], drain: DrainState) -> None:
        self.live = live
        self.calls: list[str] = []

        async def app(scope, receive, send):  # noqa: ANN001, ANN202 (a bare ASGI app)
            raise AssertionError("not served")

        app.state = types.SimpleNamespace(server=self, drain=drain)  # type: ignore[attr-defined]
        config = uvicorn.Config(app, log_level="warning")
        config.load()
        self.drain = drain
        self.server = server_class()(config, app)

    async def abort_all(self, timeout: float = 5.0) -> None:
        self.calls.append(f"abort {len(self.live)}, exit flag {self.server.should_exit}")


def test_an_expired_drain_aborts_before_it_lets_the_server_exit(monkeypatch):
    """The order that keeps a stream's last chunks: the expired drain aborts the generations
    left while the server runs (uvicorn's exit flag still unset, which sse-starlette would see
    and close the streams at), and lets it exit once they are gone, or after the grace."""
    fake = FakeSidecar({"gen-1", "gen-2"}, DrainState(timeout_s=0.0))
    server, calls = fake.server, fake.calls
    fake.drain.begin()  # expired at once (timeout 0)

    async def ticks() -> None:
        await server.on_tick(1)
        assert calls == ["abort 2, exit flag False"] and not server.should_exit
        await server.on_tick(2)  # streams still ending: no second abort, no exit yet
        assert calls == ["abort 2, exit flag False"] and not server.should_exit
        fake.live.clear()
        await server.on_tick(3)
        assert server.should_exit

    asyncio.run(ticks())
    # Streams that never end: the exit comes after the grace.
    stuck_fake = FakeSidecar({"gen-3"}, fake.drain)
    monkeypatch.setattr(drain_module, "ABORTED_STREAMS_GRACE_S", 0.0)

    async def stuck() -> None:
        await stuck_fake.server.on_tick(1)
        await stuck_fake.server.on_tick(2)
        assert stuck_fake.calls == ["abort 1, exit flag False"] and stuck_fake.server.should_exit

    asyncio.run(stuck())


def test_sigint_with_streams_in_flight_aborts_them_before_the_server_exits():
    """Ctrl-C stops at once, yet in the same order as an expired drain: abort first, exit once
    the streams ended; a second signal exits without waiting."""
    fake = FakeSidecar({"gen-1"}, DrainState(timeout_s=30.0))
    server = fake.server
    server.handle_exit(signal.SIGINT, None)
    assert not server.should_exit and fake.drain.draining  # new requests get 503

    async def ticks() -> None:
        await server.on_tick(1)
        assert fake.calls == ["abort 1, exit flag False"] and not server.should_exit
        fake.live.clear()
        await server.on_tick(2)
        assert server.should_exit

    asyncio.run(ticks())
    # A second signal while the abort waits: exit at once.
    again = FakeSidecar({"gen-2"}, DrainState(timeout_s=30.0))
    again.server.handle_exit(signal.SIGINT, None)
    again.server.handle_exit(signal.SIGINT, None)
    assert again.server.should_exit


def test_sigint_stops_the_sidecar_by_that_signal_without_a_traceback(tmp_path):
    """QA: Ctrl-C printed uvicorn's re-raised KeyboardInterrupt as a traceback. The sidecar
    (its Triton endpoint unreachable: it serves anyway) still exits by SIGINT, silently."""
    import socket
    import subprocess
    import sys

    from tritonllm.triton_server import free_port

    port = free_port()
    log = tmp_path / "sidecar.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "openai_frontend", "--port", str(port)]
            + ["--triton-url", f"127.0.0.1:{free_port()}", "--model-name", "tiny"],
            stdout=out,
            stderr=subprocess.STDOUT,
            # SIGINT's default action, whatever this test inherited: a runner started in the
            # background without job control ignores SIGINT, and so would the sidecar's Python.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # serving: its port takes connections
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == -signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


def test_every_drain_503_carries_retry_after_health_included():
    """README: the drain's 503s carry ``Retry-After``. QA: ``/health``'s did not (only new
    requests' did). Both answer with the drain's headers; ``/health/live`` stays 200. (In
    process, no lifespan: neither answer reaches Triton.)"""
    from fastapi.testclient import TestClient

    from openai_frontend import create_app

    app = create_app("127.0.0.1:9", "tiny")
    app.state.drain.begin()
    client = TestClient(app)
    health = client.get("/health")
    refused = client.post("/v1/chat/completions", json={})
    assert health.status_code == refused.status_code == 503
    assert health.json() == {"status": "draining"}
    assert refused.json()["error"]["code"] == "service_unavailable"
    for response in (health, refused):
        assert response.headers["retry-after"] == str(drain_module.DRAIN_RETRY_AFTER_S)
        assert response.headers["connection"] == "close"
    assert client.get("/health/live").status_code == 200
