"""Where one decode step's time goes: host (Python) hot spots and device kernels.

`python -m benchmarks.profile_step [--model DIR] [--batch-sizes 1,256] [--prompt-len 512]
[--steps 40] [--mode graph+overlap] [--out DIR]`

For each batch size the engine is set up as in `benchmarks.decode_step` (prefill, 4 warm-up
decode steps), then `--steps` decode steps run twice: once under `cProfile` (host time per
Python function, sorted by own time) and once under `torch.profiler` with CUDA activity
(device time per kernel, and the device-busy time per step against the step's wall time; a
step whose wall time is well above its device time is host-bound). Prints a short summary;
full tables go to `--out`/profile_detail.txt. This is a diagnostic, not a
benchmark: it writes nothing to BENCHMARKS.md.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from benchmarks import common
from benchmarks.decode_step import MODES, decoding_engine
from benchmarks.offline import engine_config


def profile_batch(args, model: str, bs: int, out_dir: Path) -> str:
    """Profile `args.steps` decode steps at batch size `bs`; returns a one-paragraph summary."""
    engine = decoding_engine(
        model,
        args.device,
        args.attention_backend,
        bs,
        args.mode,
        args.prompt_len,
        3 * args.steps + 16,
        args.temperature,
        common.engine_args(args),
    )
    report = io.StringIO()
    # Plain wall time first.
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    common.synchronize(args.device)
    wall = (time.perf_counter() - t0) / args.steps
    # Host hot spots.
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    common.synchronize(args.device)
    prof.disable()
    stats = pstats.Stats(prof, stream=report)
    report.write(f"== batch {bs}: cProfile, {args.steps} steps, sorted by own time ==\n")
    stats.sort_stats("tottime").print_stats(40)
    report.write(f"== batch {bs}: cProfile sorted by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(40)
    # Device kernels.
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as tp:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        common.synchronize(args.device)
        prof_wall = (time.perf_counter() - t0) / args.steps
    events = tp.key_averages()
    # Kernel and memcpy rows only: an aten op's row repeats the time of the kernels it launched.
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in kernels) / args.steps
    report.write(f"== batch {bs}: torch.profiler, sorted by device time ==\n")
    report.write(events.table(sort_by="self_device_time_total", row_limit=45))
    report.write(f"\n== batch {bs}: torch.profiler, sorted by host time ==\n")
    report.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    with open(out_dir / "profile_detail.txt", "a") as f:
        f.write(report.getvalue())
    summary = (
        f"bs={bs} {args.mode}: wall {wall * 1e3:.3f} ms/step; device busy {device_us / 1e3:.3f} "
        f"ms/step (sum of kernel times; under the profiler the step took "
        f"{prof_wall * 1e3:.3f} ms)"
    )
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    lines = [summary]
    for e in top:
        lines.append(
            f"   {e.self_device_time_total / args.steps:9.1f} us/step  x{e.count / args.steps:5.1f}"
            f"  {e.key[:90]}"
        )
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return "\n".join(lines)


def _offline_pass(args, model: str, out_dir: Path, profiled: bool) -> list[str]:
    """One run of the offline workload with per-step timers (and cProfile if `profiled`)."""
    from benchmarks.bandwidth import checkpoint_weight_bytes, measure_copy_bandwidth
    from benchmarks.offline import make_engine, run_engine, warm_up
    from tritonllm.engine import overlap

    copy_bw = measure_copy_bandwidth(args.device)  # before the engine's KV pool takes memory
    engine = make_engine(
        engine_config(
            model, args.device, args.attention_backend, 256, engine_args=common.engine_args(args)
        )
    )
    warm_up(engine, args.device)
    # [launched a decode batch?, its size, wall s, GPU-wait s, tokens whose K/V it reads,
    #  new (prompt) tokens of a prefill batch]
    steps: list[list] = []
    wait = [0.0]
    cfg = engine.config
    weight_bytes = checkpoint_weight_bytes(model, cfg.torch_dtype.itemsize)
    kv_per_token = cfg.model_config.kv_bytes_per_token * cfg.torch_dtype.itemsize
    original_result = overlap.LaunchedStep.result
    original_step, original_run = engine.step, engine.runner.run
    launched: list = []  # the batches launched by the current step

    def recorded_run(batch, before_sample=None):
        # (batch, tokens whose K/V a decode step reads: every computed one + the one appended),
        # taken before the run advances `num_computed`.
        launched.append((batch, sum(r.num_computed + 1 for r in batch.reqs)))
        return original_run(batch, before_sample)

    def timed_result(self):
        t = time.perf_counter()
        try:
            return original_result(self)
        finally:
            wait[0] += time.perf_counter() - t

    window = {"prof": None, "steps": 0, "t0": 0.0, "lens": []}

    def profile_window(num_done: int) -> None:
        # Kernel times over steps [start, start + n) of the window's kind (decode or prefill
        # launching) of the real workload.
        start, n = args.window_start, args.window_steps
        if profiled:
            return
        if num_done == start and window["prof"] is None:
            common.synchronize(args.device)
            acts = [torch.profiler.ProfilerActivity.CPU]
            if args.device.startswith("cuda"):
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            window["prof"] = torch.profiler.profile(activities=acts)
            window["prof"].start()
            window["t0"] = time.perf_counter()
            window["lens"] = [r.num_computed for r in engine.scheduler.running]
        elif num_done == start + n and window["prof"] is not None and "wall" not in window:
            common.synchronize(args.device)
            window["wall"] = (time.perf_counter() - window["t0"]) / n
            window["prof"].stop()
            if args.trace:
                window["prof"].export_chrome_trace(str(out_dir / "offline_window_trace.json"))

    def timed_step():
        profile_window(sum(1 for s in steps if s[0] is (args.window_kind == "decode")))
        t, w = time.perf_counter(), wait[0]
        launched.clear()
        outs = original_step()
        kind = launched[0][0].is_decode if launched else None
        size = len(launched[0][0].reqs) if launched else 0
        ctx = launched[0][1] if kind else 0
        new_tokens = sum(launched[0][0].extend_lens) if launched and not kind else 0
        steps.append([kind, size, time.perf_counter() - t, wait[0] - w, ctx, new_tokens])
        return outs

    overlap.LaunchedStep.result = timed_result
    engine.step = timed_step
    engine.runner.run = recorded_run
    prof = cProfile.Profile() if profiled else None
    try:
        if prof:
            prof.enable()
        res = run_engine(engine, common.random_workload(), args.device, args.temperature)
        if prof:
            prof.disable()
    finally:
        overlap.LaunchedStep.result = original_result
        del engine.step, engine.runner.run  # drop the closures (they hold the engine)
    tag = "under cProfile" if profiled else "plain"
    lines = [f"offline ({tag}): {res.seconds:.2f} s, {res.output_tokens_per_s:,.0f} tok/s"]
    if prof:
        report = io.StringIO()
        pstats.Stats(prof, stream=report).sort_stats("tottime").print_stats(45)
        with open(out_dir / "profile_detail.txt", "a") as f:
            f.write("== offline workload: cProfile sorted by own time ==\n")
            f.write(report.getvalue())
        return lines
    if window["prof"] is not None and "wall" in window:
        kernels = [e for e in window["prof"].key_averages() if e.device_type == DeviceType.CUDA]
        n = args.window_steps
        busy = sum(e.self_device_time_total for e in kernels) / n
        lens = window["lens"] or [0]  # no request running yet (a prefill window at the start)
        lines.append(
            f"  {args.window_kind} steps {args.window_start}-{args.window_start + n - 1} under "
            "torch.profiler: "
            f"batch {len(lens)}, context min/mean/max {min(lens)}/{sum(lens) // len(lens)}/"
            f"{max(lens)} tokens; wall {window['wall'] * 1e3:.3f} ms/step, kernels "
            f"{busy / 1e3:.3f} ms/step"
        )
        top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)
        for e in top[: args.window_top]:
            lines.append(
                f"     {e.self_device_time_total / n:9.1f} us/step  x{e.count / n:5.1f}"
                f"  {e.key[:80]}"
            )
    prefill = [s for s in steps if s[0] is False]
    decode = [s for s in steps if s[0] is True]

    def bound(s: list) -> float:  # the step's weights + K/V bytes over the copy bandwidth
        return (weight_bytes + s[4] * kv_per_token) / copy_bw

    lines.append(
        f"  prefill-launching steps: {len(prefill)}, {sum(s[2] for s in prefill):.2f} s "
        f"(GPU wait {sum(s[3] for s in prefill):.2f} s, "
        f"{sum(s[5] for s in prefill):,} prompt tokens); "
        f"decode-launching steps: {len(decode)}, {sum(s[2] for s in decode):.2f} s "
        f"(GPU wait {sum(s[3] for s in decode):.2f} s; bound {sum(map(bound, decode)):.2f} s "
        f"at {copy_bw / 1e12:.3f} TB/s copy bandwidth)"
    )
    for lo in range(0, 256, 32):
        bucket = [s for s in decode if lo < s[1] <= lo + 32]
        if bucket:
            n = len(bucket)
            wall, bnd = sum(s[2] for s in bucket), sum(map(bound, bucket))
            lines.append(
                f"  decode bs {lo + 1:3d}-{lo + 32:3d}: {n:4d} steps, mean context "
                f"{sum(s[4] for s in bucket) / sum(s[1] for s in bucket):5.0f}, wall "
                f"{wall / n * 1e3:6.3f} ms/step, GPU wait "
                f"{sum(s[3] for s in bucket) / n * 1e3:6.3f} ms/step, bound "
                f"{bnd / n * 1e3:6.3f} ms/step ({bnd / wall:4.0%}), over bound {wall - bnd:5.2f} s"
            )
    return lines


def profile_offline(args, model: str, out_dir: Path) -> str:
    """The offline workload (BENCHMARKS.md) once with cheap per-step timers and kernel times
    over `--window-steps` steps of `--window-kind` (decode- or prefill-launching) from
    `--window-start`, then (`--offline-cprofile`) once under cProfile
    (host hot spots to `profile_detail.txt`). The summary gives the time in prefill vs
    decode steps and, per decode batch-size bucket, the mean step wall time and the part of it
    spent waiting for the GPU (in `LaunchedStep.result`): a step that hardly waits is
    host-bound."""
    lines = _offline_pass(args, model, out_dir, profiled=False)
    if args.offline_cprofile:
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        lines += _offline_pass(args, model, out_dir, profiled=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = common.argument_parser(__doc__.splitlines()[0], "extra EngineConfig field", publishes=False)
    p.add_argument("--batch-sizes", default="1,256")
    p.add_argument("--mode", default="graph+overlap", choices=sorted(MODES))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="/tmp/tritonllm-profile")
    p.add_argument("--offline", action="store_true", help="also profile the offline workload")
    p.add_argument(
        "--offline-cprofile",
        action="store_true",
        help="offline: a second run under cProfile (about 10x slower)",
    )
    p.add_argument(
        "--window-start", type=int, default=450, help="offline: first profiled step of the kind"
    )
    p.add_argument("--window-steps", type=int, default=20, help="offline: steps profiled")
    p.add_argument(
        "--window-top", type=int, default=8, help="offline: kernels listed for the window"
    )
    p.add_argument(
        "--window-kind",
        choices=("decode", "prefill"),
        default="decode",
        help="offline: profile decode-launching or prefill-launching steps",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="offline: also write the window's Chrome trace (host and device timelines) to "
        "--out/offline_window_trace.json",
    )
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile_detail.txt").write_text("")
    model = str(common.ensure_model(args.model, args.shape))
    summaries = [
        profile_batch(args, model, int(b), out_dir) for b in args.batch_sizes.split(",") if b
    ]
    if args.offline:
        summaries.append(profile_offline(args, model, out_dir))
    print("\n".join(summaries))


if __name__ == "__main__":
    main()
