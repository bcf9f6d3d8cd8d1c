"""Benchmarks at tensor-parallel size > 1 (`--tensor-parallel-size`, offline and online).

A tensor-parallel engine runs in processes, one per rank (`tritonllm.engine.EngineProcess`,
whose child is rank 0). `ProcessEngine` puts `LLMEngine`'s `add_request` / `step` in front of
one, so the benchmarks' loops (`benchmarks.offline.run_engine`) drive both alike; its outputs
come through the engine process' pipe, one message per engine step.

The bandwidth bound of N ranks: every decode step reads the weights and the live KV once in
all, split across N GPUs that read their parts at the same time, so the bound is the same bytes
over N times one GPU's copy bandwidth (the slowest of the N, measured in the same run). KV
heads replicated on several ranks (fewer KV heads than ranks) would add reads; the default
qwen3 shapes have 8 KV heads, so at 2, 4 or 8 ranks there are none.
"""

from __future__ import annotations

import argparse
import queue
from typing import Any

from benchmarks import bandwidth
from tritonllm.cli_types import positive_int


def add_argument(p: argparse.ArgumentParser) -> None:
    """`--tensor-parallel-size N[,M...]`: the sizes to run (default 1)."""
    p.add_argument(
        "--tensor-parallel-size",
        default=[1],
        type=lambda text: [positive_int(s) for s in text.split(",")],
        help="tensor-parallel sizes to run, e.g. 1,2 (one engine each; the bound of N ranks "
        "is computed for N GPUs' bandwidth)",
    )


class ProcessEngine:
    """`add_request` / `step` / `stats` of `LLMEngine` over an `EngineProcess` (see the module
    docstring); `step()` blocks until at least one output arrived. `shutdown()` stops it."""

    def __init__(self, config: Any) -> None:
        from tritonllm.engine import EngineProcess

        self.client = EngineProcess(config)
        self._outputs: queue.Queue = queue.Queue()

    def add_request(self, request_id: str, prompt_ids: list[int], params: Any) -> None:
        self.client.submit(request_id, prompt_ids, params, self._outputs.put)

    def step(self) -> list[Any]:
        outs = [self._outputs.get()]
        while not self._outputs.empty():
            outs.append(self._outputs.get_nowait())
        return outs

    def stats(self) -> Any:
        return self.client.stats()

    def shutdown(self) -> None:
        self.client.shutdown()


def make_engine(config: Any) -> Any:
    """`LLMEngine(config)`, or a `ProcessEngine` for `config.tensor_parallel_size` > 1."""
    if config.tensor_parallel_size > 1:
        return ProcessEngine(config)
    from tritonllm.engine.engine import LLMEngine

    return LLMEngine(config)


def close_engine(engine: Any) -> None:
    """Stop `engine`'s rank processes (a `ProcessEngine`); an `LLMEngine` needs nothing."""
    if isinstance(engine, ProcessEngine):
        engine.shutdown()


def copy_bandwidth(device: str, size: int) -> float:
    """The slowest copy bandwidth (bytes/s) of the `size` devices the ranks use."""
    from tritonllm.distributed import rank_device

    return min(bandwidth.measure_copy_bandwidth(rank_device(device, r)) for r in range(size))
