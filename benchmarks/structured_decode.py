"""Decode step time with structured outputs: part of a batch under a JSON schema vs none.

`python -m benchmarks.structured_decode [--model DIR] [--batch-size 64]
[--constrained-fractions 0,0.5,1] [--prompt-len 256] [--steps 48] [--schema maxlength|plain]
[--repeats R]`

For each fraction, `--batch-size` requests with `--prompt-len` random prompts decode together,
that fraction of them (rounded down) under a JSON schema, the rest unconstrained. `--schema
maxlength` (default): `SCHEMA`, a JSON array of at least 1000 small objects (strings of at most
16 characters, bounded integers, at most 3 enums), so the constrained rows stay inside the
grammar for the whole run; a bounded string is the hard case for a mask fill (each position of
it is a grammar state). `--schema plain`: `PLAIN_SCHEMA`, the same array without the bounds.
Every request is prefilled and past 4 warm-up decode steps, then `--steps` decode steps are
timed (device synchronised on both ends). A constrained row costs its bitmask fill on the host
(xgrammar for both schemas, which are in its subset; llguidance with `--engine-arg
grammar_backend=llguidance`, the A/B of the two libraries), the upload and the in-place mask
kernel, and, with overlap scheduling, the wait for the step in flight before its mask is filled
(`tritonllm.structured.admission`). The table gives each fraction's step time and its ratio to
the unconstrained one (fraction 0) of the same repeat; with `--repeats R` the fractions run R
times in turn (a fresh engine each) and the table ends with each fraction's median ratio, since
one ratio moves by up to ±20% from run to run on one machine (BENCHMARKS.md). Defaults: CUDA
graphs and overlap scheduling on (the engine's defaults on CUDA), sampling at `--temperature`,
each request with a seed of its own (the same walk in every configuration) unless `--unseeded`
(as most API requests come: the sampler's fused path instead of a generator per row).

With `--host-profile` the table also gives the engine thread's milliseconds per timed step in
the parts of `_host_parts`, each function wrapped by a timer for the timed steps only: the
scheduler, the host half of the inputs, the forward's launch, the engine's `_process` of a
step's samples (which includes `accept`, the constrained rows' matchers fed their tokens), and
what a constrained row adds to the sampler: `mask start` (the fill started on its thread, or
run there when the sampling is not deferred), `mask finish` (the wait for the fill, the
uploads and the mask kernel's launch, `mask kernel`), and `fill`: the seconds inside the grammar
libraries' fill calls, on the fill thread or the engine thread (`TokenMaskBuffers.fill_seconds`).

Exits with an error when a request left the batch before the timed steps ended (then the
numbers would not be those of a full batch).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import gc
import json
import random
import statistics
import time
from collections.abc import Iterator

import torch

from benchmarks import common
from benchmarks.decode_step import time_steps
from benchmarks.offline import engine_config
from tritonllm.cli_types import positive_int
from tritonllm.engine.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams
from tritonllm.structured.spec import StructuredOutputs

# Most seconds an engine's grammar compile may take before the run stops with every thread's
# stack (a compile takes milliseconds; the first in a process also loads the tokenizer). On
# 2026-12-06 a seventh engine's compile did not return on an H100 host (BENCHMARKS.md).
COMPILE_WAIT_S = 60.0

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 1000}
PLAIN_ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    },
    "required": ["name", "age", "tags"],
}
PLAIN_SCHEMA = {"type": "array", "items": PLAIN_ITEM, "minItems": 1000}
SCHEMAS = {"maxlength": SCHEMA, "plain": PLAIN_SCHEMA}  # --schema
# max_tokens beyond the timed steps: the first requests decode while later ones still prefill
# or wait for their matchers, and every request must stay in the batch to the last timed step.
MAX_TOKENS_MARGIN = 256
SCHEMA_NAMES = {"maxlength": "SCHEMA", "plain": "PLAIN_SCHEMA"}


def _host_parts() -> dict[str, tuple[object, str]]:
    """`--host-profile`'s parts: name → (owner, attribute) of the function timed."""
    import kernels.token_bitmask
    from tritonllm.engine import engine, model_runner, scheduler
    from tritonllm.structured import masks

    return {
        "schedule": (scheduler.Scheduler, "schedule"),
        "host inputs": (model_runner.ModelRunner, "host_inputs"),
        "forward": (model_runner.ModelRunner, "forward"),
        "process": (LLMEngine, "_process"),
        "accept": (engine, "accept_tokens"),
        "mask start": (masks.TokenMaskBuffers, "start"),
        "mask finish": (masks.TokenMaskBuffers, "finish"),
        "mask kernel": (kernels.token_bitmask, "apply_token_bitmask"),
    }


@contextlib.contextmanager
def host_timers(seconds: dict[str, float]) -> Iterator[None]:
    """Within the block, add each `_host_parts` function's wall seconds to ``seconds[name]``."""
    parts = _host_parts()
    originals = {name: getattr(owner, attr) for name, (owner, attr) in parts.items()}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    try:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, timed(name, originals[name]))
        yield
    finally:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, originals[name])


def structured_engine(
    model: str,
    device: str,
    backend: str,
    batch_size: int,
    num_constrained: int,
    prompt_len: int,
    max_tokens: int,
    temperature: float,
    engine_args: dict[str, str],
    schema: dict = SCHEMA,
    seeded: bool = True,
) -> LLMEngine:
    """An engine with `batch_size` decoding requests (`num_constrained` of them under
    `schema`; each with its own seed, request index ``i``, when ``seeded``), prefilled and past
    4 warm-up decode steps (device synchronised)."""
    engine = LLMEngine(
        engine_config(model, device, backend, max(batch_size, 1), engine_args=engine_args)
    )
    rng = random.Random(0)
    constraint = StructuredOutputs("json", json.dumps(schema))
    # Compiled (and cached) first, so every request decodes from the first timed step on.
    compiled = engine.constraints.compiler.submit(SamplingParams(structured_outputs=constraint))
    try:
        compiled.result(timeout=COMPILE_WAIT_S)
    except concurrent.futures.TimeoutError:
        faulthandler.dump_traceback(all_threads=True)  # where the compile is, on stderr
        raise SystemExit(
            f"the grammar did not compile within {COMPILE_WAIT_S:g} s (every thread's stack above)"
        ) from None
    for i in range(batch_size):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=i if seeded else None,
            ignore_eos=True,
            structured_outputs=constraint if i < num_constrained else None,
        )
        engine.add_request(f"r{i}", [rng.randint(0, 10000) for _ in range(prompt_len)], params)
    sched = engine.scheduler
    while len([r for r in sched.running if r.is_decoding]) < batch_size:
        engine.step()
    for _ in range(4):
        engine.step()
    common.synchronize(device)
    return engine


def time_structured_step(
    model: str,
    device: str,
    backend: str,
    batch_size: int,
    num_constrained: int,
    prompt_len: int,
    steps: int,
    temperature: float,
    engine_args: dict[str, str],
    schema: dict = SCHEMA,
    host: dict[str, float] | None = None,
    seeded: bool = True,
) -> float:
    """Mean seconds of one decode step of `batch_size` rows, `num_constrained` under `schema`;
    with ``host`` (a dict), also the mean host seconds per step of each `host_timers` part.

    Raises:
        SystemExit: a request finished before the timed steps ended.
    """
    engine = structured_engine(
        model,
        device,
        backend,
        batch_size,
        num_constrained,
        prompt_len,
        steps + MAX_TOKENS_MARGIN,
        temperature,
        engine_args,
        schema,
        seeded,
    )
    totals: dict[str, float] = {}
    masks = engine.runner.sampler.masks
    filled = masks.fill_seconds
    with host_timers(totals) if host is not None else contextlib.nullcontext():
        seconds = time_steps(engine, steps, device)
    totals["fill"] = masks.fill_seconds - filled  # the libraries' calls, on either thread
    if host is not None:
        host.update({name: total / steps for name, total in totals.items()})
    live = len(engine.scheduler.running)
    constrained = len(engine.constraints.live)
    engine.shutdown()  # its grammar threads, before the next engine starts its own
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if live != batch_size or constrained != num_constrained:
        raise SystemExit(f"{batch_size - live} requests left the batch during the timed steps")
    return seconds


def main(argv: list[str] | None = None) -> None:
    p = common.argument_parser(__doc__.splitlines()[0], "extra EngineConfig field")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--constrained-fractions", default="0,0.5,1")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="maxlength")
    p.add_argument("--host-profile", action="store_true", help="host ms per step by part")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="run the fractions this many times in turn; each ratio is against the same "
        "repeat's unconstrained step, and the median ratio of each fraction closes the table",
    )
    p.add_argument(
        "--unseeded",
        action="store_true",
        help="no per-request seeds (as most API requests: the fused sampling path)",
    )
    args = p.parse_args(argv)
    schema = SCHEMAS[args.schema]
    parts = [*_host_parts(), "fill"] if args.host_profile else []
    model = str(common.ensure_model(args.model, args.shape))
    extra = common.engine_args(args)
    bs = args.batch_size
    # Untimed first: one-time costs (kernel JIT, graph capture, the grammar compile and its
    # cache, allocator growth) would otherwise land in the first configuration's numbers.
    time_structured_step(
        model, args.device, args.attention_backend, 2, 1, 16, 4, 0.0, extra, schema
    )
    rows: list[list[str]] = []
    ratios: dict[int, list[float]] = {}  # constrained rows → ratio of each repeat
    fractions = [float(f) for f in args.constrained_fractions.split(",")]
    for repeat in range(1, args.repeats + 1):
        base = None
        for fraction in fractions:
            n = int(bs * fraction)
            host: dict[str, float] | None = {} if args.host_profile else None
            seconds = time_structured_step(
                model,
                args.device,
                args.attention_backend,
                bs,
                n,
                args.prompt_len,
                args.steps,
                args.temperature,
                extra,
                schema,
                host,
                not args.unseeded,
            )
            base = seconds if base is None and n == 0 else base
            ratio = "" if base is None else f"{seconds / base:.3f}"
            if base is not None:
                ratios.setdefault(n, []).append(seconds / base)
            row = [str(repeat), str(bs), str(n), f"{seconds * 1e3:.3f}", f"{bs / seconds:,.0f}"]
            rows.append(row + [ratio] + [f"{(host or {}).get(p, 0.0) * 1e3:.3f}" for p in parts])
            common.log(f"#{repeat} bs={bs} constrained={n}: {seconds * 1e3:.3f} ms/step {ratio}")
    if args.repeats > 1:
        for n, values in ratios.items():
            rows.append(["median", str(bs), str(n), "", "", f"{statistics.median(values):.3f}"])
            rows[-1] += [""] * len(parts)
    headers = ["repeat", "batch", "JSON-schema rows", "step (ms)", "tok/s", "vs unconstrained"]
    headers += [f"host {part} (ms/step)" for part in parts]
    notes = [
        f"{args.attention_backend} attention, prompt {args.prompt_len} tokens, temperature "
        f"{args.temperature} ({'unseeded' if args.unseeded else 'a seed per request'}), mean "
        f"of {args.steps} decode steps after prefill and 4 warm-up "
        "steps; engine defaults (CUDA graphs, overlap scheduling, mixed steps) unless "
        f"--engine-arg: {extra or 'none'}",
        f"constrained rows: `benchmarks.structured_decode.{SCHEMA_NAMES[args.schema]}` "
        f"(--schema {args.schema}: an array of >= 1000 small objects), masks by "
        f"{'llguidance' if extra.get('grammar_backend') == 'llguidance' else 'xgrammar'}; "
        "unconstrained rows sample as in decode_step",
    ]
    common.publish(
        "Structured-output decode step", common.markdown_table(headers, rows), notes, args
    )


if __name__ == "__main__":
    main()
