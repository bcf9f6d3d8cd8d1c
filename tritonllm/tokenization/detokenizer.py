"""Stateless, exact incremental detokenization for byte-level BPE tokenizers (Qwen, Llama 3).

A streamed response carries new ids plus the few ids generated just before them (``prefix_ids``).
Text is a UTF-8 decode of the concatenated token bytes, and a UTF-8 decoder's only state is the
at most 3 bytes of a character still incomplete; those bytes lie in the prefix, so the decoder can
be rebuilt from it on every call and no per-request state has to live in the detokenizer.

This replaces the usual "decode the last few tokens twice and diff the strings" trick (vLLM's
``detokenize_incrementally``) with byte arithmetic: a table id -> bytes, a bytes join and one
incremental ``codecs`` decode per call.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

# UTF-8's longest incomplete character: a 4-byte lead byte and two continuation bytes.
MAX_PENDING_BYTES = 3


def _token_bytes(token: str, byte_decoder: dict[str, int]) -> bytes:
    """Bytes of one token string, as the ``tokenizers`` ByteLevel decoder maps it.

    Every char in the byte-level alphabet: the bytes it stands for; otherwise (an added token
    such as ``<think>`` is usually inside the alphabet, but need not be) its UTF-8 encoding.
    """
    try:
        return bytes(byte_decoder[char] for char in token)
    except KeyError:
        return token.encode("utf-8")


def build_id_to_bytes(tokenizer: Any) -> list[bytes]:
    """Table ``id -> bytes`` for every id of ``tokenizer`` (``len(tokenizer)`` entries).

    Special tokens (``tokenizer.all_special_ids`` and added tokens flagged ``special``) map to
    ``b""``: they are skipped, as ``decode(..., skip_special_tokens=True)`` does.

    Raises:
        ValueError: the tokenizer's decoder is not byte-level (e.g. SentencePiece ``▁`` tokens).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder_type = type(getattr(backend, "decoder", None)).__name__
    if decoder_type != "ByteLevel":
        raise ValueError(f"Detokenizer needs a byte-level BPE tokenizer, decoder is {decoder_type}")
    byte_decoder = {char: byte for byte, char in bytes_to_unicode().items()}
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table = [b"" if token is None else _token_bytes(token, byte_decoder) for token in tokens]
    special_ids = set(tokenizer.all_special_ids)
    special_ids.update(i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    for token_id in special_ids:
        if 0 <= token_id < len(table):
            table[token_id] = b""
    return table


def build_special_bytes(tokenizer: Any) -> dict[int, bytes]:
    """``id -> UTF-8 bytes of its text`` for the special tokens ``build_id_to_bytes`` blanks
    (e.g. ``151645 -> b"<|im_end|>"``)."""
    special = {
        int(i): str(t)
        for i, t in zip(tokenizer.all_special_ids, tokenizer.all_special_tokens, strict=False)
    }
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if added.special:
            special[int(token_id)] = added.content
    return {token_id: text.encode("utf-8") for token_id, text in special.items()}


class Detokenizer:
    """Exact incremental detokenizer with no per-request state.

    Guarantee: for a sequence of ids fed in any chunking, where each call gets the chunk as
    ``new_ids`` and the up to 8 ids before it as ``prefix_ids`` (``final=True`` on the last
    chunk), the concatenated deltas equal ``tokenizer.decode(all_ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False)``. It holds whenever the prefix window holds the bytes of
    the last incomplete character: always, unless 6 or more of the 8 prefix ids are special
    tokens (empty text) right after a character split across tokens. An incomplete character is
    held back until it completes (never a partial U+FFFD for valid UTF-8), and flushed as U+FFFD
    on the final call if it never does. Ids at or beyond ``len(tokenizer)`` decode to nothing.

    Args:
        tokenizer: a Hugging Face fast tokenizer with a byte-level decoder.
    Raises:
        ValueError: from ``build_id_to_bytes`` for a non-byte-level tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._table = build_id_to_bytes(tokenizer)
        self._vocab_size = len(self._table)
        self._special_bytes = build_special_bytes(tokenizer)

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
        pending = self.token_bytes(prefix_ids)[-MAX_PENDING_BYTES:]
        if pending and max(pending) >= 0x80:
            decoder.decode(pending)  # rebuilds the decoder state; this text was emitted before
        return decoder.decode(self.token_bytes(new_ids), final=final)

    def batch_delta(self, items: Iterable[tuple[Sequence[int], Sequence[int], bool]]) -> list[str]:
        """``delta`` of each ``(prefix_ids, new_ids, final)`` item, for a dynamic batch."""
        return [self.delta(prefix, new, final) for prefix, new, final in items]
