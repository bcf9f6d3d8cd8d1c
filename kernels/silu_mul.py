"""Triton kernel: SwiGLU's `silu(gate) * up` from the fused `[T, 2I]` gate/up projection.

Rounding as PyTorch's eager `F.silu(gate) * up` in a 16-bit dtype: silu in float32, rounded to
the input dtype, then the product in float32, rounded. SwiGLU: Shazeer, 2020.

Reference: `tritonllm.layers.mlp.SwiGLUMLP` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_wait


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xt, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate_up[:, :I]) * gate_up[:, I:]`.

    Args:
        gate_up: `[T, 2I]`, last dim contiguous.

    Returns:
        `[T, I]` contiguous, same dtype.

    Raises:
        ValueError: not 2-D with an even, contiguous last dim.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: bad input {tuple(gate_up.shape)} {gate_up.stride()}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up,
        out,
        gate_up.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
        **launch_options(gate_up.device),
    )
    return out
