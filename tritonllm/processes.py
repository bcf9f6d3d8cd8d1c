"""Starting, waiting for and stopping the service's processes (tritonserver, the sidecar).

Each server runs in a process group of its own (`start_process_group`), so that
`stop_process_group` reaches the children it spawns (Triton's Python backend stubs) and a
terminal's Ctrl-C does not; readiness is an HTTP 200 (`wait_http_ok`); servers bind to loopback
unless told otherwise (`DEFAULT_BIND_ADDRESS`).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

# Where servers listen unless told otherwise: loopback only, so a development machine does not
# expose an unauthenticated inference API (and Triton's model-control endpoints) to its network.
DEFAULT_BIND_ADDRESS = "127.0.0.1"


def connect_host(bind_address: str) -> str:
    """The host part of a URL that reaches a server bound to ``bind_address``: loopback for a
    wildcard (``0.0.0.0``, ``::``, empty), IPv6 literals in brackets, other addresses as is."""
    if bind_address in ("", "0.0.0.0"):
        return "127.0.0.1"
    if bind_address == "::":
        return "[::1]"
    return f"[{bind_address}]" if ":" in bind_address else bind_address


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (racy by nature; fine for tests and local serving)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process_group(
    command: Sequence[str],
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """Start ``command`` in a new session (its own process group), so that
    ``stop_process_group`` reaches the children it spawns and a terminal's Ctrl-C does not.

    Args:
        log_path: file for stdout and stderr (truncated); None inherits this process' streams.
        env: the full environment (None: this process' environment).
        cwd: working directory (None: this process').
    Raises:
        OSError: the command cannot be executed or the log cannot be opened.
    """
    if log_path is None:
        return subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True)
    # The child holds its own copy of the descriptor; ours is closed once it is started.
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a live (non-zombie) member."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal is still a member
        return True
    if not Path("/proc").is_dir():
        return True
    # kill(2) also reaches zombies; orphaned ones wait for init to reap them, which can take
    # seconds, and they hold nothing.
    return any(pg == pgid for _, _, pg in _live_processes())


def child_pids(pid: int) -> list[int]:
    """The live (non-zombie) child processes of ``pid`` (Linux ``/proc``; [] elsewhere), e.g.
    the workers of a sidecar started with ``--workers``, each in a process group of its own."""
    return sorted(child for child, ppid, _ in _live_processes() if ppid == pid)


def parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid`` (Linux ``/proc``), or None when it is gone, a zombie,
    or ``/proc`` is not there."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return None if fields is None else int(fields[1])


def _stat_fields(stat: Path) -> list[str] | None:
    """The fields of a live (non-zombie) process' /proc/PID/stat after its command name: state
    (3), ppid (4), pgid (5), ...; None for a zombie or one that cannot be read (gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields


def _live_processes() -> Iterator[tuple[int, int, int]]:
    """(pid, ppid, pgid) of every live (non-zombie) process in Linux ``/proc`` (none
    elsewhere)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields is not None:
            yield int(stat.parent.name), int(fields[1]), int(fields[2])


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# Seconds the members of a group whose leader already exited get between SIGTERM and SIGKILL.
# Nothing coordinates their shutdown any more (Triton's Python backend stubs ignore SIGTERM and
# wait for their server's word), so waiting the full grace period would only delay the exit.
ORPHAN_GRACE_S = 2.0


def remove_shm_regions(prefix: str, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Unlink the POSIX shared-memory files in ``shm_dir`` whose names start with ``prefix``
    (call it only when no process uses them any more); returns their names. No-op where
    ``shm_dir`` does not exist."""
    if not prefix or not shm_dir.is_dir():
        return []
    removed = []
    for path in shm_dir.glob(f"{prefix}*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def private_shm_command(command: Sequence[str], size_bytes: int) -> list[str] | None:
    """``command`` run with a /dev/shm of its own, or None where this host cannot give one.

    The command runs in a new mount namespace (``unshare --mount``; as a non-root user inside a
    user namespace that maps it to root, ``--map-root-user``, where the kernel allows that) over
    a fresh tmpfs at /dev/shm of at most ``size_bytes``, mode 0700: its processes and their
    children see only their own shared memory, no other user (or process outside) can open it,
    and the kernel frees it when the last of them exits. Triton's Python backend creates its
    regions with mode 0644 whatever the umask, so this is what makes them private.
    """
    if not _private_shm_available():
        return None
    return [*_unshare_prefix(), "sh", "-c", _MOUNT_SHM.format(size=size_bytes), "sh", *command]


_MOUNT_SHM = 'mount -t tmpfs -o size={size},mode=0700 tritonllm-shm /dev/shm && exec "$@"'


def _unshare_prefix() -> list[str]:
    root = os.geteuid() == 0
    return ["unshare", "--mount", *([] if root else ["--map-root-user"]), "--propagation=private"]


@functools.cache
def _private_shm_available() -> bool:
    """Whether ``private_shm_command`` works here (tried once per process: 10-20 ms)."""
    if shutil.which("unshare") is None or not Path("/dev/shm").is_dir():
        return False
    probe = [*_unshare_prefix(), "sh", "-c", _MOUNT_SHM.format(size=1 << 20), "sh", "true"]
    try:
        result = subprocess.run(probe, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def restrict_shm_regions(prefix: str, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Make the shared-memory files in ``shm_dir`` whose names start with ``prefix`` readable
    by their owner only (0600); returns their names. The fallback where no private /dev/shm
    can be made: it closes the files to users who have not opened them yet."""
    if not prefix or not shm_dir.is_dir():
        return []
    changed = []
    for path in shm_dir.glob(f"{prefix}*"):
        try:
            path.chmod(0o600)
        except OSError:
            continue
        changed.append(path.name)
    return changed


def stop_process_group(
    process: subprocess.Popen | None, timeout_s: float = 20.0, poll_s: float = 0.05
) -> None:
    """Stop the whole process group of ``process`` (started by ``start_process_group``) and reap
    ``process``: SIGTERM to the group, SIGKILL to what is left of it after ``timeout_s`` seconds
    (``ORPHAN_GRACE_S`` at most when ``process`` had already exited).

    The group is signalled even when ``process`` itself has already exited: a tritonserver that
    died (a port in use, a crash) leaves its Python backend stubs behind in its group, and they
    ignore SIGTERM, so only the SIGKILL stops them. No-op when ``process`` is None.
    """
    if process is None:
        return
    # start_new_session made the leader's pid the group id; Linux keeps that number reserved
    # while any member lives, so it names this group even after the leader was reaped.
    pgid = process.pid
    if process.poll() is not None:
        if not _group_alive(pgid):
            return  # stopped before, or exited with no member left: nothing to signal
        timeout_s = min(timeout_s, ORPHAN_GRACE_S)
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(poll_s)
    if process.poll() is None or _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
        process.wait()
        # SIGKILL cannot be ignored; wait briefly so callers see the group gone on return.
        kill_deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < kill_deadline:
            time.sleep(poll_s)


def wait_http_ok(
    url: str,
    timeout_s: float,
    process: subprocess.Popen | None = None,
    name: str = "server",
    poll_s: float = 0.25,
) -> None:
    """Poll ``url`` every ``poll_s`` seconds until it answers HTTP 200.

    Raises:
        RuntimeError: ``process`` (the server behind ``url``) exited first, or no 200 came
            within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{name} exited early with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # refused, reset, timed out, or an HTTP error status (503 while loading)
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s ({url})")
