"""Prompt logprobs: the logprob of each prompt token given the tokens before it, computed while
the prompt prefills (OpenAI's legacy ``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``;
lm-evaluation-harness scores every loglikelihood request this way).

A request with ``SamplingParams.prompt_logprobs`` = k scores its prompt as it prefills. In each
prefill chunk, every position p whose next token is a prompt token (p + 1 < prompt length) gets
its logits computed too (the model runner adds these rows to the forward's ``logits_indices``
after the sampling rows), and the row's log-softmax gives the logprob of prompt token p + 1 and
the k most likely tokens. The chunks of a long prompt fill ``PromptScores`` in turn; the first
output of the request carries them all (``RequestOutput.prompt_logprobs``); the first prompt
token has none (nothing precedes it).

Values are the log-softmax of the model's raw logits in float32: no temperature, penalty or
filter applies (the model's own distribution over the prompt, as vLLM reports it).

Every prompt position must run through the model, so a scoring request takes no prefix from the
prefix cache (the scheduler skips its ``match_prefix`` until its scores are reported, as vLLM
does for prompt logprobs); it still adds its pages to the cache for others. A prefill step
computes at most ``MAX_SCORED_TOKENS_PER_STEP`` such rows (the scheduler caps the chunks of
scoring requests): a ``[rows, vocab]`` float32 log-softmax is what it costs in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tritonllm.engine.request import Request, RequestOutput

# Prompt positions scored per prefill step, over all requests of the batch: 1024 rows of
# Qwen3's 151,936-token vocabulary are 622 MB of float32 log-softmax.
MAX_SCORED_TOKENS_PER_STEP = 1024


class PromptScores:
    """One request's prompt logprobs, filled chunk by chunk (host side).

    Args:
        num_prompt_tokens: P; tokens 1..P-1 get a logprob each.
        num_top: k, the most likely alternatives kept per token.

    Attributes:
        logprobs: ``[P - 1]`` logprob of prompt token i + 1.
        top_logprobs: ``[P - 1]`` ``{token id: logprob}`` of its k most likely tokens.
        reported: an output carried them (the request then scores nothing more, and a
            recomputation after preemption may take its prefix from the cache).
    """

    def __init__(self, num_prompt_tokens: int, num_top: int) -> None:
        self.num_top = num_top
        size = num_prompt_tokens - 1
        self.logprobs: list[float] = [0.0] * size
        self.top_logprobs: list[dict[int, float]] = [{} for _ in range(size)]
        self._filled = np.zeros(size, dtype=bool)
        self.reported = False

    @property
    def complete(self) -> bool:
        """Every prompt token after the first has its logprob."""
        return bool(self._filled.all())

    def report(self, out: RequestOutput) -> None:
        """Put the scores in ``out`` (the choice's output) once they are complete, unless an
        earlier output carried them."""
        if not self.reported and self.complete:
            self.reported = True
            out.prompt_logprobs, out.prompt_top_logprobs = self.logprobs, self.top_logprobs

    def fill(self, start: int, logprobs: list[float], top_logprobs: list[dict[int, float]]) -> None:
        """Store the scores of prompt tokens ``start + 1 .. start + len(logprobs)``."""
        end = start + len(logprobs)
        self.logprobs[start:end] = logprobs
        self.top_logprobs[start:end] = top_logprobs
        self._filled[start:end] = True


@dataclass
class PromptRows:
    """The scored positions of one prefill batch.

    Attributes:
        reqs, starts, counts: per scored segment, its request, the first scored position
            (prompt token ``start + 1`` is its target) and the number of positions.
        token_index: ``[R]`` int64, each scored position's row in the batch's flat token axis
            (what the forward's ``logits_indices`` gets).
        targets: ``[R]`` int64, the prompt token each row predicts.
    """

    reqs: list[Request] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def plan(cls, reqs: list[Request], extend_lens: list[int], cu: np.ndarray) -> PromptRows | None:
        """The scored positions of a prefill batch (before its requests' ``num_computed``
        advance); None when no request of it scores its prompt.

        Args:
            reqs, extend_lens: the batch's requests and their new tokens.
            cu: ``[B + 1]`` offsets of each request's new tokens in the flat token axis.
        """
        rows = cls()
        index, targets = [], []
        for b, (req, ext) in enumerate(zip(reqs, extend_lens, strict=True)):
            if not req.scores_prompt:
                continue
            start = req.num_computed
            count = min(start + ext, req.num_prompt_tokens - 1) - start
            if count <= 0:
                continue
            rows.reqs.append(req)
            rows.starts.append(start)
            rows.counts.append(count)
            index.append(np.arange(cu[b], cu[b] + count, dtype=np.int64))
            targets.extend(req.prompt_ids[start + 1 : start + 1 + count])
        if not rows.reqs:
            return None
        rows.token_index = np.concatenate(index)
        rows.targets = np.asarray(targets, dtype=np.int64)
        return rows

    def score(self, logits: torch.Tensor) -> LaunchedScores:
        """Enqueue the scores of these rows from their ``[R, vocab]`` logits (any float dtype;
        no host sync) and start copying them to the host."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.from_numpy(self.targets).to(logits.device, non_blocking=True)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        k = max(req.prompt_scores.num_top for req in self.reqs if req.prompt_scores)
        top_vals, top_ids = logprobs.topk(max(k, 1), dim=-1)
        tensors = [chosen, top_ids, top_vals]
        event = None
        if logits.is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            tensors = host
        return LaunchedScores(self, tensors, event)


@dataclass
class LaunchedScores:
    """The scores of a launched step, on their way to the host (``fill`` waits for them)."""

    rows: PromptRows
    host: list[torch.Tensor]
    event: torch.cuda.Event | None = None

    def fill(self) -> None:
        """Store each segment's scores in its request's ``PromptScores`` (unless an output
        already reported them: a recomputation after preemption scores again)."""
        if self.event is not None:
            self.event.synchronize()
        chosen, top_ids, top_vals = (t.tolist() for t in self.host)
        offset = 0
        rows = self.rows
        for req, start, count in zip(rows.reqs, rows.starts, rows.counts, strict=True):
            scores = req.prompt_scores
            end = offset + count
            if scores is not None and not scores.reported:
                k = scores.num_top
                tops = [
                    dict(zip(ids[:k], vals[:k], strict=True))
                    for ids, vals in zip(top_ids[offset:end], top_vals[offset:end], strict=True)
                ]
                scores.fill(start, chosen[offset:end], tops)
            offset = end
