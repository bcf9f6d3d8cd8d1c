"""`ModelConfig`: the parsed ``config.json`` (and ``generation_config.json``) of a Hugging Face
model directory, as the engine needs it. A frozen dataclass; derived values are properties.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
_MODEL_TYPE_TO_ARCH = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (`rope_type == "llama3"`), as in Hugging Face configs."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer, from `config.json`.

    Attributes follow Hugging Face names where they exist; `qk_norm` is True for Qwen3 (per-head
    RMSNorm on q and k before RoPE), `attention_bias` is True for Qwen2 (q/k/v biases).
    """

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        """Parse `path/config.json` (+ `generation_config.json` for extra EOS ids).

        Accepts both the transformers 4 keys (`rope_theta`, `rope_scaling`) and the
        transformers 5 key (`rope_parameters`).

        Raises:
            FileNotFoundError: no config.json in `path`.
            ValueError: an unsupported architecture or rope scaling type.
        """
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return cls.from_dict(cfg, _read_generation_eos(path))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a parsed `config.json` dict. Raises ValueError if unsupported."""
        archs = cfg.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling_dict = cfg.get("rope_scaling") or rope
        rope_type = scaling_dict.get("rope_type", scaling_dict.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(scaling_dict["factor"]),
                low_freq_factor=float(scaling_dict["low_freq_factor"]),
                high_freq_factor=float(scaling_dict["high_freq_factor"]),
                original_max_position_embeddings=int(
                    scaling_dict["original_max_position_embeddings"]
                ),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (default, llama3)")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = is_qwen2 or bool(cfg.get("attention_bias", False))
        eos = _as_tuple(cfg.get("eos_token_id"))
        eos = tuple(dict.fromkeys(eos + tuple(extra_eos)))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            # Qwen2 biases q/k/v only; Llama and Qwen3 with attention_bias also bias o_proj.
            o_proj_bias=attention_bias and not is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, for a 1-byte dtype (multiply by size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_generation_eos(path: str) -> tuple[int, ...]:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_path):
        return ()
    with open(gen_path) as f:
        return _as_tuple(json.load(f).get("eos_token_id"))
