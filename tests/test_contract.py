"""The one contract (``tritonllm.contract``) holds every config.pbtxt, the sidecar's limits and
the engine's, and imports without torch.

Oracle: Triton's own ``ModelConfig`` protobuf (tritonclient ships it) parses each
``model_repository/*/config.pbtxt`` as tritonserver does; the parsed inputs, outputs, batching
and transaction policy must equal the contract's ``ModelSpec``, and every ensemble step may only
map tensors its model declares.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from tritonllm.contract import limits, tensors
from tritonllm.triton_server import MODEL_REPOSITORY, REPO_ROOT

DataType = model_config_pb2.DataType


def _config(name: str) -> model_config_pb2.ModelConfig:
    text = (MODEL_REPOSITORY / name / "config.pbtxt").read_text()
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _tensor(t, is_input: bool) -> tuple:
    row = (t.name, DataType.Name(t.data_type), tuple(t.dims))
    return row + ((t.optional, t.allow_ragged_batch) if is_input else ())


def _spec(s: tensors.TensorSpec, is_input: bool) -> tuple:
    row = (s.name, s.config_dtype, s.dims)
    return row + ((s.optional, s.ragged) if is_input else ())


def test_every_model_in_the_repository_has_a_contract():
    on_disk = {p.parent.name for p in MODEL_REPOSITORY.glob("*/config.pbtxt")}
    assert on_disk == {spec.name for spec in tensors.MODELS}


@pytest.mark.parametrize("spec", tensors.MODELS, ids=lambda s: s.name)
def test_config_pbtxt_equals_the_contract(spec):
    config = _config(spec.name)
    assert config.name == spec.name
    assert [_tensor(t, True) for t in config.input] == [_spec(s, True) for s in spec.inputs]
    assert [_tensor(t, False) for t in config.output] == [_spec(s, False) for s in spec.outputs]
    assert config.max_batch_size == spec.max_batch_size
    assert config.model_transaction_policy.decoupled == spec.decoupled


@pytest.mark.parametrize("ensemble", ["llm", "llm_fused"])
def test_llm_ensemble_steps_map_only_declared_tensors(ensemble):
    """Every step's input_map keys are inputs of its model and its output_map keys outputs;
    every ensemble input reaches a step, every ensemble output comes from one, and every
    internal tensor a step reads is one an earlier step writes."""
    config = _config(ensemble)
    by_name = {spec.name: spec for spec in tensors.MODELS}
    written, read = set(config.input[i].name for i in range(len(config.input))), set()
    produced_outputs = set()
    for step in config.ensemble_scheduling.step:
        model = by_name[step.model_name]
        assert set(step.input_map) <= set(model.input_names), step.model_name
        assert set(step.output_map) <= set(model.output_names), step.model_name
        for tensor in step.input_map.values():
            assert tensor in written, f"{step.model_name} reads {tensor} before it is written"
            read.add(tensor)
        written |= set(step.output_map.values())
        produced_outputs |= set(step.output_map.values())
    assert {t.name for t in config.input} <= read
    assert {t.name for t in config.output} <= produced_outputs
    # The generator gets every sampling input the ensemble takes, under the same name.
    (generator_step,) = [s for s in config.ensemble_scheduling.step if s.model_name == "generator"]
    for spec in tensors.SAMPLING_INPUTS:
        assert generator_step.input_map[spec.name] == spec.name


def test_the_platform_ceiling_batches_its_post_step_as_the_detokenizer():
    """benchmarks/ceiling measures Triton's cost of an llm-shaped ensemble: its stand-in for the
    detokenizer must batch (or not) the same way."""
    post = text_format.Parse(
        (REPO_ROOT / "benchmarks/ceiling_repository/ceiling_post/config.pbtxt").read_text(),
        model_config_pb2.ModelConfig(),
    )
    detokenizer = _config("detokenizer")
    assert post.max_batch_size == detokenizer.max_batch_size
    assert post.HasField("dynamic_batching") == detokenizer.HasField("dynamic_batching")


def test_sidecar_and_engine_share_the_limits():
    """The sidecar's schemas are built from the contract's ranges: one value each, not two."""
    from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest

    fields = ChatCompletionRequest.model_fields

    def bounds(field) -> dict:
        found = {}
        for item in field.metadata:
            for name in ("ge", "gt", "le", "lt"):
                if getattr(item, name, None) is not None:
                    found[name] = getattr(item, name)
        return found

    assert bounds(fields["temperature"]) == limits.TEMPERATURE.field_bounds() == {"ge": 0, "le": 2}
    assert bounds(fields["top_p"]) == limits.TOP_P.field_bounds()
    assert bounds(fields["n"]) == limits.N.field_bounds()
    assert bounds(fields["top_logprobs"]) == limits.LOGPROBS.field_bounds()
    assert bounds(fields["presence_penalty"]) == limits.PENALTY.field_bounds()
    assert bounds(fields["repetition_penalty"]) == limits.REPETITION_PENALTY.field_bounds()
    assert bounds(CompletionRequest.model_fields["logprobs"])["le"] == (
        limits.MAX_COMPLETION_LOGPROBS
    )


def test_engine_validation_uses_the_contract_ranges():
    from tritonllm.sampling_params import SamplingParams

    high = limits.TEMPERATURE.high
    assert SamplingParams(temperature=high).temperature == high
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        SamplingParams(temperature=high + 0.01)
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=limits.MAX_N + 1)
    with pytest.raises(ValueError, match="stop must be at most 16"):
        SamplingParams(stop=["x"] * (limits.MAX_STOP_STRINGS + 1))


def test_contract_imports_without_torch():
    """The sidecar's side of the contract needs no torch: torch made unimportable, the contract
    (and the sidecar's schemas built on it) still import."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        "import tritonllm.contract\n"
        "from tritonllm.contract import errors, limits, tensors\n"
        "import openai_frontend.protocol, openai_frontend.errors\n"
        "assert 'torch' not in {m for m, v in sys.modules.items() if v is not None}\n"
        "print(len(tensors.MODELS), errors.ErrorCode.INVALID_VALUE.value)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(len(tensors.MODELS)), "invalid_value"]


def test_contract_package_has_no_heavy_imports():
    """Only the standard library: what it imports is readable in one screen."""
    for path in Path(tensors.__file__).parent.glob("*.py"):
        for line in path.read_text().splitlines():
            if line.startswith(("import ", "from ")):
                module = line.split()[1]
                assert module.split(".")[0] in {
                    "__future__",
                    "dataclasses",
                    "enum",
                    "json",
                    "math",
                    "typing",
                    "tritonllm",
                }, f"{path.name}: {line}"
