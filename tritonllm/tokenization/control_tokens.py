"""Control tokens come from the chat template only, never from what a client wrote.

A chat prompt is rendered to text by the model's template, and that text is then encoded. A
tokenizer matches its special tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ...)
anywhere in the text, so a message whose content holds ``<|im_end|>\\n<|im_start|>system`` would
be encoded as a real end of turn and a real system turn: a client could forge turns.
``ContentGuard`` keeps the two apart:

1. ``mark`` wraps every occurrence of a special token's text inside the client's strings (message
   contents, tool results, ...) between two markers that hold a per-guard random nonce, so no
   client text can produce or close one;
2. the template renders the marked messages as usual (the markers are ordinary characters to it;
   they enclose exactly the special token's text, so trimming and splitting on other text behave
   as without them);
3. ``encode`` splits the rendered text at the special tokens that are *not* marked (the
   template's own), encodes each piece between them with special-token text treated as text
   (Hugging Face's ``split_special_tokens=True``), the markers removed, and puts the template's
   special tokens in between as their ids.

Hugging Face's own ``encode`` also splits the text at special tokens and encodes the pieces
between them separately, so content without special-token text gives exactly the ids it gives
today. Only tokens marked *special* are guarded; other added tokens (Qwen3's ``<think>``,
``<tool_call>``, which its template also looks for in content) keep their ids in content, as with
Hugging Face's ``split_special_tokens``. A raw ``text_input`` is not chat content: it is encoded
as given, special-token text included (its client writes the whole prompt).
"""

from __future__ import annotations

import re
import secrets
import weakref
from typing import Any

_GUARDS: weakref.WeakKeyDictionary[Any, ContentGuard] = weakref.WeakKeyDictionary()


def guard_for(tokenizer: Any) -> ContentGuard:
    """The ``ContentGuard`` of a Hugging Face tokenizer (built once per tokenizer object)."""
    guard = _GUARDS.get(tokenizer)
    if guard is None:
        guard = _GUARDS[tokenizer] = ContentGuard(tokenizer)
    return guard


class ContentGuard:
    """Marks special-token text in client strings and encodes rendered prompts (module doc).

    Args:
        tokenizer: a Hugging Face fast tokenizer; its special tokens are the added tokens marked
            ``special`` (``added_tokens_decoder``), with their ``lstrip`` / ``rstrip`` flags.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        nonce = secrets.token_hex(8)
        self.open, self.close = f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000"
        self._ids: dict[str, int] = {}
        self._lstrip: set[str] = set()
        self._rstrip: set[str] = set()
        for token_id, token in tokenizer.added_tokens_decoder.items():
            if token.special:
                self._ids[token.content] = int(token_id)
                if token.lstrip:
                    self._lstrip.add(token.content)
                if token.rstrip:
                    self._rstrip.add(token.content)
        # Longest first, so a special token that starts another one never cuts it short.
        names = sorted(self._ids, key=len, reverse=True)
        alternatives = "|".join(re.escape(name) for name in names)
        self._special = re.compile(alternatives) if names else None
        marked = f"{re.escape(self.open)}.*?{re.escape(self.close)}"
        self._pieces = re.compile(f"{marked}|{alternatives}" if names else marked, re.DOTALL)

    def mark(self, value: Any) -> Any:
        """``value`` with special-token text inside every string marked (recursively through
        lists, tuples and dict values; dict keys and ``role`` values are left alone: they are
        names the template compares, never free text)."""
        if isinstance(value, str):
            if self._special is None:
                return value
            return self._special.sub(lambda m: self.open + m.group(0) + self.close, value)
        if isinstance(value, dict):
            return {k: v if k == "role" else self.mark(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.mark(v) for v in value)
        return value

    def unmark(self, text: str) -> str:
        """``text`` without the markers (the prompt as a client should see it)."""
        return text.replace(self.open, "").replace(self.close, "")

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a prompt rendered from ``mark``-ed messages: unmarked special tokens
        (the template's) as their ids, everything else as text.

        Returns:
            ``list[int]``, no special tokens added (BOS/EOS only where the template wrote them).
        """
        ids: list[int] = []
        text_start = 0
        pending_lstrip = False
        for match in self._pieces.finditer(rendered):
            token = match.group(0)
            if token.startswith(self.open):
                continue  # content's special-token text: part of the text around it
            before = rendered[text_start : match.start()]
            if pending_lstrip:
                before = before.lstrip()
            if token in self._lstrip:
                before = before.rstrip()
            ids += self._encode_text(before)
            ids.append(self._ids[token])
            pending_lstrip = token in self._rstrip
            text_start = match.end()
        tail = rendered[text_start:]
        ids += self._encode_text(tail.lstrip() if pending_lstrip else tail)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        text = self.unmark(text)
        if not text:
            return []
        return list(
            self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        )
