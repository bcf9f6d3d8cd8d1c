"""lm-evaluation-harness (``lm_eval``, its ``local-completions`` model) against the real sidecar
and tritonserver, on two local tasks (``tests/lm_eval/``, JSONL data, no hub access): a
multiple-choice task scored by loglikelihood (echo + logprobs of token-id prompts) and a
``generate_until`` task. Oracles: transformers' float32 log_softmax summed over each choice's
tokens (the same context/continuation split lm_eval makes), and transformers' greedy ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TASKS_DIR = Path(__file__).parent / "lm_eval"
TOL = 1e-3  # a sum of a few float32 logprobs


@pytest.fixture(scope="module")
def results(sidecar, tiny_model_dir, tmp_path_factory):
    """lm_eval's ``simple_evaluate`` of both tasks, with every sample logged."""
    mp = pytest.MonkeyPatch()
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
    mp.chdir(TASKS_DIR)  # the task YAMLs name their data files relative to it
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    model_args = {
        "model": sidecar.model_name,
        "base_url": f"{sidecar.base_url}/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tiny_model_dir),
        "num_concurrent": 2,
        "max_retries": 1,
    }
    try:
        yield lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=["tritonllm_mc", "tritonllm_gen"],
            task_manager=TaskManager(include_path=str(TASKS_DIR)),
            log_samples=True,
        )
    finally:
        mp.undo()


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS_DIR / name).read_text().splitlines()]


def test_multiple_choice_loglikelihoods_match_transformers(results, tokenizer, hf_logprobs):
    """Each choice's loglikelihood is transformers' (context = question, continuation = " " +
    choice, split as lm_eval splits it), and acc is the argmax's accuracy."""
    samples = sorted(results["samples"]["tritonllm_mc"], key=lambda s: s["doc_id"])
    docs = _docs("mc.jsonl")
    assert len(samples) == len(docs)
    correct = []
    for doc, sample in zip(docs, samples, strict=True):
        context_ids = tokenizer.encode(doc["question"], add_special_tokens=False)
        expected = []
        for choice in doc["choices"]:
            whole = tokenizer.encode(f"{doc['question']} {choice}", add_special_tokens=False)
            continuation = whole[len(context_ids) :]
            logprobs = hf_logprobs(context_ids, continuation)
            expected.append(sum(float(logprobs[j, t]) for j, t in enumerate(continuation)))
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=TOL)
        correct.append(max(range(len(expected)), key=expected.__getitem__) == doc["answer"])
    acc = results["results"]["tritonllm_mc"]["acc,none"]
    assert acc == pytest.approx(sum(correct) / len(correct))


def test_generate_until_gives_transformers_greedy_text(results, tokenizer, hf_greedy):
    samples = sorted(results["samples"]["tritonllm_gen"], key=lambda s: s["doc_id"])
    docs = _docs("gen.jsonl")
    assert len(samples) == len(docs)
    for doc, sample in zip(docs, samples, strict=True):
        ids = tokenizer.encode(doc["prompt"], add_special_tokens=False)
        text = tokenizer.decode(hf_greedy(ids, 8), skip_special_tokens=True)
        assert sample["resps"][0][0] == text.split("\n")[0]
    assert "exact_match,none" in results["results"]["tritonllm_gen"]
