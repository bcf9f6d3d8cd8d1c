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

import heapq
from typing import Any

from tritonllm.serving.coalesce import coalesce, merged


class ResponsePacer:
    """Holds back non-final outputs of a request until its next response is due.

    Held outputs are kept as they came (one list per request and choice) and merged once, when
    they are released; a pass costs the outputs that arrived plus the requests that fell due
    (a heap of due times), not every live request.

    Args:
        max_responses_per_s: the budget; ``0`` (or less) disables pacing.
    """

    def __init__(self, max_responses_per_s: float) -> None:
        self.max_responses_per_s = max_responses_per_s
        # (request id, choice index) → its outputs not yet sent / its next send time
        self._held: dict[tuple[str, int], list[Any]] = {}
        self._next_send: dict[tuple[str, int], float] = {}
        self._due: list[tuple[float, tuple[str, int]]] = []  # heap: (due time, held key)

    def admit(self, outputs: list[Any], now: float) -> list[Any]:
        """Merge ``outputs`` (``RequestOutput``, in engine order) with the held ones; return
        those to send now, one per request and choice: first the held ones that fell due, then
        the ones that got outputs, in the order of their last output. The rest stay held until
        ``next_due()``."""
        if self.max_responses_per_s <= 0:
            return coalesce(outputs)
        held, next_send = self._held, self._next_send
        arrived: dict[tuple[str, int], None] = {}  # keys in the order of their last output
        new = set()  # keys held from this pass on (one held before has its heap entry)
        for output in outputs:
            key = (output.request_id, output.index)
            group = held.get(key)
            if group is None:
                held[key] = [output]
                new.add(key)
            elif group[-1].finished:
                continue  # stale: an output after the finished one is dropped
            else:
                group.append(output)
            arrived.pop(key, None)
            arrived[key] = None
        live = len(next_send) + sum(1 for key in arrived if key not in next_send)
        gap = live / self.max_responses_per_s
        ready = []
        while self._due and self._due[0][0] <= now:
            due, key = heapq.heappop(self._due)
            if key in arrived or key not in held or next_send.get(key) != due:
                continue  # handled below, or an outdated entry
            next_send[key] = now + gap
            ready.append(merged(held.pop(key)))
        for key in arrived:
            group = held[key]
            if group[-1].finished:
                next_send.pop(key, None)
            elif now >= next_send.get(key, 0.0):
                next_send[key] = now + gap
            else:
                if key in new:
                    heapq.heappush(self._due, (next_send[key], key))
                continue
            ready.append(merged(held.pop(key)))
        return ready

    def next_due(self) -> float | None:
        """The monotonic time when the earliest held output is due (None if nothing is held)."""
        due = self._due
        while due and (due[0][1] not in self._held or self._next_send.get(due[0][1]) != due[0][0]):
            heapq.heappop(due)
        return due[0][0] if due else None
