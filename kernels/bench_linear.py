"""Decode GEMMs on the GPU: cuBLAS (`F.linear`) against each skinny-GEMM candidate family.

`python -m kernels.bench_linear [--models qwen3-0.6b,qwen3-8b] [--batch-sizes 1,2,...,256]
[--json FILE]` (CUDA only). For the projections of each model (bf16 `[N, K]` weights: fused
qkv, o_proj, fused gate/up, down_proj, lm_head) and each M bucket, every configuration of
`kernels.linear_sweep.sweep_configs` is checked against `F.linear` and timed as decode runs it:
replayed from a CUDA graph that calls it once per weight copy, over enough copies that none is
L2-resident. The families' distinct kernels are compiled first, in parallel processes (Triton's
on-disk cache then serves this process).

Prints one row per shape and M: cuBLAS and each family's best time (us), the best candidate's
speedup over cuBLAS, its weight bytes per second (and fraction of the device-to-device copy
bandwidth measured in the same run) and its configuration; then per model and M the four
projections of a layer summed (cuBLAS vs the best of everything per shape). The JSON (rewritten
after every shape, so a cut-short run keeps what it measured) holds every timing and a
`choices` list, one per (model, shape, M bucket): the implementation that won (a candidate
must beat cuBLAS by `tritonllm.layers.linear`'s margin, as `TRITONLLM_LINEAR_KERNEL=auto` demands) and
its `LinearConfig`, enough to drive a per-shape choice without timing at start-up.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.linear import LinearConfig, gpu_time_ms, skinny_linear
from kernels.linear_sweep import FAMILIES, compile_key, sweep_configs
from tritonllm.layers import linear as linear_layer

# model -> shape name -> (N, K): Qwen3-0.6B (hidden 1024, 16 q + 8 kv heads of 128,
# intermediate 3072) and Qwen3-8B (hidden 4096, 32 q + 8 kv heads of 128, intermediate 12288).
MODELS = {
    "qwen3-0.6b": {
        "qkv_proj": (4096, 1024),
        "o_proj": (1024, 2048),
        "gate_up_proj": (6144, 1024),
        "down_proj": (1024, 3072),
        "lm_head": (151936, 1024),
    },
    "qwen3-8b": {
        "qkv_proj": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up_proj": (24576, 4096),
        "down_proj": (4096, 12288),
        "lm_head": (151936, 4096),
    },
}
LAYER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COLD_BYTES = 256 << 20  # weight copies per graph: at least this much, so reads miss L2


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of CUDA-event runs."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (gpu_time_ms(lambda: dst.copy_(src), runs=5) / 1e3)


def graph_time(fn, weights: list[torch.Tensor], reps: int = 10) -> float:
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
    del graph
    return start.elapsed_time(end) / 1e3 / (reps * len(weights))


def config_text(cfg: LinearConfig) -> str:
    """`mma 16x64x128 s4 w4 st4` (+ ` fix`): kind, tile, split, warps, stages, fix-up."""
    kind = "mma" if cfg.use_dot else "fma"
    text = f"{kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.split_k} "
    text += f"w{cfg.num_warps} st{cfg.num_stages}"
    return text + (" fix" if cfg.fixup and cfg.split_k > 1 else "")


def _compile(items: list[tuple[LinearConfig, int, int]]) -> int:
    """Launch each (config, N, K) once on a one-row problem: compiles it into Triton's cache."""
    tensors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    done = 0
    for cfg, n, k in items:
        if (n, k) not in tensors:
            tensors[n, k] = (
                torch.zeros(1, k, dtype=torch.bfloat16, device="cuda"),
                torch.zeros(n, k, dtype=torch.bfloat16, device="cuda"),
            )
        try:
            skinny_linear(*tensors[n, k], None, cfg)
            done += 1
        except Exception as exc:  # noqa: BLE001 (the sweep reports it for that configuration)
            print(f"compile {config_text(cfg)}: {type(exc).__name__}: {exc}", flush=True)
    torch.cuda.synchronize()
    return done


def compile_items(points: list[tuple[int, int, int]], sms: int) -> list[tuple]:
    """One (config, N, K) per distinct kernel the sweep of `points` ((M, N, K) each) launches.
    N is capped at 4096 (it does not change the compiled kernel: every N here is a multiple
    of 16), so the compile launches stay small."""
    todo: dict[tuple, tuple[LinearConfig, int, int]] = {}
    for m, n, k in points:
        for configs in sweep_configs(m, n, k, sms).values():
            for cfg in configs:
                todo.setdefault(compile_key(cfg, k), (cfg, min(n, 4096), k))
    return list(todo.values())


def precompile(points: list[tuple[int, int, int]], sms: int, workers: int) -> int:
    """Compile `compile_items(points, sms)` in `workers` spawned processes (into Triton's
    on-disk cache, which this process then reads); returns how many."""
    items = compile_items(points, sms)
    if workers <= 1 or len(items) < 2:
        return _compile(items)
    chunks = [items[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, ctx) as pool:
        return sum(pool.map(_compile, [c for c in chunks if c]))


def measure_point(
    x: torch.Tensor, weights: list[torch.Tensor], families: dict[str, list[LinearConfig]]
) -> dict:
    """cuBLAS and every candidate on one (shape, M): `{"cublas_us", "families": {family:
    {"us", "config", "wrong"}}}` (a family's best; `wrong`: configurations whose result
    differed from `F.linear`, or that failed to compile or launch, which are not timed)."""
    expected = F.linear(x, weights[0])
    scale = expected.float().abs().max().item()
    out = {"cublas_us": graph_time(lambda w: F.linear(x, w), weights) * 1e6, "families": {}}
    for family, configs in families.items():
        best: tuple[float, LinearConfig] | None = None
        wrong = []
        for cfg in configs:
            try:
                got = skinny_linear(x, weights[0], None, cfg)
            except Exception as exc:  # noqa: BLE001 (e.g. more shared memory than the GPU has)
                wrong.append(f"{config_text(cfg)} ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            if not torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale):
                wrong.append(config_text(cfg))
                continue
            t = graph_time(lambda w, c=cfg: skinny_linear(x, w, None, c), weights) * 1e6
            if best is None or t < best[0]:
                best = (t, cfg)
        out["families"][family] = {
            "us": best[0] if best else None,
            "config": best[1]._asdict() if best else None,
            "wrong": wrong,
        }
    return out


def best_of(point: dict) -> tuple[str, float, dict | None]:
    """(winner, its us, its config): a candidate wins only under `_MARGIN` x cuBLAS."""
    timed = [(f["us"], name, f["config"]) for name, f in point["families"].items() if f["us"]]
    if timed:
        us, name, cfg = min(timed, key=lambda t: t[0])
        if us < linear_layer._MARGIN * point["cublas_us"]:
            return name, us, cfg
    return "cublas", point["cublas_us"], None


def _header(families: list[str]) -> str:
    cells = "".join(f"{f + ' us':>10}" for f in families)
    return (
        f"{'model':>10} {'shape':>12} {'M':>4} {'cublas us':>10}{cells} {'best':>7} "
        f"{'speedup':>7} {'TB/s':>5} {'of copy':>7}  config"
    )


def run(
    models: dict[str, dict[str, tuple[int, int]]],
    batch_sizes: list[int],
    families: list[str],
    sms: int,
    copy_bw: float,
    json_path: str | None = None,
    device: str = "cuda",
) -> dict:
    """Measure every (model, shape, M) point and print its row; per model, the layer sums.

    Returns:
        `{"device", "date", "copy_bandwidth", "margin", "points", "layers", "choices"}` (the
        JSON, also written to `json_path` after each shape when given).
    """
    result = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bandwidth": copy_bw,
        "margin": linear_layer._MARGIN,
        "points": [],
        "layers": [],
        "choices": [],
    }
    print(_header(families), flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for model, shapes in models.items():
            layer = {m: [0.0, 0.0] for m in batch_sizes}  # cuBLAS, best per shape
            for name, (n, k) in shapes.items():
                nbytes = n * k * 2
                copies = max(1, min(64, math.ceil(COLD_BYTES / nbytes)))
                weights = [
                    torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen)
                    / math.sqrt(k)
                    for _ in range(copies)
                ]
                for m in batch_sizes:
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
                    configs = sweep_configs(m, n, k, sms)
                    point = measure_point(x, weights, {f: configs[f] for f in families})
                    winner, us, cfg = best_of(point)
                    point.update(model=model, shape=name, n=n, k=k, m=m, winner=winner)
                    result["points"].append(point)
                    result["choices"].append(
                        {"model": model, "shape": name, "n": n, "k": k, "m_bucket": m}
                        | {"impl": "cublas" if cfg is None else "triton", "config": cfg}
                    )
                    if name in LAYER:
                        layer[m][0] += point["cublas_us"]
                        layer[m][1] += us
                    print(_row(point, families, us, cfg, nbytes, copy_bw), flush=True)
                del weights
                if device == "cuda":
                    torch.cuda.empty_cache()
                if json_path:
                    Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
            for m, (cublas, best) in layer.items():
                if not best:
                    continue  # no projection of a layer among the shapes run
                result["layers"].append(
                    {"model": model, "m": m, "cublas_us": cublas, "best_us": best}
                )
                print(
                    f"{model:>10} {'layer':>12} {m:4d} {cublas:10.1f}  best per shape "
                    f"{best:.1f} us ({cublas / best:.2f}x)"
                )
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _row(point: dict, families: list[str], us: float, cfg: dict | None, nbytes: int, bw: float):
    cells = "".join(f"{point['families'][f]['us'] or float('nan'):10.1f}" for f in families)
    shown = config_text(LinearConfig(**cfg)) if cfg else "-"
    wrong = sum(len(f["wrong"]) for f in point["families"].values())
    tbs = nbytes / us / 1e6
    return (
        f"{point['model']:>10} {point['shape']:>12} {point['m']:4d} {point['cublas_us']:10.1f}"
        f"{cells} {point['winner']:>7} {point['cublas_us'] / us:7.2f} {tbs:5.2f} "
        f"{tbs / (bw / 1e12):7.0%}  {shown}" + (f"  ({wrong} WRONG)" if wrong else "")
    )


def wrong_results(result: dict) -> list[str]:
    """`model shape M: config` of every candidate whose result differed from `F.linear`."""
    return [
        f"{p['model']} {p['shape']} M={p['m']}: {w}"
        for p in result["points"]
        for f in p["families"].values()
        for w in f["wrong"]
    ]


def main(argv: list[str] | None = None) -> int:
    """CLI: the sweep on CUDA. Exit status 1 when any candidate computed a wrong result (it was
    left out of the timings; the lines are printed)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--shapes", default="", help="only these shape names (default: all)")
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--compile-workers", type=int, default=min(16, (os.cpu_count() or 2) - 1))
    args = p.parse_args(argv)
    models = {m: MODELS[m] for m in args.models.split(",")}
    if args.shapes:
        wanted = set(args.shapes.split(","))
        models = {
            m: {s: nk for s, nk in shapes.items() if s in wanted} for m, shapes in models.items()
        }
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_bw = copy_bandwidth()
    points = [
        (m, n, k) for shapes in models.values() for n, k in shapes.values() for m in batch_sizes
    ]
    t0 = time.monotonic()
    try:
        compiled = precompile(points, sms, args.compile_workers)
        print(f"compiled {compiled} kernels in {time.monotonic() - t0:.0f} s", flush=True)
    except Exception as exc:  # noqa: BLE001 (the sweep then compiles each kernel on first use)
        print(f"parallel compile failed ({type(exc).__name__}: {exc}); compiling lazily")
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write); bf16, graph-replayed")
    result = run(models, batch_sizes, args.families.split(","), sms, copy_bw, args.json)
    wrong = wrong_results(result)
    for line in wrong:
        print(f"WRONG {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
