"""Triton kernel: rotary position embedding of q and k in one launch (NeoX "rotate half").

`out[:D/2] = x1 * cos - x2 * sin`, `out[D/2:] = x2 * cos + x1 * sin`, with cos/sin gathered
from `[max_positions, D/2]` float32 caches by position and rounded like
`tritonllm.layers.rotary.RotaryEmbedding` (and transformers): cos/sin, each product and each sum
rounded to the input dtype. RoPE: RoFormer, Su et al. 2021. One program
rotates all heads of q and of k for one token.

Reference: `tritonllm.layers.rotary.RotaryEmbedding` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    t,
    num_heads,
    cos,
    sin,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (d[None, :] < half)
    base = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # Round like eager PyTorch/transformers in x's dtype: each product, then the sum.
    c = cos[None, :].to(dt).to(tl.float32)
    s = sin[None, :].to(dt).to(tl.float32)
    o1 = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
    o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    dst = out_ptr + (t * num_heads + h[:, None].to(tl.int64)) * (2 * half) + d[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * half + d, mask=d < half, other=0.0)
    sin = tl.load(sin_ptr + pos * half + d, mask=d < half, other=0.0)
    _rotate_heads(
        q_ptr, q_out_ptr, stride_qt, stride_qh, t, num_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr, k_out_ptr, stride_kt, stride_kh, t, num_k_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF
    )


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions.

    Args:
        positions: `[T]` int64.
        q: `[T, Hq, D]`, k: `[T, Hk, D]`; same dtype, last dim contiguous, D even.
        cos_cache, sin_cache: `[max_positions, D/2]` float32, contiguous.

    Returns:
        new contiguous `(q, k)`, same shapes and dtype.

    Raises:
        ValueError: shapes or strides that do not fit.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if (
        k.shape[0] != num_tokens
        or k.shape[2] != head_dim
        or q.stride(2) != 1
        or k.stride(2) != 1
        or cos_cache.shape[1] != half
        or not cos_cache.is_contiguous()
        or not sin_cache.is_contiguous()
    ):
        raise ValueError(f"rotary: q {tuple(q.shape)} k {tuple(k.shape)} cos {cos_cache.shape}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        num_q_heads,
        k.shape[1],
        half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
