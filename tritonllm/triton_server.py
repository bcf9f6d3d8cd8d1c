"""Find and start a real ``tritonserver`` on this project's model repository.

Where the binary comes from, in order:

1. ``$TRITONSERVER`` (a path), with ``$TRITON_BACKEND_DIR`` for its backends;
2. ``tritonserver`` on ``PATH`` (NVIDIA's container, the GPU devpack), same backend rule, falling
   back to ``/opt/tritonserver/backends``;
3. the ``nvidia-pytriton`` 0.7.0 wheel, which carries Triton 2.51, its Python backend, one backend
   stub per Python version and its shared libraries (ARCHITECTURE.md, "Platform facts").

The Python backend stub runs on the environment of the first ``python3`` on ``PATH`` (it ignores
``PYTHONPATH``), so the server is started with this interpreter's ``bin/`` first on ``PATH``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"

# Lines of a tritonserver log that say why something failed.
_ERROR_LINE = re.compile(r"error|exception|failed to load|traceback", re.IGNORECASE)


@dataclass(frozen=True)
class TritonInstall:
    """A runnable tritonserver: the binary, its backend directory and extra library paths."""

    binary: Path
    backend_dir: Path
    library_paths: tuple[Path, ...] = ()


def _pytriton_install() -> TritonInstall | None:
    """Lay out the ``nvidia-pytriton`` wheel's server as a runnable install, or None.

    The wheel ships stubs under ``python_backend_stubs/3.X``; the backend wants the one for the
    running Python inside ``backends/python``. We build that directory inside this virtualenv
    (``<prefix>/triton_backends``) from symlinks plus a copied stub, once.
    """
    try:
        import pytriton  # noqa: F401  (only located, never imported for its API)
    except ImportError:
        return None
    root = Path(sys.modules["pytriton"].__file__).parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.exists():
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    backend_dir = Path(sys.prefix) / "triton_backends"
    python_dir = backend_dir / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for item in (root / "backends" / "python").iterdir():
        if item.name == "__pycache__":
            continue
        link = python_dir / item.name
        if not link.exists():
            link.symlink_to(item)
    stub_copy = python_dir / "triton_python_backend_stub"
    if not stub_copy.exists():
        shutil.copy2(stub, stub_copy)
    for exe in (binary, stub_copy):
        exe.chmod(exe.stat().st_mode | 0o111)
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(binary, backend_dir, (libs,) if libs.exists() else ())


def find_tritonserver() -> TritonInstall:
    """Return the tritonserver to run.

    Raises:
        RuntimeError: when no tritonserver can be found (install the ``server`` extra).
    """
    explicit = os.environ.get("TRITONSERVER") or shutil.which("tritonserver")
    if explicit:
        backend = os.environ.get("TRITON_BACKEND_DIR", "/opt/tritonserver/backends")
        return TritonInstall(Path(explicit), Path(backend))
    install = _pytriton_install()
    if install is None:
        raise RuntimeError(
            "no tritonserver found: put one on PATH, set TRITONSERVER, or "
            "`pip install nvidia-pytriton==0.7.0` (the project's `server` extra)"
        )
    return install


def server_paths(install: TritonInstall, env: Mapping[str, str]) -> dict[str, str]:
    """``PATH`` and ``LD_LIBRARY_PATH`` for running ``install`` from environment ``env``: this
    interpreter's ``bin/`` first on PATH (the Python stub runs the first ``python3`` there),
    the install's own libraries and this Python's ``LIBDIR`` (the stub links libpython) ahead
    of ``env``'s LD_LIBRARY_PATH."""
    lib_paths = [str(p) for p in install.library_paths]
    lib_paths.append(sysconfig.get_config_var("LIBDIR") or "")
    if env.get("LD_LIBRARY_PATH"):
        lib_paths.append(env["LD_LIBRARY_PATH"])
    return {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in lib_paths if p),
    }


def print_env(env: Mapping[str, str] | None = None) -> str:
    """Shell ``export`` lines that make a plain ``"$TRITONSERVER" --model-repository ...
    --backend-directory "$TRITON_BACKEND_DIR"`` run the server ``find_tritonserver`` finds as
    ``TritonServer`` would (PATH, LD_LIBRARY_PATH, TRITONSERVER, TRITON_BACKEND_DIR).

    Raises:
        RuntimeError: no tritonserver is installed (see ``find_tritonserver``).
    """
    env = os.environ if env is None else env
    install = find_tritonserver()
    values = {
        **server_paths(install, env),
        "TRITONSERVER": str(install.binary),
        "TRITON_BACKEND_DIR": str(install.backend_dir),
    }
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in values.items())


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
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    # kill(2) also reaches zombies; orphaned ones wait for init to reap them, which can take
    # seconds, and they hold nothing. Linux: field 3 of /proc/PID/stat is the state, 5 the pgid.
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


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


@dataclass
class TritonServer:
    """A running tritonserver process on localhost ports; use as a context manager.

    Args:
        model_path: the Hugging Face model directory to serve (exported as ``TRITONLLM_MODEL``).
        model_repository: the Triton model repository (default: this project's).
        env: extra environment for the server and its Python stubs (e.g. engine settings).
        log_path: where the server's stdout/stderr go (default: a file in the temp dir).
        http_port, grpc_port, metrics_port: TCP ports (default: free ones).
        bind_address: the address all three endpoints listen on (tritonserver's own default is
            ``0.0.0.0``; this one is loopback only). ``0.0.0.0`` exposes them to the network.
    """

    model_path: Path | str | None = None
    model_repository: Path = MODEL_REPOSITORY
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    bind_address: str = DEFAULT_BIND_ADDRESS
    process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        """``HOST:PORT`` of the gRPC endpoint, as a local client reaches it."""
        return f"{connect_host(self.bind_address)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """``HOST:PORT`` of the HTTP endpoint, as a local client reaches it."""
        return f"{connect_host(self.bind_address)}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        """The Prometheus metrics URL."""
        return f"http://{connect_host(self.bind_address)}:{self.metrics_port}/metrics"

    @property
    def shm_prefix(self) -> str:
        """The name prefix of this server's Python-backend shared-memory regions in /dev/shm
        (the backend's ``shm-region-prefix-name``; unique per launching process and HTTP
        port). `stop` removes what a killed stub or server left under it; with the backend's
        default prefix those regions (1 MB each at the default size) outlive the server and pile
        up: 390 of them on one test machine."""
        return f"tritonllm_{os.getpid()}_{self.http_port}_"

    def command(self, install: TritonInstall) -> list[str]:
        """The ``tritonserver`` command line (HTTP, gRPC and metrics on ``bind_address``, metrics
        on, verbose logging off)."""
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={self.bind_address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.bind_address}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.bind_address}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--log-verbose=0",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        """This environment plus the interpreter's ``bin/`` first on PATH (see the module doc),
        the install's libraries on LD_LIBRARY_PATH, ``TRITONLLM_MODEL`` and ``self.env``."""
        env = dict(os.environ)
        env.update(server_paths(install, env))
        if self.model_path is not None:
            env["TRITONLLM_MODEL"] = str(Path(self.model_path).resolve())
        env.update(self.env)
        return env

    def start(self, timeout: float = 180.0) -> TritonServer:
        """Start the server and wait until it reports ready.

        Raises:
            RuntimeError: the process exited or was not ready within ``timeout`` seconds; the
                message carries the tail of the server log.
        """
        install = find_tritonserver()
        if self.log_path is None:
            import tempfile

            self.log_path = Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.process = start_process_group(
            self.command(install), self.log_path, self.environment(install)
        )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Wait until ``/v2/health/ready`` answers 200.

        Raises:
            RuntimeError: the process exited or was not ready within ``timeout`` seconds; the
                message carries the tail of the server log.
        """
        try:
            wait_http_ok(
                f"http://{self.http_url}/v2/health/ready", timeout, self.process, "tritonserver"
            )
        except RuntimeError as exc:
            errors = self.log_errors()
            details = "\n".join(errors) if errors else self.log_tail()
            raise RuntimeError(f"{exc} (log: {self.log_path}):\n{details}") from None

    def log_tail(self, n_chars: int = 6000) -> str:
        """The last ``n_chars`` characters of the server log ("" before there is one)."""
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")[-n_chars:]

    def log_errors(self, limit: int = 12, width: int = 600) -> list[str]:
        """The server log's last ``limit`` lines that report an error (a model that failed to
        load, an exception), each cut to ``width`` characters; [] without a log. Triton's
        model tables make a plain tail mostly padding, which can hide the reason."""
        if self.log_path is None or not Path(self.log_path).exists():
            return []
        lines = Path(self.log_path).read_text(errors="replace").splitlines()
        hits = [
            line.strip()[:width]
            for line in lines
            if _ERROR_LINE.search(line) and not line.lstrip().startswith("|")
        ]
        return hits[-limit:]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after ``timeout`` s), then
        remove the shared-memory regions left under its `shm_prefix` (none after a clean
        shutdown)."""
        stop_process_group(self.process, timeout)
        if self.process is not None:
            remove_shm_regions(self.shm_prefix)

    def __enter__(self) -> TritonServer:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tritonllm.triton_server --print-env``: print `print_env`'s export lines
    (``eval "$(...)"`` them in a shell). Returns the exit status."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--print-env",
        action="store_true",
        help="print shell exports to run this project's tritonserver by hand",
    )
    args = parser.parse_args(argv)
    if not args.print_env:
        parser.print_help()
        return 2
    try:
        sys.stdout.write(print_env())
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
