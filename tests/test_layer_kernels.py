"""The layers' Triton kernels (`kernels.rmsnorm`, `kernels.rotary`, `kernels.silu_mul`) against
the layers' own PyTorch code, their reference.

On CUDA (marked `gpu`) the kernels are compiled and the tolerance is one rounding step of the
dtype; on CPU they run in Triton's interpreter on small shapes. Inputs are strided views like the
ones the model passes (q/k heads split out of the fused qkv projection).
"""

from __future__ import annotations

import pytest
import torch

import kernels

pytest.importorskip("triton")
from kernels.rmsnorm import rmsnorm  # noqa: E402
from kernels.rotary import rotary  # noqa: E402
from kernels.silu_mul import silu_mul  # noqa: E402
from tritonllm.layers import (  # noqa: E402
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    fused,  # noqa: E402
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not kernels.interpreting(), reason="needs the interpreter")
    ),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="CUDA")]),
]
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _reference(module, *args):
    """The module's PyTorch path, on the CPU copy of the inputs."""
    enabled, fused.ENABLED = fused.ENABLED, False
    try:
        return module(*args)
    finally:
        fused.ENABLED = enabled


def _qkv(num_tokens, hq, hk, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim, generator=gen).to(dtype).to(device)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    return q.view(num_tokens, hq, head_dim), k.view(num_tokens, hk, head_dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_kernel_matches_layer_on_rows_and_strided_heads(device, dtype):
    norm = RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=torch.Generator().manual_seed(1)))
    norm = norm.to(dtype)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = _reference(norm, x)
    got = rmsnorm(x.to(device), norm.weight.to(device), 1e-6).cpu()
    torch.testing.assert_close(got, expected, **_tol(dtype))
    q, _ = _qkv(3, 4, 2, 48, dtype, "cpu")
    assert not q.is_contiguous()
    got = rmsnorm(
        q.to(device) if device == "cpu" else _qkv(3, 4, 2, 48, dtype, device)[0],
        norm.weight.to(device),
        1e-6,
    )
    torch.testing.assert_close(got.cpu(), _reference(norm, q), **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kernel_matches_layer(device, dtype):
    rope = RotaryEmbedding(32, 64, 1e6, None)
    q, k = _qkv(6, 4, 2, 32, dtype, "cpu", seed=3)
    positions = torch.tensor([0, 1, 7, 30, 63, 5])
    exp_q, exp_k = _reference(rope, positions, q, k)
    dq, dk = _qkv(6, 4, 2, 32, dtype, device, seed=3)
    got_q, got_k = rotary(
        positions.to(device), dq, dk, rope.cos_cache.to(device), rope.sin_cache.to(device)
    )
    torch.testing.assert_close(got_q.cpu(), exp_q, **_tol(dtype))
    torch.testing.assert_close(got_k.cpu(), exp_k, **_tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel_matches_layer(device, dtype):
    mlp = SwiGLUMLP(16, 40).to(dtype)
    gate_up = torch.randn(4, 80, generator=torch.Generator().manual_seed(4)).to(dtype) * 3
    gate, up = gate_up.split(40, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = silu_mul(gate_up.to(device)).cpu()
    torch.testing.assert_close(got, expected, **_tol(dtype))
    assert mlp.intermediate_size == 40
