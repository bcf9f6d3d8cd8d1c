"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with HTTP statuses.

Every failure the sidecar reports (bad JSON, invalid values, unknown model, Triton rejecting a
prompt, Triton unreachable) goes through ``OpenAIError`` or the handlers installed by
``install_error_handlers``, so clients always get the OpenAI error body.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonllm.contract.errors import ErrorCode, WireError

from .triton_client import RepeatedWarning

log = logging.getLogger(__name__)

# The backend's error codes (tritonllm.contract.errors) -> HTTP status, OpenAI type and code.
OPENAI_STATUS: dict[ErrorCode, tuple[int, str, str | None]] = {
    ErrorCode.INVALID_VALUE: (400, "invalid_request_error", "invalid_value"),
    ErrorCode.INVALID_INPUT: (400, "invalid_request_error", "invalid_value"),
    ErrorCode.MISSING_INPUT: (400, "invalid_request_error", "missing_required_parameter"),
    ErrorCode.UNSUPPORTED_PARAMETER: (400, "invalid_request_error", "unsupported_parameter"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error", "context_length_exceeded"),
    # Only the service's own parts send control requests: a refusal is the sidecar's fault.
    ErrorCode.PERMISSION_DENIED: (500, "server_error", None),
    ErrorCode.INTERNAL_ERROR: (500, "server_error", None),
    ErrorCode.ENGINE_UNAVAILABLE: (503, "server_error", "service_unavailable"),
    ErrorCode.SERVER_OVERLOADED: (429, "rate_limit_error", "rate_limit_exceeded"),
}
# Seconds a 429 (the generator's queue is full) asks the client to wait (``Retry-After``).
RETRY_AFTER_S = 1
# The messages of server faults: their details (exception text, addresses) go to the log only.
INTERNAL_MESSAGE = "internal server error"
UNAVAILABLE_MESSAGE = "the model backend is unavailable; retry later"
# Backend parameter names that are another field in the OpenAI request (the prompt's own name,
# "messages" or "prompt", is filled in per endpoint).
_PROMPT_PARAMS = {"prompt", "text_input", "input_ids"}


class OpenAIError(Exception):
    """An error to return to the client as an OpenAI error body.

    Args:
        message: human-readable reason.
        status: HTTP status (400 invalid request, 404 not found, 500 server, 503 unavailable).
        type: OpenAI error type (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if any.
        code: machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
        headers: extra response headers (``Retry-After`` of a 429).
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """``body()`` with ``status`` as the HTTP status (ASCII-escaped JSON, so a message that
        quotes client text with lone surrogates still renders)."""
        return _AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def unsupported(param: str, what: str | None = None, reason: str | None = None) -> OpenAIError:
    """A 400 ``unsupported_parameter`` for a request field this server does not implement
    (``what``: the message's subject, default the field; ``reason``: why, or what to use
    instead)."""
    message = f"{what or param} is not supported by this server"
    return OpenAIError(
        f"{message}: {reason}" if reason else message,
        param=param,
        code="unsupported_parameter",
    )


def unsupported_value(param: str, value: object, reason: str) -> OpenAIError:
    """A 400 ``unsupported_value``: the field ``param`` is served, but not at ``value`` (quoted
    as JSON, cut to 80 characters); ``reason`` says which values are."""
    shown = json.dumps(value, ensure_ascii=False)
    shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
    return OpenAIError(
        f"{param} {shown} is not supported by this server: {reason}",
        param=param,
        code="unsupported_value",
    )


# A server fault's log line, per code: a dead engine fails every request (QA: 253 lines in 10 s).
_BACKEND_ERROR_LOGS: dict[ErrorCode, RepeatedWarning] = {}


def from_backend(error: WireError, prompt_param: str) -> OpenAIError:
    """The OpenAI error of a backend error, by its code alone (never its message's wording).
    A server fault's message (exception text) is logged, not returned.

    Args:
        error: the decoded wire error.
        prompt_param: the request field that holds the prompt (``messages`` or ``prompt``).
    """
    status, kind, code = OPENAI_STATUS[error.code]
    param = None
    if error.code.is_request_fault and error.param is not None:
        param = error.param
        if param in _PROMPT_PARAMS:
            param = prompt_param
        elif param == "logprobs" and prompt_param == "messages":
            param = "top_logprobs"  # chat's name for the count
        elif param == "enable_thinking":
            param = "chat_template_kwargs.enable_thinking"  # where the client gave it
    if status == 429:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return OpenAIError(error.message, status, kind, code=code, headers=headers)
    if status >= 500:
        repeated = _BACKEND_ERROR_LOGS.setdefault(error.code, RepeatedWarning(10.0, log))
        repeated.log("backend error %s: %s", error.code.value, error.message)
        message = UNAVAILABLE_MESSAGE if status == 503 else INTERNAL_MESSAGE
        return OpenAIError(message, status, kind, code=code)
    return OpenAIError(error.message, status, kind, param=param, code=code)


def _short(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (errors never echo a whole huge input)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _param(loc: tuple, body: object, missing: bool) -> str | None:
    """The request field at fault, dotted (``messages.0.role``), from a pydantic error location.

    The location of a union field's error also names the member type tried (``prompt.str``,
    ``messages.0.content.list[ContentPart].0.type``). Such parts are not in the body, so only
    the keys and indices the body holds are kept, plus the name of a missing field (which the body
    lacks by definition). Without a JSON object body the location is kept whole.
    """
    parts = list(loc[1:] if loc[:1] == ("body",) else loc)
    if not isinstance(body, dict):
        return ".".join(map(str, parts)) or None
    kept, node = [], body
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (missing and i == len(parts) - 1):
            continue  # a union member's type name, or pydantic's "[key]" marker
        kept.append(str(part))
    return ".".join(kept) or None


def _most_specific(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The error to report: the first one, unless the same field failed a union member whose
    type matched. A union field reports one error per member tried (``prompt: [-1]`` fails
    ``str`` and ``list[str]`` by type and ``list[TokenId]`` by range); the first error that is not
    a mere type mismatch (``*_type``) says what is wrong with the value."""
    first = errors[0]
    field = tuple(first.get("loc", ()))[:2]  # ("body", name)
    for error in errors:
        same_field = tuple(error.get("loc", ()))[:2] == field
        if same_field and not str(error.get("type", "")).endswith("_type"):
            return error
    return first


# Codes of a body that is no JSON object: JSON that does not parse, and a body that parses to
# something else (an array, a string, ...) or that was not sent as JSON at all.
INVALID_JSON = "invalid_json"
INVALID_BODY_TYPE = "invalid_type"
_JSON_TYPES = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _unparsed_body(reason: str) -> OpenAIError:
    """The 400 ``invalid_json`` of a body that does not parse as JSON, saying why."""
    return OpenAIError(
        f"We could not parse the JSON body of your request: {reason}. The body must be a JSON "
        "object.",
        code=INVALID_JSON,
    )


# What FastAPI's 400 for a body it could not decode was caused by, and how to say it.
_UNPARSED_CAUSES = {
    UnicodeDecodeError: "it is not valid UTF-8",
    RecursionError: "it is nested too deeply",  # json.loads of very deep nesting
}


def _body_error(error: Mapping[str, Any], body: Any) -> OpenAIError | None:
    """The error of a body that is no JSON object, from FastAPI's error (its ``type`` and
    ``loc``, never its wording) and the body as FastAPI read it (JSON, or raw bytes when the
    Content-Type was not JSON); None for an error inside a JSON object."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == "json_invalid":  # FastAPI: loc ("body", offset), body: the text
        offset = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
        where = ""
        if offset is not None and isinstance(body, str):
            line = body.count("\n", 0, offset) + 1
            column = offset - body.rfind("\n", 0, offset)
            where = f" at line {line} column {column} (character {offset})"
        return _unparsed_body((error.get("ctx", {}).get("error") or "invalid JSON") + where)
    if loc != ("body",) or isinstance(body, dict):  # a field's error, or the object's own
        return None
    if error.get("type") == "missing":  # FastAPI: an empty body
        got = "the request has no body"
    elif isinstance(body, bytes):  # FastAPI reads JSON only under a JSON Content-Type
        got = "it was not sent with Content-Type: application/json"
    else:
        got = f"got {_JSON_TYPES.get(type(body), 'a number')}"
    return OpenAIError(
        f"The body of your request must be a JSON object: {got}.", code=INVALID_BODY_TYPE
    )


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    first: Mapping[str, Any] = (
        _most_specific(exc.errors()) if exc.errors() else {"msg": "invalid request", "loc": ()}
    )
    body_error = _body_error(first, exc.body)
    if body_error is not None:
        return body_error
    param = _param(tuple(first.get("loc", ())), exc.body, first.get("type") == "missing")
    message = first.get("msg", "invalid value")
    if param:
        message = f"Invalid '{param}': {message} (got {_short(first.get('input'))})"
    return OpenAIError(message, param=param, code=first.get("type"))


def install_error_handlers(app: FastAPI) -> None:
    """Route every error raised inside ``app`` to an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        for cause, reason in _UNPARSED_CAUSES.items():
            if isinstance(exc.__cause__, cause):
                return _unparsed_body(reason).response()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(str(exc.detail), status=exc.status_code, type=kind).response()

    @app.exception_handler(UnicodeEncodeError)
    async def _unicode(_: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # JSON allows "\ud800" escapes that are no valid Unicode text (lone surrogates).
        return OpenAIError(
            "the request holds text that is not valid Unicode (a lone UTF-16 surrogate)",
            code="invalid_unicode",
        ).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return OpenAIError(INTERNAL_MESSAGE, status=500, type="server_error").response()
