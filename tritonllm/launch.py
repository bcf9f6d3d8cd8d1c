"""``make serve``: tritonserver + the OpenAI sidecar, readiness, clean shutdown.

``python -m tritonllm.launch [--model PATH|HUB_ID] [--host 127.0.0.1] [--port 9000]
[--triton-host 127.0.0.1] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
[--on-failure restart|exit] [--drain-timeout 30] [--sidecar-workers 1]
[--generator-instances 1] [--tool-call-parser hermes|llama3_json]``

Without ``--model`` (or ``TRITONLLM_MODEL``) the built-in default, SmolLM2-135M-Instruct, is
served from ``models/smollm2-135m-instruct`` (converted once, on first use, by
``tritonllm.default_model`` in a child process). tritonserver runs on this project's
``model_repository`` with ``TRITONLLM_MODEL`` set; the sidecar (``python -m openai_frontend``)
runs as a child process. Both are started in their own process groups, so Ctrl-C / SIGTERM
reach only this launcher, which then stops the sidecar first and tritonserver (with its Python
stubs) second: no orphan processes.

Supervision (``supervisor.py``): when tritonserver dies, or the sidecar's end-to-end
``/health`` fails for ``--unhealthy-timeout`` seconds (or still fails ``--failed-timeout``
seconds after it said ``backend_failed``: a stub answered with an error), tritonserver is restarted
after an exponential backoff (a dead sidecar likewise); ``--on-failure exit`` instead stops
everything and exits 1, for a container whose orchestrator restarts it. SIGTERM drains: new requests get
503 while the ones in flight finish (up to ``--drain-timeout`` seconds), then both stop; Ctrl-C
(SIGINT) stops at once, aborting what is in flight. This process imports neither torch nor
transformers. ``--sidecar-workers N`` runs the sidecar as N processes on its one port
(``openai_frontend/workers.py``): still one child here, which exits non-zero, and is restarted,
when one of its workers dies. ``--generator-instances N`` serves the generator model as N
Triton instances (its instance_group count, set in a copy of the repository:
``triton_server.repository_with_instances``) sharing one engine process.

``--tool-call-parser`` (or ``TRITONLLM_TOOL_CALL_PARSER``) is the sidecar's: the served model's
tool-call syntax, parsed for ``tool_choice`` ``auto`` (``hermes``, its default, or
``llama3_json`` for Llama 3.x).

Ports and addresses: the OpenAI API on ``--host``:``--port`` (default 127.0.0.1:9000);
tritonserver's HTTP, gRPC and metrics endpoints on ``--triton-host`` (default 127.0.0.1) at
``--http-port`` / ``--grpc-port`` / ``--metrics-port`` (8000 / 8001 / 8002). Everything listens
on loopback only unless told otherwise: ``--host 0.0.0.0`` (or ``TRITONLLM_HOST=0.0.0.0``)
exposes the OpenAI API to the network, ``--triton-host 0.0.0.0`` (or
``TRITONLLM_TRITON_HOST=0.0.0.0``) tritonserver's.

Security (README): ``--api-key`` / ``TRITONLLM_API_KEY`` (comma-separated: several tenants)
reaches the sidecar in its environment, never on a command line, as does the control secret
the generator requires of aborts (generated per launcher start, like tritonserver's admin key).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .cli_types import positive_int, positive_seconds, seconds
from .default_model import DEFAULT_MODEL_DIR, is_converted
from .supervisor import FAILURE_POLICIES, SupervisePolicy, Supervisor
from .triton_server import (
    API_KEY_ENV,
    CONTROL_SECRET_ENV,
    DEFAULT_BIND_ADDRESS,
    MODEL_REPOSITORY,
    REPO_ROOT,
    TritonServer,
    connect_host,
)

# The child that converts the built-in model: ``python -m tritonllm.default_model --out DIR``.
DEFAULT_MODEL_BUILDER = ("-m", "tritonllm.default_model")
# API_KEY_ENV: the sidecar's API keys (comma-separated), read by the launcher and passed on in
# the sidecar's environment only (openai_frontend.security.API_KEY_ENV; tritonserver's drops it).
# Set by ``make serve API_KEY=...`` beside TRITONLLM_API_KEY: that key was given to make, so
# the user's shell does not have the variable the startup hint's curl command reads.
API_KEY_FROM_MAKE_ENV = "TRITONLLM_API_KEY_FROM_MAKE"
# The sidecar's --tool-call-parser choices (openai_frontend.tool_parsers.TOOL_PARSERS, held equal
# by a test: importing the sidecar here would load its whole app), and the variable that
# chooses one where the launcher's flags are fixed (a container's CMD).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
#: The sidecar's request limits the launcher passes on, as (flag, argparse type, help): the same
#: flag of ``python -m openai_frontend``; one not given leaves the sidecar's default.
SIDECAR_LIMITS = (
    ("--max-request-bytes", positive_int, "largest request body in bytes (larger: 413)"),
    (
        "--body-timeout",
        seconds,
        "seconds a request's body may take to arrive after its headers (slower: 408; 0: no limit)",
    ),
    (
        "--header-timeout",
        positive_seconds,
        "seconds a connection may take to send a request's headers (then it is closed)",
    ),
    (
        "--stream-idle-timeout",
        seconds,
        "seconds without a response from tritonserver before a generation fails (0: wait forever)",
    ),
)
TOOL_CALL_PARSER_ENV = "TRITONLLM_TOOL_CALL_PARSER"


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
        triton_log: tritonserver's log file (None: a temp file); restarts write
            ``NAME.1.log``, ``NAME.2.log``, ... beside it.
        policy: failure handling, health checks and the drain (``SupervisePolicy``).
        api_keys: the OpenAI API's keys (none: no authentication).
        api_keys_in_shell: the keys came from ``TRITONLLM_API_KEY`` as the user's shell
            exported it (not ``--api-key``, not ``make serve API_KEY=...``), so a command pasted
            into that shell can read it.
        cache_salt_from_api_key: a prefix cache of its own per API key.
        cors_origins: browser origins allowed to call the OpenAI API (none: CORS off).
        tensor_parallel_size: ranks the engine splits the model across
            (``TRITONLLM_TENSOR_PARALLEL_SIZE``; None: the repository's setting, 1).
        sidecar_workers: the sidecar's worker processes (its ``--workers``).
        tool_call_parser: the sidecar's ``--tool-call-parser`` (``TOOL_CALL_PARSERS``; None:
            the sidecar's default, hermes).
        generator_instances: the generator model's Triton instances (``TritonServer``'s
            ``generator_instances``).
        sidecar_limits: the ``SIDECAR_LIMITS`` flags given, as the sidecar's arguments
            (``--body-timeout=60.0``).
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
    policy: SupervisePolicy = SupervisePolicy()
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_keys_in_shell: bool = False
    cache_salt_from_api_key: bool = False
    cors_origins: tuple[str, ...] = ()
    tensor_parallel_size: int | None = None
    sidecar_workers: int = 1
    tool_call_parser: str | None = None
    generator_instances: int = 1
    sidecar_limits: tuple[str, ...] = ()

    @property
    def base_url(self) -> str:
        """The OpenAI base URL clients use (``http://HOST:PORT/v1``; a wildcard bind as local)."""
        return f"http://{connect_host(self.host)}:{self.port}/v1"

    @property
    def triton_endpoints(self) -> str:
        """tritonserver's endpoints as clients reach them (a wildcard bind as local): ``HTTP
        http://HOST:HTTP_PORT, gRPC HOST:GRPC_PORT, metrics http://HOST:METRICS_PORT/metrics``
        (gRPC as tritonclient takes it, without a scheme)."""
        host = connect_host(self.triton_host)
        return (
            f"HTTP http://{host}:{self.http_port}, gRPC {host}:{self.grpc_port}, "
            f"metrics http://{host}:{self.metrics_port}/metrics"
        )


def resolve_model(model: str | None) -> str:
    """The checkpoint to serve: a local directory (absolute path) or a hub id kept as is.

    With no model, converts the built-in default model once (``tritonllm.default_model``), in a
    child process: converting imports torch and transformers, which this process never holds.

    Raises:
        SystemExit: no model given and the default model could not be converted (e.g. its
            wheel is not installed; the child's message says how to install it).
    """
    if model is None:
        if not is_converted(DEFAULT_MODEL_DIR):
            command = [sys.executable, *DEFAULT_MODEL_BUILDER, "--out", str(DEFAULT_MODEL_DIR)]
            if subprocess.run(command, cwd=REPO_ROOT).returncode != 0:
                raise SystemExit(
                    f"error: could not convert the default model ({' '.join(command)})"
                )
        return str(DEFAULT_MODEL_DIR.resolve())
    path = Path(model).expanduser()
    # A path that does not exist is passed through: transformers resolves hub ids like
    # Qwen/Qwen3-0.6B where a hub is reachable.
    return str(path.resolve()) if path.exists() else model


def served_name(model: str) -> str:
    """The default served model name: a directory's basename, or the hub id itself."""
    path = Path(model)
    return path.name if path.is_absolute() and path.exists() else model


def sidecar_command(
    grpc_url: str,
    port: int,
    host: str = "127.0.0.1",
    model_name: str | None = None,
    drain_timeout_s: float | None = None,
    cache_salt_from_api_key: bool = False,
    cors_origins: tuple[str, ...] = (),
    triton_model: str | None = None,
    workers: int = 1,
    tool_call_parser: str | None = None,
    limits: tuple[str, ...] = (),
) -> list[str]:
    """The command line of the OpenAI sidecar (``python -m openai_frontend``): it calls the
    tritonserver gRPC endpoint ``grpc_url`` (``HOST:PORT``) and listens on ``host`` / ``port``;
    ``model_name`` / ``drain_timeout_s`` / ``triton_model`` (the ensemble it streams from) /
    ``tool_call_parser`` None leave the sidecar's defaults; ``workers`` > 1 adds ``--workers``
    (processes serving the port); ``limits`` are ``LaunchConfig.sidecar_limits``. Secrets (API
    keys, the control secret) are never on it: ``sidecar_env``."""
    command = [sys.executable, "-m", "openai_frontend", f"--triton-url={grpc_url}"]
    if triton_model is not None:
        command.append(f"--triton-model={triton_model}")
    if model_name is not None:
        command.append(f"--model-name={model_name}")
    if drain_timeout_s is not None:
        command.append(f"--drain-timeout={drain_timeout_s:g}")
    if cache_salt_from_api_key:
        command.append("--cache-salt-from-api-key")
    command += [f"--cors-allow-origin={origin}" for origin in cors_origins]
    if workers != 1:
        command.append(f"--workers={workers}")
    if tool_call_parser is not None:
        command.append(f"--tool-call-parser={tool_call_parser}")
    return command + list(limits) + [f"--host={host}", f"--port={port}"]


def sidecar_env(api_keys: tuple[str, ...], control_secret: str) -> dict[str, str]:
    """The sidecar's environment: this one with its API keys (``TRITONLLM_API_KEY``; none:
    removed) and the control secret (``TRITONLLM_CONTROL_SECRET``). A process' environment is
    readable by its own user only (/proc/PID/environ), unlike its command line."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    env.update({API_KEY_ENV: ",".join(api_keys)} if api_keys else {})
    return {**env, CONTROL_SECRET_ENV: control_secret}


class _Stop(Exception):
    """A signal asked the launcher to stop; ``graceful``: SIGTERM (drain) rather than SIGINT."""

    def __init__(self, graceful: bool) -> None:
        super().__init__("stop")
        self.graceful = graceful


def _raise_stop(signum: int, frame: object) -> None:
    # One stop only: `kill` of `make serve`'s process group reaches the launcher twice (once
    # directly, once forwarded by make), and the second must not interrupt the first's drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop(graceful=signum == signal.SIGTERM)


def _triton_factory(cfg: LaunchConfig, model: str, control_secret: str):
    """A function that makes the ``TritonServer`` of each (re)start: same ports and control
    secret (the sidecar keeps its own across tritonserver restarts), its own log."""
    starts = 0

    def new_triton() -> TritonServer:
        nonlocal starts
        log = cfg.triton_log
        if log is not None and starts > 0:
            log = log.with_name(f"{log.stem}.{starts}{log.suffix or '.log'}")
        starts += 1
        # TRITONLLM_MODEL goes through env (not model_path) so a hub id is not made a path.
        env = {"TRITONLLM_MODEL": model}
        if cfg.tensor_parallel_size is not None:
            env["TRITONLLM_TENSOR_PARALLEL_SIZE"] = str(cfg.tensor_parallel_size)
        return TritonServer(
            model_path=None,
            model_repository=MODEL_REPOSITORY,
            env=env,
            log_path=log,
            http_port=cfg.http_port,
            grpc_port=cfg.grpc_port,
            metrics_port=cfg.metrics_port,
            bind_address=cfg.triton_host,
            control_secret=control_secret,
            generator_instances=cfg.generator_instances,
        )

    return new_triton


def build_supervisor(cfg: LaunchConfig, model: str, model_name: str) -> Supervisor:
    """The ``Supervisor`` of ``cfg``'s tritonserver (serving ``model``) and sidecar (serving
    it as ``model_name``): what ``serve`` runs. Its ``new_triton().command(install)`` and
    ``sidecar_command`` are the two command lines (``docker/`` and ``deploy/`` run them
    through this launcher; their tests read them here)."""
    grpc_url = f"{connect_host(cfg.triton_host)}:{cfg.grpc_port}"
    command = sidecar_command(
        grpc_url,
        cfg.port,
        cfg.host,
        model_name,
        cfg.policy.drain_timeout_s,
        cfg.cache_salt_from_api_key,
        cfg.cors_origins,
        workers=cfg.sidecar_workers,
        tool_call_parser=cfg.tool_call_parser,
        limits=cfg.sidecar_limits,
    )
    health = cfg.base_url.removesuffix("/v1") + "/health"
    control_secret = os.environ.get(CONTROL_SECRET_ENV, "").strip() or secrets.token_hex(32)
    return Supervisor(
        _triton_factory(cfg, model, control_secret),
        command,
        health,
        cfg.policy,
        cfg.startup_timeout_s,
        REPO_ROOT,
        sidecar_env(cfg.api_keys, control_secret),
    )


def serve(cfg: LaunchConfig) -> int:
    """Start both processes, wait for health, print the base URL, supervise until a signal.

    Returns:
        0 after a SIGTERM (drained) or Ctrl-C shutdown; 1 when a process failed to start, or
        failed with ``on_failure="exit"``.
    """
    # SIGINT explicitly too: a job started in the background of a non-interactive shell inherits
    # SIGINT as ignored, and Ctrl-C / `kill -INT` must still stop both servers.
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    graceful = False
    supervisor: Supervisor | None = None
    try:
        model = resolve_model(cfg.model)
        model_name = cfg.model_name or served_name(model)
        supervisor = build_supervisor(cfg, model, model_name)
        print(f"starting tritonserver (model {model}) ...", flush=True)
        supervisor.start()
        print(_banner(cfg, model_name), flush=True)
        status = supervisor.run()
        print("shutting down after a failure (--on-failure exit)", file=sys.stderr, flush=True)
        return status
    except _Stop as stop:
        graceful = stop.graceful
        print("draining ..." if graceful else "shutting down ...", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"launch failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Ignore further signals while stopping, so the children are always reaped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.stop(graceful)
        print("stopped", flush=True)


def _banner(cfg: LaunchConfig, model_name: str) -> str:
    # The curl command reads the key from the shell it is pasted into, never printed (logs keep
    # the banner): the first of the comma-separated keys (QA: with several, "$TRITONLLM_API_KEY"
    # got a 401). A key from --api-key or make's API_KEY is not in that shell (QA: the pasted
    # command got a 401): the line before says to export it.
    auth, export = "", ""
    if cfg.api_keys:
        auth = f'-H "Authorization: Bearer ${{{API_KEY_ENV}%%,*}}" '
    if cfg.api_keys and not cfg.api_keys_in_shell:
        export = (
            f"the API key was given with --api-key (or make's API_KEY): first run `export "
            f"{API_KEY_ENV}=<your API key>` in the shell you paste into (make chat reads it too)\n"
        )
    return (
        f"OpenAI base URL: {cfg.base_url}\n"
        f"Triton endpoints: {cfg.triton_endpoints}\n"
        f"{export}"
        f"try: curl {cfg.base_url}/chat/completions -H 'Content-Type: application/json' {auth}"
        f'-d \'{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Hello"}}], '
        f'"max_tokens": 32}}\'\n'
        "Ctrl-C stops both servers (SIGTERM drains first)."
    )


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """The launcher's command line as a ``LaunchConfig``; exits with usage on bad flags."""
    p = argparse.ArgumentParser(prog="python -m tritonllm.launch", description=__doc__)
    p.add_argument(
        "--model",
        default=os.environ.get("TRITONLLM_MODEL") or None,
        help="HF model directory or hub id (default: $TRITONLLM_MODEL or SmolLM2-135M-Instruct)",
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
    p.add_argument(
        "--startup-timeout", type=positive_seconds, default=600.0, help="seconds per server"
    )
    p.add_argument("--triton-log", type=Path, default=None, help="tritonserver log file")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="ranks (GPUs) per model")
    defaults = SupervisePolicy()
    p.add_argument(
        "--on-failure",
        choices=FAILURE_POLICIES,
        default=os.environ.get("TRITONLLM_ON_FAILURE", defaults.on_failure),
        help="when tritonserver or the sidecar dies or stays unhealthy: restart it with "
        "backoff, or exit 1 for an orchestrator to restart (default: $TRITONLLM_ON_FAILURE "
        "or restart)",
    )
    p.add_argument(
        "--unhealthy-timeout",
        type=positive_seconds,
        default=defaults.unhealthy_timeout_s,
        help="seconds /health may fail in a row before it counts as a failure",
    )
    p.add_argument(
        "--failed-timeout",
        type=positive_seconds,
        default=defaults.failed_timeout_s,
        help="restart tritonserver when /health still fails this many seconds after reporting "
        "backend_failed (a stub answered with an error, e.g. a dead generator instance: Triton "
        "never repairs one); forgotten after as long without one",
    )
    p.add_argument(
        "--health-interval",
        type=positive_seconds,
        default=defaults.health_interval_s,
        help="seconds between health checks",
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds,
        default=defaults.drain_timeout_s,
        help="seconds SIGTERM lets requests in flight finish (new ones get 503)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"an API key of the OpenAI API (repeat for several tenants; default: "
        f"${API_KEY_ENV}, comma-separated, which keeps keys off the command line other local "
        "users can read; none: no authentication)",
    )
    p.add_argument(
        "--cache-salt-from-api-key",
        action="store_true",
        help="a prefix cache of its own per API key (tenants share no KV pages)",
    )
    p.add_argument(
        "--cors-allow-origin",
        action="append",
        default=[],
        help="a browser origin allowed to call the OpenAI API (repeat; none: CORS off)",
    )
    p.add_argument(
        "--sidecar-workers",
        type=int,
        default=1,
        help="processes of the OpenAI sidecar, serving its one port (default 1; more relay "
        "more streamed chunks per second, one CPU core each)",
    )
    p.add_argument(
        "--generator-instances",
        type=int,
        default=1,
        metavar="N",
        help="generator model instances (Triton instance_group) sharing one engine process: "
        "responses are sent from N Python stubs at once; needs the engine in its own process "
        "(the default on CUDA); default 1",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=os.environ.get(TOOL_CALL_PARSER_ENV) or None,
        help="the served model's tool-call syntax, parsed for tool_choice auto: hermes "
        "(Qwen2.5/Qwen3/Hermes <tool_call> blocks) or llama3_json (Llama 3.x); the sidecar's "
        f"flag (default: ${TOOL_CALL_PARSER_ENV}, else the sidecar's default, hermes)",
    )
    for flag, type_, help_ in SIDECAR_LIMITS:
        p.add_argument(flag, type=type_, default=None, help=f"{help_} (default: the sidecar's)")
    a = p.parse_args(argv)
    if a.sidecar_workers < 1:
        p.error(f"--sidecar-workers must be at least 1, got {a.sidecar_workers}")
    if a.tool_call_parser not in (None, *TOOL_CALL_PARSERS):  # argparse skips a default's check
        p.error(
            f"{TOOL_CALL_PARSER_ENV}={a.tool_call_parser}: not one of "
            f"{', '.join(TOOL_CALL_PARSERS)}"
        )
    if a.generator_instances < 1:
        p.error(f"--generator-instances must be at least 1, got {a.generator_instances}")
    engine_process = os.environ.get("TRITONLLM_ENGINE_PROCESS", "").strip().lower()
    if a.generator_instances > 1 and engine_process in ("0", "false", "no", "off"):
        p.error(
            f"--generator-instances {a.generator_instances} needs the engine in its own process,"
            f" which TRITONLLM_ENGINE_PROCESS={engine_process} turns off"
        )
    keys = ",".join(a.api_key or [os.environ.get(API_KEY_ENV, "")])
    api_keys = tuple(k.strip() for k in keys.split(",") if k.strip())
    if a.cache_salt_from_api_key and not api_keys:
        p.error("--cache-salt-from-api-key needs --api-key (or $TRITONLLM_API_KEY)")
    policy = SupervisePolicy(
        on_failure=a.on_failure,
        health_interval_s=a.health_interval,
        unhealthy_timeout_s=a.unhealthy_timeout,
        failed_timeout_s=a.failed_timeout,
        drain_timeout_s=a.drain_timeout,
    )
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
        policy=policy,
        api_keys=api_keys,
        api_keys_in_shell=bool(api_keys)
        and not a.api_key
        and not os.environ.get(API_KEY_FROM_MAKE_ENV),
        cache_salt_from_api_key=a.cache_salt_from_api_key,
        cors_origins=tuple(a.cors_allow_origin),
        tensor_parallel_size=a.tensor_parallel_size,
        sidecar_workers=a.sidecar_workers,
        tool_call_parser=a.tool_call_parser,
        generator_instances=a.generator_instances,
        sidecar_limits=tuple(
            f"{flag}={value}"
            for flag, _, _ in SIDECAR_LIMITS
            if (value := getattr(a, flag[2:].replace("-", "_"))) is not None
        ),
    )


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted; exits with ``serve``'s status."""
    sys.exit(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
