"""Token logprobs in the two OpenAI formats.

The backend (the ``llm`` ensemble's ``logprobs_json``) already sends the chat format: per token
``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}``. Chat
responses wrap those entries as ``{"content": [...]}``; the legacy completions format is derived
here (the same mapping vLLM's OpenAI server uses). Every logprob the sidecar sends is a finite
number (``backend_entries``): JSON has no NaN or infinities, and clients' parsers refuse them.
"""

from __future__ import annotations

import json
from typing import Any

from tritonllm.contract.limits import MIN_LOGPROB

# The backend sends finite logprobs (tritonllm.serving.logprobs.wire_logprob); should a value
# still arrive as one of the constants Python's json reads (and would write back out), it is
# read as that function maps it.
_NON_FINITE = {"NaN": MIN_LOGPROB, "-Infinity": MIN_LOGPROB, "Infinity": 0.0}


def backend_entries(text: str) -> list[dict[str, Any]]:
    """The chat-format entries of the backend's ``logprobs_json`` / ``prompt_logprobs_json``.

    ``NaN`` and ``-Infinity`` are read as ``MIN_LOGPROB``, ``Infinity`` as 0.0, so no response
    or chunk built from them holds a number JSON cannot carry.

    Raises:
        ValueError: (``json.JSONDecodeError``) ``text`` is not JSON.
    """
    entries: list[dict[str, Any]] = json.loads(text, parse_constant=_NON_FINITE.__getitem__)
    return entries


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """``choices[i].logprobs`` of a chat response or chunk (None when not asked for)."""
    return None if entries is None else {"content": entries}


def completion_logprobs(
    entries: list[dict[str, Any]] | None, text_offset: int = 0
) -> tuple[dict[str, Any] | None, int]:
    """``choices[i].logprobs`` of a text completion or chunk, and the next token's offset.

    Args:
        entries: chat-format entries of consecutive tokens of one choice (None: not asked for).
        text_offset: the offset of the first of them (characters of the token texts before).
    Returns:
        ``({"tokens", "token_logprobs", "top_logprobs", "text_offset"}, offset after the last
        token)``; ``top_logprobs`` holds per token the alternatives plus the chosen token
        (OpenAI: "up to logprobs + 1 elements"); tokens with the same text keep the first.
        An entry without a logprob (an echoed prompt's first token, which nothing predicts)
        has ``token_logprobs`` and ``top_logprobs`` null, as OpenAI answers with ``echo``.
    """
    if entries is None:
        return None, text_offset
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        tokens.append(entry["token"])
        values.append(entry["logprob"])
        offsets.append(text_offset)
        text_offset += len(entry["token"])
        if entry["logprob"] is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for alternative in entry["top_logprobs"]:
            top.setdefault(alternative["token"], alternative["logprob"])
        top.setdefault(entry["token"], entry["logprob"])
        tops.append(top)
    result = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}
    result["text_offset"] = offsets
    return result, text_offset
