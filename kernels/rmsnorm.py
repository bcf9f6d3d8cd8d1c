"""Triton kernel: RMSNorm over the last dim of a `[T, H, D]` (or `[T, D]`) strided view.

Same numerics as `tritonllm.layers.norm.RMSNorm` (Hugging Face's order): the statistic in
float32, the normalised row rounded to the input dtype, then multiplied by the weight and
rounded again. One program normalises one row; rows of a `[T, H, D]` view (e.g. the q or k heads
split out of a fused qkv projection) are addressed through their two strides, so no copy is
needed first. RMSNorm: Zhang & Sennrich, 2019.

Reference: `tritonllm.layers.norm.RMSNorm` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    num_heads,
    dim,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    t = (row // num_heads).to(tl.int64)
    h = (row % num_heads).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / dim
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * dim + d, out, mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim.

    Args:
        x: `[T, D]` or `[T, H, D]`, bf16/fp16/fp32, last dim contiguous (other strides free).
        weight: `[D]`, same dtype as x.
        eps: added to the mean square.

    Returns:
        a new contiguous tensor shaped like `x`, in x's dtype.

    Raises:
        ValueError: x is not 2-D/3-D, its last dim is not contiguous, or weight mismatches.
    """
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rmsnorm: x {tuple(x.shape)} stride {x.stride()} w {weight.shape}")
    dim = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.shape[0] * heads
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    _rmsnorm_kernel[(rows,)](
        x,
        weight,
        out,
        x.stride(0),
        stride_h,
        heads,
        dim,
        eps,
        BLOCK_D=block_d,
        num_warps=max(1, min(8, block_d // 256)),
    )
    return out
