"""TensorRT-LLM's entry point: its ``ensemble`` model's names and ``[1, 1]`` tensors over ``llm``.

A BLS model (decoupled, ``max_batch_size`` 1): each request is translated
(``tritonllm.serving.trtllm_convention``) into one ``llm`` request, whose responses come back
under TensorRT-LLM's output names and shapes. It holds no engine: the one engine is the
``generator``'s. Why a BLS model and not a second ensemble: Triton ties a tensor's rank to the
config, so ``[1, 1]`` inputs need a model with ``max_batch_size`` > 0, and an ensemble may only
batch when every step does, which the decoupled generator does not. A client that cancels is
seen here (``is_cancelled``, asked at most every ``CANCEL_CHECK_S``) and its generation is
aborted in the generator (control request ``abort_request_id``). Inputs and outputs:
``tritonllm.contract.tensors.TRTLLM_ENSEMBLE``.
"""

import json
import sys
import threading
import time
import uuid
from pathlib import Path

import triton_python_backend_utils as pb_utils

try:
    import tritonllm  # noqa: F401
except ImportError:  # not pip-installed: use the checkout that holds this repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tritonllm.contract.errors import ErrorCode, RequestError, encode_error
from tritonllm.contract.tensors import TRTLLM_ENSEMBLE
from tritonllm.serving.bls import abort_generation, triton_error
from tritonllm.serving.trtllm_convention import OutputState, client_error, llm_inputs
from tritonllm.triton_config import model_parameters, serving_config

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.2
LLM_OUTPUTS = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "index"]


def _send_error(sender, message):
    error = triton_error(pb_utils, message)
    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)


def _parameters(request):
    """The request's Triton parameters for the ``llm`` request (BLS takes bool/int/str)."""
    raw = json.loads(request.parameters() or "{}")
    return {k: v if isinstance(v, bool | int | str) else str(v) for k, v in raw.items()}


def _generate(request, sender, control_secret):
    inputs = {}
    for name in TRTLLM_ENSEMBLE.input_names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    translation = llm_inputs(inputs)
    wanted = LLM_OUTPUTS + (["output_logprobs"] if translation.return_log_probs else [])
    key = f"trtllm-{uuid.uuid4().hex}"  # the generator aborts by it
    llm = pb_utils.InferenceRequest(
        model_name="llm",
        inputs=[pb_utils.Tensor(name, value) for name, value in translation.inputs.items()],
        requested_output_names=wanted,
        request_id=key,
        parameters=_parameters(request),
    )
    state, checked, aborted = OutputState(translation.whole_sequences), time.monotonic(), False
    num_choices = int(translation.inputs.get("n", [1])[0])
    finished = set()  # choices that sent their finish_reason: the last one carries FINAL
    for response in llm.exec(decoupled=True):
        if response.has_error():  # (named as the client's inputs)
            _send_error(sender, client_error(response.error().message(), inputs))
            return
        outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
        if not outputs or aborted:
            continue  # the empty final response, or the rest of a cancelled request
        now = time.monotonic()
        if now - checked >= CANCEL_CHECK_S:
            checked = now
            if sender.is_cancelled():
                abort_generation(pb_utils, key, control_secret)
                aborted = True
                continue
        tensors = state.outputs(outputs, translation.return_log_probs)
        if tensors is None:
            continue  # a sequence sent whole, not ended yet
        if tensors["finish_reason"][0, 0]:
            finished.add(int(tensors["sequence_index"][0, 0]))
        reply = [pb_utils.Tensor(name, value) for name, value in tensors.items()]
        final = len(finished) == num_choices
        sender.send(pb_utils.InferenceResponse(output_tensors=reply), flags=FINAL if final else 0)
        if final:
            return
    sender.send(flags=FINAL)


def _run(request, sender, logger, control_secret):
    try:
        _generate(request, sender, control_secret)
    except RequestError as exc:
        _send_error(sender, exc.wire())
    except Exception as exc:  # the client's stream may be gone, or llm failed to run
        logger.log_warn(f"ensemble: request failed: {exc}")
        try:
            _send_error(sender, encode_error(ErrorCode.INTERNAL_ERROR, f"ensemble: {exc}"))
        except Exception:
            pass


class TritonPythonModel:
    def initialize(self, args):
        self.logger = pb_utils.Logger
        self.control_secret = serving_config(model_parameters(args["model_config"])).control_secret

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            thread = threading.Thread(
                target=_run,
                args=(request, sender, self.logger, self.control_secret),
                name="trtllm-request",
            )
            thread.daemon = True
            thread.start()
        return None
