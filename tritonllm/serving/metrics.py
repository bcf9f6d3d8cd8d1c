"""The engine gauges the generator exports as Triton custom metrics (``tritonllm_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def gauge_values(stats: Any) -> dict[str, float]:
    """``{metric name: value}`` of the gauges in ``ENGINE_GAUGES`` from an ``EngineStats``.

    ``request_pages`` is derived: ``used_pages - evictable_pages``, the pages that live
    requests hold (the prefix cache's unreferenced pages are free for the taking, so a server
    with no request running reports 0 even while its prefix cache is warm).
    """
    values = {"request_pages": stats.used_pages - getattr(stats, "evictable_pages", 0)}
    return {
        spec.name: float(values[attr] if attr in values else getattr(stats, attr, 0))
        for spec, attr in ENGINE_GAUGES
    }
