"""Programmatic dependent launch (`kernels.pdl`): when it is on, and that a chain of PDL kernels
replayed from a CUDA graph computes exactly what the same kernels compute launched one by one
without PDL (a kernel that touched memory before waiting for its predecessor would read stale
inputs or race with it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from kernels import pdl

HAS_CUDA = torch.cuda.is_available()


def test_pdl_is_off_on_cpu_and_in_the_interpreter():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or kernels.interpreting(), reason="needs CUDA")
def test_pdl_switch_follows_the_device_and_the_engine_config():
    """On by default where the device can; `EngineConfig.pdl=False` (env `TRITONLLM_PDL=0` for
    the Triton model) turns it off for the process when the engine starts."""
    from test_engine_helpers import checkpoint

    from tritonllm.config import EngineConfig
    from tritonllm.engine.model_runner import ModelRunner

    device = torch.device("cuda")
    capable = torch.cuda.get_device_capability()[0] >= 9
    try:
        assert pdl.enabled(device) is capable
        assert pdl.launch_options(device) == (
            {"PDL": True, "launch_pdl": True} if capable else {"PDL": False}
        )
        config = EngineConfig(
            model=checkpoint("qwen3"), device="cuda", num_pages=16, cuda_graph=False, pdl=False
        )
        ModelRunner(config)
        assert not pdl.enabled(device)
        assert pdl.launch_options(device) == {"PDL": False}
        ModelRunner(dataclasses.replace(config, pdl=True))
        assert pdl.enabled(device) is capable
    finally:
        pdl.set_enabled(True)


def _chain(x, residual, weights):
    """Two decoder-layer-like rounds of every PDL kernel: add + RMSNorm, skinny GEMM (split-K
    and not), SiLU-mul, RMSNorm over heads, q/k-norm + RoPE with the K/V store."""
    from kernels.linear import LinearConfig, skinny_linear
    from kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
    from kernels.rotary import KVStore, rotary
    from kernels.silu_mul import silu_mul

    w_qkv, w_gate_up, w_down, norm, cos, sin, k_cache, v_cache, loc, positions = weights
    split = LinearConfig(True, 16, 64, 128, 4, 4, 4)  # split-K 4: GEMM + reduce kernel
    whole = LinearConfig(True, 16, 64, 128, 1, 4, 4)
    outs = []
    for _ in range(2):
        h, residual = fused_add_rmsnorm(x, residual, norm, 1e-6)
        qkv = skinny_linear(h, w_qkv, None, split).view(-1, 24, 128)
        q, k, v = qkv[:, :16], qkv[:, 16:20], qkv[:, 20:]
        q_normed = rmsnorm(q, norm[:128], 1e-6)  # RMSNorm over strided heads
        q_out, k_out = rotary(
            positions,
            q,
            k,
            cos,
            sin,
            norm[:128],
            norm[128:256],
            1e-6,
            kv_store=KVStore(v, k_cache, v_cache, loc),
        )
        gate_up = skinny_linear(h, w_gate_up, None, whole)
        x = skinny_linear(silu_mul(gate_up), w_down, None, split) + q_out.view(len(x), -1)[:, :1024]
        outs += [x, residual, q_normed, q_out, k_out]
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or kernels.interpreting(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16])
def test_pdl_chain_in_a_cuda_graph_matches_plain_launches(m):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    gen = torch.Generator(device="cuda").manual_seed(m)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, **bf16) * scale

    weights = (
        rand(3072, 1024, scale=0.03),  # qkv: 16 q + 4 k + 4 v heads of 128
        rand(6144, 1024, scale=0.03),
        rand(1024, 3072, scale=0.02),
        rand(1024) + 1,
        torch.rand(64, 64, generator=gen, device="cuda"),
        torch.rand(64, 64, generator=gen, device="cuda"),
        torch.zeros(8, 16, 4, 128, **bf16),
        torch.zeros(8, 16, 4, 128, **bf16),
        torch.randperm(128, generator=gen, device="cuda")[:m],
        torch.randint(0, 64, (m,), generator=gen, device="cuda"),
    )
    x, residual = rand(m, 1024), rand(m, 1024)
    k_cache, v_cache = weights[6], weights[7]

    pdl.set_enabled(False)
    try:
        expected = [t.clone() for t in _chain(x, residual, weights)]
    finally:
        pdl.set_enabled(True)
    expected_caches = (k_cache.clone(), v_cache.clone())

    k_cache.zero_()
    v_cache.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(x, residual, weights)  # compiles the PDL variants outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(x, residual, weights)
    for _ in range(3):
        k_cache.zero_()
        v_cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, expected, strict=True):
            assert torch.equal(got, want)
        assert torch.equal(k_cache, expected_caches[0])
        assert torch.equal(v_cache, expected_caches[1])
