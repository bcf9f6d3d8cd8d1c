"""The parent's side of a tensor-parallel engine's ranks 1..N-1 (used by `EngineProcess`).

    parent (Triton stub)         rank 0 (EngineProcess's child)         ranks 1..N-1
    EngineProcess ── commands ──▶ engine loop, scheduler, sampler ─ step pipes ─▶ worker_main
                  ◀─ steps ─────  forward ◀──── all-reduce / all-gather ──────▶ forward

The parent spawns every rank (multiprocessing `spawn`) from `EngineProcess`'s receiver thread,
so that `PR_SET_PDEATHSIG` kills them all when that thread or the whole parent dies, and
creates what they need to meet: the rendezvous file of the process group and one pipe from
rank 0 to each other rank (`engine_child.RankLink`). It puts `distributed.MULTICAST_OFF_ENV`
into its own environment first (`distributed.disable_multicast`), so every rank starts with NVLink multicast off (each sets it
again before torch.distributed initialises). It also watches them: a thread waits on
every rank's exit, and the first unexpected exit is reported to `EngineProcess`, which kills
the rest (a rank without its peers can only hang in a collective) and fails the requests in
flight.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext, SpawnProcess

from tritonllm.config import EngineConfig
from tritonllm.distributed import ModelShard, disable_multicast
from tritonllm.engine.engine_child import RankLink, worker_main


class WorkerRanks:
    """Ranks 1..N-1 of a tensor-parallel engine, as seen from the parent.

    Args:
        ctx: the spawn context that also starts rank 0.
        config: the engine's configuration (`tensor_parallel_size` > 1).
        parent_pid: this process' pid (the ranks exit at once if it is gone).

    Attributes:
        rank0: the `RankLink` to start rank 0 with (`engine_child.engine_main`).
        processes: ranks 1..N-1, named `tritonllm-tp<rank>`.

    Raises:
        RuntimeError: the model's config cannot be read or its heads cannot be split into
            `tensor_parallel_size` ranks (refused before any rank is started).
    """

    def __init__(self, ctx: SpawnContext, config: EngineConfig, parent_pid: int) -> None:
        size = config.tensor_parallel_size
        try:
            ModelShard.of(config.model_config, 0, size)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"engine failed to start: {type(exc).__name__}: {exc}") from exc
        disable_multicast()  # inherited by every rank (rank 0 included)
        fd, self.store_path = tempfile.mkstemp(prefix="tritonllm-tp-", suffix=".store")
        os.close(fd)  # FileStore takes an empty file
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]
        self.rank0 = RankLink(0, size, self.store_path, [writer for _, writer in pipes])
        self.processes: list[SpawnProcess] = [
            ctx.Process(
                target=worker_main,
                args=(config, RankLink(rank, size, self.store_path, [reader]), parent_pid),
                name=f"tritonllm-tp{rank}",
                daemon=True,
            )
            for rank, (reader, _) in enumerate(pipes, start=1)
        ]
        # The parent's copies of the pipe ends, closed once the ranks hold theirs: a rank's
        # exit must close its pipe for good (rank 0 then gets EPIPE, a follower end-of-file).
        self._ends: list[Connection] = [end for pair in pipes for end in pair]
        # (rank, exit code) of the rank 1..N-1 whose exit ended the engine (see `start`).
        self.dead_rank: tuple[int, int | None] | None = None

    def start(self, rank0: SpawnProcess, stopping: Callable[[], bool]) -> None:
        """Start ranks 1..N-1 (after `rank0`, on the thread that started it) and their
        watcher thread: when the first rank exits while `stopping()` is False, it records
        which one it was (`dead_rank`, unless it was rank 0) and kills all the others."""
        try:
            for process in self.processes:
                process.start()
        finally:
            self.close_pipes()
        threading.Thread(
            target=self._watch, args=(rank0, stopping), name="tritonllm-tp-watch", daemon=True
        ).start()

    def close_pipes(self) -> None:
        """Close the parent's copies of the step pipes (idempotent)."""
        for end in self._ends:
            end.close()
        self._ends = []

    def _watch(self, rank0: SpawnProcess, stopping: Callable[[], bool]) -> None:
        ready = set(wait([rank0.sentinel, *(p.sentinel for p in self.processes)]))
        if stopping():
            return  # shut down: the ranks exit one after the other
        # A rank that dies makes rank 0 fail at its next collective or step message: when rank
        # 0 is gone too, a rank that exited around then is the cause.
        for rank, p in enumerate(self.processes, start=1):
            # A sentinel closes as its process exits, a moment before it can be reaped.
            p.join(5.0 if p.sentinel in ready else 0.5 if rank0.sentinel in ready else 0.0)
            if p.exitcode is not None:
                self.dead_rank = (rank, p.exitcode)
                break
        rank0.kill()  # its end of file fails the requests in flight (EngineProcess)
        self.kill()

    def alive(self) -> bool:
        """Whether every rank 1..N-1 is running."""
        return all(p.is_alive() for p in self.processes)

    def kill(self) -> None:
        """SIGKILL the ranks still running."""
        for p in self.processes:
            if p.pid is not None and p.exitcode is None:
                p.kill()

    def stop(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds for the ranks to exit (they do once rank 0 is gone),
        SIGKILL the rest, reap them, and remove the rendezvous file."""
        self.join(timeout)
        self.kill()
        self.join(5.0)
        self.close_pipes()
        with contextlib.suppress(OSError):
            os.unlink(self.store_path)

    def join(self, timeout: float | None) -> None:
        """Wait up to `timeout` seconds in all for the started ranks to exit."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.processes:
            if p.pid is not None:
                p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
