"""The engine's own host (Python) work per decode step, with the device work stubbed out.

`python -m benchmarks.host_step [--model DIR] [--batch-size 256] [--steps 200]
[--sampler fused|cpu|stub] [--no-attention-plan] [--profile]`

Runs on any machine (CPU is enough): `LLMEngine` with overlap scheduling and the model forward
replaced by a tiny constant logits tensor, so what is timed is the Python a GPU step runs:
scheduling, input building (`ModelRunner.build_inputs`), commit, output processing, and by
default also

- the host side of FlashInfer's plan: `paged_kv_args` of each batch on CPU tensors, padded to
  the CUDA-graph batch size as `prepare_replay` does for decode (`--no-attention-plan` drops it;
  FlashInfer's own `plan()` is not included);
- the sampler's host-side parameter preparation as on CUDA (`--sampler fused`: penalty checks,
  the fast-path test, the inverse temperatures), with the Gumbel-max kernel replaced by an
  argmax. `--sampler cpu` runs the real CPU sampler on the tiny logits instead, `--sampler
  stub` replaces the whole sampler by a constant id.

What is left out exists only on CUDA (kernel launches, pinned copies, FlashInfer's plan, graph
replay); `benchmarks.profile_step` measures those on a GPU. A diagnostic for changes to the
engine's Python; it writes nothing to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import pstats
import random
import time
from unittest import mock

import torch

from benchmarks import common
from tritonllm.attention.flashinfer_backend import paged_kv_args, replay_kv_args
from tritonllm.config import EngineConfig
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.sampler import DeviceSamples
from tritonllm.sampling_params import SamplingParams

SAMPLERS = ("fused", "cpu", "stub")
VOCAB = 8  # columns of the stub logits


def stubbed_engine(
    model: str,
    batch_size: int,
    prompt_len: int,
    max_tokens: int,
    sampler: str = "fused",
    attention_plan: bool = True,
) -> LLMEngine:
    """A CPU engine whose forward costs (almost) nothing, with `batch_size` requests decoding.

    Args:
        sampler: "fused", "cpu" or "stub" (see the module docstring); "fused" needs the step
            to run inside `fused_sampler_stub()`.
        attention_plan: run `paged_kv_args` / `replay_kv_args` on each batch, as the FlashInfer
            backend does before its plan.
    """
    pages = batch_size * -(-(prompt_len + max_tokens) // 16) + 1
    config = EngineConfig(
        model=model,
        device="cpu",
        max_running_requests=batch_size,
        overlap_schedule=True,
        num_pages=pages,
    )
    engine = LLMEngine(config)
    runner = engine.runner
    graph_sizes = config.cuda_graph_batch_sizes

    def forward(fwd):
        meta = fwd.meta
        if attention_plan:
            if meta.is_decode and meta.num_seqs <= graph_sizes[-1]:
                bs = graph_sizes[bisect.bisect_left(graph_sizes, meta.num_seqs)]
                replay_kv_args(meta, bs, config.page_size)
            else:
                paged_kv_args(meta.page_table, meta.seq_lens_cpu, config.page_size)
        return torch.zeros(max(len(fwd.sample_reqs), 1), VOCAB)

    runner.forward = forward
    if sampler == "stub":

        def sample(logits, reqs, ids_to_device=None):
            n = logits.shape[0]
            token_ids = torch.full((n,), 7, dtype=torch.int64)
            return DeviceSamples(token_ids, None, None, None, [None] * n)

        runner.sampler.sample_device = sample
    elif sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.6, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randint(0, 1000) for _ in range(prompt_len)], params)
    sched = engine.scheduler
    with fused_sampler_stub() if sampler == "fused" else contextlib.nullcontext():
        while sched.waiting or any(not r.is_decoding for r in sched.running):
            engine.step()
    return engine


@contextlib.contextmanager
def fused_sampler_stub():
    """Make the sampler take its CUDA fast path on CPU logits, with the Gumbel-max kernel
    replaced by a plain argmax (so only the host-side work of that path is timed)."""

    def gumbel_argmax(logits, inv_temperature, seed, offset, row_seeds=None, row_offsets=None):
        return logits.argmax(dim=-1)

    with (
        mock.patch("tritonllm.engine.sampler.use_fused", lambda enabled, x: enabled),
        mock.patch("kernels.sampling.gumbel_argmax", gumbel_argmax),
    ):
        yield


def time_steps(engine: LLMEngine, steps: int, sampler: str = "fused") -> float:
    """Mean host seconds per `engine.step()` over `steps` steps (after 5 warm-up steps)."""
    with fused_sampler_stub() if sampler == "fused" else contextlib.nullcontext():
        for _ in range(5):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (default: models/tiny-qwen3)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sampler", choices=SAMPLERS, default="fused")
    p.add_argument("--no-attention-plan", action="store_true", help="skip paged_kv_args")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the steps")
    args = p.parse_args(argv)
    if args.model is None:  # the checkpoint `make serve` builds; built here if missing
        from tritonllm.build_model import build_model

        args.model = str(build_model(common.REPO_ROOT / "models" / "tiny-qwen3", shape="tiny"))
    model = str(common.ensure_model(args.model))
    # The CPU tensors stand in for device ones: intra-op threads only add noise (on 2 cores a
    # parallel CPU op sometimes stalls for milliseconds).
    torch.set_num_threads(1)
    engine = stubbed_engine(
        model,
        args.batch_size,
        args.prompt_len,
        3 * args.steps + 16,
        args.sampler,
        not args.no_attention_plan,
    )
    seconds = time_steps(engine, args.steps, args.sampler)
    print(
        f"batch {args.batch_size}: {seconds * 1e3:.3f} ms host per decode step "
        f"({seconds / args.batch_size * 1e6:.2f} us per request; sampler {args.sampler}, "
        f"attention plan {'off' if args.no_attention_plan else 'on'}); {common.hardware('cpu')}"
    )
    if args.profile:
        prof = cProfile.Profile()
        with fused_sampler_stub() if args.sampler == "fused" else contextlib.nullcontext():
            prof.enable()
            for _ in range(args.steps):
                engine.step()
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
