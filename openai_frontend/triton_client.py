"""How a request reaches Triton: gRPC streams to the ``llm`` ensemble and aborts to ``generator``.

``grpc.aio`` with tritonclient's protobuf service (``tritonclient.grpc.service_pb2*``); responses
are read straight from their raw output bytes (no numpy arrays per chunk). The raw stub, not
``tritonclient.grpc.aio.InferenceServerClient.stream_infer``, because every stream sets the
reserved parameter ``triton_enable_empty_final_response`` (the empty final response ends a
decoupled request; the generator answers an abort with exactly that), which that client cannot.
Shapes and datatypes come from the model's metadata. Every stream is read to its end; one whose
client went away is ended by an abort to the generator (``TritonClient.finish`` says why).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tritonllm.contract.errors import ErrorCode, decode_error

from .tensor_codec import InputSpec, InputValue, TritonError, decode_outputs, encode_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LLMChunk:
    """One response of the ``llm`` ensemble.

    Attributes:
        text: the text delta (may be empty: an incomplete UTF-8 character is held back).
        finish_reason: ``""`` while running, else ``"stop"``, ``"length"`` or ``"abort"``.
        num_input_tokens: prompt tokens.
        num_output_tokens: tokens generated so far (cumulative).
        cached_tokens: prompt tokens served from the prefix cache.
        index: the choice (0..n-1) this response belongs to.
        logprobs_json: ``""``, or the JSON list of this response's token logprobs (OpenAI's
            chat ``logprobs.content`` entries; parsed only when the client asked for them).
        prompt_logprobs_json: ``""``, or (a choice's first response of a request that scores
            its prompt) the same entries for every prompt token, the first with logprob null.
    """

    text: str
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    cached_tokens: int
    index: int = 0
    logprobs_json: str = ""
    prompt_logprobs_json: str = ""


# A BYTES element is a 4-byte little-endian length, then the bytes; integer outputs are
# little-endian. ``_Outputs``: output name -> (datatype, raw bytes) of one response.
_BYTES_LEN = struct.Struct("<I")
_INT_FORMATS = {"INT32": "<i", "INT64": "<q", "UINT32": "<I", "UINT64": "<Q"}
_Outputs = dict[str, tuple[str, bytes]]


def first_text(outputs: _Outputs, name: str) -> str:
    """The first element of BYTES output ``name`` as text ("" when absent or empty)."""
    raw = outputs[name][1] if name in outputs else b""
    if len(raw) < _BYTES_LEN.size:
        return ""
    (size,) = _BYTES_LEN.unpack_from(raw)
    return raw[_BYTES_LEN.size : _BYTES_LEN.size + size].decode("utf-8", errors="replace")


def _first_int(outputs: _Outputs, name: str) -> int:
    if name not in outputs:
        return 0
    datatype, raw = outputs[name]
    fmt = _INT_FORMATS.get(datatype)
    if fmt is None:
        raise TritonError(f"output {name}: unexpected datatype {datatype}")
    return struct.unpack_from(fmt, raw)[0] if len(raw) >= struct.calcsize(fmt) else 0


def parse_chunk(response: service_pb2.ModelInferResponse) -> LLMChunk:
    """The ``llm`` ensemble's outputs of one response as an ``LLMChunk``.

    Reads the first element of each output from ``raw_output_contents`` (where Triton's gRPC
    endpoint puts every output); a missing or empty output reads as ``""`` or 0.

    Raises:
        TritonError: outputs without raw contents, or a token count of a non-integer datatype.
    """
    if len(response.raw_output_contents) != len(response.outputs):
        raise TritonError("response outputs without raw_output_contents")
    outputs = {
        o.name: (o.datatype, raw)
        for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }
    return LLMChunk(
        text=first_text(outputs, "text_output"),
        finish_reason=first_text(outputs, "finish_reason"),
        num_input_tokens=_first_int(outputs, "num_input_tokens"),
        num_output_tokens=_first_int(outputs, "num_output_tokens"),
        cached_tokens=_first_int(outputs, "cached_tokens"),
        index=_first_int(outputs, "index"),
        logprobs_json=first_text(outputs, "logprobs_json"),
        prompt_logprobs_json=first_text(outputs, "prompt_logprobs_json"),
    )


class ResponseStream:
    """The responses of one decoupled request on its own gRPC stream, read one at a time.

    ``read()`` returns the next ``LLMChunk``, or None once the stream ended: after Triton's final
    response it also reads the end of the RPC, so that no stream is ever cancelled after its
    final response (``finished``). ``cancel()`` cancels the gRPC stream, and with it the
    request in Triton; the sidecar avoids that (``TritonClient.finish`` says why), and a
    caller cancelled while it waits in ``read()`` leaves the stream open: the read goes on and
    the next ``read()`` returns its response.

    Attributes:
        finished: Triton sent the request's final response (or an error response).
        done: the stream ended (its end was read, it failed or was cancelled).
    """

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call
        self._pending: asyncio.Future | None = None  # the gRPC read in progress
        self.finished = False
        self.done = False

    async def _next_message(self) -> Any:
        # Shielded: grpc.aio cancels the whole call when a task awaiting ``call.read()`` is
        # cancelled, and a cancelled reader must not cancel the request.
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._call.read())
            # Retrieve the outcome of a read nobody awaits any more (no "never retrieved" log).
            self._pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        pending = self._pending
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # Task.cancelling() is Python 3.11+; before it, a cancelled read counts as the call's.
            reader_cancelled = (
                sys.version_info >= (3, 11) and task is not None and task.cancelling() > 0
            )
            if pending.cancelled() and not reader_cancelled:
                return grpc.aio.EOF  # the call was cancelled (``cancel()``), not this reader
            raise
        finally:
            if pending.done():
                self._pending = None

    async def read(self) -> LLMChunk | None:
        """Raises: TritonError on an error response or a broken stream."""
        while not self.done:
            try:
                message = await self._next_message()
            except grpc.aio.AioRpcError as exc:
                self.finished = self.done = True
                raise TritonError(exc.details() or str(exc.code()), unavailable=True) from exc
            if message is grpc.aio.EOF:
                self.finished = self.done = True
                return None
            if message.error_message:
                self.finished = True  # an error response ends the request; the stream follows
                raise TritonError(message.error_message)
            infer = message.infer_response
            if infer.parameters["triton_final_response"].bool_param:
                self.finished = True
            if infer.outputs:
                return parse_chunk(infer)
        return None

    async def drain(self, timeout: float) -> bool:
        """Read and drop responses until the stream ends, also past an error response; True if
        it ended within ``timeout`` s without an error (never raises)."""
        failed = False

        async def skip_all() -> None:
            nonlocal failed
            while True:
                try:
                    if await self.read() is None:
                        return
                except TritonError:
                    failed = True

        try:
            await asyncio.wait_for(skip_all(), timeout)
        except asyncio.TimeoutError:
            return False
        return not failed

    def cancel(self) -> None:
        """Cancel the gRPC stream (Triton then cancels the request); later reads return None."""
        self.done = True
        self._call.cancel()


# gRPC statuses of a Triton that cannot answer (rather than of a request it refused).
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Seconds between two renewals of the generator lease on its stream (the generator answers a
# lease request left unrenewed for 1 s), and before a lease stream that failed is opened again
# (``TritonClient.hold_lease``).
LEASE_RENEW_S = 0.5
LEASE_RETRY_S = 1.0
# At most one warning per this many seconds for failed lease renewals (the others go to DEBUG):
# with a dead generator instance, about every other renewal fails until tritonserver restarts.
LEASE_WARN_EVERY_S = 60.0
# The ensemble a client streams from by default, and the one it falls back to when the
# generator refuses its lease: through the latter a cancelled stream still stops its generation
# (its detokenizer step sees the cancellation).
FUSED_MODEL = "llm_fused"
FALLBACK_MODEL = "llm"


def new_lease() -> str:
    """A random generator lease id (``TritonClient``): ``sidecar-`` and 16 hex digits."""
    return f"sidecar-{secrets.token_hex(8)}"


class RepeatedWarning:
    """Logs a failure that repeats: a warning at most once every ``every_s`` seconds (saying
    how many there were since the last one), the others at DEBUG, on ``logger`` (default:
    this module's)."""

    def __init__(self, every_s: float, logger: logging.Logger | None = None) -> None:
        self.every_s, self._warned_at, self._since = every_s, -math.inf, 0
        self.logger = logger or log

    def log(self, fmt: str, *args: object) -> None:
        """Log one occurrence (``logging``'s lazy ``fmt % args``)."""
        self._since += 1
        now = time.monotonic()
        if now - self._warned_at < self.every_s:
            self.logger.debug(fmt, *args)
            return
        more = f" ({self._since} since the last warning)" if self._since > 1 else ""
        self.logger.warning(fmt + more, *args)
        self._warned_at, self._since = now, 0


class TritonClient:
    """An async gRPC client of one tritonserver, shared by all requests of the sidecar.

    Every request id it sends to Triton is ``"<lease>/<request id>"``: ``hold_lease`` keeps a
    ``client_lease`` control request open in the generator, and when this process dies its gRPC
    stream closes and the generator aborts every request of the lease (``GeneratorCore``,
    "leases"). Through ``llm_fused`` nothing else would see that the streams are gone.

    Args:
        url: ``host:port`` of Triton's gRPC endpoint.
        model: the ensemble to generate with (``llm_fused``).
        generator: the decoupled model that takes ``abort_request_id`` (``generator``).
        secret: the server's ``TRITONLLM_CONTROL_SECRET``, sent with every abort and the lease.
        lease: this client's lease id (None: ``new_lease()``).
    Attributes:
        lease: this client's lease id.
    """

    def __init__(
        self,
        url: str,
        model: str = FUSED_MODEL,
        generator: str = "generator",
        secret: str | None = None,
        lease: str | None = None,
    ) -> None:
        self.url, self.model, self.generator_model = url, model, generator
        self._control_secret = secret
        self.lease = lease or new_lease()
        self._lease_task: asyncio.Task | None = None
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.aio.insecure_channel(url, options=options)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._specs: dict[str, dict[str, InputSpec]] = {}
        self._background: set[asyncio.Task] = set()

    def triton_id(self, request_id: str) -> str:
        """The Triton request id of ``request_id``: ``"<lease>/<request_id>"``."""
        return f"{self.lease}/{request_id}"

    def _secret(self) -> dict[str, InputValue]:
        return {} if self._control_secret is None else {"control_secret": self._control_secret}

    def start_lease(self) -> None:
        """Hold the generator lease from now on (``hold_lease`` in a task; ``close`` ends it).
        Logs the lease id with this process' pid (the prefix of its requests' ids in Triton)."""
        if self._lease_task is None:
            log.info("process %d holds generator lease %s", os.getpid(), self.lease)
            self._lease_task = asyncio.get_running_loop().create_task(self.hold_lease())

    async def hold_lease(self) -> None:
        """Keep this client's ``client_lease`` open in the generator: one gRPC stream that sends
        a lease request every ``LEASE_RENEW_S`` seconds (each answers the one before), so that
        one is always open while this process runs; a stream that failed (tritonserver
        restarting or unreachable) is opened again after ``LEASE_RETRY_S``. Runs until
        cancelled. Its end, by cancellation or by this process' death, aborts this client's
        requests in the generator. A renewal answered with an error keeps the stream (the next
        renewal follows), so that one failing generator instance does not end the lease.

        A generator that refuses the lease for want of the control secret (a sidecar started
        without ``TRITONLLM_CONTROL_SECRET``) can take no aborts from this client either: then
        a client of ``llm_fused`` streams from ``FALLBACK_MODEL`` instead, where a cancelled
        stream still stops its generation, and the lease is given up (logged once).
        """
        inputs = {"client_lease": self.lease, **self._secret()}
        failures = RepeatedWarning(LEASE_WARN_EVERY_S)

        async def renewals(request: Any) -> Any:
            while True:
                yield request
                await asyncio.sleep(LEASE_RENEW_S)

        while True:
            call = None
            try:
                request = await self._request(self.generator_model, f"lease-{self.lease}", inputs)
                call = self._stub.ModelStreamInfer(renewals(request))
                async for message in call:  # an empty final response per renewal
                    if not message.error_message:
                        continue
                    wire = decode_error(message.error_message)
                    if wire is not None and wire.code is ErrorCode.PERMISSION_DENIED:
                        self._lease_refused(wire.message)
                        return
                    # One renewal failed (e.g. it reached a dead generator instance): the stream
                    # stays, since closing it would end the lease on the instance that holds
                    # it open and abort every request of this client; the next renewal follows.
                    failures.log("generator lease renewal: %s", message.error_message)
            except (TritonError, grpc.aio.AioRpcError) as exc:
                failures.log("generator lease: %r", exc)
            finally:
                if call is not None:
                    call.cancel()
            await asyncio.sleep(LEASE_RETRY_S)

    async def end_lease(self, timeout: float = 5.0) -> bool:
        """End this client's lease in the generator now, for a holder that is gone (the
        ``--workers`` parent, for a worker it killed): take the lease over with a lease request
        of its own and cancel that once the generator holds it open; the generator then aborts
        every request of the lease at its next lease check. A holder that stalled before it
        died had no lease request open (the generator answers one left unrenewed for a second),
        so its death alone would end the lease only after the generator's grace
        (``GeneratorCore``, "leases").

        Returns:
            True once the generator held the takeover open; False when it refused it (no
            control secret), Triton was unreachable, or ``timeout`` seconds passed.
        """
        inputs = {"client_lease": self.lease, **self._secret()}
        call = None

        async def twice(request: Any) -> Any:
            # The second answers the first: once that answer is back, the second is the
            # lease's open request. The stream stays open until cancelled (a cancellation, not
            # a half-close, is what ends the lease).
            yield request
            yield request
            await asyncio.Event().wait()

        async def take_over() -> bool:
            nonlocal call
            request = await self._request(self.generator_model, f"lease-{self.lease}", inputs)
            call = self._stub.ModelStreamInfer(twice(request))
            async for message in call:
                return not message.error_message
            return False

        try:
            return await asyncio.wait_for(take_over(), timeout)
        except (asyncio.TimeoutError, TritonError, grpc.aio.AioRpcError) as exc:
            log.warning("generator lease %s not ended: %r", self.lease, exc)
            return False
        finally:
            if call is not None:
                call.cancel()

    def _lease_refused(self, reason: str) -> None:
        if self.model == FUSED_MODEL:
            self.model = FALLBACK_MODEL
        log.warning(
            "the generator refused this sidecar's lease (%s): streaming from %r, whose "
            "detokenizer step stops the generations of cancelled streams",
            reason,
            self.model,
        )

    async def close(self) -> None:
        """End the lease, wait for scheduled aborts, then close the gRPC channel."""
        if self._lease_task is not None:
            self._lease_task.cancel()
            await asyncio.gather(self._lease_task, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._channel.close()

    async def is_ready(self, timeout: float = 2.0) -> bool:
        """True when the server and the ``llm`` model are ready (``timeout`` s per call)."""
        try:
            server = await self._stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=timeout)
            if not server.ready:
                return False
            request = service_pb2.ModelReadyRequest(name=self.model)
            return (await self._stub.ModelReady(request, timeout=timeout)).ready
        except grpc.aio.AioRpcError:
            return False

    async def input_specs(self, model: str | None = None) -> dict[str, InputSpec]:
        """The inputs ``model`` (default: the ensemble) accepts, from its metadata (cached).

        Raises:
            TritonError(unavailable=True): Triton unreachable or the model is not loaded.
        """
        model = model or self.model
        if model not in self._specs:
            try:
                meta = await self._stub.ModelMetadata(
                    service_pb2.ModelMetadataRequest(name=model), timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                raise TritonError(f"model {model!r}: {exc.details()}", unavailable=True) from exc
            self._specs[model] = {
                t.name: InputSpec(t.datatype, tuple(t.shape)) for t in meta.inputs
            }
        return self._specs[model]

    async def _request(
        self, model: str, request_id: str, inputs: Mapping[str, InputValue], stream: bool = True
    ) -> Any:
        specs = await self.input_specs(model)
        request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
        for name, value in inputs.items():
            if name not in specs:
                raise TritonError(f"model {model!r} has no input {name!r}")
            tensor, raw = encode_tensor(name, value, specs[name])
            request.inputs.append(tensor)
            request.raw_input_contents.append(raw)
        if stream:
            request.parameters["triton_enable_empty_final_response"].bool_param = True
        return request

    async def infer(
        self, model: str, request_id: str, inputs: Mapping[str, InputValue], timeout: float = 10.0
    ) -> dict[str, np.ndarray]:
        """One request to a non-decoupled ``model`` (the ``tokenizer``): its outputs by name.

        Raises:
            TritonError: an error response (``unavailable`` when Triton is unreachable or
                the timeout passed).
        """
        request = await self._request(model, request_id, inputs, stream=False)
        try:
            response = await self._stub.ModelInfer(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            # A model's error response keeps its message (the contract's wire form).
            unavailable = exc.code() in _UNAVAILABLE
            raise TritonError(exc.details() or str(exc.code()), unavailable) from exc
        return decode_outputs(response)

    async def generator_info(self, timeout: float = 5.0) -> dict[str, np.ndarray]:
        """The outputs of the generator's answer to a health probe (``max_model_len``).

        Raises:
            TritonError: the engine does not run, or Triton is unreachable (``unavailable``).
        """
        request = await self._request(
            self.generator_model, "info-probe", {"health_probe": True}, stream=True
        )
        call = self._stub.ModelStreamInfer(iter([request]))
        outputs: dict[str, np.ndarray] = {}

        async def read_all() -> None:
            async for message in call:
                if message.error_message:
                    raise TritonError(message.error_message)
                outputs.update(decode_outputs(message.infer_response))

        try:
            await asyncio.wait_for(read_all(), timeout)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            raise TritonError(f"generator probe: {exc!r}", unavailable=True) from exc
        finally:
            call.cancel()
        return outputs

    async def stream(
        self, request_id: str, inputs: Mapping[str, InputValue], model: str | None = None
    ) -> ResponseStream:
        """Send one request to the ensemble (or ``model``) on its own gRPC stream.

        Args:
            request_id: the request's id (the OpenAI completion id; aborts name it), sent to
                Triton as ``triton_id(request_id)``.
            inputs: ensemble input name → value; only inputs the client was given.
        Raises:
            TritonError: unknown input, Triton unreachable.
        """
        request = await self._request(model or self.model, self.triton_id(request_id), inputs)
        # One request, then half-close: Triton keeps the stream open until the final response.
        return ResponseStream(self._stub.ModelStreamInfer(iter([request])))

    async def _control(self, request_id: str, inputs: Mapping[str, InputValue], timeout: float):
        """Send the generator one control request; True when its final response (and the end
        of the stream) came within ``timeout`` s without an error."""
        try:
            request = await self._request(self.generator_model, request_id, inputs)
        except TritonError as exc:
            log.warning("control request %s not sent: %s", request_id, exc.message)
            return False
        stream = ResponseStream(self._stub.ModelStreamInfer(iter([request])))
        answered = await stream.drain(timeout)
        ended = stream.done  # drain failed on an error response rather than on the timeout
        if not ended:
            stream.cancel()
        if not answered and ended:
            log.warning("control request %s refused (an error response)", request_id)
        elif not answered:
            log.warning("control request %s not answered within %.1f s", request_id, timeout)
        return answered

    async def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        """Ask the generator to abort ``request_id`` now and free its KV pages (control request
        ``abort_request_id`` + the secret); True when acknowledged within ``timeout`` s."""
        inputs = {"abort_request_id": self.triton_id(request_id), **self._secret()}
        return await self._control(f"abort-{request_id}", inputs, timeout)

    async def finish(
        self, stream: ResponseStream, abort_request_id: str | None = None, timeout: float = 5.0
    ) -> None:
        """End ``stream`` by reading it to its end, after aborting ``abort_request_id`` (its
        request id) in the generator when given; only a stream that has not ended after
        ``timeout`` s is cancelled.

        A cancelled ``llm`` stream stops its generation too (ARCHITECTURE.md "Platform
        facts"), but the abort is kept: a non-streamed backend request shows no cancellation
        before its end; an abort acts within milliseconds, a cancellation at the next response;
        and a stream cancelled after its final response can stay unreleased by the gRPC
        endpoint (Triton 2.51). The abort brings the final response (``"abort"``).
        """
        if abort_request_id is not None and not stream.finished:
            # Read while the abort is on its way, so the responses sent meanwhile never pile up.
            ended = asyncio.ensure_future(stream.drain(timeout))
            if not await self.abort(abort_request_id, timeout):
                stream.cancel()  # the generator may go on: at least stop listening
            await ended
        else:
            await stream.drain(timeout)
        if not stream.done:
            # The request id says whose (a health probe's id starts "health-").
            log.warning(
                "stream %s did not end within %.1f s; cancelling it",
                abort_request_id or "?",
                timeout,
            )
            stream.cancel()

    def close_soon(self, stream: ResponseStream, abort_request_id: str | None = None) -> None:
        """Schedule ``finish`` without awaiting it (safe inside a cancelled task's cleanup);
        ``close()`` waits for it."""
        task = asyncio.get_running_loop().create_task(self.finish(stream, abort_request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
