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
"""

from __future__ import annotations

import cProfile
import ctypes
import dataclasses
import functools
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tritonllm.config import EngineConfig
from tritonllm.distributed import init_tensor_parallel, rank_device
from tritonllm.engine.client import LoopTimes
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.engine_thread import admit_and_step
from tritonllm.engine.model_runner import ModelRunner
from tritonllm.engine.process_messages import (
    ABORT,
    FAILED,
    READY,
    SUBMIT,
    StepBroadcast,
    decode_forward,
    encode_step,
)
from tritonllm.engine.request_limits import RequestLimits

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # <linux/prctl.h>
# Diagnostics (`EngineConfig.engine_profile`): seconds between two dumps of the child's cProfile
# stats.
PROFILE_DUMP_S = 10.0


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


def engine_main(
    config: EngineConfig,
    commands: Connection,
    results: Connection,
    parent_pid: int,
    link: RankLink | None = None,
) -> None:
    """The child's entry point: build the engine (as rank 0 of `link`'s group when given),
    report ready (or the error), serve."""
    _start_child(parent_pid)
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
        results.send((READY, RequestLimits.of(engine), engine.stats()))
        _serve(engine, commands, results, dump_profile)
    except (EOFError, OSError):
        pass  # the parent closed its end or is gone: nobody is left to serve
    finally:
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
    commands: Connection,
    results: Connection,
    dump_profile: Callable[[], None] | None = None,
) -> None:
    """The engine loop (like `EngineThread._loop`): read commands, blocking only while idle,
    apply them between steps, step, send one message per step. Returns on a stop command;
    raises EOFError when the parent closed the command pipe. `dump_profile` (diagnostics, see
    `EngineConfig.engine_profile`) is called every `PROFILE_DUMP_S` seconds."""
    cpu0 = time.thread_time()
    busy = transport = 0.0
    loops = 0
    next_dump = time.monotonic() + PROFILE_DUMP_S
    while True:
        if dump_profile is not None and time.monotonic() >= next_dump:
            dump_profile()
            next_dump = time.monotonic() + PROFILE_DUMP_S
        batch: list[tuple] = []
        if not engine.has_unfinished():
            batch.extend(commands.recv())
        while commands.poll():
            batch.extend(commands.recv())
        start = time.perf_counter()
        submissions, aborts = [], []
        for command in batch:
            if command[0] == SUBMIT:
                submissions.append(command[1:])
            elif command[0] == ABORT:
                aborts.append(command[1])
            else:
                return
        outputs = admit_and_step(engine, submissions, aborts)
        encoding = time.perf_counter()
        busy_now = busy + encoding - start
        times = LoopTimes(busy_now, time.thread_time() - cpu0, transport, loops + 1)
        results.send_bytes(encode_step(outputs, engine.stats(), times))
        end = time.perf_counter()
        busy += end - start
        transport += end - encoding
        loops += 1
