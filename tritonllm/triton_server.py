"""Find and start a real ``tritonserver`` on this project's model repository.

Where the binary comes from, in order:

1. ``$TRITONSERVER`` (a path), with ``$TRITON_BACKEND_DIR`` for its backends;
2. ``tritonserver`` on ``PATH`` (NVIDIA's container, the GPU devpack), same backend rule, falling
   back to ``/opt/tritonserver/backends``;
3. the ``nvidia-pytriton`` 0.7.0 wheel, which carries Triton 2.51, its Python backend, one backend
   stub per Python version and its shared libraries (DESIGN.md, "tritonserver without Docker").

The Python backend stub runs on the environment of the first ``python3`` on ``PATH`` (it ignores
``PYTHONPATH``), so the server is started with this interpreter's ``bin/`` first on ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"


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


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (racy by nature; fine for tests and local serving)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TritonServer:
    """A running tritonserver process on localhost ports; use as a context manager.

    Args:
        model_path: the Hugging Face model directory to serve (exported as ``TRITONLLM_MODEL``).
        model_repository: the Triton model repository (default: this project's).
        env: extra environment for the server and its Python stubs (e.g. engine settings).
        log_path: where the server's stdout/stderr go (default: a file in the temp dir).
    """

    model_path: Path | str | None = None
    model_repository: Path = MODEL_REPOSITORY
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--log-verbose=0",
        ]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        lib_paths = [str(p) for p in install.library_paths]
        lib_paths.append(sysconfig.get_config_var("LIBDIR") or "")
        if env.get("LD_LIBRARY_PATH"):
            lib_paths.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in lib_paths if p)
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
        log = open(self.log_path, "wb")  # noqa: SIM115 (kept open for the process' lifetime)
        self.process = subprocess.Popen(
            self.command(install),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environment(install),
            start_new_session=True,
        )
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited early:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n_chars: int = 6000) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")[-n_chars:]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after ``timeout`` s)."""
        import signal

        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> TritonServer:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
