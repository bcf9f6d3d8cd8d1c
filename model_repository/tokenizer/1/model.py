"""Triton adapter: ``text_input`` | ``messages`` (JSON) [+ ``enable_thinking``, ``tools``] |
``input_ids`` → ``input_ids``.

The work is ``tritonllm.tokenization.chat``; bad input becomes a Triton error response
(``tritonllm.contract.errors`` wire form) for that request only. Before any work an input is
held to ``contract.limits.MAX_PROMPT_BYTES``, and the prompt text (``text_input``, or the
rendered chat prompt) to the characters the context can hold (``tokenization.prompt_limits``):
a prompt that cannot fit is refused without being tokenized. Token ids given as ``input_ids``
pass through (each must be in ``[0, len(tokenizer))``); ``add_special_tokens`` true encodes
``text_input`` with the tokenizer's special tokens (a BOS where the tokenizer adds one). With
``exclude_input_in_output`` false the prompt text also goes out as ``echo_text`` (the generator
puts it in front of each choice's text): ``text_input`` as given, the rendered chat prompt of
``messages``, or the decoded ``input_ids``. A ``prompt_limits`` request answers those limits as
``limits_json``. Inputs and outputs: ``tritonllm.contract.tensors.TOKENIZER``.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import tritonllm  # noqa: F401
except ImportError:  # not pip-installed: use the checkout that holds this repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tritonllm.contract import limits
from tritonllm.contract.errors import ErrorCode, RequestError, encode_error
from tritonllm.serving.bls import triton_error
from tritonllm.serving.inputs import scalar
from tritonllm.tokenization.chat import render_chat, render_prompt
from tritonllm.tokenization.prompt_limits import PromptLimits, max_token_chars
from tritonllm.tokenization.tools import parse_tools_json
from tritonllm.triton_config import engine_config, model_parameters, served_model_dir


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _bounded(request, name):
    """Input ``name``, refused (``invalid_input``) over ``MAX_PROMPT_BYTES`` before decoding."""
    array = _input(request, name)
    if array is not None and sum(len(v) for v in array.reshape(-1)) > limits.MAX_PROMPT_BYTES:
        raise RequestError(
            ErrorCode.INVALID_INPUT, name, f"{name} exceeds {limits.MAX_PROMPT_BYTES} bytes"
        )
    return array


def _tensors(tokenizer, prompt_limits, request):
    """The output tensors of one request. Raises: RequestError for a bad request."""
    if scalar(_input(request, "prompt_limits"), "prompt_limits", bool):
        answer = {**asdict(prompt_limits), "max_prompt_chars": prompt_limits.max_prompt_chars}
        return [
            pb_utils.Tensor("input_ids", np.zeros(0, dtype=np.int32)),
            pb_utils.Tensor("limits_json", np.array([json.dumps(answer).encode()], dtype=object)),
        ]
    prompt_ids = _input(request, "input_ids")
    if prompt_ids is not None:
        if prompt_ids.size > limits.MAX_PROMPT_TOKENS:
            raise RequestError(
                ErrorCode.INVALID_INPUT,
                "input_ids",
                f"input_ids holds more than {limits.MAX_PROMPT_TOKENS} token ids",
            )
        return _id_tensors(tokenizer, request, prompt_ids.reshape(-1).tolist())
    text_input = scalar(_bounded(request, "text_input"), "text_input", str)
    messages_json = scalar(_bounded(request, "messages"), "messages", str)
    messages = None
    if messages_json is not None:
        try:
            messages = json.loads(messages_json)
        except json.JSONDecodeError as exc:
            raise RequestError(
                ErrorCode.INVALID_INPUT, "messages", f"messages is not valid JSON: {exc}"
            ) from None
    # None (absent): the template's own default; only templates with the option accept it.
    thinking = scalar(_input(request, "enable_thinking"), "enable_thinking", bool)
    special = scalar(_input(request, "add_special_tokens"), "add_special_tokens", bool)
    tools = parse_tools_json(scalar(_bounded(request, "tools"), "tools", str))
    if special and text_input is not None:
        prompt_limits.check_chars(len(text_input), "text_input")
        ids = list(tokenizer.encode(text_input, add_special_tokens=True))
    else:
        ids = render_prompt(
            tokenizer,
            text_input,
            messages,
            thinking,
            check_chars=prompt_limits.check_chars,
            tools=tools,
        )
    tensors = [pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32))]
    exclude = scalar(_input(request, "exclude_input_in_output"), "exclude_input_in_output", bool)
    if exclude is False:
        echo = text_input
        if messages is not None:
            echo = render_chat(tokenizer, messages, thinking, tools)
        tensors.append(pb_utils.Tensor("echo_text", np.array([echo.encode()], dtype=object)))
    return tensors


def _id_tensors(tokenizer, request, ids):
    """The outputs of a prompt given as token ids. Raises: RequestError for an unknown id or
    another prompt given too."""
    for name in ("text_input", "messages"):
        if _input(request, name) is not None:
            raise RequestError(
                ErrorCode.INVALID_VALUE, name, f"give exactly one of input_ids or {name}"
            )
    if not ids:
        raise RequestError(ErrorCode.INVALID_VALUE, "input_ids", "input_ids is empty")
    vocab = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(
            ErrorCode.INVALID_VALUE, "input_ids", f"token id {bad} is not in [0, {vocab})"
        )
    tensors = [pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32))]
    exclude = scalar(_input(request, "exclude_input_in_output"), "exclude_input_in_output", bool)
    if exclude is False:
        echo = tokenizer.decode(ids)
        tensors.append(pb_utils.Tensor("echo_text", np.array([echo.encode()], dtype=object)))
    return tensors


class TritonPythonModel:
    def initialize(self, args):
        from tritonllm.tokenization.loading import load_tokenizer

        params = model_parameters(args["model_config"])
        self.tokenizer = load_tokenizer(served_model_dir(params))  # without torch
        # The context length does not depend on the device: no torch to find a GPU.
        max_model_len = engine_config(params, default_device="cpu").effective_max_model_len
        self.prompt_limits = PromptLimits(max_model_len, max_token_chars(self.tokenizer))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = _tensors(self.tokenizer, self.prompt_limits, request)
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # any bad request fails alone; the stub keeps serving
                if isinstance(exc, RequestError):
                    message = exc.wire()
                else:
                    message = encode_error(ErrorCode.INTERNAL_ERROR, f"tokenizer: {exc}")
                error = triton_error(pb_utils, message)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses
