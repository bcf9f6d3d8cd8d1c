"""Request bodies the sidecar refuses before any route parses them: too large (413) or
compressed (415).

``BodyLimits``, the ASGI middleware in front of every route (``app.create_app``).
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import OpenAIError

# Largest request body accepted (bytes). Far above any prompt a 128k-token context can take, and
# small enough that tokenizing a rejected giant prompt cannot stall other requests for seconds.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class BodyLimits:
    """ASGI middleware: a request body larger than ``max_bytes`` gets a 413 OpenAI error
    (``code`` ``request_too_large``) without being read to its end, and a body sent with a
    ``Content-Encoding`` other than ``identity`` (gzip, ...) a 415 (``code``
    ``unsupported_content_encoding``) naming it: the sidecar decodes no compressed bodies,
    as OpenAI's API takes none, and would otherwise call one "not valid UTF-8".

    Two checks, because a client need not announce the size: a ``Content-Length`` over the limit
    is refused before the app runs; otherwise (``Transfer-Encoding: chunked``) the bytes the app
    receives are counted, and the moment the total passes the limit the 413 is sent and the app
    sees the client as disconnected, so the body is never parsed or tokenized. The server
    discards whatever more of the body arrives (clients such as curl stop sending on the 413).

    A plain ASGI middleware on purpose: Starlette's ``@app.middleware("http")``
    (``BaseHTTPMiddleware``) hides the client's disconnect from ``Request.is_disconnected()``
    inside the routes, so a non-streamed request whose client went away would never be aborted.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, what: str = "") -> Response:
        return OpenAIError(
            f"request body{what} exceeds the limit of {self.max_bytes} bytes",
            status=413,
            code="request_too_large",
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

        received = 0
        rejected = False
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    rejected = True
                    # Routes read the whole body before they answer; should one ever start its
                    # response first, the disconnect below still stops it reading.
                    if not response_started:
                        await self._too_large()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if rejected:
                return  # the 413 (or the dropped connection) is the answer; drop the app's
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            # The app may fail on the body it was cut off from (a disconnect mid-read); the
            # client already has its 413.
            if not rejected:
                raise
