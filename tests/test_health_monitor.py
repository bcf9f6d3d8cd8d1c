"""The sidecar's HealthMonitor: a held backend failure clears after RECOVERY_PROBES probes in a
row went through, and never while every other probe fails (one of two instances dead)."""

from __future__ import annotations

import asyncio
import time
import types

import numpy as np

from openai_frontend.errors import OpenAIError
from openai_frontend.generation import BackendProgress, Generation
from openai_frontend.health import RECOVERY_PROBES, BackendWatch, HealthMonitor
from openai_frontend.triton_client import LLMChunk, TritonError


class _Stream:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    async def read(self):
        if self.fail:
            raise TritonError("Stub process 'generator_0_0' is not healthy.")
        return None


class _Client:
    """A Triton client whose probes go through or fail in the order of ``outcomes``."""

    def __init__(self, outcomes: list[bool], generator_fails: bool = False) -> None:
        self.outcomes = list(outcomes)
        self.generator_fails = generator_fails

    async def is_ready(self) -> bool:
        return True

    async def generator_info(self) -> dict:
        if self.generator_fails:  # as every instance answers while one of two is gone
            raise TritonError(
                '{"code":"engine_unavailable","message":"1 of the generator\'s 2 instances'
                ' lost their engine connection"}'
            )
        return {}

    async def stream(self, request_id, inputs, model=None):
        # through llm, every stub, whatever ensemble the sidecar streams from
        assert model == "llm"
        return _Stream(fail=not self.outcomes.pop(0))

    def close_soon(self, stream, request_id) -> None:
        pass


def _statuses(outcomes: list[bool], generator_fails: bool = False) -> list[bool]:
    client = _Client(outcomes, generator_fails)
    monitor = HealthMonitor(client, set(), interval_s=0.0, failure_hold_s=600.0)

    async def run() -> list[bool]:
        return [(await monitor.check()).ok for _ in outcomes]

    return asyncio.run(run())


def test_a_held_failure_clears_after_enough_probes_in_a_row():
    passes = [True] * RECOVERY_PROBES
    assert _statuses([False, *passes]) == [False] * RECOVERY_PROBES + [True]


def test_alternating_failures_keep_the_failure_held():
    assert _statuses([False, True] * 4) == [False] * 8


def test_a_healthy_backend_is_ok_at_once():
    assert _statuses([True, True]) == [True, True]


def test_a_lost_generator_instance_fails_every_check_even_when_generations_pass():
    """Generations land on the live instance, but the generator's own probe says an instance
    is gone: every check fails (no flapping), so supervision restarts the server."""
    assert _statuses([True] * 6, generator_fails=True) == [False] * 6


def _just_answered() -> BackendProgress:
    """The record of a backend that has just sent some generation a response."""
    return BackendProgress(time.monotonic())


def test_a_busy_server_is_ok_without_a_probe_generation():
    client = _Client([])  # any probe generation would pop from an empty list and fail the test
    monitor = HealthMonitor(client, set(), _just_answered(), interval_s=60.0)
    assert asyncio.run(monitor.check()).ok


def test_a_lost_generator_instance_fails_the_check_of_a_busy_server():
    """Under load the live instance keeps streaming, which used to stand in for the whole
    check; the generator's own probe is still asked, so the dead instance is seen."""
    client = _Client([], generator_fails=True)
    monitor = HealthMonitor(client, set(), _just_answered(), interval_s=60.0)
    status = asyncio.run(monitor.check())
    assert not status.ok and status.backend_failed


class _QueuedProbe:
    """A probe generation stuck behind a burst: no response until it is aborted."""

    async def read(self):
        await asyncio.sleep(3600)


class _BurstClient(_Client):
    """A Triton client whose probe generation queues behind a burst of requests."""

    def __init__(self) -> None:
        super().__init__([])
        self.aborted: list[str] = []

    async def stream(self, request_id, inputs, model=None):
        return _QueuedProbe()

    def close_soon(self, stream, request_id) -> None:
        self.aborted.append(request_id)


def _probe_behind_a_burst(others_answered: bool, probe_timeout_s: float):
    """A check whose probe never gets its response; meanwhile, with ``others_answered``, a
    non-streamed request of the burst gets its one (final) response. The check must answer
    within 10 s."""
    client = _BurstClient()
    progress = BackendProgress()
    monitor = HealthMonitor(
        client, set(), progress, interval_s=0.0, probe_timeout_s=probe_timeout_s
    )

    async def run():
        async def finish_one():
            await asyncio.sleep(0.05)
            progress.last_response_at = time.monotonic()

        task = asyncio.ensure_future(finish_one()) if others_answered else None
        status = await asyncio.wait_for(monitor.check(), 10.0)
        if task is not None:
            await task
        return status

    status = asyncio.run(run())
    assert len(client.aborted) == 1  # the timed-out probe is aborted either way
    return status


def test_a_probe_queued_behind_a_burst_passes_while_other_requests_finish():
    """QA: 600 non-streamed chats at once; /health said "no generation within 10 s" for 34 s
    while requests kept finishing, and supervision restarted a server doing its work. The
    check now passes as soon as another request gets a response, well within the
    supervisor's wait for an answer."""
    status = _probe_behind_a_burst(others_answered=True, probe_timeout_s=3600.0)
    assert status.ok, status.reason  # at once, not after the probe's timeout


def test_a_probe_that_times_out_with_no_response_anywhere_fails_as_slow_not_failed():
    status = _probe_behind_a_burst(others_answered=False, probe_timeout_s=0.2)
    assert not status.ok and not status.backend_failed
    assert status.reason.startswith("no generation within")


class _SteppingEngineClient(_BurstClient):
    """A probe queued behind a burst of non-streamed requests (no response anywhere), the
    generator's probe answer carrying the engine's step count: advancing between two answers
    with ``stepping``, else stuck."""

    def __init__(self, stepping: bool) -> None:
        super().__init__()
        self.stepping, self.steps = stepping, 100

    async def generator_info(self) -> dict:
        self.steps += 5 if self.stepping else 0
        return {"engine_steps": np.array([self.steps], dtype=np.int64)}


def test_a_probe_behind_non_streamed_requests_passes_while_the_engine_steps():
    """QA: 300 non-streamed requests of 600 tokens at once; no response came for tens of
    seconds (each request's only one is its last), the probe timed out, and the launcher
    restarted tritonserver 30 s in, failing all 300. The engine's step count, asked again at
    the probe's deadline, tells that busy engine from a stuck one."""
    results = {}
    for stepping in (True, False):
        client = _SteppingEngineClient(stepping)
        monitor = HealthMonitor(
            client, set(), BackendProgress(), interval_s=0.0, probe_timeout_s=0.2
        )
        results[stepping] = asyncio.run(monitor.check())
        assert len(client.aborted) == 1  # the probe itself is aborted either way
    assert results[True].ok, results[True].reason
    assert not results[False].ok and not results[False].backend_failed


class _FailsThenQueues(_BurstClient):
    """The first probe gets an error answer (a dead stub); later ones queue behind a burst."""

    def __init__(self) -> None:
        super().__init__()
        self.probes = 0

    async def stream(self, request_id, inputs, model=None):
        self.probes += 1
        return _Stream(fail=True) if self.probes == 1 else _QueuedProbe()


def test_other_requests_responses_do_not_clear_a_held_failure():
    """With one of two generator instances dead, the live one keeps answering its requests:
    while a failure is held, only probes that went through clear it, not others' progress."""
    client = _FailsThenQueues()
    progress = BackendProgress()
    monitor = HealthMonitor(
        client, set(), progress, interval_s=0.0, probe_timeout_s=0.3, failure_hold_s=600.0
    )

    async def run():
        first = await monitor.check()
        progress.last_response_at = time.monotonic()  # the live instance streams on
        task = asyncio.ensure_future(monitor.check())
        await asyncio.sleep(0.1)
        progress.last_response_at = time.monotonic()
        return first, await task

    first, second = asyncio.run(run())
    assert first.backend_failed and not second.ok


class _OneResponse:
    """The stream of a non-streamed request: its one response, then the end."""

    def __init__(self) -> None:
        self.responses = [LLMChunk("Paris.", "stop", 7, 2, 0), None]
        self.done = False

    async def read(self):
        chunk = self.responses.pop(0)
        self.done = chunk is None
        return chunk


class _OneResponseClient:
    async def stream(self, request_id, inputs, model=None):
        return _OneResponse()


def test_a_finished_non_streamed_generation_remains_evidence_of_progress():
    """A non-streamed request leaves the generations in flight with its only response; the
    process-wide record keeps that response as evidence (the per-generation time left with
    it, which is how a burst of non-streamed requests looked like a stuck server)."""
    live: set = set()
    progress = BackendProgress()

    async def run():
        gen = Generation(_OneResponseClient(), "cmpl-1", {}, registry=live, progress=progress)
        await gen.start()
        choices = await gen.collect()
        gen.close()
        return choices

    before = time.monotonic()
    choices = asyncio.run(run())
    assert [c.text for c in choices] == ["Paris."]
    assert not live
    assert progress.last_response_at is not None and progress.last_response_at >= before
    monitor = HealthMonitor(_Client([]), live, progress, interval_s=60.0)
    assert asyncio.run(monitor.check()).ok  # no probe generation: _Client([]) would fail it


def test_health_says_backend_failed_for_an_error_answer_only():
    """The /health body tells supervision an error answer (restart soon) from slowness."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from openai_frontend import health

    def served(client) -> dict:
        app = FastAPI()
        app.include_router(health.router)
        app.state.health = HealthMonitor(client, set(), interval_s=0.0)
        app.state.drain = types.SimpleNamespace(draining=False)
        response = TestClient(app).get("/health")
        return {"code": response.status_code, **response.json()}

    assert served(_Client([True])) == {"code": 200, "status": "ok"}
    failed = served(_Client([False]))
    assert failed["code"] == 503 and failed["backend_failed"] is True

    class Unready(_Client):
        async def is_ready(self) -> bool:
            return False

    assert served(Unready([])) == {
        "code": 503,
        "status": "triton not ready",
        "backend_failed": False,
    }


class _Failing:
    """A generation in flight, silent for long, that records the error it is failed with."""

    def __init__(self) -> None:
        self.last_response_at, self.started_at, self.error = None, 0.0, None

    def fail(self, error) -> bool:
        self.error = error
        return True


def test_unhealthy_reasons_name_no_internals_and_the_log_keeps_them(caplog):
    """/health needs no API key and its reason becomes the error of the generations it fails:
    Triton's message (stub and model names) goes to the log only. QA found "the backend
    failed: generator: Stub process 'generator_0_0' is not healthy." in error bodies."""
    for client, reason in [
        (_Client([False]), "generation failed"),
        (_Client([True], generator_fails=True), "generator failed"),
    ]:
        monitor = HealthMonitor(client, set(), interval_s=0.0)
        with caplog.at_level("WARNING", logger="openai_frontend.health"):
            status = asyncio.run(monitor.check())
        assert (status.ok, status.reason) == (False, reason)
        assert "generator_0_0" in caplog.text or "instances" in caplog.text
        caplog.clear()
        watch = BackendWatch(monitor, interval_s=60.0, silence_s=0.0)
        gen = _Failing()
        monitor.live.add(gen)
        assert watch.fail_silent(status.reason) == 1
        assert gen.error.message == f"the backend failed: {reason}", gen.error.message


def test_the_supervisor_waits_longer_for_health_than_a_probe_may_take():
    """A /health still waiting for its probe generation is a slow backend; the supervisor
    used to give up after 5 s of the probe's 10 and restart the sidecar as wedged."""
    import inspect

    from tritonllm.supervisor import SupervisePolicy

    probe_s = inspect.signature(HealthMonitor).parameters["probe_timeout_s"].default
    assert SupervisePolicy().health_answer_timeout_s > probe_s


class _LateResponse:
    """The stream of a non-streamed request whose one response comes ``delay_s`` after its
    first read. A read cancelled by a timeout loses nothing: the next one waits for the same
    moment, as ``ResponseStream`` keeps its gRPC read."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.responses = [LLMChunk("Once upon a time", "length", 7, 300, 0), None]
        self.done = False
        self._ready_at: float | None = None

    async def read(self):
        loop = asyncio.get_running_loop()
        if self._ready_at is None:
            self._ready_at = loop.time() + self.delay_s
        await asyncio.sleep(max(0.0, self._ready_at - loop.time()))
        chunk = self.responses.pop(0)
        self.done = chunk is None
        return chunk

    def cancel(self) -> None:
        self.done = True


class _LateClient:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def stream(self, request_id, inputs, model=None):
        return _LateResponse(self.delay_s)


def _late_generation(stream: bool, healthy: bool) -> Generation:
    async def backend_ok() -> bool:
        return healthy

    return Generation(
        _LateClient(0.5),
        "chatcmpl-1",
        {"stream": stream},
        idle_timeout_s=0.1,
        backend_ok=backend_ok,
    )


def _collect(gen: Generation):
    async def run():
        try:
            await gen.start()
            return await gen.collect()
        finally:
            gen._closed = True  # nothing to abort: a fake stream

    return asyncio.run(run())


def test_a_non_streamed_request_outlasts_the_idle_timeout_while_the_backend_is_healthy():
    """QA: a non-streamed request gets one response, at its end, so a healthy generation longer
    than --stream-idle-timeout (300 s: a long output on a CPU) was cut with a 504 and its work
    thrown away; it waits on while the health check passes."""
    choices = _collect(_late_generation(stream=False, healthy=True))
    assert [(c.text, c.finish_reason) for c in choices] == [("Once upon a time", "length")]


def test_the_idle_timeout_still_fails_a_silent_stream_or_an_unhealthy_backend():
    for stream, healthy in ((True, True), (False, False)):
        try:
            _collect(_late_generation(stream=stream, healthy=healthy))
        except OpenAIError as exc:
            assert (exc.status, exc.code) == (504, "timeout")
        else:
            raise AssertionError(f"no timeout (stream={stream}, healthy={healthy})")
