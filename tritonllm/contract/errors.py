"""Error codes, the typed ``RequestError``, and the one wire form of an error.

An error's class travels as a code, never as wording: the engine and the models raise
``RequestError(code, param, message)`` for a request's own faults, the Triton models put every
error they answer with into the wire form below, and the sidecar maps the code (never the
message) to an OpenAI status. Wire form, the whole text of a Triton error message as the model
sends it::

    tritonllm-error:{"code":"invalid_value","param":"temperature","message":"..."}

(JSON with ASCII escapes, so no client text can end the object early.) Triton may prepend its
own routing (``in ensemble 'llm', ``); ``decode_error`` finds the object that ends the message,
so text quoted inside ``message`` (a client's stop string, say) can neither forge nor change a
code. An error without the wire form comes from Triton itself (model not ready, stub died,
cancelled) and keeps Triton's own meaning.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

MARKER = "tritonllm-error:"
_DECODER = json.JSONDecoder()
_FIELDS = {"code", "param", "message"}


class ErrorCode(str, enum.Enum):
    """What went wrong, as data. The first six are the request's fault."""

    INVALID_VALUE = "invalid_value"  # a parameter out of its range or of the wrong type
    INVALID_INPUT = "invalid_input"  # a malformed input: element count, UTF-8, JSON, size
    MISSING_INPUT = "missing_input"  # a required input is absent
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # known, but this service cannot honour it
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + output over the model's limit
    PERMISSION_DENIED = "permission_denied"  # a control request without the control secret
    INTERNAL_ERROR = "internal_error"  # the server failed (an engine step, an unload)
    ENGINE_UNAVAILABLE = "engine_unavailable"  # the engine is not running (dead, shut down)
    SERVER_OVERLOADED = "server_overloaded"  # the generator's queue is full: retry later

    @property
    def is_request_fault(self) -> bool:
        """Whether the client caused it (a 400-class error)."""
        return self not in _SERVER_FAULTS


_SERVER_FAULTS = frozenset(
    {ErrorCode.INTERNAL_ERROR, ErrorCode.ENGINE_UNAVAILABLE, ErrorCode.SERVER_OVERLOADED}
)


class RequestError(ValueError):
    """A request's own fault: a code, the parameter at fault (None: the request as a whole) and
    a human-readable message. A ``ValueError``, so callers that catch those still do.

    Args:
        code: the ``ErrorCode`` (a request fault; see ``ErrorCode.is_request_fault``).
        param: the parameter or input at fault, in the engine's names (``temperature``,
            ``stop``, ``prompt``, ``messages``, ``sampling_parameters.top_p``, ...).
        message: the text shown to the client; it may quote (shortened) client values.
    """

    def __init__(self, code: ErrorCode, param: str | None, message: str) -> None:
        super().__init__(message)
        self.code, self.param, self.message = ErrorCode(code), param, message

    def wire(self) -> str:
        """This error in the wire form (see the module docstring)."""
        return encode_error(self.code, self.message, self.param)


@dataclass(frozen=True)
class WireError:
    """An error decoded from its wire form."""

    code: ErrorCode
    param: str | None
    message: str


def encode_error(code: ErrorCode, message: str, param: str | None = None) -> str:
    """The wire form of an error: ``MARKER`` + a JSON object ``{code, param, message}``."""
    payload = {"code": ErrorCode(code).value, "param": param, "message": message}
    return MARKER + json.dumps(payload, ensure_ascii=True, separators=(",", ":"))


def decode_error(text: str) -> WireError | None:
    """The error a Triton error message carries in wire form, or None (then the error is
    Triton's own). The wire object must end the text: anything quoted inside its message,
    a marker or JSON included, is only part of that message."""
    start = text.find(MARKER)
    while start >= 0:
        try:
            payload, end = _DECODER.raw_decode(text, start + len(MARKER))
        except ValueError:
            payload, end = None, -1
        if end == len(text) and _valid(payload):
            return WireError(ErrorCode(payload["code"]), payload["param"], payload["message"])
        start = text.find(MARKER, start + 1)
    return None


def _valid(payload: object) -> bool:
    if not isinstance(payload, dict) or set(payload) != _FIELDS:
        return False
    code, param, message = payload["code"], payload["param"], payload["message"]
    known = isinstance(code, str) and code in ErrorCode._value2member_map_
    return known and isinstance(message, str) and (param is None or isinstance(param, str))


def triton_status(text: str) -> str:
    """The name of the ``pb_utils.TritonError`` code a model answers an error message with:
    ``INVALID_ARG`` for a request's own fault in wire form, else ``INTERNAL`` (the Python
    backend's default). Triton reports that code as the status of a direct call of a
    non-decoupled model (KServe ``/infer``: 400 against 500; gRPC ``ModelInfer``:
    ``INVALID_ARGUMENT`` against ``INTERNAL``), as its own input checks answer a bad request;
    the wire code in the message stays what clients read."""
    error = decode_error(text)
    return "INVALID_ARG" if error is not None and error.code.is_request_fault else "INTERNAL"


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: messages never echo a huge input whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


__all__ = [
    "MARKER",
    "ErrorCode",
    "RequestError",
    "WireError",
    "decode_error",
    "encode_error",
    "short_repr",
    "triton_status",
]
