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
(deterministic, no atomics), then the bias, and rounds once to the output dtype; with
`fixup` the tile's last program does that reduction itself, in the same launch
(`kernels.linear_kernels`). `split_k` == 1 writes the output directly. Why split K rather than only shrink BLOCK_N: with
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

import kernels
from kernels.linear_configs import (
    MAX_M,
    LinearConfig,
    candidate_configs,
    gpu_time_ms,
    m_bucket,
    num_sms,
)
from kernels.linear_kernels import _skinny_linear_kernel, _splitk_reduce_kernel
from kernels.pdl import launch_options

logger = logging.getLogger(__name__)

_REDUCE_BLOCK = 1024
# Triton's interpreter (3.6) multiplies bf16 tl.dot operands as raw bits: upcast there (as
# kernels/decode_attention.py does). Compiled kernels use the bf16/fp16 tensor-core dot.
_UPCAST_DOT = kernels.interpreting()


_DUMMIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_LOCKS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_LOCKS = 1 << 16  # tile counters per device: more than any decode shape has tiles


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if (device, dtype) not in _DUMMIES:
        _DUMMIES[device, dtype] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMIES[device, dtype]


def _locks(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's int32 tile counters of fix-up launches, all 0 between launches (each
    launch's last programs reset theirs); grown only outside a CUDA-graph capture.

    Raises:
        ValueError: more tiles than counters while capturing (warm the shape up first).
    """
    buffers = _LOCKS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"skinny_linear: {tiles} fix-up tiles first seen inside a capture")
        # Smaller buffers stay allocated: captured CUDA graphs may still use them.
        buffers.append(torch.zeros(max(tiles, _MIN_LOCKS), dtype=torch.int32, device=device))
    return buffers[-1]


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
        else _dummy(x.device, torch.float32)
    )
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    fixup = cfg.fixup and split > 1
    # Always int32 pointers (like `part`'s float32), so the variants share compiled kernels.
    locks = _locks(x.device, grid[0] * grid[1]) if fixup else _dummy(x.device, torch.int32)
    pdl = launch_options(x.device)
    _skinny_linear_kernel[grid](
        x,
        weight,
        bias_arg,
        out,
        part,
        locks,
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
        FIXUP=fixup,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )
    if split > 1 and not fixup:
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
