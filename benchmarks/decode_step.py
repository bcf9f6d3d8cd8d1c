"""Decode step time of the engine against its bandwidth bound, at fixed batch sizes.

`python -m benchmarks.decode_step [--model DIR] [--batch-sizes 1,256] [--prompt-len 512]
[--modes graph+overlap,graph,eager] [--attention-backend flashinfer]`

For each batch size and mode, every request gets a `--prompt-len` random prompt and is prefilled;
then `--steps` decode steps are timed (CUDA synchronised on both ends). The bound of one step is
the bytes it must read (all weights once, plus the K and V of every live token) over the
device-to-device copy bandwidth measured in the same run (BENCHMARKS.md, methodology).
The batch-1 step is the floor for online ITL at concurrency 1.
"""

from __future__ import annotations

import gc
import random
import time

import torch

from benchmarks import common
from benchmarks.bandwidth import measure_copy_bandwidth
from benchmarks.offline import engine_config
from tritonllm.engine.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams

# mode name → (cuda_graph, overlap_schedule)
MODES = {"graph+overlap": (True, True), "graph": (True, False), "eager": (False, False)}


def decoding_engine(
    model: str,
    device: str,
    backend: str,
    batch_size: int,
    mode: str,
    prompt_len: int,
    max_tokens: int,
    temperature: float,
    engine_args: dict[str, str],
) -> LLMEngine:
    """An engine with `batch_size` random `prompt_len`-token requests, prefilled and past 4
    warm-up decode steps (device synchronised), ready for timed decode steps.

    Raises:
        KeyError: unknown `mode` (see MODES).
    """
    graph, overlap = MODES[mode]
    extra = {"cuda_graph": str(graph), "overlap_schedule": str(overlap), **engine_args}
    engine = LLMEngine(engine_config(model, device, backend, max(batch_size, 1), engine_args=extra))
    fill_decoding(engine, batch_size, prompt_len, max_tokens, temperature, device)
    return engine


def fill_decoding(
    engine: LLMEngine,
    batch_size: int,
    prompt_len: int,
    max_tokens: int,
    temperature: float,
    device: str,
    tag: str = "r",
) -> None:
    """Add `batch_size` random `prompt_len`-token requests (ids `{tag}{i}`) to an idle
    `engine`, step until all of them decode, then 4 warm-up decode steps (device synchronised).
    """
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"{tag}{i}", [rng.randint(0, 10000) for _ in range(prompt_len)], params)
    sched = engine.scheduler
    while sched.waiting or any(not r.is_decoding for r in sched.running):
        engine.step()
    for _ in range(4):
        engine.step()
    common.synchronize(device)


def time_steps(engine: LLMEngine, steps: int, device: str) -> float:
    """Mean wall seconds of the next `steps` `engine.step()` calls (device synchronised)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    common.synchronize(device)
    return (time.perf_counter() - t0) / steps


def batch1_decode_step(
    engine: LLMEngine, device: str, prompt_len: int = 512, steps: int = 48
) -> float:
    """Mean seconds of one decode step of an idle `engine` with one `prompt_len`-token request
    decoding (the floor of online ITL at concurrency 1); the request is aborted afterwards."""
    fill_decoding(engine, 1, prompt_len, steps + 16, 0.0, device, tag="decode-step-")
    seconds = time_steps(engine, steps, device)
    engine.abort("decode-step-0")
    while engine.has_unfinished():
        engine.step()
    return seconds


def time_decode_step(
    model: str,
    device: str,
    backend: str,
    batch_size: int,
    mode: str,
    prompt_len: int,
    steps: int,
    engine_args: dict[str, str],
) -> tuple[float, int]:
    """Mean seconds of one decode step and the bytes it must read (weights + live KV).

    Raises:
        KeyError: unknown `mode` (see MODES).
    """
    engine = decoding_engine(
        model, device, backend, batch_size, mode, prompt_len, steps + 16, 0.0, engine_args
    )
    config, sched = engine.config, engine.scheduler
    seconds = time_steps(engine, steps, device)
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    live_tokens = sum(r.num_computed for r in sched.running)
    elem = torch.tensor([], dtype=config.torch_dtype).element_size()
    kv = live_tokens * config.model_config.kv_bytes_per_token * elem
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds, weights + kv


def main(argv: list[str] | None = None) -> None:
    p = common.argument_parser(__doc__.splitlines()[0], "extra EngineConfig field")
    p.add_argument("--batch-sizes", default="1,256")
    p.add_argument("--modes", default="graph+overlap,graph,eager")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args(argv)
    model = str(common.ensure_model(args.model, args.shape))
    bandwidth = measure_copy_bandwidth(args.device)
    # One untimed engine first: process-wide one-time costs (kernel JIT, allocator growth,
    # library handles) would otherwise land in the first configuration's numbers.
    first_mode = args.modes.split(",")[0]
    time_decode_step(model, args.device, args.attention_backend, 1, first_mode, 16, 4, {})
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        for mode in args.modes.split(","):
            seconds, nbytes = time_decode_step(
                model,
                args.device,
                args.attention_backend,
                bs,
                mode,
                args.prompt_len,
                args.steps,
                common.engine_args(args),
            )
            bound = nbytes / bandwidth
            rows.append(
                [
                    str(bs),
                    mode,
                    f"{seconds * 1e3:.3f}",
                    f"{bs / seconds:,.0f}",
                    f"{bound * 1e3:.3f}",
                    f"{bound / seconds:.0%}",
                ]
            )
            common.log(f"bs={bs} {mode}: {seconds * 1e3:.3f} ms/step")
    headers = ["batch", "mode", "step (ms)", "tok/s", "bound (ms)", "of bound"]
    notes = [
        f"{args.attention_backend} attention, prompt {args.prompt_len} tokens, mean of "
        f"{args.steps} decode steps after prefill and 4 warm-up steps",
        f"bound: weights once + K/V of every live token per step over the "
        f"{bandwidth / 1e12:.3f} TB/s copy bandwidth measured in this run",
    ]
    common.publish("Decode step time", common.markdown_table(headers, rows), notes, args)


if __name__ == "__main__":
    main()
