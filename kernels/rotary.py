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

With a `KVStore`, the same launch also writes each token's rotated K and its V into the paged
KV cache at its slot (what `kernels.store_kv` does as a separate launch): one kernel fewer per
layer, and the values are read straight from the fused qkv projection's output.

Reference: `tritonllm.layers.norm.RMSNorm` then `tritonllm.layers.rotary.RotaryEmbedding` on CPU
(and `kernels.reference.ref_store_kv` for the stored K/V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_wait
from kernels.rmsnorm import _normalize_and_weight
from kernels.store_kv import check_kv_args


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    w_ptr,
    cache_ptr,
    stride_xt,
    stride_xh,
    stride_c_slot,
    stride_c_head,
    t,
    slot,
    num_heads,
    cos,
    sin,
    half,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
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
    if STORE:  # also into the paged KV cache, at the token's slot
        cdt = cache_ptr.dtype.element_ty
        cdst = cache_ptr + slot * stride_c_slot + h[:, None].to(tl.int64) * stride_c_head
        tl.store(cdst + d[None, :], o1.to(dt).to(cdt), mask=mask)
        tl.store(cdst + half + d[None, :], o2.to(dt).to(cdt), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    num_q_heads,
    num_k_heads,
    half,
    eps,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # One program per token: all q heads, all k heads (and, with STORE, the token's K and V
    # into the cache). Without NORM the weight pointers are unused; without STORE the value
    # and cache pointers are.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * half + d, mask=d < half, other=0.0)
    sin = tl.load(sin_ptr + pos * half + d, mask=d < half, other=0.0)
    slot = tl.load(loc_ptr + t).to(tl.int64)  # without STORE loc_ptr is any [T] tensor
    _rotate_heads(
        q_ptr, q_out_ptr, q_w_ptr, q_out_ptr, stride_qt, stride_qh, 0, 0, t, slot,
        num_q_heads, cos, sin, half, eps, BLOCK_HQ, BLOCK_HALF, NORM, False,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, k_w_ptr, k_cache_ptr, stride_kt, stride_kh, stride_kc_slot,
        stride_kc_head, t, slot, num_k_heads, cos, sin, half, eps, BLOCK_HK, BLOCK_HALF, NORM,
        STORE,
    )  # fmt: skip
    if STORE:
        h = tl.arange(0, BLOCK_HK)
        mask = (h[:, None] < num_k_heads) & (d[None, :] < half)
        hv = h[:, None].to(tl.int64)
        src = v_ptr + t * stride_vt + hv * stride_vh + d[None, :]
        dst = v_cache_ptr + slot * stride_vc_slot + hv * stride_vc_head + d[None, :]
        vdt = v_cache_ptr.dtype.element_ty
        tl.store(dst, tl.load(src, mask=mask).to(vdt), mask=mask)
        tl.store(dst + half, tl.load(src + half, mask=mask).to(vdt), mask=mask)


@dataclass(frozen=True)
class KVStore:
    """Where `rotary` also writes the new tokens' K (after RoPE) and V: the paged cache.

    v: `[T, Hk, D]`, q's dtype, last dim contiguous (a view of a fused qkv is fine).
    k_cache, v_cache: `[num_pages, page_size, Hk, D]` with contiguous pages; slot `s` is
        `(s // page_size, s % page_size)`. Written in their dtype.
    out_cache_loc: `[T]` int64 (or int32), each token's slot.
    """

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out_cache_loc: torch.Tensor


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions; with norm weights, RMSNorm each head first;
    with `kv_store`, also write the rotated k and the values into the paged KV cache (what
    `kernels.store_kv.store_kv` would write, in the same launch).

    Args:
        positions: `[T]` int64.
        q: `[T, Hq, D]`, k: `[T, Hk, D]`; same dtype, last dim contiguous, D even (other strides
            free: q and k may be views split out of a fused qkv projection).
        cos_cache, sin_cache: `[max_positions, D/2]` float32, contiguous.
        q_norm_weight, k_norm_weight: `[D]` in q's dtype, both or neither: Qwen3's per-head
            q/k RMSNorm weights, applied before the rotation (`RMSNorm` then `RotaryEmbedding`).
        eps: the norms' epsilon, added to the mean square (unused without weights).
        kv_store: the values and the cache to store K and V into (see `KVStore`), or None.

    Returns:
        new contiguous `(q, k)`, same shapes and dtype.

    Raises:
        ValueError: shapes or strides that do not fit, or only one of the norm weights.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
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
    if norm != (k_norm_weight is not None) or not all(
        w is None or (w.shape == (head_dim,) and w.dtype == q.dtype and w.is_contiguous())
        for w in (q_norm_weight, k_norm_weight)
    ):
        raise ValueError(
            "rotary: q_norm_weight and k_norm_weight must both be given ([D], q's dtype) or neither"
        )
    if kv_store is not None:
        _check_store(kv_store, k)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    if norm:
        q_w, k_w = q_norm_weight, k_norm_weight
    else:
        q_w = k_w = q  # unused (NORM=False)
    if kv_store is not None:
        st = kv_store
        store_args = (st.v, st.k_cache, st.v_cache, st.out_cache_loc)
        store_strides = (
            st.v.stride(0), st.v.stride(1), st.k_cache.stride(1), st.k_cache.stride(2),
            st.v_cache.stride(1), st.v_cache.stride(2),
        )  # fmt: skip
    else:
        store_args = (k, k_out, k_out, positions)  # unused (STORE=False); positions is [T]
        store_strides = (0,) * 6
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, q_w, k_w, positions, cos_cache, sin_cache, *store_args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *store_strides,
        num_q_heads, num_k_heads, half, eps,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        NORM=norm,
        STORE=kv_store is not None,
        num_warps=4,
        **launch_options(q.device),
    )  # fmt: skip
    return q_out, k_out


def _check_store(store: KVStore, k: torch.Tensor) -> None:
    """Raise ValueError unless `store` fits keys `k` `[T, Hk, D]` (see `KVStore`)."""
    check_kv_args(k, store.v, store.k_cache, store.v_cache, store.out_cache_loc, "rotary kv_store")
    if store.v.stride(2) != 1:
        raise ValueError("rotary kv_store: v's last dim must be contiguous")
