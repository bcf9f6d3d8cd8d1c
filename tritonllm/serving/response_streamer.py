"""The generator's sender thread: engine outputs → coalesced batches → Triton responses.

The engine thread only enqueues (``put`` is its callback), so a slow response path never stalls
a decode step. The sender drains everything that is queued, coalesces it per request (outputs
that piled up while it was busy become one response), paces it (``ResponsePacer``: a budget of
responses per second under load) and hands the batch to ``deliver``; ``tick`` runs at most
every ``interval_s`` seconds and at once after a batch that finished a request (metrics,
cancellation checks).

With ``senders`` > 1 the batch is split by request id over that many sender threads, which call
``deliver`` at the same time (each request always on the same one, so its responses keep their
order) while the sender waits for all of them: Triton's ``send`` waits for tritonserver without
the GIL, so responses to different requests overlap (``benchmarks/response_path.py --triton``).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tritonllm.serving.pacer import ResponsePacer

_STOP = object()
_FAILED = object()  # what `_call` returns when the callable raised


@dataclass(frozen=True)
class SenderTimes:
    """The sender thread's counters since it started.

    Attributes:
        busy_s: wall seconds in ``deliver`` and ``tick`` (the Triton response path).
        cpu_s: CPU seconds of the thread (``time.thread_time``); ``busy_s - cpu_s`` is time
            blocked in Triton's IPC or waiting for the GIL.
        responses: responses ``deliver`` reported sending (its return value; a ``deliver``
            that returns None counts one per output handed to it).
    """

    busy_s: float = 0.0
    cpu_s: float = 0.0
    responses: int = 0


class ResponseStreamer:
    """A daemon thread draining engine outputs into ``deliver``.

    Args:
        deliver: called on the sender thread with ``list[RequestOutput]``, one per request;
            returns the number of responses it sent (or None).
        tick: called on the sender thread periodically (see module docstring).
        interval_s: seconds between ticks.
        on_error: called with a traceback string when ``deliver`` or ``tick`` raises (the
            thread keeps running).
        max_responses_per_s: the ``ResponsePacer`` budget; 0 sends every output at once.
        cost: a request id's cost per response for the pacer (``ResponsePacer``'s ``cost``).
        senders: threads that call ``deliver`` (see the module docstring); ``deliver`` must
            then be safe to call from several threads at once for different requests.
    Raises:
        ValueError: ``senders`` < 1.
    """

    def __init__(
        self,
        deliver: Callable[[list[Any]], int | None],
        tick: Callable[[], None],
        interval_s: float = 0.05,
        on_error: Callable[[str], None] | None = None,
        max_responses_per_s: float = 0.0,
        senders: int = 1,
        cost: Callable[[str], float] | None = None,
    ) -> None:
        if senders < 1:
            raise ValueError(f"senders must be >= 1, got {senders}")
        self._deliver = deliver
        self._tick = tick
        self._interval_s = interval_s
        self._on_error = on_error or (lambda text: print(text, flush=True))
        self._pacer = ResponsePacer(max_responses_per_s, cost)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._times = SenderTimes()
        self._thread = threading.Thread(target=self._run, name="tritonllm-sender", daemon=True)
        self._pool = [_Sender(self._call, self._deliver, i) for i in range(senders - 1)]

    def start(self) -> ResponseStreamer:
        for sender in self._pool:
            sender.thread.start()
        self._thread.start()
        return self

    def put(self, output: Any) -> None:
        """Enqueue one ``RequestOutput`` (thread-safe, never blocks): the engine callback."""
        self._queue.put(output)

    def times(self) -> SenderTimes:
        """The sender thread's counters as of its last batch."""
        return self._times

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, then end the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        for sender in self._pool:
            sender.jobs.put(None)

    def _drain(self, timeout: float) -> tuple[list[Any], bool]:
        batch: list[Any] = []
        try:
            batch.append(self._queue.get(timeout=timeout))
            while True:
                batch.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        stopping = any(item is _STOP for item in batch)
        return [item for item in batch if item is not _STOP], stopping

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`; an exception is reported to `on_error` (the result is then `_FAILED`)."""
        try:
            return fn(*args)
        except Exception:  # a failing response must not end the sender thread
            self._on_error(traceback.format_exc())
            return _FAILED

    def _send(self, merged: list[Any]) -> int:
        """``deliver`` the batch (split over the sender threads); the responses it sent."""
        if not self._pool:
            shards = [merged]
        else:
            shards = [[] for _ in range(len(self._pool) + 1)]
            for output in merged:
                shards[hash(output.request_id) % len(shards)].append(output)
        results: queue.SimpleQueue = queue.SimpleQueue()
        waiting = 0
        for sender, shard in zip(self._pool, shards[1:], strict=True):
            if shard:
                sender.jobs.put((shard, results))
                waiting += 1
        counts = [_count(self._call(self._deliver, shards[0]), shards[0])] if shards[0] else []
        counts += [results.get() for _ in range(waiting)]
        return sum(counts)

    def _run(self) -> None:
        next_tick = time.monotonic()
        cpu0 = time.thread_time()
        busy = 0.0
        responses = 0
        while True:
            due = self._pacer.next_due()
            wake = next_tick if due is None else min(next_tick, due)
            outputs, stopping = self._drain(max(0.0, wake - time.monotonic()))
            start = time.monotonic()
            merged = self._pacer.admit(outputs, start)
            if merged:
                responses += self._send(merged)
            now = time.monotonic()
            if now >= next_tick or any(o.finished for o in merged):
                self._call(self._tick)
                next_tick = now = time.monotonic()
                next_tick += self._interval_s
            busy += now - start
            self._times = SenderTimes(busy, time.thread_time() - cpu0, responses)
            if stopping:
                return


def _count(sent: Any, shard: list[Any]) -> int:
    """Responses a ``deliver`` call reported (None: one per output; failed: none)."""
    if sent is _FAILED:
        return 0
    return len(shard) if sent is None else sent


class _Sender:
    """One extra sender thread: ``deliver``s the shards it is given, reports their counts."""

    def __init__(self, call: Callable[..., Any], deliver: Callable[..., Any], i: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._call, self._deliver = call, deliver
        self.thread = threading.Thread(target=self._run, name=f"tritonllm-sender-{i + 1}")
        self.thread.daemon = True

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            shard, results = job
            results.put(_count(self._call(self._deliver, shard), shard))
