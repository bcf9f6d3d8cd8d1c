"""Triton adapter of the engine: a decoupled model streaming each request's new token ids.

``execute`` only validates and enqueues into the engine: an ``EngineProcess`` (the engine in a
child process with a GIL of its own; the default on CUDA) or an ``EngineThread`` (a thread of
this stub; the default on CPU), chosen by ``TRITONLLM_ENGINE_PROCESS``. The engine's output
callback puts outputs on a ``ResponseStreamer`` whose sender thread coalesces what piled up per
request and sends the responses (several tokens per response under load). Control request: input
``abort_request_id`` aborts that request id (its KV pages are freed at once) and is answered
with one empty final response. Engine gauges are exported as ``tritonllm_*`` custom metrics.

``n > 1`` (streaming only): the engine runs children ``"{key}#{i}"``; each child's outputs go
out as responses of the same Triton request, with output ``index`` = i and their own prefix ids,
and the final flag comes with the response that ends the last child.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import tritonllm  # noqa: F401
except ImportError:  # not pip-installed: use the checkout that holds this repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tritonllm.engine.client import EngineClient
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.engine_process import EngineProcess
from tritonllm.engine.engine_thread import EngineThread
from tritonllm.serving.inputs import SAMPLING_INPUTS, sampling_params, scalar
from tritonllm.serving.logprobs import flatten_top_logprobs
from tritonllm.serving.metrics import (
    ENGINE_GAUGES,
    GENERATED_TOKENS,
    TIME_COUNTERS,
    counter_values,
    gauge_values,
)
from tritonllm.serving.request_table import RequestTable
from tritonllm.serving.response_streamer import ResponseStreamer
from tritonllm.serving.stream_state import ResponseChunk, StreamState
from tritonllm.triton_config import engine_config, model_parameters, serving_config

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Prefix of errors that are the server's fault, not the request's (the sidecar maps them to
# 500 server_error; any other generator error is an invalid request).
INTERNAL = "internal error: "
# How often a live request's client is asked whether it cancelled (an IPC round trip each).
CANCEL_CHECK_S = 0.2


class _Entry:
    """A live request: its response sender, one stream state per choice, children still live."""

    __slots__ = ("sender", "states", "live", "num_top", "cancelled", "checked_at")

    def __init__(self, sender, stream, n, num_top):
        self.sender = sender
        self.states = [StreamState(stream=stream, index=i) for i in range(n)]
        self.live = n
        self.num_top = num_top  # top logprobs per token; None: logprobs not requested
        self.cancelled = False
        self.checked_at = time.monotonic()


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _response(chunk, num_choices=1, num_top=None):
    """The ``generator`` outputs of one ``ResponseChunk``.

    ``index`` is sent only when ``num_choices > 1`` and the logprob outputs only when logprobs were
    requested (``num_top`` not None): each tensor costs time on the response path, which
    bounds throughput (ARCHITECTURE.md, "Platform facts"), and the detokenizer reads absent ones as 0 / none.
    """
    if chunk.error is not None:  # the engine failed the request: a server-side error
        return pb_utils.InferenceResponse(
            output_tensors=[], error=pb_utils.TritonError(f"generator: {INTERNAL}{chunk.error}")
        )
    counts = (chunk.num_input_tokens, chunk.num_output_tokens, chunk.cached_tokens)
    counts += (chunk.trim_chars,)
    names = ("num_input_tokens", "num_output_tokens", "cached_tokens", "trim_chars")
    tensors = [
        pb_utils.Tensor("output_ids", np.asarray(chunk.output_ids, dtype=np.int32)),
        pb_utils.Tensor("prefix_ids", np.asarray(chunk.prefix_ids, dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([chunk.finish_reason.encode()], dtype=object)),
    ]
    tensors += [
        pb_utils.Tensor(n, np.array([c], dtype=np.int32))
        for n, c in zip(names, counts, strict=True)
    ]
    if num_choices > 1:
        tensors.append(pb_utils.Tensor("index", np.array([chunk.index], dtype=np.int32)))
    if num_top is not None:
        top_ids, top_values = flatten_top_logprobs(chunk.top_logprobs, num_top)
        logprobs = np.asarray(chunk.logprobs or [], dtype=np.float32)
        tensors += [
            pb_utils.Tensor("output_logprobs", logprobs),
            pb_utils.Tensor("top_logprob_ids", top_ids),
            pb_utils.Tensor("top_logprobs", top_values),
        ]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _send_error(sender, message):
    error = pb_utils.TritonError(f"generator: {message}")
    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)


def _request_error(exc):
    """The message of a request that failed in ``execute``: a ``ValueError`` is the request's
    fault (its text as is); anything else (the engine is shut down or died) is the server's,
    marked ``INTERNAL`` so that clients see a server error, not an invalid request."""
    return str(exc) if isinstance(exc, ValueError) else f"{INTERNAL}{exc}"


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
        self.logger = pb_utils.Logger
        # The stub's parent is tritonserver. A pb_utils call of the sender thread (metrics, a
        # response, a cancellation check) made after it died never returns, and the stub, which
        # exits by itself when its parent is gone, then hangs for good with the engine's memory
        # (Triton 2.51's Python backend): the sender thread stops calling pb_utils once the
        # parent changed.
        self.parent_pid = os.getppid()
        self.requests = RequestTable()
        self.metrics = _Metrics()
        self.new_tokens = 0
        self.last_cancel_scan = time.monotonic()
        config, serving = engine_config(params), serving_config(params)
        self.engine: EngineClient
        if serving.use_engine_process(config.device):
            self.engine = EngineProcess(config)  # RuntimeError with the reason fails the load
        else:
            self.engine = EngineThread(LLMEngine(config))
        self.streamer = ResponseStreamer(
            self._deliver,
            self._tick,
            interval_s=serving.metrics_interval_s,
            on_error=self.logger.log_error,
            max_responses_per_s=serving.max_responses_per_s,
        )
        self.streamer.start()  # after the assignment: its first tick reads self.streamer

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._accept(request, sender)
            except Exception as exc:  # a bad request fails alone
                _send_error(sender, _request_error(exc))
        return None

    def _accept(self, request, sender):
        abort_id = _input(request, "abort_request_id")
        if abort_id is not None:
            for key in self.requests.abort(scalar(abort_id, "abort_request_id", str)):
                self.engine.abort(key)
            if not self.engine.is_alive():  # the sidecar's health probe must see a dead engine
                raise RuntimeError("the engine is not running")
            sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
            return
        input_ids = _input(request, "input_ids")
        if input_ids is None:
            raise ValueError("input_ids is required (or abort_request_id for a control request)")
        params = sampling_params({name: _input(request, name) for name in SAMPLING_INPUTS})
        stream = scalar(_input(request, "stream"), "stream", bool, default=True)
        if params.n > 1 and not stream:
            raise ValueError("n > 1 requires stream=true (each choice is its own response)")
        if self.requests.was_aborted(request.request_id()):  # its abort overtook it
            chunk = ResponseChunk([], [], "abort", int(input_ids.size), 0, 0, final=True)
            sender.send(_response(chunk), flags=FINAL)
            return
        entry = _Entry(sender, stream, params.n, params.logprobs)
        key = self.requests.add(request.request_id(), entry)
        try:
            prompt_ids = input_ids.reshape(-1).tolist()
            self.engine.submit(key, prompt_ids, params, self.streamer.put)
        except Exception:
            self.requests.pop(key)
            raise

    # --- sender thread -------------------------------------------------------------------

    def _cancelled(self, entry, now):
        """Whether the client cancelled; asked at most every CANCEL_CHECK_S per request."""
        if now - entry.checked_at < CANCEL_CHECK_S:
            return False
        entry.checked_at = now
        return entry.sender.is_cancelled()

    def _cancel(self, key, entry):
        """Abort a cancelled request; its final flag is sent now (its engine output is ignored)."""
        entry.cancelled = True
        self.engine.abort(key)
        try:
            entry.sender.send(flags=FINAL)
        except Exception:  # the stream may already be gone
            pass

    def _finished(self, key, entry, output):
        """Count a finished child; True when it was the request's last (the entry is removed)."""
        # A whole-request output (n == 1, or an n > 1 request that failed before it was split
        # into children) ends every choice at once.
        entry.live = 0 if output.request_id == key else entry.live - 1
        if entry.live > 0:
            return False
        self.requests.pop(key)
        return True

    def _parent_gone(self):
        """Whether tritonserver, this stub's parent, has died (see ``initialize``)."""
        return os.getppid() != self.parent_pid

    def _deliver(self, outputs):
        """Send the responses of a batch of coalesced outputs; returns how many were sent
        (none once tritonserver is gone). A request whose response cannot be built fails
        alone, with an internal error; the others' outputs are still delivered."""
        if self._parent_gone():
            return 0
        now = time.monotonic()
        sent = 0
        for output in outputs:
            key, index, entry = self.requests.lookup(output.request_id)
            self.new_tokens += len(output.new_token_ids)
            if entry is None:
                continue
            try:
                sent += self._deliver_one(key, index, entry, output, now)
            except Exception as exc:
                sent += self._fail(key, entry, exc)
        return sent

    def _deliver_one(self, key, index, entry, output, now):
        """Send the response (if any is due) of one output; returns 1 if one was sent."""
        final = output.finished and self._finished(key, entry, output)
        if entry.cancelled:
            return 0
        chunk = entry.states[index].on_output(output)
        if chunk is None:
            return 0
        if chunk.error is not None:
            # One error response ends the whole Triton request; the other choices go too.
            entry.cancelled = True
            if not final:
                self.engine.abort(key)
            return self._send(key, entry, _response(chunk), final=True)
        if not final and self._cancelled(entry, now):
            self._cancel(key, entry)
            return 0
        response = _response(chunk, len(entry.states), entry.num_top)
        return self._send(key, entry, response, final)

    def _fail(self, key, entry, exc):
        """End a request whose output could not be turned into a response: an internal error
        to its client, an abort in the engine; returns 1 if the error was sent."""
        self.logger.log_error(f"generator: request {key!r} failed: {exc!r}")
        if entry.cancelled:
            return 0
        entry.cancelled = True
        self.requests.pop(key)
        self.engine.abort(key)
        try:
            _send_error(entry.sender, f"{INTERNAL}{exc}")
            return 1
        except Exception:  # the stream may already be gone
            return 0

    def _send(self, key, entry, response, final):
        """Send one response; False when the stream is gone (the request is then cancelled)."""
        try:
            entry.sender.send(response, flags=FINAL if final else 0)
            return True
        except Exception as exc:
            self.logger.log_warn(f"generator: dropping request {key!r}: {exc}")
            if not final and not entry.cancelled:
                self._cancel(key, entry)
            return False

    def _tick(self):
        if self._parent_gone():
            return
        now = time.monotonic()
        if now - self.last_cancel_scan >= CANCEL_CHECK_S:
            # Requests that send nothing for a while (waiting for admission) are checked here.
            self.last_cancel_scan = now
            for key, entry in self.requests.items():
                if not entry.cancelled and self._cancelled(entry, now):
                    self._cancel(key, entry)
        self.metrics.update(
            self.engine.stats(),
            self.new_tokens,
            self.engine.loop_times(),
            self.streamer.times(),
        )
        self.new_tokens = 0

    def finalize(self):
        self.engine.shutdown()
        self.streamer.stop()
        for _, entry in self.requests.items():
            if not entry.cancelled:
                try:
                    _send_error(entry.sender, f"{INTERNAL}the model is being unloaded")
                except Exception:
                    pass
