"""Triton kernels: rotary position embedding of q and k in one launch (NeoX "rotate half"),
optionally preceded by Qwen3's per-head q/k RMSNorm in the same launch.

`out[:D/2] = x1 * cos - x2 * sin`, `out[D/2:] = x2 * cos + x1 * sin`, with cos/sin gathered
from `[max_positions, D/2]` float32 caches by position and rounded like
`tritonllm.layers.rotary.RotaryEmbedding` (and transformers): cos/sin, each product and each sum
rounded to the input dtype. RoPE: RoFormer, Su et al. 2021. One program rotates all heads of q
and of k for one token.

With norm weights, each head is first normalised over all D elements (both halves) with the
rounding of `tritonllm.layers.norm.RMSNorm` (statistic in float32, normalised head rounded to the
dtype, times the weight, rounded again), as Qwen3 applies `q_norm`/`k_norm` before RoPE.

Reference: `tritonllm.layers.norm.RMSNorm` then `tritonllm.layers.rotary.RotaryEmbedding` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rmsnorm import _normalize_and_weight


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    w_ptr,
    stride_xt,
    stride_xh,
    t,
    num_heads,
    cos,
    sin,
    half,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (d[None, :] < half)
    base = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if NORM:
        # The statistic spans the whole head: both halves, 2 * half elements.
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        inv_rms = tl.rsqrt(sum_sq / (2 * half) + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < half, other=0.0)[None, :]
        w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0)[None, :]
        x1 = _normalize_and_weight(x1, inv_rms, w1, dt).to(tl.float32)
        x2 = _normalize_and_weight(x2, inv_rms, w2, dt).to(tl.float32)
    # Round like eager PyTorch/transformers in x's dtype: each product, then the sum.
    c = cos[None, :].to(dt).to(tl.float32)
    s = sin[None, :].to(dt).to(tl.float32)
    o1 = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
    o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    dst = out_ptr + (t * num_heads + h[:, None].to(tl.int64)) * (2 * half) + d[None, :]
    tl.store(dst, o1.to(dt), mask=mask)
    tl.store(dst + half, o2.to(dt), mask=mask)


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
    # No norm: the weight pointer is unused (NORM=False), q_ptr stands in for it.
    _rotate_heads(
        q_ptr, q_out_ptr, q_ptr, stride_qt, stride_qh, t, num_q_heads, cos, sin, half, 0.0,
        BLOCK_HQ, BLOCK_HALF, False,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, k_ptr, stride_kt, stride_kh, t, num_k_heads, cos, sin, half, 0.0,
        BLOCK_HK, BLOCK_HALF, False,
    )  # fmt: skip


@triton.jit
def _qk_norm_rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
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
    eps,
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
        q_ptr, q_out_ptr, q_w_ptr, stride_qt, stride_qh, t, num_q_heads, cos, sin, half, eps,
        BLOCK_HQ, BLOCK_HALF, True,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, k_w_ptr, stride_kt, stride_kh, t, num_k_heads, cos, sin, half, eps,
        BLOCK_HK, BLOCK_HALF, True,
    )  # fmt: skip


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions; with norm weights, RMSNorm each head first.

    Args:
        positions: `[T]` int64.
        q: `[T, Hq, D]`, k: `[T, Hk, D]`; same dtype, last dim contiguous, D even (other strides
            free: q and k may be views split out of a fused qkv projection).
        cos_cache, sin_cache: `[max_positions, D/2]` float32, contiguous.
        q_norm_weight, k_norm_weight: `[D]` in q's dtype, both or neither: Qwen3's per-head
            q/k RMSNorm weights, applied before the rotation (`RMSNorm` then `RotaryEmbedding`).
        eps: the norms' epsilon, added to the mean square (unused without weights).

    Returns:
        new contiguous `(q, k)`, same shapes and dtype.

    Raises:
        ValueError: shapes or strides that do not fit, or only one of the norm weights.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    if (
        k.shape[0] != num_tokens
        or k.shape[2] != head_dim
        or head_dim % 2
        or k.dtype != q.dtype
        or q.stride(2) != 1
        or k.stride(2) != 1
        or cos_cache.shape[1] != half
        or not cos_cache.is_contiguous()
        or not sin_cache.is_contiguous()
    ):
        raise ValueError(f"rotary: q {tuple(q.shape)} k {tuple(k.shape)} cos {cos_cache.shape}")
    norm = q_norm_weight is not None
    if norm != (k_norm_weight is not None) or (
        norm
        and not all(
            w.shape == (head_dim,) and w.dtype == q.dtype and w.is_contiguous()
            for w in (q_norm_weight, k_norm_weight)
        )
    ):
        raise ValueError(
            "rotary: q_norm_weight and k_norm_weight must both be given ([D], q's dtype) or neither"
        )
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    blocks = dict(
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    if norm:
        _qk_norm_rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, q_norm_weight, k_norm_weight, positions, cos_cache, sin_cache,
            *strides, num_q_heads, k.shape[1], half, eps, **blocks,
        )  # fmt: skip
    else:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_cache, sin_cache,
            *strides, num_q_heads, k.shape[1], half, **blocks,
        )  # fmt: skip
    return q_out, k_out
