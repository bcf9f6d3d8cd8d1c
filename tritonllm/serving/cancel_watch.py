"""When the detokenizer must turn a client's cancellation into an abort of the generation.

Triton 2.51 does not pass the cancellation of an ``llm`` stream into the running generator step,
but its ensemble scheduler marks every later step request of that ensemble request as
cancelled: each generator response that follows reaches the detokenizer as a request whose
``is_cancelled()`` is true (ARCHITECTURE.md, "Platform facts"). The detokenizer then asks the
generator to abort the generation (a control request), which frees its KV pages and brings the
generator's final response, and the ensemble request completes.

``is_cancelled()`` is an IPC round trip to tritonserver, so a request id is asked at its first
response and then at most every ``interval_s``; an id found cancelled is reported once.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CancelWatch:
    """Per request id: when to ask whether it was cancelled, and whether to abort it now.

    Args:
        interval_s: least seconds between two checks of one request id.
        ttl_s: an id not seen for this long is forgotten (its final response never came here,
            e.g. the generator failed it).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        interval_s: float = 0.5,
        ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s, self.ttl_s, self._clock = interval_s, ttl_s, clock
        self._checked: dict[str, float] = {}  # request id -> when it was last asked
        self._aborted: dict[str, float] = {}  # request id -> when its abort was reported
        self._next_prune = clock() + ttl_s

    def should_abort(self, request_id: str, final: bool, is_cancelled: Callable[[], bool]) -> bool:
        """Whether the caller must abort ``request_id`` now: it was found cancelled (asking
        ``is_cancelled`` only when a check is due) and was not reported before.

        Args:
            request_id: the generation's id (the one the generator's abort takes).
            final: this is the last response of the request (or of one of its choices).
            is_cancelled: asks Triton whether this response's request was cancelled.
        """
        now = self._clock()
        if now >= self._next_prune:
            self._prune(now)
        if request_id in self._aborted:
            if final:
                del self._aborted[request_id]
            return False
        last = self._checked.get(request_id)
        if last is not None and now - last < self.interval_s:
            if final:
                del self._checked[request_id]
            return False
        self._checked[request_id] = now
        if is_cancelled():
            del self._checked[request_id]
            if not final:
                self._aborted[request_id] = now
            return not final  # a final response needs no abort: the generation has ended
        if final:
            del self._checked[request_id]
        return False

    def _prune(self, now: float) -> None:
        horizon = now - self.ttl_s
        for table in (self._checked, self._aborted):
            for request_id in [r for r, t in table.items() if t < horizon]:
                del table[request_id]
        self._next_prune = now + self.ttl_s

    def __len__(self) -> int:
        """Request ids remembered (checked or aborted)."""
        return len(self._checked) + len(self._aborted)
