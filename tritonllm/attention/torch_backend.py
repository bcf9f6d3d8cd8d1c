"""Reference attention backend in plain PyTorch (runs on CPU and GPU; correctness first).

Decode batches attend in one padded SDPA call; extend (prefill) batches loop over sequences,
each with an explicit causal mask offset by its cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.attention import register_backend
from tritonllm.attention.base import AttentionBackend, AttentionMetadata


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's K/V from the pages, then `scaled_dot_product_attention`."""

    def prepare(self, meta: AttentionMetadata) -> None:
        page_size = self.kv_cache.page_size
        max_len = max(meta.seq_lens_cpu)
        pos = torch.arange(max_len, device=self.device)
        # slots[b, j]: cache slot of token j of sequence b (padding points into page 0).
        pages = meta.page_table[:, pos // page_size].long()
        self._slots = pages * page_size + pos % page_size  # [B, max_len]
        self._meta = meta
        if meta.is_decode:
            valid = pos[None, :] < meta.seq_lens[:, None].long()
            self._decode_mask = valid[:, None, None, :]  # [B, 1, 1, max_len]
            return
        self._extend_masks = []
        for b in range(meta.num_seqs):
            seq_len, ext = meta.seq_lens_cpu[b], meta.extend_lens_cpu[b]
            prefix = seq_len - ext
            q_pos = prefix + torch.arange(ext, device=self.device)
            k_pos = torch.arange(seq_len, device=self.device)
            self._extend_masks.append(k_pos[None, :] <= q_pos[:, None])  # [ext, seq_len]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        meta = self._meta
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = self.kv_cache.k_cache(layer_id).view(-1, num_kv_heads, head_dim)
        v_flat = self.kv_cache.v_cache(layer_id).view(-1, num_kv_heads, head_dim)
        if not kv_stored:
            k_flat[meta.out_cache_loc] = k
            v_flat[meta.out_cache_loc] = v
        if meta.is_decode:
            keys = k_flat[self._slots].transpose(1, 2)  # [B, Hkv, S, D]
            values = v_flat[self._slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys,
                values,
                attn_mask=self._decode_mask,
                scale=self.scale,
                enable_gqa=True,
            )  # [B, Hq, 1, D]
            return out.squeeze(2)
        out = torch.empty_like(q)
        start = 0
        for b in range(meta.num_seqs):
            seq_len, ext = meta.seq_lens_cpu[b], meta.extend_lens_cpu[b]
            slots = self._slots[b, :seq_len]
            keys = k_flat[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
            values = v_flat[slots].transpose(0, 1).unsqueeze(0)
            q_b = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, Hq, ext, D]
            o = F.scaled_dot_product_attention(
                q_b,
                keys,
                values,
                attn_mask=self._extend_masks[b],
                scale=self.scale,
                enable_gqa=True,
            )
            out[start : start + ext] = o[0].transpose(0, 1)
            start += ext
        return out
