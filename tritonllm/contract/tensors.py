"""Every Triton model's inputs and outputs: names, datatypes, shapes, optional flags.

``tests/test_contract.py`` parses each ``model_repository/*/config.pbtxt`` and fails when it
disagrees with the ``ModelSpec`` here, so the configs, the adapters, the sidecar and the docs
share one declaration. Datatypes are Triton's wire names (``INT32``, ``FP32``, ``BOOL``,
``BYTES``...; a config writes ``TYPE_`` before them and ``TYPE_STRING`` for ``BYTES``). Dims
exclude the batch dimension of a model with ``max_batch_size > 0``.

Entry points (ARCHITECTURE.md, "Triton models"):

- ``llm``: the ensemble ``tokenizer`` -> ``generator`` -> ``detokenizer``; rank-1 inputs. It
  speaks this project's names and the Triton vLLM backend's (``sampling_parameters``,
  ``exclude_input_in_output``, request parameters).
- ``ensemble``: TensorRT-LLM's entry name and convention (``[1, 1]`` tensors: a batch dimension
  of 1), a BLS model that translates each request into one ``llm`` request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model.

    Attributes:
        name: the tensor name.
        dtype: Triton's wire datatype (``"INT32"``, ``"BYTES"``, ...).
        dims: the config's dims (-1: any length), without the batch dimension.
        optional: an input the request may leave out. For outputs: sent only in some responses
            (the config cannot say so; documentation only).
        ragged: ``allow_ragged_batch`` (inputs of batching models only).
    """

    name: str
    dtype: str
    dims: tuple[int, ...] = (1,)
    optional: bool = False
    ragged: bool = False

    @property
    def config_dtype(self) -> str:
        """The ``data_type`` a config.pbtxt writes (``TYPE_STRING`` for ``BYTES``)."""
        return "TYPE_STRING" if self.dtype == "BYTES" else f"TYPE_{self.dtype}"


@dataclass(frozen=True)
class ModelSpec:
    """A Triton model's interface: its inputs and outputs, batching and transaction policy."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int = 0
    decoupled: bool = False

    def input(self, name: str) -> TensorSpec:
        """The input called ``name``. Raises: KeyError when there is none."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(f"model {self.name!r} has no input {name!r}")

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,)) -> TensorSpec:
    return TensorSpec(name, dtype, dims, optional=True)


# --- shared inputs ---------------------------------------------------------------------------
TEXT_INPUT = _opt("text_input", "BYTES")  # a raw prompt, no chat template
MESSAGES = _opt("messages", "BYTES")  # JSON list of {"role", "content"}
ENABLE_THINKING = _opt("enable_thinking", "BOOL")
# Tool calling: the OpenAI `tools` list as JSON, rendered by the chat template (messages only).
TOOLS = _opt("tools", "BYTES")
# false: each choice's first response starts with the prompt (absent: true, never echoed).
EXCLUDE_INPUT_IN_OUTPUT = _opt("exclude_input_in_output", "BOOL")
# The vLLM backend's JSON object of sampling parameters (values may be strings such as "0.1").
SAMPLING_PARAMETERS = _opt("sampling_parameters", "BYTES")
STREAM = _opt("stream", "BOOL")  # false: exactly one response (absent: true)

# The sampling inputs, one per `SamplingParams` field of the same name.
MAX_TOKENS = _opt("max_tokens", "INT32")  # absent: until EOS, a stop or the context limit
SAMPLING_INPUTS: tuple[TensorSpec, ...] = (
    MAX_TOKENS,
    _opt("temperature", "FP32"),
    _opt("top_p", "FP32"),
    _opt("top_k", "INT32"),
    _opt("min_p", "FP32"),
    _opt("seed", "INT64"),
    _opt("stop_token_ids", "INT32", (-1,)),
    _opt("stop", "BYTES", (-1,)),
    _opt("ignore_eos", "BOOL"),
    _opt("min_tokens", "INT32"),
    _opt("presence_penalty", "FP32"),
    _opt("frequency_penalty", "FP32"),
    _opt("repetition_penalty", "FP32"),
    _opt("logprobs", "INT32"),  # top alternatives per token; absent: no logprobs
    _opt("n", "INT32"),  # choices; > 1 needs stream=true
    # Structured outputs: vLLM's StructuredOutputsParams as a JSON object, exactly one of
    # {"json": schema}, {"json_object": true}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}
    # (tritonllm.structured.spec).
    _opt("structured_outputs", "BYTES"),
    _opt("allowed_token_ids", "INT32", (-1,)),  # only these ids may be sampled
    _opt("bad_words", "BYTES", (-1,)),  # words never generated (vLLM / TensorRT-LLM semantics)
)

# --- tokenizer -------------------------------------------------------------------------------
INPUT_IDS = TensorSpec("input_ids", "INT32", (-1,))
ECHO_TEXT = _opt("echo_text", "BYTES")  # the prompt text, with exclude_input_in_output=false
TOKENIZER = ModelSpec(
    "tokenizer",
    inputs=(TEXT_INPUT, MESSAGES, ENABLE_THINKING, EXCLUDE_INPUT_IN_OUTPUT, TOOLS),
    outputs=(INPUT_IDS, ECHO_TEXT),
)

# --- generator -------------------------------------------------------------------------------
# Control requests carry one of these instead of input_ids.
ABORT_REQUEST_ID = _opt("abort_request_id", "BYTES")  # abort that request id
HEALTH_PROBE = _opt("health_probe", "BOOL")  # only reports whether the engine runs
GENERATOR_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("output_ids", "INT32", (-1,)),
    TensorSpec("prefix_ids", "INT32", (-1,)),
    TensorSpec("finish_reason", "BYTES"),
    TensorSpec("num_input_tokens", "INT32"),
    TensorSpec("num_output_tokens", "INT32"),
    TensorSpec("cached_tokens", "INT32"),
    TensorSpec("trim_chars", "INT32"),
    _opt("index", "INT32"),  # only when n > 1
    _opt("output_logprobs", "FP32", (-1,)),  # only with logprobs, this and the next two
    _opt("top_logprob_ids", "INT32", (-1,)),
    _opt("top_logprobs", "FP32", (-1,)),
    ECHO_TEXT,  # only in a choice's first response, when the request carried echo_text
    # The generator's key of the request, only when it differs from the request id (an empty or
    # reused id): the detokenizer's abort of a cancelled request names it.
    _opt("request_key", "BYTES"),
)
GENERATOR = ModelSpec(
    "generator",
    inputs=(
        _opt("input_ids", "INT32", (-1,)),  # required except in a control request
        *SAMPLING_INPUTS,
        STREAM,
        SAMPLING_PARAMETERS,
        ECHO_TEXT,
        ABORT_REQUEST_ID,
        HEALTH_PROBE,
    ),
    outputs=GENERATOR_OUTPUTS,
    decoupled=True,
)

# --- detokenizer -----------------------------------------------------------------------------
LLM_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES"),
    TensorSpec("finish_reason", "BYTES"),
    TensorSpec("num_input_tokens", "INT32"),
    TensorSpec("num_output_tokens", "INT32"),
    TensorSpec("cached_tokens", "INT32"),
    TensorSpec("index", "INT32"),
    _opt("output_logprobs", "FP32", (-1,)),
    _opt("top_logprob_ids", "INT32", (-1,)),
    _opt("top_logprobs", "FP32", (-1,)),
    TensorSpec("logprobs_json", "BYTES"),  # "" without logprobs
)
DETOKENIZER = ModelSpec(
    "detokenizer",
    inputs=tuple(
        TensorSpec(s.name, s.dtype, s.dims, optional=s.optional) for s in GENERATOR_OUTPUTS
    ),
    outputs=LLM_OUTPUTS,
)

# --- the llm ensemble ------------------------------------------------------------------------
LLM = ModelSpec(
    "llm",
    inputs=(
        TEXT_INPUT,
        MESSAGES,
        ENABLE_THINKING,
        EXCLUDE_INPUT_IN_OUTPUT,
        TOOLS,
        *SAMPLING_INPUTS,
        STREAM,
        SAMPLING_PARAMETERS,
    ),
    outputs=LLM_OUTPUTS,
)

# --- the TensorRT-LLM convention entry ------------------------------------------------------
# TensorRT-LLM's `ensemble` inputs that `ensemble` accepts (dims after the batch dimension).
TRTLLM_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "BYTES"),
    _opt("max_tokens", "INT32"),
    _opt("stream", "BOOL"),
    _opt("temperature", "FP32"),
    _opt("top_k", "INT32"),
    _opt("top_p", "FP32"),
    _opt("beam_width", "INT32"),  # only 1
    _opt("num_return_sequences", "INT32"),  # -> n
    _opt("random_seed", "UINT64"),  # -> seed (older TensorRT-LLM name)
    _opt("seed", "UINT64"),
    _opt("repetition_penalty", "FP32"),
    _opt("presence_penalty", "FP32"),
    _opt("frequency_penalty", "FP32"),
    _opt("length_penalty", "FP32"),  # beam search only: 1.0 (no-op) accepted
    _opt("min_length", "INT32"),  # -> min_tokens (older name)
    _opt("min_tokens", "INT32"),
    _opt("stop_words", "BYTES", (-1,)),  # -> stop
    _opt("bad_words", "BYTES", (-1,)),  # -> bad_words
    _opt("end_id", "INT32"),  # generation ends at this id instead of the model's EOS
    _opt("pad_id", "INT32"),  # accepted: no output is padded
    EXCLUDE_INPUT_IN_OUTPUT,
    _opt("return_log_probs", "BOOL"),
    _opt("return_context_logits", "BOOL"),  # false only
    _opt("return_generation_logits", "BOOL"),  # false only
    _opt("return_perf_metrics", "BOOL"),  # false only
    _opt("return_num_input_tokens", "BOOL"),  # the counts are always sent
    _opt("return_num_output_tokens", "BOOL"),
)
TRTLLM_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES"),
    TensorSpec("num_input_tokens", "INT32"),
    TensorSpec("num_output_tokens", "INT32"),
    TensorSpec("sequence_index", "INT32"),  # the choice (num_return_sequences > 1)
    TensorSpec("batch_index", "INT32"),  # always 0 (batch size 1)
    _opt("cum_log_probs", "FP32", (-1,)),  # with return_log_probs: [beam = 1]
    _opt("output_log_probs", "FP32", (-1, -1)),  # [beam = 1, this response's tokens]
)
TRTLLM_ENSEMBLE = ModelSpec(
    "ensemble", inputs=TRTLLM_INPUTS, outputs=TRTLLM_OUTPUTS, max_batch_size=1, decoupled=True
)

MODELS: tuple[ModelSpec, ...] = (TOKENIZER, GENERATOR, DETOKENIZER, LLM, TRTLLM_ENSEMBLE)
