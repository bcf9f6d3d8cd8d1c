"""A decode layer's kernel chain on the GPU, with and without programmatic dependent launch.

`python -m kernels.bench_pdl` (CUDA, sm_90+; about a minute, most of it compiling and tuning).
Replays, from one CUDA graph, 28 layers of Qwen3-0.6B's decode step without attention (each
layer its own weights, so none is L2-resident): fused add + RMSNorm, qkv projection, o_proj (of
the qkv output's first 2,048 columns, standing in for the attention output), fused add +
RMSNorm, gate/up projection, SiLU-mul, down projection. That is 7 of the 10 kernels of a layer
and all of its weight reads. For each batch size M it prints the time per layer of each
variant and the time to read the layer's weights at the device-to-device copy bandwidth
measured in the same run:

- `cublas`: the projections in cuBLAS (`F.linear`), the other kernels without PDL;
- `cublas+pdl`: the same with PDL on the Triton kernels (`kernels.pdl`);
- `skinny`: the projections in `kernels.linear.skinny_linear` (tuned configurations), no PDL;
- `skinny+pdl`: the same with PDL on every kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import kernels.linear as klinear
from kernels import pdl
from kernels.bench_linear import copy_bandwidth, graph_time
from kernels.rmsnorm import fused_add_rmsnorm
from kernels.silu_mul import silu_mul

HIDDEN, QKV, Q, INTER = 1024, 4096, 2048, 3072
LAYERS = 28
BATCH_SIZES = (1, 8, 32, 64, 128, 256)
VARIANTS = ("cublas", "cublas+pdl", "skinny", "skinny+pdl")


def _layers(gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(k)

    return [
        {
            "qkv": w(QKV, HIDDEN),
            "o": w(HIDDEN, Q),
            "gate_up": w(2 * INTER, HIDDEN),
            "down": w(HIDDEN, INTER),
            "norm1": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
            "norm2": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
        }
        for _ in range(LAYERS)
    ]


def _forward(x, layers, linear):
    residual = x
    for p in layers:
        h, residual = fused_add_rmsnorm(x, residual, p["norm1"], 1e-6)
        qkv = linear(h, p["qkv"])
        o = linear(qkv[:, :Q], p["o"])
        h, residual = fused_add_rmsnorm(o, residual, p["norm2"], 1e-6)
        x = linear(silu_mul(linear(h, p["gate_up"])), p["down"])
    return x


def _ignoring_weight(x: torch.Tensor, layers: list, linear: Callable) -> Callable:
    """`_forward(x, layers, linear)` as `graph_time`'s `fn(weight)` (the weight is a dummy)."""
    return lambda _weight: _forward(x, layers, linear)


@torch.inference_mode()
def main() -> None:
    copy_bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = _layers(gen)
    weight_bytes = sum(
        p[n].numel() * 2 for n in ("qkv", "o", "gate_up", "down") for p in layers[:1]
    )
    bound_us = weight_bytes / copy_bw * 1e6
    print(
        f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; one layer's projections read "
        f"{weight_bytes / 1e6:.1f} MB = {bound_us:.1f} us at that bandwidth; us per layer:"
    )
    print(f"{'M':>4} " + " ".join(f"{v:>14}" for v in VARIANTS) + "   best vs cublas")

    def skinny(x, w):
        return klinear.skinny_linear(x, w)

    try:
        for m in BATCH_SIZES:
            x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = _forward(x, layers, F.linear)
            times = {}
            for variant in VARIANTS:
                pdl.set_enabled("pdl" in variant)
                linear = F.linear if variant.startswith("cublas") else skinny
                out = _forward(x, layers, linear)  # tunes the skinny GEMM outside the graph
                # 28 layers of bf16 roundings in another order drift apart a little; a kernel
                # that read its input before the previous kernel wrote it would be far off.
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 0.05, f"{variant} at M={m}: relative error {err:.3f}"
                # One graph of the whole 28-layer forward (graph_time's "weights": one dummy).
                seconds = graph_time(_ignoring_weight(x, layers, linear), [None], 20)
                times[variant] = seconds / LAYERS
            best = min(times, key=times.__getitem__)
            print(
                f"{m:4d} "
                + " ".join(f"{times[v] * 1e6:14.1f}" for v in VARIANTS)
                + f"   {best} {times['cublas'] / times[best]:.2f}x",
                flush=True,
            )
    finally:
        pdl.set_enabled(True)  # the process default


if __name__ == "__main__":
    main()
