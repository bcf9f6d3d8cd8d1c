"""The paged KV cache: one K and one V tensor for all layers, and the pool's size.

Layout `[num_layers, num_pages, page_size, num_kv_heads, head_dim]` (FlashInfer's NHD paged
layout per layer). Token slot `s = page * page_size + offset`. Page 0 is never handed out: it is
the padding target of page tables (and of CUDA-graph padding). Which page belongs to whom is
`engine.cache_manager`'s business.
"""

from __future__ import annotations

import torch

from tritonllm.config import EngineConfig, ModelConfig


class KVCache:
    """K and V page pools.

    Attributes:
        k, v: `[num_layers, num_pages, page_size, num_kv_heads, head_dim]` in the model dtype.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.num_pages, self.page_size = num_pages, page_size
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def k_cache(self, layer: int) -> torch.Tensor:
        """`[num_pages, page_size, num_kv_heads, head_dim]` view of layer `layer`'s K."""
        return self.k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """`[num_pages, page_size, num_kv_heads, head_dim]` view of layer `layer`'s V."""
        return self.v[layer]


def derive_num_pages(config: EngineConfig, page_bytes: int | None = None) -> int:
    """Pool size in pages (including page 0) for `config`.

    `config.num_pages` if set. On CPU: `config.cpu_default_num_pages`. On CUDA: call after the
    weights are loaded; `gpu_memory_utilization` of the memory free now, minus a margin for
    activations, divided by the page size in bytes (`page_bytes`, default `config.page_bytes`;
    a tensor-parallel rank passes the size of its own heads' pages).
    """
    if config.num_pages is not None:
        return config.num_pages
    device = config.torch_device
    if device.type != "cuda":
        return config.cpu_default_num_pages
    free, _total = torch.cuda.mem_get_info(device)
    # Leave room for activations and logits of a max_prefill_tokens batch.
    activation_margin = 1 << 30
    budget = int(free * config.gpu_memory_utilization) - activation_margin
    return max(2, budget // (page_bytes or config.page_bytes))
