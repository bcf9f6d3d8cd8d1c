"""When the layers use the Triton kernels in `kernels/` (RMSNorm, rotary, SiLU-mul, and the
sampler's fused Gumbel-max kernel `kernels/sampling.py`).

On CUDA each of these is one kernel instead of the 5-20 small kernels of the eager PyTorch
code, which matters most in CUDA-graph decode at small batch sizes, where launches, not bytes,
bound the step. The PyTorch code stays the path on CPU (and the reference the kernels are tested
against). `TRITONLLM_FUSED_LAYERS=0` turns all of them off, the sampler's too (for debugging).
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("TRITONLLM_FUSED_LAYERS", "1") != "0"


def use_fused(x: torch.Tensor) -> bool:
    """Whether a layer should run its Triton kernel on `x` (CUDA, 16/32-bit float)."""
    return ENABLED and x.is_cuda
