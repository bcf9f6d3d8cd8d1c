"""Request bodies the sidecar refuses before any route parses them: too large (413),
compressed (415) or too slow to arrive (408).

``BodyLimits``, the ASGI middleware in front of every route (``app.create_app``).
"""

from __future__ import annotations

import asyncio

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import OpenAIError

# Largest request body accepted (bytes). Far above any prompt a 128k-token context can take, and
# small enough that tokenizing a rejected giant prompt cannot stall other requests for seconds.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# Seconds a request's whole body may take to arrive after its headers: the largest body (4 MiB)
# at about 1.2 Mbit/s, and a bound on how long a stalled body holds a connection and a task.
DEFAULT_BODY_TIMEOUT_S = 30.0
# The shortest wait for a body read, even past the deadline (``BodyLimits``).
_LAST_LOOK_S = 0.01


class BodyLimits:
    """ASGI middleware: a request body larger than ``max_bytes`` gets a 413 OpenAI error
    (``code`` ``request_too_large``) without being read to its end; a body sent with a
    ``Content-Encoding`` other than ``identity`` (gzip, ...) a 415 (``code``
    ``unsupported_content_encoding``) naming it: the sidecar decodes no compressed bodies,
    as OpenAI's API takes none, and would otherwise call one "not valid UTF-8"; and a body not
    received whole within ``timeout_s`` seconds of its request's headers a 408 (``code``
    ``request_timeout``) with ``Connection: close``.

    Two size checks, because a client need not announce the size: a ``Content-Length`` over the
    limit is refused before the app runs; otherwise (``Transfer-Encoding: chunked``) the bytes
    the app receives are counted, and the moment the total passes the limit the 413 is sent and
    the app sees the client as disconnected, so the body is never parsed or tokenized. The
    server discards whatever more of the body arrives (clients such as curl stop sending on the
    413). The time limit is on the whole body, not on each read, so that a client trickling a
    byte at a time cannot hold a connection and a task open either (slowloris on the body; the
    headers have their own limit, ``security.header_timeout_protocol``): the app then sees the
    client as disconnected, as after a 413, and the connection is closed.

    A plain ASGI middleware on purpose: Starlette's ``@app.middleware("http")``
    (``BaseHTTPMiddleware``) hides the client's disconnect from ``Request.is_disconnected()``
    inside the routes, so a non-streamed request whose client went away would never be aborted.

    Args:
        max_bytes: the largest body accepted, in bytes.
        timeout_s: seconds the whole body may take to arrive, counted from when the request's
            headers reached the app; None: no limit.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    ) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    def _too_large(self, what: str = "") -> Response:
        return OpenAIError(
            f"request body{what} exceeds the limit of {self.max_bytes} bytes",
            status=413,
            code="request_too_large",
        ).response()

    def _too_slow(self) -> Response:
        return OpenAIError(
            f"the request body did not arrive within {self.timeout_s:g} s",
            status=408,
            code="request_timeout",
            headers={"Connection": "close"},
        ).response()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):
            await OpenAIError(
                f"Content-Encoding {encoding.decode('latin-1')!r} is not supported: send the "
                "request body uncompressed",
                status=415,
                code="unsupported_content_encoding",
            ).response()(scope, receive, send)
            return
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(f" of {int(length)} bytes")(scope, receive, send)
            return

        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        received = 0
        body_complete = False
        rejected = False
        response_started = False

        async def reject(response: Response) -> Message:
            """Answer ``response`` instead of the app, whose reads then see a disconnect."""
            nonlocal rejected
            rejected = True
            # Routes read the whole body before they answer; should one ever start its response
            # first, the disconnect still stops it reading.
            if not response_started:
                await response(scope, receive, send)
            return {"type": "http.disconnect"}

        async def counting_receive() -> Message:
            nonlocal received, body_complete
            if rejected:
                return {"type": "http.disconnect"}
            if body_complete or deadline is None:
                message = await receive()  # later reads only wait for the disconnect
            else:
                # At least a moment even past the deadline: a body that has arrived meanwhile
                # (an app slow to read it) is taken, not refused.
                wait_s = max(deadline - loop.time(), _LAST_LOOK_S)
                try:
                    message = await asyncio.wait_for(receive(), wait_s)
                except asyncio.TimeoutError:
                    return await reject(self._too_slow())
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_complete = not message.get("more_body", False)
                if received > self.max_bytes:
                    return await reject(self._too_large())
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if rejected:
                return  # the 413 or 408 (or the dropped connection) is the answer; drop the app's
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            # The app may fail on the body it was cut off from (a disconnect mid-read); the
            # client already has its 413 or 408.
            if not rejected:
                raise
