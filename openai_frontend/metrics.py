"""The sidecar's Prometheus metrics (prometheus-client), served at ``GET /metrics`` on the API
port, where aiperf and Prometheus scrape an OpenAI-compatible server.

Names follow vLLM's (``vllm:e2e_request_latency_seconds`` ...) under the ``openai_`` prefix
(the generator's Triton metrics, on Triton's metrics port, are ``tritonllm_*``):

- ``openai_requests_total{route, status}``: HTTP requests answered, by route template
  (``/v1/chat/completions``, also for the answers of the middleware in front of the routes:
  401, 413, 415, a drain's 503; ``unmatched`` for unknown paths) and status code;
- ``openai_requests_in_flight``: requests being answered (streams until their end), the
  ``/metrics`` scrape itself not counted (an idle server reads 0);
- ``openai_e2e_request_latency_seconds{route}``: arrival to the last byte sent;
- ``openai_time_to_first_token_seconds``: a generation's start to its first token, per choice;
- ``openai_inter_token_latency_seconds``: between a choice's responses, per token of the later
  one (a response carrying k tokens stands for k samples of gap / k);
- ``openai_prompt_tokens_total``, ``openai_generation_tokens_total``: tokens of finished
  generations once closed (usage's ``prompt_tokens`` / ``completion_tokens``).

The histogram buckets are the generator's (``tritonllm.serving.metrics``).

With several worker processes (``--workers``, ``workers.py``) each worker writes its values to
files of its own in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode, which
that variable turns on), and ``/metrics`` sums all of them, whichever worker answers the scrape:
the same metric names, counted over every worker (the requests in flight as the sum over the
live workers), without the ``*_created`` samples, which that mode does not keep, and without
the collectors of one process (``process_*``, ``python_*``). One worker (the default) serves
its own registry, as before.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tritonllm.serving.metrics import ITL_BUCKETS_S, REQUEST_BUCKETS_S, TTFT_BUCKETS_S

# prometheus-client reads this variable when it is imported: set, every value lives in a file
# of this process' own in that directory (``workers.py`` sets it for its workers).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

REQUESTS = Counter(
    "openai_requests", "HTTP requests answered, by route and status", ["route", "status"]
)
# livesum: with several workers, the sum over the live ones (a dead worker's count goes).
IN_FLIGHT = Gauge(
    "openai_requests_in_flight", "HTTP requests being answered", multiprocess_mode="livesum"
)
E2E_LATENCY = Histogram(
    "openai_e2e_request_latency_seconds",
    "Seconds from a request's arrival to its response's last byte",
    ["route"],
    buckets=REQUEST_BUCKETS_S,
)
TTFT = Histogram(
    "openai_time_to_first_token_seconds",
    "Seconds from a generation's start to a choice's first token",
    buckets=TTFT_BUCKETS_S,
)
ITL = Histogram(
    "openai_inter_token_latency_seconds",
    "Seconds between a choice's tokens (a response's gap divided by its tokens)",
    buckets=ITL_BUCKETS_S,
)
PROMPT_TOKENS = Counter("openai_prompt_tokens", "Prompt tokens of finished generations")
GENERATION_TOKENS = Counter("openai_generation_tokens", "Tokens generated, finished generations")
UNMATCHED = "unmatched"

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    """The Prometheus text exposition of the sidecar's metrics (every worker's: ``registry``)."""
    return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)


def registry() -> CollectorRegistry:
    """What ``/metrics`` serves: this process' registry, or in multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR`` set) a fresh one that sums the files of every process that
    wrote into that directory."""
    if MULTIPROC_DIR_ENV not in os.environ:
        return REGISTRY
    merged = CollectorRegistry()
    MultiProcessCollector(merged)
    return merged


def _route(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The route template of ``scope``'s request (a bounded set of label values): the route
    that served it (FastAPI's routing sets ``scope["route"]``), or for an answer a middleware
    gave before routing (a 401, a 413 or 415 of the body limits, a drain's 503) the one of
    ``routes`` it was sent to, picked as routing picks it (the first that matches path and
    method, else the first that matches the path: routing's 405); ``unmatched`` for a path no
    route serves."""
    route = scope.get("route")
    if route is None:
        partial = None
        for candidate in routes:
            match, _ = candidate.matches(scope)
            if match is Match.FULL:
                route = candidate
                break
            if match is Match.PARTIAL and partial is None:
                partial = candidate
        route = route or partial
    return UNMATCHED if route is None else str(getattr(route, "path", UNMATCHED))


class RequestMetrics:
    """ASGI middleware: counts every HTTP request by route and status, the requests in flight
    and their end-to-end latency (a stream's, until its last byte).

    Args:
        routes: the app's routes, each with its full path (no router prefix): what an answer
            given before routing is labelled with (``_route``); none: such answers are
            ``unmatched``.
    """

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute] = ()) -> None:
        self.app, self.routes = app, tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        counted = scope.get("path") != "/metrics"  # a scrape would always see itself
        if counted:
            IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            if counted:
                IN_FLIGHT.dec()
            route = _route(scope, self.routes)
            REQUESTS.labels(route, str(status)).inc()
            E2E_LATENCY.labels(route).observe(time.perf_counter() - start)


class TokenTimes:
    """One generation's token latencies: TTFT per choice, then ITL per later response.

    Args:
        started_at: ``time.monotonic()`` of the generation's start.
    """

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self._last: dict[int, tuple[float, int]] = {}  # choice → (time, output tokens so far)

    def on_response(self, index: int, num_output_tokens: int, now: float) -> None:
        """A response of choice ``index`` with ``num_output_tokens`` generated so far."""
        last = self._last.get(index)
        if last is None:
            if num_output_tokens > 0:
                TTFT.observe(now - self.started_at)
                self._last[index] = (now, num_output_tokens)
            return
        new = num_output_tokens - last[1]
        if new > 0:
            gap = (now - last[0]) / new
            for _ in range(new):
                ITL.observe(gap)
            self._last[index] = (now, num_output_tokens)


def count_tokens(prompt_tokens: int, completion_tokens: int) -> None:
    """Add a finished generation's usage to the token counters."""
    PROMPT_TOKENS.inc(prompt_tokens)
    GENERATION_TOKENS.inc(completion_tokens)
