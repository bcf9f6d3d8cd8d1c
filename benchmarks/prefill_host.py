"""Host (Python) time of eager prefill steps next to CUDA-graph decode steps, in a live engine.

`python -m benchmarks.prefill_host [--model DIR] [--decoding 128] [--cases 1x600,4x600,1x2000]
[--steps 30] [--profile]`

`--decoding` requests (prompts of `--decode-prompt-len` random ids) are prefilled and then
decode; during each case, `count` new prompts of `len` random ids arrive every third step. For
every step the wall time of `ModelRunner.run` (input building, attention plan, the forward's
kernel launches or graph replay, sampling launches: host work only under overlap scheduling,
nothing waits for the GPU there) is recorded per kind, and the mean per kind is printed.
`--profile` adds a cProfile of the prefill steps of the first case (top functions by own time).

Why: on CUDA a decode step replays a graph while a prefill step runs the model eagerly, whose
host cost (hundreds of kernel launches from Python) hardly depends on its size; under a
trickle of arrivals one prefill step per arrival starves decode (the admission delay,
`EngineConfig.prefill_delay_steps`, answers that). With mixed steps (the default) a prefill
step also carries the decoding requests as one-token rows; the summary gives their number. A diagnostic; it writes nothing to
BENCHMARKS.md. Runs on CPU too, where the "host time" includes the computation itself.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time

from benchmarks import common
from benchmarks.offline import engine_config
from tritonllm.cli_types import positive_int
from tritonllm.engine.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams


def parse_cases(text: str) -> list[tuple[int, int]]:
    """`"1x600,4x600"` -> `[(1, 600), (4, 600)]`: (prompts per arrival, prompt length).

    Raises:
        ValueError: a case that is not COUNTxLEN with positive integers.
    """
    cases = []
    for item in text.split(","):
        count, _, length = item.strip().partition("x")
        if not (count.isdigit() and length.isdigit() and int(count) > 0 and int(length) > 0):
            raise ValueError(f"case {item!r}: expected COUNTxLEN, e.g. 4x600")
        cases.append((int(count), int(length)))
    return cases


class RunTimer:
    """Wraps `engine.runner.run` with its signature, `(batch, before_sample=None)`: records
    (is_decode, host seconds, prompt tokens, sequences, decode rows) per call; while `profiler`
    is set, prefill calls run under it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.records: list[tuple[bool, float, int, int, int]] = []
        self.profiler: cProfile.Profile | None = None
        self._run = engine.runner.run
        engine.runner.run = self

    def __call__(self, batch, before_sample=None):
        profiler = None if batch.is_decode else self.profiler
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        try:
            return self._run(batch, before_sample)
        finally:
            if profiler is not None:
                profiler.disable()
            seconds = time.perf_counter() - start
            self.records.append(
                (
                    batch.is_decode,
                    seconds,
                    batch.num_prefill_tokens,
                    len(batch.reqs),
                    batch.num_decode_rows,
                )
            )


def run(args: argparse.Namespace) -> list[str]:
    """Build the engine, run the cases; returns the printed result lines."""
    model = common.ensure_model(args.model, args.shape)
    extra = {"prefill_delay_steps": "0", **common.engine_args(args)}
    engine = LLMEngine(engine_config(model, args.device, args.attention_backend, engine_args=extra))
    timer = RunTimer(engine)
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10000) for _ in range(length)]

    forever = SamplingParams(max_tokens=args.decode_max_tokens, ignore_eos=True)
    for i in range(args.decoding):
        engine.add_request(f"decode-{i}", prompt(args.decode_prompt_len), forever)
    sched = engine.scheduler
    while sched.waiting or any(not r.is_decoding for r in sched.running):
        engine.step()
    for _ in range(10):  # warm-up decode steps
        engine.step()
    lines = []
    short = SamplingParams(max_tokens=20, ignore_eos=True)
    for index, (count, length) in enumerate(parse_cases(args.cases)):
        timer.records.clear()
        timer.profiler = cProfile.Profile() if args.profile and index == 0 else None
        for step in range(args.steps):
            if step % 3 == 0:
                for j in range(count):
                    engine.add_request(f"new-{index}-{step}-{j}", prompt(length), short)
            engine.step()
        common.synchronize(args.device)
        lines.append(_summary(count, length, timer.records))
        print(lines[-1], flush=True)
        if timer.profiler is not None:
            pstats.Stats(timer.profiler).sort_stats("tottime").print_stats(args.profile_top)
    return lines


def _summary(count: int, length: int, records: list[tuple[bool, float, int, int, int]]) -> str:
    prefill = [r for r in records if not r[0]]
    decode = [r for r in records if r[0]]

    def mean_ms(rows):
        return 1e3 * sum(r[1] for r in rows) / max(len(rows), 1)

    tokens = sum(r[2] for r in prefill) / max(len(prefill), 1)
    riders = sum(r[4] for r in prefill) / max(len(prefill), 1)
    batch = sum(r[3] for r in decode) / max(len(decode), 1)
    return (
        f"arrivals of {count}x{length}: {len(prefill)} prefill steps, host {mean_ms(prefill):.2f} "
        f"ms each ({tokens:,.0f} prompt tokens and {riders:.0f} decode rows on average); "
        f"{len(decode)} decode steps, host {mean_ms(decode):.2f} ms each (batch {batch:.0f} on "
        "average)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The tool's flags (see the module doc); exits with usage on bad flags."""
    p = common.argument_parser(
        __doc__.splitlines()[0], "extra EngineConfig field, e.g. page_size=32", publishes=False
    )
    positive = positive_int
    p.add_argument("--decoding", type=positive, default=128, help="requests decoding meanwhile")
    p.add_argument("--decode-prompt-len", type=positive, default=500)
    p.add_argument("--decode-max-tokens", type=positive, default=2000)
    p.add_argument(
        "--cases", type=_cases, default="1x600,4x600,1x2000", help="COUNTxLEN arrivals per case"
    )
    p.add_argument("--steps", type=positive, default=30, help="engine steps per case")
    p.add_argument("--profile", action="store_true", help="cProfile the first case's prefills")
    p.add_argument("--profile-top", type=positive, default=30)
    return p.parse_args(argv)


def _cases(text: str) -> str:
    """argparse type of `--cases`: checked by `parse_cases`, kept as text."""
    try:
        parse_cases(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


if __name__ == "__main__":
    run(parse_args(sys.argv[1:]))
