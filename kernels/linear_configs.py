"""Launch configurations of the skinny-GEMM kernel (`kernels.linear`): the candidates tried
per shape, the M buckets shapes are tuned by, and the GPU timer that picks among them."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

MAX_M = 256  # larger M is compute-bound: cuBLAS's territory
_SPLIT_K_MAX = 16


class LinearConfig(NamedTuple):
    """One launch configuration of `_skinny_linear_kernel`.

    `split_k`: K-ranges (1 = no workspace, no reduce kernel); `block_m`: token rows per program
    (a power of 2; >= 16 with `use_dot`); `block_n`, `block_k`: weight tile (elements);
    `fixup` (with `split_k` > 1): the tile's last program reduces the partials, instead of a
    second kernel (`kernels.linear_kernels`; never concurrently on two streams of a device).
    """

    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    fixup: bool = False


def m_bucket(m: int) -> int:
    """The decode CUDA-graph batch size that serves `m` token rows: 1, 2, 4, 8, then multiples
    of 8 (`EngineConfig.cuda_graph_batch_sizes`); shapes are tuned and chosen per bucket."""
    return triton.next_power_of_2(m) if m <= 8 else -(-m // 8) * 8


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132 off CUDA, see below), cached per device."""
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H100/H200 so split-K gets exercised
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _auto_split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, sms: int):
    """Smallest power-of-2 split that launches >= 2 programs per SM (two resident programs per
    SM hide each other's load latency), keeping >= one BLOCK_K step per split."""
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 2 * sms and split < _SPLIT_K_MAX and k >= 2 * split * block_k:
        split *= 2
    return split


def candidate_configs(m: int, n: int, k: int, sms: int = 132) -> list[LinearConfig]:
    """The configurations tried for an `[m, k] x [n, k]` product, most likely best first.

    Per M range: M <= 8 tries the dot-free GEMV (two tile shapes) and the padded MMA; larger M
    tries MMA tiles. Each tile shape comes with its automatic split-K (`_auto_split_k`); when
    that is > 1 the no-split variant is tried too (it saves the reduce kernel and the
    workspace traffic, and wins when the tiles alone fill the GPU).
    """
    bm = triton.next_power_of_2(m)
    if m <= 8:
        tiles = [
            (False, bm, 16, 256, 4, 3),
            (False, bm, 32, 128, 4, 3),
            (True, 16, 64, 128, 4, 4),
        ]
    elif m <= 64:
        tiles = [(True, max(16, bm), 64, 128, 4, 4), (True, max(16, bm), 128, 64, 4, 4)]
    else:
        tiles = [(True, 64, 128, 64, 4, 4), (True, 128, 128, 64, 8, 3), (True, 64, 64, 128, 4, 4)]
    configs = []
    for use_dot, block_m, block_n, block_k, warps, stages in tiles:
        split = _auto_split_k(m, n, k, block_m, block_n, block_k, sms)
        for s in (split, 1) if split > 1 else (1,):
            configs.append(LinearConfig(use_dot, block_m, block_n, block_k, s, warps, stages))
    return configs


def gpu_time_ms(fn: Callable[[], object], runs: int = 15, warmup: int = 2) -> float:
    """Median GPU time of `fn()` in ms: CUDA events around each call on the current stream,
    after a write that evicts L2 (the weights of a decode step are never L2-resident: the next
    layer's are elsewhere). The eviction also keeps the GPU busy, so the host's launch latency
    is not timed. Synchronizes the device.
    """
    device = torch.cuda.current_device()
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    flush = torch.empty(2 * max(l2, 32 << 20), dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(runs)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
