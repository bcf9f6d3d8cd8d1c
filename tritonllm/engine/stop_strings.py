"""OpenAI ``stop`` strings over a stream of token ids: hold back, detect, trim.

Semantics (OpenAI): the output text ends just before the first stop string; no part of a stop
string is ever sent, not even while streaming; generation ends at once with finish_reason
``"stop"``. The pipeline carries ids, not text (generator -> ids -> stateless detokenizer ->
text), so a ``StopStringChecker`` per request decides which ids may travel on:

* It keeps its own incremental decode of the output: the ``Detokenizer`` id -> bytes table and an
  incremental UTF-8 decoder. A character belongs to the token whose bytes complete it (exactly
  what ``Detokenizer.delta`` emits); a token that only starts a character, or a special token,
  has no text. Per token the work is O(max stop length + token length): only the new text plus
  the ``max(len(stop)) - 1`` characters before it are searched.
* Hold back: ids whose text overlaps the longest suffix of the text so far that is a proper
  prefix of some stop string stay with the checker (a token straddling that point is held
  whole); the rest are released. Released text is therefore always a prefix of the final answer.
* Decision rule: after each token (ids are processed one by one, so the chunking of ``process``
  calls never matters), if any stop string now occurs in the text, the request stops at the
  earliest position where any stop string occurs. A shorter stop string that completes in an
  earlier token than a longer one starting before it wins (it is the only match at that time);
  when both are complete after the same token, the earlier-starting one wins.

Contract for the downstream (generator + Triton detokenizer):

1. Send ``result.release_ids`` as the next output ids, as usual (the detokenizer's prefix ids
   are the ids released before them).
2. When ``result.stopped``: that response is the final one (finish_reason ``"stop"``, decoded
   with ``final=True``), and its text is ``apply_trim(delta, result.trim_chars)``: the delta
   holds the text before the stop string plus the text from the stop string's start to the end of
   the released ids (including the U+FFFD that ``final=True`` flushes for a character left
   incomplete by the last released id); dropping ``trim_chars`` characters from its end leaves
   exactly the text before the stop string. Ids after the token where the match starts are never
   released; ``num_output_tokens`` still counts them (every id generated).
3. When the request ends otherwise (EOS, stop id, length, abort), send ``checker.flush()`` with
   the final response: the held ids, untrimmed.

The hold-back/trim approach follows vLLM's and TGI's stop-sequence handling (which work on
detokenized text); here the decisions are mapped back onto token ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tritonllm.tokenization.detokenizer import Detokenizer

if TYPE_CHECKING:  # request.py imports this module
    from tritonllm.engine.request import Request


@dataclass
class StopResult:
    """What ``StopStringChecker.process`` decided for one engine step of one request.

    Attributes:
        release_ids: ids now safe to send downstream, in generation order.
        trim_chars: characters (Python ``str`` code points) to drop from the end of the final
            delta text of ``release_ids``; 0 unless ``stopped``.
        stopped: a stop string matched; the request must finish with finish_reason ``"stop"``.
    """

    release_ids: list[int] = field(default_factory=list)
    trim_chars: int = 0
    stopped: bool = False


@dataclass
class _HeldToken:
    token_id: int
    char_end: int  # characters of output text once this token is decoded (absolute)
    pending: bytes  # bytes of an incomplete character after this token
    has_text: bool  # it completes at least one character


def apply_trim(text: str, trim_chars: int) -> str:
    """``text`` without its last ``trim_chars`` characters (all of it when ``trim_chars`` is
    larger; unchanged when it is 0).

    Raises:
        ValueError: ``trim_chars`` is negative.
    """
    if trim_chars < 0:
        raise ValueError(f"trim_chars must be >= 0, got {trim_chars}")
    return text[: max(0, len(text) - trim_chars)] if trim_chars else text


class StopStringChecker:
    """Per-request stop-string matcher over sampled token ids (see the module docstring).

    Args:
        detokenizer: the shared ``Detokenizer`` (only its id -> bytes table is used).
        stop: the request's stop strings; empty strings are ignored, and with none left every
            id is released at once.
    """

    def __init__(self, detokenizer: Detokenizer, stop: Sequence[str]) -> None:
        self._detok = detokenizer
        self._stops = tuple(dict.fromkeys(s for s in stop if s))  # dedupe, keep order
        self._window = max((len(s) for s in self._stops), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_chars = 0  # characters of output text decoded so far
        self._tail = ""  # the last `_window` characters of that text
        self._held: list[_HeldToken] = []
        self._finished = False

    @property
    def stops(self) -> tuple[str, ...]:
        """The non-empty stop strings checked, deduplicated."""
        return self._stops

    @property
    def num_held(self) -> int:
        """Ids received but not yet released."""
        return len(self._held)

    def process(self, new_ids: Sequence[int]) -> StopResult:
        """Consume the ids sampled for this request in one engine step.

        Args:
            new_ids: the newly sampled ids (any number, possibly none).
        Returns:
            The ids to release now; on a match, ``stopped=True`` and the trim to apply.
        Raises:
            RuntimeError: called after the checker stopped or was flushed.
        """
        if self._finished:
            raise RuntimeError("StopStringChecker used after it stopped or was flushed")
        if not self._stops:
            return StopResult(list(new_ids))
        for token_id in new_ids:
            text = self._decoder.decode(self._detok.token_bytes((token_id,)))
            start = self._num_chars - len(self._tail)  # absolute position of _tail[0]
            self._num_chars += len(text)
            pending = self._decoder.getstate()[0]
            self._held.append(_HeldToken(token_id, self._num_chars, pending, bool(text)))
            if not text:
                continue
            searched = self._tail + text
            match = self._earliest_match(searched, len(self._tail))
            if match >= 0:
                return self._stop_at(start + match)
            self._tail = searched[max(0, len(searched) - self._window) :] if self._window else ""
        return StopResult(self._release_before(self._hold_point()))

    def flush(self) -> list[int]:
        """Release every held id (the request ended for another reason: EOS, length, abort).

        Later ``process`` calls raise; a second ``flush`` returns ``[]``.
        """
        self._finished = True
        ids = [held.token_id for held in self._held]
        self._held.clear()
        return ids

    def _earliest_match(self, searched: str, new_start: int) -> int:
        """Index in ``searched`` of the earliest stop string ending past ``new_start``, or -1."""
        best = -1
        for stop in self._stops:
            # A match ending in the new text starts at or after new_start - len(stop) + 1;
            # earlier matches would have stopped the request already.
            pos = searched.find(stop, max(0, new_start - len(stop) + 1))
            if pos >= 0 and (best < 0 or pos < best):
                best = pos
        return best

    def _hold_point(self) -> int:
        """Absolute start of the longest text suffix that is a proper prefix of a stop string
        (the text length when there is none)."""
        tail = self._tail
        start = self._num_chars - len(tail)
        for i in range(len(tail)):
            suffix = tail[i:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return start + i
        return self._num_chars

    def _release_before(self, hold_point: int) -> list[int]:
        """Release the held ids whose text ends at or before ``hold_point``."""
        held = self._held
        count = 0
        while count < len(held) and held[count].char_end <= hold_point:
            count += 1
        # Ids that only begin a character (no text, bytes pending) wait for the id that
        # completes it: should that character start a stop string, they lie wholly after the
        # cut, and such ids get no logprobs entry (serving/text_outputs.py).
        while count and held[count - 1].pending and not held[count - 1].has_text:
            count -= 1
        released = [h.token_id for h in held[:count]]
        del held[:count]
        return released

    def _stop_at(self, match_start: int) -> StopResult:
        """Release up to the token holding character ``match_start``; compute the trim."""
        count = 0
        while self._held[count].char_end <= match_start:
            count += 1
        last = self._held[count]
        # `final=True` downstream turns an incomplete trailing character into U+FFFD.
        flushed = len(last.pending.decode("utf-8", errors="replace"))
        trim = last.char_end - match_start + flushed
        released = [held.token_id for held in self._held[: count + 1]]
        self._held.clear()
        self._finished = True
        return StopResult(released, trim, stopped=True)


def check_stop_strings(
    req: Request,
    checker: StopStringChecker,
    token: int,
    reason: str | None,
    lp: list[float] | None,
    top: list[dict[int, float]] | None,
) -> tuple[list[int], int, bool, list[float] | None, list[dict[int, float]] | None]:
    """Run the stop-string checker of `req` (`checker`) on its new token (the engine's step).

    Returns (released ids, trim chars, stopped, logprobs, top logprobs) for this step's
    output; a request that ends for another reason (`reason`) releases what was held. The
    logprobs of held ids wait in `req.held_logprobs` and are released with their ids, so
    an output's logprobs always align 1:1 with its `new_token_ids`.
    """
    result = checker.process([token])
    released = list(result.release_ids)
    if not result.stopped and reason is not None:
        released += checker.flush()
    if lp is not None and top is not None:  # logprobs come with their top alternatives
        # The checker releases its oldest held ids first; `token` is the newest.
        held = req.held_logprobs
        held.append((lp[0], top[0]))
        count = len(released)
        lp = [value for value, _ in held[:count]]
        top = [alternatives for _, alternatives in held[:count]]
        del held[:count]
    return released, result.trim_chars, result.stopped, lp, top
