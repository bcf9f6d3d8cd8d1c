"""Configuration: `EngineConfig`, and `ModelConfig` (`tritonllm.model_config`, re-exported here).

Both are frozen dataclasses. Derived values are properties, so one object is the single source
of truth for a knob and everything computed from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from tritonllm.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

# dtype names and their element sizes in bytes. torch is imported only where a torch object is
# asked for (`torch_device`, `torch_dtype`): the tokenizer and detokenizer stubs read this config
# (the context length) without torch.
_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEVICE_TYPES = ("cpu", "cuda")


def device_type(device: str) -> str:
    """The device type of a device string: "cpu", "cuda" for "cuda" and "cuda:N".

    Raises:
        ValueError: not a CPU or CUDA device string.
    """
    kind, sep, index = device.partition(":")
    if kind not in DEVICE_TYPES or (sep and not index.isdigit()) or (kind == "cpu" and sep):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return kind


# CPU has no memory probe worth trusting; the KV pool defaults to this many bytes at most.
CPU_KV_CACHE_BYTES = 1 << 30
CPU_DEFAULT_CONTEXT = 2048
# Default per-step prefill token budgets (EngineConfig.max_prefill_tokens).
# CPU: a step's time grows with its tokens (no fixed launch cost to amortise), so short chunks
# keep every step short, and the requests behind a long prompt (the sidecar's health probe too)
# no longer wait for all of it; chunks of 512 were not slower in total (BENCHMARKS.md, "CPU
# prefill chunks").
CPU_MAX_PREFILL_TOKENS = 512
CUDA_MAX_PREFILL_TOKENS = 16384
# Default admission delay on CUDA (EngineConfig.prefill_delay_steps), in decode steps. Chosen
# when each prefill step cost the decoding requests a whole step (BENCHMARKS.md, "Online: one
# eager prefill step per arrival starved the decode steps"). With mixed steps they advance in
# that step, but it is still an eager forward ("Host time of an eager prefill step") in place
# of a CUDA-graph decode step several times shorter, so each admission still costs every
# decoding request most of a step: arrivals are still worth batching, and the delay stays.
CUDA_PREFILL_DELAY_STEPS = 8
# Its upper limit: beyond ~1k decode steps a "delay" only means new requests wait for the
# running ones to finish (seconds of TTFT), which is never what a setting means.
MAX_PREFILL_DELAY_STEPS = 1024
# GEMM kernels of `Linear` on CUDA (EngineConfig.linear_kernel). cuBLAS by default: on the H200
# `kernels.bench_linear` found it faster than the skinny-GEMM kernel at most decode shapes of
# Qwen3-0.6B, so "auto" would mostly pick cuBLAS after timing every shape at start-up
# (BENCHMARKS.md, "Kernel micro-benchmarks").
LINEAR_KERNELS = ("auto", "cublas", "triton")
# Default of EngineConfig.tensor_core_decode_min_batch: from this batch size on, FlashInfer's
# tensor-core decode balances uneven contexts better than its CUDA-core kernels; 64 had the
# best offline result of 1, 64 and 128 on the H200 (BENCHMARKS.md, "Offline: tensor-core
# decode threshold").
TENSOR_CORE_DECODE_MIN_BATCH = 64
GRAMMAR_BACKENDS = ("auto", "llguidance")  # EngineConfig.grammar_backend
# Most threads of the derived EngineConfig.grammar_threads (llguidance's own default: 80% of
# the cores, at most 32).
MAX_GRAMMAR_THREADS = 32


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. `None` means "derive"; the derived values are the properties below.

    Attributes:
        model: path of a Hugging Face model directory (config.json + safetensors).
        device: "cpu" or "cuda" (or "cuda:N").
        dtype: "float32" | "bfloat16" | "float16"; None → float32 on CPU, bfloat16 on CUDA.
        page_size: tokens per KV page; None → 16 on CPU, 64 on CUDA (fewer, larger pages: less
            page-table work per step on the host and fewer page lookups in the attention
            kernels: the offline benchmark ran closer to its bound at 64 than at 16,
            BENCHMARKS.md "Offline: page size"). The prefix cache reuses whole pages only.
        num_pages: KV pages in the pool (page 0 is reserved, so num_pages - 1 are usable);
            None → on CPU enough for `max_running_requests` sequences of min(max_model_len,
            2048) tokens capped at 1 GiB, on CUDA `gpu_memory_utilization` of free memory
            after the weights (see `engine.kv_cache.derive_num_pages`).
        max_running_requests: most requests in one batch (admitted at the same time).
        max_prefill_tokens: the per-step token budget of a prefill/extend batch (chunked
            prefill splits longer prompts across steps; with `mixed_steps` the decode rows
            riding along count in, though prompts keep at least half of it:
            `Scheduler.prefill_budget`); None → `CPU_MAX_PREFILL_TOKENS` on CPU,
            `CUDA_MAX_PREFILL_TOKENS` on CUDA, where an eager prefill step's host time does
            not grow with its size, so fewer, larger steps finish a burst of prompts sooner
            (BENCHMARKS.md, "Host time of an eager prefill step" and "Session 5 diagnostics",
            "Offline A/Bs").
        prefill_delay_steps: most decode steps a new request waits, while others decode, so
            that arrivals share prefill steps (admission delay; see `engine.scheduler`); 0 =
            admit at the next step; at most `MAX_PREFILL_DELAY_STEPS`. None → 0 on CPU,
            `CUDA_PREFILL_DELAY_STEPS` on CUDA, where each eager prefill (or mixed) step costs
            milliseconds of host time (see `CUDA_PREFILL_DELAY_STEPS`).
        mixed_steps: decoding requests ride along in prefill/extend steps as one-token rows
            of the same (eager) forward, so no decode step is lost to a prefill; decode-only
            steps still replay CUDA graphs (`engine.scheduler`). False: a step is a prefill or
            a decode batch, never both (for A/B). On by default on both devices: on CUDA a
            prefill no longer costs the decoding requests a step; on CPU, where every forward
            is eager, a mixed step does the work of a prefill and a decode step in one
            forward, and the CPU tests run the policy the GPU runs.
        enable_prefix_cache: reuse KV pages of earlier prompts through the radix cache.
        attention_backend: a key of `tritonllm.attention.ATTENTION_BACKENDS`, or "auto": on
            CUDA "flashinfer" (bf16/fp16, when installed), else "triton" (when installed), else
            "torch"; always "torch" on CPU. `resolved_attention_backend` gives the choice.
        max_model_len: prompt + output limit in tokens; None → the model's
            max_position_embeddings.
        seed: seed of the sampler's generator for requests without their own seed.
        gpu_memory_utilization: fraction of free GPU memory the KV pool may take (CUDA only).
        cuda_graph: capture decode steps as CUDA graphs at batch sizes 1, 2, 4, 8, 16, 24, ...
            up to `cuda_graph_max_bs` (padded); None → on for CUDA with a backend that supports
            it (triton, flashinfer). Always off on CPU. Larger decode batches and prefill run
            eagerly.
        cuda_graph_max_bs: the largest captured decode batch (sequences).
        overlap_schedule: schedule step N+1 on the CPU while the GPU runs step N (sampled ids
            stay on the GPU and are processed one step late); None → on for CUDA, off on CPU.
            True on CPU is honoured (no speed-up; it exercises the same code path in tests).
        fused_layers: on CUDA, run the layers' Triton kernels (RMSNorm, fused add + RMSNorm,
            q/k-norm + RoPE, SiLU-mul) and the sampler's fused Gumbel-max kernel; False runs
            their PyTorch code (for debugging). The CPU path always runs PyTorch.
        linear_kernel: GEMMs of at most 256 rows in `layers.Linear` on CUDA: "cublas"
            (`F.linear`), "triton" (the skinny-GEMM kernel wherever it applies) or "auto"
            (time both per shape once, keep the faster; cuBLAS when `fused_layers` is off).
        pdl: programmatic dependent launch for the Triton kernels on sm_90+ (`kernels.pdl`).
        tensor_core_decode_min_batch: FlashInfer decode batches of at least this many
            sequences run its tensor-core kernels (see `TENSOR_CORE_DECODE_MIN_BATCH`); 0: all.
        engine_profile: diagnostics: a file path; the engine process (`EngineProcess`) then
            runs its loop under cProfile and writes the stats (pstats format) there every 10 s
            and when it exits. None: no profile.
        tensor_parallel_size: ranks the model is split across (`tritonllm.distributed`): one
            process per rank, each on its own GPU (`device` and the next ones) or all on the
            CPU (gloo), started by `EngineProcess`, whose child is rank 0. 1: the whole model
            in one engine, no process group.
        grammar_threads: structured outputs: the threads that fill the constrained rows' token
            masks (llguidance's executor, and xgrammar's); None → `resolved_grammar_threads`.
        grammar_backend: structured outputs: ``"auto"``: JSON schemas of xgrammar's subset
            get xgrammar's matchers, every other constraint llguidance's
            (`tritonllm.structured.spec`); ``"llguidance"``: llguidance's for all (the A/B of
            `benchmarks.structured_decode`).
        defer_grammar_sampling: structured outputs: a step with rows under a grammar enqueues
            its sampling only before the next step's uploads, its masks filling on a thread of
            their own meanwhile (`engine.model_runner`); False: the masks fill and the step
            samples as soon as its forward is enqueued.
        grammar_compile_timeout_s: structured outputs: most seconds a request waits for its
            constraint to compile and its matchers to be built; past it the request fails
            with a server error and the compiler starts over on fresh threads, so that no
            request waits forever behind a compile that does not return (SGLang bounds its
            grammar wait the same way). A compile takes milliseconds; the first one in a
            process loads the tokenizer (seconds).
    """

    model: str
    device: str = "cpu"
    dtype: str | None = None
    # page_size, max_prefill_tokens and prefill_delay_steps: None ("derive") is replaced in
    # __post_init__, so they are typed as what they always are once constructed.
    page_size: int = None  # type: ignore[assignment]
    num_pages: int | None = None
    max_running_requests: int = 256
    max_prefill_tokens: int = None  # type: ignore[assignment]
    prefill_delay_steps: int = None  # type: ignore[assignment]
    mixed_steps: bool = True
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    gpu_memory_utilization: float = 0.85
    cuda_graph: bool | None = None
    cuda_graph_max_bs: int = 256
    overlap_schedule: bool | None = None
    fused_layers: bool = True
    linear_kernel: str = "cublas"
    pdl: bool = True
    tensor_core_decode_min_batch: int = TENSOR_CORE_DECODE_MIN_BATCH
    engine_profile: str | None = None
    tensor_parallel_size: int = 1
    grammar_threads: int | None = None
    grammar_backend: str = "auto"
    defer_grammar_sampling: bool = True
    grammar_compile_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        cpu = device_type(self.device) == "cpu"
        if self.page_size is None:  # frozen: derived once, here
            object.__setattr__(self, "page_size", 16 if cpu else 64)
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_prefill_tokens is None:
            tokens = CPU_MAX_PREFILL_TOKENS if cpu else CUDA_MAX_PREFILL_TOKENS
            object.__setattr__(self, "max_prefill_tokens", tokens)
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.prefill_delay_steps is None:
            object.__setattr__(self, "prefill_delay_steps", 0 if cpu else CUDA_PREFILL_DELAY_STEPS)
        if not 0 <= self.prefill_delay_steps <= MAX_PREFILL_DELAY_STEPS:
            raise ValueError(
                f"prefill_delay_steps must be in 0..{MAX_PREFILL_DELAY_STEPS} (decode steps a new "
                f"request may wait), got {self.prefill_delay_steps}"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(
                f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.grammar_threads is not None and self.grammar_threads < 1:
            raise ValueError(f"grammar_threads must be >= 1, got {self.grammar_threads}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}"
            )
        if self.tensor_core_decode_min_batch < 0:
            raise ValueError(
                "tensor_core_decode_min_batch must be >= 0, "
                f"got {self.tensor_core_decode_min_batch}"
            )

    @cached_property
    def model_config(self) -> ModelConfig:
        """The parsed `config.json` of `model` (read once)."""
        return ModelConfig.from_pretrained(self.model)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda" (without importing torch)."""
        return device_type(self.device)

    @property
    def dtype_name(self) -> str:
        """Weights/activations/KV dtype name: `dtype`, else float32 on CPU, bfloat16 on CUDA."""
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device_type == "cpu" else "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        """Weights/activations/KV dtype: `dtype`, else float32 on CPU and bfloat16 on CUDA."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def use_cuda_graph(self) -> bool:
        """Whether decode steps replay CUDA graphs (never on CPU; see `cuda_graph`)."""
        if self.device_type != "cuda":
            return False
        return self.cuda_graph is not False and self.resolved_attention_backend != "torch"

    @cached_property
    def resolved_attention_backend(self) -> str:
        """The attention backend name after resolving "auto" (see `attention_backend`)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.device_type != "cuda":
            return "torch"
        import importlib.util

        if self.dtype_name != "float32" and importlib.util.find_spec("flashinfer"):
            return "flashinfer"
        return "triton" if importlib.util.find_spec("triton") else "torch"

    @property
    def resolved_grammar_threads(self) -> int:
        """`grammar_threads`, else llguidance's own default: 80% of the cores this process may
        run on, from 1 to `MAX_GRAMMAR_THREADS`."""
        if self.grammar_threads is not None:
            return self.grammar_threads
        import os

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(MAX_GRAMMAR_THREADS, (cores or 1) * 4 // 5))

    @property
    def use_overlap_schedule(self) -> bool:
        """Whether the engine overlaps CPU scheduling with the GPU (see `overlap_schedule`)."""
        if self.overlap_schedule is None:
            return self.device_type == "cuda"
        return self.overlap_schedule

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """Captured decode batch sizes: 1, 2, 4, 8, then steps of 8, up to cuda_graph_max_bs
        (and max_running_requests); the largest is always included."""
        top = min(self.cuda_graph_max_bs, self.max_running_requests)
        sizes = [b for b in (1, 2, 4, 8) if b <= top]
        sizes += list(range(16, top + 1, 8))
        if sizes[-1] != top:
            sizes.append(top)
        return sizes

    @property
    def effective_max_model_len(self) -> int:
        """Prompt + output token limit per request."""
        mpe = self.model_config.max_position_embeddings
        return mpe if self.max_model_len is None else self.max_model_len

    @property
    def max_pages_per_seq(self) -> int:
        """Pages one sequence of `effective_max_model_len` tokens needs."""
        return math.ceil(self.effective_max_model_len / self.page_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page over all layers (K and V)."""
        elem = _DTYPES[self.dtype_name]
        return self.model_config.kv_bytes_per_token * elem * self.page_size

    @property
    def cpu_default_num_pages(self) -> int:
        """The CPU default pool size in pages (including reserved page 0)."""
        context = min(self.effective_max_model_len, CPU_DEFAULT_CONTEXT)
        wanted = self.max_running_requests * math.ceil(context / self.page_size)
        return max(2, min(wanted, CPU_KV_CACHE_BYTES // self.page_bytes) + 1)


__all__ = [
    "CPU_DEFAULT_CONTEXT",
    "CPU_KV_CACHE_BYTES",
    "CPU_MAX_PREFILL_TOKENS",
    "CUDA_MAX_PREFILL_TOKENS",
    "CUDA_PREFILL_DELAY_STEPS",
    "DEVICE_TYPES",
    "LINEAR_KERNELS",
    "MAX_PREFILL_DELAY_STEPS",
    "SUPPORTED_ARCHITECTURES",
    "TENSOR_CORE_DECODE_MIN_BATCH",
    "EngineConfig",
    "ModelConfig",
    "RopeScaling",
    "device_type",
]
