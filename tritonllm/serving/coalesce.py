"""Coalescing of engine outputs that piled up while the response sender was busy.

Triton's response path tops out near 7k responses/s through the ensemble (ARCHITECTURE.md,
"Platform facts"), well below what the engine can generate on a GPU. The
sender therefore merges every output of one request that is waiting in its queue into a single
response: one token per response when the server is idle, several under load. Outputs are keyed
by the engine's request id, so the n children ``"{id}#{i}"`` of one request are never merged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonllm.engine.request import RequestOutput


def _concat(first: list | None, second: list | None) -> list | None:
    """Per-token lists of two outputs joined; None only when neither has one (a final abort
    output carries no ids and no logprobs even when logprobs were requested)."""
    if first is None and second is None:
        return None
    return list(first or []) + list(second or [])


def _merged(previous: RequestOutput, output: RequestOutput) -> RequestOutput:
    """``output`` with ``previous``'s ids and logprobs in front of its own."""
    return replace(
        output,
        new_token_ids=list(previous.new_token_ids) + list(output.new_token_ids),
        logprobs=_concat(previous.logprobs, output.logprobs),
        top_logprobs=_concat(previous.top_logprobs, output.top_logprobs),
    )


def coalesce(outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
    """Merge the outputs of each request into one, keeping per-request order.

    Args:
        outputs: ``RequestOutput`` objects in the order the engine produced them.
    Returns:
        One ``RequestOutput`` per request id, in order of first appearance: its
        ``new_token_ids`` (and ``logprobs`` / ``top_logprobs``) are the concatenation of the
        merged outputs'; ``finished``, ``finish_reason`` and the token counts are those of the
        last one. Outputs that arrive after a request's finished output are dropped (stale).
    """
    merged: dict[str, RequestOutput] = {}
    for output in outputs:
        previous = merged.get(output.request_id)
        if previous is None:
            merged[output.request_id] = output
        elif not previous.finished:
            merged[output.request_id] = _merged(previous, output)
    return list(merged.values())
