"""`EngineThread`: runs an `LLMEngine` on its own daemon thread for the Triton generator (an
`engine.client.EngineClient`).

Submissions and aborts from any thread are queued under one condition variable and applied
between steps; the thread sleeps on it when there is no work. Outputs are delivered by calling
each request's callback on the engine thread. `CallbackTable` (the routing of outputs to
callbacks, n > 1 children included) and `admit_and_step` (one loop iteration) are shared with
`engine_process.EngineProcess`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from tritonllm.contract.errors import ErrorCode
from tritonllm.engine.client import EngineClient, LoopTimes, OutputCallback
from tritonllm.engine.engine import LLMEngine
from tritonllm.engine.request import RequestOutput
from tritonllm.engine.stats import EngineStats
from tritonllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Submission = tuple[str, list[int], SamplingParams]  # (request id, prompt ids, params)


class _Route:
    __slots__ = ("callback", "num_prompt_tokens")

    def __init__(self, callback: OutputCallback, num_prompt_tokens: int) -> None:
        self.callback = callback
        self.num_prompt_tokens = num_prompt_tokens


class CallbackTable:
    """Routes each `RequestOutput` to the callback of its request (thread-safe).

    A request registered as `request_id` gets every output of that id (all its choices). Its
    entry is dropped after the output with `request_finished` (the engine counts the choices).
    Callbacks run outside the table's lock; an exception in one is logged and does not reach
    the caller.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}

    def add(self, request_id: str, callback: OutputCallback, num_prompt_tokens: int = 0) -> None:
        """Register a request (`num_prompt_tokens` goes into `fail_all`'s outputs).

        Raises:
            ValueError: `request_id` is still registered (in flight).
        """
        with self._lock:
            if request_id in self._routes:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._routes[request_id] = _Route(callback, num_prompt_tokens)

    def discard(self, request_id: str) -> bool:
        """Forget a request without calling its callback (it never reached the engine).
        Returns False when it was not registered (any more)."""
        with self._lock:
            return self._routes.pop(request_id, None) is not None

    def __len__(self) -> int:
        return len(self._routes)

    def deliver(self, out: RequestOutput) -> None:
        """Call the callback of `out`'s request with it; outputs of unknown ids are dropped."""
        with self._lock:
            route = self._routes.get(out.request_id)
            if route is None:
                return
            if out.request_finished:
                del self._routes[out.request_id]
        _call(route.callback, out)

    def fail_all(self, message: str, code: ErrorCode | None = None) -> None:
        """End every registered request with one final "error" output carrying `message`
        and `code` (`request_finished`: it ends all n choices) and forget them all."""
        with self._lock:
            routes, self._routes = self._routes, {}
        for request_id, route in routes.items():
            out = error_output(request_id, route.num_prompt_tokens, message, code)
            _call(route.callback, out)


def _call(callback: OutputCallback, out: RequestOutput) -> None:
    try:
        callback(out)
    except Exception:
        logger.exception("output callback failed for %s", out.request_id)


class EngineThread(EngineClient):
    """Thread-safe front of an `LLMEngine`, on a thread of this process (`EngineClient`).

    Errors: `submit` validates synchronously (ValueError, nothing queued). An exception inside
    a step fails the requests in flight with finish_reason "error" (message in
    `RequestOutput.error`) and the thread keeps serving; an exception in a callback is logged.

    Args:
        engine: the engine this thread drives (no other thread may call it).
        name: the thread's name.
        stall_timeout_s: `is_alive()` turns False while one engine step (or the delivery of
            its outputs) has been running for longer than this many seconds: a hung engine;
            it turns True again when the step returns. None: never. The default stays above
            a fresh GPU machine's first-request kernel compilation (ARCHITECTURE.md,
            "Platform facts", FlashInfer).
    """

    def __init__(
        self,
        engine: LLMEngine,
        name: str = "tritonllm-engine",
        stall_timeout_s: float | None = 300.0,
    ) -> None:
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self._step_started: float | None = None  # monotonic start of the running step
        self._cv = threading.Condition()
        self._submissions: deque[Submission] = deque()
        self._aborts: deque[str] = deque()
        self._routes = CallbackTable()
        self._stop = False
        self._stats = engine.stats()
        self._times = LoopTimes()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        callback: OutputCallback,
    ) -> None:
        """Queue a request; `callback(RequestOutput)` is called from the engine thread for each
        output (every choice's), the last one with `request_finished=True`.

        Raises:
            RequestError: invalid request (see `LLMEngine.check_request`).
            ValueError: a request id that is still in flight.
            RuntimeError: after `shutdown()`.
        """
        self.engine.check_request(prompt_ids, params)
        with self._cv:
            if self._stop:
                raise RuntimeError("engine thread is shut down")
            self._routes.add(request_id, callback)
            self._submissions.append((request_id, list(prompt_ids), params))
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        """Abort a request between steps; its callback gets a final "abort" output. Unknown or
        finished ids are ignored."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def stats(self) -> EngineStats:
        """The engine stats as of the end of the last step."""
        return self._stats

    def loop_times(self) -> LoopTimes:
        """The engine thread's time counters as of the end of its last step."""
        return self._times

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the thread (requests in flight get no further outputs) and join it."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the engine serves: its thread runs and no step has been running for longer
        than `stall_timeout_s`."""
        if not self._thread.is_alive():
            return False
        started, stall = self._step_started, self.stall_timeout_s
        return stall is None or started is None or time.monotonic() - started <= stall

    # ---- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        cpu0 = time.thread_time()
        busy = callbacks = 0.0
        loops = 0
        while True:
            with self._cv:
                while not (
                    self._stop or self._submissions or self._aborts or engine.has_unfinished()
                ):
                    self._cv.wait()
                if self._stop:
                    engine.shutdown()
                    return
                submissions, self._submissions = list(self._submissions), deque()
                aborts, self._aborts = list(self._aborts), deque()
            start = time.perf_counter()
            self._step_started = time.monotonic()
            outputs = admit_and_step(engine, submissions, aborts)
            self._stats = engine.stats()
            delivered = time.perf_counter()
            for out in outputs:
                self._routes.deliver(out)
            self._step_started = None
            end = time.perf_counter()
            busy += end - start
            callbacks += end - delivered
            loops += 1
            self._times = LoopTimes(busy, time.thread_time() - cpu0, callbacks, loops)


def admit_and_step(
    engine: LLMEngine, submissions: list[Submission], aborts: list[str]
) -> list[RequestOutput]:
    """One iteration of an engine loop: add the submitted requests, apply the aborts, run one
    `engine.step()`; return the outputs to deliver.

    A request that `add_request` refuses (validated before it was queued, so unexpected) gets
    one "error" output with `request_finished`, which ends all its n choices.
    An exception inside the step fails every request in flight with finish_reason "error";
    the engine stays usable.
    """
    outputs: list[RequestOutput] = []
    for request_id, prompt_ids, params in submissions:
        try:
            engine.add_request(request_id, prompt_ids, params)
        except Exception as exc:
            logger.exception("add_request failed for %s", request_id)
            outputs.append(error_output(request_id, len(prompt_ids), str(exc)))
    for request_id in aborts:
        engine.abort(request_id)
    try:
        outputs.extend(engine.step())
    except Exception as exc:
        logger.exception("engine step failed; failing the requests in flight")
        outputs.extend(engine.abort_all(f"engine error: {exc}"))
    return outputs


def error_output(
    request_id: str, num_prompt_tokens: int, message: str, code: ErrorCode | None = None
) -> RequestOutput:
    """A request's final output after an engine failure: no ids, finish_reason "error",
    `request_finished` (it ends every choice), the error's `code` if given (None: the
    generator reports ``internal_error``)."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        finished=True,
        finish_reason="error",
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=0,
        cached_tokens=0,
        error=message,
        error_code=None if code is None else code.value,
        request_finished=True,
    )
