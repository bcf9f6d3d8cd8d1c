"""`EngineClient`: the interface through which the Triton generator drives a running engine.

Two implementations: `engine_thread.EngineThread` (the engine on a thread of this process) and
`engine_process.EngineProcess` (the engine in a child process with a GIL of its own). Both
queue submissions and aborts and apply them between engine steps, deliver each request's
`RequestOutput`s in order to its callback from one thread of theirs (the last one with
`finished=True`), and report the engine's stats and loop times as of its last step. The
interface is declared once here (as Triton's OpenAI frontend declares its `LLMEngine`
Protocol), so the generator and the tests are written against it, not against either class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tritonllm.engine.request import RequestOutput
    from tritonllm.engine.stats import EngineStats
    from tritonllm.sampling_params import SamplingParams

# Called with each output of a request, from the client's delivery thread. Callbacks must not
# block; they may call `submit` and `abort`.
OutputCallback = Callable[["RequestOutput"], None]


@dataclass(frozen=True)
class LoopTimes:
    """Where the engine loop's time went since it started (seconds, monotonic counters).

    Attributes:
        busy_s: wall time with work to do (submissions, aborts, `engine.step()`, delivery);
            the rest of the loop's life it slept waiting for work.
        cpu_s: CPU time of the loop's thread itself (`time.thread_time`), including waits for
            the GPU (`EngineStats.gpu_wait_s`: CUDA event waits spin). `busy_s - cpu_s` is time
            blocked otherwise, mostly on the GIL when the loop shares its process.
        callback_s: wall time spent delivering outputs: the callbacks (`EngineThread`), or
            encoding and sending step messages (`EngineProcess`).
        loops: iterations of the loop that did work (about one engine step each).
    """

    busy_s: float = 0.0
    cpu_s: float = 0.0
    callback_s: float = 0.0
    loops: int = 0


class EngineClient(Protocol):
    """A running engine behind a thread-safe front (see the module docstring)."""

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        callback: OutputCallback,
    ) -> None:
        """Queue a request; `callback(RequestOutput)` gets each of its outputs (every choice's,
        by `index`), the last with `request_finished`.

        Raises:
            RequestError: (a ValueError) invalid request (the checks of
                `LLMEngine.check_request`), validated synchronously (nothing queued).
            ValueError: a request id that is still in flight.
            RuntimeError: after `shutdown()`, or once the engine is gone.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request between steps; its callback gets a final "abort" output. Unknown or
        finished ids are ignored."""
        ...

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of its last step."""
        ...

    def loop_times(self) -> LoopTimes:
        """The engine loop's time counters as of its last step."""
        ...

    def is_alive(self) -> bool:
        """Whether the engine serves: running, not shut down, and not stalled in a step."""
        ...

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine (requests in flight get no further outputs) within about `timeout`
        seconds."""
        ...
