"""Attention backend on this project's Triton-language kernels (`kernels/`).

`forward` stores the new K/V with `kernels.store_kv`, then runs `kernels.decode_attention`
(split-K flash-decoding) for decode batches or `kernels.extend_attention` for prefill/extend
batches. Without CUDA the kernels run in Triton's interpreter (slow; for tests).

CUDA-graph decode: `init_cuda_graph(max_bs)` allocates fixed buffers (page table, seq_lens,
out_cache_loc, split-K workspace); `prepare_capture(bs)` points the backend at them before
capturing a batch-size-`bs` graph; `prepare_replay(meta, bs)` copies a real decode batch of
`meta.num_seqs <= bs` sequences into them before replay, padding the rest to one token on the
reserved page 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.decode_attention import decode_attention, default_num_kv_splits
from kernels.extend_attention import extend_attention
from kernels.store_kv import store_kv
from tritonllm.attention import register_backend
from tritonllm.attention.base import AttentionBackend, AttentionMetadata, AttentionOptions

if TYPE_CHECKING:
    from tritonllm.config import ModelConfig
    from tritonllm.engine.kv_cache import KVCache


@dataclass
class _GraphBuffers:
    """Fixed-address decode inputs for CUDA graphs, `max_bs` rows each."""

    page_table: torch.Tensor  # [max_bs, max_pages_per_seq] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    out_cache_loc: torch.Tensor  # [max_bs] int64
    workspace: torch.Tensor  # flat float32, split-K partials of the largest graph


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels in `kernels/` (see module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device,
        options: AttentionOptions | None = None,
    ) -> None:
        super().__init__(model_config, kv_cache, device, options)
        self.num_q_heads = model_config.num_heads
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        self.page_size = kv_cache.page_size
        self._workspace = torch.empty(0, dtype=torch.float32, device=device)
        self._graph: _GraphBuffers | None = None
        self._is_decode = True
        # The planned forward's inputs (views of the batch's metadata or of the graph
        # buffers); empty until the first `prepare`.
        self._page_table = torch.empty(0, 0, dtype=torch.int32, device=device)
        self._seq_lens = torch.empty(0, dtype=torch.int32, device=device)
        self._out_cache_loc = torch.empty(0, dtype=torch.int64, device=device)
        self._cu_extend_lens = torch.empty(0, dtype=torch.int32, device=device)
        self._max_extend_len = 0
        self._num_kv_splits = 1
        self._decode_ws: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- eager path -------------------------------------------------------------------------

    def prepare(self, meta: AttentionMetadata) -> None:
        """Pick the decode split count or the extend grid; no device work, no host sync."""
        self._is_decode = meta.is_decode
        self._page_table, self._seq_lens = meta.page_table, meta.seq_lens
        self._out_cache_loc = meta.out_cache_loc
        if meta.is_decode:
            batch = meta.num_seqs
            self._num_kv_splits = default_num_kv_splits(
                batch, self.num_kv_heads, max(meta.seq_lens_cpu), self.device
            )
            self._decode_ws = self._split_workspace(batch, self._num_kv_splits, grow=True)
        else:
            self._cu_extend_lens = meta.cu_extend_lens
            self._max_extend_len = max(meta.extend_lens_cpu)

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
        if self._is_decode:
            return decode_attention(
                q,
                k_cache,
                v_cache,
                self._page_table,
                self._seq_lens,
                sm_scale=self.scale,
                num_kv_splits=self._num_kv_splits,
                workspace=self._decode_ws,
            )
        return extend_attention(
            q,
            k_cache,
            v_cache,
            self._page_table,
            self._seq_lens,
            self._cu_extend_lens,
            self._max_extend_len,
            sm_scale=self.scale,
        )

    def _split_workspace(
        self, batch: int, splits: int, grow: bool, flat: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `(part_o [B, Hq, S, D], part_lse [B, Hq, S])` on a flat float32 buffer."""
        o_elems = batch * self.num_q_heads * splits * self.head_dim
        lse_elems = batch * self.num_q_heads * splits
        if flat is None:
            if grow and self._workspace.numel() < o_elems + lse_elems:
                self._workspace = torch.empty(
                    o_elems + lse_elems, dtype=torch.float32, device=self.device
                )
            flat = self._workspace
        part_o = flat[:o_elems].view(batch, self.num_q_heads, splits, self.head_dim)
        part_lse = flat[o_elems : o_elems + lse_elems].view(batch, self.num_q_heads, splits)
        return part_o, part_lse

    def fused_kv_store_target(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The layer's caches and this forward's slots: the RoPE kernel stores K/V there."""
        return self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id), self._out_cache_loc

    # ---- CUDA-graph decode ------------------------------------------------------------------

    @property
    def supports_cuda_graph(self) -> bool:
        return True

    def _graph_splits(self, bs: int) -> int:
        max_len = self._require_graph(bs).page_table.shape[1] * self.page_size
        return default_num_kv_splits(bs, self.num_kv_heads, max_len, self.device)

    def init_cuda_graph(self, max_bs: int, max_pages_per_seq: int | None = None) -> None:
        """Allocate the fixed buffers for decode graphs of up to `max_bs` sequences.

        Args:
            max_bs: largest captured batch size.
            max_pages_per_seq: page-table width of the graphs (default: enough pages for the
                model's max_position_embeddings, at most the pool size).
        """
        if max_pages_per_seq is None:
            max_pages_per_seq = min(
                math.ceil(self.model_config.max_position_embeddings / self.page_size),
                self.kv_cache.num_pages,
            )
        dev = self.device
        self._graph = _GraphBuffers(
            page_table=torch.zeros(max_bs, max_pages_per_seq, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            out_cache_loc=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            workspace=torch.empty(0, dtype=torch.float32, device=dev),
        )
        need = max(b * self._graph_splits(b) for b in range(1, max_bs + 1))
        self._graph.workspace = torch.empty(
            need * self.num_q_heads * (self.head_dim + 1), dtype=torch.float32, device=dev
        )

    def prepare_capture(self, bs: int) -> None:
        """Point `forward` at the graph buffers for a decode batch of exactly `bs` tokens.

        Raises:
            RuntimeError: `init_cuda_graph` was not called, or `bs` exceeds its max_bs.
        """
        g = self._require_graph(bs)
        self._is_decode = True
        self._page_table, self._seq_lens = g.page_table[:bs], g.seq_lens[:bs]
        self._out_cache_loc = g.out_cache_loc[:bs]
        self._num_kv_splits = self._graph_splits(bs)
        self._decode_ws = self._split_workspace(
            bs, self._num_kv_splits, grow=False, flat=g.workspace
        )

    def prepare_replay(self, meta: AttentionMetadata, bs: int) -> None:
        """Copy decode batch `meta` into the graph buffers; rows `num_seqs..bs` become padding.

        Padding rows have seq_len 1 on page 0 and write their K/V to slot 0 (page 0 is never
        handed out). Device copies only; no host sync.

        Raises:
            ValueError: `meta` is not a decode batch, has more than `bs` sequences, or a wider
                page table than the graph buffers.
        """
        g = self._require_graph(bs)
        n, width = meta.num_seqs, meta.page_table.shape[1]
        if not meta.is_decode or n > bs or width > g.page_table.shape[1]:
            raise ValueError(
                f"cannot replay: decode={meta.is_decode}, num_seqs={n}, bs={bs}, "
                f"page_table width {width} > {g.page_table.shape[1]}"
            )
        g.page_table[:n, :width].copy_(meta.page_table, non_blocking=True)
        g.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        g.out_cache_loc[:n].copy_(meta.out_cache_loc, non_blocking=True)
        if n < bs:
            g.page_table[n:bs, 0] = 0
            g.seq_lens[n:bs] = 1
            g.out_cache_loc[n:bs] = 0

    def _require_graph(self, bs: int) -> _GraphBuffers:
        if self._graph is None or bs > self._graph.seq_lens.shape[0]:
            raise RuntimeError(f"init_cuda_graph(max_bs >= {bs}) must be called first")
        return self._graph
