"""POST /v1/completions: a raw prompt → ``llm`` ensemble (``text_input``) → JSON or SSE."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ..errors import OpenAIError
from ..generation import Generation
from ..protocol import Completion, CompletionChoice, CompletionRequest
from ..sampling import completion_inputs
from .common import SSE_DONE, check_model, get_state, sse, unless_disconnected

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request
) -> Completion | StreamingResponse:
    """Continue the raw prompt (no chat template); stream SSE chunks when ``stream`` is true."""
    state = get_state(request)
    check_model(state, body.model)
    specs = await state.input_specs("prompt")
    inputs = completion_inputs(body, specs, backend_stream=body.stream)
    gen = Generation(state.client, f"cmpl-{uuid.uuid4().hex}", inputs, "prompt")
    try:
        await unless_disconnected(request, gen.start())
        if body.stream:
            return StreamingResponse(
                _chunks(gen, state.model_name, body.include_usage),
                media_type="text/event-stream",
                background=BackgroundTask(gen.close),
            )
        text = await unless_disconnected(request, gen.collect())
    except BaseException:
        gen.close()
        raise
    gen.close()
    return Completion(
        id=gen.request_id,
        model=state.model_name,
        choices=[CompletionChoice(text=text, finish_reason=gen.finish_reason)],
        usage=gen.usage,
    )


async def _chunks(gen: Generation, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    skip = None if include_usage else {"usage"}

    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        body = Completion(id=gen.request_id, created=created, model=model, choices=[choice])
        return sse(body.model_dump_json(exclude=skip))

    try:
        async for text, finish_reason in gen.deltas():
            if text or finish_reason:
                yield chunk(text, finish_reason)
        if include_usage:
            usage = Completion(
                id=gen.request_id, created=created, model=model, choices=[], usage=gen.usage
            )
            yield sse(usage.model_dump_json())
    except OpenAIError as exc:  # after the 200: report in-band, as OpenAI-compatible servers do
        yield sse(json.dumps(exc.body()))
    finally:
        gen.close()
    yield SSE_DONE
