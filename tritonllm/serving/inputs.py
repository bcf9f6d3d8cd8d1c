"""Request inputs of the generator (numpy arrays by input name) → plain Python values."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np

from tritonllm.sampling_params import SamplingParams

# Optional sampling inputs of the generator and the llm ensemble (ARCHITECTURE.md), with the
# Python type of their SamplingParams field; `stop_token_ids` (ints) and `stop` (strings) are
# lists, the others scalars.
SAMPLING_INPUTS: dict[str, type] = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "stop_token_ids": list,
    "stop": str,
    "ignore_eos": bool,
    "min_tokens": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "logprobs": int,  # top alternatives per token, 0..20; absent: no logprobs
    "n": int,  # choices, 1..16; > 1 needs stream=true
}
_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


def scalar(array: np.ndarray | None, name: str, kind: type, default: Any = None) -> Any:
    """The single element of ``array`` as ``kind`` (``default`` when the input is absent).

    Raises:
        ValueError: the input does not hold exactly one element, or a ``str`` input is not
            UTF-8.
    """
    if array is None:
        return default
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"input {name!r} must hold one value, got {flat.size}")
    value = flat[0]
    if kind is str:
        return _text(value, name)
    return kind(value)


def _text(value: Any, name: str) -> str:
    """A string input's element as text.

    Raises:
        ValueError: the bytes are not UTF-8 (the message names input ``name``).
    """
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"input {name!r} is not valid UTF-8") from None


def sampling_params(inputs: Mapping[str, np.ndarray | None]) -> SamplingParams:
    """``SamplingParams`` from the optional sampling inputs present in ``inputs``, validated.

    Raises:
        ValueError: an input with the wrong number of elements or a value out of range (the
            message names the parameter).
    """
    kwargs: dict[str, Any] = {}
    for name, kind in SAMPLING_INPUTS.items():
        array = inputs.get(name)
        if array is None or name not in _PARAM_FIELDS:
            continue
        if kind is list:
            kwargs[name] = [int(t) for t in np.asarray(array).reshape(-1)]
        elif name == "stop":  # a list of strings
            kwargs[name] = [_text(t, name) for t in np.asarray(array).reshape(-1)]
        else:
            kwargs[name] = scalar(array, name, kind)
    max_tokens = kwargs.get("max_tokens")
    if max_tokens is not None and max_tokens < 0:  # (SamplingParams would say ">= 1")
        raise ValueError(
            f"max_tokens must be >= 0 (0: until EOS, a stop condition or the context limit), "
            f"got {max_tokens}"
        )
    if max_tokens == 0:
        kwargs["max_tokens"] = None
    return SamplingParams(**kwargs).validate()
