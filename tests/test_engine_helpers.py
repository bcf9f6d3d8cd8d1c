"""Shared helpers for the engine tests (no tests here): tiny checkpoints built with
transformers and the transformers greedy reference.

Checkpoints are built once per process (cached) in a temporary directory. Weights are seeded
and scaled for wide logit margins (small embeddings, a final norm weight that brings logits to
std ~8), so float-level differences never flip a greedy choice.
"""

from __future__ import annotations

import atexit
import functools
import math
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 1024
EOS_ID = 7
# Small original context so that Llama 3 scaling changes the model at tiny prompt lengths.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

_ROOT = Path(tempfile.mkdtemp(prefix="tritonllm-engine-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def _config(arch: str, tie: bool):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        eos_token_id=EOS_ID,
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, rope_theta=1e6, **common)
    if arch == "qwen2":
        return Qwen2Config(rope_theta=1e6, **common)
    return LlamaConfig(head_dim=16, rope_theta=5e5, rope_scaling=dict(LLAMA3_SCALING), **common)


def _init_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, p in model.named_parameters():
        if name == "model.norm.weight":
            mean = 8.0 / (math.sqrt(hidden) * 0.05)
            std = 0.2 * mean
        elif name.endswith("norm.weight"):
            mean, std = 1.0, 0.2
        elif name.endswith(".bias"):
            mean, std = 0.0, 0.2
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            mean, std = 0.0, 0.05
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            mean, std = 0.0, 4.0 / math.sqrt(p.shape[-1])
        else:
            mean, std = 0.0, 1.0 / math.sqrt(p.shape[-1])
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std + mean)


@functools.cache
def checkpoint(arch: str = "qwen3", tie: bool = True, seed: int = 0) -> str:
    """Path of a tiny float32 `arch` checkpoint ("qwen3" | "qwen2" | "llama")."""
    out = _ROOT / f"{arch}-{'tied' if tie else 'untied'}-{seed}"
    model = AutoModelForCausalLM.from_config(_config(arch, tie), dtype=torch.float32)
    _init_(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=[EOS_ID, EOS_ID + 1]).save_pretrained(out)
    return str(out)


@functools.cache
def hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (argmax, no EOS stop) and its `[max_new, vocab]`
    float32 logits per generated token."""
    model = hf_model(path)
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(max_new):
        row = out.logits[0, -1].float()
        logits.append(row)
        tok = int(row.argmax())
        tokens.append(tok)
        # transformers 5 renamed past_key_values to cache (4.x has only the former).
        if "cache" in out:
            out = model(torch.tensor([[tok]]), cache=out.cache, use_cache=True)
        else:
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


@torch.inference_mode()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]` float32 logits of a full forward over `ids`."""
    return hf_model(path)(torch.tensor([ids])).logits[0].float()


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Random prompts (token ids in [10, VOCAB)) of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def sample_host(sampler, logits: torch.Tensor, reqs: list):
    """`sampler.sample_device(logits, reqs)` copied back to the host (a `SamplerOutput`: token
    ids, logprobs, top logprobs per row), as the engine's `LaunchedStep.result` does."""
    from tritonllm.engine.sampler import DeviceSamples

    samples = sampler.sample_device(logits, reqs)
    return DeviceSamples.to_output([t.cpu() for t in samples.tensors()], samples.num_top)
