"""The physical bound of decoding: bytes that must be read over measured copy bandwidth.

Decode is memory-bound for a 0.6B model: every decode step reads all weights once plus the K
and V of every live sequence. `decode_bytes` sums those reads over the step schedule of a
workload; `measure_copy_bandwidth` gives the bandwidth to divide by, measured in the same run
(BENCHMARKS.md, methodology). Prefill is not counted: it is compute-bound, and its
weight reads are amortised over thousands of tokens.
"""

from __future__ import annotations

import json
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


def measure_copy_bandwidth(device: str, nbytes: int | None = None, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written.

    Copies a `nbytes` uint8 tensor (default 4 GiB on CUDA, 64 MiB on CPU) into another
    `repeats` times after two warm-ups and keeps the fastest copy (CUDA events on GPU,
    `time.perf_counter` on CPU).
    """
    is_cuda = device.startswith("cuda")
    if nbytes is None:
        nbytes = (4 << 30) if is_cuda else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    del src, dst
    return 2 * nbytes / best


def checkpoint_weight_bytes(model_dir: Path | str, itemsize: int) -> int:
    """Bytes of weights one decode step reads, for weights held at `itemsize` bytes per element.

    Counts every tensor of the checkpoint's `*.safetensors` files (read from their headers) at
    `itemsize` bytes, except `embed_tokens` when a separate `lm_head` exists: the embedding is
    only gathered row by row, whereas a tied embedding is read whole as the LM head.
    """
    numel: dict[str, int] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            numel[name] = count
    if not numel:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    if any(n.endswith("lm_head.weight") for n in numel):
        numel = {n: c for n, c in numel.items() if "embed_tokens" not in n}
    return sum(numel.values()) * itemsize


@dataclass(frozen=True)
class DecodeTraffic:
    """Bytes read over a workload's decode schedule.

    Attributes:
        decode_steps: decode steps run (steps with at least one sequence decoding).
        weight_bytes: weight bytes over all steps (`decode_steps` x weights).
        kv_bytes: K and V bytes over all steps.
    """

    decode_steps: int
    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        """Weight plus KV bytes (bytes)."""
        return self.weight_bytes + self.kv_bytes

    def bound_seconds(self, bandwidth: float) -> float:
        """Least time to read `total_bytes` at `bandwidth` bytes/s."""
        return self.total_bytes / bandwidth


def decode_bytes(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    weight_bytes: int,
    kv_bytes_per_token: int,
    max_running: int | None = None,
) -> DecodeTraffic:
    """Simulate the decode schedule of a workload and sum the bytes each step must read.

    Requests are admitted in order while fewer than `max_running` (default: all) are live; an
    admitted request's prefill emits its first output token, then each decode step emits one
    more for every live request. The step that emits token `j + 1` of a request with prompt
    length `p` reads the K and V of `p + j` cached tokens (the prompt plus the `j` tokens
    generated so far, the last of them written in that same step). Each step also reads the
    weights once. A request leaves after its last token, freeing its slot for the next one.

    Args:
        prompt_lens, output_lens: tokens per request (outputs >= 1).
        weight_bytes: bytes of weights read per decode step (`checkpoint_weight_bytes`).
        kv_bytes_per_token: K+V bytes of one cached token over all layers
            (`2 * num_layers * num_kv_heads * head_dim * itemsize`; 114,688 for Qwen3-0.6B bf16).
        max_running: most requests decoding at once.
    """
    queue = deque(zip(prompt_lens, output_lens, strict=True))
    limit = max_running or len(queue)
    live: list[list[int]] = []  # [prompt_len, tokens generated so far, output_len]
    steps = kv_tokens = 0
    while queue or live:
        while queue and len(live) < limit:
            p, o = queue.popleft()
            if o > 1:  # a one-token request is finished by its prefill
                live.append([p, 1, o])
        if not live:
            continue
        steps += 1
        for seq in live:
            kv_tokens += seq[0] + seq[1]
            seq[1] += 1
        live = [s for s in live if s[1] < s[2]]
    return DecodeTraffic(steps, steps * weight_bytes, kv_tokens * kv_bytes_per_token)
