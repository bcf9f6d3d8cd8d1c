"""Triton kernels: RMSNorm over the last dim, and residual add fused with RMSNorm.

Same numerics as `tritonllm.layers.norm.RMSNorm` (Hugging Face's order): the statistic in
float32, the normalised row rounded to the input dtype, then multiplied by the weight and
rounded again. RMSNorm: Zhang & Sennrich, 2019.

- `rmsnorm`: one program normalises one row; rows of a `[T, H, D]` view (e.g. the q or k heads
  split out of a fused qkv projection) are addressed through their two strides, so no copy is
  needed first.
- `fused_add_rmsnorm`: the pre-norm residual stream of a decoder layer (the fused form vLLM and
  SGLang use): `residual = x + residual` rounded to the dtype, then `rmsnorm(residual)`, one
  kernel instead of an add kernel plus a norm kernel.

Reference: `tritonllm.layers.norm.RMSNorm` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_wait


@triton.jit
def _normalize_and_weight(x, inv_rms, w, dtype: tl.constexpr):
    """float32 `x * inv_rms` rounded to `dtype`, times `w` in float32, rounded again."""
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    return (w.to(tl.float32) * normed).to(dtype)


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
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0)
    t = (row // num_heads).to(tl.int64)
    h = (row % num_heads).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    out = _normalize_and_weight(x, inv_rms, w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * dim + d, out, mask=mask)


@triton.jit
def _fused_add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_xt,
    stride_rt,
    dim,
    eps,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_xt + d, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_rt + d, mask=mask, other=0.0).to(tl.float32)
    # Eager `x + residual`: one float32 add, one rounding; the norm reads the rounded sum.
    total = (x + res).to(dtype)
    tl.store(res_out_ptr + row * dim + d, total, mask=mask)
    total = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(total * total, axis=0) / dim + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0)
    tl.store(out_ptr + row * dim + d, _normalize_and_weight(total, inv_rms, w, dtype), mask=mask)


def _num_warps(block_d: int) -> int:
    # 8 elements (16 bytes of bf16) per thread at D = 1024 and up to 4096.
    return max(1, min(8, block_d // 256))


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
        num_warps=_num_warps(block_d),
        **launch_options(x.device),
    )
    return out


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual`; `normed = rmsnorm(new_residual)`, in one kernel.

    Rounds exactly like eager PyTorch `r = x + residual` (float32 add, one rounding to the dtype)
    followed by `tritonllm.layers.norm.RMSNorm(r)`. Both outputs are new tensors: neither input
    is written, so a caller (or a CUDA graph replaying the forward) may still read them. One
    program per row: a row of 1024 bf16 is 8 elements per thread at 4 warps, and at decode batch
    sizes one row per program spreads the few rows over the most SMs.

    Args:
        x: `[T, D]` bf16/fp16/fp32 (e.g. an attention or MLP output), last dim contiguous.
        residual: `[T, D]`, same dtype, last dim contiguous (the residual stream so far).
        weight: `[D]`, same dtype.
        eps: added to the mean square.

    Returns:
        `(normed, new_residual)`, both new contiguous `[T, D]` tensors in x's dtype.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    if (
        x.dim() != 2
        or residual.shape != x.shape
        or weight.shape != (x.shape[-1],)
        or residual.dtype != x.dtype
        or weight.dtype != x.dtype
        or x.stride(-1) != 1
        or residual.stride(-1) != 1
    ):
        raise ValueError(
            f"fused_add_rmsnorm: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, residual "
            f"{tuple(residual.shape)} {residual.dtype} stride {residual.stride()}, "
            f"w {tuple(weight.shape)} {weight.dtype}"
        )
    num_tokens, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, new_residual
    block_d = triton.next_power_of_2(dim)
    _fused_add_rmsnorm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        out,
        new_residual,
        x.stride(0),
        residual.stride(0),
        dim,
        eps,
        BLOCK_D=block_d,
        num_warps=_num_warps(block_d),
        **launch_options(x.device),
    )
    return out, new_residual
