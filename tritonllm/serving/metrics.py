"""The engine gauges, time counters and latency histograms the generator exports as Triton
custom metrics (``tritonllm_*``), and the histogram buckets the sidecar's ``/metrics`` shares.

The latency histograms are Triton ``HISTOGRAM`` metric families (the Python backend of Triton
2.51 has them: ``pb_utils.MetricFamily.HISTOGRAM``, ``Metric(labels, buckets)``,
``observe(value)``). Every ``observe`` is an IPC round trip from the stub to tritonserver, so
they are observed per request (TTFT, queue time, end-to-end) and per response (ITL), never per
token. The sender thread's tick (``GeneratorCore``) collects each tick's samples and hands them
to a ``HistogramObserver`` thread, so that one IPC per response is not paid on a thread that
sends responses (what an ``observe`` costs against a ``send``: BENCHMARKS.md "Latency
histograms off the sender thread"); both stop calling into Triton once the server is gone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tritonllm.engine.client import LoopTimes
    from tritonllm.engine.stats import EngineStats
    from tritonllm.serving.response_streamer import SenderTimes


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: Prometheus name, help text, kind ``"gauge"``, ``"counter"`` or
    ``"histogram"`` (then ``buckets``: the upper bounds, seconds)."""

    name: str
    description: str
    kind: str
    buckets: tuple[float, ...] = ()


# Bucket upper bounds in seconds (Prometheus adds +Inf), from a GPU's milliseconds to a
# loaded CPU's minutes; vLLM's families cover a similar range.
TTFT_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TTFT_BUCKETS_S += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1)
ITL_BUCKETS_S += (0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
REQUEST_BUCKETS_S: tuple[float, ...] = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5)
REQUEST_BUCKETS_S += (5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
REQUEST_BUCKETS_S += (960.0, 1920.0)


@dataclass
class LatencySamples:
    """Latencies the generator measured since the last tick (seconds; one list per histogram).

    Attributes:
        ttft_s: per choice, execute → its first response with output ids sent.
        itl_s: per later response with output ids, the gap since the choice's previous one
            divided by its number of ids (one sample stands for that many tokens).
        queue_s: per choice, the engine's queue time (`RequestOutput.queue_time_s`).
        e2e_s: per request, execute → its final response sent.
    """

    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)


# Histograms: metric spec → attribute of ``LatencySamples``.
LATENCY_HISTOGRAMS: tuple[tuple[MetricSpec, str], ...] = (
    (
        MetricSpec(
            "tritonllm_time_to_first_token_seconds",
            "Seconds from a request's arrival at the generator to its first token's response",
            "histogram",
            TTFT_BUCKETS_S,
        ),
        "ttft_s",
    ),
    (
        MetricSpec(
            "tritonllm_inter_token_latency_seconds",
            "Seconds between a choice's token responses, per token of the later one",
            "histogram",
            ITL_BUCKETS_S,
        ),
        "itl_s",
    ),
    (
        MetricSpec(
            "tritonllm_request_queue_time_seconds",
            "Seconds a request waited in the engine's queue before its first admission",
            "histogram",
            REQUEST_BUCKETS_S,
        ),
        "queue_s",
    ),
    (
        MetricSpec(
            "tritonllm_e2e_request_latency_seconds",
            "Seconds from a request's arrival at the generator to its final response",
            "histogram",
            REQUEST_BUCKETS_S,
        ),
        "e2e_s",
    ),
)


class HistogramObserver:
    """A thread that observes the latency samples of each tick into Triton histograms.

    Args:
        histograms: ``(metric, LatencySamples attribute)`` pairs; each metric has
            ``observe(value)`` (a ``pb_utils`` histogram metric).
        alive: False once tritonserver is gone: a ``pb_utils`` call made then never returns,
            so the thread stops before its next batch.
        max_pending: ticks' samples that may wait; beyond that a tick's samples are dropped
            (counted in ``dropped``; ``on_error`` is told of the first drop) rather than held
            without bound.
        on_error: called with a message when an ``observe`` raises (the thread goes on), and
            when samples are first dropped.
    """

    def __init__(
        self,
        histograms: Sequence[tuple[Any, str]],
        alive: Callable[[], bool],
        max_pending: int = 1000,
        on_error: Callable[[str], None] = lambda message: None,
    ) -> None:
        self._histograms = list(histograms)
        self._alive, self._on_error = alive, on_error
        self._pending: queue.Queue[LatencySamples | None] = queue.Queue(max_pending)
        self.dropped = 0  # samples dropped because too many ticks waited
        self._thread = threading.Thread(target=self._run, name="tritonllm-observe", daemon=True)
        self._thread.start()

    def put(self, samples: LatencySamples) -> None:
        """Queue one tick's samples (the caller gives them up); never blocks."""
        if not any(getattr(samples, attr) for _, attr in self._histograms):
            return
        try:
            self._pending.put_nowait(samples)
        except queue.Full:
            if not self.dropped:
                self._on_error(
                    f"generator: {self._pending.maxsize} ticks of latency samples wait to be "
                    "observed; later samples are dropped until they are"
                )
            self.dropped += sum(len(getattr(samples, attr)) for _, attr in self._histograms)

    def close(self, timeout: float = 5.0) -> None:
        """Observe what is queued (while the server lives), then stop the thread."""
        try:
            self._pending.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while (samples := self._pending.get()) is not None:
            if not self._alive():
                return
            try:
                for metric, attr in self._histograms:
                    for value in getattr(samples, attr):
                        metric.observe(value)
            except Exception as exc:  # a metric call failed: the next tick's samples still go
                self._on_error(f"generator: latency histogram observe failed: {exc!r}")


GENERATED_TOKENS = MetricSpec(
    "tritonllm_generated_tokens_total", "Output tokens generated (all requests)", "counter"
)

# Gauges read from ``EngineStats``: metric spec → stats attribute (see ``gauge_values``).
ENGINE_GAUGES: tuple[tuple[MetricSpec, str], ...] = (
    (
        MetricSpec("tritonllm_kv_pages_used", "KV cache pages held by live requests", "gauge"),
        "request_pages",
    ),
    (
        MetricSpec("tritonllm_kv_pages_cached", "KV cache pages held by the prefix cache", "gauge"),
        "cached_pages",
    ),
    (MetricSpec("tritonllm_kv_pages_total", "KV cache pages in the pool", "gauge"), "total_pages"),
    (
        MetricSpec("tritonllm_requests_running", "Requests in the running batch", "gauge"),
        "num_running",
    ),
    (
        MetricSpec("tritonllm_requests_waiting", "Requests waiting for admission", "gauge"),
        "num_waiting",
    ),
    (
        MetricSpec("tritonllm_batch_size_max", "Largest decode batch seen", "gauge"),
        "max_batch_size_seen",
    ),
)


def gauge_values(stats: EngineStats) -> dict[str, float]:
    """``{metric name: value}`` of the gauges in ``ENGINE_GAUGES`` from an ``EngineStats``.

    ``request_pages`` is derived: ``used_pages - evictable_pages``, the pages that live
    requests hold (the prefix cache's unreferenced pages are free for the taking, so a server
    with no request running reports 0 even while its prefix cache is warm).
    """
    values = {"request_pages": stats.used_pages - stats.evictable_pages}
    return {
        spec.name: float(values[attr] if attr in values else getattr(stats, attr))
        for spec, attr in ENGINE_GAUGES
    }


# Cumulative counters: metric spec → attribute of ``EngineStats``, ``LoopTimes`` (the engine
# loop, in its thread or process) or ``SenderTimes`` (sender thread), read by
# ``counter_values``. Rates of these over an interval say where a served engine's time goes
# (``benchmarks/online.py`` reports them).
TIME_COUNTERS: tuple[tuple[MetricSpec, str, str], ...] = (
    (
        MetricSpec(
            "tritonllm_engine_busy_seconds_total",
            "Seconds the engine loop had work (steps, admissions, output callbacks)",
            "counter",
        ),
        "loop",
        "busy_s",
    ),
    (
        MetricSpec(
            "tritonllm_engine_cpu_seconds_total",
            "CPU seconds of the engine loop's thread",
            "counter",
        ),
        "loop",
        "cpu_s",
    ),
    (
        MetricSpec(
            "tritonllm_engine_gpu_wait_seconds_total",
            "Seconds the engine loop waited for the device to finish a launched step",
            "counter",
        ),
        "engine",
        "gpu_wait_s",
    ),
    (
        MetricSpec(
            "tritonllm_engine_output_seconds_total",
            "Seconds the engine loop spent delivering outputs (callbacks, or encoding and "
            "sending step messages to the generator's stubs)",
            "counter",
        ),
        "loop",
        "callback_s",
    ),
    (
        MetricSpec(
            "tritonllm_engine_steps_total", "Engine loop iterations with work (steps)", "counter"
        ),
        "loop",
        "loops",
    ),
    (
        MetricSpec(
            "tritonllm_engine_prefill_steps_total",
            "Engine steps that ran a prefill/extend batch (the others ran decode batches)",
            "counter",
        ),
        "engine",
        "num_prefill_steps",
    ),
    (
        MetricSpec(
            "tritonllm_engine_prefill_tokens_total",
            "Tokens computed by prefill/extend steps (prompt chunks, recomputation)",
            "counter",
        ),
        "engine",
        "prefill_tokens",
    ),
    (
        MetricSpec(
            "tritonllm_sender_busy_seconds_total",
            "Seconds the generator's sender thread spent on the Triton response path",
            "counter",
        ),
        "sender",
        "busy_s",
    ),
    (
        MetricSpec(
            "tritonllm_sender_cpu_seconds_total",
            "CPU seconds of the generator's sender thread",
            "counter",
        ),
        "sender",
        "cpu_s",
    ),
    (
        MetricSpec(
            "tritonllm_responses_total", "Streaming responses the generator sent", "counter"
        ),
        "sender",
        "responses",
    ),
)


# The ``TIME_COUNTERS`` each generator instance adds its own share to (its sender threads'); the
# others are the engine's, reported by the instance that owns a shared engine.
SENDER_COUNTERS = frozenset(spec.name for spec, source, _ in TIME_COUNTERS if source == "sender")


def counter_values(
    stats: EngineStats, loop_times: LoopTimes, sender_times: SenderTimes
) -> dict[str, float]:
    """``{metric name: cumulative value}`` of ``TIME_COUNTERS``.

    Args:
        stats: an ``EngineStats``; loop_times: the engine loop's ``LoopTimes``;
        sender_times: the sender thread's ``SenderTimes``.
    """
    sources = {"engine": stats, "loop": loop_times, "sender": sender_times}
    return {
        spec.name: float(getattr(sources[source], attr)) for spec, source, attr in TIME_COUNTERS
    }
