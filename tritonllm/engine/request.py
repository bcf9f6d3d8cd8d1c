"""`Request` (engine-side state of one generation) and `RequestOutput` (what a step reports)."""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tritonllm.engine.prompt_logprobs import PromptScores
from tritonllm.engine.stop_strings import StopStringChecker
from tritonllm.sampling_params import SamplingParams
from tritonllm.structured.constraint import TokenConstraint


class RequestStatus(enum.Enum):
    COMPILING = "compiling"  # its token constraint is compiling (not yet in the scheduler)
    WAITING = "waiting"  # in the waiting queue (new or preempted)
    RUNNING = "running"  # admitted: holds KV pages (prefilling or decoding)
    FINISHED = "finished"


@dataclass(eq=False)  # a request is only ever equal to itself (list.remove, `in`)
class Request:
    """One sequence being generated.

    `index` is the choice (0..n-1) of a request with `params.n > 1`; the engine keys a request
    by `key` = (request_id, index). `max_tokens` is the resolved output limit in tokens (the
    engine passes `params.max_tokens` or the room left in the context; left 0, it is
    `params.max_tokens`, or no limit). `token_ids` is prompt + generated tokens. `num_computed`
    tokens of it have K/V in the cache (in `pages`); the first `num_tree_pages` pages belong to
    the prefix cache and are
    locked through `tree_node` while the request holds them. `page_row` is the request's row
    in the cache manager's `HostPageTable` (-1 while it holds no pages).

    The prompt and the sampling params never change after construction, so what the hot path
    asks of them each step is computed once: `num_prompt_tokens`, `uses_penalties` (any of
    logit_bias, repetition/presence/frequency penalty or min_tokens: the sampler's float32 pass
    over the row before sampling) and `plain_sampling` (no top-k, top-p,
    min-p or logprobs).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order key: larger is newer (the preemption victim)
    index: int = 0
    max_tokens: int = 0  # 0: not resolved (see the class docstring)
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    page_row: int = -1
    num_tree_pages: int = 0
    tree_node: Any = None
    cached_tokens: int = 0
    admitted_once: bool = False
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    # With `params.seed`: this choice's seed (seed + index), which keys its draws on the
    # sampler's fast path (`engine.sampler`); `generator` is seeded with it for the PyTorch path.
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    stop_checker: StopStringChecker | None = None  # only for requests with stop strings
    # Structured outputs / allowed ids / bad words: the mask state (set when admitted).
    constraint: TokenConstraint | None = None
    # With logprobs and stop strings: (logprob, top logprobs) of each id the stop checker holds,
    # oldest first (parallel to its held ids); released together with those ids.
    held_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    # With `params.prompt_logprobs`: its prompt's scores, filled as it prefills.
    prompt_scores: PromptScores | None = None
    # Monotonic seconds: when it was made (`add_request`) and first admitted (the scheduler).
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    num_prompt_tokens: int = field(init=False)
    uses_penalties: bool = field(init=False)
    plain_sampling: bool = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        p = self.params
        if not self.max_tokens:
            self.max_tokens = sys.maxsize if p.max_tokens is None else p.max_tokens
        self.num_prompt_tokens = len(self.prompt_ids)
        if p.prompt_logprobs is not None:  # every choice scores its own (no cached prefix)
            self.prompt_scores = PromptScores(self.num_prompt_tokens, p.prompt_logprobs)
        self.uses_penalties = bool(
            p.logit_bias
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or p.min_tokens > 0
        )
        self.plain_sampling = not (
            p.top_k_enabled or p.top_p < 1.0 or p.min_p > 0 or p.logprobs is not None
        )

    @property
    def key(self) -> tuple[str, int]:
        """The engine's key of this request: (request id, choice index)."""
        return (self.request_id, self.index)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def add_details(self, out: RequestOutput) -> RequestOutput:
        """`out`, one of its outputs, with what only some outputs carry: the prompt scores (the
        first output once they are complete) and, when finished, the queue time."""
        if self.prompt_scores is not None:
            self.prompt_scores.report(out)
        if out.finished and self.scheduled_time is not None:
            out.queue_time_s = self.scheduled_time - self.arrival_time
        return out

    @property
    def scores_prompt(self) -> bool:
        """Its prefill must score the prompt (`engine/prompt_logprobs.py`): it asked for prompt
        logprobs and no output has carried them yet."""
        return self.prompt_scores is not None and not self.prompt_scores.reported

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Prefill done: each step feeds exactly the last sampled token (one pending token,
        and it is an output token)."""
        n = len(self.token_ids)
        return n == self.num_computed + 1 and n > self.num_prompt_tokens


@dataclass
class RequestOutput:
    """What one engine step reports for one request.

    Attributes:
        request_id: the id given to `add_request` (every choice of an n > 1 request has it).
        new_token_ids: tokens released this step (empty for an abort or error). With stop
            strings, tokens that may begin a stop string are held back and released later, so
            this can be empty while running or hold several tokens.
        finished: this is the request's last output.
        finish_reason: None while running; "stop" (EOS or a stop token, included in the ids),
            "length" (max_tokens), "abort", or "error" (see `error`).
        num_prompt_tokens, num_output_tokens: counts so far (tokens); with stop strings,
            output ids count once released (held ids do not, yet), and the final count is
            every id generated, also those after a matched stop string's start that are never
            released (OpenAI and vLLM count them as completion tokens).
        cached_tokens: prompt tokens served from the prefix cache at admission.
        logprobs: with `SamplingParams.logprobs`, the logprob of each new token (one per id of
            `new_token_ids`, also for ids held back by stop strings and released later).
        top_logprobs: with `SamplingParams.logprobs`, per new token {token id: logprob} of the
            `logprobs` most likely tokens, most likely first.
        error: the message when finish_reason is "error".
        error_code, error_param: with ``error``, an ``ErrorCode`` value and the parameter at
            fault when the request itself caused it (a constraint that breaks while
            generating: ``invalid_value``, its ``StructuredOutputs.param``, the field as the
            client gave it); None: the server failed.
        trim_chars: characters to drop from the end of the text of `new_token_ids` (decoded
            after all earlier ones) so the output ends just before a matched stop string; 0
            unless a stop string ended the request (see `engine/stop_strings.py`).
        index: the choice (0..n-1) this output belongs to; 0 when n == 1.
        request_finished: the request's last output: every choice has finished (with
            `finished`, the same as it for n == 1). An output that fails a whole request
            (`finish_reason` "error" from a failed engine) has it set and ends every choice.
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, in the choice's first output
            only: `[P - 1]` the logprob of prompt tokens 1..P-1 (the first has none).
        prompt_top_logprobs: with them, per such token {token id: logprob} of its
            `prompt_logprobs` most likely tokens.
        queue_time_s: in a finished output, the seconds the choice waited from `add_request`
            to its first admission (None if it never ran).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    trim_chars: int = 0
    index: int = 0
    request_finished: bool = False
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    queue_time_s: float | None = None
    error_code: str | None = None
    error_param: str | None = None
