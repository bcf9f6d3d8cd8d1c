"""What the routes share: server state, the served-model check, the disconnect watch and a
generation's lifecycle (``start_generation``, then ``collect_choices`` or ``sse.stream_response``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from ..errors import OpenAIError
from ..generation import Choice, Generation, to_openai_error
from ..protocol import SamplingFields
from ..triton_client import InputSpec, InputValue, TritonClient, TritonError

T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=SamplingFields)

# Starts, ends and aborts of requests whose client went away are not answered; nginx's code.
CLIENT_CLOSED_REQUEST = 499


@dataclass
class ServerState:
    """Per-app state: the shared Triton client, the served model name, how long a generation
    may go without a response (seconds; None: no limit), the generations in flight
    (``live``: started, not yet closed) and the model's tool-call parser."""

    client: TritonClient
    model_name: str
    stream_idle_timeout_s: float | None = None
    live: set[Generation] = field(default_factory=set)
    tool_call_parser: str = "hermes"  # tool_parsers.TOOL_PARSERS

    async def abort_all(self, timeout: float = 5.0) -> None:
        """Abort every generation in flight in the generator (on shutdown: their streams then
        end at once with finish_reason "abort" instead of holding the server open)."""
        live = list(self.live)
        await asyncio.gather(*(self.client.abort(gen.request_id, timeout) for gen in live))

    async def input_specs(self, prompt_param: str) -> Mapping[str, InputSpec]:
        """The ensemble's inputs. Raises: OpenAIError 503 when Triton is unavailable."""
        try:
            return await self.client.input_specs()
        except TritonError as exc:
            raise to_openai_error(exc, prompt_param) from exc


def get_state(request: Request) -> ServerState:
    """The app's ``ServerState`` (set by ``create_app``'s lifespan)."""
    return request.app.state.server


def check_model(state: ServerState, model: str | None) -> None:
    """Raises: OpenAIError 404 ``model_not_found`` for a model other than the served one."""
    if model is not None and model != state.model_name:
        raise OpenAIError(
            f"The model `{model}` does not exist.", 404, param="model", code="model_not_found"
        )


async def unless_disconnected(request: Request, awaitable: Awaitable[T], poll_s: float = 0.5) -> T:
    """Await ``awaitable``, cancelling it if the HTTP client disconnects meanwhile (checked
    every ``poll_s`` seconds).

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


async def start_generation(
    request: Request,
    body: RequestT,
    id_prefix: str,
    prompt_param: str,
    build_inputs: Callable[[RequestT, Mapping[str, InputSpec], bool], dict[str, InputValue]],
) -> Generation:
    """Check ``body``, send it to the ensemble and wait for its first response.

    The caller owns the returned generation and must end it with ``collect_choices`` or
    ``sse.stream_response``, which close it (abort in the backend if unfinished). With
    ``n > 1`` the backend always streams (its choices come as separate responses), also for a
    non-streamed request, whose choices are then assembled here.

    Args:
        id_prefix: ``chatcmpl`` or ``cmpl``; the completion id (= Triton request id) is
            ``{id_prefix}-{uuid4 hex}``.
        prompt_param: the request field prompt errors name (``messages`` or ``prompt``).
        build_inputs: ``(body, ensemble input specs, backend_stream)`` -> ensemble inputs.
    Raises:
        OpenAIError: 404 for another model; 400 for invalid or unsupported fields or a prompt
            the backend rejects (e.g. longer than the context); 503 when Triton is
            unavailable; 499 when the client went away first.
    """
    state = get_state(request)
    check_model(state, body.model)
    specs = await state.input_specs(prompt_param)
    inputs = build_inputs(body, specs, body.stream or body.n > 1)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    gen = Generation(
        state.client,
        request_id,
        inputs,
        prompt_param,
        n=body.n,
        logprobs=body.wants_logprobs,
        registry=state.live,
        idle_timeout_s=state.stream_idle_timeout_s,
    )
    try:
        await unless_disconnected(request, gen.start())
    except BaseException:
        gen.close()
        raise
    return gen


async def collect_choices(request: Request, gen: Generation) -> list[Choice]:
    """The choices of a started, non-streamed generation, which is closed afterwards.

    Raises:
        OpenAIError: a backend error (see ``Generation.deltas``); 499 if the client went away.
    """
    try:
        return await unless_disconnected(request, gen.collect())
    finally:
        gen.close()
