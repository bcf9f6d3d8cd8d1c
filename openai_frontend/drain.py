"""Graceful drain: SIGTERM stops taking new requests and lets the ones in flight finish.

On SIGTERM the sidecar starts draining: ``/health`` answers 503 (a load balancer's readiness
check takes the replica out), every new request gets a 503 OpenAI error (nothing of it reached
Triton, so a balancer may retry it on another replica), both with ``Connection: close`` and
``Retry-After`` (``DRAIN_HEADERS``), and the generations in flight go on. The server exits
once none is left, or after ``timeout_s`` seconds, when the rest are aborted (their streams end
with finish_reason ``"abort"``). SIGINT (Ctrl-C), or a second SIGTERM, stops at once: the generations in flight
are aborted, as before. Either way the abort comes first, while the server still runs, and the
server exits once their streams ended (each with its ``"abort"`` chunk and ``[DONE]``), at most
``ABORTED_STREAMS_GRACE_S`` later; one more signal exits without waiting.

The sidecar keeps no state that ties a client to a replica: a completion's id names a request
only while its own stream lasts, and every request carries all its context, so a balancer may
send consecutive requests of one client to any replica.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import OpenAIError

log = logging.getLogger(__name__)

# Paths that stay open while draining: probes must see the drain, and nothing else is work.
_OPEN_PATHS = ("/health", "/health/live")
# Most seconds an expired drain waits, after aborting the generations left, for their streams
# to send their last chunks before the server exits.
ABORTED_STREAMS_GRACE_S = 5.0
# Seconds a drain's 503 asks its client to wait before retrying (on another replica).
DRAIN_RETRY_AFTER_S = 1
# The headers of every 503 a draining sidecar answers, /health's included: the connection is
# not kept (this server is going away) and the client may retry.
DRAIN_HEADERS = {"Connection": "close", "Retry-After": str(DRAIN_RETRY_AFTER_S)}


@dataclass
class DrainState:
    """Whether the sidecar is draining, and until when.

    Attributes:
        timeout_s: most seconds the generations in flight get to finish after SIGTERM (0: do
            not drain; SIGTERM then aborts them at once).
        started_at: ``time.monotonic()`` when the drain began (None: not draining).
        stopping: SIGINT (or SIGTERM without a drain) asked to stop now: the drain counts as
            expired at once (the generations in flight are aborted, then the server exits).
    """

    timeout_s: float = 30.0
    started_at: float | None = None
    stopping: bool = False

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self) -> None:
        """Start draining (idempotent)."""
        if self.started_at is None:
            self.started_at = time.monotonic()
            log.warning("draining: new requests get 503 for up to %.0f s", self.timeout_s)

    def stop_now(self) -> None:
        """Stop without draining: new requests get 503 and the generations in flight are
        aborted at the next tick (`server_class`)."""
        self.stopping = True
        if self.started_at is None:
            self.started_at = time.monotonic()

    def expired(self) -> bool:
        """Whether the drain's time is up (at once after `stop_now`)."""
        if self.started_at is None:
            return False
        return self.stopping or time.monotonic() - self.started_at >= self.timeout_s


class DrainGate:
    """ASGI middleware: while ``state`` drains, each new HTTP request other than the health
    probes gets a 503 ``service_unavailable`` OpenAI error before the app sees it."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.state.draining or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        response = OpenAIError(
            "the server is shutting down; retry on another replica",
            503,
            "server_error",
            code="service_unavailable",
        ).response()
        response.headers.update(DRAIN_HEADERS)
        await response(scope, receive, send)


def server_class() -> Any:
    """uvicorn's ``Server`` with this module's SIGTERM drain; on shutdown it also aborts the
    generations still in flight first (uvicorn waits for open responses to finish, and a long
    stream would otherwise hold the shutdown until the launcher's SIGKILL and leave its work
    in Triton). Imported lazily: uvicorn is needed only to run the server."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, app: Any) -> None:
            super().__init__(config)
            self.app = app  # the FastAPI app of ``create_app`` (config.app is typed loosely)
            self._aborted_at: float | None = None  # when an expired drain aborted the rest

        def _states(self) -> tuple[Any, DrainState]:
            # ``state.server`` is None until the lifespan started.
            return self.app.state.server, self.app.state.drain

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            server, drain = self._states()
            draining = drain.draining or self.should_exit
            if sig == signal.SIGTERM and drain.timeout_s > 0 and not draining:
                drain.begin()  # on_tick ends the server once drained
                return
            if not self.should_exit and not drain.stopping and server is not None and server.live:
                # Stop now, but abort the generations first, while the server still runs
                # (on_tick, `_abort_expired`): uvicorn's exit flag would let sse-starlette
                # close their streams before the abort's last chunks. A second signal exits.
                drain.stop_now()
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            server, drain = self._states()
            if drain.draining and not self.should_exit:
                if not (server is not None and server.live):
                    self.should_exit = True
                elif drain.expired():
                    await self._abort_expired(server)
            return await super().on_tick(counter)

        async def _abort_expired(self, server: Any) -> None:
            """The drain's time is up with generations in flight: abort them while the server
            still runs, and exit once their streams have ended (each with finish_reason
            "abort" and ``[DONE]``), or ``ABORTED_STREAMS_GRACE_S`` after the abort. Setting
            ``should_exit`` first would let sse-starlette, which watches uvicorn's exit flag,
            close a stream before its abort reached it: a stream without a finish_reason."""
            now = time.monotonic()
            if self._aborted_at is None:
                self._aborted_at = now
                log.warning("drain timed out: aborting %d generation(s)", len(server.live))
                await server.abort_all(timeout=5.0)
            elif now - self._aborted_at >= ABORTED_STREAMS_GRACE_S:
                self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            server, _ = self._states()
            if server is not None and server.live:
                log.warning("aborting %d generation(s) in flight", len(server.live))
                await server.abort_all(timeout=5.0)
            await super().shutdown(sockets)

    return Server
