"""How a tokenizer's ids become text bytes: the table behind the stateless detokenizer.

A Hugging Face fast tokenizer decodes by mapping tokens to strings and running its decoder chain
(``tokenizer.json`` ``"decoder"``). For the decoders below that chain is, exactly, a per-id byte
string plus at most one rule for the start of the text, so decoding ``ids`` is a bytes join and
one UTF-8 decode:

- ``ByteLevel`` (GPT-2, Qwen, Llama 3, SmolLM2): every character of a token stands for one byte
  (GPT-2's ``bytes_to_unicode`` alphabet); no start rule.
- ``Metaspace`` (SentencePiece-style, e.g. T5, newer Llama-2 conversions): ``▁`` is a space; with
  a prepend scheme other than ``never`` the first token of the text loses all its ``▁``
  (``tokenizers``' ``Metaspace::decode_chain`` does exactly that, not just one leading space).
- ``Sequence`` of ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``, ``Strip(" ", n, 0)``
  (Llama 2, Mistral, Gemma): ``<0xNN>`` tokens are the byte NN, ``▁`` a space, and once the text
  is fused, up to n leading spaces are dropped.

Any other decoder (WordPiece, CTC, BPE suffixes, ...) is refused with a ``ValueError`` naming
it, since the byte arithmetic would not reproduce its ``decode``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPIECE_SPACE = "\u2581"  # ▁, SentencePiece's word-boundary mark
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenBytes:
    """The bytes of every id of one tokenizer, and its rule for the start of a text.

    Attributes:
        table: ``id -> bytes`` for ids ``0 .. len(tokenizer) - 1``; skipped ids give ``b""``.
        skipped: ids that ``decode(..., skip_special_tokens=True)`` drops (special tokens).
        first_table: Metaspace only: the bytes of an id when it is the text's first (non-skipped)
            token; None when the first token decodes as any other.
        strip_spaces: spaces dropped from the very start of the text (``Strip`` decoder), 0 if none.
        special_text: ``id -> UTF-8 text`` of the skipped ids (``b"<|im_end|>"``), for logprobs.
    """

    table: list[bytes]
    skipped: frozenset[int]
    first_table: list[bytes] | None
    strip_spaces: int
    special_text: dict[int, bytes]

    @property
    def has_start_rule(self) -> bool:
        """Whether the first token or the first characters of a text decode differently."""
        return self.first_table is not None or self.strip_spaces > 0


def _decoder_json(tokenizer: Any) -> dict | None:
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"detokenizer: needs a Hugging Face fast tokenizer (a tokenizer.json), "
            f"got {type(tokenizer).__name__}"
        )
    return json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")


def _byte_level(tokens: list[str | None]) -> list[bytes]:
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    table = []
    for token in tokens:
        if token is None:
            table.append(b"")
            continue
        try:
            table.append(bytes(byte_of[char] for char in token))
        except KeyError:  # an added token outside the byte alphabet: its own UTF-8 text
            table.append(token.encode("utf-8"))
    return table


def _replace_then_bytes(tokens: list[str | None], space: str, byte_fallback: bool) -> list[bytes]:
    table = []
    for token in tokens:
        if token is None:
            table.append(b"")
            continue
        match = _BYTE_FALLBACK.fullmatch(token) if byte_fallback else None
        if match:
            table.append(bytes([int(match.group(1), 16)]))
        else:
            table.append(token.replace(space, " ").encode("utf-8"))
    return table


def _sentencepiece_sequence(steps: list[dict], tokens: list[str | None]) -> tuple[list[bytes], int]:
    """The table and leading-space strip of a Llama-2-style decoder sequence (see module doc).

    Raises:
        ValueError: a step outside ``Replace(▁, " ")``, ``ByteFallback``, ``Fuse``, ``Strip``,
            or a ``Strip`` before ``Fuse`` (it would strip every token).
    """
    kinds = [step.get("type") for step in steps]
    strip, fused, byte_fallback, space = 0, False, False, None
    for step, kind in zip(steps, kinds, strict=True):
        if kind == "Replace" and step.get("content") == " ":
            space = (step.get("pattern") or {}).get("String")
            if space is None:
                raise ValueError("detokenizer: a Replace decoder with a regex is not supported")
        elif kind == "ByteFallback":
            byte_fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and step.get("content") == " " and not step.get("stop"):
            strip = int(step.get("start", 0))
        else:
            raise ValueError(f"detokenizer: unsupported decoder sequence {kinds}")
    return _replace_then_bytes(tokens, space or SPIECE_SPACE, byte_fallback), strip


def _special_ids(tokenizer: Any) -> dict[int, str]:
    special = {
        int(i): str(t)
        for i, t in zip(tokenizer.all_special_ids, tokenizer.all_special_tokens, strict=False)
    }
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if added.special:
            special[int(token_id)] = added.content
    return special


def build_token_bytes(tokenizer: Any) -> TokenBytes:
    """The ``TokenBytes`` of a Hugging Face fast tokenizer (``len(tokenizer)`` ids).

    Special tokens (``all_special_ids`` and added tokens flagged ``special``) map to ``b""``:
    they are skipped, as ``decode(..., skip_special_tokens=True)`` does.

    Raises:
        ValueError: not a fast tokenizer, or a decoder other than the ones in the module doc.
    """
    decoder = _decoder_json(tokenizer) or {}
    kind = decoder.get("type")
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    first_table, strip = None, 0
    if kind == "ByteLevel":
        table = _byte_level(tokens)
    elif kind == "Metaspace":
        space = decoder.get("replacement", SPIECE_SPACE)
        table = _replace_then_bytes(tokens, space, byte_fallback=False)
        prepend = decoder.get("prepend_scheme", "always" if decoder.get("add_prefix_space") else "")
        if prepend in ("always", "first"):
            first_table = [b"" if t is None else t.replace(space, "").encode() for t in tokens]
    elif kind == "Sequence":
        table, strip = _sentencepiece_sequence(decoder.get("decoders") or [], tokens)
    else:
        raise ValueError(
            f"detokenizer: tokenizer decoder {kind or 'none'!r} is not supported "
            "(ByteLevel, Metaspace, or SentencePiece's Replace/ByteFallback/Fuse/Strip sequence)"
        )
    special = _special_ids(tokenizer)
    for token_id in special:
        if 0 <= token_id < len(table):
            table[token_id] = b""
            if first_table is not None:
                first_table[token_id] = b""
    return TokenBytes(
        table=table,
        skipped=frozenset(special),
        first_table=first_table,
        strip_spaces=strip,
        special_text={i: text.encode("utf-8") for i, text in special.items()},
    )
