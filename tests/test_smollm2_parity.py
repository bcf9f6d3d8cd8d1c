"""Correctness on trained weights: the converted SmolLM2-135M-Instruct (float32, CPU) gives the
same greedy tokens through the engine, and the same answers through the whole service, as
Hugging Face transformers on the same directory.

Float32 ties: two logits closer than ``TIE_MARGIN`` can swap their order between two correct
implementations (a different summation order). Ids are therefore compared up to the first
position where transformers' top-2 margin is below ``TIE_MARGIN`` (past it, both continuations
are right), and such positions must be rare: at most ``MAX_AMBIGUOUS`` sequences per test.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from openai_helpers import chat_prompt_ids
from test_engine_helpers import hf_greedy

from tritonllm.config import EngineConfig, ModelConfig
from tritonllm.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams

TIE_MARGIN = 1e-4
MAX_AMBIGUOUS = 1
NEW_TOKENS = 64

LONG_TEXT = (
    "The Industrial Revolution began in Great Britain in the late 18th century and spread to "
    "Europe and North America. It replaced hand production with machines, introduced new "
    "chemical and iron processes, and made steam power and the factory system common. "
    "Textiles were the first industry to use modern methods, and output per worker rose "
    "sharply. Living standards, cities and trade all changed over the following century. "
) * 3
# Chat prompts from one line to a few hundred tokens, single and multi-turn, with the model's
# default system prompt and with one of their own. The first wave is admitted first; the second
# joins the running batch once the first is prefilled, so with the prefix cache on it reuses
# their pages: the default system prompt, and the whole first turn of the Ada conversation.
ADA = [{"role": "user", "content": "My name is Ada. Remember it."}]
FIRST_WAVE = [
    [{"role": "user", "content": "Hi"}],
    ADA,
    [
        {"role": "system", "content": "You are a pirate. Answer in pirate speak."},
        {"role": "user", "content": "Where is the treasure buried?"},
    ],
    [{"role": "user", "content": "Summarize this text in two sentences:\n\n" + LONG_TEXT}],
]
SECOND_WAVE = [
    [{"role": "user", "content": "What is the capital of France?"}],
    ADA
    + [
        {"role": "assistant", "content": "Nice to meet you, Ada! I will remember your name."},
        {"role": "user", "content": "What is my name, and what does it remind you of?"},
    ],
    [{"role": "user", "content": "Write a short poem about the sea at night."}],
    [{"role": "user", "content": "Compute 12 * 34 and 1,234 + 5,678; show the steps:\n\n1. "}],
]
CHATS = FIRST_WAVE + SECOND_WAVE
# Factual questions whose greedy answers are short (8 to 24 tokens): the oracle's cost is one
# transformers forward per answer token.
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many days are there in a week?",
    "What is the capital of Germany?",
    "What is 2 + 2?",
    "What is the capital of Canada?",
    "What is the capital of England?",
    "What is the capital of Egypt?",
    "What is the capital of Russia?",
    "What is the freezing point of water in degrees Fahrenheit?",
    "What is the largest ocean on Earth?",
    "What is the capital of Italy?",
]


def comparable_len(logits: torch.Tensor) -> int:
    """Positions of a greedy run whose choice is unambiguous: the index of the first one whose
    top-2 logit margin is below ``TIE_MARGIN`` (``len(logits)`` when there is none)."""
    top2 = logits.topk(2, dim=-1).values
    ties = ((top2[:, 0] - top2[:, 1]) < TIE_MARGIN).nonzero()
    return int(ties[0]) if len(ties) else len(logits)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    return [chat_prompt_ids(smollm2_tokenizer, chat) for chat in CHATS]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts) -> list[tuple[list[int], int]]:
    """transformers' greedy ids (``NEW_TOKENS`` each, past EOS) and their comparable length."""
    runs = [hf_greedy(str(smollm2_dir), p, NEW_TOKENS) for p in prompts]
    return [(ids, comparable_len(logits)) for ids, logits in runs]


def run_batch(engine: LLMEngine, prompts: list[list[int]]):
    """The first wave, then (after its prefill step) the second wave joining it: one continuous
    batch. Returns ``(ids per prompt, cached prompt tokens per prompt)``."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    keys = [f"chat-{i}" for i in range(len(prompts))]
    ids: dict[str, list[int]] = {key: [] for key in keys}
    cached: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            ids[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.cached_tokens

    for key, prompt in zip(keys[: len(FIRST_WAVE)], prompts, strict=False):
        engine.add_request(key, prompt, params)
    step()
    assert engine.stats().num_running == len(FIRST_WAVE)
    for key, prompt in zip(keys[len(FIRST_WAVE) :], prompts[len(FIRST_WAVE) :], strict=True):
        engine.add_request(key, prompt, params)
    while engine.has_unfinished():
        step()
    return [ids[key] for key in keys], [cached[key] for key in keys]


def assert_matches(outs: list[list[int]], reference) -> None:
    ambiguous = 0
    for i, (out, (ref, k)) in enumerate(zip(outs, reference, strict=True)):
        assert len(out) == NEW_TOKENS, i
        assert out[:k] == ref[:k], f"prompt {i}: first difference at {_first_diff(out, ref)}"
        ambiguous += k < NEW_TOKENS
    assert ambiguous <= MAX_AMBIGUOUS, f"{ambiguous} sequences hit a float32 tie"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def test_prompts_have_different_lengths(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(set(lengths)) == len(prompts) and lengths[0] < 40 and lengths[-1] > 250


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_engine_greedy_equals_transformers(smollm2_dir, prompts, reference, prefix_cache):
    """8 chat prompts in one continuous batch, 64 greedy tokens each, equal transformers'; with
    the prefix cache on, the second wave's prompts start from cached pages and stay exact."""
    page_size = 16
    config = EngineConfig(
        model=str(smollm2_dir),
        device="cpu",
        dtype="float32",
        page_size=page_size,
        enable_prefix_cache=prefix_cache,
    )
    engine = LLMEngine(config)
    outs, cached = run_batch(engine, prompts)
    assert_matches(outs, reference)
    assert engine.stats().max_batch_size_seen == len(prompts)
    first, second = cached[: len(FIRST_WAVE)], cached[len(FIRST_WAVE) :]
    if not prefix_cache:
        assert cached == [0] * len(prompts)
        return
    assert first == [0] * len(FIRST_WAVE)
    assert all(c >= page_size for c in second), second  # the default system prompt's page
    ada_turn = (len(prompts[FIRST_WAVE.index(ADA)]) // page_size) * page_size
    assert second[1] == ada_turn  # the whole first Ada prompt, page for page


def test_service_answers_equal_transformers_word_for_word(
    smollm2_service, smollm2_dir, smollm2_tokenizer
):
    """12 factual questions at temperature 0, sent at once through tritonserver + the sidecar:
    each answer's text and finish_reason are transformers' greedy answer (ending at EOS)."""
    eos = frozenset(ModelConfig.from_pretrained(str(smollm2_dir)).eos_token_ids)
    client = openai.OpenAI(base_url=smollm2_service.base_url, api_key="unused", max_retries=0)

    def ask(question: str):
        return client.chat.completions.create(
            model=smollm2_service.model_name,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=NEW_TOKENS,
        )

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(ask, QUESTIONS))
    ambiguous = 0
    for question, answer in zip(QUESTIONS, answers, strict=True):
        prompt = chat_prompt_ids(smollm2_tokenizer, [{"role": "user", "content": question}])
        ids, logits = hf_greedy(str(smollm2_dir), prompt, NEW_TOKENS, stop_ids=eos)
        k = comparable_len(logits)
        text = smollm2_tokenizer.decode(ids[:k], skip_special_tokens=True)
        choice = answer.choices[0]
        if k == len(ids):
            assert choice.message.content == text, question
            assert choice.finish_reason == ("stop" if ids[-1] in eos else "length"), question
            assert answer.usage.completion_tokens == len(ids), question
        else:
            ambiguous += 1
            assert choice.message.content.startswith(text), question
    assert ambiguous <= MAX_AMBIGUOUS, f"{ambiguous} answers hit a float32 tie"
    france = answers[0].choices[0]
    assert "Paris" in france.message.content and france.finish_reason == "stop"
