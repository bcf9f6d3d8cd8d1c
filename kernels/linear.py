"""Triton kernel: decode-sized GEMM ("skinny GEMM") `out = x @ weight.T + bias` for small M.

In decode every projection multiplies a few token rows (M = batch size, 1..256) by a weight of
MBs, so it is bound by reading the weight once from HBM, not by FLOPs. The kernel is built for
that: it streams the `[N, K]` weight along K in 16-byte vectors, computes in float32 and covers
every SM even when N is small (Qwen3-0.6B's o_proj/down_proj have N = 1024) by splitting K.

Each program computes one `[BLOCK_N, BLOCK_M]` tile of `out.T` over one K-range:

- `USE_DOT`: `tl.dot(w_tile, x_tile.T)` with the weight as the MMA's M operand ("swap AB", as
  in TensorRT-LLM's and CUTLASS's small-batch GEMMs), so N, not the tiny M, fills the 64-row
  MMA tile (wgmma on sm_90); M is padded to BLOCK_M >= 16 (tl.dot's minimum): the extra rows
  re-read a valid row and are never stored.
- not `USE_DOT` (M <= 8): a dot-free GEMV, one broadcast multiply + row sum per token row;
  no padding and no MMA operand staging.

Both paths stream the weight through `num_stages`-deep software pipelining (cp.async into
shared memory on sm_80/sm_90, several tiles in flight per program).

Split-K (`split_k` > 1): program `(m, n, s)` writes its float32 partial sum of K-range `s` to a
`[split_k, M, N]` workspace and `_splitk_reduce_kernel` adds the partials in a fixed order
(deterministic, no atomics), then the bias, and rounds once to the output dtype.
`split_k` == 1 writes the output directly. Why split K rather than only shrink BLOCK_N: with
N = 1024 even BLOCK_N = 8 leaves ~1 program per SM, each walking all of K with only its own
pipeline in flight (latency-bound); splitting K 4-16 ways gives 2-4 programs per SM with 1-2
pipelined steps each, for a workspace of `split_k * M * N * 4` bytes (32 KB at M = 1, read
back from L2) and a second small kernel. The tuner also tries `split_k = 1` for every tile, so
shapes whose tiles alone fill the GPU (lm_head, large M) skip the reduce.

On sm_90+ both kernels launch with programmatic dependent launch (`kernels.pdl`).

Configurations are picked per shape by timing a few candidates on the GPU (`tuned_config`, once
per (M bucket, N, K, dtype, bias); the candidates and the timer are `kernels.linear_configs`);
`tritonllm.layers.linear.Linear` then decides per shape between this kernel and cuBLAS.
Reference: `torch.nn.functional.linear` (float32 math).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

import kernels
from kernels.linear_configs import (
    MAX_M,
    LinearConfig,
    candidate_configs,
    gpu_time_ms,
    m_bucket,
    num_sms,
)
from kernels.pdl import launch_options, pdl_wait

logger = logging.getLogger(__name__)

_REDUCE_BLOCK = 1024
# Triton's interpreter (3.6) multiplies bf16 tl.dot operands as raw bits: upcast there (as
# kernels/decode_attention.py does). Compiled kernels use the bf16/fp16 tensor-core dot.
_UPCAST_DOT = kernels.interpreting()


# M and split_k are not specialized (Triton would compile separate kernels for M == 1 and
# split_k == 1): one compiled kernel per tile configuration serves every M and split.
@triton.jit(do_not_specialize=["M", "split_k"])
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
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


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy_f32(device: torch.device) -> torch.Tensor:
    if device not in _DUMMIES:
        _DUMMIES[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _DUMMIES[device]


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: LinearConfig
) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty K-range
    # Always a float32 pointer, so split and no-split launches share one compiled kernel.
    part = (
        torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        if split > 1
        else _dummy_f32(x.device)
    )
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    pdl = launch_options(x.device)
    _skinny_linear_kernel[grid](
        x,
        weight,
        bias_arg,
        out,
        part,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        k_per_split,
        split,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None,
        UPCAST=_UPCAST_DOT,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )
    if split > 1:
        _splitk_reduce_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK))](
            part,
            bias_arg,
            out,
            m,
            n,
            out.stride(0),
            split,
            BLOCK=_REDUCE_BLOCK,
            HAS_BIAS=bias is not None,
            num_warps=4,
            **pdl,
        )
    return out


_TUNED: dict[tuple, LinearConfig] = {}


def tuned_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearConfig:
    """The fastest of `candidate_configs` for this (M bucket, N, K, dtype, bias), timed once
    with `gpu_time_ms` on these inputs and remembered. Without timing (Triton's interpreter,
    or while the current stream is capturing a CUDA graph) it returns the remembered
    configuration, else the first candidate, without remembering it."""
    (m, k), n = x.shape, weight.shape[0]
    key = (m_bucket(m), n, k, x.dtype, bias is not None, x.device)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    candidates = candidate_configs(m, n, k, num_sms(x.device))
    if kernels.interpreting() or not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    times = [
        gpu_time_ms(functools.partial(_launch, x, weight, bias, c), runs=7) for c in candidates
    ]
    cfg = candidates[min(range(len(candidates)), key=times.__getitem__)]
    logger.debug("skinny_linear M<=%d N=%d K=%d: %s (%.1f us)", key[0], n, k, cfg, min(times) * 1e3)
    _TUNED[key] = cfg
    return cfg


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LinearConfig | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` for small M, float32 accumulation, as `F.linear` computes it.

    Args:
        x: `[M, K]` bf16/fp16, last dim contiguous, M <= 256 (`MAX_M`; any M works, but
            larger M is compute-bound and slower than cuBLAS).
        weight: `[N, K]` same dtype, last dim contiguous (`nn.Linear.weight`).
        bias: `[N]` same dtype, or None.
        config: a launch configuration (tests, benchmarks); default `tuned_config`, which on
            the first call for a shape times the candidates (synchronizes the device).

    Returns:
        `[M, N]` contiguous, x's dtype; sums in float32, one rounding at the end (so results
        differ from cuBLAS only by the order of the float32 additions).

    Raises:
        ValueError: bad ranks, shapes, dtypes, strides or devices.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: shapes {tuple(x.shape)} x {tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"skinny_linear: dtypes {x.dtype}, {weight.dtype} (bf16/fp16 only)")
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.device != weight.device:
        raise ValueError("skinny_linear: x and weight need a contiguous last dim, one device")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"skinny_linear: bias {tuple(bias.shape)} {bias.dtype}")
    if bias is not None:
        bias = bias.contiguous()
    return _launch(x, weight, bias, config or tuned_config(x, weight, bias))


__all__ = [
    "MAX_M",
    "LinearConfig",
    "candidate_configs",
    "gpu_time_ms",
    "m_bucket",
    "skinny_linear",
    "tuned_config",
]
