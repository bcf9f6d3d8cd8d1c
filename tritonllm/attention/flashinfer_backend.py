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
Decode batches of `AttentionOptions.tensor_core_decode_min_batch` or more sequences use the
tensor-core decode kernels (load balance over uneven context lengths;
`tritonllm.config.TENSOR_CORE_DECODE_MIN_BATCH` says why the default is 64).

Split-KV in graphs: in CUDA-graph mode FlashInfer's tensor-core (prefill) planner always plans
split-KV, so every layer also runs its merge kernel, but it splits no sequence once the batch
exceeds the CTAs it may add (`2 * SMs / kv_heads`, FlashInfer's `max_batch_size_if_split`): every
sequence already takes at least one CTA, so its KV-chunk search ends at the longest sequence
(`PrefillSplitQOKVIndptr` in FlashInfer's `attention/scheduler.cuh`, 0.5.x). Those graph wrappers
are therefore planned with `disable_split_kv=True`: the same one chunk per sequence, written
straight to the output, without the 28 merge kernels per step (BENCHMARKS.md, "Session 5
diagnostics"). Without split-KV FlashInfer launches its padded
grid (`bs + ceil(2 * bs / 16) - 1` tiles for GQA group 2) with no validity mask, and the padding
CTAs read the plan's request/tile indices past the real ones, entries no plan of the wrapper
writes (each writes `bs` of them). They are set in the wrapper's pinned plan-staging buffer,
which every plan copies to the device whole: zero at creation (so even the capture's first
plan points them at a real sequence), then the batch's shortest sequence (a one-token padding
row whenever the batch is smaller than the graph): a padding CTA recomputes that sequence's
tile and writes the same values again. Pointing them at sequence 0, often the longest, made
the attention slower than with split-KV on (BENCHMARKS.md, "Session 6 diagnostics").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.store_kv import store_kv
from tritonllm.attention import register_backend
from tritonllm.attention.base import AttentionBackend, AttentionMetadata, AttentionOptions

if TYPE_CHECKING:
    from tritonllm.config import ModelConfig
    from tritonllm.engine.kv_cache import KVCache

try:
    import flashinfer
except ImportError:  # the registry still lists the backend; constructing it raises
    flashinfer = None

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-K)


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

    def __init__(
        self,
        model_config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device,
        options: AttentionOptions | None = None,
    ) -> None:
        if flashinfer is None:
            raise ImportError("the flashinfer backend needs flashinfer-python (tritonllm[gpu])")
        super().__init__(model_config, kv_cache, device, options)
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
        self.tensor_core_min_batch = self.options.tensor_core_decode_min_batch
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
        # This forward's K/V slots (the batch's, or the graph buffer's); empty until `prepare`.
        self._out_cache_loc = torch.empty(0, dtype=torch.int64, device=device)
        self._graph: _GraphBuffers | None = None
        self._graph_wrappers: dict[int, object] = {}
        # graph batch size -> planned without split-KV (module docstring)
        self._graph_no_split: dict[int, bool] = {}
        # graph batch size -> (int32 view of its staging buffer's padding-tile request indices,
        # the sequence they name now); only for no-split graphs with padding tiles
        self._graph_pad_tiles: dict[int, list] = {}
        num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 0
        )
        # FlashInfer's max_batch_size_if_split for its tensor-core decode plan (2 CTAs per SM)
        self._max_batch_if_split = 2 * num_sms // self.num_kv_heads

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

    def _plan_decode(self, wrapper, args: PagedKVArgs, disable_split_kv: bool = False) -> None:
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
            disable_split_kv=disable_split_kv,
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

    @property
    def supports_cuda_graph(self) -> bool:
        return True

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
        self._graph_no_split.clear()
        self._graph_pad_tiles.clear()

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
            tensor_cores = self.use_tensor_cores or bs >= self.tensor_core_min_batch
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=g.kv_indptr[: bs + 1],
                paged_kv_indices_buffer=g.kv_indices,
                paged_kv_last_page_len_buffer=g.kv_last_page_len[:bs],
            )
            # FlashInfer 0.5's private pinned plan-staging buffer (module docstring): a version
            # without it keeps FlashInfer's split-KV plan rather than fail at capture.
            staging = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
            no_split = False
            if staging is not None and tensor_cores and bs > self._max_batch_if_split:
                staging.zero_()  # padding CTAs then read sequence 0 (module docstring)
                no_split = True
            self._graph_wrappers[bs] = wrapper
            self._graph_no_split[bs] = no_split
        dummy_table = torch.zeros(bs, 1, dtype=torch.int32, device=self.device)
        dummy = paged_kv_args(dummy_table, [1] * bs, self.page_size)
        self._plan_decode(wrapper, dummy, disable_split_kv=self._graph_no_split[bs])
        if self._graph_no_split[bs] and bs not in self._graph_pad_tiles:
            tail = self._padding_tile_requests(wrapper, bs)
            if tail is None:  # not the plan layout this code knows: keep FlashInfer's split-KV
                self._graph_no_split[bs] = False
                self._plan_decode(wrapper, dummy)
            elif tail.numel():
                self._graph_pad_tiles[bs] = [tail, 0]
        g.out_cache_loc[:bs] = 0
        self._out_cache_loc = g.out_cache_loc[:bs]
        self._wrapper = wrapper

    def _padding_tile_requests(self, wrapper, bs: int) -> torch.Tensor | None:
        """The int32 entries of `wrapper`'s pinned plan-staging buffer that hold the request
        index of each padding tile (tiles `bs..padded_batch_size-1`), from the plan it just made;
        None when the plan is not FlashInfer 0.5's unsplit CUDA-graph prefill plan (a 15-field
        `PrefillPlanInfo`: padded_batch_size first, cta_tile_q fourth, request_indices' byte
        offset fifth, enable_cuda_graph and split_kv last) with one tile per sequence (the
        real tiles are then exactly `0..bs-1`)."""
        try:
            info = [int(v) for v in wrapper._plan_info]
        except (AttributeError, TypeError, ValueError):
            return None
        group = self.num_q_heads // self.num_kv_heads
        if len(info) != 15 or info[13] != 1 or info[14] != 0 or info[0] < bs:
            return None
        if info[3] < group:  # a decode row's packed heads span several tiles
            return None
        padded, offset = info[0], info[4]
        staging = wrapper._pin_memory_int_workspace_buffer
        return staging[offset + 4 * bs : offset + 4 * padded].view(torch.int32)

    def prepare_replay(self, meta: AttentionMetadata, bs: int) -> None:
        """Re-plan the batch-size-`bs` graph wrapper with `meta` padded to `bs` sequences.

        Raises:
            ValueError: `meta` is not a decode batch or has more than `bs` sequences.
            RuntimeError: no graph was prepared for `bs`.
        """
        n = meta.num_seqs
        if not meta.is_decode or n > bs:
            raise ValueError(f"cannot replay: decode={meta.is_decode}, num_seqs={n}, bs={bs}")
        wrapper, g = self._graph_wrappers.get(bs), self._graph
        if wrapper is None or g is None:
            raise RuntimeError(f"prepare_capture({bs}) was never called")
        pad = self._graph_pad_tiles.get(bs)
        if pad is not None:
            # Padding tiles recompute the shortest sequence: a padding row if there is one.
            target = bs - 1 if n < bs else int(np.argmin(meta.seq_lens_cpu))
            if target != pad[1]:
                pad[0].fill_(target)  # staged; the plan below copies it to the device
                pad[1] = target
        self._plan_decode(
            wrapper,
            replay_kv_args(meta, bs, self.page_size),
            disable_split_kv=self._graph_no_split[bs],
        )
        g.out_cache_loc[:n].copy_(meta.out_cache_loc, non_blocking=True)
        if n < bs:
            g.out_cache_loc[n:bs] = 0
        self._out_cache_loc = g.out_cache_loc[:bs]
        self._wrapper = wrapper
