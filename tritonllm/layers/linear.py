"""`Linear`: `nn.Linear` whose CUDA forward runs, per shape, the faster of the skinny-GEMM Triton
kernel (`kernels.linear.skinny_linear`) and cuBLAS (`F.linear`).

Decode multiplies a handful of token rows by each weight, a memory-bound product where cuBLAS's
kernels leave bandwidth unused at some shapes and win at others (large M, some N/K). Rather than
guess, the first time a shape is seen outside a CUDA-graph capture both are timed on the actual
inputs (`kernels.linear.gpu_time_ms`: CUDA events, median of several runs with a cold L2) and
the winner is remembered per (M bucket, N, K, dtype, bias, device); M buckets are the decode
CUDA-graph batch sizes (1, 2, 4, 8, 16, 24, ..., 256), so the warm-up before each graph capture
decides the shapes that graph will contain. During a capture the remembered choice is used
(cuBLAS when there is none). M > 256, float32, autograd and CPU always take `F.linear`.

`TRITONLLM_LINEAR` (read at every CUDA forward): `cublas` (default: always `F.linear`; see
`DEFAULT_MODE` for why), `auto` (measure and choose), `triton` (the kernel wherever it applies). `auto` also takes
`F.linear` when `TRITONLLM_FUSED_LAYERS=0` (all layer kernels off). Each choice is logged once
at INFO.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.layers import fused

logger = logging.getLogger(__name__)

MODES = ("auto", "cublas", "triton")
# cuBLAS by default: on the H200 `kernels.bench_linear` (BENCHMARKS.md) found cuBLAS faster at
# most decode shapes of Qwen3-0.6B (the kernel wins only o_proj at M=1 and lm_head at M=1/32),
# so `auto` would mostly pick cuBLAS after ~175 timings at start-up.
DEFAULT_MODE = "cublas"
MAX_M = 256  # = kernels.linear.MAX_M (not imported here: CPU imports stay free of Triton)
# Triton must beat cuBLAS by this factor: near-ties (timing noise) keep the library.
_MARGIN = 0.97

# (M bucket, N, K, dtype, has bias, device) -> True when skinny_linear is faster.
_CHOICES: dict[tuple, bool] = {}


def linear_mode() -> str:
    """`TRITONLLM_LINEAR` lower-cased (`DEFAULT_MODE` when unset).

    Raises:
        ValueError: a value not in MODES.
    """
    mode = os.environ.get("TRITONLLM_LINEAR", "").strip().lower() or DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"TRITONLLM_LINEAR={mode!r}: expected one of {MODES}")
    return mode


def _applies(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether skinny_linear can compute this product (shape, dtype, layout, no autograd)."""
    if not 1 <= x2d.shape[0] <= MAX_M or x2d.dtype not in (torch.bfloat16, torch.float16):
        return False
    if weight.dtype != x2d.dtype or weight.stride(1) != 1:
        return False
    if bias is not None and bias.dtype != x2d.dtype:
        return False
    return not (torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad))


def _choose(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The remembered choice for this shape; measured now if new and not capturing."""
    from kernels.linear import gpu_time_ms, m_bucket, skinny_linear, tuned_config

    n, k = weight.shape
    key = (m_bucket(x2d.shape[0]), n, k, x2d.dtype, bias is not None, x2d.device)
    choice = _CHOICES.get(key)
    if choice is not None:
        return choice
    if torch.cuda.is_current_stream_capturing():
        return False  # timing would break the capture; not remembered
    cfg = tuned_config(x2d, weight, bias)
    t_cublas = gpu_time_ms(lambda: F.linear(x2d, weight, bias))
    t_triton = gpu_time_ms(lambda: skinny_linear(x2d, weight, bias, cfg))
    choice = _CHOICES[key] = t_triton < _MARGIN * t_cublas
    dtype = str(x2d.dtype).removeprefix("torch.")
    logger.info(
        "linear M<=%d N=%d K=%d %s: triton %.1f us (%s) vs cublas %.1f us -> %s",
        key[0],
        n,
        k,
        dtype,
        t_triton * 1e3,
        ",".join(f"{f}={v}" for f, v in cfg._asdict().items()),
        t_cublas * 1e3,
        "triton" if choice else "cublas",
    )
    return choice


def linear_choices() -> dict[tuple, bool]:
    """A copy of the remembered choices: (M bucket, N, K, dtype, has bias, device) -> True
    where skinny_linear runs."""
    return dict(_CHOICES)


class Linear(nn.Linear):
    """Drop-in `nn.Linear` (same constructor, parameters, state-dict names and CPU math) whose
    CUDA forward may run `kernels.linear.skinny_linear` (see module docstring).

    Input `[..., in_features]`, output `[..., out_features]`, x's dtype.

    Raises:
        ValueError: (CUDA forward) `TRITONLLM_LINEAR` set to an unknown mode.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return F.linear(x, self.weight, self.bias)
        mode = linear_mode()
        if mode == "cublas" or (mode == "auto" and not fused.ENABLED):
            return F.linear(x, self.weight, self.bias)
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        if not _applies(x2d, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        if mode == "auto" and not _choose(x2d, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        from kernels.linear import skinny_linear

        out = skinny_linear(x2d, self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])
