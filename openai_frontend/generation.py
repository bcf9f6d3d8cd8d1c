"""One OpenAI request's generation: the Triton stream, usage, abort on early exit.

``Generation.start()`` waits for the first Triton response, so errors the backend finds in the
request (prompt longer than the context, invalid sampling values) surface as ``OpenAIError``
before any HTTP status is sent. ``close()`` always runs (routes call it in ``finally``): if the
backend had not finished, it cancels the gRPC stream and sends the generator an explicit abort by
request id, because an ensemble does not pass the cancellation into a running step (DESIGN.md).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Mapping

from .errors import OpenAIError
from .protocol import PromptTokensDetails, Usage
from .triton_client import InputValue, LLMChunk, ResponseStream, TritonClient, TritonError

_CONTEXT_HINTS = ("context", "too long", "max_model_len", "maximum model length", "exceeds")
_PARAM_IN_MESSAGE = re.compile(r"generator: ([a-z_]+) must ")
_SERVER_HINTS = ("stub process", "internal", "unknown model", "not ready", "unavailable")


def to_openai_error(exc: TritonError, prompt_param: str) -> OpenAIError:
    """Map a Triton error to the status and code OpenAI would use.

    Unreachable/unloaded backend → 503; the model's own rejection of a too-long prompt → 400
    ``context_length_exceeded``; crashes → 500; any other model-raised error is taken as an
    invalid request (400), which is how the backend reports bad parameter values.
    """
    message = exc.message
    lower = message.lower()
    if exc.unavailable:
        return OpenAIError(
            f"backend unavailable: {message}", 503, "server_error", code="service_unavailable"
        )
    if any(h in lower for h in _CONTEXT_HINTS) and ("token" in lower or "length" in lower):
        return OpenAIError(message, param=prompt_param, code="context_length_exceeded")
    if any(h in lower for h in _SERVER_HINTS):
        return OpenAIError(message, 500, "server_error")
    # The engine names the parameter first: "generator: top_p must be in (0, 1], got 0".
    named = _PARAM_IN_MESSAGE.search(message)
    return OpenAIError(message, param=named.group(1) if named else None, code="invalid_value")


class Generation:
    """Text deltas of one request through the ``llm`` ensemble.

    Args:
        client: the shared Triton client.
        request_id: Triton request id == OpenAI completion id.
        inputs: ensemble inputs (see ``sampling.py``).
        prompt_param: the request field named by prompt errors (``messages`` or ``prompt``).
    """

    def __init__(
        self,
        client: TritonClient,
        request_id: str,
        inputs: Mapping[str, InputValue],
        prompt_param: str = "messages",
    ) -> None:
        self.client, self.request_id, self.inputs = client, request_id, inputs
        self.prompt_param = prompt_param
        self.finish_reason: str | None = None
        self._stream: ResponseStream | None = None
        self._first: LLMChunk | None = None
        self._last: LLMChunk | None = None
        self._backend_finished = False
        self._closed = False

    async def start(self) -> None:
        """Send the request and wait for its first response.

        Raises:
            OpenAIError: the backend rejected the request or is unavailable.
        """
        try:
            self._stream = await self.client.stream(self.request_id, self.inputs)
        except TritonError as exc:
            raise to_openai_error(exc, self.prompt_param) from exc
        self._first = await self._read()

    async def _read(self) -> LLMChunk | None:
        assert self._stream is not None
        try:
            chunk = await self._stream.read()
        except TritonError as exc:
            self._backend_finished = True  # an error response ends the request in Triton
            raise to_openai_error(exc, self.prompt_param) from exc
        if chunk is not None:
            self._last = chunk
        return chunk

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        """Yield ``(text, finish_reason)``: reason None until the last delta.

        Raises:
            OpenAIError: a backend error mid-stream, or a stream that ended unfinished (500).
        """
        chunk, self._first = self._first, None
        while chunk is not None:
            text = chunk.text
            if chunk.finish_reason:
                self._backend_finished = True
                self.finish_reason = chunk.finish_reason
                yield text, chunk.finish_reason
                await self._drain()
                return
            if text:
                yield text, None
            chunk = await self._read()
        raise OpenAIError(
            "the backend ended the stream without a finish reason", 500, "server_error"
        )

    async def _drain(self, timeout_s: float = 1.0) -> None:
        # Read the final (empty) response that follows the last chunk, so that the stream ends
        # normally instead of being cancelled in close().
        try:
            await asyncio.wait_for(self._read(), timeout_s)
        except (asyncio.TimeoutError, OpenAIError):
            pass

    async def collect(self) -> str:
        """The whole completion text (non-streaming requests).

        Raises:
            OpenAIError: as ``deltas``.
        """
        return "".join([text async for text, _ in self.deltas()])

    @property
    def usage(self) -> Usage:
        """Token counts of the latest response (prompt, generated, cached prefix)."""
        last = self._last
        prompt, completion, cached = (
            (last.num_input_tokens, last.num_output_tokens, last.cached_tokens)
            if last
            else (0, 0, 0)
        )
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def close(self) -> None:
        """Release the request: cancel the stream; abort it in the generator if still running.

        Synchronous on purpose: it is called from cleanup of a cancelled task, where awaiting
        would be cancelled again; the abort runs as a background task.
        """
        if self._closed:
            return
        self._closed = True
        if self._stream is not None and not self._stream.done:
            self._stream.cancel()
        if self._stream is not None and not self._backend_finished:
            self.client.abort_soon(self.request_id)
