"""Shared helpers for the tensor-parallel tests (no tests here): greedy runs with their top-2
logprobs, the honest comparison of two greedy runs, the SmolLM2 prompts and engine settings.

Ties: two logits closer than the comparison's `margin` may swap their order between two correct
computations that sum in another order (a row-parallel all-reduce does). The ids of a run are
therefore compared up to the first position where the reference's top-2 margin is below it;
there the other run must have picked one of the two near-tied ids, and past it both
continuations are right. Such positions must be rare (`max_ambiguous` sequences per test).
"""

from __future__ import annotations

from dataclasses import dataclass

from test_engine_thread import Collector

from tritonllm.config import EngineConfig
from tritonllm.engine import EngineThread, LLMEngine
from tritonllm.engine.client import EngineClient
from tritonllm.sampling_params import SamplingParams

TIE_MARGIN = 1e-4  # float32: logits closer than this may swap under another summation order
SMOLLM2_TOKENS = 24
# Chat prompts for SmolLM2 (its own template, which adds its default system prompt where a chat
# has none): short and long, one and several turns.
SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea at night."}],
    [
        {"role": "system", "content": "You are a pirate. Answer in pirate speak."},
        {"role": "user", "content": "Where is the treasure buried?"},
    ],
    [
        {"role": "user", "content": "My name is Ada. Remember it."},
        {"role": "assistant", "content": "Nice to meet you, Ada! I will remember your name."},
        {"role": "user", "content": "What is my name, and what does it remind you of?"},
    ],
    [{"role": "user", "content": "Summarize: " + "Steam power changed industry and cities. " * 12}],
]


def smollm2_config(model_dir) -> EngineConfig:
    """The SmolLM2 engine of the size-1 reference and of the served TP=2 engine
    (`test_tp_triton`, through ``TRITONLLM_*``)."""
    return EngineConfig(model=str(model_dir), device="cpu", page_size=16, num_pages=512)


def smollm2_prompts(tokenizer) -> list[list[int]]:
    from openai_helpers import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, chat) for chat in SMOLLM2_CHATS]


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


def reference_runs(
    config: EngineConfig, prompts: list[list[int]], max_tokens: int
) -> list[GreedyRun]:
    """`run_client` on a size-1 engine of `config` in this process (`EngineThread`)."""
    engine = EngineThread(LLMEngine(config))
    try:
        return run_client(engine, prompts, max_tokens)
    finally:
        engine.shutdown()


def assert_same_greedy(
    reference: list[GreedyRun],
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
