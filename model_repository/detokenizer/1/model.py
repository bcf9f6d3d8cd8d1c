"""Triton adapter: ``output_ids`` + ``prefix_ids`` → ``text_output`` (stateless per response).

The text delta is ``tritonllm.tokenization.detokenizer.Detokenizer.delta``, less ``trim_chars``
trailing characters (a matched stop string, see ``tritonllm/engine/stop_strings.py``), after
``echo_text`` when given (the prompt, for ``exclude_input_in_output=false``); ``finish_reason``
and the token counts pass through unchanged. ``index`` passes through (0 when absent). With
logprobs (the optional ``output_logprobs``, ``top_logprob_ids``, ``top_logprobs`` inputs, which
pass through), ``logprobs_json`` is the OpenAI chat ``content`` list of this response's tokens
(``tritonllm.serving.logprobs.logprob_entries``); ``""`` otherwise. With the prompt's scores
(``prompt_ids``, ``prompt_token_logprobs``, ``prompt_top_logprob_ids``, ``prompt_top_logprobs``,
a choice's first response of a request with prompt logprobs), ``prompt_logprobs_json`` holds
the same entries for every prompt token (``prompt_logprob_entries``). All of it is
``tritonllm.serving.text_outputs.text_outputs``, which the generator also calls when its
request asks for ``text_output`` itself (the ``llm_fused`` ensemble, which has no detokenizer).

Cancellation: a client that cancelled its ``llm`` stream makes Triton mark the detokenizer
requests that follow as cancelled; the detokenizer then sends the generator an abort of that
generation (``tritonllm.serving.cancel_watch``, ARCHITECTURE.md "Platform facts"). Requests
are taken one by one (no dynamic batching): Triton's dynamic batcher fails a cancelled request
before the model sees it, and the ensemble request then never completes.
Inputs and outputs: ``tritonllm.contract.tensors.DETOKENIZER``.
"""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import tritonllm  # noqa: F401
except ImportError:  # not pip-installed: use the checkout that holds this repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tritonllm.contract.errors import ErrorCode, RequestError, encode_error
from tritonllm.model_config import ModelConfig
from tritonllm.serving.bls import abort_generation, triton_error
from tritonllm.serving.cancel_watch import CancelWatch
from tritonllm.serving.inputs import scalar
from tritonllm.serving.text_outputs import text_outputs
from tritonllm.tokenization.detokenizer import Detokenizer
from tritonllm.triton_config import model_parameters, served_model_dir, serving_config

PASS_THROUGH = ("finish_reason", "num_output_tokens")
# Optional inputs passed through when present: the prompt's counts (in a choice's first and
# final responses) and the logprobs (only when they were requested).
OPTIONAL_PASS_THROUGH = (
    "num_input_tokens",
    "cached_tokens",
    "output_logprobs",
    "top_logprob_ids",
    "top_logprobs",
)
LOGPROB_INPUTS = ("output_logprobs", "top_logprob_ids", "top_logprobs")
PROMPT_SCORE_INPUTS = ("prompt_token_logprobs", "prompt_top_logprob_ids", "prompt_top_logprobs")


def _inputs(request):
    """``{name: array}`` of the request's inputs, read in one pass (each
    ``get_input_tensor_by_name`` walks every input again: a cost per response)."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def _token_ids(array, name, vocab_size):
    """The ids of input ``name`` as a list, each in ``[0, vocab_size)``, else a
    ``RequestError`` (``invalid_value``) naming the first id outside: a negative one would
    index the id → bytes table from its end, and no generation produces one past the model's
    vocabulary. Ids from ``len(tokenizer)`` up to ``vocab_size`` (the embedding's padding rows,
    which a model may sample) decode to nothing (``Detokenizer``)."""
    flat = array.reshape(-1)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        bad = int(flat[(flat < 0) | (flat >= vocab_size)][0])
        raise RequestError(
            ErrorCode.INVALID_VALUE, name, f"{name} holds token id {bad}, not in [0, {vocab_size})"
        )
    return flat.tolist()


def _given(inputs, names):
    """Whether the inputs ``names``, which come together or not at all, were given.

    Raises:
        RequestError: (``invalid_input``) some given without the others.
    """
    missing = [name for name in names if name not in inputs]
    if missing and len(missing) < len(names):
        given = next(name for name in names if name in inputs)
        raise RequestError(
            ErrorCode.INVALID_INPUT, missing[0], f"{given} needs {', '.join(missing)} too"
        )
    return not missing


class TritonPythonModel:
    def initialize(self, args):
        from tritonllm.tokenization.loading import load_tokenizer

        params = model_parameters(args["model_config"])
        model_dir = served_model_dir(params)
        tokenizer = load_tokenizer(model_dir)  # without torch
        self.detokenizer = Detokenizer(tokenizer)
        # The ids a generation can hold: the model's logits width (config.json), which may
        # exceed the tokenizer's ids (Qwen3: 151,936 rows, 151,669 ids).
        self.vocab_size = max(
            ModelConfig.from_pretrained(str(model_dir)).vocab_size, len(tokenizer)
        )
        self.control_secret = serving_config(params).control_secret
        self.cancel_watch = CancelWatch()
        self.logger = pb_utils.Logger

    def _response(self, request):
        inputs = _inputs(request)
        passed = {name: inputs[name] for name in PASS_THROUGH}
        finish_reason = scalar(passed["finish_reason"], "finish_reason", str)
        final = finish_reason != ""
        index = inputs.get("index")
        key = scalar(inputs.get("request_key"), "request_key", str)
        self._watch_cancellation(request, key, final and index is None)
        new_ids = _token_ids(inputs["output_ids"], "output_ids", self.vocab_size)
        trim = scalar(inputs.get("trim_chars"), "trim_chars", int, 0)
        if trim < 0:
            raise RequestError(ErrorCode.INVALID_VALUE, "trim_chars", f"trim_chars {trim} < 0")
        echo = scalar(inputs.get("echo_text"), "echo_text", str)
        for name in OPTIONAL_PASS_THROUGH:
            if name in inputs:
                passed[name] = inputs[name]
        logprobs = None
        if _given(inputs, LOGPROB_INPUTS):
            logprobs = tuple(inputs[name].reshape(-1).tolist() for name in LOGPROB_INPUTS)
        prompt_scores = None
        if _given(inputs, ("prompt_ids", *PROMPT_SCORE_INPUTS)):
            prompt_ids = _token_ids(inputs["prompt_ids"], "prompt_ids", self.vocab_size)
            values = [inputs[name].reshape(-1).tolist() for name in PROMPT_SCORE_INPUTS]
            prompt_scores = (prompt_ids, *values)
        try:
            out = text_outputs(
                self.detokenizer,
                new_ids,
                _token_ids(inputs["prefix_ids"], "prefix_ids", self.vocab_size),
                finish_reason,
                trim,
                echo,
                logprobs,
                prompt_scores,
            )
        except RequestError:
            raise
        except ValueError as exc:  # text_outputs' own: logprob lengths that do not fit the ids
            raise RequestError(ErrorCode.INVALID_INPUT, None, str(exc)) from exc
        shape = passed["finish_reason"].shape
        passed["index"] = np.zeros(shape, np.int32) if index is None else index
        strings = {"text_output": out.text, "logprobs_json": out.logprobs_json}
        if out.prompt_logprobs_json is not None:
            strings["prompt_logprobs_json"] = out.prompt_logprobs_json
        outputs = [
            pb_utils.Tensor(name, np.array([value.encode("utf-8")], np.object_).reshape(shape))
            for name, value in strings.items()
        ]
        outputs += [pb_utils.Tensor(name, value) for name, value in passed.items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def _watch_cancellation(self, request, key, final):
        """Abort the generation in the generator when its client cancelled (module doc);
        ``key``: the ``request_key`` input's text (None when absent)."""
        request_id = request.request_id() if key is None else key
        if not self.cancel_watch.should_abort(request_id, final, request.is_cancelled):
            return
        for error in abort_generation(pb_utils, request_id, self.control_secret):
            self.logger.log_warn(f"detokenizer: abort of {request_id!r} failed: {error}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._response(request))
            except Exception as exc:  # one malformed request must not fail the others
                if isinstance(exc, RequestError):
                    message = exc.wire()
                else:
                    message = encode_error(ErrorCode.INTERNAL_ERROR, f"detokenizer: {exc}")
                error = triton_error(pb_utils, message)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        return responses
