"""Triton adapter of the engine: pb_utils tensors in, responses out (decoupled).

Everything else (validation, control requests, choices, cancellation, errors) is
``tritonllm.serving.generator_core.GeneratorCore``; this file only translates Triton's request
objects into plain values and ``ResponseChunk``s into Triton responses, and exports the engine
gauges as ``tritonllm_*`` custom metrics. The engine runs in an ``EngineProcess`` (its own
process and GIL; the default on CUDA) or an ``EngineThread`` of this stub (the default on
CPU), chosen by ``TRITONLLM_ENGINE_PROCESS``. Inputs and outputs:
``tritonllm.contract.tensors.GENERATOR`` (ARCHITECTURE.md, "Triton models").

A request that asks for ``text_output`` and not ``output_ids`` (the ``llm_fused`` ensemble's
generator step) is answered with ``llm``'s outputs instead of ids: the sender thread makes the
text with ``tritonllm.serving.text_outputs.text_outputs``, the detokenizer's own function, so
that no detokenizer step follows (one Python step fewer per streamed response).
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
from tritonllm.serving.bls import triton_error
from tritonllm.serving.generator_core import GeneratorCore
from tritonllm.serving.logprobs import flatten_top_logprobs
from tritonllm.serving.metrics import (
    ENGINE_GAUGES,
    GENERATED_TOKENS,
    LATENCY_HISTOGRAMS,
    SENDER_COUNTERS,
    TIME_COUNTERS,
    HistogramObserver,
    counter_values,
    gauge_values,
)
from tritonllm.serving.orphan_watch import exit_when_orphaned
from tritonllm.serving.pacer import DETOKENIZED_RESPONSE_COST
from tritonllm.serving.shared_engine import SharedEngineOwner, engine_key, open_shared_engine
from tritonllm.serving.text_outputs import text_outputs
from tritonllm.tokenization.detokenizer import Detokenizer
from tritonllm.tokenization.loading import load_tokenizer
from tritonllm.triton_config import (
    engine_config,
    instance_count,
    model_parameters,
    served_model_dir,
    serving_config,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _int32(name, value):
    return pb_utils.Tensor(name, np.array([value], np.int32))


LOGPROB_OUTPUTS = ("output_logprobs", "top_logprob_ids", "top_logprobs")


def _progress(chunk):
    """What every response of a choice carries, as ids or as text: ``finish_reason``,
    ``num_output_tokens``; the prompt's counts only in a choice's first and final responses,
    ``index`` only when n > 1 (each tensor costs time on the response path, ARCHITECTURE.md)."""
    tensors = [
        _text("finish_reason", chunk.finish_reason),
        _int32("num_output_tokens", chunk.num_output_tokens),
    ]
    if chunk.with_counts:
        tensors += [
            _int32("num_input_tokens", chunk.num_input_tokens),
            _int32("cached_tokens", chunk.cached_tokens),
        ]
    if chunk.with_index:
        tensors.append(_int32("index", chunk.index))
    return tensors


def _logprob_arrays(chunk):
    """``(logprobs float32 [num_ids], top ids int32 [num_ids * k], top logprobs float32
    [num_ids * k])`` of a chunk with logprobs requested, else None."""
    if chunk.num_top is None:
        return None
    top_ids, top_values = flatten_top_logprobs(chunk.top_logprobs, chunk.num_top)
    return np.asarray(chunk.logprobs or [], dtype=np.float32), top_ids, top_values


def _tensors(chunk):
    """The ``generator`` outputs of one ``ResponseChunk``; the optional ones only when the
    chunk carries them: ``_progress``'s, ``trim_chars`` when not 0, the logprobs when
    requested, ``echo_text`` / ``request_key`` / the prompt's scores when given."""
    tensors = [
        pb_utils.Tensor("output_ids", np.asarray(chunk.output_ids, dtype=np.int32)),
        pb_utils.Tensor("prefix_ids", np.asarray(chunk.prefix_ids, dtype=np.int32)),
        *_progress(chunk),
    ]
    if chunk.trim_chars:
        tensors.append(_int32("trim_chars", chunk.trim_chars))
    arrays = _logprob_arrays(chunk)
    if arrays is not None:
        tensors += [pb_utils.Tensor(n, a) for n, a in zip(LOGPROB_OUTPUTS, arrays, strict=True)]
    for name, text in (("echo_text", chunk.echo_text), ("request_key", chunk.request_key)):
        if text is not None:
            tensors.append(_text(name, text))
    if chunk.prompt_logprobs is not None:
        top_ids, top_values = flatten_top_logprobs(chunk.prompt_top_logprobs, chunk.prompt_num_top)
        tensors += [
            pb_utils.Tensor("prompt_ids", np.asarray(chunk.prompt_ids, dtype=np.int32)),
            pb_utils.Tensor(
                "prompt_token_logprobs", np.asarray(chunk.prompt_logprobs, dtype=np.float32)
            ),
            pb_utils.Tensor("prompt_top_logprob_ids", top_ids),
            pb_utils.Tensor("prompt_top_logprobs", top_values),
        ]
    return tensors


def _text(name, text):
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=object))


def _text_tensors(chunk, detokenizer):
    """``llm``'s outputs of one ``ResponseChunk`` (what the detokenizer would answer for
    ``_tensors(chunk)``), leaving out what reads as its default: ``index`` 0 (n = 1) and
    ``logprobs_json`` ``""`` (no logprobs)."""
    # Logprobs as the detokenizer reads them: float32 tensors (the JSON's digits then agree).
    arrays, scores = _logprob_arrays(chunk), None
    if chunk.prompt_logprobs is not None:
        top_ids, top_values = flatten_top_logprobs(chunk.prompt_top_logprobs, chunk.prompt_num_top)
        values = np.asarray(chunk.prompt_logprobs, dtype=np.float32)
        scores = (chunk.prompt_ids, values.tolist(), top_ids.tolist(), top_values.tolist())
    out = text_outputs(
        detokenizer,
        chunk.output_ids,
        chunk.prefix_ids,
        chunk.finish_reason,
        chunk.trim_chars,
        chunk.echo_text,
        None if arrays is None else tuple(a.tolist() for a in arrays),
        scores,
    )
    tensors = [_text("text_output", out.text), *_progress(chunk)]
    if arrays is not None:
        tensors += [pb_utils.Tensor(n, a) for n, a in zip(LOGPROB_OUTPUTS, arrays, strict=True)]
        tensors.append(_text("logprobs_json", out.logprobs_json))
    if out.prompt_logprobs_json is not None:
        tensors.append(_text("prompt_logprobs_json", out.prompt_logprobs_json))
    return tensors


class _Sink:
    """``serving.generator_core.ResponseSink`` over a Triton response sender; with a
    ``detokenizer``, responses carry ``llm``'s text outputs instead of ids."""

    __slots__ = ("sender", "detokenizer", "response_cost")

    def __init__(self, sender, detokenizer=None):
        self.sender = sender
        self.detokenizer = detokenizer
        # ids go through a detokenizer step after this one (serving.pacer)
        self.response_cost = 1.0 if detokenizer is not None else DETOKENIZED_RESPONSE_COST

    def send(self, chunk, final):
        flags = FINAL if final else 0
        if chunk is None:
            self.sender.send(flags=flags)
            return
        if self.detokenizer is None:
            tensors = _tensors(chunk)
        else:
            tensors = _text_tensors(chunk, self.detokenizer)
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags)

    def send_error(self, message):
        error = triton_error(pb_utils, message)
        self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()

    def send_info(self, max_model_len, engine_steps):
        tensor = pb_utils.Tensor("max_model_len", np.array([max_model_len], dtype=np.int32))
        steps = pb_utils.Tensor("engine_steps", np.array([engine_steps], dtype=np.int64))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=[tensor, steps]), flags=FINAL)


class _Metrics:
    """The ``tritonllm_*`` Triton custom metrics (``serving.metrics`` names them). Triton
    counters only increment: the cumulative ``TIME_COUNTERS`` go in as deltas. The latency
    histograms are Triton histograms, one ``observe`` per sample, made on a thread of their own
    (``HistogramObserver``), not on the sender thread that runs ``update``.

    Instances of one model that create a metric of the same name and labels share it (Triton's
    custom metrics API): with a shared engine, every instance adds its own tokens, sender
    times and latencies, and only the one that owns the engine (``engine_wide``) reports the
    engine's gauges and loop counters."""

    def __init__(self, alive, log_error, engine_wide=True):
        self.engine_wide = engine_wide
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
        self.histograms = []
        for spec, attr in LATENCY_HISTOGRAMS:
            kind = pb_utils.MetricFamily.HISTOGRAM
            family = pb_utils.MetricFamily(spec.name, spec.description, kind)
            self.families.append(family)
            metric = family.Metric(labels=labels, buckets=list(spec.buckets))
            self.histograms.append((metric, attr))
        self.observer = HistogramObserver(self.histograms, alive, on_error=log_error)

    def update(self, stats, new_tokens, loop_times, sender_times, latencies):
        # Each set/increment is an IPC round trip to tritonserver: only changes are sent (an
        # idle server sends none).
        if self.engine_wide:
            for name, value in gauge_values(stats).items():
                if self.values.get(name) != value:
                    self.gauges[name].set(value)
                    self.values[name] = value
        if new_tokens:
            self.generated_tokens.increment(new_tokens)
        for name, total in counter_values(stats, loop_times, sender_times).items():
            if not self.engine_wide and name not in SENDER_COUNTERS:
                continue
            if total > self.totals[name]:
                self.counters[name].increment(total - self.totals[name])
                self.totals[name] = total
        self.observer.put(latencies)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args["model_config"])
        logger = pb_utils.Logger
        # The stub's parent is tritonserver. A pb_utils call of the sender thread (metrics, a
        # response, a cancellation check) made after it died never returns, and the stub, which
        # exits by itself when its parent is gone, then hangs for good with the engine's memory
        # (Triton 2.51's Python backend): the core stops calling pb_utils once it changed.
        parent_pid = os.getppid()
        exit_when_orphaned(parent_pid)  # ...and a call already in flight then cannot hang it
        model_dir = served_model_dir(params)  # a missing one fails the load with how to build it
        # For requests that ask for text (llm_fused); an unsupported tokenizer fails the load
        # with its decoder's name, as the detokenizer's does.
        self.detokenizer = Detokenizer(load_tokenizer(model_dir))
        config, serving = engine_config(params), serving_config(params)
        instances = instance_count(args["model_config"])
        engine: EngineClient
        own_process = serving.use_engine_process(
            config.device, config.tensor_parallel_size, instances
        )
        owner = True
        if instances > 1:  # one engine for every instance (serving/shared_engine.py)
            key = engine_key(parent_pid, f"{args['model_name']}-{args['model_version']}")
            engine = open_shared_engine(config, key, server_pid=parent_pid)  # fails the load
            owner = isinstance(engine, SharedEngineOwner)
        elif own_process:
            # RuntimeError with the reason fails the load. The engine kills this stub should it
            # outlive tritonserver (its own watch needs the GIL a stuck pb_utils call may hold).
            engine = EngineProcess(config, server_pid=parent_pid)
        else:
            engine = EngineThread(LLMEngine(config))

        def parent_alive():
            return os.getppid() == parent_pid

        # The engine's gauges and loop counters come from the instance that owns it.
        self.metrics = _Metrics(parent_alive, logger.log_error, engine_wide=owner)
        self.core = GeneratorCore(
            engine,
            on_tick=self.metrics.update,
            parent_alive=parent_alive,
            log_warning=logger.log_warn,
            log_error=logger.log_error,
            metrics_interval_s=serving.metrics_interval_s,
            # The budget is the generator's: each instance paces its share of the requests.
            max_responses_per_s=serving.max_responses_per_s / instances,
            sender_threads=serving.senders(own_process),
            control_secret=serving.control_secret,
            max_live_requests=config.max_running_requests + serving.max_waiting_requests,
            max_model_len=config.effective_max_model_len,
            instances=instances,
        ).start()
        if serving.control_secret is None:
            logger.log_warn(
                "generator: TRITONLLM_CONTROL_SECRET is not set: any Triton client that knows a"
                " request id can abort it (README, Security)"
            )

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in GENERATOR.input_names:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            wanted = request.requested_output_names()
            text = "text_output" in wanted and "output_ids" not in wanted
            sink = _Sink(request.get_response_sender(), self.detokenizer if text else None)
            self.core.execute(request.request_id(), inputs, request.parameters(), sink)
        return None

    def finalize(self):
        self.core.finalize()
        self.metrics.observer.close()
