"""One long prompt's prefill on CPU at several per-step token budgets: total time, steps and
the longest step (what a request behind it waits at most for a step to end).

`python -m benchmarks.cpu_prefill_chunks [--model DIR] [--prompt-len 6000] [--budgets 8192,1024,512]`

Prints one line per budget; writes nothing to BENCHMARKS.md (a diagnostic for the CPU default
`config.CPU_MAX_PREFILL_TOKENS`).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tritonllm.config import EngineConfig
from tritonllm.engine.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams


def prefill_seconds(model: str, budget: int, prompt_len: int) -> tuple[float, int, float]:
    """(total seconds, steps, longest step in seconds) of one `prompt_len`-token prompt with
    `max_tokens=1`, after a short warm-up request, at `max_prefill_tokens=budget`."""
    engine = LLMEngine(
        EngineConfig(
            model=model, device="cpu", max_prefill_tokens=budget, max_model_len=prompt_len + 64
        )
    )
    rng = random.Random(0)
    warm_up = [rng.randrange(100, 10000) for _ in range(64)]  # (shares no prefix with it)
    prompt = [rng.randrange(100, 10000) for _ in range(prompt_len)]
    engine.add_request("warm-up", warm_up, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    start, steps, longest = time.perf_counter(), 0, 0.0
    engine.add_request("long", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        step_start = time.perf_counter()
        engine.step()
        longest = max(longest, time.perf_counter() - step_start)
        steps += 1
    return time.perf_counter() - start, steps, longest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=6000)
    p.add_argument("--budgets", default="8192,1024,512")
    args = p.parse_args(argv)
    for budget in (int(b) for b in args.budgets.split(",")):
        total, steps, longest = prefill_seconds(args.model, budget, args.prompt_len)
        print(
            f"budget {budget}: {total:.1f} s for {args.prompt_len} tokens, {steps} steps, "
            f"longest step {longest:.2f} s; torch threads {torch.get_num_threads()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
