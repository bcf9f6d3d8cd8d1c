"""``n`` and ``logprobs`` through the Triton models (real tritonserver, tritonclient gRPC), and
the engine's stop-string hold-back of logprobs underneath.

Oracles: Hugging Face transformers' float32 logits of the tiny checkpoint (log_softmax at every
generated position), single-choice requests with seed + i for choice i, and the generator's
own id stream (prefix ids, stop strings) decoded by the Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.request
import uuid
from collections import defaultdict

import numpy as np
import pytest
import torch
from openai_helpers import strict_json

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

INT32 = {"max_tokens", "top_k", "input_ids", "logprobs", "n", "stop_token_ids", "prompt_logprobs"}
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
TOL = 1e-4


def _array(name: str, value) -> np.ndarray:
    if isinstance(value, str):
        return np.array([value.encode()], dtype=np.object_)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return np.array([v.encode() for v in value], dtype=np.object_)
    if isinstance(value, bool):
        return np.array([value], dtype=bool)
    if name == "seed":
        return np.array([value], dtype=np.int64)
    if name in INT32:
        return np.asarray(value if isinstance(value, list) else [value], dtype=np.int32)
    return np.array([value], dtype=np.float32)


class Stream:
    """One gRPC stream; ``run`` sends one request and returns its responses in order."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, model: str, inputs: dict) -> str:
        tensors = []
        for name, value in inputs.items():
            array = _array(name, value)
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        request_id = uuid.uuid4().hex
        self.client.async_stream_infer(
            model, tensors, request_id=request_id, enable_empty_final_response=True
        )
        return request_id

    def next(self, timeout: float = 60.0) -> tuple[dict | None, bool]:
        """(outputs or None for an empty response, Triton final flag). Raises on an error."""
        result, error = self.results.get(timeout=timeout)
        if error is not None:
            raise error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        return {o.name: result.as_numpy(o.name) for o in response.outputs} or None, final

    def run(self, model: str, inputs: dict) -> list[tuple[dict | None, bool]]:
        self.send(model, inputs)
        responses = []
        while not (responses and responses[-1][1]):
            responses.append(self.next())
        return responses

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
def stream(triton_server):
    s = Stream(triton_server.grpc_url)
    yield s
    s.close()


def _by_index(responses) -> dict[int, list[dict]]:
    choices = defaultdict(list)
    for outputs, _ in responses:
        if outputs is not None:
            choices[int(outputs["index"][0])].append(outputs)
    return choices


def _text(outputs: list[dict]) -> str:
    return "".join(o["text_output"][0].decode() for o in outputs)


def _flat(outputs: list[dict], name: str) -> np.ndarray:
    return np.concatenate([o[name].reshape(-1) for o in outputs])


def _check_logprob_outputs(outputs: dict, k: int) -> list[dict]:
    """The per-response contract: shapes, most likely first, JSON equal to the tensors."""
    lps = outputs["output_logprobs"].reshape(-1)
    top_ids = outputs["top_logprob_ids"].reshape(-1)
    top = outputs["top_logprobs"].reshape(-1)
    assert len(top_ids) == len(top) == k * len(lps)
    rows = top.reshape(len(lps), k)
    assert np.all(np.diff(rows, axis=1) <= 0)  # sorted, most likely first
    raw = outputs["logprobs_json"][0].decode()
    entries = json.loads(raw) if raw else []
    assert len(entries) == len(lps)
    for i, entry in enumerate(entries):
        assert entry["logprob"] == pytest.approx(float(lps[i]), abs=1e-6)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            rows[i].tolist(), abs=1e-6
        )
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", errors="replace")
    return entries


def test_llm_n_choices_stream_with_their_index_and_seed_plus_i(stream):
    common = {"text_input": PROMPT, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    responses = stream.run("llm", {**common, "seed": 11, "n": 3, "logprobs": 2})
    assert [final for _, final in responses].count(True) == 1  # one request, one final flag
    choices = _by_index(responses)
    assert sorted(choices) == [0, 1, 2]
    for index, outputs in choices.items():
        reasons = [o["finish_reason"][0].decode() for o in outputs]
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {""}
        assert int(outputs[-1]["num_output_tokens"][0]) == 8
        assert sum(len(_check_logprob_outputs(o, 2)) for o in outputs) == 8
        single = stream.run("llm", {**common, "seed": 11 + index})
        assert _text(outputs) == _text(_by_index(single)[0]), index


def test_llm_greedy_logprobs_match_transformers(stream, tokenizer, hf_logprobs):
    k, n = 3, 10
    responses = stream.run("llm", {"text_input": PROMPT, "max_tokens": n, "logprobs": k, **GREEDY})
    outputs = _by_index(responses)[0]
    entries = [e for o in outputs for e in _check_logprob_outputs(o, k)]
    chosen = _flat(outputs, "top_logprob_ids").reshape(n, k)[:, 0].tolist()  # greedy = top-1
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = hf_logprobs(prompt_ids, chosen)
    assert chosen == expected.argmax(dim=-1).tolist()  # the greedy ids of transformers
    lps = torch.from_numpy(_flat(outputs, "output_logprobs"))
    torch.testing.assert_close(
        lps, expected.gather(1, torch.tensor(chosen)[:, None])[:, 0], atol=TOL, rtol=0
    )
    top_values = torch.from_numpy(_flat(outputs, "top_logprobs")).reshape(n, k)
    torch.testing.assert_close(top_values, expected.topk(k, dim=-1).values, atol=TOL, rtol=0)
    text = _text(outputs)
    assert text == tokenizer.decode(chosen, skip_special_tokens=True)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace") == text


def test_llm_tiny_temperature_is_greedy_with_finite_logprobs(stream):
    """temperature 1e-40 (a valid FP32 input whose 1 / T overflows float32) is greedy: the
    same ids, text and logprobs as temperature 0, and ``logprobs_json`` is strict JSON (``llm``
    sent NaN logprobs, and token 0 repeated, before)."""
    inputs = {"text_input": PROMPT, "max_tokens": 8, "logprobs": 2, "seed": 3, "ignore_eos": True}
    tiny = _by_index(stream.run("llm", {**inputs, "temperature": 1e-40}))[0]
    greedy = _by_index(stream.run("llm", {**inputs, "temperature": 0.0}))[0]
    assert _text(tiny) == _text(greedy)
    assert _flat(tiny, "top_logprob_ids").tolist() == _flat(greedy, "top_logprob_ids").tolist()
    for name in ("output_logprobs", "top_logprobs"):
        values = _flat(tiny, name)
        assert np.isfinite(values).all()
        np.testing.assert_allclose(values, _flat(greedy, name), atol=1e-5, rtol=0)
    entries = [e for o in tiny for e in strict_json(o["logprobs_json"][0].decode() or "[]")]
    assert len(entries) == 8
    assert [e["top_logprobs"][0]["token"] for e in entries] == [e["token"] for e in entries]


def test_engine_releases_held_logprobs_with_their_ids(tiny_model_dir, tokenizer, hf_logprobs):
    from tritonllm.config import EngineConfig
    from tritonllm.engine.engine import LLMEngine
    from tritonllm.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), device="cpu", page_size=4, num_pages=128)
    )
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    (ids,) = engine.generate([prompt], greedy)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    # A false start (tokens 8.. are held while they could begin it, then released together)
    # and a real stop string later.
    start = len(tokenizer.decode(ids[:8], skip_special_tokens=True))
    false_start = text[start : start + 12] + "\x00"
    start = len(tokenizer.decode(ids[:16], skip_special_tokens=True))
    stop = text[start : start + 6]
    params = SamplingParams(**{**greedy.__dict__, "stop": (false_start, stop), "logprobs": 2})
    engine.add_request("r", prompt, params)
    released, logprobs, held_at_once, final = [], [], 0, None
    while final is None:
        for out in engine.step():
            assert len(out.logprobs or []) == len(out.new_token_ids) == len(out.top_logprobs or [])
            held_at_once = max(held_at_once, len(out.new_token_ids))
            released += out.new_token_ids
            logprobs += out.logprobs or []
            final = out if out.finished else None
    assert final.finish_reason == "stop" and held_at_once > 1
    assert released == ids[: len(released)] and final.num_output_tokens == len(released)
    expected = hf_logprobs(prompt, released).gather(1, torch.tensor(released)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=TOL, rtol=0)


def test_generator_stop_string_keeps_logprobs_aligned_with_ids(stream, tokenizer, hf_logprobs):
    prompt_ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    free = stream.run("generator", {"input_ids": prompt_ids, "max_tokens": 24, **GREEDY})
    greedy_ids = _flat([o for o, _ in free if o is not None], "output_ids").tolist()
    text = tokenizer.decode(greedy_ids, skip_special_tokens=True)
    # A stop string in the middle of the text: its first characters are held back first.
    start = len(text) // 2
    stop = text[start : start + 3]
    start = text.index(stop)
    responses = stream.run(
        "generator",
        {"input_ids": prompt_ids, "max_tokens": 24, "stop": [stop], "logprobs": 1, **GREEDY},
    )
    outputs = [o for o, _ in responses if o is not None]
    for o in outputs:
        assert len(o["output_logprobs"]) == len(o["output_ids"]) == len(o["top_logprob_ids"])
    ids = _flat(outputs, "output_ids").tolist()
    assert outputs[-1]["finish_reason"][0] == b"stop"
    assert ids == greedy_ids[: len(ids)]
    assert text[:start] in tokenizer.decode(ids, skip_special_tokens=True)
    expected = hf_logprobs(prompt_ids, ids).gather(1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(
        torch.from_numpy(_flat(outputs, "output_logprobs")), expected, atol=TOL, rtol=0
    )


def test_generator_n_children_have_their_own_prefix_ids(stream, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    responses = stream.run(
        "generator", {"input_ids": prompt_ids, "max_tokens": 12, "n": 2, **GREEDY}
    )
    choices = _by_index(responses)
    seen = {}
    for index, outputs in choices.items():
        ids: list[int] = []
        for o in outputs:
            assert o["prefix_ids"].tolist() == ids[-8:]
            ids += o["output_ids"].tolist()
            assert "output_logprobs" not in o  # not requested: not sent
        seen[index] = ids
    assert len(seen[0]) == 12 and seen[0] == seen[1]  # greedy choices are identical


def test_requests_with_and_without_logprobs_share_the_detokenizer(stream, tokenizer):
    """Concurrent requests, half with logprobs: the detokenizer's dynamic batches mix requests
    with and without the optional logprob inputs, and each gets what it asked for."""
    prompts = ["Hello world", "Once upon a time", "1, 2, 3", "The sky is"]
    sent = {}
    for i, prompt in enumerate(prompts * 2):
        extra = {"logprobs": 1} if i % 2 else {}
        rid = stream.send("llm", {"text_input": prompt, "max_tokens": 12, **GREEDY, **extra})
        sent[rid] = (prompt, bool(extra))
    responses: dict[str, list[dict]] = defaultdict(list)
    finals = 0
    while finals < len(sent):
        result, error = stream.results.get(timeout=60)
        assert error is None, error
        response = result.get_response()
        finals += response.parameters["triton_final_response"].bool_param
        if response.outputs:
            responses[response.id].append(
                {o.name: result.as_numpy(o.name) for o in response.outputs}
            )
    texts = {}
    for rid, (prompt, with_logprobs) in sent.items():
        outputs = responses[rid]
        texts.setdefault(prompt, _text(outputs))
        assert _text(outputs) == texts[prompt]  # the same greedy text either way
        entries = (
            [e for o in outputs for e in _check_logprob_outputs(o, 1)] if with_logprobs else []
        )
        assert len(entries) == (12 if with_logprobs else 0)
        if not with_logprobs:
            assert all(o["logprobs_json"][0] == b"" and "output_logprobs" not in o for o in outputs)


def test_n_above_one_requires_stream(stream):
    stream.send("llm", {"text_input": PROMPT, "max_tokens": 2, "n": 2, "stream": False})
    with pytest.raises(InferenceServerException, match="n > 1 requires stream=true"):
        stream.next()
    stream.send("llm", {"text_input": PROMPT, "max_tokens": 2, "logprobs": 21})
    with pytest.raises(InferenceServerException, match="logprobs"):
        stream.next()


def _pages_used(server) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    line = next(s for s in text.splitlines() if s.startswith("tritonllm_kv_pages_used{"))
    return float(line.rsplit(" ", 1)[1])


def test_cancelled_n_stream_aborts_every_choice(triton_server, tokenizer):
    cancelled = Stream(triton_server.grpc_url)
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    cancelled.send("generator", {"input_ids": ids, "max_tokens": 2000, "n": 3, **GREEDY})
    indexes = {int(cancelled.next()[0]["index"][0]) for _ in range(12)}
    assert indexes == {0, 1, 2}
    cancelled.close(cancel=True)
    deadline = time.monotonic() + 3.0
    while _pages_used(triton_server) != 0:
        assert time.monotonic() < deadline, "KV pages still used after cancelling an n=3 stream"
        time.sleep(0.05)


def test_detokenizer_direct_call_with_and_without_logprobs(triton_server, tokenizer):
    """Direct callers may leave the optional inputs out: index 0, no logprobs JSON. (The
    detokenizer takes one response per request, without a batch dimension: see its config.)"""
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    base = {
        "output_ids": np.array(ids, np.int32),
        "prefix_ids": np.zeros(0, np.int32),
        "finish_reason": np.array([b"length"], np.object_),
        "num_input_tokens": np.array([3], np.int32),
        "num_output_tokens": np.array([len(ids)], np.int32),
        "cached_tokens": np.array([0], np.int32),
        "trim_chars": np.array([0], np.int32),
    }
    with_logprobs = {
        **base,
        "index": np.array([2], np.int32),
        "output_logprobs": np.array([-0.5, -1.5], np.float32),
        "top_logprob_ids": np.array([ids[0], 151645, ids[1], 0], np.int32),
        "top_logprobs": np.array([-0.5, -3.0, -1.5, -2.0], np.float32),
    }
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    results = []
    for inputs in (base, with_logprobs):
        tensors = []
        for name, array in inputs.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        results.append(client.infer("detokenizer", tensors))
    client.close()
    plain, rich = results
    assert plain.as_numpy("text_output")[0].decode() == "Hello world"
    assert int(plain.as_numpy("index")[0]) == 0
    assert plain.as_numpy("logprobs_json")[0] == b""
    assert int(rich.as_numpy("index")[0]) == 2
    entries = json.loads(rich.as_numpy("logprobs_json")[0].decode())
    assert [e["token"] for e in entries] == ["Hello", " world"]
    assert [e["bytes"] for e in entries] == [list(b"Hello"), list(b" world")]
    assert [[t["token"] for t in e["top_logprobs"]] for e in entries] == [
        ["Hello", "<|im_end|>"],  # a special token is named by its text
        [" world", tokenizer.convert_ids_to_tokens(0)],
    ]
    assert entries[1]["top_logprobs"][1]["logprob"] == -2.0


def test_coalesce_and_stream_state_carry_logprobs_per_choice():
    from tritonllm.engine.request import RequestOutput
    from tritonllm.serving.coalesce import coalesce
    from tritonllm.serving.logprobs import flatten_top_logprobs
    from tritonllm.serving.stream_state import StreamState

    def out(rid, ids, reason=None, lps=None, index=0):
        top = (
            None
            if lps is None
            else [{t: lp, t + 1: lp - 1} for t, lp in zip(ids, lps, strict=True)]
        )
        return RequestOutput(rid, ids, reason is not None, reason, 3, 1, 0, lps, top, index=index)

    merged = coalesce(
        [
            out("r", [1], lps=[-0.1]),
            out("r", [5], lps=[-0.5], index=1),
            out("r", [2], lps=[-0.2]),
            out("r", [], "abort"),
        ]
    )
    # Choices of one request are merged by index, never with each other (in the order of
    # their last outputs).
    assert [(m.index, m.new_token_ids, m.logprobs) for m in merged] == [
        (1, [5], [-0.5]),
        (0, [1, 2], [-0.1, -0.2]),
    ]
    ids, values = flatten_top_logprobs(merged[1].top_logprobs, 2)
    assert ids.tolist() == [1, 2, 2, 3] and values.tolist() == pytest.approx(
        [-0.1, -1.1, -0.2, -1.2]
    )
    state = StreamState(stream=False, index=4, num_choices=5, num_top=2)
    assert state.on_output(out("r", [7], lps=[-1.0], index=4)) is None
    chunk = state.on_output(out("r", [8], "length", lps=[-2.0], index=4))
    assert (chunk.index, chunk.output_ids, chunk.logprobs) == (4, [7, 8], [-1.0, -2.0])
    assert chunk.with_index and chunk.num_top == 2


def test_logprob_entries_report_non_finite_values_as_json_numbers():
    """-inf (a masked token) is vLLM's floor, -9999.0; NaN (logits that were not finite) the
    floor too and +inf 0.0: the entries dump as strict JSON, and finite values are kept."""
    from tritonllm.serving.logprobs import logprob_entries, prompt_logprob_entries

    def token_bytes(token_id: int) -> bytes:
        return b"t%d" % token_id

    lps = np.array([-np.inf, np.nan, -0.5], np.float32)
    top_ids = np.array([1, 2, 3, 4, 5, 6], np.int32)
    top = np.array([-1.0, -np.inf, np.nan, np.inf, -0.5, -9999.5], np.float32)
    entries = logprob_entries(token_bytes, [7, 8, 9], lps, top_ids, top)
    assert [e["logprob"] for e in entries] == [-9999.0, -9999.0, -0.5]
    assert [[t["logprob"] for t in e["top_logprobs"]] for e in entries] == [
        [-1.0, -9999.0],
        [-9999.0, 0.0],
        [-0.5, -9999.0],
    ]
    json.dumps(entries, allow_nan=False)
    prompt = prompt_logprob_entries(token_bytes, [1, 2], np.array([np.nan], np.float32), [], [])
    assert prompt[1]["logprob"] == -9999.0
    json.dumps(prompt, allow_nan=False)
