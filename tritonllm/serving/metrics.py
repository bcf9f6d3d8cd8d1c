"""The engine gauges and time counters the generator exports as Triton custom metrics
(``tritonllm_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonllm.engine.client import LoopTimes
    from tritonllm.engine.engine import EngineStats
    from tritonllm.serving.response_streamer import SenderTimes


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: Prometheus name, help text, kind ``"gauge"`` or ``"counter"``."""

    name: str
    description: str
    kind: str


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
