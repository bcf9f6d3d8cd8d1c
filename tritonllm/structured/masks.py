"""`TokenMaskBuffers`: the sampler's token-mask step (fill on the host, apply on the device).

Each step that samples constrained rows fills their next-token bitmasks (`constraint.
fill_bitmasks`: row `i` of the host buffer is the mask of the `i`-th constrained row) into a
host buffer, uploads it with the logits row of each mask (pinned memory and non-blocking copies
on CUDA, so nothing waits for the device) and masks those rows of the logits in place: on CUDA
with `kernels.token_bitmask.apply_token_bitmask` (one Triton kernel), elsewhere with
`apply_token_bitmask_torch`. Two host buffers serve alternate steps: a buffer is refilled two
steps later, after the engine has waited for the step that uploaded it, so its copy is done.

The fill can also run while the engine does other work (`start`, then `finish`; `apply` is
both at once): the grammar rows' masks fill in one llguidance batch call (and one xgrammar
batch call for `XGrammarMatcher` rows), outside the GIL, on a thread of its own, so the engine
thread can meanwhile commit the step and build the next step's host inputs
(`engine.model_runner`'s deferred sampling). Starting it is a handshake: `start` returns only
once that thread is about to enter the fill. A thread that merely
waits for the GIL gets it when the holder blocks or after the interpreter's switch interval
(5 ms), so without the handshake the fill would start only when the engine thread next
blocked, which is after the work it was meant to overlap (BENCHMARKS.md, "Structured decode:
the fill beside the engine thread").
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tritonllm.engine.request import Request
from tritonllm.structured.constraint import (
    TokenConstraint,
    XGrammarMatcher,
    bitmask_words,
    restrict_rows,
)
from tritonllm.structured.stacks import GrammarExecutor


def apply_token_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Mask rows ``rows`` of ``logits`` in place: token ``t`` of row ``rows[i]`` becomes -inf
    unless bit ``t % 32`` of ``bitmask[i, t // 32]`` is set (tokens past ``32 * W``: -inf).
    PyTorch on any device; the same contract as `kernels.token_bitmask.apply_token_bitmask`.

    Args:
        logits: ``[B, vocab]`` float (any float dtype).
        bitmask: ``[N', W]`` int32, ``N' >= N``.
        rows: ``[N]`` integer logits row indices.
    """
    num_rows, vocab = rows.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    words = bitmask.shape[1]
    if bitmask.device.type == "cpu":  # numpy's unpackbits: little-endian words, bits in order
        bits = np.unpackbits(bitmask[:num_rows].numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_))
    else:  # [N, W, 1] >> [32] & 1: bit b of word w is token 32w + b.
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask[:num_rows, :, None] >> shifts) & 1).view(num_rows, 32 * words) != 0
    if 32 * words >= vocab:
        allowed = allowed[:, :vocab]
    else:  # tokens without a bit: disallowed
        pad = torch.zeros(num_rows, vocab - 32 * words, dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, pad], dim=1)
    disallowed = ~allowed.to(logits.device)
    for i, row in enumerate(rows.tolist()):  # in place, row by row: no gather of the logits
        logits[row].masked_fill_(disallowed[i], float("-inf"))


@dataclass
class MaskFill:
    """The token masks of one step, being filled (`TokenMaskBuffers.start`).

    Attributes:
        host: ``[N, W]`` int32 host bitmasks (pinned on CUDA), row ``i`` for logits row
            ``rows[i]``.
        rows: ``[N]`` int32 host logits row of each mask.
        constraints: the N rows' constraints (their allowed ids and bad words are applied in
            `TokenMaskBuffers.finish`, after the grammar fill).
        done: the grammar rows' fill on the fill thread, or None (no grammar row: nothing to
            wait for); its exception is llguidance's.
    """

    host: torch.Tensor
    rows: torch.Tensor
    constraints: list[TokenConstraint]
    done: Future[None] | None


class TokenMaskBuffers:
    """Host bitmask buffers, the fill thread and the grammar executors (llguidance's, and
    xgrammar's batch matcher) of one sampler.

    Args:
        device: where the logits are.
        threads: each executor's threads (`EngineConfig.resolved_grammar_threads`).
    """

    def __init__(self, device: torch.device, threads: int = 1) -> None:
        self.device = device
        self.threads = threads
        # Per buffer: the [N, W] int32 bitmasks and the [N] int32 logits row of each.
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self._next = 0
        self._executor: Any = None
        self._xgrammar_batch: Any = None
        self._filler: GrammarExecutor | None = None
        # Diagnostics: seconds inside the grammar libraries' fill calls so far (either thread).
        self.fill_seconds = 0.0

    @property
    def executor(self) -> Any:
        """The llguidance ``LLExecutor`` (created on first use)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.threads)
        return self._executor

    @property
    def xgrammar_batch(self) -> Any:
        """xgrammar's ``BatchGrammarMatcher`` (created on first use)."""
        if self._xgrammar_batch is None:
            import xgrammar

            self._xgrammar_batch = xgrammar.BatchGrammarMatcher(self.threads)
        return self._xgrammar_batch

    def _buffer(self, batch: int, words: int) -> tuple[torch.Tensor, torch.Tensor]:
        index, self._next = self._next, self._next ^ 1
        buf = self._buffers[index]
        if buf is None or buf[0].shape[0] < batch or buf[0].shape[1] != words:
            size = max(batch, 2 * (0 if buf is None else buf[0].shape[0]))
            pinned = self.device.type == "cuda"
            buf = (
                torch.empty((size, words), dtype=torch.int32, pin_memory=pinned),
                torch.empty(size, dtype=torch.int32, pin_memory=pinned),
            )
            self._buffers[index] = buf
        return buf[0][:batch], buf[1][:batch]

    def start(
        self, vocab: int, rows: list[int], reqs: list[Request], background: bool = True
    ) -> MaskFill:
        """Start filling the masks of logits rows ``rows`` (of a ``[B, vocab]`` step) by the
        constraints of ``reqs`` (row ``rows[i]`` is ``reqs[i]``'s, each with a
        `TokenConstraint`). With ``background`` the grammar rows' fill runs on the fill thread
        and this returns once that thread is inside the fill (module docstring);
        until `finish`, the caller must not use these constraints. Without, it fills them
        here, on the calling thread."""
        host, host_rows = self._buffer(len(rows), bitmask_words(vocab))
        host_rows.numpy()[:] = rows
        array = host.numpy()
        constraints: list[TokenConstraint] = [r.constraint for r in reqs]  # type: ignore[misc]
        grammar, xg_matchers, xg_rows = [], [], []
        for i, c in enumerate(constraints):
            if isinstance(c.matcher, XGrammarMatcher):
                xg_matchers.append(c.matcher.matcher)  # xgrammar writes the whole row too
                xg_rows.append(i)
            elif c.matcher is not None:
                grammar.append((c.matcher, i))  # llguidance writes the whole row
            else:
                array[i] = -1  # every token allowed until `restrict_rows` clears some
        done = None
        if grammar or xg_matchers:
            inside = threading.Event()
            executor: Any = self.executor if grammar else None
            batch: Any = self.xgrammar_batch if xg_matchers else None
            pointer, row_bytes = array.ctypes.data, array.shape[1] * 4

            def fill() -> None:  # llguidance.numpy.fill_next_token_bitmask_par's call, bare
                inside.set()
                begin = time.perf_counter()
                if grammar:
                    executor.unsafe_compute_mask_ptr(grammar, pointer, row_bytes, len(rows))
                if xg_matchers:
                    batch.batch_fill_next_token_bitmask(xg_matchers, host, xg_rows)
                self.fill_seconds += time.perf_counter() - begin

            if not background:
                fill()
            else:
                if self._filler is None:
                    self._filler = GrammarExecutor(1, thread_name_prefix="tritonllm-masks")
                done = self._filler.submit(fill)
                inside.wait()  # blocks the caller (GIL released) until the thread took the GIL
        return MaskFill(host, host_rows, constraints, done)

    def finish(self, logits: torch.Tensor, fill: MaskFill) -> None:
        """Wait for ``fill`` and mask its rows of ``logits`` (``[B, vocab]``, float32 /
        bfloat16 / float16, in place: a disallowed token's logit becomes -inf). No host sync.

        Raises:
            Exception: the fill's own (an engine bug: constraints are checked when compiled).
        """
        if fill.done is not None:
            fill.done.result()
        restrict_rows(fill.host.numpy(), fill.constraints)
        if self.device.type == "cuda":
            from kernels.token_bitmask import apply_token_bitmask

            mask = fill.host.to(self.device, non_blocking=True)
            index = fill.rows.to(self.device, non_blocking=True)
            apply_token_bitmask(logits, mask, index)
        else:
            apply_token_bitmask_torch(logits, fill.host, fill.rows)

    def shutdown(self) -> None:
        """Stop the fill thread (a fill in progress finishes first); a later `start` with
        ``background`` makes a new one."""
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None

    def apply(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
        """`start` and `finish` at once: mask rows ``rows`` of ``logits`` (``[B, vocab]``)
        by the constraints of ``reqs`` (row ``rows[i]`` is ``reqs[i]``'s). No host sync."""
        self.finish(logits, self.start(logits.shape[1], rows, reqs, background=False))


__all__ = ["MaskFill", "TokenMaskBuffers", "apply_token_bitmask_torch"]
