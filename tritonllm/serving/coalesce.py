"""Coalescing of engine outputs that piled up while the response sender was busy.

Triton's response path tops out near 7k responses/s through the ensemble (ARCHITECTURE.md,
"Platform facts"), well below what the engine can generate on a GPU. The
sender therefore merges every output of one request that is waiting in its queue into a single
response: one token per response when the server is idle, several under load. Outputs are keyed
by (request id, choice index), so the n choices of one request are never merged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonllm.engine.request import RequestOutput


def _joined(outputs: list[RequestOutput], field: str) -> list | None:
    """The per-token lists ``field`` of ``outputs`` joined; None only when none has one (a final
    abort output carries no ids and no logprobs even when logprobs were requested)."""
    parts = [getattr(output, field) for output in outputs]
    if all(part is None for part in parts):
        return None
    return [item for part in parts if part is not None for item in part]


def merged(outputs: list[RequestOutput]) -> RequestOutput:
    """The last of ``outputs`` (one request's choice, in engine order) with all their ids and
    logprobs, in order, and the prompt scores of the one that has them (only a choice's first
    output does).

    A shallow copy of the last output with its lists replaced, so the outputs given are left as
    they are. This runs once per response on the generator's sender thread, whose stub is
    GIL-bound under load (BENCHMARKS.md, "Less Python per response"): the copy is a
    ``__dict__`` update, not ``dataclasses.replace`` (which re-runs ``__init__`` through keyword
    arguments), and requests without logprobs join only their ids.
    """
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    out = object.__new__(type(last))
    out.__dict__.update(last.__dict__)
    ids: list[int] = []
    scored = None
    with_logprobs = False
    for output in outputs:
        ids += output.new_token_ids or ()
        if scored is None and output.prompt_logprobs is not None:
            scored = output
        if output.logprobs is not None or output.top_logprobs is not None:
            with_logprobs = True
    out.new_token_ids = ids
    if with_logprobs:
        out.logprobs = _joined(outputs, "logprobs")
        out.top_logprobs = _joined(outputs, "top_logprobs")
    if scored is not None:
        out.prompt_logprobs = scored.prompt_logprobs
        out.prompt_top_logprobs = scored.prompt_top_logprobs
    return out


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
    groups: dict[tuple[str, int], list[RequestOutput]] = {}
    for output in outputs:
        key = (output.request_id, output.index)
        group = groups.pop(key, None)
        if group is None:
            group = [output]
        elif not group[-1].finished:
            group.append(output)
        # else stale: an output after the finished one is dropped
        groups[key] = group
    return [merged(group) for group in groups.values()]
