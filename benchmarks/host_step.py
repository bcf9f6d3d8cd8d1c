"""The engine's own host (Python) work per decode step, with the model and sampler stubbed out.

`python -m benchmarks.host_step [--model DIR] [--batch-size 256] [--steps 200] [--profile]`

Runs on any machine (CPU is enough): `LLMEngine` with overlap scheduling, the model forward
replaced by a tiny constant logits tensor and the sampler by a constant id, so what is timed is
scheduling, input building (`ModelRunner.build_inputs`), commit and output processing — the
part of a step that grows with the batch (about 3.5 us per request on a 2-core CI-class CPU).
It leaves out what only exists on CUDA (FlashInfer's plan, graph replay, pinned copies, the
real sampler's kernel launches), which `benchmarks.profile_step` measures on a GPU. A
diagnostic for changes to the engine's Python; it writes nothing to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from benchmarks import common
from tritonllm.config import EngineConfig
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.sampler import DeviceSamples
from tritonllm.sampling_params import SamplingParams


def stubbed_engine(model: str, batch_size: int, prompt_len: int, max_tokens: int) -> LLMEngine:
    """A CPU engine whose forward and sampler cost nothing, with `batch_size` requests decoding."""
    pages = batch_size * -(-(prompt_len + max_tokens) // 16) + 1
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cpu",
            max_running_requests=batch_size,
            overlap_schedule=True,
            num_pages=pages,
        )
    )
    runner = engine.runner
    runner.forward = lambda fwd: torch.zeros(max(len(fwd.sample_reqs), 1), 8)

    def sample(logits, reqs, ids_to_device=None):
        n = logits.shape[0]
        return DeviceSamples(torch.full((n,), 7, dtype=torch.int64), None, None, None, [None] * n)

    runner.sampler.sample_device = sample
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.6, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randint(0, 1000) for _ in range(prompt_len)], params)
    sched = engine.scheduler
    while sched.waiting or any(not r.is_decoding for r in sched.running):
        engine.step()
    return engine


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (default: models/tiny-qwen3)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the steps")
    args = p.parse_args(argv)
    if args.model is None:  # the checkpoint `make serve` builds; built here if missing
        from tritonllm.build_model import build_model

        args.model = str(build_model(common.REPO_ROOT / "models" / "tiny-qwen3", shape="tiny"))
    model = str(common.ensure_model(args.model))
    engine = stubbed_engine(model, args.batch_size, args.prompt_len, 3 * args.steps + 16)
    for _ in range(5):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    seconds = (time.perf_counter() - t0) / args.steps
    print(
        f"batch {args.batch_size}: {seconds * 1e3:.3f} ms host per decode step "
        f"({seconds / args.batch_size * 1e6:.2f} us per request); {common.hardware('cpu')}"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
