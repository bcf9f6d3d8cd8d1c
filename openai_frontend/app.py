"""The FastAPI app factory and the sidecar's command line.

``python -m openai_frontend --triton-url 127.0.0.1:8001 --model-name NAME --port 9000
[--workers N [--worker-timeout S]]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from tritonllm.cli_types import positive_int, positive_seconds, seconds

from . import chat_page, health, metrics, workers
from .body_limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, BodyLimits
from .drain import DrainGate, DrainState, server_class
from .errors import install_error_handlers
from .openapi import install_openapi
from .routes import chat, completions, models, tokenize
from .routes.common import ServerState
from .security import (
    API_KEY_ENV,
    CONTROL_SECRET_ENV,
    DEFAULT_HEADER_TIMEOUT_S,
    ApiKeyAuth,
    header_timeout_protocol,
    parse_api_keys,
)
from .tool_parsers import TOOL_PARSERS
from .triton_client import TritonClient

# Longer than any silence a healthy backend has (a fresh GPU machine compiles its prefill
# kernels on the first request: ARCHITECTURE.md, "Platform facts", FlashInfer), short enough
# that a request whose generator died does not hang its client forever.
DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0
# Seconds SIGTERM lets the generations in flight finish (openai_frontend/drain.py).
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def create_app(
    triton_url: str,
    model_name: str,
    triton_model: str = "llm_fused",
    generator_model: str = "generator",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
    stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    api_keys: tuple[str, ...] = (),
    cors_origins: tuple[str, ...] = (),
    cache_salt_from_api_key: bool = False,
    control_secret: str | None = None,
    tool_call_parser: str = "hermes",
    heartbeat_fd: int | None = None,
    generator_lease: str | None = None,
    created: int | None = None,
) -> FastAPI:
    """An OpenAI-compatible app in front of the Triton ensemble at ``triton_url`` (gRPC).

    Args:
        triton_url: ``host:port`` of tritonserver's gRPC endpoint.
        model_name: the name clients use in ``model`` (others get 404 ``model_not_found``).
        triton_model: the ensemble to call; ``generator_model``: the model that takes aborts.
        max_request_bytes: larger bodies (announced or received) get a 413 OpenAI error.
        body_timeout_s: a body not received whole within this many seconds of its request's
            headers gets a 408 OpenAI error and its connection is closed; None: no limit.
        stream_idle_timeout_s: a generation that gets no response from Triton for this many
            seconds fails (and is aborted) instead of waiting forever, e.g. when the
            generator's stub process died; None: no limit.
        drain_timeout_s: seconds SIGTERM lets the generations in flight finish, new requests
            getting 503 meanwhile (0: abort them at once; ``drain.py``).
        api_keys: when any, every route but ``/health`` and ``/`` needs one of them as
            ``Authorization: Bearer <key>`` (``security.ApiKeyAuth``); each key is a tenant.
        cors_origins: browser origins allowed to call the API (CORS, with any request header);
            none: no CORS headers.
        cache_salt_from_api_key: each tenant gets its own prefix cache (``security.py``).
        control_secret: the generator's control secret, sent with every abort (the server's
            ``TRITONLLM_CONTROL_SECRET``).
        tool_call_parser: the model family's tool-call syntax (``tool_parsers.TOOL_PARSERS``).
        heartbeat_fd: a worker of ``--workers``: the write end of its heartbeat pipe, beaten
            while the app runs (``workers.send_heartbeats``); None: no heartbeat.
        generator_lease: the generator lease id to hold (None: a random one;
            ``TritonClient``).
        created: the model card's ``created`` (Unix seconds; None: now, when this app is
            made), so that ``GET /v1/models`` answers the same time every call.
    Raises:
        ValueError: ``cache_salt_from_api_key`` without ``api_keys``, or an unknown
            ``tool_call_parser``.
    """
    if cache_salt_from_api_key and not api_keys:
        raise ValueError("cache_salt_from_api_key needs API keys")
    if tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {tool_call_parser!r}")
    started = int(time.time()) if created is None else created

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Started first and cancelled last: the parent watches the worker's whole startup and
        # shutdown (the aborts of its generations included).
        heartbeat = None
        if heartbeat_fd is not None:
            heartbeat = asyncio.create_task(workers.send_heartbeats(heartbeat_fd))
        # The gRPC channel binds to the running event loop, so it is made here, not at import.
        client = TritonClient(
            triton_url, triton_model, generator_model, control_secret, generator_lease
        )
        client.start_lease()  # this process' death then aborts its generations
        app.state.server = state = ServerState(
            client=client,
            model_name=model_name,
            created=started,
            stream_idle_timeout_s=stream_idle_timeout_s,
            cache_salt_from_api_key=cache_salt_from_api_key,
            tool_call_parser=tool_call_parser,
        )
        app.state.health = monitor = health.HealthMonitor(client, state.live, state.progress)
        state.backend_ok = monitor.ok
        watch = health.BackendWatch(app.state.health)
        watch.start()
        try:
            yield
        finally:
            await watch.stop()
            await client.close()
            if heartbeat is not None:
                heartbeat.cancel()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan)
    app.state.server = None  # the lifespan sets it (the gRPC channel needs the running loop)
    install_error_handlers(app)
    install_openapi(app)

    app.state.drain = DrainState(timeout_s=drain_timeout_s)
    app.add_middleware(BodyLimits, max_bytes=max_request_bytes, timeout_s=body_timeout_s)
    if api_keys:  # before the body is read; after CORS, so a browser can read a 401
        app.add_middleware(ApiKeyAuth, api_keys=api_keys)
    if cors_origins:  # answers preflights (which carry no key) itself
        # Any request header, as vLLM allows: the openai SDKs send their own (x-stainless-*,
        # openai-organization, openai-project, openai-beta, ...), and a header grants nothing
        # here (the API key is still checked); the origin list is what CORS restricts.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    app.add_middleware(DrainGate, state=app.state.drain)  # refuses before reading
    modules = (chat, completions, models, tokenize, health, chat_page, metrics)
    routers = tuple(module.router for module in modules)
    # FastAPI's own (/openapi.json) and ours, for the metrics' route label of an answer the
    # middleware gives before routing (none of ours has a prefix: their paths are full).
    served = [*app.router.routes, *(route for router in routers for route in router.routes)]
    app.add_middleware(metrics.RequestMetrics, routes=served)  # outermost: counts every answer
    for router in routers:
        app.include_router(router)
    return app


def default_model_name(model: str | None) -> str:
    """The served name of a model path (its directory's basename) or hub id (kept whole)."""
    model = model or os.environ.get("TRITONLLM_MODEL")
    if not model:
        return "llm"
    path = Path(model)
    return path.resolve().name if path.exists() else model


def _worker_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > workers.HEARTBEAT_INTERVAL_S:
        raise argparse.ArgumentTypeError(
            f"must be more than {workers.HEARTBEAT_INTERVAL_S:g} s (a worker's heartbeat "
            f"interval), got {text}"
        )
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The sidecar's flags; exits with usage on bad flags (``--workers`` below 1, and
    ``--worker-timeout`` not above the heartbeat interval, included)."""
    p = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__)
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="tritonserver gRPC host:port")
    p.add_argument(
        "--model-name", default=None, help="served model name (default: --model's basename)"
    )
    p.add_argument("--model", default=None, help="the served checkpoint (only names the model)")
    p.add_argument(
        "--triton-model",
        default="llm_fused",
        help="the ensemble to call (llm_fused: the generator makes the text; llm: through the "
        "detokenizer step)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="sidecar processes serving the one port (default 1: this process alone; more: "
        "this process binds the port and supervises them, openai_frontend/workers.py)",
    )
    p.add_argument(
        "--worker-timeout",
        type=_worker_timeout,
        default=workers.DEFAULT_WORKER_TIMEOUT_S,
        help="with several --workers: seconds a worker's event loop may go without its "
        "heartbeat (one a second) before the worker is killed and the sidecar exits 1, for its "
        f"supervisor to restart it (default {workers.DEFAULT_WORKER_TIMEOUT_S:g}; the first "
        f"heartbeat, after the worker's startup, may take {workers.WORKER_STARTUP_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve the listening socket of this inherited file descriptor instead of binding "
        "--host/--port (what --workers gives each worker)",
    )
    p.add_argument(
        "--heartbeat-fd",
        type=int,
        default=None,
        help="write a byte every second to this inherited pipe while the event loop runs "
        "(what --workers gives each worker, to see that it is not hung)",
    )
    p.add_argument(
        "--generator-lease",
        default=None,
        help="the generator lease id to hold (what --workers gives each worker, so as to end "
        "the lease of one it killed; default: a random one)",
    )
    p.add_argument(
        "--created",
        type=int,
        default=None,
        help="the model card's created, Unix seconds (what --workers gives each worker, so "
        "that all answer the same; default: when this process starts serving)",
    )
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest accepted request body in bytes (larger: 413)",
    )
    p.add_argument(
        "--body-timeout",
        type=seconds,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's whole body may take to arrive after its headers (slower: 408 "
        f"and the connection closed; 0: no limit; default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=seconds,
        default=DEFAULT_STREAM_IDLE_TIMEOUT_S,
        help="seconds without any response from Triton after which a generation fails "
        "(0: wait forever; the default allows a first request's kernel compilation)",
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="seconds SIGTERM lets requests in flight finish while new ones get 503 "
        "(0: abort them at once, as SIGINT does)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"an API key clients must send as 'Authorization: Bearer KEY' (repeat, or "
        f"comma-separate, for several tenants; default: ${API_KEY_ENV}, which keeps the keys "
        "off the command line; none: no authentication)",
    )
    p.add_argument(
        "--cache-salt-from-api-key",
        action="store_true",
        help="give each API key its own prefix cache (no KV pages or cached_tokens shared "
        "across keys)",
    )
    p.add_argument(
        "--cors-allow-origin",
        action="append",
        default=[],
        help="a browser origin allowed to call the API, e.g. https://chat.example.com "
        "(repeat for several; none: CORS off)",
    )
    p.add_argument(
        "--header-timeout",
        type=positive_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a connection may take to send a request's headers (idle connections "
        "and half-sent requests are closed after it)",
    )
    p.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=sorted(TOOL_PARSERS),
        help="the served model's tool-call syntax (hermes: Qwen2.5/Qwen3/Hermes <tool_call> "
        "blocks, also this service's rendering for templates without tools)",
    )
    return p.parse_args(argv)


def _sockets(args: argparse.Namespace) -> list[socket.socket]:
    """The listening sockets to serve, one per worker: ``--fd``'s (shared by the workers), or
    with several ``--workers`` new ones on ``--host``/``--port``; none: uvicorn binds.

    Raises:
        SystemExit: the descriptor is no socket, or the address cannot be bound.
    """
    try:
        if args.fd is not None:
            return [socket.socket(fileno=args.fd)] * args.workers
        if args.workers > 1:
            return workers.listening_sockets(args.host, args.port, args.workers)
    except OSError as exc:
        where = f"--fd {args.fd}" if args.fd is not None else f"{args.host}:{args.port}"
        raise SystemExit(f"error: cannot listen on {where}: {exc}") from None
    return []


def main(argv: list[str] | None = None) -> None:
    """Run the sidecar with uvicorn until SIGINT (at once) or SIGTERM (after draining); with
    ``--workers`` N > 1, run N of them on one port (``workers.py``) and exit with their
    status."""
    import uvicorn

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    name = args.model_name or default_model_name(args.model)
    keys = parse_api_keys(",".join(args.api_key or [os.environ.get(API_KEY_ENV, "")]))
    if args.cache_salt_from_api_key and not keys:
        raise SystemExit("error: --cache-salt-from-api-key needs --api-key")
    control_secret = os.environ.get(CONTROL_SECRET_ENV, "").strip() or None
    sockets = _sockets(args)
    created = int(time.time()) if args.created is None else args.created
    if args.workers > 1:
        end_lease = functools.partial(workers.end_lease, args.triton_url, control_secret)
        worker_argv = [*argv, f"--created={created}"]
        sys.exit(workers.serve(worker_argv, sockets, args.worker_timeout, end_lease))
    app = create_app(
        args.triton_url,
        name,
        args.triton_model,
        max_request_bytes=args.max_request_bytes,
        body_timeout_s=args.body_timeout or None,
        stream_idle_timeout_s=args.stream_idle_timeout or None,
        drain_timeout_s=args.drain_timeout,
        api_keys=keys,
        cors_origins=tuple(args.cors_allow_origin),
        cache_salt_from_api_key=args.cache_salt_from_api_key,
        control_secret=control_secret,
        tool_call_parser=args.tool_call_parser,
        heartbeat_fd=args.heartbeat_fd,
        generator_lease=args.generator_lease,
        created=created,
    )
    protocol = header_timeout_protocol(args.header_timeout)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, http=protocol
    )
    try:
        server_class()(config, app).run(sockets=sockets or None)
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it stopped on, after its shutdown. Python then exits by
        # that signal as before (the exit status a worker pool expects), without printing the
        # traceback of a stop that was asked for.
        sys.excepthook = lambda *_: None
        raise
