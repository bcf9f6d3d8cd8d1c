"""The sidecar's access controls: API keys, per-tenant prefix-cache salts, a header timeout.

- ``ApiKeyAuth``: with API keys set, every route but ``PUBLIC_PATHS`` needs
  ``Authorization: Bearer <key>`` (compared in constant time with every key, ``hmac.compare_digest``);
  a missing or wrong key gets OpenAI's 401 error body. ``/health`` stays open for load balancers
  and orchestrators; ``/``, the chat page, is static (no data, no model call): its own API calls
  carry the key typed into its API-key field; ``/metrics`` (request counts and latencies, no
  content) stays open for Prometheus, as vLLM's does.
- Tenants: each API key is a tenant. With ``cache_salt_from_api_key`` the prefix-cache salt of a
  request (``cache_salt``, vLLM's field) is derived from its key (``tenant_salt``), so tenants
  never share KV-cache pages and ``cached_tokens`` (and time to first token) tell a client
  nothing about another tenant's prompts.
- ``header_timeout_protocol``: uvicorn's h11 protocol that closes a connection whose request
  headers are not complete within a timeout, or which still sends a refused body that long after
  its answer (uvicorn's ``timeout_keep_alive`` starts only after a first response, and any byte
  received stops it, so an idle or half-sent request would hold its connection open forever).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import OpenAIError

# The sidecar's environment: API keys (comma-separated; the launcher passes ``--api-key`` this
# way, never on a command line other local users can read) and the generator's control secret.
API_KEY_ENV = "TRITONLLM_API_KEY"
CONTROL_SECRET_ENV = "TRITONLLM_CONTROL_SECRET"
# Routes open without a key.
PUBLIC_PATHS = frozenset({"/health", "/health/live", "/", "/metrics"})
# Seconds a connection may take to send its request headers (first request, or the next one
# on a kept-alive connection).
DEFAULT_HEADER_TIMEOUT_S = 10.0
_SALT_CONTEXT = b"tritonllm prefix-cache salt v1"


def parse_api_keys(value: str | None) -> tuple[str, ...]:
    """The API keys of a comma-separated list (blank entries dropped; none: no auth)."""
    return tuple(key.strip() for key in (value or "").split(",") if key.strip())


def tenant_salt(api_key: str) -> str:
    """The prefix-cache salt of the tenant of ``api_key``: 64 hex digits, HMAC-SHA256 of the
    key under a fixed context, so the salt does not reveal the key."""
    return hmac.new(_SALT_CONTEXT, api_key.encode(), hashlib.sha256).hexdigest()


def request_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The salt sent to the backend: the tenant's (when salting by API key) combined with the
    request's own ``cache_salt`` (a client may split its own namespace further, never join
    another tenant's); None when neither is set."""
    if tenant and client_salt:
        return hashlib.sha256(f"{tenant}\0{client_salt}".encode()).hexdigest()
    return tenant or client_salt or None


def tenant_of(scope: Scope) -> str | None:
    """The tenant salt ``ApiKeyAuth`` stored for this request (None without API keys)."""
    return scope.get("state", {}).get("tenant")


def unauthorized(missing: bool) -> OpenAIError:
    """OpenAI's 401 for a missing or wrong API key (the key given is never echoed)."""
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        if missing
        else "Incorrect API key provided."
    )
    return OpenAIError(message, status=401, code="invalid_api_key")


class ApiKeyAuth:
    """ASGI middleware: requests to any path but ``public_paths`` need one of ``api_keys`` as
    ``Authorization: Bearer <key>``, else a 401 OpenAI error (``code`` ``invalid_api_key``,
    ``WWW-Authenticate: Bearer``) before the app reads anything. The key is compared with
    every configured key in constant time, so timing tells neither which key nor how much of
    it matched. An accepted request's tenant salt (``tenant_salt``) goes in
    ``scope["state"]["tenant"]`` (``tenant_of``).
    """

    def __init__(
        self, app: ASGIApp, api_keys: tuple[str, ...], public_paths: frozenset[str] = PUBLIC_PATHS
    ) -> None:
        if not api_keys:
            raise ValueError("ApiKeyAuth needs at least one API key")
        self.app, self.public_paths = app, public_paths
        self._keys = [(key.encode(), tenant_salt(key)) for key in api_keys]

    def _tenant(self, scope: Scope) -> str | None:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        given = given.strip() if scheme.lower() == b"bearer" else b""
        tenant = None
        for key, salt in self._keys:  # every key compared: no early exit
            if hmac.compare_digest(given, key):
                tenant = salt
        return tenant

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is None:
            missing = b"authorization" not in dict(scope["headers"])
            response = unauthorized(missing).response()
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def header_timeout_protocol(timeout_s: float) -> Any:
    """uvicorn's ``H11Protocol`` closing a connection that has not sent complete request
    headers ``timeout_s`` seconds after it opened or after its last response ended (an idle
    connection, or a half-sent request: slowloris), or that is still sending, that long after
    its answer, the body of a request answered before it was read (a 413, 415 or 401: uvicorn
    discards the rest of such a body, untimed, however slowly it comes). A request whose
    headers arrived is not timed here until it is answered (its body and the response are the
    app's: ``BodyLimits``, the stream idle timeout). Pass it as ``uvicorn.Config(http=...)``.
    Imported lazily: uvicorn and h11 are needed only to run the server."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: Any = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_overdue)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _answered(self) -> bool:
            """Whether the request being received was answered already (its body, if still
            arriving, is discarded)."""
            return self.conn.our_state is h11.DONE

        def _headers_overdue(self) -> None:
            self._header_timer = None
            waiting = self.conn.their_state is h11.IDLE  # no complete request line + headers
            if (waiting or self._answered()) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE and not self._answered():
                self._disarm()  # a new request's headers are complete

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

    return HeaderTimeoutH11Protocol
