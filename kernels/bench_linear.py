"""Decode GEMM bandwidth on the GPU: `skinny_linear` vs cuBLAS (`F.linear`) vs the copy roofline.

`python -m kernels.bench_linear` (CUDA only, about 30-60 s, most of it compiling and tuning the
kernel the first time). For Qwen3-0.6B's projections (bf16 `[N, K]` weights) and batch sizes
M in 1..256 it prints one table: the time per call of each implementation, replayed from a CUDA
graph as decode runs it, over enough copies of the weight that none is L2-resident; the weight
bytes read per second (and as a fraction of the device-to-device copy bandwidth measured in the
same run); the kernel configuration the tuner picked; and the side `Linear`'s chooser picks
(its own, quicker measurement). A `layer` row per M sums the four per-layer projections.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kernels.linear import gpu_time_ms, skinny_linear, tuned_config
from tritonllm.layers import linear as linear_layer

# name -> (N, K) of Qwen3-0.6B (hidden 1024, 16 q heads + 8 kv heads of 128, intermediate 3072).
SHAPES = {
    "qkv_proj": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up_proj": (6144, 1024),
    "down_proj": (1024, 3072),
    "lm_head": (151936, 1024),
}
LAYER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
BATCH_SIZES = (1, 8, 32, 64, 128, 256)
COLD_BYTES = 256 << 20  # weight copies per graph: at least this much, so reads miss L2


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of CUDA-event runs."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (gpu_time_ms(lambda: dst.copy_(src), runs=5) / 1e3)


def graph_time(fn: Callable[[Any], object], weights: Sequence[Any], reps: int = 10) -> float:
    """Seconds per `fn(w)`, from a CUDA graph that calls it once per weight copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * len(weights))


def _config_text(cfg) -> str:
    kind = "mma" if cfg.use_dot else "fma"
    return f"{kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps}"


@torch.inference_mode()
def main() -> None:
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write); bf16, graph-replayed")
    print(
        f"{'shape':>12} {'M':>4} {'cublas us':>9} {'triton us':>9} {'speedup':>7} "
        f"{'cublas TB/s':>11} {'triton TB/s':>11} {'of copy':>7}  {'config':<24} auto"
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer_sums: dict[int, list[float]] = {m: [0.0, 0.0, 0.0] for m in BATCH_SIZES}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, min(64, math.ceil(COLD_BYTES / nbytes)))
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(k)
            for _ in range(copies)
        ]
        for m in BATCH_SIZES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            expected = F.linear(x, weights[0])
            torch.testing.assert_close(skinny_linear(x, weights[0]), expected, atol=2e-2, rtol=2e-2)
            cfg = tuned_config(x, weights[0], None)
            t_cublas = graph_time(functools.partial(F.linear, x), weights)
            t_triton = graph_time(
                functools.partial(skinny_linear, x, bias=None, config=cfg), weights
            )
            auto = "triton" if linear_layer._choose(x, weights[0], None) else "cublas"
            if name in LAYER:
                sums = layer_sums[m]
                sums[0] += t_cublas
                sums[1] += t_triton
                sums[2] += min(t_cublas, t_triton)
            bw_c, bw_t = nbytes / t_cublas, nbytes / t_triton
            print(
                f"{name:>12} {m:4d} {t_cublas * 1e6:9.1f} {t_triton * 1e6:9.1f} "
                f"{t_cublas / t_triton:7.2f} {bw_c / 1e12:11.2f} {bw_t / 1e12:11.2f} "
                f"{bw_t / copy_bw:7.0%}  {_config_text(cfg):<24} {auto}",
                flush=True,
            )
        del weights
        torch.cuda.empty_cache()
    for m, (cublas, triton_t, best) in layer_sums.items():
        print(
            f"{'layer':>12} {m:4d} {cublas * 1e6:9.1f} {triton_t * 1e6:9.1f} "
            f"{cublas / triton_t:7.2f}  (best of both per shape: {best * 1e6:.1f} us)"
        )


if __name__ == "__main__":
    main()
