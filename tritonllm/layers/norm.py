"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 like Hugging Face's Llama/Qwen."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension.

    Input any shape `[..., dim]`; output same shape and dtype. The statistic is computed in
    float32 and the weight is applied after casting back (the Hugging Face order).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
