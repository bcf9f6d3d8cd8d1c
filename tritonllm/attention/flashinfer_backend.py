"""Attention backend on FlashInfer 0.5.x paged kernels (NHD layout), K/V stored by `store_kv`.

`prepare()` converts the page table into FlashInfer's CSR page list (`kv_indptr`, `kv_indices`,
`kv_last_page_len`) and calls `plan()` once per forward on the decode wrapper
(`BatchDecodeWithPagedKVCacheWrapper`) or the prefill wrapper
(`BatchPrefillWithPagedKVCacheWrapper`, causal: FlashInfer aligns the causal mask to the
bottom-right, so new token i of a sequence with prefix p sees keys 0..p+i). `forward()` runs the
planned wrapper on the layer's `(k_cache, v_cache)`.

CUDA-graph decode: `init_cuda_graph(max_bs)` allocates fixed indptr/indices/last_page_len
buffers; `prepare_capture(bs)` creates a `use_cuda_graph=True` decode wrapper for batch size
`bs` over slices of them and plans it with a dummy batch; `prepare_replay(meta, bs)` re-plans
that wrapper with the real batch padded to `bs` (padding: one token on reserved page 0).
FlashInfer's plan() copies into the fixed buffers, so the captured kernels see the new batch.
Decode batches of `TENSOR_CORE_DECODE_MIN_BATCH` or more sequences use the tensor-core decode
kernels (load balance over uneven context lengths; see the constant).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from kernels.store_kv import store_kv
from tritonllm.attention import register_backend
from tritonllm.attention.base import AttentionBackend, AttentionMetadata

try:
    import flashinfer
except ImportError:  # the registry still lists the backend; constructing it raises
    flashinfer = None

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-K)

# Decode batches of at least this many sequences run FlashInfer's tensor-core (prefill-kernel)
# decode even for small GQA groups: its planner splits long sequences into chunks, so a batch
# whose contexts differ (100..2047 tokens) no longer waits for its longest sequences. Measured
# on an H200 (`python -m kernels.bench_attention`, 2026-11-30, CUDA-graph wrappers, Qwen3-0.6B
# heads): contexts 100..2047 at batch 150 75% -> 90% of copy bandwidth, at batch 256 85% -> 95%;
# equal contexts at batch 128 88% -> 81%, at batch 64 80% -> 74%. Served and offline batches
# have uneven contexts, and the offline benchmark (same run, 2026-11-30 11:04 UTC) reached
# 60.6% of its bound with 128, 63.3% with 64 and 63.2% with 1: hence 64.
TENSOR_CORE_DECODE_MIN_BATCH = 64
# Overrides TENSOR_CORE_DECODE_MIN_BATCH when set (an int; read when a backend is built).
TENSOR_CORE_DECODE_ENV = "TRITONLLM_TENSOR_CORE_DECODE_MIN_BATCH"


@dataclass
class PagedKVArgs:
    """FlashInfer's CSR description of a batch's pages.

    kv_indptr: `[B + 1]` int32 on the host, page-list offsets.
    kv_indices: `[kv_indptr[-1]]` int32 on the device, page ids of all sequences, in order.
    kv_last_page_len: `[B]` int32 on the host, tokens in each sequence's last page (1..page_size).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def paged_kv_args(
    page_table: torch.Tensor, seq_lens_cpu: list[int], page_size: int, num_padding: int = 0
) -> PagedKVArgs:
    """Build FlashInfer's page list from our page table without a device-to-host sync.

    The host computes, with numpy, where each listed page sits in the row-major table (row b,
    columns 0..ceil(seq_lens[b] / page_size) - 1); one pinned, non-blocking copy takes those
    positions to the device and one `torch.take` gathers the page ids there.

    Args:
        page_table: `[B, max_pages]` int32 (device), row b holds sequence b's pages in order.
        seq_lens_cpu: B host ints >= 1, tokens per sequence.
        page_size: tokens per page.
        num_padding: sequences of one token on page 0 appended after the B real ones (the
            padding rows of a CUDA-graph batch).
    """
    seq_lens = np.asarray(seq_lens_cpu, dtype=np.int64)
    batch, width = page_table.shape
    num_pages = -(-seq_lens // page_size)
    # Row-major positions of the listed pages, in sequence order (flatnonzero walks row by row).
    positions = np.flatnonzero(np.arange(width) < num_pages[:, None])
    num_listed = positions.shape[0]
    indptr = np.empty(batch + num_padding + 1, dtype=np.int32)
    indptr[0] = 0
    np.cumsum(num_pages, out=indptr[1 : batch + 1])
    indptr[batch + 1 :] = num_listed + np.arange(1, num_padding + 1)
    last_page_len = np.ones(batch + num_padding, dtype=np.int32)
    last_page_len[:batch] = (seq_lens - 1) % page_size + 1
    dev = page_table.device
    host = torch.from_numpy(positions)
    if dev.type == "cuda":  # a pageable copy could block on the stream
        host = host.pin_memory()
    index = host.to(dev, non_blocking=True)
    kv_indices = torch.empty(num_listed + num_padding, dtype=torch.int32, device=dev)
    torch.take(page_table, index, out=kv_indices[:num_listed])
    if num_padding:
        kv_indices[num_listed:] = 0  # padding rows: page 0
    return PagedKVArgs(
        kv_indptr=torch.from_numpy(indptr),
        kv_indices=kv_indices,
        kv_last_page_len=torch.from_numpy(last_page_len),
    )


def replay_kv_args(meta: AttentionMetadata, bs: int, page_size: int) -> PagedKVArgs:
    """`paged_kv_args` of decode batch `meta` padded to `bs` sequences (CUDA-graph replay):
    rows `meta.num_seqs..bs-1` are one token on page 0."""
    return paged_kv_args(meta.page_table, meta.seq_lens_cpu, page_size, bs - meta.num_seqs)


@dataclass
class _GraphBuffers:
    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * max_pages_per_seq] int32
    kv_last_page_len: torch.Tensor  # [max_bs] int32
    out_cache_loc: torch.Tensor  # [max_bs] int64


@register_backend("flashinfer")
class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through FlashInfer (see module docstring).

    Raises:
        ImportError: flashinfer is not installed (`pip install 'tritonllm[gpu]'`).
        ValueError: a float32 KV cache (FlashInfer has no float32 kernels).
    """

    def __init__(self, model_config, kv_cache, device: torch.device) -> None:
        if flashinfer is None:
            raise ImportError("the flashinfer backend needs flashinfer-python (tritonllm[gpu])")
        super().__init__(model_config, kv_cache, device)
        if kv_cache.k_cache(0).dtype == torch.float32:
            # FlashInfer's JIT dtype table has half, bfloat16 and fp8 only.
            raise ValueError(
                "FlashInfer has no float32 attention; use bfloat16/float16 or "
                "attention_backend 'triton'/'torch'"
            )
        self.num_q_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.page_size = kv_cache.page_size
        self.dtype = kv_cache.k_cache(0).dtype
        # FlashInfer's decode kernels on CUDA cores suit small GQA groups; larger groups go
        # faster through its tensor-core (prefill) kernels (the same rule SGLang applies).
        self.use_tensor_cores = self.num_q_heads // self.num_kv_heads >= 4
        env = os.environ.get(TENSOR_CORE_DECODE_ENV, "").strip()
        self.tensor_core_min_batch = int(env) if env else TENSOR_CORE_DECODE_MIN_BATCH
        # "Must be initialized to 0 for its first use" (FlashInfer docs).
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._decode_large = self._decode  # decode batches >= tensor_core_min_batch
        if not self.use_tensor_cores:
            self._decode_large = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=True
            )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._wrapper = self._decode
        self._out_cache_loc: torch.Tensor | None = None
        self._graph: _GraphBuffers | None = None
        self._graph_wrappers: dict[int, object] = {}

    def prepare(self, meta: AttentionMetadata) -> None:
        """Plan the decode or prefill wrapper for `meta` (host-side; no device sync)."""
        args = paged_kv_args(meta.page_table, meta.seq_lens_cpu, self.page_size)
        self._out_cache_loc = meta.out_cache_loc
        if meta.is_decode:
            large = meta.num_seqs >= self.tensor_core_min_batch
            self._wrapper = self._decode_large if large else self._decode
            self._plan_decode(self._wrapper, args)
            return
        qo_indptr = np.zeros(meta.num_seqs + 1, dtype=np.int32)
        np.cumsum(meta.extend_lens_cpu, out=qo_indptr[1:])
        self._prefill.plan(
            torch.from_numpy(qo_indptr),
            args.kv_indptr,
            args.kv_indices,
            args.kv_last_page_len,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        self._wrapper = self._prefill

    def _plan_decode(self, wrapper, args: PagedKVArgs) -> None:
        wrapper.plan(
            args.kv_indptr,
            args.kv_indices,
            args.kv_last_page_len,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store k/v `[T, Hkv, D]` at out_cache_loc (unless `kv_stored`), then attend; returns
        `[T, Hq, D]`."""
        k_cache = self.kv_cache.k_cache(layer_id)
        v_cache = self.kv_cache.v_cache(layer_id)
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, self._out_cache_loc)
        return self._wrapper.run(q.contiguous(), (k_cache, v_cache))

    def fused_kv_store_target(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The layer's caches and this forward's slots: the RoPE kernel stores K/V there."""
        return self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id), self._out_cache_loc

    # ---- CUDA-graph decode ------------------------------------------------------------------

    def init_cuda_graph(self, max_bs: int, max_pages_per_seq: int | None = None) -> None:
        """Allocate FlashInfer's fixed buffers for decode graphs of up to `max_bs` sequences.

        Args:
            max_bs: largest captured batch size.
            max_pages_per_seq: pages one sequence may hold (default: the model's
                max_position_embeddings in pages, at most the pool size).
        """
        if max_pages_per_seq is None:
            max_pages_per_seq = min(
                math.ceil(self.model_config.max_position_embeddings / self.page_size),
                self.kv_cache.num_pages,
            )
        dev = self.device
        self._graph = _GraphBuffers(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            kv_indices=torch.zeros(max_bs * max_pages_per_seq, dtype=torch.int32, device=dev),
            kv_last_page_len=torch.ones(max_bs, dtype=torch.int32, device=dev),
            out_cache_loc=torch.zeros(max_bs, dtype=torch.int64, device=dev),
        )
        self._graph_wrappers.clear()

    def prepare_capture(self, bs: int) -> None:
        """Create and plan (with a dummy batch) the graph wrapper for batch size `bs`.

        Raises:
            RuntimeError: `init_cuda_graph` was not called, or `bs` exceeds its max_bs.
        """
        g = self._graph
        if g is None or bs > g.kv_last_page_len.shape[0]:
            raise RuntimeError(f"init_cuda_graph(max_bs >= {bs}) must be called first")
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores or bs >= self.tensor_core_min_batch,
                paged_kv_indptr_buffer=g.kv_indptr[: bs + 1],
                paged_kv_indices_buffer=g.kv_indices,
                paged_kv_last_page_len_buffer=g.kv_last_page_len[:bs],
            )
            self._graph_wrappers[bs] = wrapper
        dummy_table = torch.zeros(bs, 1, dtype=torch.int32, device=self.device)
        self._plan_decode(wrapper, paged_kv_args(dummy_table, [1] * bs, self.page_size))
        g.out_cache_loc[:bs] = 0
        self._out_cache_loc = g.out_cache_loc[:bs]
        self._wrapper = wrapper

    def prepare_replay(self, meta: AttentionMetadata, bs: int) -> None:
        """Re-plan the batch-size-`bs` graph wrapper with `meta` padded to `bs` sequences.

        Raises:
            ValueError: `meta` is not a decode batch or has more than `bs` sequences.
            RuntimeError: no graph was prepared for `bs`.
        """
        n = meta.num_seqs
        if not meta.is_decode or n > bs:
            raise ValueError(f"cannot replay: decode={meta.is_decode}, num_seqs={n}, bs={bs}")
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            raise RuntimeError(f"prepare_capture({bs}) was never called")
        g = self._graph
        self._plan_decode(wrapper, replay_kv_args(meta, bs, self.page_size))
        g.out_cache_loc[:n].copy_(meta.out_cache_loc, non_blocking=True)
        if n < bs:
            g.out_cache_loc[n:bs] = 0
        self._out_cache_loc = g.out_cache_loc[:bs]
        self._wrapper = wrapper
