"""Threads with room for llguidance's recursion.

llguidance 1.9.1 recurses once per link of a chain of references when it validates or compiles
a grammar (a ``$ref`` to a ``$ref``, a Lark rule that names the next one). A constraint within
``limits.MAX_GRAMMAR_CHARS`` can hold a chain long enough to overflow an 8 MiB stack (a
process's main thread, and so the Triton stub's execute thread), and the overflow kills the
process with SIGSEGV: the generator's stub, from one request (a fuzzing session found it;
BENCHMARKS.md, "multipleOf and llguidance's matcher builds; reference chains and stack", has the
lengths and the stack each needed). So every call into llguidance or xgrammar that compiles or
walks a request's grammar runs on a thread of `GRAMMAR_STACK_BYTES` (virtual memory: only the
pages a recursion touches are committed): `GrammarExecutor`'s threads (the compiler's, the
matcher builds', the mask fill's) and `on_grammar_stack` (the validation of a constraint where
the request arrives).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

GRAMMAR_STACK_BYTES = 256 << 20  # 8x what the longest chain measured needed

_T = TypeVar("_T")
_stack_size_lock = threading.Lock()
_checker_lock = threading.Lock()
_checker: GrammarExecutor | None = None


class GrammarExecutor(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose threads have `GRAMMAR_STACK_BYTES` of stack.

    ``threading.stack_size`` is process-wide: it is set only while this executor starts a
    thread (``ThreadPoolExecutor._adjust_thread_count``, where CPython 3.10-3.13 start them),
    under a lock, and put back after; a thread another module starts meanwhile gets the large
    stack too, which costs it nothing but address space."""

    def _adjust_thread_count(self) -> None:
        with _stack_size_lock:
            previous = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:
                super()._adjust_thread_count()  # type: ignore[misc, unused-ignore]
            finally:
                threading.stack_size(previous)


def on_grammar_stack(fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)`` on a thread with `GRAMMAR_STACK_BYTES` of stack (one shared thread, made on
    first use); returns its result or raises its exception. For calls such as
    ``LLMatcher.validate_grammar`` on a thread whose stack is not ours (Triton's)."""
    global _checker
    with _checker_lock:
        if _checker is None:
            _checker = GrammarExecutor(1, thread_name_prefix="tritonllm-grammar-check")
        checker = _checker
    return checker.submit(fn, *args).result()
