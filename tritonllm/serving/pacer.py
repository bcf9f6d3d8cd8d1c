"""Response pacing: a budget of responses per second shared by all live requests.

Each response costs the same on Triton's response path whatever it carries, and that path
has a ceiling of a few thousand responses per second (ARCHITECTURE.md, "Platform facts"), so
under load it is cheaper to send several tokens per response than to let the response path
eat the engine's CPU time. With ``n`` requests streaming and a budget of ``B`` responses/s, a
request gets a response at most every ``n / B`` seconds; tokens that arrive sooner are held and
coalesced into its next response. A request's first response and its final one are never held, so
TTFT and end-to-end latency are unaffected; with few requests the gap is far below a decode
step and every token goes out at once.
"""

from __future__ import annotations

from typing import Any

from tritonllm.serving.coalesce import coalesce


class ResponsePacer:
    """Holds back non-final outputs of a request until its next response is due.

    Args:
        max_responses_per_s: the budget; ``0`` (or less) disables pacing.
    """

    def __init__(self, max_responses_per_s: float) -> None:
        self.max_responses_per_s = max_responses_per_s
        self._held: dict[str, Any] = {}  # request id → coalesced RequestOutput not yet sent
        self._next_send: dict[str, float] = {}  # request id → monotonic time of next response

    def admit(self, outputs: list[Any], now: float) -> list[Any]:
        """Merge ``outputs`` (``RequestOutput``, in engine order) with the held ones; return
        those to send now, one per request. The rest stay held until ``next_due()``."""
        merged = coalesce([*self._held.values(), *outputs])
        self._held.clear()
        if self.max_responses_per_s <= 0:
            return merged
        live = len(self._next_send.keys() | {o.request_id for o in merged})
        gap = live / self.max_responses_per_s
        ready = []
        for output in merged:
            key = output.request_id
            if output.finished:
                self._next_send.pop(key, None)
                ready.append(output)
            elif now >= self._next_send.get(key, 0.0):
                self._next_send[key] = now + gap
                ready.append(output)
            else:
                self._held[key] = output
        return ready

    def next_due(self) -> float | None:
        """The monotonic time when the earliest held output is due (None if nothing is held)."""
        if not self._held:
            return None
        return min(self._next_send[key] for key in self._held)
