"""POST /v1/chat/completions: OpenAI chat JSON → ``llm`` ensemble (``messages``) → JSON or SSE."""

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
from ..protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    DeltaMessage,
)
from ..sampling import chat_inputs
from .common import SSE_DONE, check_model, get_state, sse, unless_disconnected

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletion | StreamingResponse:
    """Generate the assistant's reply; stream it as SSE chunks when ``stream`` is true."""
    state = get_state(request)
    check_model(state, body.model)
    specs = await state.input_specs("messages")
    inputs = chat_inputs(body, specs, backend_stream=body.stream)
    gen = Generation(state.client, f"chatcmpl-{uuid.uuid4().hex}", inputs, "messages")
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
    return ChatCompletion(
        id=gen.request_id,
        model=state.model_name,
        choices=[
            ChatChoice(message=AssistantMessage(content=text), finish_reason=gen.finish_reason)
        ],
        usage=gen.usage,
    )


async def _chunks(gen: Generation, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    skip = None if include_usage else {"usage"}

    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        body = ChatCompletionChunk(
            id=gen.request_id, created=created, model=model, choices=[choice]
        )
        return sse(body.model_dump_json(exclude=skip))

    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for text, finish_reason in gen.deltas():
            if text:
                yield chunk(DeltaMessage(content=text))
            if finish_reason:
                yield chunk(DeltaMessage(), finish_reason)
        if include_usage:
            usage = ChatCompletionChunk(
                id=gen.request_id, created=created, model=model, choices=[], usage=gen.usage
            )
            yield sse(usage.model_dump_json())
    except OpenAIError as exc:  # after the 200: report in-band, as OpenAI-compatible servers do
        yield sse(json.dumps(exc.body()))
    finally:
        gen.close()
    yield SSE_DONE
