"""Logprobs on the Triton path: engine dicts → flat tensors (generator) → OpenAI JSON (detokenizer).

The generator sends, per response, ``logprobs`` FP32 ``[num_ids]`` (the chosen tokens') and the
top alternatives flattened row-major as ``top_logprob_ids`` INT32 / ``top_logprobs`` FP32
``[num_ids * k]`` (k = the requested count, most likely first). The detokenizer turns them into
the entries OpenAI's chat format uses (``choices[i].logprobs.content``), which the sidecar also
maps to the legacy completions format. Prompt scores (prompt logprobs) travel the same way
under ``prompt_*`` names and become the same entries, one per prompt token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tritonllm.contract.limits import MIN_LOGPROB


def flatten_top_logprobs(
    top_logprobs: Sequence[dict[int, float]] | None, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flat ``(ids int32 [num_ids * k], logprobs float32 [num_ids * k])`` of per-token dicts.

    Args:
        top_logprobs: per token ``{token id: logprob}`` of its k most likely tokens (the
            engine's ``RequestOutput.top_logprobs``), or None (not requested).
        k: the requested number of alternatives per token.
    Raises:
        ValueError: a token with a number of alternatives other than ``k``.
    """
    if not top_logprobs or k == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    ids, values = [], []
    for alternatives in top_logprobs:
        if len(alternatives) != k:
            raise ValueError(f"expected {k} top logprobs per token, got {len(alternatives)}")
        ranked = sorted(alternatives.items(), key=lambda item: -item[1])
        ids += [token_id for token_id, _ in ranked]
        values += [value for _, value in ranked]
    return np.asarray(ids, np.int32), np.asarray(values, np.float32)


def wire_logprob(value: float) -> float:
    """``value`` as a finite JSON number: below ``MIN_LOGPROB`` (``-inf``: a masked token) and
    NaN (logits that were not finite: no probability to report) as ``MIN_LOGPROB``, above 0
    (``+inf``; log-softmax is never positive) as 0.0. JSON has no NaN or infinities."""
    value = float(value)
    if not value >= MIN_LOGPROB:  # also NaN, which compares false
        return MIN_LOGPROB
    return min(value, 0.0)


def _token(token_bytes: bytes, value: float) -> dict[str, Any]:
    return {
        "token": token_bytes.decode("utf-8", errors="replace"),
        "logprob": wire_logprob(value),
        "bytes": list(token_bytes),
    }


def logprob_entries(
    token_bytes: Any,
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
) -> list[dict[str, Any]]:
    """OpenAI chat ``logprobs.content`` entries, one per output id.

    Each entry is ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}, ...]}``: ``bytes`` are the token's own bytes, ``token`` those bytes decoded with
    ``errors="replace"`` (as OpenAI and vLLM report a token that holds part of a character).
    Logprobs are finite JSON numbers (``wire_logprob``: ``-inf`` and NaN as ``MIN_LOGPROB``).

    Args:
        token_bytes: ``token_id -> bytes`` (``Detokenizer.logprob_token_bytes``).
        output_ids: ``[num_ids]`` the chosen token ids.
        logprobs: ``[num_ids]`` their logprobs.
        top_ids, top_logprobs: ``[num_ids * k]`` the alternatives, row-major.
    Raises:
        ValueError: lengths that do not match (``logprobs`` one per id, ``top_*`` a multiple).
    """
    num_ids = len(output_ids)
    if len(logprobs) != num_ids:
        raise ValueError(f"{len(logprobs)} logprobs for {num_ids} output ids")
    if len(top_ids) != len(top_logprobs) or (num_ids and len(top_ids) % num_ids):
        raise ValueError(
            f"{len(top_ids)} top logprob ids / {len(top_logprobs)} values for {num_ids} output ids"
        )
    k = len(top_ids) // num_ids if num_ids else 0
    entries = []
    for i, token_id in enumerate(output_ids):
        entry = _token(token_bytes(int(token_id)), logprobs[i])
        row = range(i * k, (i + 1) * k)
        entry["top_logprobs"] = [_token(token_bytes(int(top_ids[j])), top_logprobs[j]) for j in row]
        entries.append(entry)
    return entries


def prompt_logprob_entries(
    token_bytes: Any,
    prompt_ids: Sequence[int],
    logprobs: Sequence[float],
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
) -> list[dict[str, Any]]:
    """The chat-format entries of a prompt's tokens: the first (which nothing predicts) with
    ``logprob`` and ``top_logprobs`` null, then ``logprob_entries`` of the others.

    Args:
        prompt_ids: ``[P]`` the prompt; logprobs: ``[P - 1]`` those of ids 1..P-1; top_ids,
            top_logprobs: ``[(P - 1) * k]`` their alternatives, row-major.
    Raises:
        ValueError: lengths that do not match.
    """
    if not prompt_ids:
        raise ValueError("a prompt has at least one token")
    first = int(prompt_ids[0])
    head = {**_token(token_bytes(first), 0.0), "logprob": None, "top_logprobs": None}
    return [head, *logprob_entries(token_bytes, prompt_ids[1:], logprobs, top_ids, top_logprobs)]
