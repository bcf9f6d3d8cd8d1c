"""Turns a `ScheduledBatch` into model inputs, runs the forward pass and samples."""

from __future__ import annotations

import torch

from tritonllm.attention import get_attention_backend
from tritonllm.attention.base import AttentionMetadata
from tritonllm.config import EngineConfig
from tritonllm.engine.kv_cache import KVCache, derive_num_pages
from tritonllm.engine.request import Request
from tritonllm.engine.sampler import Sampler, SamplerOutput
from tritonllm.engine.scheduler import ScheduledBatch
from tritonllm.models import load_model


class ModelRunner:
    """Owns the model, the KV cache, the attention backend and the sampler.

    Construction loads the weights, then sizes the KV pool (`derive_num_pages`: on CUDA it
    uses the memory left after the weights).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = config.torch_device
        self.page_size = config.page_size
        self.model = load_model(
            config.model,
            self.model_config,
            self.device,
            config.torch_dtype,
            max_positions=config.effective_max_model_len,
        )
        self.num_pages = derive_num_pages(config)
        self.kv_cache = KVCache(
            self.model_config, self.num_pages, config.page_size, config.torch_dtype, self.device
        )
        backend_cls = get_attention_backend(config.attention_backend)
        self.backend = backend_cls(self.model_config, self.kv_cache, self.device)
        self.model.set_attention_backend(self.backend)
        self.sampler = Sampler(self.device, config.seed)

    def build_metadata(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Request]]:
        """Flatten the batch.

        Returns:
            input_ids `[T]` int64, positions `[T]` int64, the attention metadata,
            logits_indices `[S]` int64 (last new token of each sampling request) and those
            S requests, in order.
        """
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_reqs: list[Request] = []
        for i, (req, ext) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            start = req.num_computed
            end = start + ext
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            pages = req.pages
            out_loc.extend(pages[p // ps] * ps + p % ps for p in range(start, end))
            seq_lens.append(end)
            if batch.samples(i):
                logits_indices.append(len(input_ids) - 1)
                sample_reqs.append(req)
        max_pages = max(-(-s // ps) for s in seq_lens)
        table = [
            r.pages[:max_pages] + [0] * (max_pages - len(r.pages[:max_pages])) for r in batch.reqs
        ]
        cu = [0]
        for ext in batch.extend_lens:
            cu.append(cu[-1] + ext)

        def dev(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        seq_t = dev(seq_lens, torch.int32)
        ext_t = dev(batch.extend_lens, torch.int32)
        meta = AttentionMetadata(
            num_seqs=len(batch.reqs),
            is_decode=batch.is_decode,
            seq_lens=seq_t,
            extend_lens=ext_t,
            prefix_lens=seq_t - ext_t,
            cu_extend_lens=dev(cu, torch.int32),
            page_table=dev(table, torch.int32),
            out_cache_loc=dev(out_loc, torch.int64),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(batch.extend_lens),
        )
        return (
            dev(input_ids, torch.int64),
            dev(positions, torch.int64),
            meta,
            dev(logits_indices, torch.int64),
            sample_reqs,
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Request], SamplerOutput | None]:
        """One forward over `batch`; returns the requests that sampled and their samples."""
        input_ids, positions, meta, logits_indices, sample_reqs = self.build_metadata(batch)
        self.backend.prepare(meta)
        if not sample_reqs:
            # Only prompt chunks: run the forward for its KV; one dummy row of logits.
            logits_indices = logits_indices.new_zeros(1)
            self.model(input_ids, positions, meta, logits_indices)
            return [], None
        logits = self.model(input_ids, positions, meta, logits_indices)
        return sample_reqs, self.sampler.sample(logits, sample_reqs)
