"""Rotary position embedding (RoFormer, Su et al. 2021), NeoX "rotate half" layout.

Llama 3 frequency scaling follows the Llama 3 paper / Meta's reference code, with the same
semantics as transformers' `_compute_llama3_parameters`: wavelengths shorter than
`original_max / high_freq_factor` are kept, longer than `original_max / low_freq_factor` are
divided by `factor`, and the band in between is interpolated smoothly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tritonllm.config import RopeScaling
from tritonllm.layers.fused import use_fused
from tritonllm.layers.norm import RMSNorm


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32, with Llama 3 scaling when given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k from a cos/sin cache indexed by position.

    The cache holds `[max_positions, head_dim // 2]` float32 cos and sin; rows are gathered per
    token, so positions need not be contiguous (prefix caching, batched sequences). The rotation
    rounds like transformers: cos/sin in the activations' dtype, products and sums rounded to it.
    With `fused` (the default) CUDA tensors go through one Triton kernel (`kernels.rotary`), q/k
    norms and the K/V store included where they fit.
    """

    cos_cache: torch.Tensor  # [max_positions, head_dim // 2] float32 (buffers, not saved)
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.fused = fused
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        if not self.cos_cache.is_meta:
            self.init_cache()

    def init_cache(self, device: torch.device | None = None) -> None:
        """(Re)compute the cos/sin cache, e.g. after the module was built on the meta device."""
        device = device or self.cos_cache.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        # An outer product: one rounding per entry, bit-equal to transformers' matmul form.
        freqs = torch.outer(t, inv_freq)
        self.cos_cache = freqs.cos().to(device)
        self.sin_cache = freqs.sin().to(device)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` int64; q `[T, Hq, D]`, k `[T, Hkv, D]` → rotated q, k (same dtype).

        With `q_norm`/`k_norm` (Qwen3's per-head norms, both or neither) q and k are normalised
        first: `q_norm(q)`, `k_norm(k)`, then rotated. On CUDA one Triton kernel
        (`kernels.rotary`) normalises and rotates q and k together, with the same rounding.
        """
        norm_args = _norm_kernel_args(q, q_norm, k_norm)
        if _fits_kernel(self.fused, q, k) and norm_args is not None:
            from kernels.rotary import rotary

            return rotary(positions, q, k, self.cos_cache, self.sin_cache, *norm_args)
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        if _fits_kernel(self.fused, q, k):
            from kernels.rotary import rotary

            return rotary(positions, q, k, self.cos_cache, self.sin_cache)
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D/2] float32
        sin = self.sin_cache[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        kv_target: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`forward`, and where the RoPE kernel runs, the same launch also writes the rotated k
        and v into the paged KV cache (`kernels.rotary.KVStore`).

        Args:
            positions, q, k, q_norm, k_norm: as for `forward`.
            v: `[T, Hk, D]`, q's dtype (may be a strided view of the fused qkv output).
            kv_target: `(k_cache, v_cache, out_cache_loc)` from the attention backend's
                `fused_kv_store_target`.

        Returns:
            `(q, k, stored)`: rotated q and k as `forward` returns them, and whether k and v
            were written to the cache (False where the kernel does not apply: the backend
            must then store them).
        """
        no_norm = q_norm is None and k_norm is None
        norm_args = None if no_norm else _norm_kernel_args(q, q_norm, k_norm)
        if not (
            _fits_kernel(self.fused, q, k)
            and (no_norm or norm_args is not None)
            and v.dtype == q.dtype
            and v.stride(-1) == 1
        ):
            q, k = self.forward(positions, q, k, q_norm, k_norm)
            return q, k, False
        from kernels.rotary import KVStore, rotary

        k_cache, v_cache, loc = kv_target
        q_weight, k_weight, eps = norm_args or (None, None, 1e-6)
        q, k = rotary(
            positions,
            q,
            k,
            self.cos_cache,
            self.sin_cache,
            q_weight,
            k_weight,
            eps,
            kv_store=KVStore(v, k_cache, v_cache, loc),
        )
        return q, k, True


def _fits_kernel(fused: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
    return use_fused(fused, q) and q.stride(-1) == 1 and k.stride(-1) == 1


def _norm_kernel_args(
    q: torch.Tensor, q_norm: RMSNorm | None, k_norm: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """`(q_norm weight, k_norm weight, eps)` for the fused kernel, or None where it cannot
    apply the norms: it takes both, one eps and weights in q's dtype; anything else runs
    unfused."""
    if q_norm is None or k_norm is None or q_norm.eps != k_norm.eps:
        return None
    if not q_norm.weight.dtype == k_norm.weight.dtype == q.dtype:
        return None
    return q_norm.weight, k_norm.weight, q_norm.eps


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Hugging Face's rounding: cos/sin cast to x's dtype, each product and the sum rounded to
    # it (exact float32 math for float32 models; bit-equal to transformers in bf16 too).
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
