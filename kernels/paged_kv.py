"""Device-side helper shared by the paged attention kernels: loading one K/V tile.

A tile is `BLOCK_N` consecutive token positions of one sequence and one KV head. Positions map
to cache slots through the sequence's page table row: slot = page_table[pos // page_size] *
page_size + pos % page_size (the layout of `tritonllm.engine.kv_cache`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    pt_row,
    pos,
    n_mask,
    d,
    d_mask,
    kv_head,
    page_size,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    UPCAST: tl.constexpr,
):
    """K and V of the positions `pos` (`[BLOCK_N]` int) of one KV head, as two
    `[BLOCK_N, BLOCK_D]` tiles (cache dtype, or float32 with `UPCAST`); masked-out positions
    (`n_mask` false) and head dims (`d_mask` false) read 0. `pt_row` points at the sequence's
    page-table row (int32 page ids)."""
    page = tl.load(pt_row + pos // page_size, mask=n_mask, other=0).to(tl.int64)
    off = pos % page_size
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_cache_ptr
        + page[:, None] * stride_kp
        + off[:, None] * stride_ks
        + kv_head * stride_kh
        + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr
        + page[:, None] * stride_vp
        + off[:, None] * stride_vs
        + kv_head * stride_vh
        + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
