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

A step whose rows sample under a grammar may have its sampling *deferred*
(`ModelRunner`): its forward is enqueued and its token masks start filling on another thread,
and the step comes back without samples (`LaunchedStep.finish` pending) but with its future-map
slots reserved, so the engine commits it and the scheduler plans the next step as usual. The
sampling is enqueued (`complete`) before the next forward's inputs are uploaded, or when the
step's results are asked for: the device sees the same work in the same order either way.
"""

from __future__ import annotations

from collections.abc import Callable
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
        slots = self.reserve(token_ids.shape[0])
        self.write(slots, token_ids)
        return slots

    def reserve(self, n: int) -> list[int]:
        """The next half's first `n` slots, for ids that `write` stores later (a step whose
        sampling is deferred, `LaunchedStep.finish`)."""
        base = self._half * self.max_batch
        self._half ^= 1
        return list(range(base, base + n))

    def write(self, slots: list[int], token_ids: torch.Tensor) -> None:
        """Store `[S]` device ids in the `S` consecutive `slots` of one `reserve`."""
        if slots:
            self.ids[slots[0] : slots[0] + len(slots)].copy_(token_ids)

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
        finish: a deferred sampling (`ModelRunner`: the forward is enqueued, the token masks
            are being filled on another thread): enqueues the sampling and sets `host`, `num_top`
            and `event`; run once by `complete`, before the next forward's inputs are uploaded
            and before `result`.
    """

    batch: ScheduledBatch
    sample_reqs: list[Request]
    host: list[torch.Tensor] = field(default_factory=list)
    num_top: list[int | None] = field(default_factory=list)
    event: torch.cuda.Event | None = None
    slots: list[int] = field(default_factory=list)
    token_pos: list[int] = field(default_factory=list)
    scores: LaunchedScores | None = None
    finish: Callable[[], None] | None = None

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
        step = cls(batch, sample_reqs, slots=slots, scores=scores)
        step.copy_samples(samples)
        return step

    def copy_samples(self, samples: DeviceSamples) -> None:
        """Start the non-blocking device-to-host copies of `samples` into `host` (no sync)."""
        tensors = samples.tensors()
        self.event = None
        if tensors[0].is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            host = tensors
        self.host, self.num_top = host, samples.num_top

    def complete(self) -> None:
        """Run the deferred sampling `finish`, once (nothing when there is none)."""
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()

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
        self.complete()
        if self.scores is not None:
            self.scores.fill()
        if not self.sample_reqs:
            return None
        if self.event is not None:
            self.event.synchronize()
        return DeviceSamples.to_output(self.host, self.num_top)
