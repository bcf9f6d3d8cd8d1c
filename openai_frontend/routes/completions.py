"""POST /v1/completions: a raw prompt → ``llm`` ensemble (``text_input``) → JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..generation import Generation
from ..protocol import Completion, CompletionChoice, CompletionRequest
from ..sampling import completion_inputs
from .common import collect_text, get_state, start_generation
from .sse import ChunkEncoder, stream_response

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request
) -> Completion | StreamingResponse:
    """Continue the raw prompt (no chat template); stream SSE chunks when ``stream`` is true.

    Raises:
        OpenAIError: before the first byte (see ``start_generation``); later errors of a
            stream are sent in-band.
    """
    gen = await start_generation(request, body, "cmpl", "prompt", completion_inputs)
    model = get_state(request).model_name
    if body.stream:
        template = Completion(id=gen.request_id, model=model, choices=[CompletionChoice(text="")])
        encoder = ChunkEncoder(template, body.include_usage)
        return stream_response(gen, _events(gen, encoder), encoder)
    text = await collect_text(request, gen)
    return Completion(
        id=gen.request_id,
        model=model,
        choices=[CompletionChoice(text=text, finish_reason=gen.finish_reason)],
        usage=gen.usage,
    )


async def _events(gen: Generation, encoder: ChunkEncoder) -> AsyncIterator[str]:
    # Every delta carries text, except possibly the last, which carries finish_reason.
    async for text, finish_reason in gen.deltas():
        yield encoder.event(finish_reason, text=text)
