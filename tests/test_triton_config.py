"""``tritonllm.triton_config``: config.pbtxt parameters and TRITONLLM_* variables → configs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tritonllm.config import EngineConfig
from tritonllm.triton_config import (
    DEFAULT_MODEL,
    engine_config,
    model_parameters,
    resolve_model_path,
    serving_config,
)
from tritonllm.triton_server import MODEL_REPOSITORY, REPO_ROOT


def test_model_parameters_parse_the_triton_config_json():
    config = {
        "parameters": {"model": {"string_value": "models/x"}, "page_size": {"string_value": "32"}}
    }
    assert model_parameters(json.dumps(config)) == {"model": "models/x", "page_size": "32"}
    assert model_parameters({}) == {}


def test_model_path_env_beats_parameter_beats_default(tmp_path):
    params = {"model": "some/dir"}
    assert resolve_model_path(params, {"TRITONLLM_MODEL": str(tmp_path)}) == tmp_path
    assert resolve_model_path(params, {}) == REPO_ROOT / "some/dir"  # relative to the project
    assert resolve_model_path({}, {}) == REPO_ROOT / DEFAULT_MODEL
    assert resolve_model_path({"model": " "}, {"TRITONLLM_MODEL": ""}) == REPO_ROOT / DEFAULT_MODEL


def test_engine_config_reads_every_field_from_env_or_parameters(tmp_path):
    env = {
        "TRITONLLM_MODEL": str(tmp_path),
        "TRITONLLM_DEVICE": "cpu",
        "TRITONLLM_PAGE_SIZE": "8",
        "TRITONLLM_ENABLE_PREFIX_CACHE": "false",
        "TRITONLLM_MAX_MODEL_LEN": "none",
        "TRITONLLM_GPU_MEMORY_UTILIZATION": "0.5",
    }
    params = {"page_size": "64", "num_pages": "100", "dtype": "float32"}
    config = engine_config(params, env)
    assert config == EngineConfig(
        model=str(tmp_path),
        device="cpu",
        page_size=8,
        num_pages=100,
        dtype="float32",
        enable_prefix_cache=False,
        max_model_len=None,
        gpu_memory_utilization=0.5,
    )


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="TRITONLLM_PAGE_SIZE"):
        engine_config({}, {"TRITONLLM_PAGE_SIZE": "eight", "TRITONLLM_DEVICE": "cpu"})
    with pytest.raises(ValueError, match="enable_prefix_cache"):
        engine_config({}, {"TRITONLLM_ENABLE_PREFIX_CACHE": "maybe"})
    with pytest.raises(ValueError, match="page_size"):
        engine_config({}, {"TRITONLLM_PAGE_SIZE": "0", "TRITONLLM_DEVICE": "cpu"})


def test_serving_config_interval():
    assert serving_config({}, {}).metrics_interval_s == 0.05
    assert serving_config({"max_responses_per_s": "10"}, {}).max_responses_per_s == 10.0
    assert serving_config({}, {"TRITONLLM_MAX_RESPONSES_PER_S": "0"}).max_responses_per_s == 0.0
    default = serving_config({}, {})
    assert default.max_responses_per_s == 5000.0
    assert default.sender_threads is None
    assert (default.senders(own_process=True), default.senders(own_process=False)) == (4, 1)
    two = serving_config({}, {"TRITONLLM_SENDER_THREADS": "2"})
    assert (two.senders(own_process=True), two.senders(own_process=False)) == (2, 2)
    with pytest.raises(ValueError, match="sender_threads"):
        serving_config({"sender_threads": "0"}, {})
    assert serving_config({}, {"TRITONLLM_METRICS_INTERVAL_MS": "20"}).metrics_interval_s == 0.02


def test_engine_process_defaults_to_a_process_on_cuda_only():
    default = serving_config({}, {})
    assert default.engine_process is None
    assert default.use_engine_process("cuda") and default.use_engine_process("cuda:1")
    assert not default.use_engine_process("cpu")  # the CPU default stays the engine thread
    forced = serving_config({"engine_process": "false"}, {"TRITONLLM_ENGINE_PROCESS": "1"})
    assert forced.engine_process is True and forced.use_engine_process("cpu")
    off = serving_config({"engine_process": "off"}, {"TRITONLLM_ENGINE_PROCESS": ""})
    assert not off.use_engine_process("cuda")
    assert serving_config({}, {"TRITONLLM_ENGINE_PROCESS": "none"}).engine_process is None
    with pytest.raises(ValueError, match="TRITONLLM_ENGINE_PROCESS"):
        serving_config({}, {"TRITONLLM_ENGINE_PROCESS": "sometimes"})


def test_tensor_parallel_size_is_parsed_and_always_runs_the_engine_in_processes():
    """``TRITONLLM_TENSOR_PARALLEL_SIZE`` over the parameter; more than one rank always runs in
    processes, and an explicit ``engine_process=false`` with it is refused with both names."""
    from tritonllm.config import EngineConfig

    assert engine_config({}, {}).tensor_parallel_size == 1
    params = {"tensor_parallel_size": "3"}
    assert engine_config(params, {}).tensor_parallel_size == 3
    assert engine_config(params, {"TRITONLLM_TENSOR_PARALLEL_SIZE": "2"}).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model="m", tensor_parallel_size=0)
    default = serving_config({}, {})
    assert default.use_engine_process("cpu", 2) and default.use_engine_process("cuda", 2)
    assert not default.use_engine_process("cpu", 1)
    off = serving_config({"engine_process": "false"}, {})
    with pytest.raises(ValueError, match="engine_process=false cannot run tensor_parallel_size=2"):
        off.use_engine_process("cuda", 2)


def test_several_generator_instances_share_an_engine_process():
    """The instance count is read from Triton's model config (the sum of its instance groups);
    more than one instance always runs the engine in a process (they share it), and an
    explicit ``engine_process=false`` with it is refused with both names."""
    from tritonllm.triton_config import instance_count

    assert instance_count('{"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}') == 2
    assert instance_count({"instance_group": [{"count": 2}, {"count": 1}]}) == 3
    assert instance_count({"instance_group": [{"kind": "KIND_CPU"}]}) == 1
    assert instance_count("{}") == 1
    assert serving_config({}, {}).use_engine_process("cpu", 1, 2)
    off = serving_config({"engine_process": "false"}, {})
    with pytest.raises(ValueError, match="engine_process=false cannot serve 2 generator instances"):
        off.use_engine_process("cpu", 1, 2)


def test_every_engine_field_is_documented():
    from dataclasses import fields

    import tritonllm.triton_config as module

    for field in fields(EngineConfig):
        assert f"TRITONLLM_{field.name.upper()}" in module.__doc__, field.name
    for name in ("METRICS_INTERVAL_MS", "MAX_RESPONSES_PER_S", "ENGINE_PROCESS", "SENDER_THREADS"):
        assert f"TRITONLLM_{name}" in module.__doc__, name


def test_repository_parameters_name_the_default_model():
    for model in ("tokenizer", "generator", "detokenizer"):
        text = Path(MODEL_REPOSITORY, model, "config.pbtxt").read_text()
        value = re.search(r'key: "model" value: \{ string_value: "([^"]*)" \}', text).group(1)
        assert value == DEFAULT_MODEL


def test_kernel_and_diagnostic_settings_are_engine_config_fields(tmp_path):
    """The settings that were read from the environment elsewhere (layer kernels, the GEMM
    choice, PDL, FlashInfer's tensor-core threshold, the engine-process profile) are
    ``EngineConfig`` fields, parsed here like every other one."""
    env = {
        "TRITONLLM_DEVICE": "cpu",
        "TRITONLLM_FUSED_LAYERS": "0",
        "TRITONLLM_LINEAR_KERNEL": "auto",
        "TRITONLLM_PDL": "off",
        "TRITONLLM_TENSOR_CORE_DECODE_MIN_BATCH": "16",
        "TRITONLLM_ENGINE_PROFILE": str(tmp_path / "engine.prof"),
    }
    config = engine_config({"model": str(tmp_path)}, env)
    assert (config.fused_layers, config.linear_kernel, config.pdl) == (False, "auto", False)
    assert config.tensor_core_decode_min_batch == 16
    assert config.engine_profile == str(tmp_path / "engine.prof")
    default = engine_config({"model": str(tmp_path)}, {"TRITONLLM_DEVICE": "cpu"})
    assert (default.fused_layers, default.linear_kernel, default.pdl) == (True, "cublas", True)
    assert default.tensor_core_decode_min_batch == 64 and default.engine_profile is None
    with pytest.raises(ValueError, match="linear_kernel"):
        engine_config({"linear_kernel": "fast"}, {"TRITONLLM_DEVICE": "cpu"})
    with pytest.raises(ValueError, match="tensor_core_decode_min_batch"):
        engine_config({"tensor_core_decode_min_batch": "-1"}, {"TRITONLLM_DEVICE": "cpu"})


def test_grammar_threads_is_a_setting_derived_from_the_cores(tmp_path, monkeypatch):
    """``TRITONLLM_GRAMMAR_THREADS`` sets the mask-fill threads; unset, 80% of the cores this
    process may use (llguidance's own default), from 1 to ``MAX_GRAMMAR_THREADS``."""
    import os

    from tritonllm.config import MAX_GRAMMAR_THREADS

    env = {"TRITONLLM_DEVICE": "cpu", "TRITONLLM_GRAMMAR_THREADS": "3"}
    assert engine_config({"model": str(tmp_path)}, env).resolved_grammar_threads == 3
    default = engine_config({"model": str(tmp_path)}, {"TRITONLLM_DEVICE": "cpu"})
    for cores, threads in ((1, 1), (2, 1), (6, 4), (16, 12), (64, MAX_GRAMMAR_THREADS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert default.resolved_grammar_threads == threads, cores
    with pytest.raises(ValueError, match="grammar_threads"):
        engine_config({"grammar_threads": "0"}, {"TRITONLLM_DEVICE": "cpu"})


def test_engine_modules_read_no_environment():
    """Engine settings reach the engine as ``EngineConfig`` fields (parsed here, in one place),
    never through environment lookups in the engine's own modules, hot paths included."""
    root = Path(__file__).resolve().parent.parent
    allowed = {
        # Triton's own switch between compiling and interpreting, set before kernels import.
        root / "kernels" / "__init__.py",
        root / "kernels" / "compile_check.py",
        # Writes NCCL's multicast switches for the ranks (disable_multicast); reads nothing.
        root / "tritonllm" / "distributed" / "group.py",
    }
    readers = re.compile(r"os\.environ|os\.getenv|getenv\(")
    offenders = []
    for folder in (
        "tritonllm/engine",
        "tritonllm/attention",
        "tritonllm/layers",
        "tritonllm/models",
        "tritonllm/distributed",
        "kernels",
    ):
        for path in sorted((root / folder).rglob("*.py")):
            if path not in allowed and readers.search(path.read_text()):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
