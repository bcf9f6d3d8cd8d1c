"""Where the ``tritonserver`` binary comes from, and the environment it needs to run.

In order:

1. ``$TRITONSERVER`` (a path), with ``$TRITON_BACKEND_DIR`` for its backends;
2. ``tritonserver`` on ``PATH`` (NVIDIA's container, the GPU devpack), same backend rule, falling
   back to ``/opt/tritonserver/backends``;
3. the ``nvidia-pytriton`` 0.7.0 wheel, which carries Triton 2.51, its Python backend, one backend
   stub per Python version and its shared libraries (ARCHITECTURE.md, "Platform facts").

The Python backend stub runs on the environment of the first ``python3`` on ``PATH`` (it ignores
``PYTHONPATH``), so the server runs with this interpreter's ``bin/`` first on ``PATH``
(`server_paths`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


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
        import pytriton  # only located, never used for its API
    except ImportError:
        return None
    root = Path(pytriton.__file__).parent / "tritonserver"
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
