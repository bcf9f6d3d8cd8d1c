"""`tritonllm.tokenization.loading.load_tokenizer`: the tokenizer and detokenizer stubs load a
checkpoint's tokenizer as ``AutoTokenizer`` does, without importing torch.

- For every checkpoint kind the service serves (tiny Qwen3 / Qwen2 / Llama, the converted
  SmolLM2), the loaded tokenizer is of AutoTokenizer's class and gives its ids, chat prompt,
  decoded text and special ids; a config that names no class falls back to AutoTokenizer.
- In a fresh interpreter without ``TRITONLLM_DEVICE`` (as under ``make serve``), the two
  stubs' own ``initialize`` imports no torch.
- In the session's running tritonserver, the tokenizer and detokenizer stubs have no libtorch
  mapped, while the generator's stub has (so the check can see torch where it is).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_model import tiny_model_factory  # noqa: F401
from process_helpers import stub_pid

from tritonllm.tokenization.loading import load_tokenizer, tokenizer_class_name

REPO_ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello world 12345, <|im_end|> ünïcode 日本語\n\n  two  spaces\tand a tab"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def _same_as_auto(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(auto)
    ids = auto.encode(TEXT)
    assert ours.encode(TEXT) == ids
    assert ours.decode(ids) == auto.decode(ids)
    assert ours.apply_chat_template(MESSAGES, tokenize=False) == auto.apply_chat_template(
        MESSAGES, tokenize=False
    )
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_tiny_checkpoints_load_as_autotokenizer_loads_them(tiny_model_factory, arch):  # noqa: F811
    model_dir = tiny_model_factory(arch)
    assert tokenizer_class_name(model_dir) is not None
    _same_as_auto(model_dir)


def test_the_default_model_loads_as_autotokenizer_loads_it(smollm2_dir):
    assert tokenizer_class_name(smollm2_dir) is not None
    _same_as_auto(smollm2_dir)


def test_a_config_naming_no_exported_class_falls_back_to_autotokenizer(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for name in (None, "NoSuchTokenizerClass"):
        if name is None:
            config.pop("tokenizer_class", None)
        else:
            config["tokenizer_class"] = name
        config_path.write_text(json.dumps(config))
        assert tokenizer_class_name(copy) == name
        _same_as_auto(copy)  # AutoTokenizer's own resolution (from config.json's model_type)


def test_the_stubs_initialize_without_torch(tiny_model_dir):
    """The tokenizer and detokenizer models' own ``initialize`` (a stand-in ``pb_utils`` module,
    no ``TRITONLLM_DEVICE``: the device is not set, as under ``make serve``) import no torch."""
    code = (
        "import importlib.util, json, sys, types\n"
        "sys.modules['triton_python_backend_utils'] = types.SimpleNamespace(Logger=None)\n"
        "config = json.dumps({'parameters': {}})\n"
        "for name in ('tokenizer', 'detokenizer'):\n"
        "    path = f'model_repository/{name}/1/model.py'\n"
        "    spec = importlib.util.spec_from_file_location(f'{name}_model', path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    module.TritonPythonModel().initialize({'model_config': config})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONLLM_")}
    env["TRITONLLM_MODEL"] = str(tiny_model_dir)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_tokenizer_and_detokenizer_stubs_run_without_torch(triton_server):
    pgid = triton_server.process.pid
    assert not _maps_torch(stub_pid(pgid, "tokenizer"))
    assert not _maps_torch(stub_pid(pgid, "detokenizer"))
    assert _maps_torch(stub_pid(pgid, "generator"))
