"""Per-request response bookkeeping: which ids a generator response carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonllm.engine.request import RequestOutput

# Ids before a response's new ids that the stateless detokenizer gets as context: enough for a
# UTF-8 character split over byte-level tokens (<= 4) plus a word boundary.
PREFIX_LEN = 8


@dataclass(slots=True)
class ResponseChunk:
    """What one generator response carries (the ``generator`` outputs of ARCHITECTURE.md).

    Built once per response and read-only after that by convention: not ``frozen``, whose
    ``__init__`` sets each of the 23 fields through ``object.__setattr__`` on the sender
    thread's GIL-bound path (BENCHMARKS.md, "Less Python per response").

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
        error_code, error_param: the request's own fault then (``RequestOutput``'s), or None.
        index: the choice (``RequestOutput.index``); sent as the ``index`` output only when
            ``with_index`` (the request has n > 1 choices).
        logprobs: with logprobs requested, one logprob per id of ``output_ids``; else None.
        top_logprobs: with logprobs requested, per id ``{token id: logprob}`` of the top
            alternatives; else None.
        num_top: top alternatives per id when logprobs were requested (the logprob outputs
            are sent), else None.
        echo_text: text this response's text starts with (the prompt, in a choice's first
            response when the client asked for it), else None.
        request_key: the generator's key of the request when it differs from the Triton
            request id (sent as output ``request_key``), else None.
        with_counts: the choice's first or final response: ``num_input_tokens`` and
            ``cached_tokens`` are sent (they never change in between).
        prompt_ids, prompt_logprobs, prompt_top_logprobs: the prompt's scores (its P ids,
            the logprobs of ids 1..P-1 and their top alternatives, ``RequestOutput``'s), in the
            choice's first chunk of a request with prompt logprobs; else None.
        prompt_num_top: the top alternatives per prompt token then (else None).
    """

    output_ids: list[int]
    prefix_ids: list[int]
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    cached_tokens: int
    final: bool
    error: str | None = None
    error_code: str | None = None
    error_param: str | None = None
    trim_chars: int = 0
    index: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    with_index: bool = False
    num_top: int | None = None
    echo_text: str | None = None
    request_key: str | None = None
    with_counts: bool = True
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    prompt_num_top: int | None = None


@dataclass
class StreamState:
    """Turns a request's (coalesced) engine outputs into response chunks.

    Args:
        stream: True: a chunk for every output with new ids and one for the finish;
            False: exactly one chunk, at the finish, carrying all output ids (and logprobs).
        index: the choice its chunks carry (one ``StreamState`` per choice).
        num_choices: the request's n (its chunks carry ``with_index`` when > 1).
        num_top: top logprobs per token, None when logprobs were not requested.
        echo_text: text the choice's first chunk starts with, or None.
        request_key: what every chunk carries as ``request_key`` (None: nothing).
        prompt_ids: the prompt, when the request scores it (its scores go out with the first
            chunk after the engine reported them); prompt_num_top: their top alternatives.
    """

    stream: bool = True
    index: int = 0
    num_choices: int = 1
    num_top: int | None = None
    echo_text: str | None = None
    request_key: str | None = None
    prompt_ids: list[int] | None = None
    prompt_num_top: int | None = None
    _scores: tuple[list[float], list[dict[int, float]]] | None = None
    _recent: list[int] = field(default_factory=list)
    _pending: list[int] = field(default_factory=list)
    _pending_logprobs: list[float] | None = None
    _pending_top: list[dict[int, float]] | None = None
    _counted: bool = False  # a chunk with the prompt's counts went out

    def on_output(self, output: RequestOutput) -> ResponseChunk | None:
        """The chunk to send for ``output`` (a ``RequestOutput``), or None if nothing is due."""
        new_ids = [int(t) for t in output.new_token_ids]
        logprobs, top = output.logprobs, output.top_logprobs
        if output.prompt_logprobs is not None:  # held for the next chunk (held ids send none)
            self._scores = (output.prompt_logprobs, output.prompt_top_logprobs or [])
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
        echo, self.echo_text = self.echo_text, None
        with_counts, self._counted = not self._counted or bool(output.finished), True
        scores, self._scores = self._scores, None
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
            error_code=output.error_code,
            error_param=output.error_param,
            index=self.index,
            logprobs=None if logprobs is None else list(logprobs),
            top_logprobs=None if top is None else list(top),
            with_index=self.num_choices > 1,
            num_top=self.num_top,
            echo_text=echo,
            request_key=self.request_key,
            with_counts=with_counts,
            prompt_ids=None if scores is None else self.prompt_ids,
            prompt_logprobs=None if scores is None else list(scores[0]),
            prompt_top_logprobs=None if scores is None else list(scores[1]),
            prompt_num_top=None if scores is None else self.prompt_num_top,
        )
