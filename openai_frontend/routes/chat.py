"""POST /v1/chat/completions: OpenAI chat JSON → ``llm`` ensemble (``messages``) → JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

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
from .common import collect_text, get_state, start_generation
from .sse import ChunkEncoder, stream_response

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletion | StreamingResponse:
    """Generate the assistant's reply; stream it as SSE chunks when ``stream`` is true.

    Raises:
        OpenAIError: before the first byte (see ``start_generation``); later errors of a
            stream are sent in-band.
    """
    gen = await start_generation(request, body, "chatcmpl", "messages", chat_inputs)
    model = get_state(request).model_name
    if body.stream:
        choice = ChatChunkChoice(delta=DeltaMessage())
        template = ChatCompletionChunk(id=gen.request_id, model=model, choices=[choice])
        encoder = ChunkEncoder(template, body.include_usage)
        return stream_response(gen, _events(gen, encoder), encoder)
    text = await collect_text(request, gen)
    return ChatCompletion(
        id=gen.request_id,
        model=model,
        choices=[
            ChatChoice(message=AssistantMessage(content=text), finish_reason=gen.finish_reason)
        ],
        usage=gen.usage,
    )


async def _events(gen: Generation, encoder: ChunkEncoder) -> AsyncIterator[str]:
    # OpenAI's chunk sequence: the role first, content deltas, then an empty delta that carries
    # finish_reason. Deltas are written as dicts: unset fields are left out, not null.
    yield encoder.event(delta={"role": "assistant", "content": ""})
    async for text, finish_reason in gen.deltas():
        if text:
            yield encoder.event(delta={"content": text})
        if finish_reason:
            yield encoder.event(finish_reason, delta={})
