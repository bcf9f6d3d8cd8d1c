"""Clients written for Triton's two common LLM conventions drive the service unchanged.

- The Triton vLLM backend's sample client flow (``samples/client.py`` of
  triton-inference-server/vllm_backend): ``tritonclient.grpc.aio`` ``stream_infer`` to one model
  with ``text_input`` [1] BYTES, ``stream`` [1] BOOL, ``sampling_parameters`` [1] BYTES (a JSON
  object whose values are strings), ``exclude_input_in_output`` [1] BOOL, the same sampling
  parameters as the request's Triton parameters, and string request ids.
- TensorRT-LLM's end-to-end gRPC client flow (``inflight_batcher_llm/client``): ``[1, 1]``
  tensors to the model ``ensemble``, ``start_stream`` / ``async_stream_infer`` /
  ``stop_stream``, text read from ``text_output[0][0]``.

Oracle: Hugging Face transformers' greedy text on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import queue
from functools import partial

import numpy as np
import pytest
import requests

grpcclient = pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc.aio as aioclient  # noqa: E402
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time"]
GREEDY_TOKENS = 10


def greedy_text(tokenizer, hf_greedy, prompt, n=GREEDY_TOKENS):
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return tokenizer.decode(hf_greedy(ids, n), skip_special_tokens=True)


# --- the vLLM backend's convention ----------------------------------------------------------
def vllm_request(prompt, stream, request_id, sampling_parameters, exclude_input_in_output):
    """One request as the vLLM backend's sample client builds it."""
    inputs = []
    tensor = aioclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs.append(tensor)
    tensor = aioclient.InferInput("stream", [1], "BOOL")
    tensor.set_data_from_numpy(np.array([stream], dtype=bool))
    inputs.append(tensor)
    tensor = aioclient.InferInput("sampling_parameters", [1], "BYTES")
    payload = json.dumps(sampling_parameters).encode("utf-8")
    tensor.set_data_from_numpy(np.array([payload], dtype=np.object_))
    inputs.append(tensor)
    tensor = aioclient.InferInput("exclude_input_in_output", [1], "BOOL")
    tensor.set_data_from_numpy(np.array([exclude_input_in_output], dtype=bool))
    inputs.append(tensor)
    return {
        "model_name": "llm",
        "inputs": inputs,
        "outputs": [aioclient.InferRequestedOutput("text_output")],
        "request_id": str(request_id),
        "parameters": sampling_parameters,
    }


async def vllm_client_run(url, prompts, stream, sampling_parameters, exclude_input_in_output):
    """The sample client's flow: one bidirectional stream, every prompt a request, text
    appended per request id; returns ({id: text}, errors)."""
    client = aioclient.InferenceServerClient(url=url)

    async def requests_iterator():
        for i, prompt in enumerate(prompts):
            yield vllm_request(prompt, stream, i, sampling_parameters, exclude_input_in_output)

    results, errors = {str(i): [] for i in range(len(prompts))}, []
    try:
        async for result, error in client.stream_infer(inputs_iterator=requests_iterator()):
            if error:
                errors.append(error)
                continue
            for piece in result.as_numpy("text_output"):
                results[result.get_response().id].append(piece.decode("utf-8"))
    finally:
        await client.close()
    return {rid: "".join(parts) for rid, parts in results.items()}, errors


SAMPLE_PARAMETERS = {"temperature": "0", "top_p": "0.95", "max_tokens": str(GREEDY_TOKENS)}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("exclude", [False, True], ids=["with-prompt", "without-prompt"])
def test_vllm_sample_client_flow_gets_the_greedy_text(
    triton_server,
    tokenizer,
    hf_greedy,
    stream,
    exclude,
):
    params = {**SAMPLE_PARAMETERS, "ignore_eos": "true"}
    texts, errors = asyncio.run(
        vllm_client_run(triton_server.grpc_url, PROMPTS, stream, params, exclude)
    )
    assert not errors
    for i, prompt in enumerate(PROMPTS):
        expected = greedy_text(tokenizer, hf_greedy, prompt)
        # exclude_input_in_output false: the text starts with the prompt, as vLLM's backend
        # answers (here also when streaming, where vLLM refuses it).
        assert texts[str(i)] == (expected if exclude else prompt + expected)


def test_vllm_parameters_alone_drive_the_request(triton_server, tokenizer, hf_greedy):
    """Sampling parameters only in the request's Triton parameters (no tensor), values as
    strings: honoured."""
    prompt = PROMPTS[0]
    expected = greedy_text(tokenizer, hf_greedy, prompt, 6)
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    parameters = {"temperature": "0", "max_tokens": "6", "ignore_eos": True}
    client.async_stream_infer("llm", [tensor], request_id="params-only", parameters=parameters)
    client.stop_stream()
    text = ""
    while not results.empty():
        result, error = results.get()
        assert error is None, error
        text += result.as_numpy("text_output")[0].decode()
    client.close()
    assert text == expected


@pytest.mark.parametrize(
    ("parameters", "param"),
    [
        ({"lora_name": "adapter"}, "sampling_parameters.lora_name"),
        ({"use_beam_search": True}, "sampling_parameters.use_beam_search"),
        ({"temperature": "hot"}, "sampling_parameters.temperature"),
    ],
)
def test_vllm_parameters_the_service_cannot_honour_are_refused_by_name(
    triton_server, parameters, param
):
    texts, errors = asyncio.run(
        vllm_client_run(triton_server.grpc_url, PROMPTS[:1], True, parameters, True)
    )
    (error,) = errors
    assert f'"param":"{param}"' in str(error)


@pytest.mark.parametrize("as_text", [False, True], ids=["object", "json-text"])
def test_a_guided_decoding_error_names_the_clients_field(triton_server, as_text):
    """vLLM's guided_decoding in sampling_parameters (an object, or its JSON text as the
    sample client's Triton parameters need it): an error found while generating (a regex
    past llguidance's lexer limits, QA's "b{500000}") names the field as the client sent it,
    not the internal structured_outputs.regex, and keeps its code."""
    guided = {"regex": "b{500000}"}
    parameters = {"max_tokens": "4", "guided_decoding": json.dumps(guided) if as_text else guided}
    if as_text:  # the sample client's flow: the same object also as the Triton parameters
        _, errors = asyncio.run(
            vllm_client_run(triton_server.grpc_url, PROMPTS[:1], True, parameters, True)
        )
    else:  # a dict is no Triton parameter: sampling_parameters alone
        errors = _sampling_parameters_errors(triton_server.grpc_url, parameters)
    (error,) = errors
    message = str(error)
    assert '"param":"sampling_parameters.guided_decoding.regex"' in message, message
    assert '"code":"invalid_value"' in message, message
    assert "structured_outputs" not in message, message


def _sampling_parameters_errors(url, sampling_parameters):
    """The errors of one streamed request whose sampling parameters are only its
    ``sampling_parameters`` input."""
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error))
    inputs = []
    for name, value in (("text_input", PROMPTS[0]), ("sampling_parameters", sampling_parameters)):
        text = value if isinstance(value, str) else json.dumps(value)
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs.append(tensor)
    client.async_stream_infer("llm", inputs, request_id="guided")
    client.stop_stream()
    client.close()
    errors = []
    while not results.empty():
        error = results.get()
        if error is not None:
            errors.append(error)
    return errors


def test_http_generate_refuses_fields_it_would_otherwise_ignore(triton_server):
    """A TensorRT-LLM field sent to llm's HTTP generate becomes a request parameter (Triton's
    rule for JSON fields that are no input): refused by name, never ignored."""
    body = {"text_input": "Hi", "max_tokens": 4, "stream": False, "beam_width": 2}
    r = requests.post(f"http://{triton_server.http_url}/v2/models/llm/generate", json=body)
    assert r.status_code == 400
    assert '\\"param\\":\\"parameters.beam_width\\"' in r.text or "parameters.beam_width" in r.text


# --- TensorRT-LLM's convention --------------------------------------------------------------
def trtllm_inputs(prompt, output_len, streaming, **extra):
    """[1, 1] tensors as TensorRT-LLM's end-to-end client prepares them."""
    arrays = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones((1, 1), np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "num_return_sequences": np.array([[1]], dtype=np.int32),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
        **extra,
    }
    tensors = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def trtllm_run(url, inputs, outputs=("text_output",)):
    """The end-to-end client's flow: one stream per request, stop_stream waits for it to
    close; returns the results and the errors received."""
    client = grpcclient.InferenceServerClient(url)
    completed: queue.Queue = queue.Queue()

    def callback(user_data, result, error):
        user_data.put(error if error else result)

    client.start_stream(callback=partial(callback, completed))
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs]
    client.async_stream_infer("ensemble", inputs, outputs=requested, request_id="1")
    client.stop_stream()
    results, errors = [], []
    while not completed.empty():
        item = completed.get()
        (errors if isinstance(item, InferenceServerException) else results).append(item)
    client.close()
    return results, errors


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_trtllm_client_flow_gets_the_greedy_text(triton_server, tokenizer, hf_greedy, streaming):
    prompt = PROMPTS[1]
    expected = greedy_text(tokenizer, hf_greedy, prompt)
    extra = {
        "end_id": np.array([[tokenizer.eos_token_id]], np.int32),
        "pad_id": np.array([[tokenizer.pad_token_id or 0]], np.int32),
        "random_seed": np.array([[7]], np.uint64),
    }
    # end_id: generation ends at that id instead of the model's EOS ids.
    inputs = trtllm_inputs(prompt, GREEDY_TOKENS, streaming, **extra)
    results, errors = trtllm_run(triton_server.grpc_url, inputs)
    assert not errors
    pieces = [r.as_numpy("text_output") for r in results]
    assert all(p.shape == (1, 1) for p in pieces)
    text = "".join(p[0][0].decode() for p in pieces)
    assert text == prompt + expected  # exclude_input_in_output false: the prompt first
    assert len(results) == 1 or streaming


def test_trtllm_log_probs_and_choices(triton_server, tokenizer, hf_greedy, hf_logprobs):
    prompt = PROMPTS[0]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    new_ids = hf_greedy(prompt_ids, 6)
    inputs = trtllm_inputs(
        prompt,
        6,
        True,
        return_log_probs=np.array([[True]]),
        exclude_input_in_output=np.array([[True]]),
        end_id=np.array([[tokenizer.eos_token_id]], np.int32),
    )
    outputs = ("text_output", "output_log_probs", "cum_log_probs", "sequence_index")
    results, errors = trtllm_run(triton_server.grpc_url, inputs, outputs)
    assert not errors
    logprobs = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in results])
    oracle = hf_logprobs(prompt_ids, new_ids)[range(len(new_ids)), new_ids].numpy()
    np.testing.assert_allclose(logprobs, oracle, atol=2e-3)
    assert float(results[-1].as_numpy("cum_log_probs")[0, 0]) == pytest.approx(
        float(oracle.sum()), abs=1e-2
    )
    # Two choices: each response names its sequence_index, both sequences complete.
    inputs = trtllm_inputs(
        prompt,
        4,
        True,
        num_return_sequences=np.array([[2]], np.int32),
        temperature=np.array([[1.0]], np.float32),
        exclude_input_in_output=np.array([[True]]),
    )
    results, errors = trtllm_run(triton_server.grpc_url, inputs, ("text_output", "sequence_index"))
    assert not errors
    assert {int(r.as_numpy("sequence_index")[0, 0]) for r in results} == {0, 1}


def test_trtllm_sequences_without_streaming_come_whole_one_response_each(
    triton_server, tokenizer, hf_greedy, hf_logprobs
):
    """``num_return_sequences`` 2 without streaming (QA: a 400 naming ``n``, "n > 1 requires
    stream=true", a parameter the client never sent): one response per sequence, each with
    its whole text (the prompt first, exclude_input_in_output false), its logprobs and their
    sum, as TensorRT-LLM answers; greedy, both equal transformers' text."""
    prompt = PROMPTS[0]
    inputs = trtllm_inputs(
        prompt,
        5,
        False,
        num_return_sequences=np.array([[2]], np.int32),
        return_log_probs=np.array([[True]]),
    )
    names = ("text_output", "sequence_index", "output_log_probs", "cum_log_probs")
    results, errors = trtllm_run(triton_server.grpc_url, inputs, names)
    assert not errors
    assert sorted(int(r.as_numpy("sequence_index")[0, 0]) for r in results) == [0, 1]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    new_ids = hf_greedy(prompt_ids, 5)
    oracle = hf_logprobs(prompt_ids, new_ids)[range(len(new_ids)), new_ids].numpy()
    for r in results:
        text = r.as_numpy("text_output").reshape(-1)[0].decode()
        assert text == prompt + greedy_text(tokenizer, hf_greedy, prompt, 5)
        logprobs = r.as_numpy("output_log_probs").reshape(-1)
        np.testing.assert_allclose(logprobs, oracle, atol=2e-3)
        assert float(r.as_numpy("cum_log_probs")[0, 0]) == pytest.approx(
            float(oracle.sum()), abs=1e-2
        )


def test_trtllm_errors_of_llm_name_the_inputs_the_client_sent(triton_server):
    """An error ``llm`` raises about an input made from a TensorRT-LLM one names the client's
    input (QA: ``num_return_sequences`` 99 was refused naming ``n``, which it never sent)."""
    for extra, name in (
        ({"num_return_sequences": np.array([[99]], np.int32)}, "num_return_sequences"),
        ({"random_seed": np.array([[2**63]], np.uint64)}, "random_seed"),
        ({"min_length": np.array([[-1]], np.int32)}, "min_length"),
    ):
        results, errors = trtllm_run(triton_server.grpc_url, trtllm_inputs("Hi", 4, True, **extra))
        (error,) = errors
        assert f'"param":"{name}"' in str(error), error
        assert not results


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        ({"beam_width": np.array([[2]], np.int32)}, "beam_width"),
        ({"return_context_logits": np.array([[True]])}, "return_context_logits"),
        ({"length_penalty": np.array([[0.5]], np.float32)}, "length_penalty"),
    ],
)
def test_trtllm_inputs_the_service_cannot_honour_are_refused_by_name(triton_server, extra, name):
    results, errors = trtllm_run(triton_server.grpc_url, trtllm_inputs("Hi", 4, True, **extra))
    (error,) = errors
    assert f'"code":"unsupported_parameter","param":"{name}"' in str(error)
    assert not results


def test_trtllm_http_generate_takes_the_batch_dimension(triton_server, tokenizer, hf_greedy):
    prompt = PROMPTS[1]
    body = {"text_input": prompt, "max_tokens": 5, "temperature": 0.0, "stream": False}
    body["end_id"] = tokenizer.eos_token_id
    r = requests.post(f"http://{triton_server.http_url}/v2/models/ensemble/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == greedy_text(tokenizer, hf_greedy, prompt, 5)


def test_trtllm_quickstart_request_gets_one_whole_response(triton_server, tokenizer, hf_greedy):
    """TensorRT-LLM's quickstart body, unchanged: no ``stream`` (TensorRT-LLM's default is not
    to stream; ``llm`` streams by default, so HTTP generate refused it) and empty
    ``bad_words`` / ``stop_words``. QA found it refused."""
    prompt = PROMPTS[1]
    body = {"text_input": prompt, "max_tokens": 5, "bad_words": "", "stop_words": ""}
    body["temperature"] = 0.0
    r = requests.post(f"http://{triton_server.http_url}/v2/models/ensemble/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == greedy_text(tokenizer, hf_greedy, prompt, 5)


# --- the translation alone ------------------------------------------------------------------
def test_trtllm_translation_maps_names_and_refuses_what_it_cannot_honour():
    from tritonllm.contract.errors import ErrorCode
    from tritonllm.serving.trtllm_convention import llm_inputs

    batch = {
        "text_input": np.array([[b"Hi"]], dtype=object),
        "max_tokens": np.array([[5]], np.int32),
        "num_return_sequences": np.array([[2]], np.int32),
        "random_seed": np.array([[9]], np.uint64),
        "min_length": np.array([[1]], np.int32),
        "stop_words": np.array([[b"\n\n", b""]], dtype=object),  # padded with ""
        "end_id": np.array([[7]], np.int32),
        "pad_id": np.array([[0]], np.int32),
    }
    translated = llm_inputs(batch).inputs
    assert {name: value.tolist() for name, value in translated.items()} == {
        "text_input": [b"Hi"],
        "max_tokens": [5],
        "n": [2],
        "seed": [9],
        "min_tokens": [1],
        "stop": [b"\n\n"],
        "stop_token_ids": [7],
        "ignore_eos": [True],
        "stream": [True],  # absent is TensorRT-LLM's false, but n > 1 streams from llm
    }
    assert llm_inputs(batch).whole_sequences  # ... and each sequence goes out whole
    one = llm_inputs({**batch, "num_return_sequences": np.array([[1]], np.int32)})
    assert one.inputs["stream"].tolist() == [False] and not one.whole_sequences
    too_big = {**batch, "seed": np.array([[2**63]], np.uint64)}
    for bad, code, param in [
        ({"random_seed": np.array([[2**63]], np.uint64)}, ErrorCode.INVALID_VALUE, "random_seed"),
        (too_big, ErrorCode.INVALID_VALUE, "seed"),  # and differs from random_seed
        ({"beam_width": np.array([[4]], np.int32)}, ErrorCode.UNSUPPORTED_PARAMETER, "beam_width"),
        ({"return_perf_metrics": np.array([[True]])}, ErrorCode.UNSUPPORTED_PARAMETER, None),
    ]:
        with pytest.raises(ValueError) as info:
            llm_inputs({"text_input": batch["text_input"], **bad})
        assert info.value.code is code
        assert param is None or info.value.param == param
