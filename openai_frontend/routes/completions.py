"""POST /v1/completions: raw prompts → ``llm`` ensemble (``text_input`` or ``input_ids``) →
JSON or SSE.

Each prompt of the request is its own Triton request (id ``{completion id}-{prompt index}``)
of ``n`` choices; they run concurrently and their choices are numbered prompt-major,
``prompt_index * n + i``, as OpenAI numbers them. Usage sums the prompts' token counts. With
``echo`` each choice's text starts with its prompt, and with ``logprobs`` too its logprobs start
with the prompt's tokens, the first of which has null ``token_logprobs`` / ``top_logprobs``
(nothing predicts it); the prompt is then scored in prefill (``prompt_logprobs`` in the engine),
which takes no prefix from the prefix cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from tritonllm.contract import limits

from ..errors import OpenAIError
from ..generation import Delta, Generation
from ..logprobs import completion_logprobs
from ..protocol import Completion, CompletionChoice, CompletionRequest, PromptTokensDetails, Usage
from ..sampling import completion_inputs
from ..structured import rename_param
from .common import collect_choices, get_state, new_id, start_generation
from .sse import ChunkEncoder, stream_response

router = APIRouter()


class Generations:
    """The generations of one completions request, one per prompt (``Streamed``)."""

    def __init__(self, gens: list[Generation]) -> None:
        self.gens = gens

    @property
    def usage(self) -> Usage:
        """The prompts' token counts summed."""
        usages = [gen.usage for gen in self.gens]
        prompt = sum(u.prompt_tokens for u in usages)
        completion = sum(u.completion_tokens for u in usages)
        cached = sum(
            u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details
        )
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def close(self) -> None:
        """Close every generation (abort those unfinished)."""
        for gen in self.gens:
            gen.close()


def _check_output_tokens(body: CompletionRequest, num_prompts: int) -> None:
    """The per-request cap on output tokens (``limits.MAX_REQUEST_OUTPUT_TOKENS``, which the
    generator holds each prompt's ``n x max_tokens`` to), over all of a request's prompts:
    each prompt is a generation of its own, so a list of 64 prompts would otherwise ask for 64
    times the cap in one request.

    Raises:
        OpenAIError: 400 ``invalid_value`` naming ``max_tokens``.
    """
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = limits.DEFAULT_COMPLETION_MAX_TOKENS  # what the generations are sent
    total = num_prompts * body.n * max_tokens
    if total > limits.MAX_REQUEST_OUTPUT_TOKENS:
        raise OpenAIError(
            f"{num_prompts} prompts x n ({body.n}) x max_tokens ({max_tokens}) = {total} "
            f"exceeds the limit of {limits.MAX_REQUEST_OUTPUT_TOKENS} output tokens per request",
            param="max_tokens",
            code="invalid_value",
        )


async def _start_all(request: Request, body: CompletionRequest, request_id: str) -> Generations:
    """Start one generation per prompt, concurrently. Raises: the first prompt's error (by
    prompt order); every generation is closed then."""
    prompts = body.prompts
    if len(prompts) > 1:
        _check_output_tokens(body, len(prompts))

    def inputs_of(prompt: str | list[int]) -> Any:
        return lambda req, specs, stream: completion_inputs(req, specs, stream, prompt)

    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    tasks = [
        asyncio.ensure_future(
            start_generation(request, body, "cmpl", "prompt", inputs_of(p), request_id=rid)
        )
        for p, rid in zip(prompts, ids, strict=True)
    ]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    gens = [r for r in results if isinstance(r, Generation)]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        Generations(gens).close()
        if isinstance(failure, OpenAIError):
            rename_param(failure, body, None)  # a constraint error names the client's field
        raise failure
    return Generations(gens)


def _choice_logprobs(body: CompletionRequest, delta: Any) -> list[dict[str, Any]] | None:
    """The chat-format entries a choice's (delta's) completions logprobs come from: with echo,
    the prompt's first."""
    if delta.logprobs is None:
        return None
    if body.echo and delta.prompt_logprobs is not None:
        return [*delta.prompt_logprobs, *delta.logprobs]
    return delta.logprobs


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request
) -> Completion | EventSourceResponse:
    """Continue each raw prompt (no chat template; ``n`` choices each); stream SSE chunks
    when ``stream`` is true.

    Raises:
        OpenAIError: before the first byte (see ``start_generation``; a prompt's error names
            ``prompt``); later errors of a stream are sent in-band.
    """
    completion_id = new_id("cmpl")
    gens = await _start_all(request, body, completion_id)
    model = get_state(request).model_name
    rename = lambda exc: rename_param(exc, body, None)  # noqa: E731  # the client's field
    if body.stream:
        template = Completion(id=completion_id, model=model, choices=[CompletionChoice(text="")])
        prompt_usage = gens.usage if body.continuous_usage else None
        encoder = ChunkEncoder(template, body.include_usage, prompt_usage)
        return stream_response(gens, _events(body, gens, encoder), encoder, rename)
    try:
        per_prompt = await asyncio.gather(*(collect_choices(request, g) for g in gens.gens))
    except OpenAIError as exc:  # a choice's constraint failed while generating
        rename(exc)
        raise
    finally:
        gens.close()
    choices = []
    for p, prompt_choices in enumerate(per_prompt):
        for i, c in enumerate(prompt_choices):
            logprobs = completion_logprobs(_choice_logprobs(body, c))[0]
            index = p * body.n + i
            choice = CompletionChoice(
                index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason
            )
            choices.append(choice)
    return Completion(id=completion_id, model=model, choices=choices, usage=gens.usage)


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """``(prompt index, delta)`` of every generation, as they come. Raises: the first error
    of any of them (the others are then left to ``close``)."""
    if len(gens) == 1:
        async for delta in gens[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | None | BaseException]] = asyncio.Queue()

    async def pump(p: int, gen: Generation) -> None:
        try:
            async for delta in gen.deltas():
                await queue.put((p, delta))
            await queue.put((p, None))
        except Exception as exc:
            await queue.put((p, exc))

    tasks = [asyncio.ensure_future(pump(p, g)) for p, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            p, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:
        for task in tasks:
            task.cancel()


async def _events(
    body: CompletionRequest, gens: Generations, encoder: ChunkEncoder
) -> AsyncGenerator[str, None]:
    # Every delta carries text (or logprobs), except possibly each choice's last, which carries
    # its finish_reason. text_offset continues across a choice's chunks.
    n = body.n
    offsets = [0] * (n * len(gens.gens))
    async for p, delta in _merged(gens.gens):
        index = p * n + delta.index
        entries = _choice_logprobs(body, delta)
        logprobs, offsets[index] = completion_logprobs(entries, offsets[index])
        yield encoder.event(
            delta.finish_reason,
            index=index,
            logprobs=logprobs,
            num_output_tokens=delta.num_output_tokens,
            text=delta.text,
        )
