"""`TokenMaskBuffers`: the sampler's token-mask step (fill on the host, apply on the device).

Each step that samples constrained rows fills their next-token bitmasks (`constraint.
fill_bitmasks`: row `i` of the host buffer is the mask of the `i`-th constrained row) into a
host buffer, uploads it with the logits row of each mask (pinned memory and non-blocking copies
on CUDA, so nothing waits for the device) and masks those rows of the logits in place: on CUDA
with `kernels.token_bitmask.apply_token_bitmask` (one Triton kernel), elsewhere with
`apply_token_bitmask_torch`. Two host buffers serve alternate steps: a buffer is refilled two
steps later, after the engine has waited for the step that uploaded it, so its copy is done.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tritonllm.engine.request import Request
from tritonllm.structured.constraint import bitmask_words, fill_bitmasks


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


class TokenMaskBuffers:
    """Host bitmask buffers and the llguidance executor of one sampler.

    Args:
        device: where the logits are.
        threads: the executor's threads (`EngineConfig.resolved_grammar_threads`).
    """

    def __init__(self, device: torch.device, threads: int = 1) -> None:
        self.device = device
        self.threads = threads
        # Per buffer: the [N, W] int32 bitmasks and the [N] int32 logits row of each.
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        self._next = 0
        self._executor: Any = None

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

    def apply(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
        """Mask rows ``rows`` of ``logits`` (``[B, vocab]``, float32 / bfloat16 / float16, in
        place: a disallowed token's logit becomes -inf) by the constraints of ``reqs`` (row
        ``rows[i]`` is ``reqs[i]``'s, each with a `TokenConstraint`). No host sync."""
        import llguidance

        vocab = logits.shape[1]
        host, host_rows = self._buffer(len(rows), bitmask_words(vocab))
        host.numpy()[:] = -1  # every token allowed until a constraint clears it
        host_rows.numpy()[:] = rows
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.threads)
        constraints = [r.constraint for r in reqs]
        fill_bitmasks(host, list(range(len(rows))), constraints, self._executor)  # type: ignore[arg-type]
        if self.device.type == "cuda":
            from kernels.token_bitmask import apply_token_bitmask

            mask = host.to(self.device, non_blocking=True)
            index = host_rows.to(self.device, non_blocking=True)
            apply_token_bitmask(logits, mask, index)
        else:
            apply_token_bitmask_torch(logits, host, host_rows)


__all__ = ["TokenMaskBuffers", "apply_token_bitmask_torch"]
