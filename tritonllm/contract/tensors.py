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
# A prompt given as token ids (the third way): the tokenizer passes them through.
PROMPT_INPUT_IDS = _opt("input_ids", "INT32", (-1,))
# true: the tokenizer adds the tokenizer's special tokens (a BOS) to text_input (absent: false).
ADD_SPECIAL_TOKENS = _opt("add_special_tokens", "BOOL")
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
    # The prefix-cache namespace (vLLM's cache_salt): pages are shared only within one salt.
    _opt("cache_salt", "BYTES"),
    # Also score the prompt: each prompt token's logprob plus this many top alternatives.
    _opt("prompt_logprobs", "INT32"),
    # Structured outputs: vLLM's StructuredOutputsParams as a JSON object, exactly one of
    # {"json": schema}, {"json_object": true}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}
    # (tritonllm.structured.spec).
    _opt("structured_outputs", "BYTES"),
    _opt("allowed_token_ids", "INT32", (-1,)),  # only these ids may be sampled
    _opt("bad_words", "BYTES", (-1,)),  # words never generated (vLLM / TensorRT-LLM semantics)
    # OpenAI's logit_bias as its JSON object, {"<token id>": bias in [-100, 100]} (at most
    # limits.MAX_LOGIT_BIAS entries): each bias is added to its token's logit before sampling.
    _opt("logit_bias", "BYTES"),
)

# --- tokenizer -------------------------------------------------------------------------------
INPUT_IDS = TensorSpec("input_ids", "INT32", (-1,))
ECHO_TEXT = _opt("echo_text", "BYTES")  # the prompt text, with exclude_input_in_output=false
# A limits request (no prompt): the answer's `limits_json` holds the prompt limits
# (`tokenization.prompt_limits.PromptLimits`: max_model_len, max_token_chars, max_prompt_chars)
# and `input_ids` is empty. The sidecar checks prompts against them before sending them.
PROMPT_LIMITS = _opt("prompt_limits", "BOOL")
LIMITS_JSON = _opt("limits_json", "BYTES")
TOKENIZER = ModelSpec(
    "tokenizer",
    inputs=(
        TEXT_INPUT,
        MESSAGES,
        PROMPT_INPUT_IDS,
        ENABLE_THINKING,
        EXCLUDE_INPUT_IN_OUTPUT,
        ADD_SPECIAL_TOKENS,
        PROMPT_LIMITS,
        TOOLS,
    ),
    outputs=(INPUT_IDS, ECHO_TEXT, LIMITS_JSON),
)

# --- generator -------------------------------------------------------------------------------
# Control requests carry one of these instead of input_ids.
ABORT_REQUEST_ID = _opt("abort_request_id", "BYTES")  # abort that request id
HEALTH_PROBE = _opt("health_probe", "BOOL")  # only reports whether the engine runs
# The request id prefix of the sidecar's probe generations (``openai_frontend.health``): synthetic
# traffic, which the generator leaves out of its latency histograms.
HEALTH_PROBE_ID_PREFIX = "health-"
# A lease: the request stays open, unanswered, until its client renews it (or 1 s without
# renewal); once its client cancels it (or dies: its gRPC stream closes), or leaves it unrenewed
# for 30 s, every live request whose id starts with "<lease>/" is aborted. The sidecar holds one,
# because through llm_fused no step after the generator sees a cancelled stream (GeneratorCore,
# "leases"). Needs control_secret as an abort does.
CLIENT_LEASE = _opt("client_lease", "BYTES")
# An abort must carry the service's control secret (TRITONLLM_CONTROL_SECRET) when one is set.
CONTROL_SECRET = _opt("control_secret", "BYTES")
GENERATOR_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("output_ids", "INT32", (-1,)),
    TensorSpec("prefix_ids", "INT32", (-1,)),
    TensorSpec("finish_reason", "BYTES"),
    # Only in a choice's first and final responses (each tensor costs time on the response
    # path): the prompt's counts do not change.
    _opt("num_input_tokens", "INT32"),
    TensorSpec("num_output_tokens", "INT32"),
    _opt("cached_tokens", "INT32"),
    _opt("trim_chars", "INT32"),  # only when not 0 (a matched stop string, in a final response)
    _opt("index", "INT32"),  # only when n > 1
    _opt("output_logprobs", "FP32", (-1,)),  # only with logprobs, this and the next two
    _opt("top_logprob_ids", "INT32", (-1,)),
    _opt("top_logprobs", "FP32", (-1,)),
    ECHO_TEXT,  # only in a choice's first response, when the request carried echo_text
    # The generator's key of the request, only when it differs from the request id (an empty or
    # reused id): the detokenizer's abort of a cancelled request names it.
    _opt("request_key", "BYTES"),
    # Only in a choice's first response of a request with prompt_logprobs = k: the prompt's P
    # ids, the logprobs of ids 1..P-1 ([P - 1]) and their top k ([(P - 1) * k], row-major).
    _opt("prompt_ids", "INT32", (-1,)),
    _opt("prompt_token_logprobs", "FP32", (-1,)),
    _opt("prompt_top_logprob_ids", "INT32", (-1,)),
    _opt("prompt_top_logprobs", "FP32", (-1,)),
)
# Only in the answer to a health probe: the engine's context limit (prompt + output tokens),
# and the steps the (shared) engine ran so far: a sidecar whose probe generation waits behind a
# full engine tells a busy engine from a stuck one by it (openai_frontend.health).
MAX_MODEL_LEN = _opt("max_model_len", "INT32")
ENGINE_STEPS = _opt("engine_steps", "INT64")
# Only in answers to a request that asks for text_output and not output_ids (the llm_fused
# ensemble): the generator then answers the detokenizer's text outputs itself
# (tritonllm.serving.text_outputs), together with finish_reason, the counts, index and the
# logprobs above, and without the ids.
GENERATOR_TEXT_OUTPUTS: tuple[TensorSpec, ...] = (
    _opt("text_output", "BYTES"),
    _opt("logprobs_json", "BYTES"),  # only with logprobs
    _opt("prompt_logprobs_json", "BYTES"),  # only with prompt logprobs
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
        CLIENT_LEASE,
        CONTROL_SECRET,
    ),
    outputs=(*GENERATOR_OUTPUTS, MAX_MODEL_LEN, ENGINE_STEPS, *GENERATOR_TEXT_OUTPUTS),
    decoupled=True,
)

# --- detokenizer -----------------------------------------------------------------------------
LLM_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "BYTES"),
    TensorSpec("finish_reason", "BYTES"),
    _opt("num_input_tokens", "INT32"),  # in a choice's first and final responses only
    TensorSpec("num_output_tokens", "INT32"),
    _opt("cached_tokens", "INT32"),  # in a choice's first and final responses only
    TensorSpec("index", "INT32"),
    _opt("output_logprobs", "FP32", (-1,)),
    _opt("top_logprob_ids", "INT32", (-1,)),
    _opt("top_logprobs", "FP32", (-1,)),
    TensorSpec("logprobs_json", "BYTES"),  # "" without logprobs
    # Only with prompt logprobs (a choice's first response): one OpenAI chat logprobs entry per
    # prompt token, the first with logprob null.
    _opt("prompt_logprobs_json", "BYTES"),
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
        PROMPT_INPUT_IDS,
        ENABLE_THINKING,
        EXCLUDE_INPUT_IN_OUTPUT,
        ADD_SPECIAL_TOKENS,
        TOOLS,
        *SAMPLING_INPUTS,
        STREAM,
        SAMPLING_PARAMETERS,
    ),
    outputs=LLM_OUTPUTS,
)

# The same service with the text made by the generator itself (tokenizer -> generator, no
# detokenizer step: one Python step fewer per streamed response); the OpenAI sidecar's default.
# Its outputs are llm's, except that a response leaves out index when it is 0 (n = 1) and
# logprobs_json when it is "" (no logprobs): absent reads as those values.
LLM_FUSED = ModelSpec(
    "llm_fused",
    inputs=LLM.inputs,
    outputs=tuple(
        _opt(s.name, s.dtype, s.dims) if s.name in ("index", "logprobs_json") else s
        for s in LLM_OUTPUTS
    ),
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

MODELS: tuple[ModelSpec, ...] = (
    TOKENIZER,
    GENERATOR,
    DETOKENIZER,
    LLM,
    LLM_FUSED,
    TRTLLM_ENSEMBLE,
)
