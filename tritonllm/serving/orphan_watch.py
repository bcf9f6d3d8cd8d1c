"""`exit_when_orphaned`: a Python-backend stub that ends itself once tritonserver is gone.

A Triton 2.51 stub exits by itself when its parent, tritonserver, dies, unless one of its
threads is inside a pb_utils call at that moment: such a call never returns (its answer would
come from the dead parent), and the stub's own exit then waits for it forever, keeping the
generator's engine process and its tensor-parallel ranks alive with their memory (found as
ranks that outlived a SIGKILLed tritonserver by more than 15 s on a loaded 2-core machine;
ARCHITECTURE.md, "Platform facts"). The generator's sender thread avoids pb_utils calls once the
parent changed, but it cannot take back a call already started. This watchdog closes that
window: a daemon thread polls the parent pid and, once it changed, gives the stub's own exit
``grace_s`` seconds, then ends the process with ``os._exit`` (nothing is left to flush: the
server that would read the responses is gone; the engine process and its ranks follow through
``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import threading
import time


def exit_when_orphaned(
    parent_pid: int, interval_s: float = 0.5, grace_s: float = 2.0, exit_code: int = 1
) -> threading.Thread:
    """Start (and return) a daemon thread that calls ``os._exit(exit_code)`` ``grace_s``
    seconds after ``os.getppid()`` stopped being ``parent_pid`` (polled every ``interval_s``
    seconds). A process that exits by itself within the grace time is not disturbed."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        time.sleep(grace_s)
        os._exit(exit_code)

    thread = threading.Thread(target=watch, name="tritonllm-orphan-watch", daemon=True)
    thread.start()
    return thread


__all__ = ["exit_when_orphaned"]
