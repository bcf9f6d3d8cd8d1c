"""SwiGLU feed-forward block (Shazeer, 2020) with a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.distributed import TensorParallelGroup
from tritonllm.layers.fused import LayerKernels, use_fused
from tritonllm.layers.linear import Linear
from tritonllm.layers.parallel import RowParallelLinear


class SwiGLUMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`; `gate_up_proj` holds [gate; up] stacked on the output dim.

    Input `[T, hidden]`, output `[T, hidden]`, same dtype.

    Args:
        hidden_size, intermediate_size: the block's widths.
        kernels: the layers' kernel choices (SiLU-mul kernel, the projections' `Linear` mode;
            default `LayerKernels()`).
        tp: a tensor-parallel group: `intermediate_size` is then this rank's columns
            (gate/up column-parallel) and `down_proj` is row-parallel (one all-reduce).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        kernels: LayerKernels | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        kernels = kernels or LayerKernels()
        self.intermediate_size = intermediate_size
        self.fused = kernels.fused
        mode = kernels.linear_mode
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, mode=mode)
        self.down_proj: Linear
        if tp is None:
            self.down_proj = Linear(intermediate_size, hidden_size, bias=False, mode=mode)
        else:
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_fused(self.fused, gate_up) and gate_up.dim() == 2:
            from kernels.silu_mul import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
