"""`EngineStats`: a snapshot of an engine's requests, pages and step counters (`LLMEngine.stats`).

Plain data: the serving side (metrics, the engine process's messages) imports it without the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (pages are KV pages; page 0 is not counted).

    Attributes:
        num_running: admitted requests (prefilling or decoding).
        num_waiting: queued requests (new or preempted).
        total_pages: usable pages in the pool.
        free_pages: pages on the free list.
        used_pages: total_pages - free_pages (running requests + radix cache).
        cached_pages: pages held by the radix prefix cache (locked or not).
        evictable_pages: radix cache pages no running request uses (reclaimable).
        max_batch_size_seen: the most decode rows (decoding requests) of one step so far.
        num_steps: steps that ran a forward pass.
        num_preemptions: requests preempted for lack of pages.
        gpu_wait_s: seconds `step()` spent so far waiting for the device to finish a launched
            step (in `LaunchedStep.result`); with overlap scheduling a step that waits is
            device-bound, one that does not is host-bound.
        num_prefill_steps: the steps of `num_steps` that ran a prefill/extend batch, mixed
            batches included (the rest ran decode batches).
        prefill_tokens: prompt tokens those steps computed (prompt chunks, recomputed
            preempted requests; a mixed batch's decode rows not counted).
        num_mixed_steps: the prefill steps that also carried decode rows (mixed steps).
    """

    num_running: int
    num_waiting: int
    total_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    evictable_pages: int
    max_batch_size_seen: int
    num_steps: int
    num_preemptions: int
    gpu_wait_s: float = 0.0
    num_prefill_steps: int = 0
    prefill_tokens: int = 0
    num_mixed_steps: int = 0


__all__ = ["EngineStats"]
