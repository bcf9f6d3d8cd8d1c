"""Response pacing: a budget of responses per second shared by all live requests.

Each response costs the same on Triton's response path whatever it carries, and that path
has a ceiling of a few thousand responses per second (ARCHITECTURE.md, "Platform facts"), so
under load it is cheaper to send several tokens per response than to let the response path
eat the engine's CPU time. With ``n`` requests streaming and a budget of ``B`` responses/s, a
request gets a response at most every ``n / B`` seconds; tokens that arrive sooner are held and
coalesced into its next response. A request's first response and its final one are never held, so
TTFT and end-to-end latency are unaffected; with few requests the gap is far below a decode
step and every token goes out at once.

Responses do not all cost the same downstream: one that a detokenizer step follows (the ``llm``
ensemble) costs that step's Python round trip too, one the generator answers as text
(``llm_fused``) does not. Each request therefore has a cost per response (``cost``; 1 for a text
response, ``DETOKENIZED_RESPONSE_COST`` for ids that the detokenizer turns into text), and the
budget is spent in those units: with live requests of total cost ``W``, each gets a response at
most every ``W / B`` seconds (every stream the same rate; the responses that need the
detokenizer then total at most ``B / DETOKENIZED_RESPONSE_COST`` per second). The measured
rates behind the numbers (one H100 host, 16 cores, BENCHMARKS.md "The fused ensemble"): through
``llm`` the path after the generator carries about 2,000 responses/s (more queue after the
generator: 40-59% of the offline engine at 4 senders and 5,000/s), through ``llm_fused``
5,000/s was the best budget tried.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from tritonllm.serving.coalesce import coalesce, merged

# Budget units a response costs when a detokenizer step follows it (``llm``), against 1 for a
# response the generator answers as text (``llm_fused``): 5,000 / 2,000 responses/s.
DETOKENIZED_RESPONSE_COST = 2.5


class ResponsePacer:
    """Holds back non-final outputs of a request until its next response is due.

    Held outputs are kept as they came (one list per request and choice) and merged once, when
    they are released; a pass costs the outputs that arrived plus the requests that fell due
    (a heap of due times), not every live request.

    Args:
        max_responses_per_s: the budget (responses of cost 1 per second); ``0`` (or less)
            disables pacing.
        cost: a request id's cost per response in budget units (module doc), asked once when
            the request's choice is first paced; None: 1 for every request.
    """

    def __init__(
        self, max_responses_per_s: float, cost: Callable[[str], float] | None = None
    ) -> None:
        self.max_responses_per_s = max_responses_per_s
        self._cost = cost
        # (request id, choice index) → its outputs not yet sent / its next send time / its cost
        self._held: dict[tuple[str, int], list[Any]] = {}
        self._next_send: dict[tuple[str, int], float] = {}
        self._costs: dict[tuple[str, int], float] = {}
        self._live_cost = 0.0  # the costs of the keys in _next_send
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
        live = self._live_cost + sum(self._cost_of(key) for key in arrived if key not in next_send)
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
                if next_send.pop(key, None) is not None:
                    self._live_cost -= self._costs[key]
                self._costs.pop(key, None)
            elif now >= next_send.get(key, 0.0):
                if key not in next_send:
                    self._live_cost += self._cost_of(key)
                next_send[key] = now + gap
            else:
                if key in new:
                    heapq.heappush(self._due, (next_send[key], key))
                continue
            ready.append(merged(held.pop(key)))
        return ready

    def _cost_of(self, key: tuple[str, int]) -> float:
        """The cost of ``key``'s responses (asked of ``cost`` once, kept until it finishes)."""
        value = self._costs.get(key)
        if value is None:
            value = self._costs[key] = 1.0 if self._cost is None else self._cost(key[0])
        return value

    def next_due(self) -> float | None:
        """The monotonic time when the earliest held output is due (None if nothing is held)."""
        due = self._due
        while due and (due[0][1] not in self._held or self._next_send.get(due[0][1]) != due[0][0]):
            heapq.heappop(due)
        return due[0][0] if due else None
