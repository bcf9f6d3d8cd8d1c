"""Several sidecar processes on one port: ``python -m openai_frontend --workers N``.

One asyncio process relays every streamed chunk of every client (Triton's gRPC stream in, JSON
and SSE out), so under many concurrent streams its one core limits the serving path. The
sidecar keeps no per-client state (``drain.py``), so it scales out to processes.

This process, the parent, binds ``--host``:``--port`` and starts N workers, then serves nothing
itself. Each worker is a plain one-worker sidecar (``python -m openai_frontend <the same flags>
--fd=FD --workers=1``) serving the listening socket it inherits. On Linux each worker gets a
socket of its own, all of them bound to the one address with ``SO_REUSEPORT`` (after a plain
bind of the address, so that a port in use fails as it does for one worker), and the kernel
spreads new connections evenly over them; one socket shared by every worker would give a burst
of connections mostly to whichever worker wakes first, and connections stay with the worker
that accepted them (``listening_sockets``). Elsewhere, and for an inherited ``--fd``, the one
socket is shared. Each worker has its own gRPC channel, its own generator lease (a random id
the parent chose, ``--generator-lease``: a dead worker's generations are aborted, and only its
own), its own ``/health`` monitor and its own drain.

Signals: SIGTERM and SIGINT sent to the parent are forwarded, each time, to every worker, which
then does what a one-worker sidecar does (the first SIGTERM drains, SIGINT or a second SIGTERM
stops at once). The workers run in sessions of their own, so that a signal to the parent's
process group (a terminal's Ctrl-C, the launcher's ``killpg``) reaches each of them once,
through the parent. The parent exits once every worker has: 0 when all exited 0 after a stop
signal (or by that signal: uvicorn ends a stop that SIGINT asked for by raising it again), else
1. A worker that exits unasked (killed, crashed, failed to start) makes the parent stop the
others at once (SIGINT: their generations are aborted; SIGKILL after
``FAILED_STOP_TIMEOUT_S``) and exit 1, so that the launcher's supervisor restarts the whole
sidecar as it restarts a one-process one. Linux kills the workers with the parent
(``PR_SET_PDEATHSIG``): a SIGKILLed parent leaves no worker holding the port, and their closed
lease streams abort their generations.

Hangs: a worker that stops without exiting (a blocked event loop, SIGSTOP) would keep being
given its share of new connections while the launcher's ``/health`` probes reach the others.
So each worker proves its event loop runs: a task of its own (``send_heartbeats``, started by
the app's lifespan) writes a byte every ``HEARTBEAT_INTERVAL_S`` to a pipe inherited from the
parent (``--heartbeat-fd``), off the request path. A worker silent for ``--worker-timeout``
seconds (``WORKER_STARTUP_TIMEOUT_S`` for its first beat, which follows the imports) is
SIGKILLed and treated as one that exited unasked: the others are stopped and the parent exits
1. A pipe, not a file: no clock or file system in the check, and nothing to clean up. A worker
stalled for more than a second has no lease request open in the generator, so its death does
not end its lease (the generator would after a 30 s grace): the parent ends it
(``TritonClient.end_lease``), and the killed worker's generations are aborted at once.

Metrics: the workers get a fresh ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's
multiprocess mode: ``metrics.py``'s ``/metrics`` sums every worker's files, whichever worker
answers); the parent marks an exited worker dead there (its live gauges go) and removes the
directory when it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead

from .metrics import MULTIPROC_DIR_ENV
from .triton_client import TritonClient, new_lease

log = logging.getLogger(__name__)

# Connections a listening socket queues before its worker accepts them (uvicorn's default).
BACKLOG = 2048
# Seconds between two looks at the workers (how promptly a dead one is noticed).
POLL_S = 0.1
# Seconds the other workers get to stop (aborting their generations) after one died unasked,
# before they are SIGKILLed.
FAILED_STOP_TIMEOUT_S = 10.0
# Seconds between two heartbeats of a worker's event loop.
HEARTBEAT_INTERVAL_S = 1.0
# Seconds a worker may take from its start to its first heartbeat: the interpreter and the
# imports (far longer on a cold disk cache than on a warm one) and the app's start.
WORKER_STARTUP_TIMEOUT_S = 120.0
# Seconds a worker may go without a heartbeat (``--worker-timeout``'s default).
DEFAULT_WORKER_TIMEOUT_S = 10.0
# Seconds the parent waits for the generator to take over (and end) a killed worker's lease.
END_LEASE_TIMEOUT_S = 5.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening TCP socket per worker on ``host``:``port`` (IPv6 when ``host`` has a
    colon, as uvicorn binds; port 0: one the system chooses, the same for all).

    On Linux, ``count`` sockets in one ``SO_REUSEPORT`` group: the kernel gives each new
    connection to one of them by a hash of its addresses, so connections spread evenly over
    the workers. A single shared socket goes to whichever worker wakes first and accepts every
    pending connection (asyncio's accept loop): on a 2-core machine a burst of 24 connections
    to two idle workers often landed 23 or 24 to one. Elsewhere ``SO_REUSEPORT`` does not
    balance, and the list holds one shared socket ``count`` times.

    The address is bound once without ``SO_REUSEPORT`` first, so that a port in use by any
    socket, another sidecar's ``SO_REUSEPORT`` group included, fails here.

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, port), family=family) as probe:
        port = probe.getsockname()[1]
    if not sys.platform.startswith("linux"):
        return [socket.create_server((host, port), family=family, backlog=BACKLOG)] * count
    return [
        socket.create_server((host, port), family=family, backlog=BACKLOG, reuse_port=True)
        for _ in range(count)
    ]


def worker_command(argv: Sequence[str], fd: int, heartbeat_fd: int, lease: str) -> list[str]:
    """A worker's command line: this sidecar's flags ``argv``, then ``--fd``,
    ``--heartbeat-fd``, ``--generator-lease`` and ``--workers=1`` (argparse keeps a flag's last
    value, so these win over any in ``argv``)."""
    own = [f"--fd={fd}", f"--heartbeat-fd={heartbeat_fd}", f"--generator-lease={lease}"]
    return [sys.executable, "-m", "openai_frontend", *argv, *own, "--workers=1"]


def end_lease(triton_url: str, secret: str | None, lease: str) -> bool:
    """End generator lease ``lease`` now, from outside any event loop (the parent's):
    ``TritonClient.end_lease`` within ``END_LEASE_TIMEOUT_S``; True when it was ended."""

    async def end() -> bool:
        client = TritonClient(triton_url, secret=secret, lease=lease)
        try:
            return await client.end_lease(END_LEASE_TIMEOUT_S)
        finally:
            await client.close()

    return asyncio.run(end())


async def send_heartbeats(fd: int) -> None:
    """Runs in a worker, as a task of its event loop, until cancelled: write one byte to ``fd``
    (the write end of its heartbeat pipe) every ``HEARTBEAT_INTERVAL_S`` seconds. Never blocks
    the loop: a full pipe (a parent that stopped reading) drops the beat, and a closed one (a
    dead parent, whose death kills this worker too) is ignored."""
    os.set_blocking(fd, False)
    while True:
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(fd, b".")
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


class Heartbeat:
    """The parent's end of one worker's heartbeat pipe: how long the worker's event loop has
    been silent.

    Args:
        fd: the read end of the pipe (made non-blocking; ``close`` closes it).
        timeout_s: seconds the worker may go without a beat.
        first_s: seconds the first beat may take from now (the worker's startup).
    Attributes:
        last: ``time.monotonic()`` of the last beat read (at first: of the start).
    """

    def __init__(self, fd: int, timeout_s: float, first_s: float) -> None:
        os.set_blocking(fd, False)
        self.fd, self.timeout_s, self._allowed_s = fd, timeout_s, first_s
        self.last = time.monotonic()

    def silent_s(self) -> float | None:
        """Read the beats that arrived; then the seconds since the last one when that is more
        than the worker may take, else None. Reading first: a parent that was itself slow to
        look still sees the beats sent meanwhile."""
        now = time.monotonic()
        with contextlib.suppress(BlockingIOError):
            if os.read(self.fd, 4096):  # b"": the worker exited (its exit status tells)
                self.last, self._allowed_s = now, self.timeout_s
        silent = now - self.last
        return silent if silent > self._allowed_s else None

    def close(self) -> None:
        os.close(self.fd)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _in_worker(parent_pid: int, prctl: Callable[..., int] | None) -> None:
    """Runs in a worker between fork and exec: take the stop signals again (blocked in the
    parent while it starts workers, and a blocked mask survives exec), and die with the parent
    (``prctl`` resolved beforehand, in the parent)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _exit_status(returncode: int) -> str:
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


class WorkerPool:
    """The worker processes of one sidecar (module doc).

    Args:
        argv: the sidecar's flags (``worker_command`` adds each worker's own).
        sockets: one listening socket per worker (``listening_sockets``; one socket may be
            there several times: shared).
        metrics_dir: the workers' ``PROMETHEUS_MULTIPROC_DIR`` (an empty directory).
        timeout_s: seconds a worker may go without a heartbeat before it is SIGKILLed
            (``WORKER_STARTUP_TIMEOUT_S``, or this when more, for the first one).
        end_lease: ends a generator lease at once (``end_lease`` with the sidecar's Triton);
            called with the lease of a worker SIGKILLed for its silence. None: not ended here
            (the generator ends it after its grace).
    Attributes:
        workers: the started processes.
        heartbeats, leases: each worker's ``Heartbeat`` and generator lease id, in the order
            of ``workers``.
        stopping: a stop signal came, or a worker died: workers are expected to exit now.
        sent: the signals sent to the workers so far.
    """

    def __init__(
        self,
        argv: Sequence[str],
        sockets: Sequence[socket.socket],
        metrics_dir: str,
        timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
        end_lease: Callable[[str], bool] | None = None,
    ) -> None:
        self.argv, self.sockets, self.metrics_dir = list(argv), list(sockets), metrics_dir
        self.timeout_s, self.end_lease = timeout_s, end_lease
        self.workers: list[subprocess.Popen] = []
        self.heartbeats: list[Heartbeat] = []
        self.leases = [new_lease() for _ in self.sockets]
        self.stopping = False
        self.sent: set[int] = set()

    def start(self) -> None:
        """Start the workers, close this process' copies of their sockets, and forward
        SIGTERM and SIGINT to the workers from now on. The two signals are blocked meanwhile:
        one that arrives while they start is forwarded to all of them once they are.

        Raises:
            OSError: a worker could not be started.
        """
        env = {**os.environ, MULTIPROC_DIR_ENV: self.metrics_dir}
        prctl, parent = _prctl(), os.getpid()
        saved = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            first_s = max(self.timeout_s, WORKER_STARTUP_TIMEOUT_S)
            for sock, lease in zip(self.sockets, self.leases, strict=True):
                read_fd, write_fd = os.pipe()  # both close-on-exec: no other worker gets one
                self.heartbeats.append(Heartbeat(read_fd, self.timeout_s, first_s))
                try:
                    worker = subprocess.Popen(
                        worker_command(self.argv, sock.fileno(), write_fd, lease),
                        pass_fds=(sock.fileno(), write_fd),
                        env=env,
                        start_new_session=True,
                        preexec_fn=lambda: _in_worker(parent, prctl),
                    )
                finally:
                    os.close(write_fd)  # the worker's alone: its death ends the pipe
                self.workers.append(worker)
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._forward)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, saved)
            # A socket of an SO_REUSEPORT group stays in it, and is given connections, while
            # any process holds it: only its worker may.
            for sock in self.sockets:
                sock.close()
        log.info("workers %s", ", ".join(str(w.pid) for w in self.workers))

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        self.signal(signum)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every worker still running."""
        self.sent.add(signum)
        for worker in self.workers:
            if worker.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.send_signal(signum)

    def wait(self) -> int:
        """Wait until every worker has exited; stop the others as soon as one exits unasked,
        or has sent no heartbeat for ``timeout_s`` (then it is SIGKILLed first, and its lease
        ended: ``end_lease``).

        Returns:
            0 when every worker exited after a stop signal, with status 0 or by that signal;
            else 1.
        """
        exited: set[int] = set()
        killed: set[int] = set()  # SIGKILLed here for their silence
        failed = False
        kill_at = math.inf
        while True:
            for worker, heartbeat, lease in zip(
                self.workers, self.heartbeats, self.leases, strict=True
            ):
                if worker.pid in exited:
                    continue
                if worker.poll() is None:
                    silent_s = None if worker.pid in killed else heartbeat.silent_s()
                    if silent_s is None:
                        continue
                    # Its exit, by SIGKILL, is then seen as a failure (the pool's status 1).
                    killed.add(worker.pid)
                    with contextlib.suppress(ProcessLookupError):
                        worker.kill()
                    log.error("worker %d did not answer for %.0f s: killed", worker.pid, silent_s)
                    if not self.stopping:
                        kill_at = self._stop_others()
                    # It had no lease request open (stalled for more than the second after
                    # which the generator answers one), so its death does not end its lease.
                    if self.end_lease is not None and self.end_lease(lease):
                        log.error("worker %d's lease ended: its generations abort", worker.pid)
                    continue
                exited.add(worker.pid)
                mark_process_dead(worker.pid, self.metrics_dir)
                code = worker.returncode
                if self.stopping and (code == 0 or -code in self.sent & set(STOP_SIGNALS)):
                    continue
                failed = True
                status = _exit_status(code)
                if self.stopping:
                    log.error("worker %d exited with %s", worker.pid, status)
                    continue
                log.error("worker %d exited with %s unasked", worker.pid, status)
                kill_at = self._stop_others()
            if len(exited) == len(self.workers):
                return 1 if failed else 0
            if time.monotonic() >= kill_at:
                self.signal(signal.SIGKILL)
            time.sleep(POLL_S)

    def _stop_others(self) -> float:
        """A worker failed: stop the others (SIGINT: they abort their generations); returns
        when to SIGKILL those still running (``time.monotonic()``)."""
        log.error("stopping the other workers")
        self.stopping = True
        self.signal(signal.SIGINT)
        return time.monotonic() + FAILED_STOP_TIMEOUT_S

    def kill(self) -> None:
        """SIGKILL and reap the workers still running, and close the heartbeat pipes (cleanup
        after an error, or after ``wait``)."""
        self.signal(signal.SIGKILL)
        for worker in self.workers:
            worker.wait()
        for heartbeat in self.heartbeats:
            heartbeat.close()
        self.heartbeats.clear()


def serve(
    argv: Sequence[str],
    sockets: Sequence[socket.socket],
    timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
    end_lease: Callable[[str], bool] | None = None,
) -> int:
    """Run one worker of the sidecar started with flags ``argv`` per listening socket of
    ``sockets`` (``listening_sockets``) until they have all exited, SIGKILLing one silent for
    ``timeout_s`` seconds and ending its lease with ``end_lease`` (``WorkerPool``); returns
    ``WorkerPool.wait``'s status.

    Raises:
        OSError: a worker could not be started (the ones started are killed first).
    """
    metrics_dir = tempfile.mkdtemp(prefix="openai_frontend-metrics-")
    pool = WorkerPool(argv, sockets, metrics_dir, timeout_s, end_lease)
    try:
        pool.start()
        return pool.wait()
    finally:
        pool.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
