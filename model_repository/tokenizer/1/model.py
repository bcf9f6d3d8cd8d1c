"""Triton adapter: ``text_input`` | ``messages`` (JSON) [+ ``enable_thinking``] | ``input_ids``
→ ``input_ids``.

The work is ``tritonllm.tokenization.chat.render_prompt``; token ids given as ``input_ids`` pass
through (each must be in ``[0, len(tokenizer))``); ``add_special_tokens`` true encodes
``text_input`` with the tokenizer's special tokens (a BOS where the tokenizer adds one). Bad input becomes a Triton error
response (``tritonllm.contract.errors`` wire form) for that request only. With
``exclude_input_in_output`` false the prompt text also goes out as ``echo_text`` (the
generator puts it in front of each choice's text): ``text_input`` as given, or the rendered
chat prompt of ``messages``, or the decoded ``input_ids``. Inputs and outputs: ``tritonllm.contract.tensors.TOKENIZER``.
"""

import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import tritonllm  # noqa: F401
except ImportError:  # not pip-installed: use the checkout that holds this repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tritonllm.contract.errors import ErrorCode, RequestError, encode_error
from tritonllm.serving.inputs import scalar
from tritonllm.tokenization.chat import render_chat, render_prompt
from tritonllm.triton_config import model_parameters, served_model_dir


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _tensors(tokenizer, request):
    """The output tensors of one request. Raises: RequestError for a bad request."""
    prompt_ids = _input(request, "input_ids")
    if prompt_ids is not None:
        return _id_tensors(tokenizer, request, prompt_ids.reshape(-1).tolist())
    text_input = scalar(_input(request, "text_input"), "text_input", str)
    messages_json = scalar(_input(request, "messages"), "messages", str)
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
    if special and text_input is not None:
        ids = list(tokenizer.encode(text_input, add_special_tokens=True))
    else:
        ids = render_prompt(tokenizer, text_input, messages, enable_thinking=thinking)
    tensors = [pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32))]
    exclude = scalar(_input(request, "exclude_input_in_output"), "exclude_input_in_output", bool)
    if exclude is False:
        echo = text_input if messages is None else render_chat(tokenizer, messages, thinking)
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
        from transformers import AutoTokenizer

        path = served_model_dir(model_parameters(args["model_config"]))
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = _tensors(self.tokenizer, request)
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # any bad request fails alone; the stub keeps serving
                if isinstance(exc, RequestError):
                    message = exc.wire()
                else:
                    message = encode_error(ErrorCode.INTERNAL_ERROR, f"tokenizer: {exc}")
                error = pb_utils.TritonError(message)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses
