"""Coalescing of engine outputs that piled up while the response sender was busy.

Triton's response path tops out near 7k responses/s through the ensemble (ARCHITECTURE.md,
"Platform facts"), well below what the engine can generate on a GPU. The
sender therefore merges every output of one request that is waiting in its queue into a single
response: one token per response when the server is idle, several under load. Outputs are keyed
by (request id, choice index), so the n choices of one request are never merged.
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
    """``output`` with ``previous``'s ids and logprobs in front of its own (and its prompt
    scores, which only a choice's first output carries)."""
    first = previous if previous.prompt_logprobs is not None else output
    return replace(
        output,
        new_token_ids=list(previous.new_token_ids) + list(output.new_token_ids),
        logprobs=_concat(previous.logprobs, output.logprobs),
        top_logprobs=_concat(previous.top_logprobs, output.top_logprobs),
        prompt_logprobs=first.prompt_logprobs,
        prompt_top_logprobs=first.prompt_top_logprobs,
    )


def coalesce(outputs: Iterable[RequestOutput]) -> list[RequestOutput]:
    """Merge the outputs of each request into one, keeping per-request order.

    Args:
        outputs: ``RequestOutput`` objects in the order the engine produced them.
    Returns:
        One ``RequestOutput`` per (request id, index), in the order of the last output merged
        into each (so the output that ends a request, ``request_finished``, stays behind every
        other output of that request's choices): its
        ``new_token_ids`` (and ``logprobs`` / ``top_logprobs``) are the concatenation of the
        merged outputs'; ``finished``, ``finish_reason`` and the token counts are those of the
        last one, the prompt scores those of the one that had them. Outputs that arrive after a
        request's finished output are dropped (stale).
    """
    merged: dict[tuple[str, int], RequestOutput] = {}
    for output in outputs:
        key = (output.request_id, output.index)
        previous = merged.pop(key, None)
        if previous is None:
            merged[key] = output
        elif not previous.finished:
            merged[key] = _merged(previous, output)
        else:
            merged[key] = previous  # stale: an output after the finished one is dropped
    return list(merged.values())
