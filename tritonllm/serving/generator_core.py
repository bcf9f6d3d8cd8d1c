"""The generator's request bookkeeping, without Triton: what ``model_repository/generator``'s
``model.py`` delegates to, testable with plain Python objects.

One ``GeneratorCore`` per generator instance. ``execute`` takes one Triton request as plain
values (its id, its input arrays, its parameters) and a ``ResponseSink`` (the adapter's
response sender), validates it once (``serving.inputs.generate_request``), and submits it to
the engine front (``EngineThread`` or ``EngineProcess``). The engine's outputs go through a
``ResponseStreamer`` (sender thread: coalescing, pacing) to ``_deliver``, which turns each into
a ``ResponseChunk`` of its choice (``StreamState``) and sends it. Policies kept here:

- control requests: ``abort_request_id`` aborts that client id (every choice; an abort that
  arrives before its request is remembered, ``RequestTable``) and ``health_probe`` only reports
  whether the engine runs: an abort answers one empty final response, a health probe one final
  response that carries the engine's ``max_model_len`` and ``engine_steps`` (the steps the
  engine ran so far, all instances' requests together). With a control secret set,
  an abort must carry it (``control_secret``, compared in constant time), else it is refused
  (``permission_denied``) before it touches any state: only the service's own parts (the
  sidecar, the detokenizer, the ``ensemble`` model) abort, never another Triton client;
- leases: a ``client_lease`` control request (with the control secret) is held open,
  unanswered, until its client renews it (a new request of the same lease, which answers the
  older one with an empty final response) or for ``lease_s`` seconds without renewal (then it is
  answered: a request held open for good would keep tritonserver from unloading the generator on
  shutdown, which waits for every response sender). The lease ends when its client cancelled
  the open request (asked every ``lease_check_s`` on the sender thread's tick; a client that dies
  closes its gRPC stream, which Triton turns into a cancellation) or left it unrenewed for
  ``lease_grace_s`` (a client stalled that long); then every live request whose id starts with
  ``"<lease>/"`` is aborted in the engine, and ends with finish_reason ``"abort"``. The sidecar
  holds one, renewing it twice a second on one gRPC stream, and prefixes its request ids with
  it: through the ``llm_fused`` ensemble no step after the generator sees a cancelled stream, so
  without the lease a sidecar that dies would leave its generations running;
- admission: with ``max_live_requests``, a request that finds that many choices live (running
  or waiting in the engine, where each choice is a sequence of its own: a request of ``n``
  choices counts ``n``) is refused at once with ``server_overloaded`` (the sidecar's 429);
- choices: a request's responses carry each output's ``index``; the final flag comes with the
  engine's ``request_finished`` output (the engine counts live choices; nothing here does);
- cancellation: a request whose client cancelled (``ResponseSink.is_cancelled``, asked at most
  every ``cancel_check_s`` per request and at most ``cancel_checks_per_s`` times a second over
  all of them: an IPC round trip each), or whose stream is gone, is aborted in the engine and
  gets its final flag at once;
- errors: every error response is in the contract's wire form (``contract.errors``): a
  ``RequestError`` keeps its code, and so does an engine output that failed through the
  request's fault (``RequestOutput.error_code``); anything else is ``engine_unavailable``
  while the engine does not run, else ``internal_error``;
- latencies (``serving.metrics.LatencySamples``): TTFT, ITL and end-to-end as the responses go
  out, the engine's queue time from final outputs, handed to ``on_tick``;
- instances: with several instances sharing one engine (``instances``,
  ``serving.shared_engine``) Triton hands each request to any instance, so each control request
  reaches the others through the engine (``broadcast``): an abort by client id, a lease renewed
  (the others answer their open request of it and count it renewed) and a lease that ended (the
  others abort its requests too); a health probe fails on every instance once one of them
  lost its connection to the engine.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from tritonllm.contract import tensors
from tritonllm.contract.errors import ErrorCode, RequestError, encode_error
from tritonllm.engine.client import EngineClient
from tritonllm.engine.request import RequestOutput
from tritonllm.serving.inputs import generate_request, scalar
from tritonllm.serving.metrics import LatencySamples
from tritonllm.serving.request_table import RequestTable
from tritonllm.serving.response_sink import ResponseSink
from tritonllm.serving.response_streamer import ResponseStreamer
from tritonllm.serving.stream_state import ResponseChunk, StreamState

# How often a live request's client is asked whether it cancelled (seconds), and the most such
# checks per second over all live requests (each is an IPC round trip on the sender thread; with
# 256 requests each is then asked every 1.3 s). Through the ensemble they never fire (the
# detokenizer's CancelWatch turns a cancelled stream into an abort, ARCHITECTURE.md).
CANCEL_CHECK_S = 0.2
CANCEL_CHECKS_PER_S = 200.0
# How often each lease's client is asked whether it cancelled (seconds; one IPC each), how
# long a lease request is held open without renewal (its client renews it every 0.5 s), and
# how long a lease may stay unrenewed before its requests are aborted (a stalled client: a
# paused process, a blocked event loop).
LEASE_CHECK_S = 0.25
LEASE_S = 1.0
LEASE_GRACE_S = 30.0
# Between a lease id and the rest of the request ids it covers: "<lease>/<id>".
LEASE_SEPARATOR = "/"


# The control requests one instance hands to its siblings (``GeneratorCore._tell_siblings``).
ABORT_ID, LEASE_RENEWED, LEASE_ENDED = "abort_id", "lease_renewed", "lease_ended"


@dataclass
class _Entry:
    """A live request: its sink, one stream state per choice, when it arrived and when each
    choice last sent ids (monotonic seconds; for the latency histograms), and whether it is the
    sidecar's health probe (``tensors.HEALTH_PROBE_ID_PREFIX``: no latency samples)."""

    sink: ResponseSink
    states: list[StreamState]
    checked_at: float
    cancelled: bool = False  # aborted here: its remaining engine outputs are dropped
    arrival: float = 0.0
    last_sent: list[float | None] = field(default_factory=list)
    probe: bool = False


class _GuardedSink:
    """A request's ``ResponseSink`` whose calls never overlap and which makes none after the
    request's final response (later calls do nothing; ``is_cancelled`` answers False).

    Several threads reach one request's sink: its sender thread, the tick's cancellation scan,
    a lease renewal on Triton's execute thread. Triton 2.51's Python backend crashes
    tritonserver (SIGSEGV in ``TRITONBACKEND_ResponseFactoryIsCancelled``, seen 2026-12-06 on
    CPU) when a sender is asked ``is_cancelled()`` after its final response went out on another
    thread.
    """

    __slots__ = ("_sink", "_lock", "closed", "response_cost")

    def __init__(self, sink: ResponseSink) -> None:
        self._sink, self._lock, self.closed = sink, threading.Lock(), False
        self.response_cost = sink.response_cost

    def send(self, chunk: ResponseChunk | None, final: bool) -> None:
        with self._lock:
            if not self.closed:
                self.closed = final  # a final send that raised may still have released it
                self._sink.send(chunk, final)

    def send_error(self, message: str) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._sink.send_error(message)

    def send_info(self, max_model_len: int, engine_steps: int) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._sink.send_info(max_model_len, engine_steps)

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self.closed and self._sink.is_cancelled()


@dataclass
class _Lease:
    """A client lease: its open request's sink (None between two of them) and since when that
    request is open, or the lease has been closed (monotonic seconds)."""

    sink: ResponseSink | None = None
    since: float = 0.0


class GeneratorCore:
    """Requests in, responses out, for one generator instance.

    Args:
        engine: the engine front (an ``EngineClient``: ``EngineThread`` or ``EngineProcess``).
        on_tick: called on the sender thread every tick with ``(EngineStats, new tokens since
            the last tick, LoopTimes, SenderTimes, LatencySamples since the last tick)`` (the
            adapter's metrics).
        parent_alive: False once tritonserver (the stub's parent) is gone: the sender thread
            then makes no call into Triton (``ResponseSink`` or ``on_tick``) any more.
        log_warning, log_error: the adapter's logger.
        metrics_interval_s, max_responses_per_s: the sender thread's tick interval and
            response budget (``ResponseStreamer``).
        cancel_check_s: least seconds between two cancellation checks of one request.
        cancel_checks_per_s: most cancellation checks per second over all live requests.
        sender_threads: threads sending responses at once, each request always from the same
            one (``ResponseStreamer``'s ``senders``).
        control_secret: what an abort must carry as ``control_secret`` (None: aborts are not
            authenticated, for a tritonserver started without ``TRITONLLM_CONTROL_SECRET``).
        max_live_requests: most choices live at once, over all requests (None: no limit);
            a request that finds them reached gets ``server_overloaded``.
        max_model_len: the engine's context limit (tokens), which health probes report.
        lease_check_s, lease_s, lease_grace_s: seconds between two cancellation checks of each
            lease, that one lease request is held open, that a lease may stay unrenewed.
        instances: the generator's instances; more than one share the engine
            (``serving.shared_engine``; ``engine`` then has ``broadcast``, ``on_control`` and
            ``num_clients``): control requests reach them all (see "Instances" in the module
            doc), ``max_live_requests`` is also the engine's limit over all instances
            (``live_limit``, enforced by the engine), and a health probe
            fails while fewer instances than this are connected to the engine.
    """

    def __init__(
        self,
        engine: EngineClient,
        on_tick: Callable[[Any, int, Any, Any, LatencySamples], None],
        parent_alive: Callable[[], bool],
        log_warning: Callable[[str], None],
        log_error: Callable[[str], None],
        metrics_interval_s: float = 0.05,
        max_responses_per_s: float = 0.0,
        cancel_check_s: float = CANCEL_CHECK_S,
        cancel_checks_per_s: float = CANCEL_CHECKS_PER_S,
        sender_threads: int = 1,
        control_secret: str | None = None,
        max_live_requests: int | None = None,
        max_model_len: int = 0,
        lease_check_s: float = LEASE_CHECK_S,
        lease_s: float = LEASE_S,
        lease_grace_s: float = LEASE_GRACE_S,
        instances: int = 1,
    ) -> None:
        self.engine = engine
        self._instances = instances
        self._siblings = siblings = instances > 1
        if siblings:
            engine.on_control = self._on_sibling  # type: ignore[attr-defined]
            engine.live_limit = max_live_requests  # type: ignore[attr-defined]
        self._leases: dict[str, _Lease] = {}
        self._leases_lock = threading.Lock()
        self._lease_check_s, self._lease_s = lease_check_s, lease_s
        self._lease_grace_s = lease_grace_s
        self._last_lease_scan = time.monotonic()
        self._control_secret = None if control_secret is None else control_secret.encode()
        self._max_live_requests = max_live_requests
        self.max_model_len = max_model_len
        self._latencies = LatencySamples()  # swapped out under _tokens_lock at each tick
        self.requests: RequestTable[_Entry] = RequestTable()
        self._on_tick, self._parent_alive = on_tick, parent_alive
        self._warn, self._log_error = log_warning, log_error
        self._cancel_check_s = cancel_check_s
        self._cancel_checks_per_s = cancel_checks_per_s
        self._check_every = cancel_check_s  # seconds between two checks of one request
        self._new_tokens = 0  # generated since the last tick
        self._tokens_lock = threading.Lock()  # _deliver may run on several sender threads
        self._last_cancel_scan = time.monotonic()
        self.streamer = ResponseStreamer(
            self._deliver,
            self._tick,
            interval_s=metrics_interval_s,
            on_error=log_error,
            max_responses_per_s=max_responses_per_s,
            senders=sender_threads,
            cost=self._response_cost,
        )

    def start(self) -> GeneratorCore:
        """Start the sender thread."""
        self.streamer.start()
        return self

    # --- requests (Triton's execute thread) ------------------------------------------------
    def execute(
        self,
        request_id: str,
        inputs: Mapping[str, np.ndarray | None],
        parameters: str | Mapping[str, Any],
        sink: ResponseSink,
    ) -> None:
        """Handle one Triton request; a bad one is answered with its error and fails alone.

        Args:
            request_id: Triton's request id (an ensemble passes its own to every step).
            inputs: the generator's inputs by name (absent ones None or left out).
            parameters: the request's Triton parameters (``request.parameters()``).
            sink: where its responses go.
        """
        sink = _GuardedSink(sink)
        try:
            self._accept(request_id, inputs, parameters, sink)
        except RequestError as exc:
            sink.send_error(exc.wire())
        except Exception as exc:  # the engine front is shut down or died
            sink.send_error(encode_error(self._server_fault(), str(exc)))

    def _check_secret(self, given: np.ndarray | None) -> None:
        """Raises: RequestError (``permission_denied``) unless the control request carries the
        control secret (or none is set)."""
        if self._control_secret is None:
            return
        flat = [] if given is None else np.asarray(given).reshape(-1).tolist()
        value = flat[0] if len(flat) == 1 else b""
        value = value.encode() if isinstance(value, str) else bytes(value)
        if not hmac.compare_digest(value, self._control_secret):
            raise RequestError(
                ErrorCode.PERMISSION_DENIED,
                "control_secret",
                "control requests (aborts, leases) are taken only from the service itself"
                " (control_secret)",
            )

    def _server_fault(self) -> ErrorCode:
        alive = self.engine.is_alive()
        return ErrorCode.INTERNAL_ERROR if alive else ErrorCode.ENGINE_UNAVAILABLE

    def _accept(self, request_id, inputs, parameters, sink) -> None:
        abort_id = inputs.get(tensors.ABORT_REQUEST_ID.name)
        if abort_id is not None:
            self._check_secret(inputs.get(tensors.CONTROL_SECRET.name))
            target = scalar(abort_id, "abort_request_id", str)
            if not target:
                raise RequestError(
                    ErrorCode.INVALID_VALUE, "abort_request_id", "abort_request_id is empty"
                )
            for key in self.requests.abort(target):
                self.engine.abort(key)
            self._tell_siblings(ABORT_ID, target)
            sink.send(None, final=True)
            return
        lease = inputs.get(tensors.CLIENT_LEASE.name)
        if lease is not None:
            self._check_secret(inputs.get(tensors.CONTROL_SECRET.name))
            self._open_lease(scalar(lease, "client_lease", str), sink)
            return
        if inputs.get(tensors.HEALTH_PROBE.name) is not None:
            problem = self._unhealthy()
            if problem is None:
                stats = self.engine.stats()
                sink.send_info(self.max_model_len, 0 if stats is None else stats.num_steps)
            else:
                sink.send_error(encode_error(ErrorCode.ENGINE_UNAVAILABLE, problem))
            return
        request = generate_request(inputs, parameters)
        limit = self._max_live_requests
        if limit is not None and self._live_choices() >= limit:
            raise RequestError(
                ErrorCode.SERVER_OVERLOADED,
                None,
                f"the server is at its limit of {limit} sequences in progress; retry later",
            )
        if self.requests.was_aborted(request_id):  # its abort overtook it
            num_prompt = len(request.prompt_ids)
            sink.send(ResponseChunk([], [], "abort", num_prompt, 0, 0, final=True), final=True)
            return
        params = request.params
        now = time.monotonic()
        probe = request_id.startswith(tensors.HEALTH_PROBE_ID_PREFIX)
        entry = _Entry(sink, [], checked_at=now, arrival=now, probe=probe)
        key = self.requests.add(request_id, entry)
        own_key = None if key == request_id else key
        scored = None if params.prompt_logprobs is None else request.prompt_ids
        entry.states = [
            StreamState(
                request.stream,
                i,
                params.n,
                params.logprobs,
                request.echo_text,
                own_key,
                scored,
                params.prompt_logprobs,
            )
            for i in range(params.n)
        ]
        entry.last_sent = [None] * params.n
        try:
            self.engine.submit(key, request.prompt_ids, params, self.streamer.put)
        except Exception:
            self.requests.pop(key)
            raise

    def _live_choices(self) -> int:
        """Choices of the live requests (each a sequence in the engine)."""
        return sum(len(entry.states) for _, entry in self.requests.items())

    def _open_lease(self, lease: str, sink: ResponseSink) -> None:
        """Hold ``sink`` open as (a renewal of) lease ``lease`` (module doc, "leases"); an
        open request of the same lease is answered first.

        Raises:
            RequestError: an empty lease id, or one that holds the separator.
        """
        if not lease or LEASE_SEPARATOR in lease:
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                "client_lease",
                f"client_lease must be a non-empty id without {LEASE_SEPARATOR!r}",
            )
        self._renew_lease(lease, sink)
        self._tell_siblings(LEASE_RENEWED, lease)

    def _renew_lease(self, lease: str, sink: ResponseSink | None) -> None:
        """Count ``lease`` renewed now, with ``sink`` its open request (None: the renewal is
        open on a sibling instance); its older open request here is answered."""
        with self._leases_lock:
            state = self._leases.setdefault(lease, _Lease())
            older, state.sink, state.since = state.sink, sink, time.monotonic()
        if older is not None:
            _close(older)

    def _check_leases(self, now: float) -> None:
        """End the leases whose client went away (sender thread): an open request held
        ``lease_s`` without renewal is answered; a lease whose client cancelled, or that stayed
        unrenewed ``lease_grace_s``, ends and its requests are aborted in the engine."""
        if now - self._last_lease_scan < self._lease_check_s:
            return
        self._last_lease_scan = now
        with self._leases_lock:
            leases = list(self._leases.items())
        for lease, state in leases:
            sink = state.sink
            if sink is None:
                ended = now - state.since >= self._lease_grace_s
            else:
                ended = sink.is_cancelled()
                if not ended and now - state.since >= self._lease_s:
                    with self._leases_lock:
                        if state.sink is sink:  # not renewed meanwhile
                            state.sink, state.since = None, now
                    _close(sink)  # its client opens the next one
            if not ended:
                continue
            with self._leases_lock:
                if state.sink is not sink:  # renewed meanwhile
                    continue
                del self._leases[lease]
            self._abort_lease(lease)
            self._tell_siblings(LEASE_ENDED, lease)
            if sink is not None:
                _close(sink)

    def _abort_lease(self, lease: str) -> None:
        """Abort the live requests of ``lease`` in the engine (so that a client still there
        gets finish_reason "abort")."""
        prefix = lease + LEASE_SEPARATOR
        for key, entry in self.requests.items():
            if key.startswith(prefix) and not entry.cancelled:
                self.engine.abort(key)

    # --- sibling instances (the engine's receiver thread) ------------------------------------
    def _tell_siblings(self, kind: str, value: str) -> None:
        """Hand a control request's effect to the other instances of a shared engine."""
        if self._siblings:
            self.engine.broadcast((kind, value))  # type: ignore[attr-defined]

    def _on_sibling(self, payload: object) -> None:
        """What another instance was asked (``_tell_siblings``): an abort by client id aborts
        the requests of that id here too (or is remembered for one still on its way); a lease
        renewed there answers this instance's open request of it and counts as renewed; a
        lease ended there ends here too."""
        kind, value = cast(tuple[str, str], payload)
        if kind == ABORT_ID:
            for key in self.requests.abort(value):
                self.engine.abort(key)
        elif kind == LEASE_RENEWED:
            self._renew_lease(value, None)
        elif kind == LEASE_ENDED:
            with self._leases_lock:
                ended = self._leases.pop(value, None)
            self._abort_lease(value)
            if ended is not None and ended.sink is not None:
                _close(ended.sink)

    def _unhealthy(self) -> str | None:
        """Why a health probe fails (None: it passes): the engine does not run, or an instance
        of a shared engine is gone (its requests fail, since Triton never restarts a dead
        stub: the probe says so on every instance, so that supervision restarts the server)."""
        if not self.engine.is_alive():
            return "the engine is not running"
        connected = getattr(self.engine, "num_clients", None) if self._siblings else None
        if connected is not None and connected < self._instances:
            return (
                f"{self._instances - connected} of the generator's {self._instances} instances"
                " lost their engine connection"
            )
        return None

    # --- sender thread -----------------------------------------------------------------------
    def _response_cost(self, key: str) -> float:
        """The pacer's cost of ``key``'s responses: its sink's (1 once it is gone)."""
        entry = self.requests.get(key)
        return 1.0 if entry is None else entry.sink.response_cost

    def _deliver(self, outputs: list[RequestOutput]) -> int:
        """Send the responses of a batch of coalesced outputs; returns how many were sent
        (none once tritonserver is gone). A request whose response cannot be built fails
        alone, with an internal error; the others' outputs are still delivered. Safe on
        several sender threads at once for different requests."""
        if not self._parent_alive():
            return 0
        now = time.monotonic()
        self._pace_cancel_checks()
        with self._tokens_lock:
            self._new_tokens += sum(len(output.new_token_ids) for output in outputs)
        sent = 0
        for output in outputs:
            key = output.request_id
            entry = self.requests.get(key)
            if entry is None:
                continue
            try:
                sent += self._deliver_one(key, entry, output, now)
            except Exception as exc:
                sent += self._fail(key, entry, exc)
        return sent

    def _deliver_one(self, key: str, entry: _Entry, output: RequestOutput, now: float) -> int:
        """Send the response (if one is due) of one output; returns 1 if one was sent."""
        final = output.request_finished
        if final:
            self.requests.pop(key)
        if entry.cancelled:
            return 0
        chunk = entry.states[output.index].on_output(output)
        if chunk is None:
            return 0
        if chunk.error is not None:
            # One error response ends the whole Triton request; the other choices go too.
            entry.cancelled = True
            if not final:
                self.engine.abort(key)
            code = ErrorCode(chunk.error_code or ErrorCode.INTERNAL_ERROR)
            entry.sink.send_error(encode_error(code, chunk.error, chunk.error_param))
            return 1
        if not final and self._cancelled(entry, now):
            self._cancel(key, entry)
            return 0
        if not self._send(key, entry, chunk, final):
            return 0
        self._record(entry, output, chunk, final, now)
        return 1

    def _record(
        self, entry: _Entry, output: RequestOutput, chunk: ResponseChunk, final: bool, now: float
    ) -> None:
        """The latencies of a response just sent (``LatencySamples`` says which); none of a
        health probe's (synthetic: on an idle server it would be most of the samples)."""
        if entry.probe:
            return
        samples, index = self._latencies, output.index
        if chunk.output_ids:
            last = entry.last_sent[index]
            if last is None:
                samples.ttft_s.append(now - entry.arrival)
            else:
                samples.itl_s.append((now - last) / len(chunk.output_ids))
            entry.last_sent[index] = now
        if output.finished and output.queue_time_s is not None:
            samples.queue_s.append(output.queue_time_s)
        if final:
            samples.e2e_s.append(now - entry.arrival)

    def _fail(self, key: str, entry: _Entry, exc: Exception) -> int:
        """End a request whose output could not be turned into a response: an internal error
        to its client, an abort in the engine; returns 1 if the error was sent."""
        self._log_error(f"generator: request {key!r} failed: {exc!r}")
        if entry.cancelled:
            return 0
        entry.cancelled = True
        self.requests.pop(key)
        self.engine.abort(key)
        try:
            entry.sink.send_error(encode_error(ErrorCode.INTERNAL_ERROR, str(exc)))
            return 1
        except Exception:  # the stream may already be gone
            return 0

    def _send(self, key: str, entry: _Entry, chunk: ResponseChunk, final: bool) -> bool:
        """Send one response; False when the stream is gone (the request is then cancelled)."""
        try:
            entry.sink.send(chunk, final)
            return True
        except Exception as exc:
            self._warn(f"generator: dropping request {key!r}: {exc}")
            if not final and not entry.cancelled:
                self._cancel(key, entry)
            return False

    def _pace_cancel_checks(self) -> None:
        live = len(self.requests)
        self._check_every = max(self._cancel_check_s, live / self._cancel_checks_per_s)

    def _cancelled(self, entry: _Entry, now: float) -> bool:
        """Whether the client cancelled; asked at most every ``_check_every`` per request."""
        if now - entry.checked_at < self._check_every:
            return False
        entry.checked_at = now
        return entry.sink.is_cancelled()

    def _cancel(self, key: str, entry: _Entry) -> None:
        """Abort a cancelled request; its final flag goes now (its engine outputs are dropped)."""
        entry.cancelled = True
        self.engine.abort(key)
        try:
            entry.sink.send(None, final=True)
        except Exception:  # the stream may already be gone
            pass

    def _tick(self) -> None:
        if not self._parent_alive():
            return
        now = time.monotonic()
        self._check_leases(now)
        if now - self._last_cancel_scan >= self._cancel_check_s:
            # Requests that send nothing for a while (waiting for admission) are checked here.
            self._last_cancel_scan = now
            self._pace_cancel_checks()
            for key, entry in self.requests.items():
                if not entry.cancelled and self._cancelled(entry, now):
                    self._cancel(key, entry)
        with self._tokens_lock:
            new_tokens, self._new_tokens = self._new_tokens, 0
            latencies, self._latencies = self._latencies, LatencySamples()
        self._on_tick(
            self.engine.stats(),
            new_tokens,
            self.engine.loop_times(),
            self.streamer.times(),
            latencies,
        )

    def finalize(self) -> None:
        """Stop the engine and the sender thread; fail the requests still live."""
        self.engine.shutdown()
        self.streamer.stop()
        unloading = encode_error(ErrorCode.ENGINE_UNAVAILABLE, "the model is being unloaded")
        with self._leases_lock:
            leases, self._leases = list(self._leases.values()), {}
        for state in leases:
            if state.sink is not None:
                _close(state.sink)
        for _, entry in self.requests.items():
            if not entry.cancelled:
                try:
                    entry.sink.send_error(unloading)
                except Exception:
                    pass


def _close(sink: ResponseSink) -> None:
    """Send ``sink`` its final (empty) response; a stream already gone is left as it is."""
    with contextlib.suppress(Exception):
        sink.send(None, final=True)
