"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 like Hugging Face's Llama/Qwen, with
the residual add of a pre-norm decoder layer optionally folded in (vLLM/SGLang's residual
stream)."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.layers.fused import use_fused


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dimension.

    The statistic is computed in float32 and the weight is applied after casting back (the
    Hugging Face order). On CUDA one Triton kernel (`kernels.rmsnorm`) computes the same; with a
    residual, one kernel also does the add before it.

    Args:
        dim: the normalised (last) dimension.
        eps: added to the mean square.
        fused: run the Triton kernels on CUDA tensors (`LayerKernels.fused`).
    """

    def __init__(self, dim: int, eps: float = 1e-6, fused: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x`, or `x + residual` when a residual is given.

        Args:
            x: `[..., dim]` (with a residual: `[T, dim]` on the fused path, any shape otherwise).
            residual: None, or the residual stream, same shape and dtype as x.

        Returns:
            without a residual, `normed` (x's shape and dtype); with one,
            `(normed, new_residual)` where `new_residual = x + residual` rounded to the dtype
            (eager PyTorch's add) and `normed` is its norm. Inputs are never written.
        """
        if residual is None:
            return self._norm(x)
        if (
            use_fused(self.fused, x)
            and x.dim() == 2
            and x.dtype == residual.dtype == self.weight.dtype
            and x.shape == residual.shape
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
        ):
            from kernels.rmsnorm import fused_add_rmsnorm

            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if (
            use_fused(self.fused, x)
            and x.dim() in (2, 3)
            and x.dtype == self.weight.dtype
            and x.stride(-1) == 1
        ):
            from kernels.rmsnorm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
