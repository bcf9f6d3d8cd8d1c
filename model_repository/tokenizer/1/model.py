"""Triton adapter: ``text_input`` | ``messages`` (JSON) [+ ``enable_thinking``] → ``input_ids``.

The work is ``tritonllm.tokenization.chat.render_prompt``; bad input becomes a Triton error
response for that request only.
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

from tritonllm.tokenization.chat import render_prompt
from tritonllm.triton_config import model_parameters, served_model_dir


def _text(request, name):
    """The UTF-8 string of a BYTES [1] input, or None when absent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    flat = tensor.as_numpy().reshape(-1)
    if flat.size != 1:
        raise ValueError(f"input {name!r} must hold one string, got {flat.size}")
    value = flat[0]
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as exc:
        raise ValueError(f"input {name!r} is not valid UTF-8: {exc}") from None


def _prompt_ids(tokenizer, request):
    text_input, messages_json = _text(request, "text_input"), _text(request, "messages")
    messages = None
    if messages_json is not None:
        try:
            messages = json.loads(messages_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"messages is not valid JSON: {exc}") from None
    thinking = pb_utils.get_input_tensor_by_name(request, "enable_thinking")
    enable_thinking = None if thinking is None else bool(thinking.as_numpy().reshape(-1)[0])
    return render_prompt(tokenizer, text_input, messages, enable_thinking=enable_thinking)


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        path = served_model_dir(model_parameters(args["model_config"]))
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = np.asarray(_prompt_ids(self.tokenizer, request), dtype=np.int32)
                out = pb_utils.Tensor("input_ids", ids)
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            except Exception as exc:  # any bad request fails alone; the stub keeps serving
                error = pb_utils.TritonError(f"tokenizer: {exc}")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses
