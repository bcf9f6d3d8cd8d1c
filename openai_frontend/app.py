"""The FastAPI app factory and the sidecar's command line.

``python -m openai_frontend --triton-url 127.0.0.1:8001 --model-name NAME --port 9000``
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import OpenAIError, install_error_handlers
from .routes import chat, completions, models
from .routes.common import ServerState
from .triton_client import TritonClient

# Largest request body accepted (bytes). Far above any prompt a 128k-token context can take, and
# small enough that tokenizing a rejected giant prompt cannot stall other requests for seconds.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


class BodySizeLimit:
    """ASGI middleware: a body larger than ``max_bytes`` (by Content-Length) gets a 413 OpenAI
    error before the app reads it.

    A plain ASGI middleware on purpose: Starlette's ``@app.middleware("http")``
    (``BaseHTTPMiddleware``) hides the client's disconnect from ``Request.is_disconnected()``
    inside the routes, so a non-streamed request whose client went away would never be aborted.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_bytes:
                response = OpenAIError(
                    f"request body of {int(length)} bytes exceeds the limit of "
                    f"{self.max_bytes} bytes",
                    status=413,
                    code="request_too_large",
                ).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    triton_url: str,
    model_name: str,
    triton_model: str = "llm",
    generator_model: str = "generator",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """An OpenAI-compatible app in front of the Triton ensemble at ``triton_url`` (gRPC).

    Args:
        triton_url: ``host:port`` of tritonserver's gRPC endpoint.
        model_name: the name clients use in ``model`` (others get 404 ``model_not_found``).
        triton_model: the ensemble to call; ``generator_model``: the model that takes aborts.
        max_request_bytes: larger bodies (by Content-Length) get a 413 OpenAI error.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The gRPC channel binds to the running event loop, so it is made here, not at import.
        client = TritonClient(triton_url, triton_model, generator_model)
        app.state.server = ServerState(client=client, model_name=model_name)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan)
    install_error_handlers(app)

    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    for router in (chat.router, completions.router, models.router):
        app.include_router(router)
    return app


def default_model_name(model: str | None) -> str:
    """The served name of a model path (its directory's basename) or hub id (kept whole)."""
    model = model or os.environ.get("TRITONLLM_MODEL")
    if not model:
        return "llm"
    path = Path(model)
    return path.resolve().name if path.exists() else model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The sidecar's flags; exits with usage on bad flags."""
    p = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__)
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="tritonserver gRPC host:port")
    p.add_argument(
        "--model-name", default=None, help="served model name (default: --model's basename)"
    )
    p.add_argument("--model", default=None, help="the served checkpoint (only names the model)")
    p.add_argument("--triton-model", default="llm", help="the ensemble to call")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest accepted request body in bytes (larger: 413)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the sidecar with uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    name = args.model_name or default_model_name(args.model)
    app = create_app(
        args.triton_url, name, args.triton_model, max_request_bytes=args.max_request_bytes
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
