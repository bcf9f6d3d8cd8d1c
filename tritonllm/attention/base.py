"""The attention backend interface: `AttentionMetadata` (per forward), `AttentionOptions` (engine
settings a backend honours) and `AttentionBackend`, whose CUDA-graph hooks a backend overrides
when it can run decode in CUDA graphs (`supports_cuda_graph`). The hooks' place on the ABC is
mini-sglang's design."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tritonllm.config import TENSOR_CORE_DECODE_MIN_BATCH

if TYPE_CHECKING:
    from tritonllm.config import ModelConfig
    from tritonllm.engine.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """Describes one forward batch to the attention backend; built once by the model runner.

    Device tensors live on the model's device. B = num_seqs, T = total new tokens.

    Attributes:
        num_seqs: B.
        is_decode: every sequence adds exactly one token (T == B).
        seq_lens: `[B]` int32, tokens in the cache after this step (prefix + new).
        extend_lens: `[B]` int32, new tokens this step (1 in decode).
        prefix_lens: `[B]` int32, `seq_lens - extend_lens` (tokens already cached).
        cu_extend_lens: `[B + 1]` int32, offsets of each sequence's new tokens in the T axis.
        page_table: `[B, max_pages_per_seq]` int32, page ids, padded with 0 (reserved page).
        out_cache_loc: `[T]` int64, cache slot (`page * page_size + offset`) of each new token.
        seq_lens_cpu, extend_lens_cpu: host copies as Python ints, for CPU-side planning.
    """

    num_seqs: int
    is_decode: bool
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    prefix_lens: torch.Tensor
    cu_extend_lens: torch.Tensor
    page_table: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @property
    def num_tokens(self) -> int:
        """T, the new tokens in this forward."""
        return int(sum(self.extend_lens_cpu))


@dataclass(frozen=True)
class AttentionOptions:
    """Engine settings that backends may honour (the `EngineConfig` fields of the same names).

    Attributes:
        tensor_core_decode_min_batch: `flashinfer`: decode batches of at least this many
            sequences run FlashInfer's tensor-core kernels (0: all of them).
    """

    tensor_core_decode_min_batch: int = TENSOR_CORE_DECODE_MIN_BATCH


class AttentionBackend(ABC):
    """Paged causal attention over the KV cache.

    Subclasses register themselves in `tritonllm.attention.ATTENTION_BACKENDS` (see
    `register_backend`). The model runner calls `prepare(meta)` once per forward, then each
    attention layer calls `forward(q, k, v, layer_id)`. A backend that supports CUDA-graph
    decode says so (`supports_cuda_graph`) and overrides the three graph hooks; the engine
    captures graphs only then (`engine.cuda_graph.CudaGraphRunner`).

    Args:
        model_config: the model's shape (heads, head_dim).
        kv_cache: the paged KV cache the backend reads and writes.
        device: where the cache and the batch tensors live.
        options: engine settings (default `AttentionOptions()`).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device,
        options: AttentionOptions | None = None,
    ) -> None:
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.device = device
        self.options = options or AttentionOptions()
        self.scale = model_config.head_dim**-0.5

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Plan the forward described by `meta` (once per forward, before layer 0)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Write k/v into the cache at `out_cache_loc` (unless `kv_stored`), then attend.

        Args:
            q: `[T, Hq, D]` (after RoPE/norm), model dtype.
            k, v: `[T, Hkv, D]`, model dtype, last dim contiguous (v may be a strided view).
            layer_id: index into the KV cache's layers.
            kv_stored: the caller already wrote k and v into the cache slots that
                `fused_kv_store_target(layer_id)` gave for this forward.

        Returns:
            `[T, Hq, D]`: causal attention of each new token over its sequence's cached prefix
            and the new tokens up to itself, scale `1/sqrt(D)`; query head h reads KV head
            `h // (Hq // Hkv)` (GQA).
        """

    def fused_kv_store_target(
        self, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`(k_cache, v_cache, out_cache_loc)` of layer `layer_id` in the planned forward, when
        this backend lets the caller's RoPE kernel write the new K/V (`kernels.rotary.KVStore`:
        one launch instead of two); None (the default) when `forward` must store them."""
        return None

    # ---- CUDA-graph decode -----------------------------------------------------------------

    @property
    def supports_cuda_graph(self) -> bool:
        """Whether the graph hooks below are implemented (False here: eager decode only)."""
        return False

    def init_cuda_graph(self, max_bs: int, max_pages_per_seq: int | None = None) -> None:
        """Allocate fixed-address buffers for decode graphs of up to `max_bs` sequences (once).

        Args:
            max_bs: largest captured batch size.
            max_pages_per_seq: page-table width of the graphs (default: enough pages for the
                model's max_position_embeddings, at most the pool size).

        Raises:
            NotImplementedError: the backend has no CUDA-graph support.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph decode")

    def prepare_capture(self, bs: int) -> None:
        """Before warming up and capturing the batch-size-`bs` graph: point `forward` at the
        graph buffers.

        Raises:
            NotImplementedError: the backend has no CUDA-graph support.
            RuntimeError: (implementations) `init_cuda_graph` was not called, or `bs` exceeds
                its max_bs.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph decode")

    def prepare_replay(self, meta: AttentionMetadata, bs: int) -> None:
        """Before each replay of graph `bs`: copy decode batch `meta` (`num_seqs <= bs`) into
        the graph buffers; rows `num_seqs..bs-1` become padding (one token on page 0, K/V
        written to slot 0). Device copies only, no host sync.

        Raises:
            NotImplementedError: the backend has no CUDA-graph support.
            ValueError: (implementations) `meta` is not a decode batch or does not fit `bs`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA-graph decode")
