"""`EngineProcess`: runs an `LLMEngine` in a child process for the Triton generator.

A drop-in for `EngineThread` that gives the engine loop a GIL of its own. Inside the
generator's Python stub the engine thread shares one GIL with the response sender thread and
the stub's threads; on an H200 at concurrency 256 that made the engine host-bound
(ARCHITECTURE.md, "Platform facts"). vLLM (its engine-core process) and SGLang (its scheduler
process) run the engine loop in its own process for the same reason.

    parent (Triton stub)                              child (spawned)
    submit / abort ──── command pipe ────▶  loop: admit, abort, engine.step()
    receiver thread ◀── result pipe ─────  one message per step: outputs, EngineStats, LoopTimes
      └▶ CallbackTable.deliver → callbacks

The child's side is `engine.engine_child`, the messages between the two
`engine.process_messages` (one pickled message per step, its outputs as plain tuples).

Lifetime: the child never outlives the parent. It exits on end-of-file of its command pipe
(the parent closed it, or died), and on Linux the kernel kills it when the parent's receiver
thread, which started it, exits (`PR_SET_PDEATHSIG`), so a SIGKILLed Triton stub takes its
engine with it even mid-step. A child that dies on its own fails every request in flight with
finish_reason "error"; later submits raise RuntimeError.

Tensor parallelism (`tensor_parallel_size` > 1): the child is rank 0, and ranks 1..N-1 are
spawned beside it from the same receiver thread (`engine.rank_processes`). Any rank's death
ends the engine: the others are killed and the requests in flight fail as above.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Client, Connection

from tritonllm.config import EngineConfig
from tritonllm.contract.errors import ErrorCode
from tritonllm.engine.client import EngineClient, LoopTimes, OutputCallback
from tritonllm.engine.engine_child import ListenAddress, engine_main
from tritonllm.engine.engine_thread import CallbackTable
from tritonllm.engine.process_messages import (
    ABORT,
    CLIENTS,
    FAILED,
    FORWARD,
    STOP,
    SUBMIT,
    decode_message,
)
from tritonllm.engine.rank_processes import WorkerRanks
from tritonllm.engine.request_limits import RequestLimits
from tritonllm.engine.stats import EngineStats
from tritonllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Seconds a child that closed its result pipe gets to exit before the kernel kills it.
EXIT_GRACE_S = 10.0


def python_executable() -> str:
    """A Python interpreter to spawn the child with.

    Inside Triton's Python stub `sys.executable` may be the stub binary (it embeds Python):
    use it only when it is a `python*` executable, else `<sys.exec_prefix>/bin/python3`, else
    `sys._base_executable`. The child gets the parent's `sys.path` from multiprocessing, so a
    base interpreter still imports the virtualenv's packages.

    Raises:
        RuntimeError: none of them is an executable Python.
    """
    candidates = (
        sys.executable,
        os.path.join(sys.exec_prefix, "bin", "python3"),
        getattr(sys, "_base_executable", ""),
    )
    for path in candidates:
        if path and os.path.basename(path).startswith("python") and os.access(path, os.X_OK):
            return path
    raise RuntimeError(f"no Python interpreter to start the engine process (tried {candidates})")


ControlHandler = Callable[[object], None]


class _EngineFront(abc.ABC):
    """The parent side of an engine child, over a command connection and a result connection
    (the two pipes of `EngineProcess`, or one socket of `EngineConnection`): submits and aborts
    go down, step messages come up on a receiver thread that routes each output to its
    request's callback and each control message to `on_control`.

    Attributes:
        on_control: called on the receiver thread with the payload of each control message (a
            sibling instance's `broadcast`, see `process_messages`); None: they are dropped.
            It must not block; it may call `submit` and `abort`.
        num_clients: the clients a shared engine serves, as it last announced (None: not
            announced yet, or not shared).
        live_limit: the most choices (sequences) live in a shared engine, all clients'
            requests together (a request of n choices counts n): a
            submit beyond it ends at once with one "error" output whose `error_code` is
            `server_overloaded` (None: no limit; an engine of one client ignores it).
    """

    def __init__(self, stall_timeout_s: float | None) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.on_control: ControlHandler | None = None
        self.num_clients: int | None = None
        self.live_limit: int | None = None
        # Last sign of progress: a step message, or a submit that found nothing in flight.
        self._last_progress = time.monotonic()
        self._routes = CallbackTable()
        self._lock = threading.Lock()  # guards _running / _closed
        self._send_lock = threading.Lock()  # one writer of the command pipe at a time
        self._running = False  # ready and neither shut down nor dead
        self._closed = False  # the command pipe is closed
        self._deferred: list[tuple] = []  # commands posted on the receiver thread
        self._commands: Connection
        self._results: Connection
        self._receiver: threading.Thread
        # Both are set by the handshake, before the constructor returns.
        self._limits: RequestLimits
        self._stats: EngineStats
        self._times = LoopTimes()

    # ---- EngineClient ----------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        callback: OutputCallback,
    ) -> None:
        """Send a request to the engine; `callback(RequestOutput)` is called from the receiver
        thread for each output, the last one with `request_finished=True`.

        Raises:
            RequestError: invalid request (`RequestLimits.check`, the checks of
                `LLMEngine.check_request`).
            ValueError: a request id that is still in flight.
            RuntimeError: after `shutdown()` or once the engine process died.
        """
        self._limits.check(prompt_ids, params)
        with self._lock:
            if not self._running:
                raise RuntimeError(self._not_running())
            if not len(self._routes):  # the engine was idle: its silence so far was no stall
                self._last_progress = time.monotonic()
            self._routes.add(request_id, callback, len(prompt_ids))
        try:
            self._post((SUBMIT, request_id, list(prompt_ids), params, self.live_limit))
        except OSError as exc:
            # The child is gone. If the receiver already failed the request through its
            # callback, that was its one answer; otherwise this exception is.
            if self._routes.discard(request_id):
                raise RuntimeError(f"{self._not_running()}: {exc}") from None

    def abort(self, request_id: str) -> None:
        """Abort a request between steps; its callback gets a final "abort" output. Unknown or
        finished ids are ignored, and so are aborts after shutdown or the child's death."""
        try:
            self._post((ABORT, request_id))
        except OSError:
            pass  # the child is gone; its death fails every request in flight

    def broadcast(self, payload: object) -> None:
        """Have the engine hand `payload` (picklable) to the `on_control` of every other
        client of a shared engine (none: nothing happens). Ignored once the engine is gone."""
        with contextlib.suppress(OSError):
            self._post((FORWARD, payload))

    def stats(self) -> EngineStats:
        """The engine stats as of the end of the child's last step."""
        return self._stats

    def loop_times(self) -> LoopTimes:
        """The child's engine-loop time counters as of its last step (see the class doc)."""
        return self._times

    def _progressing(self) -> bool:
        """Not stalled (see `stall_timeout_s`)."""
        stall = self.stall_timeout_s
        silent = time.monotonic() - self._last_progress
        return stall is None or not len(self._routes) or silent <= stall

    @abc.abstractmethod
    def _not_running(self) -> str:
        """Why the engine takes no request now (the `RuntimeError` message of `submit`)."""

    # ---- transport ---------------------------------------------------------------------------
    def _post(self, command: tuple) -> None:
        """Write one command to the child. On the receiver thread it is deferred (see
        `_flush_deferred`): blocking there on a full command pipe while the child blocks on a
        full result pipe would deadlock.

        Raises:
            OSError: the pipe is closed or the child is gone.
        """
        if threading.current_thread() is self._receiver:
            self._deferred.append(command)
            return
        with self._send_lock:
            if self._closed:
                raise BrokenPipeError("the engine process is shut down")
            self._commands.send([command])

    def _flush_deferred(self) -> None:
        """Send the commands posted on the receiver thread, unless another thread is writing
        (the receiver then keeps draining results and retries)."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            commands, self._deferred = self._deferred, []
            if not self._closed:
                self._commands.send(commands)
        except OSError:
            pass  # the child is gone
        finally:
            self._send_lock.release()

    def _close_commands(self, timeout: float | None, close: bool = True) -> None:
        """Send a stop command (once) and, with `close`, close the command connection."""
        if self._send_lock.acquire(timeout=-1 if timeout is None else timeout):
            try:
                if not self._closed:
                    try:
                        self._commands.send([(STOP,)])
                    except OSError:
                        pass
                    self._closed = True
                    if close:
                        self._commands.close()  # end-of-file: the child exits even mid-start-up
            finally:
                self._send_lock.release()

    def _deliver_results(self) -> None:
        results = self._results
        while True:
            if self._deferred:
                self._flush_deferred()
                if self._deferred and not results.poll(0.01):
                    continue
            try:
                data = results.recv_bytes()
            except (EOFError, OSError):
                return
            message = decode_message(data)
            if len(message) == 2:
                payload = message[1]
                if isinstance(payload, tuple) and payload[:1] == (CLIENTS,):
                    self.num_clients = payload[1]
                    continue
                handler = self.on_control
                if handler is not None:
                    try:
                        handler(payload)
                    except Exception:
                        logger.exception("control message handler failed")
                continue
            outputs, self._stats, self._times = message
            self._last_progress = time.monotonic()
            for out in outputs:
                self._routes.deliver(out)

    def _accept_ready(self, message: tuple) -> None:
        """Take the child's READY message: the engine serves."""
        _, self._limits, self._stats = message
        with self._lock:
            self._running = True

    def _fail_in_flight(self, message: str) -> None:
        """The engine is gone: every request in flight ends with `message` (finish_reason
        "error", code ``engine_unavailable``: the sidecar's 503), and the stats show no
        request and no used page."""
        with self._lock:
            unexpected, self._running = self._running, False
        if not unexpected:
            return  # shut down: requests in flight get no further outputs
        if len(self._routes):  # (a shared engine's other clients see it end at unload)
            logger.error("%s; failing %d requests in flight", message, len(self._routes))
        # Its requests and pages are gone with it.
        self._stats = dataclasses.replace(
            self._stats,
            num_running=0,
            num_waiting=0,
            free_pages=self._stats.total_pages,
            used_pages=0,
            cached_pages=0,
            evictable_pages=0,
        )
        self._routes.fail_all(message, ErrorCode.ENGINE_UNAVAILABLE)


class EngineProcess(_EngineFront, EngineClient):
    """An `LLMEngine` in a spawned child process (`EngineClient`, like `EngineThread`).

    The constructor returns once the child has built its engine (model load, KV pool, CUDA
    graph capture). Outputs are delivered by calling each request's callback from one thread of
    this process (the receiver thread), exactly as `EngineThread` does from its thread: a
    request's outputs in order (every choice's, by `index`), the last with `request_finished`.
    Callbacks must not block; they may call `submit` and `abort`.

    `stats()` and `loop_times()` are the child's snapshots as of its last step; in
    `LoopTimes`, `busy_s`/`cpu_s` are the child's engine loop and `callback_s` is the time it
    spent encoding and sending step messages.

    Args:
        config: the engine's configuration (picklable; the child builds `LLMEngine(config)`).
        name: the child process' name (and its receiver thread's, with "-receiver").
        start_timeout: most seconds to wait for the engine to be built (None: no limit; a
            child that dies while building is noticed either way).
        stall_timeout_s: `is_alive()` turns False while requests are in flight and the child
            has sent no step for this many seconds (a hung engine; it turns True again if the
            child resumes). None: never. The default stays above a fresh GPU machine's
            first-request kernel compilation (ARCHITECTURE.md, "Platform facts", FlashInfer).
        listen: share the engine: the child also serves every `EngineConnection` made to
            `self.listen_address` (Linux: an abstract `AF_UNIX` address, authenticated with a
            random key), e.g. the other instances of a generator (`serving.shared_engine`).
        server_pid: the pid of the server this process serves (a Triton stub: tritonserver,
            its parent). Once this process is orphaned (the server died) and has not exited
            `engine_child.ORPHANED_PARENT_GRACE_S` later, the child kills it, and so ends the
            engine and its ranks. None: no such watch.
    Raises:
        RuntimeError: the engine could not be built (the message carries the child's error
            and traceback), the child died or was not ready within `start_timeout`.
    """

    def __init__(
        self,
        config: EngineConfig,
        name: str = "tritonllm-engine",
        start_timeout: float | None = None,
        stall_timeout_s: float | None = 300.0,
        listen: bool = False,
        server_pid: int | None = None,
    ) -> None:
        super().__init__(stall_timeout_s)
        self.config = config
        self.listen_address: ListenAddress | None = None
        if listen:
            address = f"\0tritonllm-engine-{os.getpid()}-{secrets.token_hex(8)}"
            self.listen_address = ListenAddress(address, secrets.token_bytes(32))
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        ctx.set_executable(python_executable())
        child_commands, self._commands = ctx.Pipe(duplex=False)
        self._results, child_results = ctx.Pipe(duplex=False)
        tp = config.tensor_parallel_size > 1
        self._ranks = WorkerRanks(ctx, config, os.getpid()) if tp else None
        rank0 = self._ranks.rank0 if self._ranks else None
        self._process = ctx.Process(
            target=engine_main,
            args=(
                config,
                child_commands,
                child_results,
                os.getpid(),
                rank0,
                self.listen_address,
                server_pid,
            ),
            name=name,
            daemon=True,
        )
        self._ready = threading.Event()
        self._start_error: str | None = None
        # The receiver thread starts the child: PR_SET_PDEATHSIG fires when the thread that
        # created the child exits, and this thread lives exactly as long as the child matters.
        self._receiver = threading.Thread(
            target=self._receive,
            args=(child_commands, child_results),
            name=f"{name}-receiver",
            daemon=True,
        )
        self._receiver.start()
        # Before multiprocessing's own exit hook, which would wait for the child forever.
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        if not self._ready.wait(start_timeout):
            self._start_error = f"engine process not ready after {start_timeout} s"
        if self._start_error is not None:
            self._stop_child(timeout=5.0)
            raise RuntimeError(self._start_error)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the child (requests in flight get no further outputs; so do those of the
        clients connected to a shared engine) and reap it: a stop command, then SIGKILL after
        `timeout` seconds. Also runs at interpreter exit."""
        with self._lock:
            self._running = False
        self._stop_child(timeout)

    def is_alive(self) -> bool:
        """Whether the engine serves: ready, not shut down, its process (every rank's) running,
        and not stalled (see `stall_timeout_s`)."""
        if not (self._running and self._process.is_alive()):
            return False
        if self._ranks and not self._ranks.alive():
            return False
        return self._progressing()

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._process.pid

    # ---- parent internals ------------------------------------------------------------------
    def _not_running(self) -> str:
        dead = self._ranks and self._ranks.dead_rank
        if dead or self._process.exitcode not in (None, 0):
            return f"the engine process died ({self._exit_cause()})"
        return "the engine process is shut down"

    def _exit_cause(self) -> str:
        """Why the engine ended: rank 0's exit, or the rank 1..N-1 whose exit ended it."""
        dead = self._ranks and self._ranks.dead_rank
        if dead:
            return f"tensor-parallel rank {dead[0]}: {_describe_exit(dead[1])}"
        return _describe_exit(self._process.exitcode)

    def _stop_child(self, timeout: float | None) -> None:
        self._close_commands(timeout)
        process = self._process
        if process.pid is not None:
            process.join(timeout)
            if process.exitcode is None:  # SIGTERM is ignored there (see `_engine_main`)
                process.kill()
                process.join(5.0)
        if self._ranks:
            self._ranks.stop(timeout)
        if threading.current_thread() is not self._receiver:
            self._receiver.join(timeout)

    def _receive(self, child_commands: Connection, child_results: Connection) -> None:
        """The receiver thread: starts the child, then delivers its step messages until it
        exits."""
        try:
            self._process.start()
            if self._ranks:  # watched: a rank's exit ends the engine unless it is stopping
                self._ranks.start(self._process, stopping=lambda: self._closed)
        except Exception as exc:
            self._start_error = f"could not start the engine process: {exc!r}"
            self._results.close()
            self._ready.set()
            return
        finally:
            # Only the child holds these ends now: its exit is our end-of-file.
            child_commands.close()
            child_results.close()
        if not self._handshake():
            return
        try:
            self._deliver_results()
        except Exception:  # a bug here; exiting this thread makes the kernel kill the child
            logger.exception("engine process receiver failed")
            self._process.kill()
        self._results.close()
        # The child closed its end: let it finish exiting (returning from this thread first
        # would have the kernel SIGKILL it, see PR_SET_PDEATHSIG), and so the other ranks.
        self._process.join(EXIT_GRACE_S)
        self._fail_in_flight(f"the engine process died ({self._exit_cause()})")
        if self._ranks:
            self._ranks.join(EXIT_GRACE_S)

    def _handshake(self) -> bool:
        """Wait for the child's first message; True when its engine is ready."""
        try:
            message = self._results.recv()
        except (EOFError, OSError):
            self._process.join(5.0)
            message = (
                FAILED,
                "the engine process exited before it was ready "
                f"({self._exit_cause()}; see its stderr)",
            )
        if message[0] == FAILED:
            self._start_error = f"engine failed to start: {message[1]}"
            self._results.close()
            self._ready.set()
            return False
        self._accept_ready(message)
        self._ready.set()
        return True


class EngineConnection(_EngineFront, EngineClient):
    """An `EngineClient` over a connection to a shared engine (`EngineProcess(listen=True)`,
    started by another process): what every generator instance but the one that started the
    engine uses. Its requests, outputs and callbacks behave as `EngineProcess`'s; the engine
    names them apart from other clients' requests, so ids need only be unique per connection.

    Args:
        listen: the engine's `EngineProcess.listen_address`.
        name: the receiver thread's name.
        stall_timeout_s: as `EngineProcess`'s.
    Raises:
        OSError: nothing listens at the address (`ConnectionRefusedError`,
            `FileNotFoundError`), or the engine closed the connection before it was ready.
        multiprocessing.AuthenticationError: the key is not the engine's.
    """

    def __init__(
        self,
        listen: ListenAddress,
        name: str = "tritonllm-engine-client",
        stall_timeout_s: float | None = 300.0,
    ) -> None:
        super().__init__(stall_timeout_s)
        conn = Client(listen.address, "AF_UNIX", authkey=listen.authkey)
        try:
            message = conn.recv()
        except EOFError:
            conn.close()
            raise ConnectionError("the shared engine closed the connection") from None
        self._commands = self._results = conn
        self._accept_ready(message)
        self._receiver = threading.Thread(target=self._receive, name=f"{name}-receiver")
        self._receiver.daemon = True
        self._receiver.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Close the connection: the engine aborts this client's requests in flight (they get
        no further outputs here)."""
        with self._lock:
            self._running = False
        # The engine answers the stop by closing its end: the receiver then reads end-of-file
        # (closing the connection under a reading thread would break its read instead).
        self._close_commands(timeout, close=False)
        if threading.current_thread() is not self._receiver:
            self._receiver.join(timeout)
        self._commands.close()

    def is_alive(self) -> bool:
        """Whether the engine serves this connection: connected, not shut down, not stalled."""
        return self._running and self._progressing()

    def _not_running(self) -> str:
        return "the shared engine process is gone or this connection is shut down"

    def _receive(self) -> None:
        try:
            self._deliver_results()
        except Exception:
            logger.exception("engine connection receiver failed")
        self._fail_in_flight("the shared engine process closed its connection")


def _shutdown_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown(EXIT_GRACE_S)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"
