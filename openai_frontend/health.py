"""End-to-end health of the service and the watch that fails requests whose backend died.

``GET /health`` answers 200 only when a generation goes through the whole ``llm`` ensemble
(tokenizer → generator → detokenizer; every stub, also when the sidecar streams from
``llm_fused``, which skips the detokenizer, so that Triton clients of ``llm`` are covered too): Triton 2.51 keeps reporting a model READY after its
Python stub died, and a wedged tokenizer or detokenizer hangs every request while the generator
alone still answers (ARCHITECTURE.md, "Platform facts"). The check is cheap and cannot load the
engine however often it is asked:

- one check runs at a time; its result is cached for ``interval_s`` seconds and shared by
  every caller meanwhile;
- a check asks whether tritonserver is ready, then the generator's own health probe
  (``health_probe``, a control request, no generation), which every generator instance fails
  while one of them is gone (``GeneratorCore``, "instances");
- then a 1-token greedy generation, unless a response the backend sent any generation (in
  flight or finished since: ``generation.BackendProgress``) within the last ``interval_s``
  seconds is proof enough that the pipeline makes progress: a busy server runs no probe
  generation at all. A probe generation passes as soon as any other generation gets a response
  while it waits, and fails the check only if it outlasts ``probe_timeout_s`` with none: under
  a burst the probe queues behind hundreds of requests, and a non-streamed request's only
  response is its last one, so responses can be seconds apart on a loaded server that is doing
  its work (QA: a server restarted for that dropped every request it had admitted). A probe
  that outlasts ``probe_timeout_s`` with no such response still passes when the engine ran
  steps meanwhile: the generator's probe answer carries its step count (``engine_steps``), asked
  again at the deadline. So 300 non-streamed requests of 600 tokens each, whose first
  responses come only when they finish, leave the service healthy and busy (QA: before this,
  the launcher restarted tritonserver 30 s into such a burst and failed all 300). Progress
  alone is not proof of health: with one of two generator instances dead, the live one keeps
  streaming while every other new request fails, which is why the generator's probe is always
  asked, and why progress counts for nothing while a failure is held.

A probe that gets an *error response* (not merely a slow one) means a part of the pipeline is
broken, and Triton never repairs a dead stub. Such a failure is held for ``failure_hold_s``
seconds (a model with two instances fails every other request when one of them died, and
/health must not flap), and is cleared early once tritonserver is seen down or restarting, or
once ``RECOVERY_PROBES`` probes in a row went through (a tritonserver restarted between two
checks is never seen down; with one of two instances dead, two probes in a row cannot both
pass, as Triton spreads requests over the instances in turn).

``BackendWatch`` runs while generations are in flight: once none of them has had a response for
``silence_s`` seconds (3), it checks health, and when the backend is known to have failed it
ends them all with a 503 at once, instead of leaving them to the stream idle timeout (300 s by
default): Triton sends nothing more to the requests of a stub it lost.

``GET /health/live`` is the liveness answer: 200 while the sidecar's event loop runs, whatever
the backend's state (a liveness probe must not restart the sidecar for a dead backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tritonllm.contract.errors import ErrorCode, decode_error
from tritonllm.contract.tensors import HEALTH_PROBE_ID_PREFIX

from .drain import DRAIN_HEADERS
from .errors import OpenAIError
from .generation import BackendProgress, Generation
from .triton_client import InputValue, TritonClient, TritonError

log = logging.getLogger(__name__)

# The probe: a prompt every tokenizer encodes and one greedy token. Its request id says what it
# is in Triton's logs and statistics.
PROBE_INPUTS: dict[str, InputValue] = {"text_input": "health", "max_tokens": 1, "temperature": 0.0}
PROBE_ID_PREFIX = HEALTH_PROBE_ID_PREFIX  # (the generator's latency histograms leave them out)
# The probe's ensemble: the one that goes through every stub.
PROBE_MODEL = "llm"
# Probes in a row that must go through to clear a held failure before its hold ends.
RECOVERY_PROBES = 3
# Seconds between two looks, while a probe generation waits, for other generations' responses.
PROGRESS_POLL_S = 0.1


def _overloaded(exc: TritonError) -> bool:
    """Whether ``exc`` is the generator's full-queue refusal (``server_overloaded``): the
    service works, so a probe refused that way passes (a 503 would get the server restarted
    for being busy)."""
    wire = None if exc.unavailable else decode_error(exc.message)
    return wire is not None and wire.code is ErrorCode.SERVER_OVERLOADED


@dataclass(frozen=True)
class HealthStatus:
    """The outcome of one health check.

    Attributes:
        ok: the service can serve a generation now.
        reason: ``"ok"`` or why not, in the service's own words (shown in the /health body,
            which needs no API key, and in the error of generations failed for it).
        backend_failed: Triton answered a generation with an error (a dead or failing stub),
            as opposed to being slow, not ready or unreachable.
        checked_at: ``time.monotonic()`` of the check.
        detail: Triton's error message behind ``reason`` (model and stub names): logged only.
    """

    ok: bool
    reason: str
    backend_failed: bool = False
    checked_at: float = 0.0
    detail: str = ""


class HealthMonitor:
    """The sidecar's end-to-end health (see the module docstring).

    Args:
        client: the shared Triton client.
        live: the generations in flight (``ServerState.live``).
        progress: the backend's latest response to any generation (``ServerState.progress``):
            the passive evidence of progress (None: a record of this monitor's own).
        interval_s: seconds a result (or a response of a live generation) stays valid.
        probe_timeout_s: seconds a probe generation may take before the check fails.
        failure_hold_s: seconds a probe's error response keeps the status failed.
    """

    def __init__(
        self,
        client: TritonClient,
        live: set[Generation],
        progress: BackendProgress | None = None,
        interval_s: float = 1.0,
        probe_timeout_s: float = 10.0,
        failure_hold_s: float = 60.0,
    ) -> None:
        self.client, self.live = client, live
        self.progress = progress if progress is not None else BackendProgress()
        self.interval_s, self.probe_timeout_s = interval_s, probe_timeout_s
        self.failure_hold_s = failure_hold_s
        self._last: HealthStatus | None = None
        self._failed: HealthStatus | None = None  # the held failure, if any
        self._passed_in_row = 0  # probes that went through since the held failure
        self._running: asyncio.Task | None = None
        self._engine_steps: int | None = None  # as the generator's last probe answer said

    def _held(self, now: float) -> HealthStatus | None:
        """The failure still held at ``now`` (within ``failure_hold_s``), if any."""
        held = self._failed
        return held if held is not None and now - held.checked_at < self.failure_hold_s else None

    def _progress_is_proof(self, now: float) -> bool:
        """Whether a recent response to some generation stands in for the probe generation:
        one came within ``interval_s``, and no failure is held (a held failure clears only
        by probes that went through)."""
        if self._held(now) is not None:
            return False
        last = self.progress.last_response_at
        return last is not None and now - last < self.interval_s

    def _progressed_since(self, since: float) -> bool:
        """Whether some generation got a response after ``since`` (``time.monotonic()``)."""
        last = self.progress.last_response_at
        return last is not None and last > since

    async def check(self) -> HealthStatus:
        """The current status: cached, evidenced by live generations, or probed (one probe at
        a time, shared by concurrent callers). Never raises."""
        now = time.monotonic()
        if self._last is not None and now - self._last.checked_at < self.interval_s:
            return self._last
        if self._running is None:
            self._running = asyncio.ensure_future(self._probe())
            self._running.add_done_callback(lambda _: setattr(self, "_running", None))
        # Shielded: a caller that goes away (a probe's HTTP client timing out) must not cancel
        # the probe that other callers share.
        return await asyncio.shield(self._running)

    async def ok(self) -> bool:
        """Whether ``check`` finds the service healthy now."""
        return (await self.check()).ok

    async def _probe(self) -> HealthStatus:
        if not await self.client.is_ready():
            self._failed = None  # tritonserver is down or (re)starting: old failures are moot
            return self._record(
                HealthStatus(False, "triton not ready", checked_at=time.monotonic())
            )
        failure = await self._ask_generator()
        if failure is None and not self._progress_is_proof(time.monotonic()):
            failure = await self._generate_one()
        now = time.monotonic()
        if failure is not None:
            reason, backend_failed, detail = failure
            status = HealthStatus(False, reason, backend_failed, now, detail)
            if backend_failed:
                self._failed, self._passed_in_row = status, 0
            return self._record(status)
        self._passed_in_row += 1
        held = self._held(now)
        if held is not None and self._passed_in_row < RECOVERY_PROBES:
            return self._record(HealthStatus(False, held.reason, True, now))
        self._failed = None
        return self._record(HealthStatus(True, "ok", checked_at=now))

    async def _ask_generator(self) -> tuple[str, bool, str] | None:
        """The generator's own health probe: None when it answers (its ``engine_steps`` then
        recorded), else ``(reason, backend_failed, Triton's message)``. With several generator
        instances it fails on every one of them while one is gone, which the generation alone
        (landing on a live one every other time) would not show for good."""
        try:
            info = await self.client.generator_info()
        except TritonError as exc:
            if _overloaded(exc):
                return None
            return "generator failed", not exc.unavailable, exc.message
        steps = info.get("engine_steps")
        self._engine_steps = None if steps is None else int(steps.reshape(-1)[0])
        return None

    async def _engine_stepped_since(self, steps: int | None) -> bool:
        """Whether the generator's engine ran steps since its probe answered ``steps`` (None,
        or a probe that fails now: no)."""
        if steps is None:
            return False
        failure = await self._ask_generator()
        return failure is None and self._engine_steps is not None and self._engine_steps > steps

    async def _generate_one(self) -> tuple[str, bool, str] | None:
        """Send the probe generation: None when it finished, else ``(reason, backend_failed,
        Triton's message)``. It passes as soon as another generation gets a response while it
        waits, or at its deadline when the engine ran steps meanwhile, unless a failure is held
        (busy, not stuck: the module docstring); it is then aborted, as is a probe that
        outlasts ``probe_timeout_s`` otherwise, which fails the check but is not
        ``backend_failed`` (slow is not dead)."""
        request_id = f"{PROBE_ID_PREFIX}{uuid.uuid4().hex}"
        sent_at = time.monotonic()
        steps_before = self._engine_steps
        try:
            stream = await self.client.stream(request_id, PROBE_INPUTS, PROBE_MODEL)
        except TritonError as exc:
            return (
                None if _overloaded(exc) else ("probe not sent", not exc.unavailable, exc.message)
            )

        async def read_all() -> None:
            while await stream.read() is not None:
                pass

        reader = asyncio.ensure_future(read_all())
        deadline = sent_at + self.probe_timeout_s
        progress_counts = self._held(sent_at) is None
        try:
            while not reader.done():
                left = deadline - time.monotonic()
                if left <= 0 or (progress_counts and self._progressed_since(sent_at)):
                    break
                await asyncio.wait({reader}, timeout=min(PROGRESS_POLL_S, left))
            if reader.done():
                reader.result()
                return None
        except TritonError as exc:
            if _overloaded(exc):  # the whole pipeline answered: busy, not broken
                return None
            return "generation failed", not exc.unavailable, exc.message
        finally:
            reader.cancel()  # (a no-op once it is done)
        self.client.close_soon(stream, request_id)
        if progress_counts and self._progressed_since(sent_at):
            return None
        if progress_counts and await self._engine_stepped_since(steps_before):
            return None  # a full engine at work: the probe waits behind it
        return f"no generation within {self.probe_timeout_s:g} s", False, ""

    def _record(self, status: HealthStatus) -> HealthStatus:
        if not status.ok and (self._last is None or self._last.reason != status.reason):
            detail = f" ({status.detail})" if status.detail else ""
            log.warning("unhealthy: %s%s", status.reason, detail)
        self._last = status
        return status


class BackendWatch:
    """While generations are in flight and every one of them has had no response for
    ``silence_s`` seconds, checks health (every ``interval_s`` seconds at most); when the
    backend is known to have failed, fails them with a 503 ``service_unavailable``.

    A backend that streams to any of them is not probed at all (the probe is a request through
    ``llm``, and Triton's statistics count it).

    Args:
        monitor: the health monitor.
        interval_s, silence_s: seconds.
    """

    def __init__(self, monitor: HealthMonitor, interval_s: float = 1.0, silence_s: float = 3.0):
        self.monitor, self.interval_s, self.silence_s = monitor, interval_s, silence_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the watch on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop the watch."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _silent(self, now: float) -> list[Generation]:
        """The live generations, if every one has been silent for ``silence_s``; else []."""
        live = list(self.monitor.live)
        for gen in live:
            last = gen.last_response_at if gen.last_response_at is not None else gen.started_at
            if now - last < self.silence_s:
                return []
        return live

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self._silent(time.monotonic()):
                continue
            try:
                status = await self.monitor.check()
            except Exception:  # the watch must outlive any surprise
                log.exception("health check failed")
                continue
            if status.backend_failed:
                self.fail_silent(status.reason)

    def fail_silent(self, reason: str) -> int:
        """Fail the live generations if all are silent (see ``_silent``); returns how many."""
        error = OpenAIError(
            f"the backend failed: {reason}", 503, "server_error", code="service_unavailable"
        )
        count = sum(gen.fail(error) for gen in self._silent(time.monotonic()))
        if count:
            log.warning("failed %d generation(s) in flight: %s", count, reason)
        return count


router = APIRouter()


@router.get("/health", response_model=None)
async def health(request: Request) -> JSONResponse:
    """200 ``{"status": "ok"}`` when a generation goes through the ``llm`` ensemble (see the
    module docstring); 503 ``{"status": reason, "backend_failed": bool}`` otherwise
    (``backend_failed``: a part of the pipeline answered with an error, which Triton never
    repairs, as opposed to being slow or restarting), and ``{"status": "draining"}`` with the
    drain's ``Retry-After`` and ``Connection: close`` (``drain.DRAIN_HEADERS``) while the
    sidecar drains."""
    drain = request.app.state.drain
    if drain.draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers=DRAIN_HEADERS)
    status = await request.app.state.health.check()
    if status.ok:
        return JSONResponse({"status": status.reason})
    # backend_failed: an error answer (a dead stub), not slowness; supervision restarts sooner.
    body = {"status": status.reason, "backend_failed": status.backend_failed}
    return JSONResponse(body, status_code=503)


@router.get("/health/live", response_model=None)
async def live() -> JSONResponse:
    """200 while the sidecar runs (liveness: says nothing about the backend)."""
    return JSONResponse({"status": "live"}, status_code=200)
