"""The physical bound of decoding: bytes that must be read over measured copy bandwidth.

Decode is memory-bound for a 0.6B model: every decode step reads all weights once plus the K
and V of every live sequence. `decode_bytes` sums those reads over the step schedule of a
workload; `measure_copy_bandwidth` gives the bandwidth to divide by, measured in the same run
(BENCHMARKS.md, methodology). Prefill is not counted: it is compute-bound, and its
weight reads are amortised over thousands of tokens.

`roofline` is the tighter bound for a model large enough that FLOPs matter (Qwen3-8B at batch
256): each decode step at the slower of its reads and its FLOPs over the GEMM rate measured in
the same run (`measure_matmul_rate`), and the prefill's FLOPs where they do not fit in the
steps' slack.
"""

from __future__ import annotations

import json
import struct
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def decode_schedule(
    prompt_lens: Sequence[int], output_lens: Sequence[int], max_running: int | None = None
) -> Iterator[tuple[int, int]]:
    """The decode steps of a workload, as `(rows, cached tokens read)` per step.

    Requests are admitted in order while fewer than `max_running` (default: all) are live; an
    admitted request's prefill emits its first output token, then each decode step emits one
    more for every live request. The step that emits token `j + 1` of a request with prompt
    length `p` reads the K and V of `p + j` cached tokens (the prompt plus the `j` tokens
    generated so far, the last of them written in that same step). A request leaves after its
    last token, freeing its slot for the next one.

    Args:
        prompt_lens, output_lens: tokens per request (outputs >= 1).
        max_running: most requests decoding at once.
    """
    queue = deque(zip(prompt_lens, output_lens, strict=True))
    limit = max_running or len(queue)
    live: list[list[int]] = []  # [prompt_len, tokens generated so far, output_len]
    while queue or live:
        while queue and len(live) < limit:
            p, o = queue.popleft()
            if o > 1:  # a one-token request is finished by its prefill
                live.append([p, 1, o])
        if not live:
            continue
        kv_tokens = 0
        for seq in live:
            kv_tokens += seq[0] + seq[1]
            seq[1] += 1
        yield len(live), kv_tokens
        live = [s for s in live if s[1] < s[2]]


def decode_bytes(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    weight_bytes: int,
    kv_bytes_per_token: int,
    max_running: int | None = None,
) -> DecodeTraffic:
    """Sum the bytes each step of the workload's decode schedule (`decode_schedule`) must
    read: the weights once, and the K and V of every cached token each row attends to.

    Args:
        prompt_lens, output_lens: tokens per request (outputs >= 1).
        weight_bytes: bytes of weights read per decode step (`checkpoint_weight_bytes`).
        kv_bytes_per_token: K+V bytes of one cached token over all layers
            (`2 * num_layers * num_kv_heads * head_dim * itemsize`; 114,688 for Qwen3-0.6B bf16).
        max_running: most requests decoding at once.
    """
    steps = kv_tokens = 0
    for _, tokens in decode_schedule(prompt_lens, output_lens, max_running):
        steps += 1
        kv_tokens += tokens
    return DecodeTraffic(steps, steps * weight_bytes, kv_tokens * kv_bytes_per_token)


def measure_matmul_rate(
    device: str, dtype: torch.dtype, n: int | None = None, repeats: int = 10
) -> float:
    """Dense matrix-multiply throughput in FLOP/s: the fastest of `repeats` square `n x n`
    products in `dtype` (default n 8192 on CUDA, 512 on CPU) after two warm-ups, counting
    `2 n^3` FLOPs each (CUDA events on GPU, `time.perf_counter` on CPU). This is the rate the
    roofline bound (`roofline`) divides FLOPs by: what the GPU's GEMM library reaches on a
    large product, not the datasheet's peak.
    """
    is_cuda = device.startswith("cuda")
    if n is None:
        n = 8192 if is_cuda else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        if is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    del a, b
    return 2 * n**3 / best


@dataclass(frozen=True)
class ModelFlops:
    """The FLOPs a decoder-only transformer spends per token (2 per multiply-add).

    Attributes:
        body_params: weights of each token's matrix multiplies over all layers (q, k, v, o,
            gate, up, down projections).
        head_params: LM-head weights (hidden x vocab), applied once per emitted token.
        attention_per_pair: FLOPs of one query token against one cached token over all layers:
            `4 * heads * head_dim * layers` (Q K^T and the product with V).
    """

    body_params: int
    head_params: int
    attention_per_pair: int

    @classmethod
    def from_config(cls, config: Any) -> ModelFlops:
        """From a `tritonllm.model_config.ModelConfig` (Llama/Qwen-style layers: q, k, v, o
        projections and a gated MLP)."""
        h, heads_dim = config.hidden_size, config.num_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        per_layer = 2 * h * heads_dim + 2 * h * kv_dim + 3 * h * config.intermediate_size
        return cls(
            config.num_layers * per_layer,
            h * config.vocab_size,
            4 * heads_dim * config.num_layers,
        )

    def prefill(self, prompt_len: int) -> int:
        """FLOPs of one prompt's prefill: every token through the layers, causal attention
        (`p (p + 1) / 2` pairs), the LM head on the last token."""
        p = prompt_len
        return (
            2 * p * self.body_params
            + 2 * self.head_params
            + self.attention_per_pair * (p * (p + 1) // 2)
        )

    def decode_step(self, rows: int, kv_tokens: int) -> int:
        """FLOPs of one decode step of `rows` tokens attending to `kv_tokens` cached tokens."""
        return (
            2 * rows * (self.body_params + self.head_params) + self.attention_per_pair * kv_tokens
        )


@dataclass(frozen=True)
class Roofline:
    """A workload's least time when every step is bound by reading its bytes or by its FLOPs.

    Attributes:
        decode_seconds: sum over decode steps of max(bytes / bandwidth, FLOPs / rate).
        prefill_seconds: the prompts' FLOPs / rate.
        hidden_seconds: prefill time that fits in the decode steps' slack (the steps whose
            reads outlast their FLOPs), as if prefill chunks rode in those steps perfectly.
        steps: decode steps; compute_bound_steps: those whose FLOPs outlast their reads.
    """

    decode_seconds: float
    prefill_seconds: float
    hidden_seconds: float
    steps: int
    compute_bound_steps: int

    @property
    def seconds(self) -> float:
        """Decode steps plus the prefill that cannot hide in them (seconds)."""
        return self.decode_seconds + self.prefill_seconds - self.hidden_seconds


def roofline(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    weight_bytes: int,
    kv_bytes_per_token: int,
    flops: ModelFlops,
    bandwidth: float,
    flop_rate: float,
    max_running: int | None = None,
) -> Roofline:
    """The roofline bound of a workload: `decode_schedule`'s steps, each at
    max(bytes / `bandwidth`, FLOPs / `flop_rate`), plus the prefill FLOPs / `flop_rate` less what
    fits in the steps' slack (the roofline model of Williams, Waterman and Patterson,
    CACM 2009, applied step by step). Units: bytes, bytes/s, FLOP/s; seconds out.
    """
    decode = slack = 0.0
    steps = compute_bound = 0
    for rows, kv_tokens in decode_schedule(prompt_lens, output_lens, max_running):
        read = (weight_bytes + kv_tokens * kv_bytes_per_token) / bandwidth
        compute = flops.decode_step(rows, kv_tokens) / flop_rate
        decode += max(read, compute)
        slack += max(0.0, read - compute)
        steps += 1
        compute_bound += compute > read
    prefill = sum(flops.prefill(p) for p in prompt_lens) / flop_rate
    return Roofline(decode, prefill, min(prefill, slack), steps, compute_bound)
