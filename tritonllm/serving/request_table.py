"""The generator's table of live requests, keyed by the request id the engine sees."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")

# An abort may overtake its request by this long (the sidecar aborts at once when its client
# disconnects, while the request may still be in the tokenizer).
EARLY_ABORT_TTL_S = 10.0
# Most early aborts remembered at once; the oldest is forgotten first beyond it.
MAX_EARLY_ABORTS = 4096


class RequestTable(Generic[T]):
    """Thread-safe map engine key → entry, remembering each entry's client request id.

    The engine key is the client's request id (Triton's ``request.request_id()``; an ensemble
    passes its own id to every step) unless that is empty or already live: then a key
    ``"<id>~<16 random hex digits>"`` is made, so two clients reusing an id never share engine
    state and no client can guess another's key.

    An abort names a client id or an engine key; an empty id matches nothing (requests sent
    without an id are reached only through their own keys). An abort can overtake its request
    (a client that disconnects at once: the abort goes to the generator directly while the
    request still passes the tokenizer), so an abort that matches no live request is
    remembered for ``abort_ttl_s`` seconds and ends that request on arrival; at most
    ``max_early_aborts`` are remembered (the oldest go first). Every operation but ``items`` is
    O(1) in the number of live requests and remembered aborts (amortised).
    """

    def __init__(
        self, abort_ttl_s: float = EARLY_ABORT_TTL_S, max_early_aborts: int = MAX_EARLY_ABORTS
    ) -> None:
        self._abort_ttl_s = abort_ttl_s
        self._max_early_aborts = max_early_aborts
        # client request id → monotonic expiry, oldest first (every entry lives the same TTL).
        self._early_aborts: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._entries: dict[str, T] = {}
        self._client_ids: dict[str, str] = {}  # engine key → client request id
        self._keys: dict[str, set[str]] = {}  # client request id → its live engine keys

    def add(self, request_id: str, entry: T) -> str:
        """Register ``entry``; return its engine key."""
        with self._lock:
            key = request_id
            while not key or key in self._entries:
                key = f"{request_id or 'request'}~{secrets.token_hex(8)}"
            self._entries[key] = entry
            self._client_ids[key] = request_id
            self._keys.setdefault(request_id, set()).add(key)
            return key

    def abort(self, request_id: str) -> list[str]:
        """Engine keys to abort for ``request_id`` (a client id or an engine key); remembers
        the id for a request still on its way if none is live. An empty id matches nothing."""
        if not request_id:
            return []
        keys = self.keys_of(request_id)
        if not keys:
            now = time.monotonic()
            with self._lock:
                early = self._early_aborts
                while early and next(iter(early.values())) <= now:
                    early.popitem(last=False)
                early.pop(request_id, None)
                early[request_id] = now + self._abort_ttl_s
                while len(early) > self._max_early_aborts:
                    early.popitem(last=False)
        return keys

    def was_aborted(self, request_id: str) -> bool:
        """Whether an abort for ``request_id`` arrived before it (consumes the record)."""
        if not request_id:
            return False
        with self._lock:
            expiry = self._early_aborts.pop(request_id, None)
        return expiry is not None and expiry > time.monotonic()

    @property
    def num_early_aborts(self) -> int:
        """Aborts remembered for requests not seen yet (expired ones may still count)."""
        with self._lock:
            return len(self._early_aborts)

    def get(self, key: str) -> T | None:
        with self._lock:
            return self._entries.get(key)

    def pop(self, key: str) -> T | None:
        """Remove and return the entry of ``key`` (None if unknown)."""
        with self._lock:
            client_id = self._client_ids.pop(key, None)
            if client_id is not None:
                keys = self._keys[client_id]
                keys.discard(key)
                if not keys:
                    del self._keys[client_id]
            return self._entries.pop(key, None)

    def keys_of(self, request_id: str) -> list[str]:
        """Engine keys of the live requests whose client request id is ``request_id``, or the
        live request whose engine key it is. An empty id has none."""
        if not request_id:
            return []
        with self._lock:
            keys = set(self._keys.get(request_id, ()))
            if request_id in self._entries:
                keys.add(request_id)
            return sorted(keys)

    def items(self) -> list[tuple[str, T]]:
        """A snapshot of ``(key, entry)`` pairs."""
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
