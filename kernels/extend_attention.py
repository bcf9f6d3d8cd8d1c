"""Triton kernel: paged causal extend (prefill) attention.

Each sequence's new tokens (flat in the T axis, located by `cu_extend_lens`) attend causally to
the sequence's cached prefix and to the new tokens up to themselves. The new tokens' K/V must
already be in the paged cache (`store_kv` first), so prefix and new tokens are read alike through
the page table. One program handles `BLOCK_M` query rows of one head of one sequence and streams
KV blocks with the online softmax of FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning"); blocks past the causal diagonal of
the row block are never loaded.

Reference: `kernels.reference.ref_extend_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import interpreting
from kernels.paged_kv import load_kv_tile

# See kernels/decode_attention.py: the interpreter cannot tl.dot bf16 operands.
_UPCAST_DOT = interpreting()
_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    seq_lens_ptr,
    cu_extend_lens_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_ptb,
    sm_scale_log2,
    head_dim,
    page_size,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_extend_lens_ptr + b)
    extend_len = tl.load(cu_extend_lens_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix_len = seq_len - extend_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this sequence's new tokens
    row_mask = rows < extend_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this row block can see: positions < prefix_len + last row + 1 (causal), and none
    # when the block lies past the sequence's new tokens (grid is sized for the longest one).
    kv_end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
    kv_end = tl.where(m_block * BLOCK_M < extend_len, kv_end, 0)
    q_pos = prefix_len + rows

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no (-inf) - (-inf)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        k, v = load_kv_tile(
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
            UPCAST,
        )
        if FP32_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def _default_blocks(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): big tiles for 16-bit inputs on Ampere and newer; float32
    tiles are 4x smaller so their double-buffered K/V stay within shared memory."""
    big = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
    if big and dtype != torch.float32 and head_dim <= 128:
        return 128, 64, 8
    return 64, 32, 4


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_extend_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Paged causal GQA attention of new tokens over their sequence's prefix and themselves.

    Args:
        q: `[T, Hq, D]` bf16/fp16/fp32, last dim contiguous; sequence b's new tokens are rows
            `cu_extend_lens[b] : cu_extend_lens[b + 1]`.
        k_cache, v_cache: `[num_pages, page_size, Hkv, D]`, already holding the new tokens'
            K/V; `Hq % Hkv == 0`, query head h reads KV head `h // (Hq // Hkv)`.
        page_table: `[B, max_pages]` int32.
        seq_lens: `[B]` int32, prefix + new tokens of each sequence.
        cu_extend_lens: `[B + 1]` int32, offsets of each sequence's new tokens (0 new tokens
            is allowed).
        max_extend_len: the largest extend length (host int, sizes the grid).
        sm_scale: softmax scale, default `1/sqrt(D)`.
        out: optional `[T, Hq, D]` output buffer.
        block_m, block_n: query rows / KV tokens per block (>= 16; defaults by device).

    Returns:
        `[T, Hq, D]` in q's dtype (or `out`).

    Raises:
        ValueError: shapes inconsistent.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)}")
    if cu_extend_lens.shape[0] != batch + 1 or page_table.shape[0] < batch:
        raise ValueError("cu_extend_lens must be [B + 1] and page_table [>= B, max_pages]")
    if page_table.stride(1) != 1:
        raise ValueError("page_table needs a contiguous last dim")
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or max_extend_len <= 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    dm, dn, num_warps = _default_blocks(head_dim, q.dtype, q.device)
    block_m = block_m or dm
    block_n = block_n or dn
    grid = (batch, num_q_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        seq_lens,
        cu_extend_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        sm_scale * _LOG2E,
        head_dim,
        page_size,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        UPCAST=_UPCAST_DOT,
        FP32_DOT=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=2,
    )
    return out
