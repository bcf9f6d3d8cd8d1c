"""One OpenAI request's generation: the Triton stream, usage, abort on early exit.

With ``n > 1`` the backend streams the choices interleaved on one Triton request (each response
carries its choice ``index``); the request ends after every choice sent its finish reason.

``Generation.start()`` waits for the first Triton response, so errors the backend finds in the
request (prompt longer than the context, invalid sampling values) surface as ``OpenAIError``
before any HTTP status is sent; their OpenAI status comes from the backend's error code
(``to_openai_error``). ``close()`` always runs (routes call it in ``finally``): if the backend
had not finished, it sends the generator an explicit abort by request id and reads the stream
on to its end (the abort brings the final response) rather than cancelling it
(``TritonClient.finish`` says why).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tritonllm.contract.errors import decode_error

from . import metrics
from .errors import INTERNAL_MESSAGE, UNAVAILABLE_MESSAGE, OpenAIError, from_backend
from .logprobs import backend_entries
from .protocol import PromptTokensDetails, Usage
from .triton_client import (
    InputValue,
    LLMChunk,
    RepeatedWarning,
    ResponseStream,
    TritonClient,
    TritonError,
)

log = logging.getLogger(__name__)
# While tritonserver is down (or a stub dead) every request fails the same way: one warning
# every 10 s of each kind.
_UNAVAILABLE_LOG = RepeatedWarning(10.0, log)
_UNHEALTHY_LOG = RepeatedWarning(10.0, log)


def to_openai_error(exc: TritonError, prompt_param: str) -> OpenAIError:
    """Map a Triton error to the status and code OpenAI would use, from data only.

    Triton unreachable or the model not loaded (a gRPC status) -> 503; an error in the
    backend's wire form (``tritonllm.contract.errors``) -> by its code (``errors.OPENAI_STATUS``);
    any other error is Triton's own (a stub that died, a model not ready, a cancelled step) ->
    500 (``backend_error`` makes it a 503 while the backend is unhealthy). No message text is
    searched: a client's own text can never change the class.
    """
    if exc.unavailable:  # the details (the internal gRPC address) go to the log only
        _UNAVAILABLE_LOG.log("backend unavailable: %s", exc.message)
        return OpenAIError(UNAVAILABLE_MESSAGE, 503, "server_error", code="service_unavailable")
    wire = decode_error(exc.message)
    if wire is None:
        log.warning("backend error: %s", exc.message)
        return OpenAIError(INTERNAL_MESSAGE, 500, "server_error")
    return from_backend(wire, prompt_param)


# Most seconds an error path waits for the health check that classifies Triton's own errors.
BACKEND_CHECK_S = 3.0


async def backend_error(
    exc: TritonError,
    prompt_param: str,
    backend_ok: Callable[[], Awaitable[bool]] | None,
) -> OpenAIError:
    """``to_openai_error``, with Triton's own errors (no wire form: a generator stub that died,
    a tritonserver that is stopping for a restart) told apart by the backend's health rather
    than by their text: a 503 ``service_unavailable`` (retry later) while ``backend_ok`` (the
    sidecar's health check, ``health.HealthMonitor``) says the backend is failing, a 500
    otherwise, and when the check takes more than ``BACKEND_CHECK_S``."""
    if backend_ok is None or exc.unavailable or decode_error(exc.message) is not None:
        return to_openai_error(exc, prompt_param)
    try:
        ok = await asyncio.wait_for(backend_ok(), BACKEND_CHECK_S)
    except asyncio.TimeoutError:
        ok = True  # unknown: Triton's own error stays a 500
    if ok:
        return to_openai_error(exc, prompt_param)
    _UNHEALTHY_LOG.log("backend error while unhealthy: %s", exc.message)
    return OpenAIError(UNAVAILABLE_MESSAGE, 503, "server_error", code="service_unavailable")


@dataclass(frozen=True, slots=True)
class Delta:
    """One piece of one choice.

    Attributes:
        index: the choice (0..n-1).
        text: its text delta (may be empty).
        finish_reason: None until the choice's last delta.
        logprobs: with logprobs asked for, the OpenAI chat ``logprobs.content`` entries of the
            delta's tokens (possibly ``[]``); None otherwise.
        prompt_logprobs: in a choice's first delta of a request that scores its prompt, the
            same entries for every prompt token (the first with ``logprob`` None); else None.
        num_output_tokens: the choice's tokens generated so far, this delta's included.
    """

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None
    prompt_logprobs: list[dict[str, Any]] | None = None
    num_output_tokens: int = 0


@dataclass
class Choice:
    """One whole choice of a non-streamed request (``logprobs``, ``prompt_logprobs`` as in
    ``Delta``)."""

    text: str
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None
    prompt_logprobs: list[dict[str, Any]] | None = None


@dataclass
class BackendProgress:
    """When the backend last answered any generation of this sidecar process.

    ``health.py``'s evidence that the pipeline moves: a generation that has finished since
    counts too (a non-streamed request gets one response, its last, and is no longer in flight
    afterwards, so its own ``last_response_at`` would leave the evidence with it).

    Attributes:
        last_response_at: ``time.monotonic()`` of the latest response (None before the first).
    """

    last_response_at: float | None = None


async def _read_within(stream: ResponseStream, timeout_s: float | None) -> LLMChunk | None:
    """``stream.read()``, raising ``asyncio.TimeoutError`` after ``timeout_s`` seconds (None:
    no limit). A timed-out read is cancelled safely: the stream keeps its gRPC read (see
    ``ResponseStream``), and ``Generation.close`` then aborts the request."""
    if timeout_s is None:
        return await stream.read()
    if sys.version_info >= (3, 11):  # asyncio.timeout: no extra task per read, unlike wait_for
        async with asyncio.timeout(timeout_s):
            return await stream.read()
    return await asyncio.wait_for(stream.read(), timeout_s)


class Generation:
    """Text deltas of one request through the ``llm`` ensemble.

    Args:
        client: the shared Triton client.
        request_id: Triton request id == OpenAI completion id.
        inputs: ensemble inputs (see ``sampling.py``).
        prompt_param: the request field named by prompt errors (``messages`` or ``prompt``).
        n: choices the backend generates (its ``n`` input).
        logprobs: whether the backend was asked for logprobs (its ``logprobs`` input).
        registry: a set this generation belongs to from ``start`` until ``close`` (the
            server's generations in flight, aborted together on shutdown).
        idle_timeout_s: most seconds to wait for the next response; past it the generation
            fails with a 504 (a backend that stopped answering, e.g. a dead generator stub,
            which Triton never reports for requests in flight). None: wait forever. A
            non-streamed request's one response comes at its end: it waits on while
            ``backend_ok`` says the backend is healthy.
        backend_ok: the sidecar's health check (True: healthy), which classifies Triton's
            own errors (``backend_error``); None: they are 500s.
        progress: the process-wide record of the backend's latest response, updated by every
            response this generation reads (``BackendProgress``).

    Attributes:
        started_at: ``time.monotonic()`` at construction; ``last_response_at``: of the latest
            response from Triton (None before the first). ``health.py`` reads both.
    """

    def __init__(
        self,
        client: TritonClient,
        request_id: str,
        inputs: Mapping[str, InputValue],
        prompt_param: str = "messages",
        n: int = 1,
        logprobs: bool = False,
        registry: set[Generation] | None = None,
        idle_timeout_s: float | None = None,
        backend_ok: Callable[[], Awaitable[bool]] | None = None,
        progress: BackendProgress | None = None,
    ) -> None:
        self.client, self.request_id, self.inputs = client, request_id, inputs
        self._progress = progress
        self._backend_ok = backend_ok
        self.prompt_param = prompt_param
        self.n, self.logprobs = n, logprobs
        self.finish_reasons: list[str | None] = [None] * n
        self._stream: ResponseStream | None = None
        self._first: LLMChunk | None = None
        self._last: dict[int, LLMChunk] = {}  # choice index → its latest response
        self._backend_finished = False
        self._closed = False
        self._registry = registry
        self._idle_timeout_s = idle_timeout_s
        self._failure: OpenAIError | None = None  # set by fail()
        self.started_at = time.monotonic()
        self.last_response_at: float | None = None
        self._times = metrics.TokenTimes(self.started_at)

    @property
    def finish_reason(self) -> str | None:
        """The finish reason of choice 0 (None until it finished)."""
        return self.finish_reasons[0]

    async def start(self) -> None:
        """Send the request and wait for its first response.

        Raises:
            OpenAIError: the backend rejected the request or is unavailable.
        """
        if self._registry is not None and not self._closed:
            self._registry.add(self)
        try:
            self._stream = await self.client.stream(self.request_id, self.inputs)
        except TritonError as exc:
            raise await backend_error(exc, self.prompt_param, self._backend_ok) from exc
        self._first = await self._read()

    async def _read(self) -> LLMChunk | None:
        assert self._stream is not None
        if self._failure is not None:
            raise self._failure
        try:
            while True:
                try:
                    chunk = await _read_within(self._stream, self._idle_timeout_s)
                    break
                except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
                    if self._failure is None and await self._working_on_its_one_response():
                        continue  # the read goes on (ResponseStream keeps it): wait again
                    raise OpenAIError(
                        f"no response from the backend for {self._idle_timeout_s:g} s",
                        504,
                        "server_error",
                        code="timeout",
                    ) from None
        except TritonError as exc:
            self._backend_finished = True  # an error response ends the request in Triton
            if self._failure is not None:
                raise self._failure from exc
            raise await backend_error(exc, self.prompt_param, self._backend_ok) from exc
        if self._failure is not None:
            raise self._failure
        self.last_response_at = time.monotonic()
        if self._progress is not None:
            self._progress.last_response_at = self.last_response_at
        if chunk is not None:
            if not 0 <= chunk.index < self.n:
                raise OpenAIError(
                    f"the backend sent choice {chunk.index} of {self.n}", 500, "server_error"
                )
            self._last[chunk.index] = chunk
            self._times.on_response(chunk.index, chunk.num_output_tokens, self.last_response_at)
        return chunk

    async def _working_on_its_one_response(self) -> bool:
        """Whether an idle timeout should wait again: a request the backend answers once (not
        streamed, ``stream`` false) is silent until it has finished, however long that takes
        (a long non-streamed output on a slow device), so its silence says nothing; it fails
        only when the backend is unhealthy too (``backend_ok``, the health check: a probe
        generation through the same engine). A streamed one fails at once, as before."""
        if self.inputs.get("stream") is not False or self._backend_ok is None:
            return False
        try:
            return await self._backend_ok()
        except Exception:  # an unknown state: the timeout stands
            log.exception("health check failed")
            return False

    def _logprobs(self, chunk: LLMChunk) -> list[dict[str, Any]] | None:
        if not self.logprobs:
            return None
        return backend_entries(chunk.logprobs_json) if chunk.logprobs_json else []

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield the ``Delta`` of each response that carries text, logprobs or a finish; each
        choice's last delta has its finish_reason.

        Raises:
            OpenAIError: a backend error mid-stream, or a stream that ended before every
                choice finished (500).
        """
        chunk, self._first = self._first, None
        unfinished = self.n
        while chunk is not None:
            logprobs = self._logprobs(chunk)
            scores = (
                backend_entries(chunk.prompt_logprobs_json) if chunk.prompt_logprobs_json else None
            )
            if chunk.finish_reason:
                if self.finish_reasons[chunk.index] is None:
                    unfinished -= 1
                self.finish_reasons[chunk.index] = chunk.finish_reason
                self._backend_finished = unfinished == 0
                yield Delta(
                    chunk.index,
                    chunk.text,
                    chunk.finish_reason,
                    logprobs,
                    scores,
                    chunk.num_output_tokens,
                )
                if unfinished == 0:
                    await self._drain()
                    return
            elif chunk.text or logprobs or scores:
                yield Delta(
                    chunk.index, chunk.text, None, logprobs, scores, chunk.num_output_tokens
                )
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

    async def collect(self) -> list[Choice]:
        """Every choice, whole (non-streaming requests), by index.

        Raises:
            OpenAIError: as ``deltas``.
        """
        texts: list[list[str]] = [[] for _ in range(self.n)]
        logprobs: list[list[dict[str, Any]] | None] = [
            [] if self.logprobs else None for _ in range(self.n)
        ]
        scores: list[list[dict[str, Any]] | None] = [None] * self.n
        async for delta in self.deltas():
            texts[delta.index].append(delta.text)
            if delta.prompt_logprobs is not None:
                scores[delta.index] = delta.prompt_logprobs
            entries = logprobs[delta.index]
            if delta.logprobs and entries is not None:  # logprobs come only when asked for
                entries.extend(delta.logprobs)
        return [
            Choice("".join(parts), reason, entries, prompt)
            for parts, reason, entries, prompt in zip(
                texts, self.finish_reasons, logprobs, scores, strict=True
            )
        ]

    @property
    def usage(self) -> Usage:
        """Token counts so far: the prompt once, the generated tokens of all choices summed,
        the cached prefix."""
        last = self._last.values()
        prompt = max((c.num_input_tokens for c in last), default=0)
        completion = sum(c.num_output_tokens for c in last)
        cached = max((c.cached_tokens for c in last), default=0)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def fail(self, error: OpenAIError) -> bool:
        """End a generation whose backend is known to have failed (``health.BackendWatch``):
        its gRPC stream is cancelled, so that the read waiting on it, and any later one,
        raises ``error`` now instead of after the idle timeout. Triton 2.51 never answers the
        requests of a stub it lost, so there is nothing to abort. Returns False when the
        generation had already ended."""
        if self._closed or self._failure is not None or self._backend_finished:
            return False
        self._failure = error
        self._backend_finished = True
        if self._stream is not None and not self._stream.done:
            self._stream.cancel()
        return True

    def close(self) -> None:
        """Release the request: if the backend had not finished, abort it in the generator; read
        the stream to its end in the background either way (never cancel it: see
        ``TritonClient.finish``).

        Synchronous on purpose: it is called from cleanup of a cancelled task, where awaiting
        would be cancelled again; the abort runs as a background task.
        """
        if self._closed:
            return
        self._closed = True
        if self._registry is not None:
            self._registry.discard(self)
        usage = self.usage
        metrics.count_tokens(usage.prompt_tokens, usage.completion_tokens)
        if self._stream is None or self._stream.done:
            return
        # Also before the first response (``start`` cancelled): the generator remembers an
        # abort that overtakes its request.
        abort = None if self._backend_finished else self.request_id
        self.client.close_soon(self._stream, abort)
