"""Shared helpers for the tensor-parallel tests (no tests here): greedy runs with their top-2
logprobs, and the honest comparison of two greedy runs.

Ties: two logits closer than the comparison's `margin` may swap their order between two correct
computations that sum in another order (a row-parallel all-reduce does). The ids of a run are
therefore compared up to the first position where the reference's top-2 margin is below it;
there the other run must have picked one of the two near-tied ids, and past it both
continuations are right. Such positions must be rare (`max_ambiguous` sequences per test).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from test_engine_thread import Collector

from tritonllm.config import EngineConfig
from tritonllm.engine import EngineThread, LLMEngine
from tritonllm.engine.client import EngineClient
from tritonllm.sampling_params import SamplingParams


@dataclass
class GreedyRun:
    """One request's greedy ids, each with its logprob and its top-2 `{id: logprob}`."""

    ids: list[int]
    logprobs: list[float]
    top2: list[dict[int, float]]

    def margins(self) -> list[float]:
        """Top-1 minus top-2 logprob at each position (the logit margin)."""
        return [max(t.values()) - min(t.values()) for t in self.top2]


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)


def run_client(client: EngineClient, prompts: list[list[int]], max_tokens: int) -> list[GreedyRun]:
    """Submit every prompt at once (greedy, with top-2 logprobs); wait for all."""
    sink = Collector()
    for i, prompt in enumerate(prompts):
        client.submit(f"p{i}", prompt, greedy_params(max_tokens), sink)
    keys = [f"p{i}" for i in range(len(prompts))]
    sink.wait(keys)
    runs = []
    for key in keys:
        outs = sink.outputs[key]
        assert outs[-1].finish_reason == "length", outs[-1]
        runs.append(
            GreedyRun(
                [t for o in outs for t in o.new_token_ids],
                [v for o in outs for v in o.logprobs or []],
                [t for o in outs for t in o.top_logprobs or []],
            )
        )
    return runs


@functools.cache
def reference_runs(
    config: EngineConfig, prompts: tuple[tuple[int, ...], ...], max_tokens: int
) -> tuple[GreedyRun, ...]:
    """`run_client` on a size-1 engine of `config` in this process (`EngineThread`), computed
    once per process for the same arguments (the engine and tritonserver tests share it)."""
    engine = EngineThread(LLMEngine(config))
    try:
        return tuple(run_client(engine, [list(p) for p in prompts], max_tokens))
    finally:
        engine.shutdown()


def assert_same_greedy(
    reference: list[GreedyRun] | tuple[GreedyRun, ...],
    runs: list[list[int]],
    margin: float,
    max_ambiguous: int,
    logprobs: list[list[float]] | None = None,
    logprob_atol: float = 1e-4,
) -> int:
    """`runs[i]` equals `reference[i].ids` up to the reference's first position with a top-2
    margin below `margin`, where it holds one of the two tied ids; at most `max_ambiguous`
    sequences have such a position. With `logprobs`, each compared id's logprob matches the
    reference's within `logprob_atol`. Returns the number of ids compared."""
    ambiguous = compared = 0
    for i, (ref, ids) in enumerate(zip(reference, runs, strict=True)):
        assert len(ids) == len(ref.ids), i
        cut = next((k for k, m in enumerate(ref.margins()) if m < margin), len(ref.ids))
        assert ids[:cut] == ref.ids[:cut], (i, cut)
        if cut < len(ref.ids):
            ambiguous += 1
            assert ids[cut] in ref.top2[cut], (i, cut, ids[cut], ref.top2[cut])
        if logprobs is not None:
            for k in range(cut):
                assert abs(logprobs[i][k] - ref.logprobs[k]) <= logprob_atol, (i, k)
        compared += cut
    assert ambiguous <= max_ambiguous, f"{ambiguous} sequences reach a near-tie"
    return compared
