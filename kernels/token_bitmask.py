"""Triton kernel: a token bitmask applied to rows of the logits, in place.

Structured outputs (`tritonllm.structured`) give each constrained row a bitmask of the tokens
it may sample: `[N, W]` int32, bit `t % 32` of word `t // 32` set = token `t` allowed (the
layout of llguidance and xgrammar). Row `i` of the bitmask belongs to row `rows[i]` of the
`[B, vocab]` logits; every disallowed token's logit becomes -inf, tokens at or past `32 * W`
(no bit for them) included. Other rows are not touched.

Grid `(N, cdiv(vocab, BLOCK))`: each program reads `BLOCK / 32` words of one bitmask row, the
`BLOCK` logits they cover, and writes back only the masked ones (a masked store: an allowed
logit is never rewritten). Logits may be float32, bfloat16 or float16.

Reference: `kernels.reference.ref_apply_token_bitmask` (a per-token loop); the sampler's path
off CUDA is `tritonllm.structured.masks.apply_token_bitmask_torch`. Both are tested in
`tests/test_token_bitmask.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_wait

BLOCK = 1024  # logits per program (32 bitmask words)


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,
    mask_ptr,
    rows_ptr,
    stride_logits,
    stride_mask,
    vocab,
    words,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    word = cols // 32
    # A token without a word (cols >= 32 * words) reads 0: disallowed.
    bits = tl.load(mask_ptr + i.to(tl.int64) * stride_mask + word, mask=word < words, other=0)
    allowed = ((bits >> (cols % 32)) & 1) != 0
    ninf = tl.full((BLOCK,), float("-inf"), dtype=tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, ninf, mask=(cols < vocab) & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Mask rows ``rows`` of ``logits`` by ``bitmask`` in place (module docstring).

    Args:
        logits: ``[B, vocab]`` float32 / bfloat16 / float16 on CUDA, last dim contiguous.
        bitmask: ``[N', W]`` int32 on the same device (N' >= N), last dim contiguous; row ``i``
            is the mask of logits row ``rows[i]``.
        rows: ``[N]`` int32 (or int64) logits row indices on the same device, each in [0, B).

    Raises:
        ValueError: wrong ranks, dtypes or strides.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"apply_token_bitmask: bad logits {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.stride(1) != 1:
        raise ValueError(f"apply_token_bitmask: bad bitmask {tuple(bitmask.shape)}")
    if rows.dim() != 1 or rows.shape[0] > bitmask.shape[0]:
        raise ValueError(f"apply_token_bitmask: {rows.shape[0]} rows, {bitmask.shape[0]} masks")
    num_rows, vocab = rows.shape[0], logits.shape[1]
    if num_rows == 0 or vocab == 0:
        return
    _apply_bitmask_kernel[(num_rows, triton.cdiv(vocab, BLOCK))](
        logits,
        bitmask,
        rows,
        logits.stride(0),
        bitmask.stride(0),
        vocab,
        bitmask.shape[1],
        BLOCK=BLOCK,
        num_warps=4,
        **launch_options(logits.device),
    )


__all__ = ["BLOCK", "apply_token_bitmask"]
