"""Which of the Triton kernels in `kernels/` the layers run (`LayerKernels`).

On CUDA the RMSNorm, rotary and SiLU-mul layers (and the sampler's Gumbel-max pass,
`kernels/sampling.py`) each run one kernel instead of the 5-20 small kernels of their eager
PyTorch code, which matters most in CUDA-graph decode at small batch sizes, where launches, not
bytes, bound the step. The PyTorch code stays the path on CPU (and the reference the kernels are
tested against). `EngineConfig.fused_layers=False` turns all of them off (for debugging) and
`EngineConfig.linear_kernel` picks the GEMM of `Linear`; the engine passes both to the model's
constructor, and each layer keeps its own switch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKernels:
    """The kernel choices of a model's layers (from `EngineConfig`).

    Attributes:
        fused: run the layers' Triton kernels on CUDA tensors (`EngineConfig.fused_layers`).
        linear: `Linear`'s GEMM on CUDA, one of `tritonllm.config.LINEAR_KERNELS`
            (`EngineConfig.linear_kernel`).
    """

    fused: bool = True
    linear: str = "cublas"

    @property
    def linear_mode(self) -> str:
        """The mode `Linear` runs: `linear`, except that "auto" takes cuBLAS with the layer
        kernels off (all Triton kernels off, as before)."""
        return "cublas" if self.linear == "auto" and not self.fused else self.linear


def use_fused(enabled: bool, x: torch.Tensor) -> bool:
    """Whether a layer whose kernel switch is `enabled` should run its Triton kernel on `x`
    (a CUDA tensor)."""
    return enabled and x.is_cuda
