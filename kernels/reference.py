"""Plain PyTorch references for the Triton kernels: slow, obvious, float32 math.

Every Triton kernel in this package is tested against the function here with the same
signature. Cache layout (ARCHITECTURE.md): `[num_pages, page_size, num_kv_heads, head_dim]` per
layer; token j of sequence b lives in page `page_table[b, j // page_size]` at offset
`j % page_size`.
"""

from __future__ import annotations

import torch


def ref_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Write `k`/`v` `[T, Hkv, D]` into the caches at slots `out_cache_loc` `[T]` int64."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[out_cache_loc] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[out_cache_loc] = v.to(v_cache.dtype)


def _gather_seq(cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """`[seq_len, Hkv, D]` float32: the first `seq_len` tokens of one sequence's pages."""
    page_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    return cache[pages[pos // page_size].long(), pos % page_size].float()


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q `[M, Hq, D]`, k/v `[N, Hkv, D]`, mask `[M, N]` bool → `[M, Hq, D]` float32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(dim=-1), v)


def ref_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole cached sequence.

    Args:
        q: `[B, Hq, D]`.
        k_cache, v_cache: `[num_pages, page_size, Hkv, D]`.
        page_table: `[B, max_pages]` int32.
        seq_lens: `[B]` int32, tokens of each sequence in the cache (>= 1).
        sm_scale: softmax scale, default `1/sqrt(D)`.

    Returns:
        `[B, Hq, D]` in `q.dtype`.
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = _gather_seq(k_cache, page_table[b], seq_len)
        v = _gather_seq(v_cache, page_table[b], seq_len)
        mask = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, mask, sm_scale)[0].to(q.dtype)
    return out


def ref_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_extend_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    The K/V of the new tokens must already be in the cache. New token i (0-based) of sequence b
    sits at position `prefix_len + i`, `prefix_len = seq_len - extend_len`, and attends to cache
    positions `0 .. prefix_len + i`.

    Args:
        q: `[T, Hq, D]`, the new tokens of all sequences, sequence after sequence.
        k_cache, v_cache: `[num_pages, page_size, Hkv, D]`.
        page_table: `[B, max_pages]` int32.
        seq_lens: `[B]` int32, prefix + new tokens.
        cu_extend_lens: `[B + 1]` int32, offsets of each sequence's new tokens in T.
        sm_scale: softmax scale, default `1/sqrt(D)`.

    Returns:
        `[T, Hq, D]` in `q.dtype`.
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    cu = cu_extend_lens.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        prefix_len = seq_len - (end - start)
        k = _gather_seq(k_cache, page_table[b], seq_len)
        v = _gather_seq(v_cache, page_table[b], seq_len)
        q_pos = prefix_len + torch.arange(end - start, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        out[start:end] = _attend(q[start:end], k, v, mask, sm_scale).to(q.dtype)
    return out


def ref_apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """`kernels.token_bitmask.apply_token_bitmask`, one token at a time: logits row
    ``rows[i]``, token ``t`` becomes -inf unless bit ``t % 32`` of ``bitmask[i, t // 32]`` is
    set (no such word: disallowed)."""
    words = bitmask.shape[1]
    for i, row in enumerate(rows.tolist()):
        mask_row = bitmask[i].tolist()
        for t in range(logits.shape[1]):
            if t // 32 >= words or not (mask_row[t // 32] >> (t % 32)) & 1:
                logits[row, t] = float("-inf")
