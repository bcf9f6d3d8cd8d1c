"""The sidecar's HealthMonitor: a held backend failure clears after RECOVERY_PROBES probes in a
row went through, and never while every other probe fails (one of two instances dead)."""

from __future__ import annotations

import asyncio
import time
import types

from openai_frontend.health import RECOVERY_PROBES, BackendWatch, HealthMonitor
from openai_frontend.triton_client import TritonError


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


class _Busy:
    """A generation in flight that has just had a response."""

    def __init__(self) -> None:
        self.last_response_at = time.monotonic()


def test_a_busy_server_is_ok_without_a_probe_generation():
    client = _Client([])  # any probe generation would pop from an empty list and fail the test
    monitor = HealthMonitor(client, {_Busy()}, interval_s=60.0)
    assert asyncio.run(monitor.check()).ok


def test_a_lost_generator_instance_fails_the_check_of_a_busy_server():
    """Under load the live instance keeps streaming, which used to stand in for the whole
    check; the generator's own probe is still asked, so the dead instance is seen."""
    client = _Client([], generator_fails=True)
    monitor = HealthMonitor(client, {_Busy()}, interval_s=60.0)
    status = asyncio.run(monitor.check())
    assert not status.ok and status.backend_failed


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
