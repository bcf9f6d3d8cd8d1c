"""`TokenMaskBuffers`: the sampler's token-mask step (fill on the host, apply on the device).

Each step that samples constrained rows fills their next-token bitmasks (`constraint.
fill_bitmasks`) into a host buffer, uploads it (pinned memory and a non-blocking copy on CUDA,
so nothing waits for the device) and masks those rows of the logits in place with xgrammar's
`apply_token_bitmask_inplace` (its Triton kernel on CUDA, its C++ loop on CPU). Two host buffers
serve alternate steps: a buffer is refilled two steps later, after the engine has waited for the
step that uploaded it, so its copy is done.
"""

from __future__ import annotations

from typing import Any

import torch

from tritonllm.engine.request import Request
from tritonllm.structured.constraint import bitmask_words, fill_bitmasks


class TokenMaskBuffers:
    """Host bitmask buffers and the batch matcher of one sampler.

    Args:
        device: where the logits are.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next = 0
        self._batch_matcher: Any = None

    def _buffer(self, batch: int, words: int) -> torch.Tensor:
        index, self._next = self._next, self._next ^ 1
        buf = self._buffers[index]
        if buf is None or buf.shape[0] < batch or buf.shape[1] != words:
            size = max(batch, 2 * (0 if buf is None else buf.shape[0]))
            pinned = self.device.type == "cuda"
            buf = torch.empty((size, words), dtype=torch.int32, pin_memory=pinned)
            self._buffers[index] = buf
        return buf[:batch]

    def apply(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
        """Mask rows ``rows`` of ``logits`` (``[B, vocab]``, any float dtype, in place: a
        disallowed token's logit becomes -inf) by the constraints of ``reqs`` (row ``rows[i]``
        is ``reqs[i]``'s, each with a `TokenConstraint`). No host sync."""
        import xgrammar as xgr

        batch, vocab = logits.shape
        host = self._buffer(batch, bitmask_words(vocab))
        host.numpy()[rows] = -1  # every token allowed until a constraint clears it
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher()
        constraints = [r.constraint for r in reqs]
        fill_bitmasks(host, rows, constraints, self._batch_matcher)  # type: ignore[arg-type]
        if self.device.type == "cuda":
            mask = host.to(self.device, non_blocking=True)
        else:
            mask = host
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)


__all__ = ["TokenMaskBuffers"]
