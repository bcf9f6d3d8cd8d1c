"""Model config parsing, RoPE frequencies, weight loading and logits against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_helpers import EOS_ID, checkpoint, hf_logits, hf_model, prompts

from tritonllm.config import EngineConfig, ModelConfig
from tritonllm.engine import LLMEngine
from tritonllm.layers import rope_inv_freq
from tritonllm.models import load_model, safetensors_files
from tritonllm.sampling_params import SamplingParams


def test_model_config_from_checkpoints():
    q3 = ModelConfig.from_pretrained(checkpoint("qwen3"))
    assert q3.architecture == "Qwen3ForCausalLM" and q3.qk_norm and not q3.attention_bias
    assert (q3.num_heads, q3.num_kv_heads, q3.head_dim, q3.num_layers) == (4, 2, 32, 2)
    assert q3.tie_word_embeddings and q3.rope_theta == 1e6 and q3.rope_scaling is None
    # EOS ids from config.json and generation_config.json, deduplicated.
    assert q3.eos_token_ids == (EOS_ID, EOS_ID + 1)
    q2 = ModelConfig.from_pretrained(checkpoint("qwen2", tie=False))
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm
    assert not q2.tie_word_embeddings and q2.head_dim == 64 // 4
    llama = ModelConfig.from_pretrained(checkpoint("llama"))
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 8.0
    assert llama.rope_scaling.original_max_position_embeddings == 16


def test_model_config_accepts_transformers4_keys():
    cfg = json.load(open(f"{checkpoint('llama')}/config.json"))
    scaling = cfg.pop("rope_parameters")
    cfg["rope_theta"] = scaling.pop("rope_theta")
    cfg["rope_scaling"] = scaling
    parsed = ModelConfig.from_dict(cfg)
    assert parsed.rope_theta == 5e5 and parsed.rope_scaling.high_freq_factor == 4.0
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict({**cfg, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope scaling"):
        ModelConfig.from_dict({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_engine_config_derived_values():
    cfg = EngineConfig(model=checkpoint("qwen3"), page_size=16, max_running_requests=4)
    assert cfg.torch_dtype == torch.float32 and cfg.effective_max_model_len == 512
    assert cfg.max_pages_per_seq == 32
    assert cfg.cpu_default_num_pages == 4 * 32 + 1  # 4 requests × 512 tokens + page 0
    assert EngineConfig(model="x", device="cuda").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(model="x", page_size=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="x", dtype="int8")


def test_llama3_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = checkpoint("llama")
    cfg = ModelConfig.from_pretrained(path)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_model(path).config, torch.device("cpu"))
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    # Scaling actually changes the low frequencies of this tiny config.
    assert not torch.equal(ours, rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))


@pytest.mark.parametrize(("arch", "tie"), [("qwen3", True), ("qwen2", False), ("llama", True)])
def test_prefill_logits_match_transformers(arch, tie):
    """One prompt of 21 tokens prefilled in chunks of 8 (page size 4): the logits of every
    chunk's last token equal transformers' logits at that position."""
    path = checkpoint(arch, tie)
    prompt = prompts([21], seed=3)[0]
    engine = LLMEngine(EngineConfig(model=path, page_size=4, num_pages=64, max_prefill_tokens=8))
    runner, sched = engine.runner, engine.scheduler
    expected = hf_logits(path, prompt)
    from tritonllm.engine.request import Request
    from tritonllm.sampling_params import SamplingParams

    req = Request("r", prompt, SamplingParams(), arrival=0)
    sched.add(req)
    while req.num_computed < len(prompt):
        batch = sched.schedule()  # nothing decodes: a prefill batch of the next chunk
        assert batch is not None and not batch.is_decode
        fwd = runner.build_inputs(batch)
        ids, pos, meta = fwd.input_ids, fwd.positions, fwd.meta
        runner.backend.prepare(meta)
        last = torch.tensor([len(ids) - 1])
        logits = runner.model(ids, pos, meta, last)[0]
        req.num_computed += batch.extend_lens[0]
        torch.testing.assert_close(logits, expected[req.num_computed - 1], rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads_identically(tmp_path):
    path = checkpoint("qwen2", tie=False)
    sharded = tmp_path / "sharded"
    hf_model(path).save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(safetensors_files(str(sharded))) > 1
    cfg = ModelConfig.from_pretrained(path)
    a = load_model(path, cfg, torch.device("cpu"), torch.float32)
    b = load_model(str(sharded), cfg, torch.device("cpu"), torch.float32)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_loader_rejects_incomplete_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    path = checkpoint("qwen3")
    state = load_file(f"{path}/model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(str(tmp_path), cfg, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("fused", [True, False])
def test_engine_settings_reach_layers_sampler_and_backend_as_constructor_arguments(fused):
    """`EngineConfig.fused_layers`, `linear_kernel` and `tensor_core_decode_min_batch` are
    handed to every layer, the sampler and the attention backend when the engine is built
    (no module reads them from the environment); the greedy ids do not depend on them on CPU."""
    from tritonllm.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLUMLP

    config = EngineConfig(
        model=checkpoint("qwen3"),
        page_size=4,
        num_pages=64,
        fused_layers=fused,
        linear_kernel="auto",
        tensor_core_decode_min_batch=16,
    )
    engine = LLMEngine(config)
    runner = engine.runner
    switched = [m for m in runner.model.modules() if isinstance(m, RMSNorm | RotaryEmbedding)]
    switched += [m for m in runner.model.modules() if isinstance(m, SwiGLUMLP)]
    assert switched and all(m.fused is fused for m in switched)
    modes = {m.mode for m in runner.model.modules() if isinstance(m, Linear)}
    assert modes == {"auto" if fused else "cublas"}  # auto with the layer kernels off: cuBLAS
    assert runner.sampler.fused is fused
    assert runner.backend.options.tensor_core_decode_min_batch == 16
    prompt = prompts([7], seed=9)[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    reference = LLMEngine(EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=64))
    assert greedy == reference.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
