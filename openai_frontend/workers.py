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
socket is shared. Each worker has its own gRPC channel, its own generator lease
(``TritonClient.lease``, random per process: a dead worker's generations are aborted, and only
its own), its own ``/health`` monitor and its own drain.

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

Metrics: the workers get a fresh ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's
multiprocess mode: ``metrics.py``'s ``/metrics`` sums every worker's files, whichever worker
answers); the parent marks an exited worker dead there (its live gauges go) and removes the
directory when it exits.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

# Connections a listening socket queues before its worker accepts them (uvicorn's default).
BACKLOG = 2048
# Seconds between two looks at the workers (how promptly a dead one is noticed).
POLL_S = 0.1
# Seconds the other workers get to stop (aborting their generations) after one died unasked,
# before they are SIGKILLed.
FAILED_STOP_TIMEOUT_S = 10.0
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


def worker_command(argv: Sequence[str], fd: int) -> list[str]:
    """A worker's command line: this sidecar's flags ``argv``, then ``--fd`` and ``--workers=1``
    (argparse keeps a flag's last value, so these two win over any in ``argv``)."""
    return [sys.executable, "-m", "openai_frontend", *argv, f"--fd={fd}", "--workers=1"]


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
    Attributes:
        workers: the started processes.
        stopping: a stop signal came, or a worker died: workers are expected to exit now.
        sent: the signals sent to the workers so far.
    """

    def __init__(
        self, argv: Sequence[str], sockets: Sequence[socket.socket], metrics_dir: str
    ) -> None:
        self.argv, self.sockets, self.metrics_dir = list(argv), list(sockets), metrics_dir
        self.workers: list[subprocess.Popen] = []
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
            for sock in self.sockets:
                worker = subprocess.Popen(
                    worker_command(self.argv, sock.fileno()),
                    pass_fds=(sock.fileno(),),
                    env=env,
                    start_new_session=True,
                    preexec_fn=lambda: _in_worker(parent, prctl),
                )
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
        """Wait until every worker has exited; stop the others as soon as one exits unasked.

        Returns:
            0 when every worker exited after a stop signal, with status 0 or by that signal;
            else 1.
        """
        exited: set[int] = set()
        failed = False
        kill_at = math.inf
        while True:
            for worker in self.workers:
                if worker.pid in exited or worker.poll() is None:
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
                log.error(
                    "worker %d exited with %s unasked: stopping the others", worker.pid, status
                )
                self.stopping = True
                self.signal(signal.SIGINT)
                kill_at = time.monotonic() + FAILED_STOP_TIMEOUT_S
            if len(exited) == len(self.workers):
                return 1 if failed else 0
            if time.monotonic() >= kill_at:
                self.signal(signal.SIGKILL)
            time.sleep(POLL_S)

    def kill(self) -> None:
        """SIGKILL and reap the workers still running (cleanup after an error)."""
        self.signal(signal.SIGKILL)
        for worker in self.workers:
            worker.wait()


def serve(argv: Sequence[str], sockets: Sequence[socket.socket]) -> int:
    """Run one worker of the sidecar started with flags ``argv`` per listening socket of
    ``sockets`` (``listening_sockets``) until they have all exited; returns
    ``WorkerPool.wait``'s status.

    Raises:
        OSError: a worker could not be started (the ones started are killed first).
    """
    metrics_dir = tempfile.mkdtemp(prefix="openai_frontend-metrics-")
    pool = WorkerPool(argv, sockets, metrics_dir)
    try:
        pool.start()
        return pool.wait()
    finally:
        pool.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
