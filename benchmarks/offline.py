"""Offline engine throughput on the nano-vllm workload, against its bandwidth bound and HF.

    python -m benchmarks.offline [--model DIR] [--num-requests 256] [--device cuda]
        [--attention-backend flashinfer] [--hf-subset 16] [--tensor-parallel-size 1,2]
        [--no-append]

Without `--model` the random-weight `qwen3-0.6b` checkpoint is built into `models/qwen3-0.6b`.
One table: the engine (all requests at once) at each tensor-parallel size, the workload's
bandwidth bound for that many GPUs measured in the same run (`benchmarks.bandwidth`,
`benchmarks.tensor_parallel`), HF `generate` on a subset; methodology: BENCHMARKS.md's header.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import bandwidth, common, tensor_parallel
from benchmarks.common import Workload, fmt, fmt_bytes, log


@dataclass(frozen=True)
class ThroughputRun:
    """One timed generation run.

    Attributes:
        num_requests: requests run.
        prompt_tokens, output_tokens: tokens of the workload actually processed / generated.
        seconds: wall time from the first submission to the last token (GPU synchronized).
        generated_tokens: tokens computed, padding/overrun included (HF's padded batch);
            equals `output_tokens` for the engine.
        steps: the engine's `step()` calls (0: not counted, e.g. HF's run).
    """

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    generated_tokens: int = 0
    steps: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        """Prompt plus output tokens per second of wall time."""
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def engine_config(
    model: Path | str,
    device: str,
    attention_backend: str,
    max_running_requests: int = 256,
    max_model_len: int = 4096,
    engine_args: dict[str, str] | None = None,
) -> Any:
    """The `EngineConfig` of a benchmark engine; `engine_args` are extra `EngineConfig` fields
    as strings, parsed as the Triton model's `TRITONLLM_*` settings are (`triton_config`)."""
    from tritonllm.triton_config import engine_config as parse_engine_config

    params = {
        "model": str(Path(model).resolve()),
        "device": device,
        "attention_backend": attention_backend,
        "max_running_requests": str(max_running_requests),
        "max_model_len": str(max_model_len),
        **(engine_args or {}),
    }
    return parse_engine_config(params, env={})


def make_engine(config: Any) -> Any:
    """An `LLMEngine` for `config` (an `EngineConfig`); its ranks' processes behind the same
    interface at `tensor_parallel_size` > 1 (`benchmarks.tensor_parallel.ProcessEngine`)."""
    return tensor_parallel.make_engine(config)


def sampling_params(max_tokens: int, temperature: float) -> Any:
    """`ignore_eos` params with a fixed output length, so every request emits `max_tokens`."""
    from tritonllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)


def warm_up(engine: Any, device: str) -> None:
    """One short request: first-use kernel compilation and allocations happen outside timing."""
    run_engine(engine, Workload([list(range(1000, 1032))], [8]), device, tag="warmup")


def prefill_alone(engine: Any, workload: Workload, device: str) -> ThroughputRun:
    """Time the workload's prefill by itself: the same prompt lengths, every request at once
    with one output token (the token a prefill emits; the bandwidth bound counts only the
    steps after it). Every id is shifted by one (modulo the largest id plus one), so the
    prefix cache holds none of these prompts after the workload's own run."""
    top = max(max(p) for p in workload.prompts) + 1
    shifted = [[(t + 1) % top for t in p] for p in workload.prompts]
    return run_engine(engine, Workload(shifted, [1] * len(shifted)), device, tag="prefill")


def run_engine(
    engine: Any,
    workload: Workload,
    device: str,
    temperature: float = 0.6,
    concurrency: int | None = None,
    tag: str = "bench",
) -> ThroughputRun:
    """Run `workload` through `engine.add_request` / `engine.step` and time it.

    With `concurrency` None every request is submitted at once (the offline benchmark); else at
    most `concurrency` are in flight and the next is submitted when one finishes (the closed
    loop the online clients run), so the two are compared on equal terms.

    Raises:
        RuntimeError: a request finished with a token count other than its output length.
    """
    n = len(workload)
    limit = concurrency or n
    pending = deque(range(n))
    produced = [0] * n
    in_flight = steps = 0
    common.synchronize(device)
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < limit:
            i = pending.popleft()
            engine.add_request(
                f"{tag}-{i}",
                workload.prompts[i],
                sampling_params(workload.output_lens[i], temperature),
            )
            in_flight += 1
        steps += 1
        for out in engine.step():
            i = int(out.request_id.rsplit("-", 1)[1])
            produced[i] += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                if produced[i] != workload.output_lens[i]:
                    raise RuntimeError(
                        f"request {i} produced {produced[i]} tokens, expected "
                        f"{workload.output_lens[i]} (finish_reason {out.finish_reason})"
                    )
    common.synchronize(device)
    seconds = time.perf_counter() - start
    out = sum(produced)
    return ThroughputRun(n, workload.num_prompt_tokens, out, seconds, out, steps)


def run_levels(
    model: str,
    device: str,
    attention_backend: str,
    workloads: dict[int, Workload],
    temperature: float = 0.0,
    engine_args: dict[str, str] | None = None,
    decode_step: bool = False,
) -> tuple[dict[int, ThroughputRun], float | None]:
    """The offline engine on each concurrency level's workload (one engine, closed loop), then,
    with `decode_step`, the same engine's batch-1 decode step (`decode_step.batch1_decode_step`;
    not at a tensor-parallel size > 1, whose engine is in other processes).

    Used by `benchmarks.online` in a subprocess so the engine's GPU memory is freed before the
    server starts.

    Returns:
        the runs per level, and the batch-1 decode step in seconds (None without `decode_step`).
    """
    engine = make_engine(
        engine_config(model, device, attention_backend, max(workloads), engine_args=engine_args)
    )
    warm_up(engine, device)
    runs = {}
    for c, w in workloads.items():
        runs[c] = run_engine(engine, w, device, temperature, concurrency=c, tag=f"c{c}")
        log(f"offline engine, concurrency {c}: {runs[c].output_tokens_per_s:,.0f} tok/s")
    if not decode_step or isinstance(engine, tensor_parallel.ProcessEngine):
        tensor_parallel.close_engine(engine)  # its rank processes, at size > 1
        return runs, None
    from benchmarks.decode_step import batch1_decode_step

    step = batch1_decode_step(engine, device)
    log(f"offline engine, batch-1 decode step: {step * 1e3:.3f} ms")
    return runs, step


@dataclass(frozen=True)
class OfflineResult:
    """Everything one offline benchmark run measured (`engines`: the engine's run at each
    tensor-parallel size, in the order run; `engine` is the first)."""

    workload: Workload
    engines: dict[int, ThroughputRun]
    copy_bandwidth: float  # bytes/s of one GPU (the slowest of those used)
    traffic: bandwidth.DecodeTraffic
    hf: ThroughputRun | None
    weight_bytes: int
    kv_bytes_per_token: int
    prefill: dict[int, ThroughputRun]  # `prefill_alone` at each tensor-parallel size
    matmul_rate: float  # FLOP/s of one GPU's large GEMM (`bandwidth.measure_matmul_rate`)
    flops: bandwidth.ModelFlops

    @property
    def engine(self) -> ThroughputRun:
        return next(iter(self.engines.values()))

    @property
    def bound_seconds(self) -> float:
        """The least decode time of the workload (seconds) at the measured copy bandwidth, on
        the GPUs of the first tensor-parallel size run."""
        return self.bound_seconds_at(next(iter(self.engines)))

    def bound_seconds_at(self, size: int) -> float:
        """The same on `size` GPUs (`benchmarks.tensor_parallel`)."""
        return self.traffic.bound_seconds(self.copy_bandwidth * size)

    def roofline_at(self, size: int) -> bandwidth.Roofline:
        """The workload's roofline bound on `size` GPUs (`bandwidth.roofline`: each step at
        the slower of its reads and its FLOPs, `size` times one GPU's bandwidth and GEMM rate)."""
        w = self.workload
        return bandwidth.roofline(
            [len(p) for p in w.prompts],
            w.output_lens,
            self.weight_bytes,
            self.kv_bytes_per_token,
            self.flops,
            self.copy_bandwidth * size,
            self.matmul_rate * size,
        )


def workload_bound(
    model: Path | str, workload: Workload, itemsize: int, max_running: int | None = None
) -> tuple[bandwidth.DecodeTraffic, int, int]:
    """(decode traffic, weight bytes per step, KV bytes per token) of `workload` on `model`."""
    from tritonllm.config import ModelConfig

    config = ModelConfig.from_pretrained(str(model))
    weight_bytes = bandwidth.checkpoint_weight_bytes(model, itemsize)
    kv_per_token = config.kv_bytes_per_token * itemsize
    traffic = bandwidth.decode_bytes(
        [len(p) for p in workload.prompts],
        workload.output_lens,
        weight_bytes,
        kv_per_token,
        max_running,
    )
    return traffic, weight_bytes, kv_per_token


def run(args: argparse.Namespace) -> OfflineResult:
    """Build/find the checkpoint, run engine, bound and HF peer as `args` say."""
    model = common.ensure_model(args.model, args.shape)
    log(f"model {model}; measuring copy bandwidth, then the engine")
    workload = common.random_workload(
        args.num_requests, args.min_len, args.max_input_len, args.max_output_len
    )
    published = (256, 100, 1024, 1024)  # the workload nano-vllm and mini-sglang publish
    if (args.num_requests, args.min_len, args.max_input_len, args.max_output_len) == published:
        assert (workload.num_prompt_tokens, workload.num_output_tokens) == (
            common.PUBLISHED_PROMPT_TOKENS,
            common.PUBLISHED_OUTPUT_TOKENS,
        ), "workload drifted"
    # Bandwidth first, while the GPUs are empty (the engine's KV pool takes most of the memory).
    copy_bw = tensor_parallel.copy_bandwidth(args.device, max(args.tensor_parallel_size))
    dtype = engine_config(
        model, args.device, args.attention_backend, engine_args=common.engine_args(args)
    ).torch_dtype
    rate = bandwidth.measure_matmul_rate(args.device, dtype)
    log(f"copy bandwidth {fmt_bytes(copy_bw, 'B/s')}; GEMM {rate / 1e12:,.1f} TFLOP/s ({dtype})")
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    results, prefills = {}, {}
    for size in args.tensor_parallel_size:
        config = engine_config(
            model,
            args.device,
            args.attention_backend,
            args.num_requests,
            engine_args={**common.engine_args(args), "tensor_parallel_size": str(size)},
        )
        engine = make_engine(config)
        warm_up(engine, args.device)
        results[size] = result = run_engine(engine, workload, args.device, args.temperature)
        log(f"engine TP={size}: {result.output_tokens:,} tokens in {result.seconds:.2f} s")
        prefills[size] = prefill = prefill_alone(engine, workload, args.device)
        log(f"prefill alone TP={size}: {prefill.prompt_tokens:,} tokens in {prefill.seconds:.2f} s")
        stats = engine.stats()  # warm-up and prefill-alone included
        log(
            f"engine steps: {stats.num_steps:,}, of which {stats.num_prefill_steps:,} "
            f"prefill/extend ({stats.num_mixed_steps:,} mixed with decode rows), "
            f"{stats.num_preemptions} preemptions"
        )
        tensor_parallel.close_engine(engine)
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    traffic, weight_bytes, kv_per_token = workload_bound(
        model, workload, config.torch_dtype.itemsize
    )
    from tritonllm.config import ModelConfig

    flops = bandwidth.ModelFlops.from_config(ModelConfig.from_pretrained(str(model)))
    hf = None
    if args.hf_subset > 0:
        from benchmarks.hf_peer import hf_generate  # it imports this module

        hf = hf_generate(model, workload.subset(args.hf_subset), args.device)
    return OfflineResult(
        workload, results, copy_bw, traffic, hf, weight_bytes, kv_per_token, prefills, rate, flops
    )


def report(res: OfflineResult, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The markdown table and the notes of one run."""
    w = res.workload
    headers = [
        "system",
        "requests",
        "prompt tokens",
        "output tokens",
        "time (s)",
        "output tok/s",
        "total tok/s",
        "of bound",
    ]

    def row(name: str, r: ThroughputRun, of_bound: str) -> list[str]:
        return [
            name,
            fmt(r.num_requests),
            fmt(r.prompt_tokens),
            fmt(r.output_tokens),
            fmt(r.seconds, 2),
            fmt(r.output_tokens_per_s, 0),
            fmt(r.total_tokens_per_s, 0),
            of_bound,
        ]

    rows, prefill_notes = [], []
    roofs = {size: res.roofline_at(size) for size in res.engines}  # one schedule walk each
    for size, run in res.engines.items():
        tp = "" if size == 1 else f", TP={size}"
        bound_s = res.bound_seconds_at(size)
        of_bound = f"{bound_s / run.seconds:.1%}"
        rows.append(row(f"tritonllm engine ({args.attention_backend}{tp})", run, of_bound))
        prefill = res.prefill[size]
        rows.append(row(f"its prefill alone (max_tokens 1{tp})", prefill, "-"))
        decode_s = run.seconds - prefill.seconds
        prefill_notes.append(
            f"prefill alone{tp}: the same prompt lengths with shifted ids (no prefix-cache "
            f"hits), one output token each, all at once: {prefill.seconds:.2f} s, "
            f"{prefill.seconds / run.seconds:.0%} of the engine's time; the engine's time less "
            f"it, {decode_s:.2f} s, is {bound_s / decode_s:.1%} of the bandwidth bound"
            if decode_s > 0
            else f"prefill alone{tp}: {prefill.seconds:.2f} s, not less than the engine's run"
        )
    for size in res.engines:
        bound = ThroughputRun(
            len(w), w.num_prompt_tokens, w.num_output_tokens, res.bound_seconds_at(size)
        )
        roof = roofs[size]
        gpus = "" if size == 1 else f"{size} GPUs, "
        rows.append(
            row(
                f"bandwidth bound ({gpus}{fmt_bytes(res.copy_bandwidth, 'B/s')} copy)",
                bound,
                "100%",
            )
        )
        roof_run = ThroughputRun(len(w), w.num_prompt_tokens, w.num_output_tokens, roof.seconds)
        rows.append(
            row(
                f"roofline bound ({gpus}copy and {res.matmul_rate / 1e12:,.1f} TFLOP/s GEMM)",
                roof_run,
                f"{bound.seconds / roof.seconds:.1%}",
            )
        )
    if res.hf is not None:
        rows.append(
            row(f"HF transformers generate (batch {res.hf.num_requests}, padded)", res.hf, "-")
        )
    roof = next(iter(roofs.values()))
    notes = [
        f"engine: device {args.device}, temperature {args.temperature} (nano-vllm uses 0.6; "
        "ignore_eos fixes the output lengths), all requests submitted at once",
        f"bound: {res.traffic.decode_steps:,} decode steps x {fmt_bytes(res.weight_bytes)} "
        f"weights + {res.kv_bytes_per_token:,} B KV per live token per step = "
        f"{fmt_bytes(res.traffic.total_bytes)} over {fmt_bytes(res.copy_bandwidth, 'B/s')} "
        "measured device-to-device copy bandwidth (read + written; N GPUs: N times it, the "
        "slowest GPU's, see benchmarks.tensor_parallel)",
        "roofline bound (benchmarks.bandwidth.roofline): each decode step at the slower of its "
        "reads over the copy bandwidth and its FLOPs over the GEMM rate measured in the same run "
        "(a large square product), then the prompts' FLOPs where they do not fit in the steps' "
        f"slack: decode "
        f"{roof.decode_seconds:.2f} s ({roof.compute_bound_steps:,} of {roof.steps:,} steps "
        f"bound by FLOPs), prefill {roof.prefill_seconds:.2f} s of which "
        f"{roof.hidden_seconds:.2f} s fits in the slack",
        *prefill_notes,
    ]
    if res.hf is not None:
        notes.append(
            f"HF: first {res.hf.num_requests} requests as one left-padded batch, greedy, "
            f"{res.hf.generated_tokens:,} tokens generated in all "
            f"({res.hf.generated_tokens / res.hf.seconds:,.0f} tok/s raw); the row counts the "
            "workload's tokens only"
        )
    return common.markdown_table(headers, rows), notes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags (see the module doc); exits with usage on bad flags."""
    p = common.argument_parser(
        __doc__.splitlines()[0], "extra EngineConfig field, e.g. page_size=32 (repeatable)"
    )
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--hf-subset", type=int, default=16, help="requests for the HF peer (0: skip)")
    tensor_parallel.add_argument(p)
    p.add_argument(
        "--plots-dir",
        help="draw the plot against the bound and write the run's JSON summary into this "
        "folder; the appended section links the plot relative to --benchmarks-md",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> OfflineResult:
    """Run the benchmark, print its table, append it to BENCHMARKS.md (unless `--no-append`),
    draw its plot (with `--plots-dir`)."""
    args = parse_args(argv)
    res = run(args)
    table, notes = report(res, args)
    if args.plots_dir:
        from benchmarks import plots

        model = Path(args.model or args.shape).name
        name = plots.run_name("offline", model)
        summary = plots.offline_summary(res, args.attention_backend, model)
        table += "\n\n" + plots.publish(summary, args.plots_dir, name, args.benchmarks_md)
    common.publish("Offline engine throughput", table, notes, args)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
