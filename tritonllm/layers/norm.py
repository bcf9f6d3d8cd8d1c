"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 like Hugging Face's Llama/Qwen."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.fused import use_fused


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension.

    Input any shape `[..., dim]`; output same shape and dtype. The statistic is computed in
    float32 and the weight is applied after casting back (the Hugging Face order). On CUDA one
    Triton kernel (`kernels.rmsnorm`) computes the same.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x) and x.dim() in (2, 3) and x.dtype == self.weight.dtype:
            from kernels.rmsnorm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
