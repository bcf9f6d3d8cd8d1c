"""The sidecar's OpenAPI document (``/openapi.json``) with the statuses it really returns.

FastAPI lists a 422 for every route with a body (its validation errors), which this service
never returns (``errors.install_error_handlers`` answers them as OpenAI 400s), and none of the
real error statuses. ``install_openapi`` replaces that: every operation documents the OpenAI
error body (``ErrorResponse``) for the statuses it can return, and the generation routes their
``text/event-stream`` response (``stream: true``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

# The generation routes: a JSON body, or server-sent events with "stream": true.
SSE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_HEALTH_SCHEMA = {
    "type": "object",
    "properties": {"status": {"type": "string"}, "backend_failed": {"type": "boolean"}},
}
_DESCRIPTIONS = {
    400: "invalid request (OpenAI error body)",
    401: "missing or wrong API key (when the server has API keys)",
    404: "unknown model",
    408: "the request body did not arrive within the body timeout",
    413: "request body over the size limit",
    415: "a compressed request body (Content-Encoding other than identity)",
    429: "the server's queue is full; retry after Retry-After seconds",
    500: "internal error",
    503: "the backend is unavailable, or the server is draining",
    504: "the backend sent nothing for the stream idle timeout",
}


def _error_statuses(path: str, has_body: bool) -> tuple[int, ...]:
    statuses = [401, 413, 500, 503]
    if has_body:
        statuses += [400, 404, 408, 415, 429]
    if path.startswith("/v1/models/"):
        statuses.append(404)
    if path in SSE_PATHS:
        statuses.append(504)
    return tuple(sorted(set(statuses)))


def _fix_operation(path: str, operation: dict[str, Any]) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    if path.startswith("/health"):  # its own body, {"status": ...}, also with 503
        for code, what in (("200", "healthy"), ("503", "unhealthy or draining")):
            content = {"application/json": {"schema": _HEALTH_SCHEMA}}
            responses[code] = {"description": what, "content": content}
        return
    for status in _error_statuses(path, "requestBody" in operation):
        responses[str(status)] = {
            "description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": _REF}},
        }
    if path in SSE_PATHS:
        ok = responses.setdefault("200", {"description": "Successful Response"})
        events = {"schema": {"type": "string"}}
        ok.setdefault("content", {})["text/event-stream"] = events


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """``app``'s OpenAPI document with this module's responses (module doc)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            _fix_operation(path, operation)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["ErrorResponse"] = ERROR_SCHEMA
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve ``openapi_document(app)`` (built once, on the first request) at /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
