"""POST /v1/chat/completions: OpenAI chat JSON → ``llm`` ensemble (``messages``) → JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from ..generation import Generation
from ..logprobs import chat_logprobs
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
from .common import collect_choices, get_state, start_generation
from .sse import ChunkEncoder, stream_response

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletion | EventSourceResponse:
    """Generate the assistant's reply (``n`` of them); stream SSE chunks when ``stream``.

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
    choices = await collect_choices(request, gen)
    return ChatCompletion(
        id=gen.request_id,
        model=model,
        choices=[
            ChatChoice(
                index=i,
                message=AssistantMessage(content=c.text),
                logprobs=chat_logprobs(c.logprobs),
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ],
        usage=gen.usage,
    )


async def _events(gen: Generation, encoder: ChunkEncoder) -> AsyncGenerator[str, None]:
    # OpenAI's chunk sequence per choice: the role first, content deltas, then an empty delta
    # that carries finish_reason. Deltas are written as dicts: unset fields are left out, not
    # null. Content chunks carry the logprobs of their tokens (also when a token completes no
    # character yet and the content is "").
    for index in range(gen.n):
        yield encoder.event(index=index, delta={"role": "assistant", "content": ""})
    async for delta in gen.deltas():
        if delta.text or delta.logprobs:
            yield encoder.event(
                index=delta.index,
                logprobs=chat_logprobs(delta.logprobs),
                delta={"content": delta.text},
            )
        if delta.finish_reason:
            yield encoder.event(delta.finish_reason, index=delta.index, delta={})
