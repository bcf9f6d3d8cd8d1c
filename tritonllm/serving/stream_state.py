"""Per-request response bookkeeping: which ids a generator response carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonllm.engine.request import RequestOutput

# Ids before a response's new ids that the stateless detokenizer gets as context: enough for a
# UTF-8 character split over byte-level tokens (<= 4) plus a word boundary.
PREFIX_LEN = 8


@dataclass(frozen=True)
class ResponseChunk:
    """What one generator response carries (the ``generator`` outputs of ARCHITECTURE.md).

    Attributes:
        output_ids: new token ids of this response.
        prefix_ids: up to ``PREFIX_LEN`` output ids generated before them (never prompt ids,
            so the concatenated text equals ``decode(all_output_ids)``).
        finish_reason: ``""`` while running, else ``"stop"`` | ``"length"`` | ``"abort"``.
        num_input_tokens: prompt tokens.
        num_output_tokens: output tokens generated so far.
        cached_tokens: prompt tokens served from the prefix cache.
        final: the last response of the request.
        trim_chars: characters the detokenizer drops from the end of this response's text (a
            matched stop string; see ``RequestOutput.trim_chars``).
        error: the engine's message when the request failed (finish_reason ``"error"``); the
            generator answers it with a Triton error response.
        index: the choice index of a request with ``n > 1`` (the i of child ``"{id}#{i}"``).
        logprobs: with logprobs requested, one logprob per id of ``output_ids``; else None.
        top_logprobs: with logprobs requested, per id ``{token id: logprob}`` of the top
            alternatives; else None.
    """

    output_ids: list[int]
    prefix_ids: list[int]
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    cached_tokens: int
    final: bool
    error: str | None = None
    trim_chars: int = 0
    index: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class StreamState:
    """Turns a request's (coalesced) engine outputs into response chunks.

    Args:
        stream: True: a chunk for every output with new ids and one for the finish;
            False: exactly one chunk, at the finish, carrying all output ids (and logprobs).
        index: the choice index its chunks carry (one ``StreamState`` per child of ``n > 1``).
    """

    stream: bool = True
    index: int = 0
    _recent: list[int] = field(default_factory=list)
    _pending: list[int] = field(default_factory=list)
    _pending_logprobs: list[float] | None = None
    _pending_top: list[dict[int, float]] | None = None

    def on_output(self, output: RequestOutput) -> ResponseChunk | None:
        """The chunk to send for ``output`` (a ``RequestOutput``), or None if nothing is due."""
        new_ids = [int(t) for t in output.new_token_ids]
        logprobs, top = output.logprobs, output.top_logprobs
        if not self.stream:
            self._pending.extend(new_ids)
            if logprobs is not None:
                self._pending_logprobs = (self._pending_logprobs or []) + list(logprobs)
                self._pending_top = (self._pending_top or []) + list(top or [])
            if not output.finished:
                return None
            new_ids, prefix = self._pending, []
            logprobs, top = self._pending_logprobs, self._pending_top
        else:
            if not new_ids and not output.finished:
                return None
            prefix = self._recent
            self._recent = (self._recent + new_ids)[-PREFIX_LEN:]
        return ResponseChunk(
            output_ids=new_ids,
            prefix_ids=list(prefix),
            finish_reason=(output.finish_reason or "") if output.finished else "",
            num_input_tokens=int(output.num_prompt_tokens),
            num_output_tokens=int(output.num_output_tokens),
            cached_tokens=int(output.cached_tokens),
            final=bool(output.finished),
            trim_chars=int(output.trim_chars),
            error=(output.error or "request failed")
            if output.finished and output.finish_reason == "error"
            else None,
            index=self.index,
            logprobs=None if logprobs is None else list(logprobs),
            top_logprobs=None if top is None else list(top),
        )
