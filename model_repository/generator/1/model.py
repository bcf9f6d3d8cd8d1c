"""Triton adapter of the engine: pb_utils tensors in, responses out (decoupled).

Everything else (validation, control requests, choices, cancellation, errors) is
``tritonllm.serving.generator_core.GeneratorCore``; this file only translates Triton's request
objects into plain values and ``ResponseChunk``s into Triton responses, and exports the engine
gauges as ``tritonllm_*`` custom metrics. The engine runs in an ``EngineProcess`` (its own
process and GIL; the default on CUDA) or an ``EngineThread`` of this stub (the default on
CPU), chosen by ``TRITONLLM_ENGINE_PROCESS``. Inputs and outputs:
``tritonllm.contract.tensors.GENERATOR`` (ARCHITECTURE.md, "Triton models").
"""

import os
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import tritonllm  # noqa: F401
except ImportError:  # not pip-installed: use the checkout that holds this repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tritonllm.contract.tensors import GENERATOR
from tritonllm.engine.client import EngineClient
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.engine_process import EngineProcess
from tritonllm.engine.engine_thread import EngineThread
from tritonllm.serving.generator_core import GeneratorCore
from tritonllm.serving.logprobs import flatten_top_logprobs
from tritonllm.serving.metrics import (
    ENGINE_GAUGES,
    GENERATED_TOKENS,
    TIME_COUNTERS,
    counter_values,
    gauge_values,
)
from tritonllm.triton_config import (
    engine_config,
    model_parameters,
    served_model_dir,
    serving_config,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_COUNTS = ("num_input_tokens", "num_output_tokens", "cached_tokens", "trim_chars")


def _tensors(chunk):
    """The ``generator`` outputs of one ``ResponseChunk``; the optional ones only when the
    chunk carries them (each tensor costs time on the response path, ARCHITECTURE.md)."""
    tensors = [
        pb_utils.Tensor("output_ids", np.asarray(chunk.output_ids, dtype=np.int32)),
        pb_utils.Tensor("prefix_ids", np.asarray(chunk.prefix_ids, dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([chunk.finish_reason.encode()], dtype=object)),
    ]
    counts = (chunk.num_input_tokens, chunk.num_output_tokens, chunk.cached_tokens)
    counts += (chunk.trim_chars,)
    tensors += [
        pb_utils.Tensor(n, np.array([c], np.int32)) for n, c in zip(_COUNTS, counts, strict=True)
    ]
    if chunk.with_index:
        tensors.append(pb_utils.Tensor("index", np.array([chunk.index], dtype=np.int32)))
    if chunk.num_top is not None:
        top_ids, top_values = flatten_top_logprobs(chunk.top_logprobs, chunk.num_top)
        logprobs = np.asarray(chunk.logprobs or [], dtype=np.float32)
        tensors += [
            pb_utils.Tensor("output_logprobs", logprobs),
            pb_utils.Tensor("top_logprob_ids", top_ids),
            pb_utils.Tensor("top_logprobs", top_values),
        ]
    for name, text in (("echo_text", chunk.echo_text), ("request_key", chunk.request_key)):
        if text is not None:
            tensors.append(pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=object)))
    return tensors


class _Sink:
    """``serving.generator_core.ResponseSink`` over a Triton response sender."""

    __slots__ = ("sender",)

    def __init__(self, sender):
        self.sender = sender

    def send(self, chunk, final):
        flags = FINAL if final else 0
        if chunk is None:
            self.sender.send(flags=flags)
        else:
            self.sender.send(pb_utils.InferenceResponse(output_tensors=_tensors(chunk)), flags)

    def send_error(self, message):
        error = pb_utils.TritonError(message)
        self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


class _Metrics:
    """The ``tritonllm_*`` Triton custom metrics (``serving.metrics`` names them). Triton
    counters only increment: the cumulative ``TIME_COUNTERS`` go in as deltas."""

    def __init__(self):
        labels = {"model": "generator"}
        # A family must outlive its metrics: keep references to both.
        self.families, self.gauges = [], {}
        for spec, _ in ENGINE_GAUGES:
            family = pb_utils.MetricFamily(spec.name, spec.description, pb_utils.MetricFamily.GAUGE)
            self.families.append(family)
            self.gauges[spec.name] = family.Metric(labels=labels)
        family = pb_utils.MetricFamily(
            GENERATED_TOKENS.name, GENERATED_TOKENS.description, pb_utils.MetricFamily.COUNTER
        )
        self.families.append(family)
        self.generated_tokens = family.Metric(labels=labels)
        self.counters, self.totals, self.values = {}, {}, {}
        for spec, _, _ in TIME_COUNTERS:
            family = pb_utils.MetricFamily(
                spec.name, spec.description, pb_utils.MetricFamily.COUNTER
            )
            self.families.append(family)
            self.counters[spec.name] = family.Metric(labels=labels)
            self.totals[spec.name] = 0.0

    def update(self, stats, new_tokens, loop_times, sender_times):
        # Each set/increment is an IPC round trip to tritonserver: only changes are sent (an
        # idle server sends none).
        for name, value in gauge_values(stats).items():
            if self.values.get(name) != value:
                self.gauges[name].set(value)
                self.values[name] = value
        if new_tokens:
            self.generated_tokens.increment(new_tokens)
        for name, total in counter_values(stats, loop_times, sender_times).items():
            if total > self.totals[name]:
                self.counters[name].increment(total - self.totals[name])
                self.totals[name] = total


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args["model_config"])
        logger = pb_utils.Logger
        # The stub's parent is tritonserver. A pb_utils call of the sender thread (metrics, a
        # response, a cancellation check) made after it died never returns, and the stub, which
        # exits by itself when its parent is gone, then hangs for good with the engine's memory
        # (Triton 2.51's Python backend): the core stops calling pb_utils once it changed.
        parent_pid = os.getppid()
        served_model_dir(params)  # a missing model directory fails the load with how to build it
        config, serving = engine_config(params), serving_config(params)
        engine: EngineClient
        if serving.use_engine_process(config.device, config.tensor_parallel_size):
            engine = EngineProcess(config)  # RuntimeError with the reason fails the load
        else:
            engine = EngineThread(LLMEngine(config))
        self.core = GeneratorCore(
            engine,
            on_tick=_Metrics().update,
            parent_alive=lambda: os.getppid() == parent_pid,
            log_warning=logger.log_warn,
            log_error=logger.log_error,
            metrics_interval_s=serving.metrics_interval_s,
            max_responses_per_s=serving.max_responses_per_s,
        ).start()

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in GENERATOR.input_names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            sink = _Sink(request.get_response_sender())
            self.core.execute(request.request_id(), inputs, request.parameters(), sink)
        return None

    def finalize(self):
        self.core.finalize()
