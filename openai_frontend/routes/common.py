"""What the routes share: server state, the served-model check, SSE framing, disconnect watch."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from ..errors import OpenAIError
from ..generation import to_openai_error
from ..triton_client import InputSpec, TritonClient, TritonError

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
# Starts, ends and aborts of requests whose client went away are not answered; nginx's code.
CLIENT_CLOSED_REQUEST = 499


@dataclass
class ServerState:
    """Per-app state: the shared Triton client and the served model name."""

    client: TritonClient
    model_name: str

    async def input_specs(self, prompt_param: str) -> Mapping[str, InputSpec]:
        """The ensemble's inputs. Raises: OpenAIError 503 when Triton is unavailable."""
        try:
            return await self.client.input_specs()
        except TritonError as exc:
            raise to_openai_error(exc, prompt_param) from exc


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def check_model(state: ServerState, model: str | None) -> None:
    """Raises: OpenAIError 404 ``model_not_found`` for a model other than the served one."""
    if model is not None and model != state.model_name:
        raise OpenAIError(
            f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
        )


def sse(payload: str) -> str:
    """One server-sent event carrying ``payload`` (a JSON document)."""
    return f"data: {payload}\n\n"


async def unless_disconnected(request: Request, awaitable: Awaitable[T], poll_s: float = 0.5) -> T:
    """Await ``awaitable``, cancelling it if the HTTP client disconnects meanwhile.

    Starlette cancels streaming bodies on disconnect, but not plain handlers; this gives the
    waits before the first byte (and whole non-streaming requests) the same behaviour.

    Raises:
        OpenAIError: status 499 when the client went away (the body is never read).
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise OpenAIError("client disconnected", CLIENT_CLOSED_REQUEST)
    finally:
        if not task.done():
            task.cancel()
