"""Triton kernels: one-pass sampling from `softmax(logits / T)` by the Gumbel-max trick.

`argmax_v(logits_v / T + G_v)` with `G_v` i.i.d. standard Gumbel is a sample of
`softmax(logits / T)` (Gumbel 1954; used for sampling e.g. by Maddison et al. 2014, "A*
sampling"). It needs no softmax, no normalisation and no second pass: each element is read once,
perturbed and raced. The sampler's PyTorch path draws `argmax(p / E)`, `E ~ Exp(1)`, the same race
in another form (`G = -log E`).

Two kernels:

1. `_gumbel_chunk_kernel`, grid `(B, num_chunks)`: each program takes `BLOCK` columns of one
   row and writes the maximum of its perturbed scores and that column to a `[B, num_chunks]`
   scratch. A single row is thus spread over the whole GPU (V = 151,936 and BLOCK = 1024 give 149
   programs), unlike a softmax or argmax with one block per row.
2. `_chunk_argmax_kernel`, grid `(B,)`: the argmax over a row's chunks.

Randomness: Philox (`tl.rand`) keyed by `seed`, counter `offset + row * V + column` (64-bit), so
a call draws `B * V` numbers and the caller passes a fresh `(seed, offset)` each call (the
sampler uses `offset = step << 32`). The uniform `u` (a multiple of 2^-31 in [0, 1)) is shifted by
2^-32 into (0, 1), and `E = -log(1 - u)` is computed with a series for small `u`, so that small
`E` (large `G = -log E`, the tail that decides which unlikely token wins) keeps full relative
precision instead of the 2^-24 grid of `1 - u` near 1. `G` lies in about [-2.8, 22.2]: finite,
so a `-inf` logit stays `-inf` and is never chosen.

Tested in `tests/test_sampling_kernel.py` against `torch.argmax` (greedy rows) and a binomial
oracle on `softmax(logits / T)` (sampled rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program of the first kernel.
BLOCK = 1024


@triton.jit
def _neg_log1m(u):
    """`-log(1 - u)` for u in (0, 1), accurate to float32 rounding of u even when u is tiny."""
    series = u * (1.0 + u * (0.5 + u * (0.3333333333 + u * 0.25)))  # next term u^5/5
    return tl.where(u < 0.015625, series, -tl.log(1.0 - u))


@triton.jit(do_not_specialize=["seed", "offset"])
def _gumbel_chunk_kernel(
    logits_ptr,
    inv_temp_ptr,
    chunk_val_ptr,
    chunk_idx_ptr,
    stride_row,
    vocab,
    num_chunks,
    inv_temp,
    seed,
    offset,
    BLOCK: tl.constexpr,
    PER_ROW_TEMP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf"))
    if PER_ROW_TEMP:
        inv_temp = tl.load(inv_temp_ptr + row)
    score = x
    if inv_temp > 0:
        # Counter: one per (row, column) of this call; 64-bit, so offset may use the high word.
        u = tl.rand(seed, offset + row * vocab + cols) + 2.3283064365386963e-10  # + 2^-32
        gumbel = -tl.log(_neg_log1m(u))
        score = x * inv_temp + gumbel
    # Padding columns are -inf: with ties (greedy rows, all--inf rows) the lowest column wins.
    best, pos = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = row * num_chunks + chunk
    tl.store(chunk_val_ptr + out, best)
    tl.store(chunk_idx_ptr + out, chunk * BLOCK + pos)


@triton.jit
def _chunk_argmax_kernel(chunk_val_ptr, chunk_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    vals = tl.load(chunk_val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    # Chunks are in column order and each holds its lowest maximal column: the leftmost maximal
    # chunk gives the row's lowest maximal column.
    _, pos = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    idx = tl.load(chunk_idx_ptr + row * num_chunks + pos)
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor | float,
    seed: int,
    offset: int,
    block: int = BLOCK,
) -> torch.Tensor:
    """One token per row: a sample of `softmax(logits * inv_temperature)`, or the argmax.

    Row `b` returns `argmax_v(logits[b, v] * inv_temperature[b] + G[b, v])` with `G` i.i.d.
    standard Gumbel from Philox (`seed`, counter `offset + b * V + v`), i.e. a sample of
    `softmax(logits[b] * inv_temperature[b])`; rows whose inverse temperature is 0.0 are greedy:
    exactly `logits[b].argmax()` (no noise). No host sync; every launch is asynchronous.

    Ties go to the lowest index, as `torch.argmax` documents ("the indices of the first maximal
    value"); ties only happen in greedy rows or between -inf scores. A `-inf` logit is never
    chosen unless the whole row is `-inf`, in which case index 0 is returned. NaN logits give an
    unspecified index (torch.argmax would pick the first NaN).

    The same `(seed, offset)` gives the same draws; the caller must not reuse the counters of a
    previous call (`[offset, offset + B * V)`) to get fresh ones. Inside a CUDA graph the seed
    and offset are frozen at capture (every replay draws the same noise), so today's caller runs
    it eagerly.

    Args:
        logits: `[B, V]` float32, last dim contiguous (row stride free); not modified.
        inv_temperature: `[B]` float32 on the logits' device (1 / temperature, 0.0 = greedy), or
            one Python float for every row (no copy to the device needed).
        seed: Philox key, an integer in [-2^63, 2^63).
        offset: Philox counter base, an integer >= 0 with `offset + B * V < 2^63`.
        block: columns per program (a power of two); tests use small blocks to get several
            chunks out of a small vocab.

    Returns:
        `[B]` int64 token ids on the logits' device.

    Raises:
        ValueError: logits not a 2-D float32 tensor with a contiguous last dim, or
            inv_temperature not a `[B]` float32 tensor on the same device, V == 0, or block not
            a power of two.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"gumbel_argmax: logits must be [B, V] float32 with a contiguous last dim, got "
            f"{tuple(logits.shape)} {logits.dtype} stride {logits.stride()}"
        )
    batch, vocab = logits.shape
    per_row = isinstance(inv_temperature, torch.Tensor)
    if per_row and (
        inv_temperature.shape != (batch,)
        or inv_temperature.dtype != torch.float32
        or inv_temperature.device != logits.device
    ):
        raise ValueError(
            f"gumbel_argmax: inv_temperature must be [{batch}] float32 on {logits.device}, got "
            f"{tuple(inv_temperature.shape)} {inv_temperature.dtype} on {inv_temperature.device}"
        )
    if block < 1 or block & (block - 1) or vocab == 0:
        raise ValueError(
            f"gumbel_argmax: need a power-of-two block and V > 0, got {block}, {vocab}"
        )
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    num_chunks = triton.cdiv(vocab, block)
    chunk_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_chunk_kernel[(batch, num_chunks)](
        logits,
        inv_temperature if per_row else logits,  # unused pointer when one float for all rows
        chunk_val,
        chunk_idx,
        logits.stride(0),
        vocab,
        num_chunks,
        0.0 if per_row else float(inv_temperature),
        seed,
        offset,
        BLOCK=block,
        PER_ROW_TEMP=per_row,
        num_warps=max(1, min(4, block // 256)),
    )
    _chunk_argmax_kernel[(batch,)](
        chunk_val,
        chunk_idx,
        out,
        num_chunks,
        BLOCK_C=triton.next_power_of_2(num_chunks),
        num_warps=1,
    )
    return out
