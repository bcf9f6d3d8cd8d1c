"""What the routes share: server state, the served-model check, the disconnect watch and a
generation's lifecycle (``start_generation``, then ``collect_choices`` or ``sse.stream_response``)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from ..errors import OpenAIError, unsupported
from ..generation import BackendProgress, Choice, Generation, to_openai_error
from ..protocol import SamplingFields
from ..security import request_cache_salt, tenant_of
from ..triton_client import InputSpec, InputValue, TritonClient, TritonError

log = logging.getLogger(__name__)
T = TypeVar("T")
# The model that answers the prompt limits (``tritonllm.contract.tensors.PROMPT_LIMITS``).
TOKENIZER_MODEL = "tokenizer"
RequestT = TypeVar("RequestT", bound=SamplingFields)

# Starts, ends and aborts of requests whose client went away are not answered; nginx's code.
CLIENT_CLOSED_REQUEST = 499


@dataclass
class ServerState:
    """Per-app state: the shared Triton client, the served model name, how long a generation
    may go without a response (seconds; None: no limit), the generations in flight
    (``live``: started, not yet closed), the model's tool-call parser, and
    ``cache_salt_from_api_key``: each API key's requests get their tenant's prefix-cache salt
    (``security.py``); ``created``: the model card's ``created`` (Unix seconds: when the
    sidecar started serving, ``create_app``)."""

    client: TritonClient
    model_name: str
    created: int
    stream_idle_timeout_s: float | None = None
    cache_salt_from_api_key: bool = False
    live: set[Generation] = field(default_factory=set)
    # The backend's latest response to any generation (health's evidence of progress).
    progress: BackendProgress = field(default_factory=BackendProgress)
    tool_call_parser: str = "hermes"  # tool_parsers.TOOL_PARSERS
    max_prompt_chars: int | None = None  # the tokenizer's limit, once fetched
    max_model_len: int | None = None  # the engine's context limit, once asked (tokens)
    # The health check (True: healthy) that tells Triton's own errors apart (503 or 500).
    backend_ok: Callable[[], Awaitable[bool]] | None = None

    async def prompt_chars_limit(self) -> int | None:
        """The most characters a prompt can have and still fit the context (the tokenizer
        model's ``prompt_limits`` answer, fetched once); None while Triton cannot say (the
        tokenizer model checks again anyway)."""
        if self.max_prompt_chars is None:
            inputs: dict[str, InputValue] = {"prompt_limits": True}
            try:
                outputs = await self.client.infer(TOKENIZER_MODEL, "prompt-limits", inputs)
            except TritonError as exc:
                log.warning("prompt limits unavailable: %s", exc.message)
                return None
            answer = outputs.get("limits_json")
            limits = json.loads(answer.reshape(-1)[0].decode() if answer is not None else "{}")
            self.max_prompt_chars = limits.get("max_prompt_chars")
        return self.max_prompt_chars

    async def context_limit(self) -> int | None:
        """The engine's ``max_model_len`` (tokens), asked of the generator once (a health
        probe's answer); None while it cannot be reached."""
        if self.max_model_len is None:
            try:
                info = await self.client.generator_info()
            except TritonError:
                return None
            if "max_model_len" in info:
                self.max_model_len = int(info["max_model_len"].reshape(-1)[0])
        return self.max_model_len

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


def prompt_chars(inputs: Mapping[str, InputValue]) -> int:
    """Characters of the prompt in ensemble ``inputs``: ``text_input``'s, or the sum of the
    ``messages``' text contents (fewer than the rendered prompt has, so a fair lower bound)."""
    text = inputs.get("text_input")
    if isinstance(text, str):
        return len(text)
    messages = inputs.get("messages")
    if not isinstance(messages, str):
        return 0
    contents = (m.get("content") for m in json.loads(messages) if isinstance(m, dict))
    return sum(len(c) for c in contents if isinstance(c, str))


async def check_prompt_chars(
    state: ServerState, inputs: Mapping[str, InputValue], prompt_param: str
) -> None:
    """Raises: OpenAIError 400 ``context_length_exceeded`` for a prompt with more characters
    than the context can hold, before anything is sent (``tokenization.prompt_limits``)."""
    limit = await state.prompt_chars_limit()
    count = prompt_chars(inputs)
    if limit is not None and count > limit:
        raise OpenAIError(
            f"the prompt has {count} characters: more than the model's context can hold",
            param=prompt_param,
            code="context_length_exceeded",
        )


def new_id(id_prefix: str) -> str:
    """A new completion id: ``{id_prefix}-{uuid4 hex}``."""
    return f"{id_prefix}-{uuid.uuid4().hex}"


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
    request_id: str | None = None,
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
        request_id: the Triton request id (default: a new completion id).
    Raises:
        OpenAIError: 404 for another model; 400 for invalid or unsupported fields or a prompt
            the backend rejects (e.g. longer than the context); 503 when Triton is
            unavailable; 499 when the client went away first.
    """
    state = get_state(request)
    check_model(state, body.model)
    specs = await state.input_specs(prompt_param)
    inputs = build_inputs(body, specs, body.stream or body.n > 1)
    tenant = tenant_of(request.scope) if state.cache_salt_from_api_key else None
    salt = request_cache_salt(tenant, body.cache_salt)
    if salt is not None:
        if "cache_salt" not in specs:
            raise unsupported("cache_salt")
        inputs["cache_salt"] = salt
    await check_prompt_chars(state, inputs, prompt_param)
    request_id = request_id or new_id(id_prefix)
    gen = Generation(
        state.client,
        request_id,
        inputs,
        prompt_param,
        n=body.n,
        logprobs=body.wants_logprobs,
        registry=state.live,
        idle_timeout_s=state.stream_idle_timeout_s,
        backend_ok=state.backend_ok,
        progress=state.progress,
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
