"""Stop strings (OpenAI ``stop``) applied to the streamed text in the sidecar.

The ensemble stops on token ids; strings can span tokens, so they are matched on the text. Text
that could still become the start of a stop string is held back until it cannot, so a stream
never shows part of a stop string, and the output ends just before the earliest match (OpenAI
excludes the stop sequence from the returned text).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Incremental matcher over text deltas.

    Args:
        stops: the stop strings (empty strings are ignored).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return ``(text safe to emit, stopped)``.

        Once ``stopped`` is True the emitted text ends right before the earliest stop string and
        the request should end.
        """
        if not self.stops:
            return delta, False
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return text[: min(hits)], True
        keep = self._partial_suffix(text)
        self._pending = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, released when generation ended without a match."""
        text, self._pending = self._pending, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        # Longest suffix of ``text`` that is a proper prefix of some stop string.
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
