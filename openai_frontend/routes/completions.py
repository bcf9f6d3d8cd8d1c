"""POST /v1/completions: a raw prompt → ``llm`` ensemble (``text_input``) → JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..errors import OpenAIError
from ..generation import Generation
from ..logprobs import completion_logprobs
from ..protocol import Completion, CompletionChoice, CompletionRequest
from ..sampling import completion_inputs
from ..structured import rename_param
from .common import collect_choices, get_state, start_generation
from .sse import ChunkEncoder, stream_response

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request
) -> Completion | StreamingResponse:
    """Continue the raw prompt (no chat template; ``n`` choices); stream SSE chunks when
    ``stream`` is true.

    Raises:
        OpenAIError: before the first byte (see ``start_generation``); later errors of a
            stream are sent in-band.
    """
    try:
        gen = await start_generation(request, body, "cmpl", "prompt", completion_inputs)
    except OpenAIError as exc:
        rename_param(exc, body, None)  # a constraint error names the client's field
        raise
    model = get_state(request).model_name
    if body.stream:
        template = Completion(id=gen.request_id, model=model, choices=[CompletionChoice(text="")])
        encoder = ChunkEncoder(template, body.include_usage)
        return stream_response(gen, _events(gen, encoder), encoder)
    choices = await collect_choices(request, gen)
    return Completion(
        id=gen.request_id,
        model=model,
        choices=[
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=completion_logprobs(c.logprobs)[0],
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ],
        usage=gen.usage,
    )


async def _events(gen: Generation, encoder: ChunkEncoder) -> AsyncGenerator[str, None]:
    # Every delta carries text (or logprobs), except possibly each choice's last, which carries
    # its finish_reason. text_offset continues across a choice's chunks.
    offsets = [0] * gen.n
    async for delta in gen.deltas():
        logprobs, offsets[delta.index] = completion_logprobs(delta.logprobs, offsets[delta.index])
        yield encoder.event(
            delta.finish_reason, index=delta.index, logprobs=logprobs, text=delta.text
        )
