"""A SIGTERM drain that runs out of time (``openai_frontend/drain.py``): the generations still
in flight are aborted while the server still runs, so each stream ends with finish_reason
"abort" (and ``[DONE]``), never cut off without one. QA found streams cut off so: the server
set uvicorn's exit flag before aborting, and sse-starlette, which watches that flag, closed
some streams before their abort reached them.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
from frontend_fixtures import start_sidecar, stop_process
from openai_helpers import engine_idle, wait_for_gauges
from test_supervision import _start_streams


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


def test_an_expired_drain_aborts_before_it_lets_the_server_exit(monkeypatch):
    """The order that keeps a stream's last chunks: the expired drain aborts the generations
    left while the server runs (uvicorn's exit flag still unset, which sse-starlette would see
    and close the streams at), and lets it exit once they are gone, or after the grace."""
    import asyncio
    import types

    import uvicorn

    from openai_frontend import drain as drain_module
    from openai_frontend.drain import DrainState, server_class

    calls: list[str] = []

    class Live:
        """The sidecar's ``ServerState``: its generations in flight, and their abort."""

        def __init__(self) -> None:
            self.live = {"gen-1", "gen-2"}

        async def abort_all(self, timeout: float = 5.0) -> None:
            calls.append(f"abort {len(self.live)}, exit flag {server.should_exit}")

    async def app(scope, receive, send):  # noqa: ANN001, ANN202 (a bare ASGI app)
        raise AssertionError("not served")

    state = Live()
    app.state = types.SimpleNamespace(server=state, drain=DrainState(timeout_s=0.0))  # type: ignore[attr-defined]
    config = uvicorn.Config(app, log_level="warning")
    config.load()
    server = server_class()(config, app)
    app.state.drain.begin()  # expired at once (timeout 0)

    async def ticks() -> None:
        await server.on_tick(1)
        assert calls == ["abort 2, exit flag False"] and not server.should_exit
        await server.on_tick(2)  # streams still ending: no second abort, no exit yet
        assert calls == ["abort 2, exit flag False"] and not server.should_exit
        state.live.clear()
        await server.on_tick(3)
        assert server.should_exit

    asyncio.run(ticks())
    # Streams that never end: the exit comes after the grace.
    calls.clear()
    server = server_class()(config, app)
    state.live = {"gen-3"}
    monkeypatch.setattr(drain_module, "ABORTED_STREAMS_GRACE_S", 0.0)

    async def stuck() -> None:
        await server.on_tick(1)
        await server.on_tick(2)
        assert calls == ["abort 1, exit flag False"] and server.should_exit

    asyncio.run(stuck())


def test_sigint_with_streams_in_flight_aborts_them_before_the_server_exits():
    """Ctrl-C stops at once, yet in the same order as an expired drain: abort first, exit once
    the streams ended; a second signal exits without waiting."""
    import asyncio
    import signal
    import types

    import uvicorn

    from openai_frontend.drain import DrainState, server_class

    aborted: list[bool] = []

    class Live:
        def __init__(self) -> None:
            self.live = {"gen-1"}

        async def abort_all(self, timeout: float = 5.0) -> None:
            aborted.append(server.should_exit)

    async def app(scope, receive, send):  # noqa: ANN001, ANN202 (a bare ASGI app)
        raise AssertionError("not served")

    state = Live()
    app.state = types.SimpleNamespace(server=state, drain=DrainState(timeout_s=30.0))  # type: ignore[attr-defined]
    config = uvicorn.Config(app, log_level="warning")
    config.load()
    server = server_class()(config, app)
    server.handle_exit(signal.SIGINT, None)
    assert not server.should_exit and app.state.drain.draining  # new requests get 503

    async def ticks() -> None:
        await server.on_tick(1)
        assert aborted == [False] and not server.should_exit
        state.live.clear()
        await server.on_tick(2)
        assert server.should_exit

    asyncio.run(ticks())
    # A second signal while the abort waits: exit at once.
    server = server_class()(config, app)
    state.live = {"gen-2"}
    app.state.drain = DrainState(timeout_s=30.0)
    server.handle_exit(signal.SIGINT, None)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit
