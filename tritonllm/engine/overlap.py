"""Overlap scheduling: a launched step whose sampled ids are still on their way to the host.

The idea is SGLang's overlap scheduler (its "zero-overhead batch scheduler", SGLang v0.4 blog):
the engine launches step N+1 before it has looked at the tokens of step N. To make that
possible,

- each step's sampled ids stay on the GPU, in a *future map* (`FutureMap`), and the requests
  get a placeholder id `-(slot + 1)` in `token_ids` at once, so the scheduler sees the same
  lengths as it would after the step;
- a forward that needs a placeholder as input (the next decode step, or a recomputation)
  gathers the real id from the future map on the GPU: no host round trip;
- the ids are copied to pinned host memory without blocking; the engine fills the placeholders
  and runs the stop checks one step late (`LaunchedStep.result`). A request that finished at
  step N may already be part of step N+1; that extra token is discarded.

Without overlap (and on CPU) the engine calls `result()` right after the launch: the same code
path, with no placeholder ever visible to the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tritonllm.engine.prompt_logprobs import LaunchedScores
from tritonllm.engine.request import Request
from tritonllm.engine.sampler import DeviceSamples, SamplerOutput
from tritonllm.engine.scheduler import ScheduledBatch


def placeholder(slot: int) -> int:
    """The token id that stands for future-map slot `slot` until the real id is known."""
    return -(slot + 1)


def num_unknown_tail(token_ids: list[int]) -> int:
    """How many trailing ids of a request are still placeholders (0, 1 or 2)."""
    n = 0
    while n < len(token_ids) and token_ids[-1 - n] < 0:
        n += 1
    return n


class FutureMap:
    """Device ring of sampled ids, in two halves used by alternate steps.

    Step k writes its S <= max_batch ids to half `k % 2`. A placeholder of step k is read only
    by steps launched before step k's results are processed, i.e. by step k+1 at the latest,
    so consecutive steps never share slots.
    """

    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.ids = torch.zeros(2 * max_batch, dtype=torch.int64, device=device)
        self._half = 0

    def store(self, token_ids: torch.Tensor) -> list[int]:
        """Write `[S]` sampled ids (device) to the next half; returns their slots."""
        n = token_ids.shape[0]
        base = self._half * self.max_batch
        self._half ^= 1
        self.ids[base : base + n].copy_(token_ids)
        return list(range(base, base + n))

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """`[N]` int64 device ids with placeholders → real ids (GPU gather, no sync)."""
        slots = (-ids - 1).clamp_(min=0)
        return torch.where(ids >= 0, ids, self.ids[slots])

    def lookup(self, slots: torch.Tensor) -> torch.Tensor:
        """`[N]` int64 device slots → the ids stored there: `resolve` for a batch whose ids are
        all placeholders (the usual decode step under overlap), as one gather."""
        return self.ids[slots]


@dataclass
class LaunchedStep:
    """One step in flight: its batch, the requests that sample, and their samples' host copies.

    Attributes:
        batch: the scheduled batch.
        sample_reqs: the S requests that sample this step, in row order.
        host: host copies of `DeviceSamples.tensors()` (pinned; valid after `event`).
        num_top: per row, the number of top logprobs asked (None: no logprobs).
        event: recorded after the device-to-host copies (None on CPU: already done).
        slots: future-map slot of each sampled id.
        token_pos: index in `req.token_ids` of each request's placeholder (set by `commit`).
        scores: the step's prompt scores on their way to the host, or None.
    """

    batch: ScheduledBatch
    sample_reqs: list[Request]
    host: list[torch.Tensor] = field(default_factory=list)
    num_top: list[int | None] = field(default_factory=list)
    event: torch.cuda.Event | None = None
    slots: list[int] = field(default_factory=list)
    token_pos: list[int] = field(default_factory=list)
    scores: LaunchedScores | None = None

    @classmethod
    def from_samples(
        cls,
        batch: ScheduledBatch,
        sample_reqs: list[Request],
        samples: DeviceSamples,
        slots: list[int],
        scores: LaunchedScores | None = None,
    ) -> LaunchedStep:
        """Start the non-blocking device-to-host copies of `samples` (no sync)."""
        tensors = samples.tensors()
        event = None
        if tensors[0].is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = tensors
        return cls(batch, sample_reqs, host, samples.num_top, event, slots, scores=scores)

    def commit(self) -> None:
        """Advance the requests as if the step were done: `num_computed` grows by the extend
        lengths and each sampling request gets its placeholder id."""
        for req, ext in zip(self.batch.reqs, self.batch.extend_lens, strict=True):
            req.num_computed += ext
        token_pos = self.token_pos = []
        for req, slot in zip(self.sample_reqs, self.slots, strict=True):
            token_pos.append(len(req.token_ids))
            req.token_ids.append(-(slot + 1))  # placeholder(slot), inlined (hot loop)

    def result(self) -> SamplerOutput | None:
        """Wait for the copies, store the step's prompt scores in their requests (before the
        samples: a request's first output carries them) and return the host samples (None if
        nothing sampled)."""
        if self.scores is not None:
            self.scores.fill()
        if not self.sample_reqs:
            return None
        if self.event is not None:
            self.event.synchronize()
        return DeviceSamples.to_output(self.host, self.num_top)
