"""Triton adapter: ``output_ids`` + ``prefix_ids`` → ``text_output`` (stateless, batched).

``index`` passes through (0 when absent). With logprobs (the optional ``output_logprobs``,
``top_logprob_ids``, ``top_logprobs`` inputs, which pass through), ``logprobs_json`` is the OpenAI
chat ``content`` list of this response's tokens (``tritonllm.serving.logprobs.logprob_entries``);
``""`` otherwise.

The text delta is ``tritonllm.tokenization.detokenizer.Detokenizer.delta``, less ``trim_chars``
trailing characters (a matched stop string, see ``tritonllm/engine/stop_strings.py``); ``finish_reason``
and the token counts pass through unchanged. A batch from the dynamic batcher holds one
request per generator response; each request's tensors carry a batch dimension of 1.
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

from tritonllm.engine.stop_strings import apply_trim
from tritonllm.serving.logprobs import logprob_entries
from tritonllm.tokenization.detokenizer import Detokenizer
from tritonllm.triton_config import model_parameters, served_model_dir

PASS_THROUGH = ("finish_reason", "num_input_tokens", "num_output_tokens", "cached_tokens")
# Optional inputs (sent by the generator only when logprobs were requested): passed through.
LOGPROB_INPUTS = ("output_logprobs", "top_logprob_ids", "top_logprobs")


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        path = served_model_dir(model_parameters(args["model_config"]))
        self.detokenizer = Detokenizer(AutoTokenizer.from_pretrained(path))

    def _response(self, request):
        def array(name):
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

        passed = {name: array(name) for name in PASS_THROUGH}
        final = passed["finish_reason"].reshape(-1)[0] != b""
        new_ids = array("output_ids").reshape(-1).tolist()
        prefix_ids = array("prefix_ids").reshape(-1).tolist()
        text = self.detokenizer.delta(prefix_ids, new_ids, final)
        text = apply_trim(text, int(array("trim_chars").reshape(-1)[0]))
        batch_shape = passed["finish_reason"].shape  # [1, 1]: batch dim + dims [1]
        index = pb_utils.get_input_tensor_by_name(request, "index")
        passed["index"] = np.zeros(batch_shape, np.int32) if index is None else index.as_numpy()
        logprobs_json = ""
        # Logprob tensors come only with requests that asked for logprobs: pass them through.
        for name in LOGPROB_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                passed[name] = tensor.as_numpy()
        if "output_logprobs" in passed and passed["output_logprobs"].size:
            entries = logprob_entries(
                self.detokenizer.logprob_token_bytes,
                new_ids,
                passed["output_logprobs"].reshape(-1).tolist(),
                passed["top_logprob_ids"].reshape(-1).tolist(),
                passed["top_logprobs"].reshape(-1).tolist(),
            )
            logprobs_json = json.dumps(entries, ensure_ascii=False)
        strings = {"text_output": text, "logprobs_json": logprobs_json}
        outputs = [
            pb_utils.Tensor(
                name, np.array([value.encode("utf-8")], np.object_).reshape(batch_shape)
            )
            for name, value in strings.items()
        ]
        outputs += [pb_utils.Tensor(name, value) for name, value in passed.items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._response(request))
            except Exception as exc:  # one malformed request must not fail the batch
                error = pb_utils.TritonError(f"detokenizer: {exc}")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses
