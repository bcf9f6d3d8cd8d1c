"""Server-sent events of a streamed completion: chunk JSON, in-band errors, ``[DONE]``.

The framing (``data: <payload>\n\n``), the SSE headers and pings are sse-starlette's
(``EventSourceResponse`` with ``sep="\n"``, the bytes OpenAI sends); this module writes the
payloads: the chunks, an error after the 200 as an OpenAI error body, ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Protocol

from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from ..errors import OpenAIError
from ..protocol import Usage

DONE = "[DONE]"
# Seconds between SSE comment pings on a quiet stream (keeps proxies from closing it; OpenAI
# clients skip comments).
PING_S = 15.0


class Streamed(Protocol):
    """What a stream needs of its generation(s): the usage so far and ``close``."""

    @property
    def usage(self) -> Usage:
        """Token counts so far."""

    def close(self) -> None:
        """Release the generation(s) (abort in the backend if unfinished)."""


def _dumps(payload: Any) -> str:
    # Same bytes as pydantic's model_dump_json: compact separators, UTF-8 kept as is.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


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
        prompt_usage: with ``stream_options.continuous_usage_stats`` (vLLM's), the stream's
            prompt counts (its completion counts are not read): every chunk then carries the
            usage so far instead of null, these prompt tokens and the tokens of the choices'
            chunks sent so far (``event``'s ``num_output_tokens``), as vLLM's chunks do.
    """

    def __init__(
        self, template: BaseModel, include_usage: bool, prompt_usage: Usage | None = None
    ) -> None:
        self.include_usage = include_usage
        with_usage = include_usage or prompt_usage is not None
        self._chunk = template.model_dump(exclude=None if with_usage else {"usage"})
        (self._choice,) = self._chunk["choices"]
        self._prompt = None if prompt_usage is None else prompt_usage.model_dump()
        self._outputs: dict[int, int] = {}  # choice index -> its tokens sent so far
        self._completion = 0  # their sum

    def event(
        self,
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        num_output_tokens: int | None = None,
        **fields: Any,
    ) -> str:
        """A chunk whose choice ``index`` has ``fields`` (``text=`` or ``delta=``),
        ``logprobs`` (in the endpoint's format) and ``finish_reason``; ``num_output_tokens``:
        the choice's tokens generated up to this chunk (None: as in its last chunk)."""
        self._choice.update(fields, finish_reason=finish_reason, index=index, logprobs=logprobs)
        if self._prompt is not None:
            if num_output_tokens is not None:
                self._completion += num_output_tokens - self._outputs.get(index, 0)
                self._outputs[index] = num_output_tokens
            completion = self._completion
            self._chunk["usage"] = {
                **self._prompt,
                "completion_tokens": completion,
                "total_tokens": self._prompt["prompt_tokens"] + completion,
            }
        return _dumps(self._chunk)

    def usage(self, usage: Usage) -> str:
        """The usage-only chunk that ends a stream with ``include_usage``: no choices."""
        return _dumps({**self._chunk, "choices": [], "usage": usage.model_dump()})


def stream_response(
    gen: Streamed,
    events: AsyncGenerator[str, None],
    encoder: ChunkEncoder,
    on_error: Callable[[OpenAIError], None] | None = None,
) -> EventSourceResponse:
    """The SSE response of a started generation: ``events`` (the endpoint's chunk payloads),
    then the usage chunk when asked for, then ``[DONE]``. An error after the 200 is sent
    in-band as an OpenAI error body, as OpenAI-compatible servers do, after ``on_error`` saw
    it (the endpoint's ``structured.rename_param``, as for an error before the 200). The
    generation is always closed, also when the client disconnects (sse-starlette then cancels
    the body)."""
    return EventSourceResponse(
        _body(gen, events, encoder, on_error),
        background=BackgroundTask(gen.close),
        sep="\n",
        ping=PING_S,
    )


async def _body(
    gen: Streamed,
    events: AsyncGenerator[str, None],
    encoder: ChunkEncoder,
    on_error: Callable[[OpenAIError], None] | None = None,
) -> AsyncIterator[str]:
    try:
        async with aclosing(events):
            async for event in events:
                yield event
        if encoder.include_usage:
            yield encoder.usage(gen.usage)
    except OpenAIError as exc:
        if on_error is not None:
            on_error(exc)
        yield _dumps(exc.body())
    finally:
        gen.close()
    yield DONE
