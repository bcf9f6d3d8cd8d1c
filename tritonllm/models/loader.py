"""Load Hugging Face safetensors checkpoints into `CausalLM` (fusing q/k/v and gate/up).

A tensor-parallel rank (`CausalLM.shard` set) reads only its slices of each tensor
(`safe_open(...).get_slice`): rows of q/k/v (its heads), gate/up (its MLP columns), the
embedding and the LM head (its vocabulary rows, zero-padded to `ModelShard.vocab_rows`);
columns of o and down; the o bias on rank 0 only; norms whole.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from tritonllm.config import ModelConfig
from tritonllm.distributed import ModelShard, Span, TensorParallelGroup
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
# Tensor parallelism: HF name suffix → which dimension of the tensor a rank slices.
_ROW_SPLIT = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_COLUMN_SPLIT = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB_SPLIT = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")


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
    tp: TensorParallelGroup | None = None,
) -> CausalLM:
    """Build `CausalLM` on `device` in `dtype` and fill it from the checkpoint at `path`.

    `max_positions`, `kernels` (the layers' Triton kernel choices) and `tp` (this rank's
    tensor-parallel group: build and load its shard only) go to `CausalLM`.

    Weights are created uninitialised (meta device, then `to_empty`) and every parameter must
    come from the checkpoint.

    Raises:
        ValueError: a parameter missing from the checkpoint or a shape mismatch.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(cfg, max_positions, kernels, tp)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks parameter sharing; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.init_cache(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shard = model.shard
    # The fused q/k/v and gate/up bounds are those of the local (shard's) shapes.
    local_cfg = cfg if shard is None else shard.local_config(cfg)
    for file in safetensors_files(path):
        # Tensors are read straight into device memory (no host copy of the model).
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if _IGNORED.search(name):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                if shard is None:
                    tensor = f.get_tensor(name)
                else:
                    tensor = _read_shard(f, name, cfg, shard)
                    if tensor is None:
                        continue
                _load_one(local_cfg, params, loaded, name, tensor)
    expected = {n for n in params if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks parameters: {missing[:8]}")
    return model.eval()


def _read_shard(f, name: str, cfg: ModelConfig, shard: ModelShard) -> torch.Tensor | None:
    """Rank `shard.rank`'s part of checkpoint tensor `name` from the open file `f` (None: the
    rank holds none of it, an o bias off rank 0)."""
    row = _ROW_SPLIT.search(name)
    if row:
        span = _span(row.group(1), cfg, shard)
        return f.get_slice(name)[span.start : span.stop]
    column = _COLUMN_SPLIT.search(name)
    if column:
        span = _span(column.group(1), cfg, shard)
        return f.get_slice(name)[:, span.start : span.stop]
    if name.endswith(".o_proj.bias"):
        return f.get_tensor(name) if shard.rank == 0 else None
    if _VOCAB_SPLIT.search(name):
        rows = f.get_slice(name)[shard.vocab.start : shard.vocab.stop]
        return torch.nn.functional.pad(rows, (0, 0, 0, shard.vocab_rows - rows.shape[0]))
    return f.get_tensor(name)


def _span(projection: str, cfg: ModelConfig, shard: ModelShard) -> Span:
    """The rank's range of a projection's split dimension: its query heads' channels (q, o),
    its KV heads' (k, v), or its MLP columns (gate, up, down)."""
    d, heads = cfg.head_dim, shard.heads
    if projection in ("q_proj", "o_proj"):
        return Span(heads.q.start * d, heads.q.stop * d)
    if projection in ("k_proj", "v_proj"):
        return Span(heads.kv.start * d, heads.kv.stop * d)
    return shard.intermediate


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
