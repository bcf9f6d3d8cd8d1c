"""Load Hugging Face safetensors checkpoints into `CausalLM` (fusing q/k/v and gate/up)."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from tritonllm.config import ModelConfig
from tritonllm.layers.fused import LayerKernels
from tritonllm.models.decoder import CausalLM

# HF name suffix → (our fused parameter suffix, shard index within the fused tensor).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: from `model.safetensors.index.json` if present,
    else `model.safetensors`, else every `*.safetensors`. Raises FileNotFoundError if none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def _shard_bounds(cfg: ModelConfig, fused: str, shard: int) -> tuple[int, int]:
    if fused.endswith("qkv_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    inter = cfg.intermediate_size
    return (shard * inter, (shard + 1) * inter)


def load_model(
    path: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int | None = None,
    kernels: LayerKernels | None = None,
) -> CausalLM:
    """Build `CausalLM` on `device` in `dtype` and fill it from the checkpoint at `path`.

    `max_positions` and `kernels` (the layers' Triton kernel choices) go to `CausalLM`.

    Weights are created uninitialised (meta device, then `to_empty`) and every parameter must
    come from the checkpoint.

    Raises:
        ValueError: a parameter missing from the checkpoint or a shape mismatch.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg, max_positions, kernels)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks parameter sharing; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.init_cache(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in safetensors_files(path):
        # Tensors are read straight into device memory (no host copy of the model).
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                _load_one(cfg, params, loaded, name, f.get_tensor(name))
    expected = {n for n in params if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks parameters: {missing[:8]}")
    return model.eval()


def _load_one(
    cfg: ModelConfig, params: dict, loaded: set[str], name: str, tensor: torch.Tensor
) -> None:
    for hf_part, (ours, shard) in _FUSED.items():
        marker = f".{hf_part}."
        if marker in name:
            target = name.replace(marker, f".{ours}.")
            start, end = _shard_bounds(cfg, ours, shard)
            param = params[target]
            dest = param.data[start:end]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            # The fused parameter counts as loaded once its last shard arrives; shards are
            # tracked individually so a missing q/k/v or gate/up is still reported.
            loaded.add(f"{target}#{shard}")
            n_shards = 3 if ours.endswith("qkv_proj") else 2
            if all(f"{target}#{i}" in loaded for i in range(n_shards)):
                loaded.add(target)
            return
    if name not in params:
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)
    loaded.add(name)
