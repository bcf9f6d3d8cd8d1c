"""The offline model builder: directories Hugging Face loads, with weights fit for greedy tests.

Oracle: Hugging Face transformers loading and running the written checkpoints.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from fixtures_model import tiny_model_factory  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tritonllm.build_model import (
    SHARD_BYTES,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    build_model,
    is_complete_model_dir,
    main,
    make_config,
    parameter_shapes,
    random_state_dict,
    shard_names,
)

ARCHS = ["qwen3", "qwen2", "llama"]
PROMPTS = [
    "Hello world",
    "你好，世界",
    "The quick brown fox",
    "def main():\n",
    "1 2 3 4",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and OpenMP spinning on a loaded 2-core
    machine made these tests ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _greedy(model, tokenizer, prompt: str, steps: int = 32) -> tuple[list[int], list[float]]:
    """Greedy continuation ids and each step's (top1 - top2) / std of the logits."""
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    margins = []
    for logits in out.logits:
        top = logits[0].double().topk(2).values
        margins.append(((top[0] - top[1]) / logits[0].double().std()).item())
    return out.sequences[0, ids.shape[1] :].tolist(), margins


def test_tiny_qwen3_loads_offline(tiny_model_dir):
    assert is_complete_model_dir(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = model.config
    assert config.model_type == "qwen3" and model.dtype == torch.float32
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (151936, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.intermediate_size == 128 and config.max_position_embeddings == 2048
    assert config.tie_word_embeddings and config.eos_token_id == 151645
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    generation = GenerationConfig.from_pretrained(tiny_model_dir)
    assert generation.eos_token_id == [151645, 151643] and not generation.do_sample
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.encode("Hello world") == [9707, 1879]
    assert tokenizer.eos_token_id == 151645


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_specific_layers(tiny_model_factory, arch):  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch))
    attn = model.model.layers[0].self_attn
    assert model.config.model_type == arch
    assert hasattr(attn, "q_norm") is (arch == "qwen3")
    if arch == "qwen2":
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.bias is not None and proj.bias.abs().min() > 0
    else:
        assert attn.q_proj.bias is None
    # Norm weights are random, so a forgotten norm weight changes the output.
    assert not torch.allclose(model.model.norm.weight, torch.ones(64))
    assert not torch.allclose(model.model.layers[0].input_layernorm.weight, torch.ones(64))


def test_llama3_rope_scaling_changes_the_output(tiny_model_factory):  # noqa: F811
    path = tiny_model_factory("llama")
    config = AutoConfig.from_pretrained(path)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["original_max_position_embeddings"] == 256
    ids = torch.arange(1000, 1064)[None]
    with torch.no_grad():
        scaled = AutoModelForCausalLM.from_pretrained(path)(ids).logits
        config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
        plain = AutoModelForCausalLM.from_pretrained(path, config=config)(ids).logits
    assert (scaled - plain).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_is_robust_and_varied(tiny_model_factory, arch):  # noqa: F811
    path = tiny_model_factory(arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model32 = AutoModelForCausalLM.from_pretrained(path).eval()
    model64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    outputs, all_margins = [], []
    for prompt in PROMPTS:
        ids32, margins = _greedy(model32, tokenizer, prompt)
        ids64, _ = _greedy(model64, tokenizer, prompt)
        # Numerical noise (float32 vs float64) never flips a greedy choice.
        assert ids32 == ids64, prompt
        assert len(set(ids32)) >= 4, f"{prompt!r} decodes to a near-constant stream {ids32}"
        outputs.append(ids32)
        all_margins += margins
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)
    assert sorted(all_margins)[len(all_margins) // 2] > 0.05  # median margin: 5% of a logit std


def test_same_seed_same_weights_other_seed_differs():
    config = make_config("tiny", "qwen3")
    first, again = random_state_dict(config, seed=0), random_state_dict(config, seed=0)
    other = random_state_dict(config, seed=1)
    assert first.keys() == again.keys() == other.keys()
    assert "lm_head.weight" not in first  # tied
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_cli_skips_a_complete_dir_unless_forced(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["--shape", "tiny", "--arch", "qwen2", "--out", str(out), "--seed", "3"]) == 0
    assert is_complete_model_dir(out)
    mtime = (out / WEIGHTS_FILE).stat().st_mtime_ns
    assert main(["--out", str(out)]) == 0
    assert "already holds" in capsys.readouterr().out
    assert (out / WEIGHTS_FILE).stat().st_mtime_ns == mtime
    assert build_model(out, arch="qwen2") == out  # API skips too
    assert (out / WEIGHTS_FILE).stat().st_mtime_ns == mtime
    time.sleep(0.01)
    assert main(["--out", str(out), "--arch", "qwen2", "--force"]) == 0
    assert (out / WEIGHTS_FILE).stat().st_mtime_ns > mtime


def test_rejects_unknown_shape_or_arch(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        build_model(tmp_path, shape="huge")
    with pytest.raises(ValueError, match="arch"):
        build_model(tmp_path, arch="gpt2")


def test_qwen3_06b_config_and_parameter_count():
    config = make_config("qwen3-0.6b", "qwen3")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        1024,
        28,
        3072,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 128)
    assert config.vocab_size == 151936 and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 40960
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Qwen3-0.6B: 0.6B parameters, 0.44B without the embedding.
    assert sum(p.numel() for p in model.parameters()) == 596_049_920


@pytest.mark.slow
def test_qwen3_06b_builds_quickly_and_loads(tmp_path):
    start = time.monotonic()
    path = build_model(tmp_path / "qwen3-0.6b", shape="qwen3-0.6b")
    assert time.monotonic() - start < 120
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[9707, 1879]])).logits
    assert torch.isfinite(logits).all()


def test_qwen3_8b_config_and_parameter_count():
    """Qwen/Qwen3-8B's shape: 36 layers of hidden 4096, 32 q / 8 KV heads of 128, an untied
    lm_head (stored, unlike the smaller shapes')."""
    config = make_config("qwen3-8b", "qwen3")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (
        4096,
        36,
        12288,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.vocab_size == 151936 and not config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rms_norm_eps == 1e-6
    assert config.dtype == torch.bfloat16
    shapes = parameter_shapes(config)
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (151936, 4096)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert sum(math.prod(s) for s in shapes.values()) == 8_190_735_360
    # 16.4 GB of bf16 in shards of at most 5 GB, each tensor whole, in parameter order.
    shards = shard_names(shapes, 2)
    assert len(shards) == 4 and [n for shard in shards for n in shard] == list(shapes)
    assert all(sum(math.prod(shapes[n]) * 2 for n in s) <= SHARD_BYTES for s in shards)


def test_sharded_checkpoint_holds_the_single_file_weights(tmp_path):
    """Weights over `shard_bytes` go to HF-named shards plus an index, which transformers and
    the engine's loader read as the one-file checkpoint of the same seed; a missing shard makes
    the directory incomplete (it is rebuilt)."""
    from tritonllm.models import safetensors_files

    one = build_model(tmp_path / "one", shape="tiny", seed=5)
    sharded = build_model(tmp_path / "sharded", shape="tiny", seed=5, shard_bytes=1 << 20)
    index = json.loads((sharded / WEIGHTS_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and not (sharded / WEIGHTS_FILE).exists()
    assert [Path(f).name for f in safetensors_files(str(sharded))] == files
    assert is_complete_model_dir(sharded)
    expected = AutoModelForCausalLM.from_pretrained(one).state_dict()
    got = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert index["metadata"]["total_size"] == sum(
        (sharded / f).stat().st_size for f in files
    ) - sum(_header_bytes(sharded / f) for f in files)
    (sharded / files[-1]).unlink()
    assert not is_complete_model_dir(sharded)
    # Rebuilding as one file leaves no stale shard behind.
    build_model(sharded, shape="tiny", seed=5)
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == [WEIGHTS_FILE]


def _header_bytes(path: Path) -> int:
    """The size of a safetensors file's length prefix and JSON header."""
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weights_drawn_on_the_gpu_are_seeded_and_loadable(tmp_path):
    first = build_model(tmp_path / "a", shape="tiny", seed=2, device="cuda")
    again = build_model(tmp_path / "b", shape="tiny", seed=2, device="cuda")
    a = AutoModelForCausalLM.from_pretrained(first).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in a.values())
