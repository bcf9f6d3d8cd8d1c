"""Supervision of the two served processes: tritonserver and the OpenAI sidecar.

``Supervisor`` starts both, watches them, and on a failure either restarts the failed process
after an exponential backoff (``make serve``) or stops everything and reports it, so that the
launcher exits non-zero and an orchestrator (Kubernetes, compose ``restart:``) restarts the
container (``--on-failure exit``). Failures, and what is restarted for each:

- tritonserver exited (killed, crashed, OOM): tritonserver;
- the sidecar exited: the sidecar;
- the sidecar's ``/health`` (end to end through the ``llm`` ensemble) has answered 503 for
  ``unhealthy_timeout_s`` seconds, or still fails ``failed_timeout_s`` seconds after saying
  ``backend_failed`` (a stub answered with an error: a dead generator instance, say, which
  is no slowness that could pass): tritonserver, since Triton 2.51 never restarts a dead or
  stopped Python stub and keeps reporting the model ready (ARCHITECTURE.md, "Platform facts");
- ``/health`` has not answered at all for that long (a wedged sidecar): the sidecar.

Stopping: ``stop(graceful=True)`` (SIGTERM to the launcher) sends the sidecar SIGTERM, which
makes it drain (new requests 503, the ones in flight finish, ``openai_frontend/drain.py``),
waits for it, then stops tritonserver; ``graceful=False`` (Ctrl-C) makes the sidecar abort what
is in flight. Both end with no process of either group left.

This module imports only the standard library and ``triton_server``: the launcher stays small
(no torch, no transformers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .processes import start_process_group, stop_process_group
from .triton_server import TritonServer

FAILURE_POLICIES = ("restart", "exit")
# Seconds a failed tritonserver gets between SIGTERM and SIGKILL before it is restarted.
FAILED_STOP_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class SupervisePolicy:
    """How failures are handled.

    Attributes:
        on_failure: ``"restart"`` the failed process, or ``"exit"`` (stop everything; the
            launcher returns 1).
        backoff_initial_s, backoff_max_s: the delay before the first restart of a process, and
            its cap; each further restart doubles it.
        backoff_reset_s: seconds of good health after which the delay is back to the initial.
        health_interval_s: seconds between two checks of the sidecar's ``/health``.
        unhealthy_timeout_s: seconds ``/health`` may fail in a row before it is a failure.
        failed_timeout_s: seconds from a ``/health`` answer saying ``backend_failed`` (an
            error answer, not slowness) after which a failing answer is a failure, unless
            ``/health`` said no ``backend_failed`` for this long meanwhile (then it is
            forgotten). QA: with a dead generator instance nearly every request failed for the
            whole ``unhealthy_timeout_s``, and with one of two stubs stopped ``/health``
            alternated between 200 and ``backend_failed``. Long enough for a one-off error to
            clear first: the sidecar holds it until 3 probes in a row pass, about 6 s at the
            2 s health interval.
        drain_timeout_s: seconds a graceful stop lets the requests in flight finish.
        health_answer_timeout_s: seconds to wait for ``/health`` to answer; past it the
            sidecar counts as not answering (wedged). Longer than the sidecar's probe
            generation may take (``HealthMonitor.probe_timeout_s``, 10 s): a ``/health``
            still waiting for its probe is a slow backend, and cutting it short (5 s before)
            blamed the sidecar for it.
    """

    on_failure: str = "restart"
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    backoff_reset_s: float = 60.0
    health_interval_s: float = 2.0
    unhealthy_timeout_s: float = 30.0
    failed_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0
    health_answer_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_failure must be one of {FAILURE_POLICIES}, got {self.on_failure}")


class Backoff:
    """Exponential restart delay of one process: ``initial * 2**k`` capped at ``max``, ``k``
    the restarts since the process was last healthy for ``reset_s`` seconds (Kubernetes'
    CrashLoopBackOff works the same way)."""

    def __init__(self, initial_s: float, max_s: float, reset_s: float) -> None:
        self.initial_s, self.max_s, self.reset_s = initial_s, max_s, reset_s
        self.restarts = 0
        self._healthy_since: float | None = None

    def healthy(self, now: float) -> None:
        """Record a good health check at ``now`` (``time.monotonic()``)."""
        if self._healthy_since is None:
            self._healthy_since = now
        elif now - self._healthy_since >= self.reset_s:
            self.restarts = 0

    def next_delay(self) -> float:
        """Seconds to wait before the next restart (and count it)."""
        delay = min(self.max_s, self.initial_s * 2**self.restarts)
        self.restarts += 1
        self._healthy_since = None
        return delay


@dataclass(frozen=True)
class HealthAnswer:
    """One ``GET /health``: ``status`` the HTTP status (None: no answer), ``reason`` its
    ``status`` field or why there was no answer, ``backend_failed`` its field of that name."""

    status: int | None
    reason: str
    backend_failed: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200


def check_health(url: str, timeout_s: float) -> HealthAnswer:
    """``GET url`` (the sidecar's ``/health``) within ``timeout_s`` seconds; never raises."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return _answer(response.status, response.read())
    except urllib.error.HTTPError as exc:
        return _answer(exc.code, exc.read())
    except (OSError, ValueError) as exc:  # refused, reset, timed out
        return HealthAnswer(None, str(exc))


def _answer(status: int, body: bytes) -> HealthAnswer:
    try:
        fields = json.loads(body)
        return HealthAnswer(
            status, str(fields.get("status", "")), fields.get("backend_failed") is True
        )
    except (ValueError, AttributeError):
        return HealthAnswer(status, body[:200].decode(errors="replace"))


def log(message: str) -> None:
    """The supervisor's lines go to stdout, unbuffered, each after its UTC time (QA: without
    one an operator could not time a restart decision)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"{stamp} {message}", flush=True)


class Supervisor:
    """Starts, watches, restarts and stops tritonserver and the sidecar.

    Args:
        new_triton: makes the (unstarted) ``TritonServer`` to run, once per start.
        sidecar_command: the sidecar's command line.
        health_url: the sidecar's ``/health``.
        policy: the ``SupervisePolicy``.
        startup_timeout_s: seconds each start may take to become healthy.
        cwd: the sidecar's working directory.
        sidecar_env: the sidecar's whole environment (None: this process').
    """

    def __init__(
        self,
        new_triton: Callable[[], TritonServer],
        sidecar_command: list[str],
        health_url: str,
        policy: SupervisePolicy,
        startup_timeout_s: float,
        cwd: Path | None = None,
        sidecar_env: Mapping[str, str] | None = None,
    ) -> None:
        self.new_triton, self.sidecar_command = new_triton, sidecar_command
        self.sidecar_env = sidecar_env
        self.health_url, self.policy, self.startup_timeout_s = health_url, policy, startup_timeout_s
        self.cwd = cwd
        self.triton: TritonServer | None = None
        self.sidecar: subprocess.Popen | None = None
        self.stopping = False  # set by stop(): run() returns, restart() starts nothing
        self.backoff = {
            name: Backoff(policy.backoff_initial_s, policy.backoff_max_s, policy.backoff_reset_s)
            for name in ("tritonserver", "sidecar")
        }

    # --- starting -------------------------------------------------------------------------

    def start_triton(self) -> None:
        """Start tritonserver and wait until it is ready. Raises: RuntimeError (see
        ``TritonServer.start``)."""
        self.triton = self.new_triton()
        self.triton.start(timeout=self.startup_timeout_s)
        assert self.triton.process is not None  # start() returns with the server running
        log(f"tritonserver pid {self.triton.process.pid}, log {self.triton.log_path}")

    def start_sidecar(self) -> None:
        """Start the sidecar (its own process group)."""
        self.sidecar = start_process_group(self.sidecar_command, env=self.sidecar_env, cwd=self.cwd)
        log(f"sidecar pid {self.sidecar.pid}")

    def wait_healthy(self) -> None:
        """Wait until ``/health`` answers 200. Raises: RuntimeError when a process exited or
        ``startup_timeout_s`` passed."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            dead = self._dead_process()
            if dead is not None:
                raise RuntimeError(f"{dead[0]} {dead[1]}")
            if check_health(self.health_url, 5.0).ok:
                return
            time.sleep(0.25)
        raise RuntimeError(f"not healthy after {self.startup_timeout_s:.0f} s ({self.health_url})")

    def start(self) -> None:
        """Start both and wait until the service is healthy. Raises: RuntimeError."""
        self.start_triton()
        self.start_sidecar()
        self.wait_healthy()

    # --- watching -------------------------------------------------------------------------

    def _dead_process(self) -> tuple[str, str] | None:
        process = self.triton.process if self.triton is not None else None
        if process is not None and process.poll() is not None:
            return "tritonserver", f"exited with code {process.returncode}"
        if self.sidecar is not None and self.sidecar.poll() is not None:
            return "sidecar", f"exited with code {self.sidecar.returncode}"
        return None

    def run(self) -> int:
        """Watch until a failure the policy does not restart (returns 1), or until ``stop()``
        (from another thread; returns 0). The launcher leaves it through the exception its
        signal handlers raise."""
        policy = self.policy
        last_ok = next_check = time.monotonic()
        # The first backend_failed answer not yet cleared, and the latest: a failure clears
        # only after failed_timeout_s without one (QA: with one of two generator stubs stopped,
        # /health alternated between 200 and backend_failed, as the probes landed on either).
        failed_since: float | None = None
        failed_at = 0.0
        while not self.stopping:
            time.sleep(0.2)
            now = time.monotonic()
            failure = self._dead_process()
            if failure is None and now >= next_check:
                next_check = now + policy.health_interval_s
                answer = check_health(self.health_url, policy.health_answer_timeout_s)
                if answer.backend_failed:
                    failed_since, failed_at = failed_since or now, now
                elif now - failed_at >= policy.failed_timeout_s:
                    failed_since = None
                if answer.ok:
                    last_ok = now
                    for backoff in self.backoff.values():
                        backoff.healthy(now)
                elif failed_since is not None and now - failed_since >= policy.failed_timeout_s:
                    what = f"failed for {now - failed_since:.0f} s: {answer.reason}"
                    failure = "tritonserver", what
                elif now - last_ok >= policy.unhealthy_timeout_s:
                    # 503: the sidecar answers and says the backend is broken; no answer at
                    # all: the sidecar itself is wedged.
                    culprit = "tritonserver" if answer.status is not None else "sidecar"
                    failure = culprit, f"unhealthy for {now - last_ok:.0f} s: {answer.reason}"
            if failure is None:
                continue
            name, what = failure
            log(f"{name} {what}")
            if policy.on_failure == "exit":
                return 1
            self.restart(name)
            last_ok = next_check = time.monotonic()
            failed_since = None
        return 0

    def restart(self, name: str) -> None:
        """Stop ``name`` (``"tritonserver"`` or ``"sidecar"``), wait its backoff, start it again
        and wait for health; a start that fails is logged, and the next check sees it."""
        delay = self.backoff[name].next_delay()
        if name == "tritonserver":
            if self.triton is not None:
                # Short: a broken server's shutdown would wait out --exit-timeout-secs (30 s)
                # for requests in flight that its dead stub never ends.
                self.triton.stop(timeout=FAILED_STOP_TIMEOUT_S)
        else:
            _stop_sidecar(self.sidecar, graceful=False)
        log(f"restarting {name} in {delay:.1f} s (restart {self.backoff[name].restarts})")
        time.sleep(delay)
        if self.stopping:
            return
        try:
            if name == "tritonserver":
                self.start_triton()
            else:
                self.start_sidecar()
            self.wait_healthy()
            log(f"{name} restarted; healthy")
        except RuntimeError as exc:
            log(f"{name} restart failed: {exc}")

    # --- stopping -------------------------------------------------------------------------

    def stop(self, graceful: bool) -> None:
        """Stop the sidecar (draining it first when ``graceful``), then tritonserver with its
        stubs; no process of either is left."""
        self.stopping = True
        _stop_sidecar(self.sidecar, graceful, self.policy.drain_timeout_s)
        if self.triton is not None:
            self.triton.stop()


def _stop_sidecar(process: subprocess.Popen | None, graceful: bool, drain_s: float = 0.0) -> None:
    """SIGTERM (drain) or SIGINT (abort what is in flight) to the sidecar's group, then
    ``stop_process_group`` for whatever is left after the drain (SIGTERM, then SIGKILL)."""
    if process is None or process.poll() is not None:
        stop_process_group(process, 2.0)
        return
    try:
        os.killpg(process.pid, signal.SIGTERM if graceful else signal.SIGINT)
    except ProcessLookupError:
        pass
    try:
        # The sidecar aborts what is left when its drain times out; 15 s more for its shutdown.
        process.wait((drain_s if graceful else 0.0) + 15.0)
    except subprocess.TimeoutExpired:
        pass
    stop_process_group(process, 5.0)
