"""Stateless, exact incremental detokenization (byte-level BPE and SentencePiece-style tokenizers).

A streamed response carries new ids plus the few ids generated just before them (``prefix_ids``).
Text is a UTF-8 decode of the concatenated token bytes (``token_bytes.py``: the id -> bytes
table of each supported decoder), and a UTF-8 decoder's only state is the at most 3 bytes of a
character still incomplete; those bytes lie in the prefix, so the decoder can be rebuilt from it
on every call and no per-request state has to live in the detokenizer. SentencePiece-style
decoders also treat the start of the text specially (the first token's ``▁``, a leading space);
a prefix shorter than the generator's window is the whole output so far, which tells whether a
call is at that start.

This replaces the usual "decode the last few tokens twice and diff the strings" trick (vLLM's
``detokenize_incrementally``) with byte arithmetic: a table id -> bytes, a bytes join and one
incremental ``codecs`` decode per call.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Any

from tritonllm.serving.stream_state import PREFIX_LEN
from tritonllm.tokenization.token_bytes import build_token_bytes

# UTF-8's longest incomplete character: a 4-byte lead byte and two continuation bytes.
MAX_PENDING_BYTES = 3


class Detokenizer:
    """Exact incremental detokenizer with no per-request state.

    Guarantee: for a sequence of ids fed in any chunking, where each call gets the chunk as
    ``new_ids`` and the up to ``prefix_window`` ids before it as ``prefix_ids`` (``final=True``
    on the last chunk), the concatenated deltas equal ``tokenizer.decode(all_ids,
    skip_special_tokens=True, clean_up_tokenization_spaces=False)`` for output that is valid
    UTF-8. It holds whenever the prefix window holds the bytes of the last incomplete character
    (always, unless 6 or more of the 8 prefix ids are special tokens right after a character
    split across tokens) and, for SentencePiece-style start rules, unless the output so far is a
    full window of special tokens. An incomplete character is held back until it completes
    (never a partial U+FFFD for valid UTF-8), and flushed as U+FFFD on the final call if it never
    does (``ByteFallback``'s ``decode`` may count the U+FFFD of invalid bytes differently). Ids
    at or beyond ``len(tokenizer)`` decode to nothing.

    Args:
        tokenizer: a Hugging Face fast tokenizer whose decoder ``build_token_bytes`` supports.
        prefix_window: the most prefix ids a call gets (the generator's ``PREFIX_LEN``).
    Raises:
        ValueError: from ``build_token_bytes`` for an unsupported tokenizer.
    """

    def __init__(self, tokenizer: Any, prefix_window: int = PREFIX_LEN) -> None:
        self._bytes = build_token_bytes(tokenizer)
        self._table = self._bytes.table
        self._vocab_size = len(self._table)
        self._special_bytes = self._bytes.special_text
        self._prefix_window = prefix_window

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        """The concatenated bytes of ``ids`` (special and unknown ids contribute nothing)."""
        table = self._table
        try:
            return b"".join([table[i] for i in ids])
        except IndexError:
            size = self._vocab_size
            return b"".join([table[i] if 0 <= i < size else b"" for i in ids])

    def logprob_token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token as logprobs report it: its own bytes, and for a special token
        its text (``b"<|im_end|>"``; decoding skips it, but an alternative must be nameable).
        Ids outside the vocabulary give ``b""``."""
        if 0 <= token_id < self._vocab_size and self._table[token_id]:
            return self._table[token_id]
        return self._special_bytes.get(token_id, b"")

    def delta(self, prefix_ids: Sequence[int], new_ids: Sequence[int], final: bool) -> str:
        """Text that ``new_ids`` add after ``prefix_ids`` (already emitted by earlier calls).

        Args:
            prefix_ids: the ids generated just before ``new_ids`` (up to 8; more are fine).
            new_ids: the ids of this response.
            final: last call for the request: flush an incomplete character as U+FFFD.
        Returns:
            The text delta (possibly ``""`` while a character is incomplete).
        """
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        before = self.token_bytes(prefix_ids)
        pending = before[-MAX_PENDING_BYTES:]
        if pending and max(pending) >= 0x80:
            decoder.decode(pending)  # rebuilds the decoder state; this text was emitted before
        if self._bytes.has_start_rule and len(prefix_ids) < self._prefix_window:
            data = self._start_bytes(prefix_ids, before, new_ids)  # the prefix is all output
        else:
            data = self.token_bytes(new_ids)
        return decoder.decode(data, final=final)

    def _start_bytes(
        self, prefix_ids: Sequence[int], before: bytes, new_ids: Sequence[int]
    ) -> bytes:
        """The bytes of ``new_ids`` when ``prefix_ids`` is the whole output before them, with the
        tokenizer's start rule applied (see ``TokenBytes``)."""
        spec = self._bytes
        if spec.first_table is not None and not any(self._counts(i) for i in prefix_ids):
            # Metaspace: the text's first token (the first one decode does not skip) is here.
            for k, token_id in enumerate(new_ids):
                if self._counts(token_id):
                    first = spec.first_table[token_id]
                    return (
                        self.token_bytes(new_ids[:k]) + first + self.token_bytes(new_ids[k + 1 :])
                    )
        data = self.token_bytes(new_ids)
        if spec.strip_spaces and before.count(b" ") == len(before) < spec.strip_spaces:
            # Strip: the text so far is spaces only, all dropped; drop the rest of the quota.
            budget = spec.strip_spaces - len(before)
            kept = data.lstrip(b" ")
            data = data[min(budget, len(data) - len(kept)) :]
        return data

    def _counts(self, token_id: int) -> bool:
        """Whether ``decode`` keeps ``token_id`` as a token (not special, in the vocabulary)."""
        return 0 <= token_id < self._vocab_size and token_id not in self._bytes.skipped

    def batch_delta(self, items: Iterable[tuple[Sequence[int], Sequence[int], bool]]) -> list[str]:
        """``delta`` of each ``(prefix_ids, new_ids, final)`` item, for a dynamic batch."""
        return [self.delta(prefix, new, final) for prefix, new, final in items]
