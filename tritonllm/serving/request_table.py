"""The generator's table of live requests, keyed by the request id the engine sees."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class RequestTable(Generic[T]):
    """Thread-safe map engine key → entry, remembering each entry's client request id.

    The engine key is the client's request id (Triton's ``request.request_id()``; an ensemble
    passes its own id to every step) unless that is empty or already live: then a unique key
    ``"<id>~<n>"`` is made, so two clients reusing an id never share engine state.

    An abort can overtake its request (a client that disconnects at once: the abort goes to
    the generator directly while the request still passes the tokenizer), so an abort of an
    unknown id is remembered for ``abort_ttl_s`` seconds and ends that request on arrival.
    """

    def __init__(self, abort_ttl_s: float = 10.0) -> None:
        self._abort_ttl_s = abort_ttl_s
        self._early_aborts: dict[str, float] = {}  # client request id → monotonic expiry
        self._lock = threading.Lock()
        self._entries: dict[str, T] = {}
        self._client_ids: dict[str, str] = {}
        self._counter = itertools.count(1)

    def add(self, request_id: str, entry: T) -> str:
        """Register ``entry``; return its engine key."""
        with self._lock:
            key = request_id
            while not key or key in self._entries:
                key = f"{request_id or 'request'}~{next(self._counter)}"
            self._entries[key] = entry
            self._client_ids[key] = request_id
            return key

    def abort(self, request_id: str) -> list[str]:
        """Engine keys to abort for client id ``request_id``; remembers the id if none is live."""
        keys = self.keys_of(request_id)
        if not keys and request_id:
            now = time.monotonic()
            with self._lock:
                self._early_aborts = {r: t for r, t in self._early_aborts.items() if t > now}
                self._early_aborts[request_id] = now + self._abort_ttl_s
        return keys

    def was_aborted(self, request_id: str) -> bool:
        """Whether an abort for ``request_id`` arrived before it (consumes the record)."""
        with self._lock:
            expiry = self._early_aborts.pop(request_id, None)
        return expiry is not None and expiry > time.monotonic()

    def get(self, key: str) -> T | None:
        with self._lock:
            return self._entries.get(key)

    def pop(self, key: str) -> T | None:
        """Remove and return the entry of ``key`` (None if unknown)."""
        with self._lock:
            self._client_ids.pop(key, None)
            return self._entries.pop(key, None)

    def keys_of(self, request_id: str) -> list[str]:
        """Engine keys of the live requests whose client request id is ``request_id``."""
        with self._lock:
            return [
                k for k, rid in self._client_ids.items() if rid == request_id or k == request_id
            ]

    def items(self) -> list[tuple[str, T]]:
        """A snapshot of ``(key, entry)`` pairs."""
        with self._lock:
            return list(self._entries.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
