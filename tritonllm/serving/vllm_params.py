"""Sampling parameters given as JSON, the Triton vLLM backend's convention.

vLLM-backend clients send a ``sampling_parameters`` input (one BYTES element holding a JSON
object) and may put the same object in the request's Triton parameters; the values are often
strings (``{"temperature": "0.1", "max_tokens": "100"}``, as the backend's own sample client
sends them). The backend converts each value to its ``vllm.SamplingParams`` field's type; here
each value is converted to the type of this engine's ``SamplingParams`` field of the same name,
with booleans read as JSON booleans or ``"true"``/``"false"`` (vLLM's ``bool("false")`` is
True). Keys this service cannot honour are refused by name; a few vLLM keys whose given value
changes nothing here are accepted (``NO_OP_VALUES``). ``structured_outputs`` (or vLLM's older
``guided_decoding``) is vLLM's object (``tritonllm.structured.spec``), given as an object or
its JSON text, and so is ``logit_bias`` (OpenAI's object of token id -> bias, keys strings
holding integers: ``logit_bias_values``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from tritonllm.contract.errors import ErrorCode, RequestError, short_repr
from tritonllm.structured.spec import StructuredOutputs

# Field -> its kind: "int", "float", "bool", "string", "strings" (a string or a list of
# strings), "ints".
FIELD_KINDS: dict[str, str] = {
    "max_tokens": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "seed": "int",
    "stop": "strings",
    "stop_token_ids": "ints",
    "ignore_eos": "bool",
    "min_tokens": "int",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "repetition_penalty": "float",
    "logprobs": "int",
    "n": "int",
    "cache_salt": "string",
    "structured_outputs": "structured",
    "allowed_token_ids": "ints",
    "bad_words": "strings",
    "logit_bias": "bias",
}
# vLLM's older name of a field -> the field (vLLM < 0.10 calls structured outputs
# `guided_decoding`, a GuidedDecodingParams of the same shape).
ALIASES = {"guided_decoding": "structured_outputs"}
# vLLM keys accepted with these values only: with them vLLM does what this service always does.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "detokenize": (True,),
    "prompt_logprobs": (None,),
    "best_of": (None, 1),
}
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def sampling_values(raw: str | Mapping[str, Any], source: str) -> dict[str, Any]:
    """The sampling fields of a JSON object, converted to their field types.

    Args:
        raw: the JSON text of an object, or the object (a dict).
        source: where it came from (``"sampling_parameters"`` or ``"parameters"``), for the
            parameter names errors carry (``sampling_parameters.top_p``).
    Returns:
        field name -> value (``None`` values are left out: the field's default applies).
    Raises:
        RequestError: not a JSON object (``invalid_input``); a key this service cannot honour
            (``unsupported_parameter``); a value of the wrong type (``invalid_value``).
    """
    payload = _object(raw, source)
    values: dict[str, Any] = {}
    for key, value in payload.items():
        param = f"{source}.{key}"
        if key in NO_OP_VALUES:
            if not any(_same(value, ok) for ok in NO_OP_VALUES[key]):
                raise RequestError(
                    ErrorCode.UNSUPPORTED_PARAMETER,
                    param,
                    f"{param}={short_repr(value)} is not supported by this server (only "
                    f"{' or '.join(json.dumps(v) for v in NO_OP_VALUES[key])})",
                )
            continue
        field = ALIASES.get(key, key)
        kind = FIELD_KINDS.get(field)
        if kind is None:
            raise RequestError(
                ErrorCode.UNSUPPORTED_PARAMETER,
                param,
                f"{param} is not supported by this server",
            )
        if value is None:
            continue
        if kind == "structured":
            values[field] = StructuredOutputs.from_wire(value, param)
        elif kind == "bias":
            values[field] = logit_bias_values(value, param)
        else:
            values[field] = _convert(value, kind, param)
    return values


def logit_bias_values(raw: Any, param: str) -> dict[int, float]:
    """OpenAI's ``logit_bias`` object (or its JSON text) as {token id: bias}.

    Keys are token ids written as integers (``"50256"``; JSON object keys are strings); values
    are numbers, or strings holding one (the vLLM backend's convention). Their ranges are
    `SamplingParams`' to check (ids >= 0 and < vocab, biases in [-100, 100], the entry count).

    Raises:
        RequestError: (``invalid_value``, param ``param``) not an object, a key that is not an
            integer or names an id twice (``"7"`` and ``"07"``), or a value that is not a
            finite number.
    """
    payload = _json_value(raw) if isinstance(raw, str) else raw
    if not isinstance(payload, Mapping):
        raise RequestError(
            ErrorCode.INVALID_VALUE,
            param,
            f"{param} must be a JSON object of token id -> bias, got {short_repr(raw)}",
        )
    values: dict[int, float] = {}
    for key, value in payload.items():
        token = _to_int(key)
        if token is None or isinstance(key, float) or token in values:
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                param,
                f"{param} keys must be distinct token ids (integers), got {short_repr(key)}",
            )
        values[token] = _convert(value, "float", f"{param}[{key}]", param)
    return values


def _json_value(text: str) -> Any:
    """The value of JSON ``text`` (blank: an empty object), or None when it is no JSON."""
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return None


def _object(raw: str | Mapping[str, Any], source: str) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        return raw
    payload = _json_value(raw)
    if not isinstance(payload, dict):
        raise RequestError(ErrorCode.INVALID_INPUT, source, f"{source} must be a JSON object")
    return payload


def _same(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool) or expected is None:
        return value is expected or (isinstance(value, str) and _bool(value) is expected)
    return not isinstance(value, bool) and value == expected


def _bool(text: str) -> bool | None:
    lowered = text.strip().lower()
    return True if lowered in _TRUE else False if lowered in _FALSE else None


def _convert(value: Any, kind: str, label: str, param: str = "") -> Any:
    """``value`` as ``kind``; raises RequestError (``invalid_value``, param ``param``, default
    ``label``) naming it ``label`` when it is not one."""
    converted = _CONVERTERS[kind](value)
    if converted is None:
        raise RequestError(
            ErrorCode.INVALID_VALUE,
            param or label,
            f"{label} must be {_EXPECTED[kind]}, got {short_repr(value)}",
        )
    return converted


def _to_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _to_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _to_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    return _bool(value) if isinstance(value, str) else None


def _to_string(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _to_strings(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _to_ints(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    ints = []
    for item in value:
        number = _to_int(item)
        if number is None:
            return None
        ints.append(number)
    return ints


_CONVERTERS = {
    "int": _to_int,
    "float": _to_float,
    "bool": _to_bool,
    "string": _to_string,
    "strings": _to_strings,
    "ints": _to_ints,
}
_EXPECTED = {
    "int": "an integer (or a string holding one)",
    "float": "a finite number (or a string holding one)",
    "bool": 'a boolean (or "true" / "false")',
    "string": "a string",
    "strings": "a string or a list of strings",
    "ints": "a list of integers",
}
