"""`SamplingParams`: per-request generation settings, with OpenAI / vLLM semantics."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_N = 16
# Stop strings per request (OpenAI allows 4; vLLM has no limit). Each is matched against the
# decoded output every step, so the count bounds per-token work.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_tokens: most new tokens (>= 1); None: until EOS, a stop condition or the context
            limit (OpenAI chat's omitted max_tokens; the engine resolves it per request).
        temperature: >= 0; 0 means greedy (argmax).
        top_p: nucleus sampling, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; -1 (or 0) disables it, else >= 1.
        min_p: drop tokens with probability < min_p * max probability, in [0, 1]; 0 disables.
        seed: per-request seed: the same seed and inputs give the same tokens regardless of
            which other requests share the batch. None uses the engine's generator.
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
        logprobs: None, or 0..20: return the sampled token's logprob plus this many top
            alternatives (log_softmax of the processed logits / temperature; temperature 1 for
            greedy).
        n: completions per prompt, 1..16; the engine runs them as requests `"{id}#{i}"`.
    """

    max_tokens: int | None = 16
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

    def __post_init__(self) -> None:
        # Accept lists from callers but keep the dataclass hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    def validate(self) -> SamplingParams:
        """Check every field; return self so calls can chain.

        Raises:
            ValueError: naming the parameter, its allowed range and the value given.
        """
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            ">= 1",
            self.max_tokens,
        )
        _check(
            _num(self.temperature) and self.temperature >= 0,
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        _check(_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            "-1 or 0 (disabled) or >= 1",
            self.top_k,
        )
        _check(_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(
            self.seed is None or isinstance(self.seed, int), "seed", "an integer or None", self.seed
        )
        _check(
            isinstance(self.min_tokens, int)
            and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
            "min_tokens",
            f"in [0, max_tokens={self.max_tokens}]",
            self.min_tokens,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_num(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        _check(
            _num(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "a finite number > 0",
            self.repetition_penalty,
        )
        _check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"None or in [0, {MAX_LOGPROBS}]",
            self.logprobs,
        )
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"in [1, {MAX_N}]", self.n)
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "non-negative token ids",
            self.stop_token_ids,
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} strings",
            len(self.stop),
        )
        _check(
            all(isinstance(t, str) and 0 < len(t) <= MAX_STOP_STRING_CHARS for t in self.stop),
            "stop",
            f"strings of 1..{MAX_STOP_STRING_CHARS} characters",
            self.stop,
        )
        return self


def _num(value: object) -> bool:
    # NaN and infinities are refused here; every float parameter has a finite range.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        text = repr(value)
        if len(text) > 80:  # never echo a huge value (a 10k-character stop string) in full
            text = f"{text[:77]}..."
        raise ValueError(f"{name} must be {allowed}, got {text}")
