"""Coalescing of engine outputs that piled up while the response sender was busy.

Triton's response path tops out near 7k responses/s through the ensemble (DESIGN.md, "The
Triton response path has a ceiling"), well below what the engine can generate on a GPU. The
sender therefore merges every output of one request that is waiting in its queue into a single
response: one token per response when the server is idle, several under load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import is_dataclass, replace
from typing import Any


def _with_ids(output: Any, token_ids: list[int]) -> Any:
    """A copy of ``output`` (dataclass or NamedTuple ``RequestOutput``) with new token ids."""
    if is_dataclass(output):
        return replace(output, new_token_ids=token_ids)
    return output._replace(new_token_ids=token_ids)


def coalesce(outputs: Iterable[Any]) -> list[Any]:
    """Merge the outputs of each request into one, keeping per-request order.

    Args:
        outputs: ``RequestOutput`` objects in the order the engine produced them.
    Returns:
        One ``RequestOutput`` per request id, in order of first appearance: its
        ``new_token_ids`` are the concatenation of the merged outputs' ids; ``finished``,
        ``finish_reason`` and the token counts are those of the last one. Outputs that arrive
        after a request's finished output are dropped (they are stale).
    """
    merged: dict[str, Any] = {}
    for output in outputs:
        previous = merged.get(output.request_id)
        if previous is None:
            merged[output.request_id] = output
        elif not previous.finished:
            ids = list(previous.new_token_ids) + list(output.new_token_ids)
            merged[output.request_id] = _with_ids(output, ids)
    return list(merged.values())
