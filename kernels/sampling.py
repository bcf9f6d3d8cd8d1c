"""Triton kernels: one-pass sampling from `softmax(logits / T)` by the Gumbel-max trick.

`argmax_v(logits_v / T + G_v)` with `G_v` i.i.d. standard Gumbel is a sample of
`softmax(logits / T)` (Gumbel 1954; used for sampling e.g. by Maddison et al. 2014, "A*
sampling"). It needs no softmax, no normalisation and no second pass: each element is read once,
perturbed and raced. The sampler's PyTorch path draws `argmax(p / E)`, `E ~ Exp(1)`, the same race
in another form (`G = -log E`).

Two kernels:

1. `_gumbel_chunk_kernel`, grid `(B, num_chunks)`: each program takes a chunk of `iters * BLOCK`
   columns of one row, `BLOCK` per loop iteration, keeps a running per-lane maximum of the
   perturbed scores (and its column) in registers, and reduces it once at the end, writing the
   chunk's maximum and its lowest maximal column to a `[B, num_chunks]` scratch. `iters` (a
   runtime argument: one compiled variant) grows with the batch (`iters_for`) so that there are
   enough programs to fill the GPU (a single row of V = 151,936 at BLOCK = 1024 gives 149
   programs) without a block-wide reduction and a program per 1,024 columns at large batches.
   The logarithms use the hardware's approximate `lg2` (`_log2`). Before both changes (one
   reduction per 1,024 columns, libdevice's accurate `log`: ~150 instructions per logit) the
   kernel was compute-bound, several times slower than reading its logits (BENCHMARKS.md,
   "Session 6 diagnostics").
2. `_chunk_argmax_kernel`, grid `(B,)`: the argmax over a row's chunks.

Randomness: Philox keyed by `seed`. One Philox call (`tl.randint4x`) yields four 32-bit numbers,
so each iteration splits its `BLOCK` columns into four contiguous quarters, and column
`q * BLOCK/4 + j` of iteration `i` of chunk `c` of row `b` takes output `q` of counter
`offset + ((b * num_chunks + c) * iters + i) * BLOCK/4 + j` (64-bit): a call uses
`B * counters_per_row(V, BLOCK, iters)` counters, a quarter of the elements. The caller passes a
fresh `(seed, offset)` each call (the sampler uses `offset = step << 32`). A call may instead
key each row by its own seed and counter base (`row_seeds`, `row_offsets`): a seeded request's
draws then depend on its seed and position only, not on its batch (`tritonllm.engine.sampler`).
The uniform `u` (a
multiple of 2^-31 in [0, 1)) is shifted by 2^-32 into (0, 1), and `E = -log(1 - u)` is computed
with a series for small `u`, so that small `E` (large `G = -log E`, the tail that decides which
unlikely token wins) keeps full relative precision instead of the 2^-24 grid of `1 - u` near 1.
`G` lies in about [-2.8, 22.2]: finite, so a `-inf` logit stays `-inf` and is never chosen.

Logits may be float32, bfloat16 or float16: each element is widened to float32 in registers, so
the model's bfloat16 logits need no float32 copy first (at batch 190 that copy alone wrote
115 MB per decode step).

Tested in `tests/test_sampling_kernel.py` against `torch.argmax` (greedy rows) and a binomial
oracle on `softmax(logits / T)` (sampled rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

import kernels

# Columns per loop iteration of the first kernel.
BLOCK = 1024
# Most iterations per program (chunk = iters * BLOCK columns).
MAX_ITERS = 8
# Programs the first kernel aims for: two waves of an H200's 132 SMs.
TARGET_PROGRAMS = 264
# Logit dtypes the kernel reads (widened to float32 in registers).
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def iters_for(batch: int, vocab: int, block: int = BLOCK) -> int:
    """Iterations per program for a `[batch, vocab]` call: the largest power of two <= MAX_ITERS
    that still leaves about TARGET_PROGRAMS programs and a chunk no wider than the row (1 at
    batch 1, 8 from batch 16 on for Qwen3's vocab)."""
    iters = 1
    while (
        iters < MAX_ITERS
        and 2 * iters * block <= vocab  # a chunk no wider than the row
        and batch * triton.cdiv(vocab, 2 * iters * block) >= TARGET_PROGRAMS
    ):
        iters *= 2
    return iters


def counters_per_row(vocab: int, block: int = BLOCK, iters: int = 1) -> int:
    """Philox counters one row of `vocab` logits uses per call: one per 4 columns of each
    `iters * block`-column chunk, padding included (`ceil(vocab / (iters * block)) * iters *
    block / 4`)."""
    return triton.cdiv(vocab, iters * block) * iters * (block // 4)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """`log2(x)`: with FAST the hardware's `lg2.approx.ftz.f32` (one MUFU op, absolute error
    about 2^-22), else Triton's accurate libdevice polynomial (~20 FMAs; the interpreter has only
    this one). The accurate one had made the kernel compute-bound (~150 instructions per
    logit)."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _neg_log1m(u, FAST: tl.constexpr):
    """`-log(1 - u)` for u in (0, 1), accurate to float32 rounding of u even when u is tiny (a
    series below 1/64, where `1 - u` would lose u's low bits)."""
    series = u * (1.0 + u * (0.5 + u * (0.3333333333 + u * 0.25)))  # next term u^5/5
    return tl.where(u < 0.015625, series, -_log2(1.0 - u, FAST) * 0.6931471805599453)


@triton.jit
def _to_uniform(bits):
    """32 random bits -> float32 in [0, 1), a multiple of 2^-31 (what `tl.rand` returns for the
    same bits: the sign is folded away, then the 31 bits are scaled by 1 / 2^31 less an ulp)."""
    x = bits.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x * 4.6566127342e-10


@triton.jit
def _race_quarter(
    logits_row,
    cols,
    vocab,
    bits,
    scale,
    best,
    best_col,
    SAMPLED: tl.constexpr,
    FAST: tl.constexpr,
):
    """Fold one quarter's perturbed scores (columns `cols`, Philox outputs `bits`) into the
    running per-lane maximum `best` and its column `best_col`. Sampled scores are in base 2:
    `x * scale - log2(E)` with `scale = log2(e) / T`, i.e. `log2(e) * (x / T + G)`, the same
    order as `x / T + G`. Columns reach a lane in increasing order and only a strictly greater
    score replaces the kept one, so each lane keeps its lowest maximal column."""
    x = tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    score = x
    if SAMPLED:
        u = _to_uniform(bits) + 2.3283064365386963e-10  # + 2^-32: u in (0, 1)
        score = x * scale - _log2(_neg_log1m(u, FAST), FAST)
    take = score > best
    return tl.where(take, score, best), tl.where(take, cols, best_col)


@triton.jit(do_not_specialize=["num_chunks", "seed", "offset", "iters"])
def _gumbel_chunk_kernel(
    logits_ptr,
    inv_temp_ptr,
    row_seed_ptr,
    row_offset_ptr,
    chunk_val_ptr,
    chunk_idx_ptr,
    stride_row,
    vocab,
    num_chunks,
    inv_temp,
    seed,
    offset,
    iters,
    BLOCK: tl.constexpr,
    PER_ROW_TEMP: tl.constexpr,
    PER_ROW_SEED: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    QUARTER: tl.constexpr = BLOCK // 4
    if PER_ROW_TEMP:
        inv_temp = tl.load(inv_temp_ptr + row)
    if PER_ROW_SEED:  # the row's own key and counter base: its draws ignore the rest of the call
        seed = tl.load(row_seed_ptr + row)
        row_base = tl.load(row_offset_ptr + row)
    else:
        row_base = offset + row * num_chunks * iters * QUARTER
    scale = inv_temp * 1.4426950408889634  # log2(e) / T: scores in base 2
    j = tl.arange(0, QUARTER)
    logits_row = logits_ptr + row * stride_row
    start = chunk * iters * BLOCK
    # Per lane: the best score so far and its column (padding columns score -inf and never
    # replace it, so an all--inf chunk keeps its first columns).
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_col = start + j
    for i in range(iters):
        base = start + i * BLOCK
        if inv_temp > 0:
            # One Philox counter per 4 columns of the row, by the column's block (chunk * iters
            # + i): the same whatever `iters` is (64-bit: the base may use the high word);
            # greedy rows (inv_temp == 0) draw nothing.
            counter = row_base + (chunk * iters + i) * QUARTER + j
            r0, r1, r2, r3 = tl.randint4x(seed, counter)
            best, best_col = _race_quarter(
                logits_row, base + j, vocab, r0, scale, best, best_col, True, FAST_LOG
            )
            best, best_col = _race_quarter(
                logits_row, base + QUARTER + j, vocab, r1, scale, best, best_col, True, FAST_LOG
            )
            best, best_col = _race_quarter(
                logits_row, base + 2 * QUARTER + j, vocab, r2, scale, best, best_col, True, FAST_LOG
            )
            best, best_col = _race_quarter(
                logits_row, base + 3 * QUARTER + j, vocab, r3, scale, best, best_col, True, FAST_LOG
            )
        else:  # greedy: plain scores (`j` stands in for the unused bits)
            for q in tl.static_range(4):
                best, best_col = _race_quarter(
                    logits_row,
                    base + q * QUARTER + j,
                    vocab,
                    j,
                    scale,
                    best,
                    best_col,
                    False,
                    FAST_LOG,
                )
    # The chunk's maximum, then its lowest column among the lanes holding it.
    top = tl.max(best, axis=0)
    col = tl.min(tl.where(best == top, best_col, 2147483647), axis=0)
    out = row * num_chunks + chunk
    tl.store(chunk_val_ptr + out, top)
    tl.store(chunk_idx_ptr + out, col)


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
    iters: int | None = None,
    row_seeds: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row: a sample of `softmax(logits * inv_temperature)`, or the argmax.

    Row `b` returns `argmax_v(logits[b, v] * inv_temperature[b] + G[b, v])` with `G` i.i.d.
    standard Gumbel from Philox (`seed`, counters `offset + b * counters_per_row(V, block,
    iters)` on, four columns per counter; module docstring), i.e. a sample of
    `softmax(logits[b] * inv_temperature[b])`; rows whose inverse temperature is 0.0 are greedy:
    exactly `logits[b].argmax()` (no noise). No host sync; every launch is asynchronous.

    Ties go to the lowest index, as `torch.argmax` documents ("the indices of the first maximal
    value"); ties only happen in greedy rows or between -inf scores. A `-inf` logit is never
    chosen unless the whole row is `-inf`, in which case index 0 is returned. NaN logits give an
    unspecified index (torch.argmax would pick the first NaN).

    The same `(seed, offset)` gives the same draws; the caller must not reuse the counters of a
    previous call (`[offset, offset + B * counters_per_row(V, block, iters))`) to get fresh ones.
    Inside a CUDA graph the seed and offset are frozen at capture (every replay draws the same
    noise), so today's caller runs it eagerly.

    With `row_seeds` and `row_offsets`, row `b` is keyed by `row_seeds[b]` and its counters
    start at `row_offsets[b]` instead (`seed` and `offset` are unused): column `v` takes output
    `(v % block) // (block / 4)` of counter `row_offsets[b] + (v // block) * block / 4 + v %
    (block / 4)`, so a row's draws depend on its key, base and `block` alone, not on its place
    in the call, the batch size or `iters`. `row_offsets[b] = offset + b * counters_per_row(V,
    block, iters)` and `row_seeds[b] = seed` give exactly the draws of the shared form.

    Args:
        logits: `[B, V]` float32, bfloat16 or float16, last dim contiguous (row stride free);
            not modified.
        inv_temperature: `[B]` float32 on the logits' device (1 / temperature, 0.0 = greedy), or
            one Python float for every row (no copy to the device needed).
        seed: Philox key, an integer in [-2^63, 2^63).
        offset: Philox counter base, an integer >= 0 with
            `offset + B * counters_per_row(V, block, iters) < 2^63`.
        block: columns per loop iteration (a power of two, at least 4); tests use small blocks
            to get several chunks out of a small vocab.
        iters: iterations per program (1 to MAX_ITERS); default `iters_for(B, V, block)`.
        row_seeds: `[B]` int64 Philox keys, one per row, on the logits' device (None: `seed`
            for every row); given together with `row_offsets`.
        row_offsets: `[B]` int64 counter bases >= 0, one per row (`row_offsets[b] +
            counters_per_row(V, block, 1) < 2^63`).

    Returns:
        `[B]` int64 token ids on the logits' device.

    Raises:
        ValueError: logits not a 2-D float32/bfloat16/float16 tensor with a contiguous last
            dim, or inv_temperature not a `[B]` float32 tensor on the same device, V == 0,
            block not a power of two >= 4, iters outside 1..MAX_ITERS, or only one of
            row_seeds / row_offsets given, or either not `[B]` int64 on the logits' device.
    """
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES or logits.stride(1) != 1:
        raise ValueError(
            "gumbel_argmax: logits must be [B, V] float32, bfloat16 or float16 with a "
            "contiguous last dim, got "
            f"{tuple(logits.shape)} {logits.dtype} stride {logits.stride()}"
        )
    batch, vocab = logits.shape
    per_row = isinstance(inv_temperature, torch.Tensor)
    if isinstance(inv_temperature, torch.Tensor) and (
        inv_temperature.shape != (batch,)
        or inv_temperature.dtype != torch.float32
        or inv_temperature.device != logits.device
    ):
        raise ValueError(
            f"gumbel_argmax: inv_temperature must be [{batch}] float32 on {logits.device}, got "
            f"{tuple(inv_temperature.shape)} {inv_temperature.dtype} on {inv_temperature.device}"
        )
    if block < 4 or block & (block - 1) or vocab == 0:
        raise ValueError(
            f"gumbel_argmax: need a power-of-two block >= 4 and V > 0, got {block}, {vocab}"
        )
    per_row_seed = row_seeds is not None or row_offsets is not None
    for name, t in (("row_seeds", row_seeds), ("row_offsets", row_offsets)):
        if per_row_seed and (
            t is None or t.shape != (batch,) or t.dtype != torch.int64 or t.device != logits.device
        ):
            got = None if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device}"
            raise ValueError(
                f"gumbel_argmax: {name} must be [{batch}] int64 on {logits.device} with both of "
                f"row_seeds and row_offsets given, got {got}"
            )
    if iters is None:
        iters = iters_for(batch, vocab, block)
    if not 1 <= iters <= MAX_ITERS:
        raise ValueError(f"gumbel_argmax: iters must be in 1..{MAX_ITERS}, got {iters}")
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    num_chunks = triton.cdiv(vocab, iters * block)
    chunk_val = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_chunk_kernel[(batch, num_chunks)](
        logits,
        inv_temperature if per_row else logits,  # unused pointer when one float for all rows
        row_seeds if per_row_seed else logits,  # unused pointers without per-row seeds
        row_offsets if per_row_seed else logits,
        chunk_val,
        chunk_idx,
        logits.stride(0),
        vocab,
        num_chunks,
        0.0 if per_row else float(inv_temperature),
        seed,
        offset,
        iters,
        BLOCK=block,
        PER_ROW_TEMP=per_row,
        PER_ROW_SEED=per_row_seed,
        FAST_LOG=not kernels.interpreting(),
        num_warps=max(1, min(4, block // 256)),
    )
    _chunk_argmax_kernel[(batch,)](
        chunk_val,
        chunk_idx,
        out,
        num_chunks,
        # sized for one iteration per program, so every iteration count shares one variant
        BLOCK_C=triton.next_power_of_2(triton.cdiv(vocab, block)),
        num_warps=1,
    )
    return out
