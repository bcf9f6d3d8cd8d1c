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
from collections.abc import Iterator
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

SHAPES = ("tiny", "qwen3-0.6b", "qwen3-8b")
ARCHS = ("qwen3", "qwen2", "llama")
VOCAB_SIZE = 151936  # Qwen3's embedding rows (the tokenizer has 151669 ids)
EOS_TOKEN_IDS = [QWEN3_EOS_TOKEN_ID, QWEN3_PAD_TOKEN_ID]  # <|im_end|>, <|endoftext|>
BOS_TOKEN_ID = QWEN3_PAD_TOKEN_ID
WEIGHTS_FILE = "model.safetensors"
# Sharded checkpoints (weights over SHARD_BYTES): HF's names and index.
WEIGHTS_INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 10**9
REQUIRED_FILES = (
    "config.json",
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
    # Qwen/Qwen3-8B's config.json (untied lm_head).
    "qwen3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
}
_SHAPE_DTYPE = {"tiny": torch.float32, "qwen3-0.6b": torch.bfloat16, "qwen3-8b": torch.bfloat16}
# Shapes whose weights are drawn on the GPU when there is one (16 GB: minutes on the CPU).
_GPU_SHAPES = ("qwen3-8b",)


def make_config(shape: str = "tiny", arch: str = "qwen3") -> PretrainedConfig:
    """The transformers config of a ``shape`` x ``arch`` model.

    All: vocab 151936, tied embeddings (except ``qwen3-8b``), rms_norm_eps 1e-6, SiLU MLP,
    bos 151643, eos 151645.
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
    )
    common.update(_SHAPE_KWARGS[shape])
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


def parameter_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The stored parameters of ``config``'s model, in transformers' order, with their shapes
    (from the model built on the meta device: no memory). Tied ``lm_head.weight`` is not
    listed."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def iter_random_tensors(
    config: PretrainedConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights for ``config`` as ``(name, CPU tensor)``, one at a time.

    Each tensor is drawn on ``device`` from one ``torch.Generator`` in parameter order
    (``parameter_shapes``), cast to ``dtype`` and moved to the CPU: peak extra memory is the
    largest tensor in float32. The same ``seed`` and device type give the same weights; CPU and
    CUDA draws differ.
    """
    generator = torch.Generator(device).manual_seed(seed)
    for name, shape in parameter_shapes(config).items():
        mean, std = init_std(name, shape, config.hidden_size)
        weight = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
        yield name, weight.mul_(std).add_(mean).to(dtype).cpu()
        del weight


def random_state_dict(
    config: PretrainedConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """All of ``iter_random_tensors`` as a state dict, named as transformers names them."""
    return dict(iter_random_tensors(config, seed, dtype, device))


def shard_names(
    shapes: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int = SHARD_BYTES
) -> list[list[str]]:
    """Parameter names per shard file, in order: a new shard starts when the next tensor would
    take the current one over ``shard_bytes`` (a tensor larger than that gets a shard alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_weights(
    config: PretrainedConfig,
    out: Path,
    seed: int,
    dtype: torch.dtype,
    device: str,
    shard_bytes: int,
) -> None:
    """``model.safetensors``, or HF-style shards ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` (written last) when the weights exceed ``shard_bytes``."""
    shapes = parameter_shapes(config)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    shards = shard_names(shapes, itemsize, shard_bytes)
    if len(shards) == 1:
        files = [WEIGHTS_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    tensors = iter_random_tensors(config, seed, dtype, device)
    for file, names in zip(files, shards, strict=True):
        state = dict(next(tensors) for _ in names)  # parameter order: exactly these names
        assert list(state) == names
        save_file(state, str(out / file), metadata={"format": "pt"})
        (out / file).chmod(0o644)  # safetensors writes 0600; servers may run as another user
        weight_map.update(dict.fromkeys(names, file))
        del state
    if len(files) > 1:
        total = sum(math.prod(shape) * itemsize for shape in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def is_complete_model_dir(path: str | Path) -> bool:
    """Whether ``path`` holds every file ``build_model`` writes: config, tokenizer and either
    ``model.safetensors`` or the shard index and every shard it names."""
    path = Path(path)
    if not all((path / name).is_file() for name in REQUIRED_FILES):
        return False
    if (path / WEIGHTS_FILE).is_file():
        return True
    try:
        weight_map = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        return False
    return all((path / file).is_file() for file in set(weight_map.values()))


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
    device: str | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write a loadable HF model directory with seeded random weights and the Qwen3 tokenizer.

    ``tiny`` is float32 (hidden 64, 2 layers, 4/2 heads, head_dim 32); ``qwen3-0.6b`` is the
    exact Qwen3-0.6B shape in bfloat16 (1.2 GB on disk); ``qwen3-8b`` the exact Qwen3-8B shape
    (untied lm_head) in bfloat16 (16.4 GB, in shards). generation_config: eos
    ``[151645, 151643]``, greedy by default. The same ``seed`` and device type give the same
    weights.

    Args:
        out_dir: target directory (created).
        force: rebuild even when ``out_dir`` already holds a complete model.
        device: where the weights are drawn (``random_state_dict``); default ``cuda`` for
            ``qwen3-8b`` when CUDA is available, else ``cpu``.
        shard_bytes: larger weights are written as shards of at most this many bytes.
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
    # An interrupted rebuild never looks complete, and no stale shard is left to be counted.
    for stale in [out / WEIGHTS_INDEX, out / "config.json", *out.glob("model*.safetensors")]:
        stale.unlink(missing_ok=True)
    if device is None:
        device = "cuda" if shape in _GPU_SHAPES and torch.cuda.is_available() else "cpu"
    _write_weights(config, out, seed, _SHAPE_DTYPE[shape], device, shard_bytes)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
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
    parser.add_argument(
        "--device", help="draw the weights on this device (default: cuda for qwen3-8b if any)"
    )
    args = parser.parse_args(argv)
    if is_complete_model_dir(args.out) and not args.force:
        print(f"{args.out} already holds a model (use --force to rebuild)")
        return 0
    out = build_model(
        args.out, shape=args.shape, arch=args.arch, seed=args.seed, force=True, device=args.device
    )
    print(f"wrote {args.shape} {args.arch} model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
