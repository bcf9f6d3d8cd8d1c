"""``llm_fused`` (tokenizer -> generator, the generator making the text) answers what ``llm``
(tokenizer -> generator -> detokenizer) answers, through the real tritonserver.

Responses may coalesce differently on two runs, so each choice's concatenated text, logprob
entries and final counts are compared, not single responses.
"""

from __future__ import annotations

import json
import queue
from collections import defaultdict

import numpy as np
import pytest

from tests.test_triton_n_logprobs import GREEDY, PROMPT, Stream

pytest.importorskip("tritonclient.grpc")

CASES = {
    "plain": {"text_input": PROMPT, "max_tokens": 12, **GREEDY},
    "chat": {
        "messages": json.dumps([{"role": "user", "content": "Hello there"}]),
        "max_tokens": 10,
        **GREEDY,
    },
    "logprobs": {"text_input": PROMPT, "max_tokens": 9, "logprobs": 3, **GREEDY},
    "prompt_logprobs": {"text_input": PROMPT, "max_tokens": 4, "prompt_logprobs": 2, **GREEDY},
    "echo": {"text_input": PROMPT, "max_tokens": 6, "exclude_input_in_output": False, **GREEDY},
    "n_seeded": {"text_input": PROMPT, "max_tokens": 8, "n": 3, "seed": 7, "temperature": 1.0},
    "not_streamed": {"text_input": PROMPT, "max_tokens": 7, "stream": False, **GREEDY},
}


@pytest.fixture
def stream(triton_server):
    s = Stream(triton_server.grpc_url)
    yield s
    s.close()


def _choices(responses) -> dict[int, dict]:
    """Per choice index: its text, logprob entries, prompt entries, last finish_reason and
    counts."""
    out: dict[int, dict] = defaultdict(lambda: {"text": "", "logprobs": [], "prompt": None})
    for outputs, _ in responses:
        if outputs is None:
            continue
        index = int(outputs["index"][0]) if "index" in outputs else 0
        choice = out[index]
        choice["text"] += outputs["text_output"][0].decode()
        raw = outputs["logprobs_json"][0].decode() if "logprobs_json" in outputs else ""
        choice["logprobs"] += json.loads(raw) if raw else []
        if "prompt_logprobs_json" in outputs:
            choice["prompt"] = json.loads(outputs["prompt_logprobs_json"][0].decode())
        choice["finish_reason"] = outputs["finish_reason"][0].decode()
        for name in ("num_output_tokens", "num_input_tokens", "cached_tokens"):
            if name in outputs:
                choice[name] = int(outputs[name][0])
    return dict(out)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_answers_what_llm_answers(stream, case):
    inputs = CASES[case]
    # cached_tokens is not compared: the second run finds the prompt in the prefix cache.
    fused = _choices(stream.run("llm_fused", inputs))
    base = _choices(stream.run("llm", inputs))
    assert sorted(fused) == sorted(base) == list(range(inputs.get("n", 1)))
    for index, want in base.items():
        got = fused[index]
        assert got["text"] == want["text"] and got["text"]
        assert got["finish_reason"] == want["finish_reason"]
        assert got["num_output_tokens"] == want["num_output_tokens"]
        assert got["num_input_tokens"] == want["num_input_tokens"]
        assert got["logprobs"] == want["logprobs"]
        assert got["prompt"] == want["prompt"]
    if "logprobs" in inputs:
        assert len(fused[0]["logprobs"]) == fused[0]["num_output_tokens"]
    if "prompt_logprobs" in inputs:
        assert fused[0]["prompt"][0]["logprob"] is None and len(fused[0]["prompt"]) > 1
    if inputs.get("exclude_input_in_output") is False:
        assert fused[0]["text"].startswith(PROMPT)


def test_fused_stop_string_trims_as_llm(stream):
    """A stop string that ends inside a token: the generator's trim_chars is applied to the
    text in the generator, as the detokenizer applies it."""
    probe = _choices(stream.run("llm", {"text_input": PROMPT, "max_tokens": 12, **GREEDY}))
    text = probe[0]["text"]
    stop = text[3:5]  # two characters from inside the text, so the cut lands mid-token
    inputs = {"text_input": PROMPT, "max_tokens": 12, "stop": [stop], **GREEDY}
    fused = _choices(stream.run("llm_fused", inputs))
    base = _choices(stream.run("llm", inputs))
    assert fused[0]["text"] == base[0]["text"] == text[: text.index(stop)]
    assert fused[0]["finish_reason"] == base[0]["finish_reason"] == "stop"


def test_fused_leaves_out_default_index_and_logprobs_json(stream):
    """n = 1 without logprobs: the responses carry text, finish_reason and counts only."""
    responses = stream.run("llm_fused", {"text_input": PROMPT, "max_tokens": 5, **GREEDY})
    names = set().union(*(set(o) for o, _ in responses if o is not None))
    assert names == {
        "text_output",
        "finish_reason",
        "num_output_tokens",
        "num_input_tokens",
        "cached_tokens",
    }


def test_fused_refuses_bad_input_with_the_llm_error(stream):
    inputs = {"text_input": PROMPT, "max_tokens": 4, "temperature": 5.0}
    errors = []
    for model in ("llm_fused", "llm"):
        with pytest.raises(Exception) as failure:
            stream.run(model, inputs)
        errors.append(str(failure.value).split("tritonllm-error:", 1)[1])
    assert errors[0] == errors[1]
    assert json.loads(errors[0])["param"] == "temperature"


def test_generator_direct_call_asking_for_text(triton_server, tokenizer):
    """A direct generator request that asks for text_output only gets text (and the same text
    as asking for ids and detokenizing them)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    ids = tokenizer(PROMPT)["input_ids"]
    arrays = {
        "input_ids": np.asarray(ids, np.int32),
        "max_tokens": np.asarray([6], np.int32),
        "temperature": np.asarray([0.0], np.float32),
        "stream": np.asarray([False]),
    }
    tensors = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    answers = {}
    try:
        for wanted in (("text_output", "finish_reason"), ("output_ids",)):
            outputs = [grpcclient.InferRequestedOutput(name) for name in wanted]
            client.async_stream_infer("generator", tensors, outputs=outputs)
            result, error = results.get(timeout=60)  # stream=false: one response
            assert error is None, error
            answers[wanted] = result
    finally:
        client.stop_stream()
        client.close()
    text_result = answers[("text_output", "finish_reason")]
    assert {o.name for o in text_result.get_response().outputs} == {"text_output", "finish_reason"}
    text = text_result.as_numpy("text_output")[0].decode()
    ids = answers[("output_ids",)].as_numpy("output_ids").tolist()
    assert len(ids) == 6
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
