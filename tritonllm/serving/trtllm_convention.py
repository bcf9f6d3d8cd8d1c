"""TensorRT-LLM's ensemble convention -> the ``llm`` ensemble's inputs, and its outputs back.

TensorRT-LLM's Triton ensemble (model ``ensemble``) is a batching model: its clients send
``[1, 1]`` tensors (a batch dimension of 1 before each ``[1]`` input). The ``ensemble`` BLS model
of this repository takes those (``tritonllm.contract.tensors.TRTLLM_ENSEMBLE``), turns each
request into one ``llm`` request with this module, and turns every ``llm`` response back into
TensorRT-LLM's output names and shapes. Mapping (ARCHITECTURE.md, "TensorRT-LLM convention"):

==========================================  =================================================
TensorRT-LLM input                          ``llm`` input
==========================================  =================================================
``text_input``, ``max_tokens``, ``stream``,  the same (absent ``stream``: false, as in
                                             TensorRT-LLM, where ``llm`` streams)
``temperature``, ``top_k``, ``top_p``,
``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``exclude_input_in_output``
``num_return_sequences``                    ``n`` (n > 1 without streaming: ``llm`` streams
                                             and each sequence is sent whole when it ends,
                                             a response per sequence, as TensorRT-LLM does)
``seed`` / ``random_seed`` (UINT64)          ``seed`` (INT64: below 2**63)
``min_tokens`` / ``min_length``              ``min_tokens``
``stop_words`` (BYTES list)                  ``stop`` (stop strings, OpenAI semantics)
``bad_words`` (BYTES list)                   ``bad_words`` (banned as vLLM bans them: each
                                             word with and without a leading space)
``end_id``                                   ``stop_token_ids = [end_id]`` + ``ignore_eos``
``return_log_probs``                         ``logprobs = 0`` (-> ``output_log_probs``,
                                             ``cum_log_probs``)
``pad_id``, ``return_num_input_tokens``,     accepted: outputs are never padded, the counts are
``return_num_output_tokens``                 always sent
``beam_width`` > 1,                          refused (``unsupported_parameter``), naming it
``length_penalty`` != 1, ``return_context_logits``,
``return_generation_logits``,
``return_perf_metrics``
==========================================  =================================================
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tritonllm.contract import limits
from tritonllm.contract.errors import (
    ErrorCode,
    RequestError,
    decode_error,
    encode_error,
    short_repr,
)
from tritonllm.serving.inputs import scalar, text

# Inputs passed on under the same name (value unchanged, the batch dimension dropped).
SAME_NAME = (
    "text_input",
    "max_tokens",
    "stream",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "exclude_input_in_output",
)
RENAMED = {"num_return_sequences": "n", "min_length": "min_tokens", "min_tokens": "min_tokens"}
# ``llm`` input -> the TensorRT-LLM inputs it is made from (an error names the one given).
CLIENT_NAMES = {
    "n": ("num_return_sequences",),
    "min_tokens": ("min_tokens", "min_length"),
    "seed": ("seed", "random_seed"),
    "stop": ("stop_words",),
    "stop_token_ids": ("end_id",),
    "logprobs": ("return_log_probs",),
}
# Flags this service cannot honour when true.
UNSUPPORTED_FLAGS = ("return_context_logits", "return_generation_logits", "return_perf_metrics")


@dataclass
class Translation:
    """One TensorRT-LLM request as ``llm`` inputs.

    Attributes:
        inputs: ``llm`` input name -> rank-1 numpy array.
        return_log_probs: whether responses carry ``output_log_probs`` / ``cum_log_probs``.
        whole_sequences: the client asked for several sequences without streaming, and
            ``llm`` sends several only streamed: ``llm`` streams, and ``OutputState`` sends
            each sequence whole, once, when it ends.
    """

    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    return_log_probs: bool = False
    whole_sequences: bool = False


def _unsupported(name: str, value: Any, why: str) -> RequestError:
    return RequestError(
        ErrorCode.UNSUPPORTED_PARAMETER,
        name,
        f"{name}={short_repr(value)} is not supported by this server ({why})",
    )


def _seed(inputs: Mapping[str, np.ndarray | None]) -> int | None:
    seeds = {}
    for name in ("seed", "random_seed"):
        if inputs.get(name) is not None:
            seeds[name] = int(scalar(inputs[name], name, int))
    values = set(seeds.values())
    if len(values) > 1:
        raise RequestError(
            ErrorCode.INVALID_VALUE, "seed", f"seed and random_seed differ ({seeds})"
        )
    if not values:
        return None
    seed = values.pop()
    if seed > limits.INT64_MAX:
        name = next(iter(seeds))
        raise RequestError(ErrorCode.INVALID_VALUE, name, f"{name} must be < 2**63, got {seed}")
    return seed


def llm_inputs(inputs: Mapping[str, np.ndarray | None]) -> Translation:
    """Translate one TensorRT-LLM request (input name -> array with the batch dimension).

    Raises:
        RequestError: a parameter this service cannot honour (``unsupported_parameter``), a
            seed that does not fit int64, or a malformed input.
    """
    out = Translation()
    given = {name: value for name, value in inputs.items() if value is not None}
    for name in SAME_NAME:
        if name in given:
            out.inputs[name] = np.asarray(given[name]).reshape(-1)
    # TensorRT-LLM streams only when asked: absent, one response with the whole text (what
    # Triton's HTTP generate needs), where `llm` streams by default.
    out.inputs.setdefault("stream", np.array([False]))
    for name, target in RENAMED.items():
        if name in given:
            value = np.asarray(given[name], dtype=np.int32).reshape(-1)
            if target in out.inputs and out.inputs[target].tolist() != value.tolist():
                raise RequestError(ErrorCode.INVALID_VALUE, target, f"{name} and {target} differ")
            out.inputs[target] = value
    n = scalar(out.inputs.get("n"), "num_return_sequences", int, 1)
    if n > 1 and not scalar(out.inputs["stream"], "stream", bool):
        out.inputs["stream"] = np.array([True])
        out.whole_sequences = True
    seed = _seed(given)
    if seed is not None:
        out.inputs["seed"] = np.array([seed], dtype=np.int64)
    beam_width = scalar(given.get("beam_width"), "beam_width", int, 1)
    if beam_width != 1:
        raise _unsupported("beam_width", beam_width, "no beam search: only 1")
    length_penalty = scalar(given.get("length_penalty"), "length_penalty", float, 1.0)
    if length_penalty != 1.0:
        raise _unsupported("length_penalty", length_penalty, "beam search only: 1.0")
    bad_words = _words(given.get("bad_words"), "bad_words")
    if bad_words:  # banned as vLLM bans them (tritonllm.structured.constraint)
        out.inputs["bad_words"] = np.array([w.encode("utf-8") for w in bad_words], np.object_)
    for name in UNSUPPORTED_FLAGS:
        if scalar(given.get(name), name, bool, False):
            raise _unsupported(name, True, "only false")
    stop = _words(given.get("stop_words"), "stop_words")
    if stop:
        out.inputs["stop"] = np.array([s.encode("utf-8") for s in stop], dtype=np.object_)
    end_id = scalar(given.get("end_id"), "end_id", int)
    if end_id is not None:
        out.inputs["stop_token_ids"] = np.array([end_id], dtype=np.int32)
        out.inputs["ignore_eos"] = np.array([True])
    if scalar(given.get("return_log_probs"), "return_log_probs", bool, False):
        out.return_log_probs = True
        out.inputs["logprobs"] = np.array([0], dtype=np.int32)
    return out


def client_error(message: str, given: Collection[str]) -> str:
    """An ``llm`` error message as a TensorRT-LLM client reads it: an error in wire form whose
    ``param`` is an ``llm`` input made from another name (``CLIENT_NAMES``) names the input
    the client sent (of ``given``, its input names) instead; any other message is returned
    unchanged (the wording keeps ``llm``'s names)."""
    error = decode_error(message)
    if error is None or error.param is None:
        return message
    head = error.param.split(".", 1)[0].split("[", 1)[0]
    sent = [name for name in CLIENT_NAMES.get(head, ()) if name in given]
    if not sent:
        return message
    return encode_error(error.code, error.message, sent[0] + error.param[len(head) :])


def _words(array: np.ndarray | None, name: str) -> list[str]:
    """A BYTES word list's non-empty strings (TensorRT-LLM clients pad lists with "")."""
    if array is None:
        return []
    words = [text(value, name) for value in np.asarray(array).reshape(-1)]
    return [word for word in words if word]


class OutputState:
    """Per request: the running sum of each choice's logprobs (TensorRT-LLM's
    ``cum_log_probs``) and, for ``Translation.whole_sequences``, each unfinished sequence's
    text and logprobs so far.

    Args:
        whole_sequences: ``Translation.whole_sequences``: ``outputs`` gives a sequence's
            outputs only once it ends, with its whole text and logprobs.
    """

    def __init__(self, whole_sequences: bool = False) -> None:
        self._cumulative: dict[int, float] = {}
        self._num_input = np.zeros((1, 1), np.int32)  # llm sends it in a choice's first response
        self._pieces: dict[int, tuple[list[bytes], list[np.ndarray]]] | None = (
            {} if whole_sequences else None
        )

    def outputs(
        self, llm: Mapping[str, np.ndarray], return_log_probs: bool
    ) -> dict[str, Any] | None:
        """TensorRT-LLM outputs (batch dimension 1) of one ``llm`` response's outputs; None
        while a whole sequence is being collected."""
        index = int(np.asarray(llm["index"]).reshape(-1)[0]) if "index" in llm else 0
        if "num_input_tokens" in llm:
            self._num_input = _int32(llm, "num_input_tokens")
        text_output = np.asarray(llm["text_output"], dtype=np.object_).reshape(1, 1)
        finish_reason = np.asarray(llm["finish_reason"], dtype=np.object_).reshape(1, 1)
        logprobs = np.asarray(llm.get("output_logprobs", []), dtype=np.float32).reshape(-1)
        if self._pieces is not None:
            texts, scores = self._pieces.setdefault(index, ([], []))
            texts.append(bytes(text_output[0, 0]))
            scores.append(logprobs)
            if not finish_reason[0, 0]:
                return None
            del self._pieces[index]
            text_output = np.array([[b"".join(texts)]], dtype=np.object_)
            logprobs = np.concatenate(scores)
        out = {
            "text_output": text_output,
            "finish_reason": finish_reason,
            "num_input_tokens": self._num_input,
            "num_output_tokens": _int32(llm, "num_output_tokens"),
            "sequence_index": np.array([[index]], dtype=np.int32),
            "batch_index": np.array([[0]], dtype=np.int32),
        }
        if return_log_probs:
            total = self._cumulative.get(index, 0.0) + float(logprobs.sum())
            self._cumulative[index] = total
            out["output_log_probs"] = logprobs.reshape(1, 1, -1)
            out["cum_log_probs"] = np.array([[total]], dtype=np.float32)
        return out


def _int32(llm: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(llm[name], dtype=np.int32).reshape(1, 1)
