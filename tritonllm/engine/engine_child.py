"""The engine's child process of `EngineProcess`: build the engine, then serve its commands.

`engine_main` is the child's entry point (multiprocessing `spawn`). It binds the child's life to
the parent's receiver thread (Linux `PR_SET_PDEATHSIG`: the kernel SIGKILLs the child when that
thread, or the whole parent, dies), builds `LLMEngine(config)`, reports ready with the engine's
`RequestLimits` (or the error and its traceback), then runs the engine loop: it blocks on the
command pipe only while the engine is idle, applies commands between steps, and sends one step
message per step (`engine.process_messages`). It exits on a stop command or on end-of-file of
the command pipe.

With tensor parallelism (`EngineConfig.tensor_parallel_size` > 1) that child is rank 0: it
joins the process group, and its engine's model runner sends every forward to the other ranks
(`RankLink.pipes`). Ranks 1..N-1 run `worker_main`: the same binding to the parent, then a
`ModelRunner` over their shard, running each forward rank 0 sends until end-of-file.

Given the pid of the server its parent serves (`EngineProcess(server_pid=...)`: a Triton stub's
tritonserver), the engine also watches that parent: once the parent is orphaned (the server
died) and still lives `ORPHANED_PARENT_GRACE_S` later, the engine SIGKILLs it and exits, and
the ranks follow the parent. A stub whose thread is stuck inside a pb_utils call that never
returns and holds the GIL cannot run its own orphan watch (`serving.orphan_watch`); seen as
ranks that outlived a SIGKILLed tritonserver by 15 s on the 2-core CI box, 2026-12-06.
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import ctypes
import dataclasses
import functools
import logging
import multiprocessing
import os
import queue
import signal
import socket
import stat
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait

from tritonllm.config import EngineConfig
from tritonllm.contract.errors import ErrorCode
from tritonllm.distributed import init_tensor_parallel, rank_device
from tritonllm.engine.client import LoopTimes
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.engine_thread import admit_and_step, error_output
from tritonllm.engine.model_runner import ModelRunner
from tritonllm.engine.process_messages import (
    ABORT,
    CLIENTS,
    FAILED,
    FORWARD,
    READY,
    SUBMIT,
    StepBroadcast,
    decode_forward,
    encode_control,
    encode_rows,
    output_row,
)
from tritonllm.engine.request import RequestOutput
from tritonllm.engine.request_limits import RequestLimits
from tritonllm.engine.stats import EngineStats
from tritonllm.processes import parent_of

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # <linux/prctl.h>
# Diagnostics (`EngineConfig.engine_profile`): seconds between two dumps of the child's cProfile
# stats.
PROFILE_DUMP_S = 10.0
# A shared engine's client with no request in it gets a step message (the engine's stats) at most
# this often, in seconds: writing one to every idle instance every step cost the engine loop
# about 50 us a client a step (BENCHMARKS.md, "Every level with 2 generator instances").
IDLE_CLIENT_STATS_S = 0.25
# A shared engine's client whose unread messages reach this many bytes is dropped (its requests
# aborted; the parent that started the engine: the engine stops). Writes to clients never block
# the loop, so a stopped client (SIGSTOP, a debugger) holds up no other; this bounds its memory.
CLIENT_BACKLOG_LIMIT = 64 << 20
# How long the idle loop waits between two attempts to write a client's backlog, in seconds.
BACKLOG_RETRY_S = 0.01
# With a `server_pid`: seconds between two looks at the parent's parent, and seconds an orphaned
# parent gets to exit by itself (its own watch allows 2 s) before the engine kills it.
ORPHAN_POLL_S = 0.5
ORPHANED_PARENT_GRACE_S = 5.0


@dataclass(frozen=True)
class RankLink:
    """What a tensor-parallel rank's process starts with (a spawn argument).

    Attributes:
        rank, size: the rank and the tensor-parallel size.
        store_path: the process group's rendezvous file (`distributed.init_tensor_parallel`).
        pipes: rank 0: the write ends of the step pipes to ranks 1..N-1, in rank order; the
            others: the read end of their own.
    """

    rank: int
    size: int
    store_path: str
    pipes: list[Connection]


@dataclass(frozen=True)
class ListenAddress:
    """Where a shared engine takes the connections of further clients (a spawn argument).

    Attributes:
        address: an `AF_UNIX` address (on Linux an abstract one: a leading NUL byte).
        authkey: the key `multiprocessing.connection` authenticates each connection with.
    """

    address: str
    authkey: bytes = dataclasses.field(repr=False)


def engine_main(
    config: EngineConfig,
    commands: Connection,
    results: Connection,
    parent_pid: int,
    link: RankLink | None = None,
    listen: ListenAddress | None = None,
    server_pid: int | None = None,
) -> None:
    """The child's entry point: build the engine (as rank 0 of `link`'s group when given),
    report ready (or the error), serve (with `listen`, also the clients that connect there).
    With `server_pid`, the parent is killed once orphaned (module docstring)."""
    _start_child(parent_pid)
    # Only a relation this process can see now (Linux `/proc`, the server still the parent's
    # parent) is watched: a wrong pid or no `/proc` must not look like an orphaned parent.
    if server_pid is not None and parent_of(parent_pid) == server_pid:
        threading.Thread(
            target=_end_orphaned_parent,
            args=(parent_pid, server_pid),
            name="tritonllm-parent-watch",
            daemon=True,
        ).start()
    try:
        engine = _build_engine(config, link)
    except BaseException as exc:
        detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        try:
            results.send((FAILED, detail))
        except OSError:
            pass
        return
    profiler: cProfile.Profile | None = None
    dump_profile: Callable[[], None] | None = None
    if config.engine_profile:
        profiler = cProfile.Profile()
        profiler.enable()
        dump_profile = functools.partial(profiler.dump_stats, config.engine_profile)
    try:
        listener = None
        if listen is not None:
            listener = Listener(listen.address, "AF_UNIX", authkey=listen.authkey)
        results.send((READY, RequestLimits.of(engine), engine.stats()))
        _serve(engine, _Clients(commands, results, listener), dump_profile)
    except (EOFError, OSError):
        pass  # the parent closed its end or is gone: nobody is left to serve
    finally:
        engine.shutdown()
        if profiler is not None and dump_profile is not None:
            profiler.disable()
            dump_profile()


def worker_main(config: EngineConfig, link: RankLink, parent_pid: int) -> None:
    """Entry point of tensor-parallel ranks 1..N-1: join the group, build this rank's
    `ModelRunner`, then run each forward rank 0 sends until its pipe closes. An error ends the
    process (traceback on stderr); `EngineProcess` then fails the engine."""
    _start_child(parent_pid)
    device = rank_device(config.device, link.rank)
    tp = init_tensor_parallel(link.rank, link.size, link.store_path, device)
    runner = ModelRunner(dataclasses.replace(config, device=device), tp)
    (steps,) = link.pipes
    while True:
        try:
            data = steps.recv_bytes()
        except (EOFError, OSError):
            return  # rank 0 is gone or stopped
        runner.run_follower(*decode_forward(data))


def _build_engine(config: EngineConfig, link: RankLink | None) -> LLMEngine:
    if link is None:
        return LLMEngine(config)
    device = rank_device(config.device, 0)
    tp = init_tensor_parallel(0, link.size, link.store_path, device)
    config = dataclasses.replace(config, device=device)
    return LLMEngine(config, ModelRunner(config, tp, StepBroadcast(link.pipes)))


def _start_child(parent_pid: int) -> None:
    _bind_to_parent(parent_pid, multiprocessing.current_process().name)
    # Like Triton's Python stubs, the engine outlives SIGINT/SIGTERM sent to its process group
    # (a terminal's Ctrl-C, `stop_process_group`): it keeps serving the requests in flight
    # while the server drains them, and exits when its parent stops it or dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _end_orphaned_parent(parent_pid: int, server_pid: int) -> None:
    """The parent watch (module docstring): poll until `parent_pid`'s parent is no longer
    `server_pid`, give it `ORPHANED_PARENT_GRACE_S`, SIGKILL it if it still lives (its other
    children, the ranks, follow by `PR_SET_PDEATHSIG`), and end this process."""
    while parent_of(parent_pid) == server_pid:
        time.sleep(ORPHAN_POLL_S)
    time.sleep(ORPHANED_PARENT_GRACE_S)
    if parent_of(parent_pid) is not None:
        logger.error(
            "the server %d is gone and its stub %d still runs: killing it", server_pid, parent_pid
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent_pid, signal.SIGKILL)
    os._exit(1)


def _bind_to_parent(parent_pid: int, name: str) -> None:
    """Linux: have the kernel SIGKILL this process when the thread that started it exits, and
    name it (`/proc/PID/comm`, what `ps` and `top` show) after the `multiprocessing` process."""
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _serve(
    engine: LLMEngine,
    clients: _Clients,
    dump_profile: Callable[[], None] | None = None,
) -> None:
    """The engine loop (like `EngineThread._loop`): read commands, blocking only while idle,
    apply them between steps, step, send one message per step to each client. Returns on a stop
    command of the parent that started the child; raises EOFError when that parent closed its
    command pipe. `dump_profile` (diagnostics, see `EngineConfig.engine_profile`) is called
    every `PROFILE_DUMP_S` seconds."""
    cpu0 = time.thread_time()
    busy = transport = 0.0
    loops = 0
    next_dump = time.monotonic() + PROFILE_DUMP_S
    while True:
        if dump_profile is not None and time.monotonic() >= next_dump:
            dump_profile()
            next_dump = time.monotonic() + PROFILE_DUMP_S
        batch = clients.receive(engine, block=not engine.has_unfinished())
        start = time.perf_counter()
        submissions, aborts = [], clients.orphaned()
        refused: list[RequestOutput] = []
        for client, command in batch:
            if command[0] == SUBMIT:
                if clients.over_limit(command):
                    refused.append(clients.overloaded(client, command))
                    continue
                engine_id = clients.submitted(client, command[1], command[3].n)
                submissions.append((engine_id, *command[2:4]))
            elif command[0] == ABORT:
                aborts.append(clients.engine_id(client, command[1]))
            elif command[0] == FORWARD:
                clients.forward(client, command[1])
            elif client is clients.owner:
                return
            else:
                clients.drop(client)
        outputs = refused + admit_and_step(engine, submissions, aborts)
        encoding = time.perf_counter()
        busy_now = busy + encoding - start
        times = LoopTimes(busy_now, time.thread_time() - cpu0, transport, loops + 1)
        clients.send_step(outputs, engine.stats(), times)
        end = time.perf_counter()
        busy += end - start
        transport += end - encoding
        loops += 1


class _Outbox:
    """Messages to one client written without ever blocking: what the connection does not take
    now waits, in order, for the next `flush`.

    Each message is framed as `multiprocessing.connection.Connection.send_bytes` frames it (a
    4-byte big-endian signed length, or -1 and an 8-byte length beyond 2 GiB, then the bytes),
    so the client reads it with `recv_bytes` as before. A socket (a client connected over the
    listener, whose commands arrive on the same socket) is written with `MSG_DONTWAIT`, which
    leaves its blocking reads alone; the write end of a pipe (the parent that started the
    child) is made non-blocking.

    Raises (`put`, `flush`):
        OSError: the client is gone (`BrokenPipeError`, `ConnectionResetError`).
    """

    __slots__ = ("_write", "_socket", "_pending", "backlog")

    def __init__(self, conn: Connection) -> None:
        fd = conn.fileno()
        self._socket: socket.socket | None = None
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            sock = self._socket = socket.socket(fileno=os.dup(fd))
            self._write: Callable[[memoryview], int] = lambda chunk: sock.send(
                chunk, socket.MSG_DONTWAIT
            )
        else:
            os.set_blocking(fd, False)
            self._write = functools.partial(os.write, fd)
        self._pending: collections.deque[memoryview] = collections.deque()
        self.backlog = 0  # bytes in _pending

    def put(self, data: bytes) -> None:
        """Write one message, or as much of it as the connection takes; keep the rest."""
        n = len(data)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        frame = memoryview(header + data)
        self._pending.append(frame)
        self.backlog += len(frame)
        if len(self._pending) == 1:
            self.flush()

    def flush(self) -> None:
        """Write what is pending until the connection would block."""
        pending = self._pending
        while pending:
            chunk = pending[0]
            try:
                written = self._write(chunk)
            except BlockingIOError:
                return
            self.backlog -= written
            if written < len(chunk):
                pending[0] = chunk[written:]
                return
            pending.popleft()

    def close(self) -> None:
        """Close the duplicate socket (a pipe's descriptor belongs to its connection)."""
        if self._socket is not None:
            self._socket.close()


class _Client:
    """One parent the child serves: its command and result connections (one duplex
    connection for a client that connected over the listener) and its requests in flight
    (engine ids; tracked only when the engine is shared)."""

    __slots__ = ("index", "commands", "results", "live", "sent_at", "outbox")

    def __init__(
        self, index: int, commands: Connection, results: Connection, shared: bool = True
    ) -> None:
        self.index, self.commands, self.results = index, commands, results
        self.live: dict[str, int] = {}  # a shared engine's live requests → their choices
        self.sent_at = 0.0  # time.monotonic() of its last step message
        # (a shared engine's clients only: one parent may block the engine, it is the engine)
        self.outbox = _Outbox(results) if shared else None


class _Clients:
    """The parents an engine child serves: the one that started it (client 0, over its two
    pipes) and, with a `listener`, every generator instance that connects there (a thread
    accepts them; the loop greets each between steps with the READY message).

    A shared engine (one with a listener) names each request `"<client index>:<id>"` inside
    the engine, so that two instances may use the same id, and hands each client its own
    outputs under the id it gave, in a step message of its own, with the engine's stats (every
    step to the parent that started the engine, which reports the engine's metrics, and to
    each client with requests in the engine; to the others at most every
    `IDLE_CLIENT_STATS_S`), and after a step in which a client joined or left, the number of
    clients connected (`(CLIENTS, n)`). A client that disconnects has its requests
    aborted. Writes to a shared engine's clients go through each one's `_Outbox` and never
    block the loop; a client whose backlog reaches `CLIENT_BACKLOG_LIMIT` is dropped. An
    engine without a listener sends the step's outputs as they are: the one parent's path costs
    nothing more.
    """

    def __init__(
        self, commands: Connection, results: Connection, listener: Listener | None = None
    ) -> None:
        self.shared = listener is not None
        self.owner = _Client(0, commands, results, self.shared)
        self._clients: dict[int, _Client] = {0: self.owner}
        self._next_index = 1
        self._accepted: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._orphans: list[str] = []  # requests of dropped clients, to abort
        self._joined_or_left = False  # since the last `(CLIENTS, n)` announcement
        self._wake_r = self._wake_w = -1
        if listener is not None:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            threading.Thread(
                target=self._accept, args=(listener,), name="tritonllm-accept", daemon=True
            ).start()

    # ---- commands -------------------------------------------------------------------------
    def receive(self, engine: LLMEngine, block: bool) -> list[tuple[_Client, tuple]]:
        """The commands waiting on every client's connection, in arrival order per client;
        with `block`, waits until there is one. Greets clients accepted meanwhile.

        Raises:
            EOFError: the parent that started the child closed its command pipe.
        """
        owner = self.owner
        if not self.shared:
            batch = [(owner, c) for c in owner.commands.recv()] if block else []
            while owner.commands.poll():
                batch.extend((owner, c) for c in owner.commands.recv())
            return batch
        self._greet(engine)
        if block:
            # Idle: wait for a command, retrying the outboxes meanwhile while they hold some
            # backlog (a wake-up for that alone is no step). A client that joined or left since
            # the last announcement ends the wait: the loop's next `send_step` announces it (the
            # greeting above may have taken the wake-up of a client accepted during the step).
            while not self._joined_or_left:
                waiting = self._flush()
                connections = [c.commands for c in self._clients.values()] + [self._wake_r]
                if self._joined_or_left or wait(
                    connections, timeout=BACKLOG_RETRY_S if waiting else None
                ):
                    break
            self._greet(engine)
        # One readiness check for every client (a `poll()` per connection costs a selector
        # each), then each ready one read until it has nothing more.
        by_connection = {c.commands: c for c in self._clients.values()}
        batch = []
        for connection in wait(list(by_connection), timeout=0):
            client = by_connection[connection]  # type: ignore[index]  # (wait returns its inputs)
            try:
                batch.extend((client, c) for c in client.commands.recv())
                while client.commands.poll():
                    batch.extend((client, c) for c in client.commands.recv())
            except (EOFError, OSError):
                if client is owner:
                    raise EOFError from None
                self.drop(client)
        return batch

    def engine_id(self, client: _Client, request_id: str) -> str:
        """The engine's name of `client`'s request `request_id`."""
        return f"{client.index}:{request_id}" if self.shared else request_id

    def submitted(self, client: _Client, request_id: str, choices: int) -> str:
        """`engine_id`, for a request of ``choices`` choices being submitted (a shared engine
        tracks it)."""
        if not self.shared:
            return request_id
        engine_id = f"{client.index}:{request_id}"
        client.live[engine_id] = choices
        return engine_id

    def over_limit(self, command: tuple) -> bool:
        """Whether a shared engine must refuse this submit: it carries a limit (the most
        choices live in the whole engine, ``_EngineFront.live_limit``: each choice is a
        sequence the engine runs or queues) that its clients' live choices already reach."""
        limit = command[4] if len(command) > 4 else None
        if not self.shared or limit is None:
            return False
        return sum(sum(c.live.values()) for c in self._clients.values()) >= limit

    def overloaded(self, client: _Client, command: tuple) -> RequestOutput:
        """The final output refusing a submit ``over_limit``: finish_reason "error" with the
        code ``server_overloaded`` (the sidecar's 429), under the engine's name of the request
        (``send_step`` maps it back)."""
        limit = command[4]
        return dataclasses.replace(
            error_output(
                self.engine_id(client, command[1]),
                len(command[2]),
                f"the server is at its limit of {limit} sequences in progress; retry later",
            ),
            error_code=ErrorCode.SERVER_OVERLOADED.value,
        )

    def forward(self, sender: _Client, payload: object) -> None:
        """Send `payload` to every client but `sender` as a control message."""
        data = encode_control(payload)
        for client in list(self._clients.values()):
            if client is not sender:
                self._send(client, data)

    def drop(self, client: _Client) -> None:
        """Forget a client that left: its requests are aborted at the next step."""
        if self._clients.pop(client.index, None) is None:
            return
        self._joined_or_left = True
        self._orphans.extend(client.live)
        client.live.clear()
        with contextlib.suppress(OSError):
            client.commands.close()
        if client.outbox is not None:
            client.outbox.close()

    def orphaned(self) -> list[str]:
        """Engine ids of dropped clients' requests not aborted yet (taken)."""
        orphans, self._orphans = self._orphans, []
        return orphans

    # ---- results ----------------------------------------------------------------------------
    def send_step(self, outputs: list[RequestOutput], stats: EngineStats, times: LoopTimes) -> None:
        """Send one step message to each client, with its own outputs.

        Raises:
            OSError: the parent that started the child is gone.
        """
        if not self.shared:
            rows = [output_row(out) for out in outputs]
            self.owner.results.send_bytes(encode_rows(rows, stats, times))
            return
        per_client: dict[int, list[tuple]] = {index: [] for index in self._clients}
        for out in outputs:
            prefix, _, request_id = out.request_id.partition(":")
            client = self._clients.get(int(prefix))
            if client is None:
                continue  # its client left
            if out.request_finished:
                client.live.pop(out.request_id, None)
            per_client[client.index].append((request_id, *output_row(out)[1:]))
        self._flush()
        now = time.monotonic()
        for number, rows in per_client.items():
            receiver = self._clients.get(number)
            if receiver is None:
                continue
            if not rows and receiver.outbox.backlog:  # type: ignore[union-attr]
                continue  # it has not read the last ones: its stats can wait
            idle = not rows and not receiver.live and receiver is not self.owner
            if idle and now - receiver.sent_at < IDLE_CLIENT_STATS_S:
                continue  # nothing of its own in the engine: its stats can wait
            receiver.sent_at = now
            self._send(receiver, encode_rows(rows, stats, times))
        if self._joined_or_left:  # (a client dropped while announcing sets it again)
            self._joined_or_left = False
            announcement = encode_control((CLIENTS, len(self._clients)))
            for client in list(self._clients.values()):
                self._send(client, announcement)

    def _send(self, client: _Client, data: bytes) -> None:
        """Hand `data` to a shared engine's client (its outbox: never blocks); drop a client
        that is gone or whose unread messages reach `CLIENT_BACKLOG_LIMIT`.

        Raises:
            OSError: that client is the parent that started the engine.
        """
        outbox = client.outbox
        assert outbox is not None
        try:
            outbox.put(data)
        except OSError:
            if client is self.owner:
                raise
            self.drop(client)
            return
        if outbox.backlog < CLIENT_BACKLOG_LIMIT:
            return
        owner = client is self.owner
        logger.error(
            "client %d has not read %d bytes of messages: %s",
            client.index,
            outbox.backlog,
            "the engine stops" if owner else "dropping it, its requests aborted",
        )
        if owner:
            raise BlockingIOError("the parent that started the engine stopped reading")
        self.drop(client)

    def _flush(self) -> bool:
        """Write what each client's outbox holds (as far as it goes without blocking); drop
        clients that are gone. Whether some backlog is left.

        Raises:
            OSError: the parent that started the engine is gone.
        """
        left = False
        for client in list(self._clients.values()):
            outbox = client.outbox
            if outbox is None or not outbox.backlog:
                continue
            try:
                outbox.flush()
            except OSError:
                if client is self.owner:
                    raise
                self.drop(client)
                continue
            left = left or outbox.backlog > 0
        return left

    # ---- connections ------------------------------------------------------------------------
    def _accept(self, listener: Listener) -> None:
        """The accept thread: hands each authenticated connection to the loop."""
        while True:
            try:
                conn = listener.accept()
            except multiprocessing.AuthenticationError:
                continue  # not one of ours
            except OSError:
                return
            self._accepted.put(conn)
            os.write(self._wake_w, b"\0")

    def _greet(self, engine: LLMEngine) -> None:
        """Add the clients accepted since the last call: each gets the READY message."""
        with contextlib.suppress(BlockingIOError):  # nothing to read: no wake-up pending
            os.read(self._wake_r, 4096)
        while True:
            try:
                conn = self._accepted.get_nowait()
            except queue.Empty:
                return
            try:
                conn.send((READY, RequestLimits.of(engine), engine.stats()))
            except OSError:
                continue
            client = _Client(self._next_index, conn, conn)
            self._clients[client.index] = client
            self._next_index += 1
            self._joined_or_left = True
