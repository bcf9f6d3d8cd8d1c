"""Triton adapter: ``text_input`` | ``messages`` (JSON) [+ ``enable_thinking``, ``tools``] →
``input_ids``.

The work is ``tritonllm.tokenization.chat.render_prompt``; bad input becomes a Triton error
response (``tritonllm.contract.errors`` wire form) for that request only. With
``exclude_input_in_output`` false the prompt text also goes out as ``echo_text`` (the
generator puts it in front of each choice's text): ``text_input`` as given, or the rendered
chat prompt of ``messages``. Inputs and outputs: ``tritonllm.contract.tensors.TOKENIZER``.
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
from tritonllm.tokenization.tools import parse_tools_json
from tritonllm.triton_config import model_parameters, served_model_dir


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _tensors(tokenizer, request):
    """The output tensors of one request. Raises: RequestError for a bad request."""
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
    tools = parse_tools_json(scalar(_input(request, "tools"), "tools", str))
    ids = render_prompt(tokenizer, text_input, messages, enable_thinking=thinking, tools=tools)
    tensors = [pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32))]
    exclude = scalar(_input(request, "exclude_input_in_output"), "exclude_input_in_output", bool)
    if exclude is False:
        echo = text_input
        if messages is not None:
            echo = render_chat(tokenizer, messages, thinking, tools)
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
