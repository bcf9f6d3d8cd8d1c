"""Triton kernels: paged decode attention, split-K (flash-decoding) with a reduce kernel.

One query token per sequence. Stage 1 splits each sequence's KV range into `num_kv_splits`
chunks and computes, per (sequence, KV head, chunk), the attention of all query heads of that
GQA group over the chunk: the chunk's normalised output and its log-sum-exp. Stage 2 combines
the chunks with their softmax weights. Splitting the sequence axis keeps the whole GPU busy when
the batch is small and contexts are long. Algorithm: Flash-Decoding (Dao, Haziza, Massa, Sizov,
2023, "Flash-Decoding for long-context inference"); online softmax after FlashAttention-2
(Dao 2023). Log-sum-exps are kept in base 2 (scores are pre-multiplied by log2(e)).

Reference: `kernels.reference.ref_decode_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import interpreting
from kernels.paged_kv import load_kv_tile

# Triton's interpreter multiplies bf16 operands of tl.dot as raw uint16 bits (triton 3.6), so
# under the interpreter the dot operands are upcast to float32 first. Compiled kernels use the
# native bf16/fp16 tensor-core dot with float32 accumulation.
_UPCAST_DOT = interpreting()
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    sm_scale_log2,
    head_dim,
    page_size,
    num_kv_splits,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Chunks are whole multiples of BLOCK_N, so a short sequence uses only its first few
    # chunks; the rest are empty and write lse = -inf, o = 0.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h = tl.arange(0, BLOCK_H)
    h_mask = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: no (-inf) - (-inf)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
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
        qk = tl.where(n_mask[None, :], qk * sm_scale_log2, float("-inf"))
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

    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = b.to(tl.int64) * stride_ob + heads * stride_oh + split * stride_os
    tl.store(part_o_ptr + row[:, None] + d[None, :], o, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(
        part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_mask
    )


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    head_dim,
    num_kv_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_kv_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    lse = tl.load(
        part_lse_ptr + b * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all chunks empty (seq_len 0): output 0
    w = tl.exp2(lse - m)  # 0 for empty chunks
    o = tl.load(
        part_o_ptr + b * stride_ob + head * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + b * stride_outb + head * stride_outh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def default_num_kv_splits(
    batch_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    block_n: int = 64,
    max_splits: int = 32,
) -> int:
    """Chunks per sequence so that stage 1 has about two programs per SM.

    Never more chunks than `BLOCK_N`-token blocks in the longest sequence, nor `max_splits`.
    """
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = 4
    wanted = triton.cdiv(2 * num_sms, max(1, batch_size * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max(1, max_seq_len), block_n), max_splits))


def decode_workspace(
    batch_size: int, num_q_heads: int, num_kv_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 buffers: partial outputs `[B, Hq, S, D]` and log-sum-exps `[B, Hq, S]`, float32."""
    part_o = torch.empty(
        batch_size, num_q_heads, num_kv_splits, head_dim, dtype=torch.float32, device=device
    )
    part_lse = torch.empty(
        batch_size, num_q_heads, num_kv_splits, dtype=torch.float32, device=device
    )
    return part_o, part_lse


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Paged GQA decode attention: one query token per sequence over its cached tokens.

    Launches no host syncs, reads no device values on the host, and uses only the given
    buffers when `out`, `workspace` and `num_kv_splits` are given: safe to capture in a CUDA
    graph (chunk boundaries are computed on the GPU from `seq_lens`).

    Args:
        q: `[B, Hq, D]` bf16/fp16/fp32, last dim contiguous.
        k_cache, v_cache: `[num_pages, page_size, Hkv, D]`; `Hq % Hkv == 0`.
        page_table: `[B, max_pages]` int32, row b lists sequence b's pages in order.
        seq_lens: `[B]` int32, tokens of each sequence in the cache, including this step's.
        sm_scale: softmax scale, default `1/sqrt(D)`.
        num_kv_splits: chunks per sequence (stage-1 grid axis); default
            `default_num_kv_splits(...)` from `max_seq_len` (or the cache capacity).
        out: optional `[B, Hq, D]` output buffer (default: new, dtype of q).
        workspace: optional `(part_o [>=B, Hq, >=S, D], part_lse [>=B, Hq, >=S])` float32,
            e.g. from `decode_workspace`, with the same layout as that function's.
        max_seq_len: longest sequence (tokens), used only to pick `num_kv_splits`.
        block_n: tokens per inner-loop block (>= 16); default 64, or 32 for float32 inputs
            (their double-buffered K/V tiles are twice as large).

    Returns:
        `[B, Hq, D]` in q's dtype (or `out`).

    Raises:
        ValueError: shapes inconsistent, or a workspace too small.
    """
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)}")
    if page_table.shape[0] < batch or seq_lens.shape[0] < batch:
        raise ValueError("page_table/seq_lens have fewer rows than q")
    sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
    if block_n is None:
        block_n = 32 if q.dtype == torch.float32 else 64
    if num_kv_splits is None:
        max_seq_len = page_table.shape[1] * page_size if max_seq_len is None else max_seq_len
        num_kv_splits = default_num_kv_splits(batch, num_kv_heads, max_seq_len, q.device, block_n)
    if workspace is None:
        workspace = decode_workspace(batch, num_q_heads, num_kv_splits, head_dim, q.device)
    part_o, part_lse = workspace
    if part_o.stride(3) != 1 or part_lse.stride(2) != 1 or page_table.stride(1) != 1:
        raise ValueError("workspace and page_table need a contiguous last dim")
    if part_o.shape[0] < batch or part_o.shape[2] < num_kv_splits:
        raise ValueError(
            f"workspace {tuple(part_o.shape)} too small for B={batch}, splits={num_kv_splits}"
        )
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    group = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    _decode_stage1_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        part_o,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        sm_scale * _LOG2E,
        head_dim,
        page_size,
        num_kv_splits,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        UPCAST=_UPCAST_DOT,
        FP32_DOT=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    _decode_reduce_kernel[(batch, num_q_heads)](
        part_o,
        part_lse,
        out,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        num_kv_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_kv_splits)),
        BLOCK_D=block_d,
        num_warps=4 if head_dim >= 128 else 2,
    )
    return out
