"""Reference attention backend in plain PyTorch (runs on CPU and GPU; correctness first).

Decode batches attend in one padded SDPA call; extend (prefill) batches loop over sequences,
each with an explicit causal mask offset by its cached prefix, except that the one-token rows
of an extend batch (the decode rows of a mixed batch) attend together in one padded call, as a
decode batch does.
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
        exts = meta.extend_lens_cpu
        self._starts = [0] * meta.num_seqs  # first token of each sequence in the T axis
        for b in range(1, meta.num_seqs):
            self._starts[b] = self._starts[b - 1] + exts[b - 1]
        # One-token rows (when there are several) attend in one padded call, the others one by
        # one with their causal masks.
        singles = [b for b, ext in enumerate(exts) if ext == 1]
        if len(singles) < 2:
            singles = []
        self._single_slots: torch.Tensor | None = None
        if singles:
            rows = torch.tensor(singles, device=self.device)
            width = max(meta.seq_lens_cpu[b] for b in singles)
            self._single_slots = self._slots[rows, :width]  # [S1, width]
            self._single_tokens = torch.tensor(
                [self._starts[b] for b in singles], device=rows.device
            )
            valid = pos[None, :width] < meta.seq_lens[rows, None].long()
            self._single_mask = valid[:, None, None, :]  # [S1, 1, 1, width]
        self._extend_masks = {}
        for b in range(meta.num_seqs):
            seq_len, ext = meta.seq_lens_cpu[b], exts[b]
            if ext == 1 and singles:
                continue
            prefix = seq_len - ext
            q_pos = prefix + torch.arange(ext, device=self.device)
            k_pos = torch.arange(seq_len, device=self.device)
            self._extend_masks[b] = k_pos[None, :] <= q_pos[:, None]  # [ext, seq_len]

    def _padded(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per sequence: q `[N, Hq, D]` over the K/V at `slots` `[N, S]` (padding
        masked out by `mask` `[N, 1, 1, S]`); returns `[N, Hq, D]`."""
        keys = k_flat[slots].transpose(1, 2)  # [N, Hkv, S, D]
        values = v_flat[slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # [N, Hq, 1, D]
        return out.squeeze(2)

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
            return self._padded(q, k_flat, v_flat, self._slots, self._decode_mask)
        out = torch.empty_like(q)
        if self._single_slots is not None:
            tokens, slots = self._single_tokens, self._single_slots
            out[tokens] = self._padded(q[tokens], k_flat, v_flat, slots, self._single_mask)
        for b, mask in self._extend_masks.items():
            seq_len, ext = meta.seq_lens_cpu[b], meta.extend_lens_cpu[b]
            start = self._starts[b]
            slots = self._slots[b, :seq_len]
            keys = k_flat[slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
            values = v_flat[slots].transpose(0, 1).unsqueeze(0)
            q_b = q[start : start + ext].transpose(0, 1).unsqueeze(0)  # [1, Hq, ext, D]
            o = F.scaled_dot_product_attention(
                q_b, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            out[start : start + ext] = o[0].transpose(0, 1)
        return out
