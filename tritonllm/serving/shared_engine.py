"""One engine for every instance of a generator (Triton ``instance_group`` count > 1).

Triton runs each instance of a Python model in a stub process of its own, with its own GIL.
Each stub must answer its own requests (a response sender cannot leave its process), but all of
them should batch in one engine (one KV cache, one model on the device). So the instances elect
one of themselves to start the engine (``EngineProcess(listen=True)``) and the others connect to
it (``EngineConnection``); each then sends its own requests' responses, from its own stub, in
parallel: the response path scales with the instances (BENCHMARKS.md, "Generator instances").

Election, by a lock file and a rendezvous file in ``directory`` (the temp directory), both named
by ``key`` (the generator's tritonserver process and model):

- the instance that takes the lock (``flock``, held for the engine's life) starts the engine,
  then writes the rendezvous (its listen address and key, mode 0600) for the others;
- the others wait for the rendezvous and connect; if the owner fails before it is ready, it
  lets go of the lock and the next instance to take it tries in turn (and fails the same way,
  with the same error, when the engine cannot be built).

A key that begins with a process id and a dash (``engine_key``: tritonserver's pid) scopes the
engine to that process's life: an owner that wins an election removes the files of keys whose
process is gone, which a tritonserver killed before its owner could clean up left behind (the
supervisor's restart sends SIGKILL after a short stop timeout).

The connection is authenticated by the random key of the rendezvous file, readable only by the
server's user; the engine's address is an abstract Unix socket (Linux).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import re
import tempfile
import time
from pathlib import Path

from tritonllm.config import EngineConfig
from tritonllm.engine.engine_child import ListenAddress
from tritonllm.engine.engine_process import EngineConnection, EngineProcess

# Seconds between two looks at the rendezvous while another instance builds the engine.
POLL_S = 0.1
# The lock and rendezvous files of an engine key scoped to a process (``engine_key``).
_SCOPED_FILE = re.compile(r"tritonllm-engine-(\d+)-.*\.(lock|json)")


def engine_key(scope_pid: int, name: str) -> str:
    """The key (``open_shared_engine``) of the engine named ``name`` (e.g. the model and its
    version) that lives no longer than process ``scope_pid`` (tritonserver): files left behind
    under a key whose process is gone are removed by the next owner (module doc)."""
    return f"{scope_pid}-{name}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale(directory: Path) -> None:
    """Remove the lock and rendezvous files in ``directory`` of engine keys scoped to a
    process that is gone (``engine_key``). Keys of a live process (also a reused pid) and keys
    not scoped to a process are left alone."""
    for path in directory.glob("tritonllm-engine-*"):
        match = _SCOPED_FILE.fullmatch(path.name)
        if match is not None and not _pid_alive(int(match.group(1))):
            path.unlink(missing_ok=True)


class SharedEngineOwner(EngineProcess):
    """The ``EngineProcess`` of the instance that won the election: its shutdown also removes
    the rendezvous and lets go of the lock (see the module doc)."""

    lock_fd: int = -1
    lock_path: Path | None = None
    rendezvous: Path | None = None

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """``EngineProcess.shutdown``, then the rendezvous and lock files are removed (the
        instances are unloading with the engine) and the lock released."""
        super().shutdown(timeout)
        for path in (self.rendezvous, self.lock_path):
            if path is not None:
                path.unlink(missing_ok=True)
        self.rendezvous = self.lock_path = None
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def open_shared_engine(
    config: EngineConfig,
    key: str,
    directory: Path | None = None,
    start_timeout: float | None = None,
    server_pid: int | None = None,
) -> SharedEngineOwner | EngineConnection:
    """The engine front of one instance: the engine itself for the first instance to get here
    (a ``SharedEngineOwner``), a connection to it for the others.

    Args:
        config: the engine's configuration (the owner builds ``LLMEngine(config)``).
        key: names the engine among those on the host: the same for every instance of one
            generator, different for any other (e.g. tritonserver's pid and the model name).
        directory: where the lock and rendezvous files live (default: the temp directory).
        start_timeout: most seconds to wait for the engine, built here or by another
            instance (None: no limit).
        server_pid: the owner's ``EngineProcess`` ``server_pid`` (tritonserver's pid).
    Raises:
        RuntimeError: the engine could not be built (``EngineProcess``'s error), or it was not
            ready within ``start_timeout``.
    """
    base = Path(directory or tempfile.gettempdir())
    lock_path = base / f"tritonllm-engine-{key}.lock"
    rendezvous = base / f"tritonllm-engine-{key}.json"
    deadline = None if start_timeout is None else time.monotonic() + start_timeout
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                connection = _connect(rendezvous)
                if connection is not None:
                    return connection
            else:
                owner = _start_owner(config, fd, rendezvous, start_timeout, server_pid)
                owner.lock_path, fd = lock_path, -1  # the owner holds it now
                return owner
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"the shared engine was not ready after {start_timeout} s")
            time.sleep(POLL_S)
    finally:
        if fd >= 0:
            os.close(fd)


def _start_owner(
    config: EngineConfig,
    fd: int,
    rendezvous: Path,
    start_timeout: float | None,
    server_pid: int | None,
) -> SharedEngineOwner:
    """Start the engine (the lock ``fd`` is held) and publish its address."""
    rendezvous.unlink(missing_ok=True)  # a dead owner's, if any: its engine is gone
    sweep_stale(rendezvous.parent)
    owner = SharedEngineOwner(
        config, start_timeout=start_timeout, listen=True, server_pid=server_pid
    )
    listen = owner.listen_address
    assert listen is not None
    text = json.dumps({"address": listen.address, "authkey": listen.authkey.hex()})
    temporary = rendezvous.parent / f"{rendezvous.name}.{os.getpid()}.tmp"
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    os.replace(temporary, rendezvous)
    owner.lock_fd, owner.rendezvous = fd, rendezvous
    return owner


def _connect(rendezvous: Path) -> EngineConnection | None:
    """A connection to the engine the rendezvous names; None while there is none (not
    written yet, or its engine is gone)."""
    try:
        info = json.loads(rendezvous.read_text())
        listen = ListenAddress(info["address"], bytes.fromhex(info["authkey"]))
    except (OSError, ValueError, KeyError):
        return None
    with contextlib.suppress(OSError, EOFError, multiprocessing.AuthenticationError):
        return EngineConnection(listen)
    return None
