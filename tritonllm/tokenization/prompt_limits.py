"""How long a prompt can be before it is tokenized: characters against the context.

Tokenizing costs CPU time in proportion to the text (seconds for megabytes), and a prompt that
cannot fit the context is refused only after it. A prompt of ``c`` characters encodes to at
least ``c / k`` tokens, where ``k`` bounds the characters one token can cover, so one longer
than ``max_model_len * k`` characters can never fit and is refused (``context_length_exceeded``)
before any tokenizing: by the ``tokenizer`` model, and by the sidecar before it sends anything.

``k`` is read off the tokenizer: the longest token of its vocabulary (added tokens included), in
characters of its vocabulary string (for byte-level BPE one character per byte, so at least the
characters it decodes to), times ``NORMALIZER_FACTOR`` when the tokenizer normalizes its input
first (Unicode composition, NFC/NFKC, can merge up to three code points into one, as Hangul
jamo into a syllable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tritonllm.contract.errors import ErrorCode, RequestError

NORMALIZER_FACTOR = 4


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of a Hugging Face fast tokenizer can stand for (module
    doc): its longest vocabulary string, times ``NORMALIZER_FACTOR`` with a normalizer."""
    backend = tokenizer.backend_tokenizer
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
    return longest * (NORMALIZER_FACTOR if backend.normalizer is not None else 1)


@dataclass(frozen=True)
class PromptLimits:
    """The limits a prompt is checked against before tokenizing.

    Attributes:
        max_model_len: prompt + output tokens per request.
        max_token_chars: characters one token can stand for at most (``max_token_chars``).
    """

    max_model_len: int
    max_token_chars: int

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which no prompt fits the context."""
        return self.max_model_len * self.max_token_chars

    def check_chars(self, num_chars: int, param: str) -> None:
        """Raises: RequestError (``context_length_exceeded``, ``param``) when ``num_chars``
        characters cannot fit the context, whatever they hold."""
        if num_chars > self.max_prompt_chars:
            raise RequestError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                param,
                f"the prompt has {num_chars} characters: more than the {self.max_model_len}-token "
                f"context can hold at {self.max_token_chars} characters per token at most",
            )
