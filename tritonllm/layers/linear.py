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

Each `Linear` has a `mode`, fixed at construction (`EngineConfig.linear_kernel`, through
`LayerKernels.linear_mode`): `cublas` (default: always `F.linear`;
`tritonllm.config.LINEAR_KERNELS` says why), `auto` (measure and choose), `triton` (the kernel
wherever it applies). Each choice of `auto` is logged once at INFO.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.config import LINEAR_KERNELS

logger = logging.getLogger(__name__)

MAX_M = 256  # = kernels.linear.MAX_M (not imported here: CPU imports stay free of Triton)
# Triton must beat cuBLAS by this factor: near-ties (timing noise) keep the library.
_MARGIN = 0.97

# (M bucket, N, K, dtype, has bias, device) -> True when skinny_linear is faster.
_CHOICES: dict[tuple, bool] = {}


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


class Linear(nn.Linear):
    """Drop-in `nn.Linear` (same parameters, state-dict names and CPU math; the constructor
    adds `mode`) whose CUDA forward may run `kernels.linear.skinny_linear` (see module
    docstring).

    Input `[..., in_features]`, output `[..., out_features]`, x's dtype.

    Args:
        in_features, out_features, bias, device, dtype: as for `nn.Linear`.
        mode: one of `tritonllm.config.LINEAR_KERNELS` (default "cublas").

    Raises:
        ValueError: an unknown `mode`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        mode: str = "cublas",
    ) -> None:
        if mode not in LINEAR_KERNELS:
            raise ValueError(f"Linear mode must be one of {LINEAR_KERNELS}, got {mode!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = self.mode
        if mode == "cublas" or not x.is_cuda:
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
