"""Every request limit, written once: the engine validates against these, the sidecar's schemas
are built from them, and the docs quote them.

Sampling ranges follow OpenAI's API (temperature in [0, 2], penalties in [-2, 2], top_p in
[0, 1]) and vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Bounds(TypedDict, total=False):
    """A range as pydantic ``Field`` keyword arguments."""

    ge: float
    gt: float
    le: float
    lt: float


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of numbers; ``None`` bounds are unbounded (but values must
    still be finite)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """``"in [0, 2]"``, ``"> 0"``, ``">= 1"``, ... (what an error message says)."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "a finite number"

    def field_bounds(self) -> Bounds:
        """The bounds as pydantic ``Field`` keyword arguments (``ge``/``gt``/``le``/``lt``)."""
        bounds = Bounds()
        if self.low is not None:
            if self.low_open:
                bounds["gt"] = self.low
            else:
                bounds["ge"] = self.low
        if self.high is not None:
            if self.high_open:
                bounds["lt"] = self.high
            else:
                bounds["le"] = self.high
        return bounds


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# --- sampling -------------------------------------------------------------------------------
TEMPERATURE = Range(0, 2)  # 0: greedy
# A temperature below this samples greedily, as 0 does (vLLM's _SAMPLING_EPS): logits / T for a
# tiny T (1e-40 is a valid FP32 input) overflow float32 to inf and softmax gives NaN; and below
# it a token whose logit trails the largest by 1e-3 has a probability under e^-100, so sampling
# is the argmax but for near-ties. SamplingParams stores such a temperature as 0.0.
GREEDY_TEMPERATURE_EPS = 1e-5
TOP_P = Range(0, 1)  # 1: disabled; 0: the most likely token alone (SamplingParams: top_k 1)
TOP_K = Range(-1, INT32_MAX)  # -1 or 0: disabled
MIN_P = Range(0, 1)  # 0: disabled
PENALTY = Range(-2, 2)  # presence_penalty, frequency_penalty
REPETITION_PENALTY = Range(0, None, low_open=True)  # 1: disabled
SEED = Range(INT64_MIN, INT64_MAX)
# logit_bias: each value is added to its token's logit before sampling (OpenAI's range: -100
# bans a token in effect, +100 forces it). OpenAI refuses objects of more than 300 entries.
LOGIT_BIAS = Range(-100, 100)
MAX_LOGIT_BIAS = 300

# --- logprobs on the wire ---------------------------------------------------------------------
# The floor vLLM's OpenAI server applies to a reported logprob: -inf (a masked token: min_tokens,
# a token constraint) is no JSON number; NaN and infinities are never sent (the detokenizer's
# ``logprobs_json`` and the sidecar's responses alike).
MIN_LOGPROB = -9999.0

# --- lengths and counts ---------------------------------------------------------------------
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default (the sidecar sends it)
MAX_TOKENS = Range(1, INT32_MAX)  # absent: until EOS, a stop condition or the context limit
# The engine also takes max_tokens = 0: the request only prefills and generates nothing (it
# scores its prompt with prompt_logprobs, or echoes it: legacy completions with echo, as
# lm-evaluation-harness sends its loglikelihood requests).
PREFILL_ONLY_MAX_TOKENS = 0
COMPLETION_MAX_TOKENS = Range(PREFILL_ONLY_MAX_TOKENS, INT32_MAX)  # legacy completions (echo)
MIN_TOKENS = Range(0, INT32_MAX)
TOKEN_ID = Range(0, INT32_MAX)
MAX_N = 16  # choices per request
N = Range(1, MAX_N)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI chat's top_logprobs)
LOGPROBS = Range(0, MAX_LOGPROBS)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions endpoint
# Logprobs of each prompt token plus this many top alternatives (vLLM's prompt_logprobs;
# computed during prefill, engine/prompt_logprobs.py).
PROMPT_LOGPROBS = Range(0, MAX_LOGPROBS)
# Prompts in one legacy completions request (a list of strings or of token-id lists); each is
# its own generation of n choices.
MAX_COMPLETION_PROMPTS = 64
# Stop strings (OpenAI allows 4; vLLM has no limit). Each is matched against the decoded output
# every step, so the count and length bound the per-token work.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# A prefix-cache namespace (`SamplingParams.cache_salt`): sidecar-derived salts are 64 hex digits.
MAX_CACHE_SALT_CHARS = 256

# --- sizes of direct Triton inputs ----------------------------------------------------------
# Checked by the models before any decoding, parsing or tokenizing (the sidecar's own body limit
# is 4 MiB). A prompt must also fit the context in characters (`tokenization.prompt_limits`).
MAX_PROMPT_BYTES = 8 << 20  # text_input, messages (JSON), echo_text
MAX_PROMPT_TOKENS = 1 << 20  # input_ids (the engine then holds it to max_model_len)
MAX_STOP_TOKEN_IDS = 1024
MAX_PARAMETERS_BYTES = 64 << 10  # sampling_parameters (JSON)
# Output tokens of all n choices of one request (n x max_tokens): a larger explicit request is
# refused; without max_tokens each choice gets min(room in the context, this // n). OpenAI caps
# a completion's output of its GPT-4o models at the same 16,384 tokens.
MAX_REQUEST_OUTPUT_TOKENS = 16384

# --- structured outputs and token masks (tritonllm/structured) ------------------------------
MAX_GRAMMAR_CHARS = 100_000  # a JSON schema's canonical text, a regex or an EBNF grammar
MAX_CHOICES = 256  # guided_choice strings
# Structured-output backend names a request may give (vLLM's); llguidance serves them all.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance")
MAX_BAD_WORDS = 64  # bad_words entries (each 1..MAX_BAD_WORD_CHARS characters)
MAX_BAD_WORD_CHARS = 256
