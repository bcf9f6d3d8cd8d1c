"""Server-sent events of a streamed completion: chunk JSON, in-band errors, ``[DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from ..errors import OpenAIError
from ..generation import Generation
from ..protocol import Usage

SSE_DONE = "data: [DONE]\n\n"


def _dumps(payload: Any) -> str:
    # Same bytes as pydantic's model_dump_json: compact separators, UTF-8 kept as is.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload: str) -> str:
    """One server-sent event carrying ``payload`` (a JSON document)."""
    return f"data: {payload}\n\n"


class ChunkEncoder:
    """The events of one stream's chunks, from a template chunk.

    The template (id, object, created, model, one choice) is validated and dumped by pydantic
    once; each chunk then only sets its choice's changing fields in that dict and serialises it
    with ``json.dumps``, rather than building and dumping three models per streamed response.
    Every chunk carries one choice; with ``n > 1`` its ``index`` says which.

    Args:
        template: a ``ChatCompletionChunk`` or a ``Completion`` with exactly one choice.
        include_usage: ``stream_options.include_usage``: every chunk carries ``"usage": null``
            and ``usage()`` gives the usage-only last chunk (OpenAI's format); else no ``usage``.
    """

    def __init__(self, template: BaseModel, include_usage: bool) -> None:
        self.include_usage = include_usage
        self._chunk = template.model_dump(exclude=None if include_usage else {"usage"})
        (self._choice,) = self._chunk["choices"]

    def event(
        self,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        **fields: Any,
    ) -> str:
        """A chunk whose choice ``index`` has ``fields`` (``text=`` or ``delta=``),
        ``logprobs`` (in the endpoint's format) and ``finish_reason``."""
        self._choice.update(fields, finish_reason=finish_reason, index=index, logprobs=logprobs)
        return sse(_dumps(self._chunk))

    def usage(self, usage: Usage) -> str:
        """The usage-only chunk that ends a stream with ``include_usage``: no choices."""
        return sse(_dumps({**self._chunk, "choices": [], "usage": usage.model_dump()}))


def stream_response(
    gen: Generation, events: AsyncGenerator[str, None], encoder: ChunkEncoder
) -> StreamingResponse:
    """The SSE response of a started generation: ``events`` (the endpoint's chunks), then the
    usage chunk when asked for, then ``[DONE]``. An error after the 200 is sent in-band as an
    OpenAI error body, as OpenAI-compatible servers do. The generation is always closed, also
    when the client disconnects (Starlette then cancels the body)."""
    return StreamingResponse(
        _body(gen, events, encoder),
        media_type="text/event-stream",
        background=BackgroundTask(gen.close),
    )


async def _body(
    gen: Generation, events: AsyncGenerator[str, None], encoder: ChunkEncoder
) -> AsyncIterator[str]:
    try:
        async with aclosing(events):
            async for event in events:
                yield event
        if encoder.include_usage:
            yield encoder.usage(gen.usage)
    except OpenAIError as exc:
        yield sse(_dumps(exc.body()))
    finally:
        gen.close()
    yield SSE_DONE
