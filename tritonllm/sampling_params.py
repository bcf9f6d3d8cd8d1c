"""`SamplingParams`: per-request generation settings, with OpenAI / vLLM semantics.

A `SamplingParams` is validated when it is built (against `tritonllm.contract.limits`), so one
that exists is valid: the layers after the trust boundary that built it never check it again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tritonllm.contract import limits
from tritonllm.contract.errors import ErrorCode, RequestError, short_repr
from tritonllm.structured.spec import StructuredOutputs

# Kept for callers that import them from here; the values live in the contract.
MAX_LOGPROBS = limits.MAX_LOGPROBS
MAX_N = limits.MAX_N
MAX_STOP_STRINGS = limits.MAX_STOP_STRINGS
MAX_STOP_STRING_CHARS = limits.MAX_STOP_STRING_CHARS

# (token id, bias) pairs of `SamplingParams.logit_bias`, ascending by id.
LogitBias = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (validated on construction).

    Attributes:
        max_tokens: most new tokens (>= 1); None (the default): until EOS, a stop condition or
            the context limit (the engine resolves it per request); 0: none at all, the request
            only prefills (to score its prompt with `prompt_logprobs`, or to echo it).
        temperature: in [0, 2]; 0 means greedy (argmax). A temperature below
            ``limits.GREEDY_TEMPERATURE_EPS`` (1e-5, vLLM's) is stored as 0.0: the request is
            greedy in every way (tokens, seed, logprobs at temperature 1), as dividing logits
            by it would overflow float32 to inf and sample from NaN.
        top_p: nucleus sampling, in [0, 1] (OpenAI's range); 1 disables it. 0, the limit
            p -> 0 that keeps only the most likely token, is stored as what it means:
            ``top_p=1.0, top_k=1`` (the samplers see top_k = 1, whatever top_k was given).
        top_k: keep the k most likely tokens; -1 (or 0) disables it, else >= 1.
        min_p: drop tokens with probability < min_p * max probability, in [0, 1]; 0 disables.
        seed: per-request seed (int64): the same seed and inputs give the same tokens
            regardless of which other requests share the batch. None uses the engine's
            generator. Choice i of an n > 1 request samples with seed + i.
        stop: stop strings (OpenAI semantics): the output text ends just before the first
            occurrence of any of them, no part of one is ever streamed, and the request finishes
            with "stop". At most MAX_STOP_STRINGS, each 1..MAX_STOP_STRING_CHARS characters.
            Applied from the first generated token (min_tokens does not delay them).
        stop_token_ids: extra token ids that finish the request ("stop"); the stop token is
            included in the output ids.
        ignore_eos: keep generating past the model's EOS ids.
        min_tokens: EOS and stop ids are masked until this many tokens were generated.
        presence_penalty, frequency_penalty: OpenAI penalties in [-2, 2], applied to logits of
            tokens already generated (not the prompt): `logit -= freq * count + presence`.
        repetition_penalty: > 0; vLLM/CTRL style over prompt and generated tokens (positive
            logits divided by it, negative ones multiplied); 1 disables it.
        logit_bias: OpenAI's: (token id, bias) pairs, each bias in [-100, 100] added to that
            token's logit before penalties, temperature, filtering and logprobs (-100 bans a
            token in effect, +100 forces it); at most MAX_LOGIT_BIAS entries, each id once (in
            [0, vocab), checked by the engine's limits). Given as a mapping {id: bias} or as
            pairs; stored as pairs ascending by id. Empty: no bias.
        logprobs: None, or 0..20: return the sampled token's logprob plus this many top
            alternatives (log_softmax of the processed logits / temperature; temperature 1 for
            greedy).
        n: completions per prompt, 1..16; the engine reports each under its `index`.
        cache_salt: the prefix-cache namespace of the request (vLLM's ``cache_salt``): its
            prompt shares cached KV pages only with requests of the same salt (None or "": the
            shared namespace; `engine.prefix_cache`). At most MAX_CACHE_SALT_CHARS characters.
        prompt_logprobs: None, or 0..20: also return the logprob of each prompt token after
            the first, plus this many top alternatives (log_softmax of the model's raw logits;
            `engine/prompt_logprobs.py`). Such a request takes no prefix from the prefix cache.
        structured_outputs: the output must match this JSON schema / regex / choice / grammar
            (`tritonllm.structured`; validated when built); the grammar also ends the
            generation ("stop") once its output is complete. Not with min_tokens > 0.
        allowed_token_ids: vLLM's: only these ids may be sampled (each in [0, vocab), checked
            by the engine's limits); None: no restriction.
        bad_words: vLLM's / TensorRT-LLM's: words that must not be generated (a word's last
            token is masked after its other tokens; `tritonllm.structured.constraint`).
    Raises:
        RequestError: (code ``invalid_value``) a field out of its range or of the wrong type;
            the error names the field, its allowed range and (shortened) the value given.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    logit_bias: LogitBias = ()

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the dataclass hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        _check(not isinstance(ids, str | bytes), "stop_token_ids", "a list of token ids", ids)
        ids = tuple(ids)
        _check(all(_int(t) for t in ids), "stop_token_ids", "a list of token ids", ids)
        object.__setattr__(self, "stop_token_ids", ids)
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            ok = not isinstance(allowed, str | bytes) and all(_int(t) for t in allowed)
            _check(ok, "allowed_token_ids", "a list of token ids", allowed)
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        object.__setattr__(self, "bad_words", words)
        self._validate()
        self._validate_constraints()
        if self.temperature < limits.GREEDY_TEMPERATURE_EPS:  # the limit T -> 0: the argmax
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p == 0:  # the nucleus of p -> 0: the most likely token alone
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    @property
    def has_token_constraint(self) -> bool:
        """Whether sampling is masked per token (structured outputs, allowed ids, bad words)."""
        return bool(
            self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or self.bad_words
        )

    def _validate_constraints(self) -> None:
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            "a StructuredOutputs",
            self.structured_outputs,
        )
        if self.allowed_token_ids is not None:
            _check(
                len(self.allowed_token_ids) > 0 and all(t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids",
                "a non-empty list of non-negative token ids",
                self.allowed_token_ids,
            )
        _check(
            len(self.bad_words) <= limits.MAX_BAD_WORDS,
            "bad_words",
            f"at most {limits.MAX_BAD_WORDS} strings",
            len(self.bad_words),
        )
        _check(
            all(
                isinstance(w, str) and 0 < len(w.strip()) and len(w) <= limits.MAX_BAD_WORD_CHARS
                for w in self.bad_words
            ),
            "bad_words",
            f"non-blank strings of at most {limits.MAX_BAD_WORD_CHARS} characters",
            self.bad_words,
        )
        if self.structured_outputs is not None and self.min_tokens > 0:
            # The grammar may allow only EOS while min_tokens masks it: no token would be left.
            raise RequestError(
                ErrorCode.UNSUPPORTED_PARAMETER,
                "min_tokens",
                "min_tokens > 0 cannot be combined with structured outputs",
            )

    def _validate(self) -> None:
        _check(
            self.max_tokens is None
            or _in(self.max_tokens, limits.MAX_TOKENS, int)
            or (_int(self.max_tokens) and self.max_tokens == limits.PREFILL_ONLY_MAX_TOKENS),
            "max_tokens",
            f"{limits.MAX_TOKENS.describe()} (or absent: until EOS or the context limit; or 0: "
            "prefill only)",
            self.max_tokens,
        )
        _in_range("temperature", self.temperature, limits.TEMPERATURE)
        _in_range("top_p", self.top_p, limits.TOP_P)
        _check(
            _in(self.top_k, limits.TOP_K, int),
            "top_k",
            "-1 or 0 (disabled) or >= 1",
            self.top_k,
        )
        _in_range("min_p", self.min_p, limits.MIN_P)
        _check(
            self.seed is None or _in(self.seed, limits.SEED, int),
            "seed",
            "a 64-bit integer or absent",
            self.seed,
        )
        _check(
            _in(self.min_tokens, limits.MIN_TOKENS, int)
            and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "min_tokens",
            f"in [0, max_tokens={self.max_tokens}]",
            self.min_tokens,
        )
        _in_range("presence_penalty", self.presence_penalty, limits.PENALTY)
        _in_range("frequency_penalty", self.frequency_penalty, limits.PENALTY)
        _in_range("repetition_penalty", self.repetition_penalty, limits.REPETITION_PENALTY)
        _check(
            self.logprobs is None or _in(self.logprobs, limits.LOGPROBS, int),
            "logprobs",
            f"absent or {limits.LOGPROBS.describe()}",
            self.logprobs,
        )
        _check(_in(self.n, limits.N, int), "n", limits.N.describe(), self.n)
        _check(
            self.cache_salt is None
            or (
                isinstance(self.cache_salt, str)
                and len(self.cache_salt) <= limits.MAX_CACHE_SALT_CHARS
            ),
            "cache_salt",
            f"a string of at most {limits.MAX_CACHE_SALT_CHARS} characters",
            self.cache_salt,
        )
        _check(
            self.prompt_logprobs is None or _in(self.prompt_logprobs, limits.PROMPT_LOGPROBS, int),
            "prompt_logprobs",
            f"absent or {limits.PROMPT_LOGPROBS.describe()}",
            self.prompt_logprobs,
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean", self.ignore_eos)
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "non-negative token ids",
            self.stop_token_ids,
        )
        _check(
            len(self.stop) <= limits.MAX_STOP_STRINGS,
            "stop",
            f"at most {limits.MAX_STOP_STRINGS} strings",
            len(self.stop),
        )
        _check(
            all(
                isinstance(t, str) and 0 < len(t) <= limits.MAX_STOP_STRING_CHARS for t in self.stop
            ),
            "stop",
            f"strings of 1..{limits.MAX_STOP_STRING_CHARS} characters",
            self.stop,
        )


def _logit_bias_pairs(value: Any) -> LogitBias:
    """``logit_bias`` ({id: bias} or (id, bias) pairs) as pairs ascending by id, each id an int
    >= 0 given once and each bias a finite number in [-100, 100] (as a float).

    Raises:
        RequestError: (``invalid_value``, param ``logit_bias``) anything else, or more than
            MAX_LOGIT_BIAS entries.
    """
    name, allowed = "logit_bias", "an object of token id -> bias"
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        _check(not isinstance(value, str | bytes), name, allowed, value)
        try:
            pairs = [tuple(pair) for pair in value]
        except TypeError:
            raise _error(name, allowed, value) from None
        _check(all(len(pair) == 2 for pair in pairs), name, allowed, value)
    _check(
        len(pairs) <= limits.MAX_LOGIT_BIAS,
        name,
        f"at most {limits.MAX_LOGIT_BIAS} entries",
        len(pairs),
    )
    ids = [token for token, _ in pairs]
    _check(all(_int(t) and t >= 0 for t in ids), name, "keyed by non-negative token ids", ids)
    _check(len(set(ids)) == len(ids), name, "keyed by distinct token ids", ids)
    for token, bias in pairs:
        _in_range(name, bias, limits.LOGIT_BIAS, f"{name}[{token}]")
    return tuple(sorted((token, float(bias)) for token, bias in pairs))


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in(value: object, allowed: limits.Range, kind: type) -> bool:
    """``value`` is an int (never a bool) within ``allowed``."""
    return _int(value) and value in allowed


def _in_range(name: str, value: object, allowed: limits.Range, label: str = "") -> None:
    """Raises RequestError (param ``name``) unless ``value`` is a finite number in ``allowed``;
    the message calls the value ``label`` (default: ``name``)."""
    label = label or name
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _error(name, f"a number {allowed.describe()}", value, label)
    # NaN and infinities are refused; every float parameter has a finite range.
    if not math.isfinite(value):
        raise _error(name, f"a finite number {allowed.describe()}", value, label)
    if value not in allowed:
        raise _error(name, allowed.describe(), value, label)


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise _error(name, allowed, value)


def _error(name: str, allowed: str, value: object, label: str = "") -> RequestError:
    message = f"{label or name} must be {allowed}, got {short_repr(value)}"
    return RequestError(ErrorCode.INVALID_VALUE, name, message)
