"""Offline model builder: the Qwen3 tokenizer plus seeded random weights as a HF model directory.

No model hub is reachable in tests or on the GPU host, so the served checkpoint is built here:
``config.json``, ``model.safetensors``, ``generation_config.json`` and tokenizer files, which
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load offline.

    python -m tritonllm.build_model --shape tiny --arch qwen3 --out models/tiny-qwen3 [--seed 0]

Weights are drawn tensor by tensor and cast to the target dtype (never a float32 copy of the
whole model), with scales chosen so that greedy decoding is robust (see ``init_std``).

EOS: the weights are not rigged, so random text rarely reaches ``<|im_end|>`` (151645). To
exercise stop handling, run the greedy reference (HF ``generate``) once and pass one of the ids
it produces as ``stop_token_ids``; ``ignore_eos`` is exercised by any long generation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from tritonllm.tokenization.qwen_tokenizer import (
    QWEN3_EOS_TOKEN_ID,
    QWEN3_PAD_TOKEN_ID,
    build_qwen3_tokenizer,
    save_qwen3_tokenizer,
)

SHAPES = ("tiny", "qwen3-0.6b")
ARCHS = ("qwen3", "qwen2", "llama")
VOCAB_SIZE = 151936  # Qwen3's embedding rows (the tokenizer has 151669 ids)
EOS_TOKEN_IDS = [QWEN3_EOS_TOKEN_ID, QWEN3_PAD_TOKEN_ID]  # <|im_end|>, <|endoftext|>
BOS_TOKEN_ID = QWEN3_PAD_TOKEN_ID
WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = (
    "config.json",
    WEIGHTS_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Llama 3.1-style RoPE scaling, with a small original context so that it changes the tiny model.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

_SHAPE_KWARGS = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=2048,
    ),
    # Qwen/Qwen3-0.6B's config.json.
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40960,
    ),
}
_SHAPE_DTYPE = {"tiny": torch.float32, "qwen3-0.6b": torch.bfloat16}


def make_config(shape: str = "tiny", arch: str = "qwen3") -> PretrainedConfig:
    """The transformers config of a ``shape`` x ``arch`` model.

    All: vocab 151936, tied embeddings, rms_norm_eps 1e-6, SiLU MLP, bos 151643, eos 151645.
    ``qwen3`` has q/k RMSNorm, ``qwen2`` q/k/v biases, ``llama`` llama3 RoPE scaling.

    Raises:
        ValueError: unknown shape or arch.
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=QWEN3_EOS_TOKEN_ID,
        **_SHAPE_KWARGS[shape],
    )
    # transformers 5 still takes the legacy rope_theta / rope_scaling keys (it folds them into
    # rope_parameters) without declaring them, hence the call-arg ignores.
    config: PretrainedConfig
    if arch == "qwen3":
        config = Qwen3Config(  # type: ignore[call-arg]
            rope_theta=1e6, attention_bias=False, **common
        )
    elif arch == "qwen2":
        config = Qwen2Config(rope_theta=1e6, **common)  # type: ignore[call-arg]
    else:
        config = LlamaConfig(  # type: ignore[call-arg]
            rope_theta=5e5, rope_scaling=dict(LLAMA3_ROPE_SCALING), **common
        )
    config.dtype = _SHAPE_DTYPE[shape]
    return config


EMBED_STD = 0.05  # token embedding (and tied lm_head) rows
LOGIT_STD = 8.0  # target std of the logits: top-1 is well separated, sampling is not uniform
OUT_PROJ_GAIN = 4.0  # o_proj / down_proj output scale relative to 1/sqrt(fan_in)


def init_std(name: str, shape: tuple[int, ...], hidden_size: int) -> tuple[float, float]:
    """(mean, std) of the normal init of parameter ``name`` with shape ``shape``.

    Chosen for greedy decoding that is varied and robust with random weights (checked in
    tests/test_build_model.py):

    - projections are ``1/sqrt(fan_in)`` so activations stay O(1) (bf16-safe); attention and MLP
      outputs (``o_proj``, ``down_proj``) are ``OUT_PROJ_GAIN`` times larger;
    - embeddings are small (``EMBED_STD``), so the residual stream is dominated by the blocks:
      with a tied lm_head, a large embedding in the last hidden state makes the model echo its
      input token;
    - the final norm weight restores the logit scale to ``LOGIT_STD``
      (``|normed hidden| = sqrt(hidden_size)``), so top-1/top-2 margins are wide in absolute
      terms and the distribution is peaked;
    - other norm weights and biases are random, not 1 and 0, so a forgotten norm weight or bias
      changes the output.
    """
    if name == "model.norm.weight":
        gain = LOGIT_STD / (math.sqrt(hidden_size) * EMBED_STD)
        return gain, 0.2 * gain
    if name.endswith("norm.weight"):
        return 1.0, 0.2
    if name.endswith(".bias"):
        return 0.0, 0.2
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0.0, EMBED_STD
    fan_in = shape[-1]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, OUT_PROJ_GAIN / math.sqrt(fan_in)
    return 0.0, 1.0 / math.sqrt(fan_in)


def random_state_dict(
    config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Seeded random weights for ``config``, named as transformers names them.

    Parameter names and shapes come from the model built on the meta device (no memory); each
    tensor is drawn on the CPU from one ``torch.Generator`` in name order, then cast to ``dtype``
    (one tensor at a time: peak extra memory is the largest tensor in float32). Tied
    ``lm_head.weight`` is not stored.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        mean, std = init_std(name, tuple(param.shape), config.hidden_size)
        weight = torch.randn(tuple(param.shape), generator=generator, dtype=torch.float32)
        state[name] = weight.mul_(std).add_(mean).to(dtype)
        del weight
    return state


def is_complete_model_dir(path: str | Path) -> bool:
    """Whether ``path`` holds every file ``build_model`` writes."""
    return all((Path(path) / name).is_file() for name in REQUIRED_FILES)


def _write_config(config: PretrainedConfig, out: Path, arch: str) -> None:
    config.save_pretrained(out)
    # Also the legacy keys real checkpoints carry (transformers 4.x, other engines' parsers).
    path = out / "config.json"
    data = json.loads(path.read_text())
    data["rope_theta"] = (data.get("rope_parameters") or {}).get("rope_theta")
    data["rope_scaling"] = dict(LLAMA3_ROPE_SCALING) if arch == "llama" else None
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_model(
    out_dir: str | Path,
    shape: str = "tiny",
    arch: str = "qwen3",
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write a loadable HF model directory with seeded random weights and the Qwen3 tokenizer.

    ``tiny`` is float32 (hidden 64, 2 layers, 4/2 heads, head_dim 32); ``qwen3-0.6b`` is the
    exact Qwen3-0.6B shape in bfloat16 (1.2 GB on disk). generation_config: eos
    ``[151645, 151643]``, greedy by default. The same ``seed`` gives the same weights.

    Args:
        out_dir: target directory (created).
        force: rebuild even when ``out_dir`` already holds a complete model.
    Returns:
        ``out_dir`` as a ``Path``.
    Raises:
        ValueError: unknown shape or arch. FileNotFoundError: no ``qwen.tiktoken``.
    """
    out = Path(out_dir)
    config = make_config(shape, arch)
    if is_complete_model_dir(out) and not force:
        return out
    out.mkdir(parents=True, exist_ok=True)
    dtype = _SHAPE_DTYPE[shape]
    state = random_state_dict(config, seed=seed, dtype=dtype)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / WEIGHTS_FILE).chmod(0o644)  # safetensors writes 0600; servers may run as another user
    del state
    _write_config(config, out, arch)
    GenerationConfig(
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=list(EOS_TOKEN_IDS),
        pad_token_id=QWEN3_PAD_TOKEN_ID,
        do_sample=False,
    ).save_pretrained(out)
    save_qwen3_tokenizer(build_qwen3_tokenizer(), out)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``tritonllm-build-model``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--shape", choices=SHAPES, default="tiny")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild an existing model")
    args = parser.parse_args(argv)
    if is_complete_model_dir(args.out) and not args.force:
        print(f"{args.out} already holds a model (use --force to rebuild)")
        return 0
    out = build_model(args.out, shape=args.shape, arch=args.arch, seed=args.seed, force=True)
    print(f"wrote {args.shape} {args.arch} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
