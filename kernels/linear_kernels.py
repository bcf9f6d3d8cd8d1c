"""Triton kernels of the skinny GEMM (`kernels.linear.skinny_linear`, which launches them).

`_skinny_linear_kernel`: program `(m, n, s)` computes one `[BLOCK_N, BLOCK_M]` tile of `out.T`
over K-range `s` (the algorithm: `kernels.linear`'s module docstring). With `split_k` == 1 it
writes the output; else it writes its float32 partial sum to a `[split_k, M, N]` workspace, and
the partials are added in a fixed order (deterministic, no float atomics), then the bias, with
one rounding to the output dtype, by one of:

- `_splitk_reduce_kernel`, a second launch (`FIXUP` off);
- the tile's last program (`FIXUP` on, one launch): each program of a tile increments the
  tile's int32 counter in `lock_ptr` after its partial is stored (acquire-release, GPU scope);
  the one that sees `split_k - 1` sums the partials (read from L2, which is where the other
  SMs' stores are coherent) and resets the counter to 0 for the next launch. No program waits
  for another, so no scheduling order can deadlock. This is the tile "fix-up" of stream-K
  (Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense Matrix-Matrix
  Multiplication on the GPU", 2023) and of CUTLASS's serial split-K, with the last arrival
  doing the whole reduction so that the order of the additions does not depend on arrival.
  The counters are shared by all launches on a device, so fix-up launches must not run
  concurrently on two streams (the engine runs its forward on one stream).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import pdl_wait


# M and split_k are not specialized (Triton would compile separate kernels for M == 1 and
# split_k == 1): one compiled kernel per tile configuration serves every M and split.
@triton.jit(do_not_specialize=["M", "split_k"])
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FIXUP: tl.constexpr,
    PDL: tl.constexpr,
):
    # Axis 0 is the M tile, so the programs that share a weight tile run side by side and all
    # but the first find it in L2.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_per_split
    offs_k = k_start + tl.arange(0, BLOCK_K)
    # Rows past N / M are clamped to row 0 instead of masked: the loads stay unpredicated
    # and the extra rows are dropped at the store.
    rows_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
    rows_m = tl.where(mask_m, offs_m, 0).to(tl.int64)
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    cols = tl.arange(0, BLOCK_M)
    pdl_wait(PDL)  # nothing above touches memory (`kernels.pdl`)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # An explicit num_stages makes Triton software-pipeline the loads of the dot-free path too
    # (cp.async into shared memory, NUM_STAGES - 1 tiles in flight), not only loads of a dot.
    # The last K-range may be shorter; with EVEN_K (K % BLOCK_K == 0, k_start a multiple of
    # BLOCK_K) every step is then whole and needs no mask.
    k_len = tl.minimum(k_per_split, K - k_start)
    for k in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):
        mask_k = (offs_k + k < K)[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=mask_k, other=0.0)
        if USE_DOT:
            if EVEN_K:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=mask_k, other=0.0)
            if UPCAST:
                acc = tl.dot(
                    w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee"
                )
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        else:
            wf = w.to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                # One broadcast multiply + row sum per token row (BLOCK_M <= 8), accumulated
                # in the weight tile's layout; rows past M re-read row M - 1 (not stored).
                row_i = tl.minimum(pid_m * BLOCK_M + i, M - 1).to(tl.int64)
                xi_ptrs = x_ptr + row_i * stride_xm + offs_k + k
                if EVEN_K:
                    xi = tl.load(xi_ptrs)
                else:
                    xi = tl.load(xi_ptrs, mask=offs_k + k < K, other=0.0)
                part = tl.sum(wf * xi.to(tl.float32)[None, :], axis=1)
                acc += tl.where(cols[None, :] == i, part[:, None], 0.0)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = mask_n[:, None] & mask_m[None, :]
    if split_k == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_ptrs = part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(part_ptrs, acc, mask=mask)
        if FIXUP:
            # The last program of this tile to arrive sums every partial (see module doc).
            # The barrier orders all threads' partial stores before the release of the
            # counter; the acquire plus L2-only (.cg) loads make the others' partials visible.
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in range(split_k):  # fixed order, as `_splitk_reduce_kernel`
                    rows = (s * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
                    acc += tl.load(part_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
                out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                tl.store(lock_ptr + tile, 0)  # reset: the next launch finds every counter at 0


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(
    part_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    split_k,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(split_k):  # fixed order: the result does not depend on program scheduling
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
