"""`RequestLimits`: the engine facts that decide whether a request fits, without the engine.

`LLMEngine` validates each request against its vocabulary, context limit and KV pool; an
`EngineProcess` must refuse a bad request synchronously in the parent process, where there is
no engine. The child sends these facts once at start-up and the parent validates with the same
code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tritonllm.contract import limits
from tritonllm.contract.errors import ErrorCode, RequestError
from tritonllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of an engine (picklable, immutable).

    Attributes:
        vocab_size: prompt token ids must be in [0, vocab_size).
        max_model_len: prompt + output limit per request (tokens).
        page_size: tokens per KV page.
        num_usable_pages: KV pages a request can hold at most (the whole pool less page 0).
        max_request_output_tokens: output tokens of all of a request's choices together
            (``n * max_tokens``; ``contract.limits.MAX_REQUEST_OUTPUT_TOKENS``).
    """

    vocab_size: int
    max_model_len: int
    page_size: int
    num_usable_pages: int
    max_request_output_tokens: int = limits.MAX_REQUEST_OUTPUT_TOKENS

    @classmethod
    def of(cls, engine: Any) -> RequestLimits:
        """The limits of a built `LLMEngine`."""
        return cls(
            vocab_size=engine.model_config.vocab_size,
            max_model_len=engine.max_model_len,
            page_size=engine.config.page_size,
            num_usable_pages=engine.cache.num_usable_pages,
        )

    def check(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate a request against these limits (`params` are valid already: a
        `SamplingParams` is validated when built); return its output limit in tokens per
        choice: `params.max_tokens`, or for None as many as fit in max_model_len and in the
        whole KV pool, and at most `max_request_output_tokens // params.n`.

        Raises:
            RequestError: an empty prompt, prompt, stop, allowed or logit_bias token ids
                outside the vocabulary, or `n * max_tokens` over `max_request_output_tokens`
                (``invalid_value``), prompt + max_tokens over max_model_len or more KV pages
                than the pool has (``context_length_exceeded``).
        """
        vocab = self.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:  # a stop id the model cannot produce is a client mistake, not a no-op
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                "stop_token_ids",
                f"stop_token_ids must be in [0, {vocab}), got {bad[:5]}",
            )
        allowed = params.allowed_token_ids or ()
        bad = [t for t in allowed if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                "allowed_token_ids",
                f"allowed_token_ids must be in [0, {vocab}), got {bad[:5]}",
            )
        bad = [t for t, _ in params.logit_bias if not t < vocab]
        if bad:
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                "logit_bias",
                f"logit_bias token ids must be in [0, {vocab}), got {bad[:5]}",
            )
        return self.max_tokens(prompt_ids, params)

    def max_tokens(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's output limit in tokens (see `check`, which also checks the stop
        token ids). Raises RequestError as `check`."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError(
                ErrorCode.INVALID_VALUE, "prompt", "prompt must contain at least one token"
            )
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                "prompt",
                f"prompt token ids must be in [0, {vocab}), got {bad[:5]}",
            )
        # The last sampled token is never fed back, so its K/V never needs a slot: a sequence
        # of `total` tokens needs ceil((total - 1) / page_size) pages.
        pool_tokens = self.num_usable_pages * self.page_size + 1
        per_choice = self.max_request_output_tokens // params.n
        if params.max_tokens is None:
            room = min(self.max_model_len, pool_tokens) - n
            if room < 1:
                raise _too_long(
                    f"prompt ({n} tokens) leaves no room for output: max_model_len is "
                    f"{self.max_model_len}, the KV cache holds {pool_tokens - 1} tokens"
                )
            return min(room, per_choice)
        total = n + params.max_tokens
        if total > self.max_model_len:
            raise _too_long(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        pages = math.ceil((total - 1) / self.page_size)
        if pages > self.num_usable_pages:
            raise _too_long(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} tokens exceeds "
                f"the KV cache's capacity: it needs {pages} KV pages of {self.page_size} tokens; "
                f"the cache has {self.num_usable_pages}"
            )
        if params.max_tokens > per_choice:
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                "max_tokens",
                f"n ({params.n}) x max_tokens ({params.max_tokens}) exceeds the limit of "
                f"{self.max_request_output_tokens} output tokens per request",
            )
        return params.max_tokens


def _too_long(message: str) -> RequestError:
    return RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt", message)
