"""Triton kernel: scatter the new tokens' K/V into the paged KV cache.

Reference: `kernels.reference.ref_store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per new token: all of its KV heads at once.
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_kc_slot + h[:, None] * stride_kc_head + d[None, :]
    v_dst = v_cache_ptr + slot * stride_vc_slot + h[:, None] * stride_vc_head + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    prefix: str = "store_kv",
) -> None:
    """Raise ValueError (message starting with `prefix`) unless new keys/values `[T, Hkv, D]`
    and their slots `[T]` fit the caches (see `store_kv`)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or out_cache_loc.shape != (num_tokens,):
        raise ValueError(
            f"{prefix}: shape mismatch: k {tuple(k.shape)} v {tuple(v.shape)} "
            f"out_cache_loc {tuple(out_cache_loc.shape)}"
        )
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{prefix}: cache shape {tuple(k_cache.shape)} does not match k {tuple(k.shape)}"
        )
    check_cache(k_cache)
    check_cache(v_cache)


def check_cache(cache: torch.Tensor) -> None:
    """Raise ValueError unless `cache` is `[num_pages, page_size, Hkv, D]` with a contiguous
    head dim and contiguous pages (slot `s` at `(s // page_size, s % page_size)`)."""
    pages, page_size, _, _ = cache.shape
    if cache.stride(3) != 1 or (pages > 1 and cache.stride(0) != page_size * cache.stride(1)):
        raise ValueError("KV cache must be [num_pages, page_size, Hkv, D] with contiguous pages")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Write the new tokens' keys and values into the paged cache.

    Args:
        k, v: `[T, Hkv, D]`, any float dtype, last dim contiguous (views of a fused qkv are
            fine); cast to the cache dtype.
        k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, slot `s` is
            `(s // page_size, s % page_size)`; pages must be contiguous in memory.
        out_cache_loc: `[T]` int64 (or int32), the slot of each token.

    Raises:
        ValueError: mismatched shapes or a non-contiguous cache/head dim.
    """
    check_kv_args(k, v, k_cache, v_cache, out_cache_loc)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        out_cache_loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )
