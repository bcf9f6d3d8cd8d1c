"""The generator's request inputs (numpy arrays by input name) -> one validated request.

This is the generator's trust boundary: every client value is checked here, once, and the
layers after it (the engine front, the engine) trust what it built. Sampling values come from
three places, merged by field name (``tritonllm.contract.tensors.SAMPLING_INPUTS``):

1. the sampling input tensors (``temperature`` FP32 [1], ``stop`` BYTES [-1], ...);
2. ``sampling_parameters``, a JSON object (the Triton vLLM backend's convention;
   ``serving.vllm_params`` converts its values, often strings such as ``"0.1"``);
3. the request's Triton ``parameters`` (where vLLM-backend clients may also put them, and where
   Triton's HTTP ``generate`` puts every JSON field that is no input).

A field given in more than one place must have the same value everywhere; anything unknown is
refused by name, never ignored. Sizes are checked before any conversion
(``contract.limits``: ``MAX_PROMPT_TOKENS`` ids, 64 times the stop-string limits,
``MAX_STOP_TOKEN_IDS``, ``MAX_PARAMETERS_BYTES`` of JSON, ``MAX_PROMPT_BYTES`` of echo text), so
an oversized input costs no more than its refusal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonllm.contract import limits, tensors
from tritonllm.contract.errors import ErrorCode, RequestError, short_repr
from tritonllm.sampling_params import SamplingParams
from tritonllm.serving.vllm_params import logit_bias_values, sampling_values
from tritonllm.structured.spec import StructuredOutputs

# Sampling input -> (a list input?, the Python type of its elements), from the contract.
_TYPES = {"INT32": int, "INT64": int, "FP32": float, "BOOL": bool, "BYTES": str}
_KINDS: dict[str, tuple[bool, type]] = {
    spec.name: (spec.dims == (-1,), _TYPES[spec.dtype]) for spec in tensors.SAMPLING_INPUTS
}
# Most elements of an input (counted before conversion) and most bytes of a string input:
# coarse bounds on the conversion's cost; `SamplingParams` then holds the values to their
# exact limits (MAX_STOP_STRINGS, with its own message).
_MAX_ELEMENTS = {
    "input_ids": limits.MAX_PROMPT_TOKENS,
    "stop": 64 * limits.MAX_STOP_STRINGS,
    "stop_token_ids": limits.MAX_STOP_TOKEN_IDS,
}
_MAX_BYTES = {
    "stop": 64 * limits.MAX_STOP_STRINGS * limits.MAX_STOP_STRING_CHARS,
    "sampling_parameters": limits.MAX_PARAMETERS_BYTES,
    "echo_text": limits.MAX_PROMPT_BYTES,
    "cache_salt": limits.MAX_CACHE_SALT_CHARS * 4,  # UTF-8: at most 4 bytes a character
    "logit_bias": limits.MAX_PARAMETERS_BYTES,  # a JSON object, as sampling_parameters
}


def check_size(name: str, array: np.ndarray | None) -> None:
    """Raises: RequestError (``invalid_input``) when input ``name`` holds more elements, or
    (string inputs) more bytes, than its limit; no-op for absent inputs and other names."""
    if array is None:
        return
    count = _MAX_ELEMENTS.get(name)
    if count is not None and array.size > count:
        raise RequestError(
            ErrorCode.INVALID_INPUT, name, f"{name} holds {array.size} elements; at most {count}"
        )
    size = _MAX_BYTES.get(name)
    if size is not None and array.dtype == object:
        if sum(len(v) for v in array.reshape(-1)) > size:
            raise RequestError(ErrorCode.INVALID_INPUT, name, f"{name} exceeds {size} bytes")


@dataclass(frozen=True)
class GenerateRequest:
    """A validated generation request.

    Attributes:
        prompt_ids: the prompt's token ids.
        params: its sampling params (validated).
        stream: True: a response per batch of new ids; False: exactly one response.
        echo_text: text each choice's first response starts with (the prompt, when the client
            sent ``exclude_input_in_output=false``), or None.
    """

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = True
    echo_text: str | None = None


def scalar(array: np.ndarray | None, name: str, kind: type, default: Any = None) -> Any:
    """The single element of ``array`` as ``kind`` (``default`` when the input is absent).

    Raises:
        RequestError: (``invalid_input``) not exactly one element, or a ``str`` input that is
            not UTF-8.
    """
    if array is None:
        return default
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise RequestError(
            ErrorCode.INVALID_INPUT, name, f"input {name!r} must hold one value, got {flat.size}"
        )
    value = flat[0]
    if kind is str:
        return text(value, name)
    return kind(value)


def text(value: Any, name: str) -> str:
    """A string input's element as text.

    Raises:
        RequestError: (``invalid_input``) the bytes are not UTF-8.
    """
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(
            ErrorCode.INVALID_INPUT, name, f"input {name!r} is not valid UTF-8"
        ) from None


def tensor_sampling_values(inputs: Mapping[str, np.ndarray | None]) -> dict[str, Any]:
    """The sampling fields given as input tensors, as plain Python values."""
    values: dict[str, Any] = {}
    for name, (is_list, kind) in _KINDS.items():
        array = inputs.get(name)
        if array is None:
            continue
        if is_list:
            flat = np.asarray(array).reshape(-1)
            values[name] = [text(t, name) if kind is str else kind(t) for t in flat]
        elif name == "structured_outputs":  # a JSON object (tritonllm.structured.spec)
            values[name] = StructuredOutputs.from_wire(scalar(array, name, str), name)
        elif name == "logit_bias":  # OpenAI's JSON object {"<token id>": bias}
            values[name] = logit_bias_values(scalar(array, name, str), name)
        else:
            values[name] = scalar(array, name, kind)
    return values


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):  # an FP32 tensor vs a JSON number
        return np.float32(a) == np.float32(b)
    return a == b


def merge_sampling_values(sources: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """One dict of sampling fields from several sources (source name -> its fields, in the
    order given). A field given by several sources keeps the first one's value (the others
    are equal to it), so errors about it name the field as that source gave it (a
    constraint's ``sampling_parameters.guided_decoding.regex`` rather than its copy in the
    request's parameters).

    Raises:
        RequestError: (``invalid_value``) a field that two sources give different values.
    """
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, values in sources.items():
        for name, value in values.items():
            if name not in merged:
                merged[name], origin[name] = value, source
            elif not _same(merged[name], value):
                raise RequestError(
                    ErrorCode.INVALID_VALUE,
                    name,
                    f"{name} is given twice with different values ({origin[name]}: "
                    f"{short_repr(merged[name])}, {source}: {short_repr(value)})",
                )
    return merged


def generate_request(
    inputs: Mapping[str, np.ndarray | None], parameters: str | Mapping[str, Any] = ""
) -> GenerateRequest:
    """Validate one generation request.

    Args:
        inputs: the generator's input tensors by name (absent inputs None or left out).
        parameters: the Triton request's parameters (``request.parameters()``, a JSON object
            string, or a dict).
    Raises:
        RequestError: a missing ``input_ids``, a malformed input, an unknown or unsupported
            parameter, a value out of range, or ``n > 1`` without streaming.
    """
    input_ids = inputs.get("input_ids")
    if input_ids is None:
        raise RequestError(
            ErrorCode.MISSING_INPUT,
            "input_ids",
            "input_ids is required (or abort_request_id / health_probe for a control request)",
        )
    for name, array in inputs.items():
        check_size(name, array)
    sources = {"input": tensor_sampling_values(inputs)}
    raw_json = inputs.get("sampling_parameters")
    if raw_json is not None:
        text_json = scalar(raw_json, "sampling_parameters", str)
        sources["sampling_parameters"] = sampling_values(text_json, "sampling_parameters")
    if parameters:
        sources["parameters"] = sampling_values(parameters, "parameters")
    params = SamplingParams(**merge_sampling_values(sources))
    stream = scalar(inputs.get("stream"), "stream", bool, default=True)
    if params.n > 1 and not stream:
        raise RequestError(
            ErrorCode.INVALID_VALUE,
            "n",
            "n > 1 requires stream=true (each choice is its own response)",
        )
    echo = inputs.get("echo_text")
    return GenerateRequest(
        prompt_ids=np.asarray(input_ids).reshape(-1).tolist(),
        params=params,
        stream=stream,
        echo_text=None if echo is None else scalar(echo, "echo_text", str),
    )
