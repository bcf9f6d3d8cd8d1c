"""OpenAI request and response schemas (pydantic v2) for the endpoints the sidecar serves.

Requests follow the OpenAI API reference for ``/v1/chat/completions`` and ``/v1/completions``,
plus the vLLM-style extension fields (``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``min_tokens``, ``chat_template_kwargs``). Fields a model does not declare
are kept (``extra="allow"``) for ``extensions.check_extensions``, which refuses each by name
(vLLM's unless given their no-op value, OpenAI's unserved ones unless null, and any other).
Range checks live here so that invalid values become 400 errors before anything reaches Triton.

Boolean, integer and number fields are strict, field by field, as OpenAI's API is: a JSON value of
the wrong type is a 400, never coerced (``"stream": "yes"``, ``"max_tokens": true``, ``"n": 2.0``
are refused). Numbers (``Number``) still take JSON integers (``"temperature": 1`` reads as
1.0) but neither strings, booleans, NaN nor infinities. The models themselves stay lax: FastAPI validates nested
models and enums from Python dicts, which whole-model strict mode would refuse.

JSON ``null`` for an optional field is its default, as OpenAI's API reference marks these fields
nullable and OpenAI and vLLM read them (``"n": null`` is 1, ``"stream": null`` false):
``_NullIsDefault``. A required field (``messages``, ``prompt``) stays required.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tritonllm.contract import limits

from .structured import StructuredOutputFields
from .tools import ToolFields

# Every limit is the contract's (tritonllm.contract.limits), the one the engine checks too; the
# bounds of the ensemble's INT32 / INT64 inputs make larger values invalid requests, not crashes.
INT32_MAX = limits.INT32_MAX
# JSON `true` is no token id: bool (an int subclass) and strings are refused, as is 7.0.
TokenId = Annotated[StrictInt, Field(**limits.TOKEN_ID.field_bounds())]
# A JSON number (integers read as floats), finite: NaN and Infinity (which Python's JSON parser
# accepts) are a 400 saying so, not a range error.
Number = Annotated[float, Strict(), AllowInfNan(False)]
MAX_N = limits.MAX_N
MAX_TOP_LOGPROBS = limits.MAX_LOGPROBS


def _now() -> int:
    return int(time.time())


class _NullIsDefault(BaseModel):
    """A request model whose optional fields read JSON ``null`` as their default (OpenAI's
    nullable fields: ``"n": null`` is ``n`` 1). Fields whose default is None take null as
    themselves; this covers the others (``n``, ``stream``, ``echo``, ...), whose values are
    then never None. A required field given null is still a 400."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _keys_with_defaults(cls)
        if not any(data.get(key, 0) is None for key in defaulted):
            return data
        return {k: v for k, v in data.items() if not (k in defaulted and v is None)}


@functools.cache
def _keys_with_defaults(model: type[BaseModel]) -> frozenset[str]:
    """The JSON keys of ``model``'s optional fields whose default is not None."""
    return frozenset(
        field.alias or name
        for name, field in model.model_fields.items()
        if not field.is_required() and field.get_default(call_default_factory=True) is not None
    )


class _Lenient(_NullIsDefault):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_NullIsDefault):
    """``stream_options``: ``include_usage`` adds a usage-only chunk before ``[DONE]``.
    ``continuous_usage_stats`` (vLLM's) gives every chunk that carries a choice the usage of
    the stream so far (``sse.ChunkEncoder``). ``include_obfuscation`` (OpenAI's random padding
    of stream events, against network side channels) may be false or null: this server adds
    none; true is refused by ``sampling.sampling_inputs``. Any other key is a 400 naming it
    (``stream_options.<key>``): a typo is never silently ignored."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    include_obfuscation: StrictBool | None = None


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions requests."""

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, **limits.MAX_TOKENS.field_bounds())
    temperature: Number | None = Field(default=None, **limits.TEMPERATURE.field_bounds())
    # [0, 1] as OpenAI's; 0 keeps the most likely token alone (top_k 1: SamplingParams.top_p).
    top_p: Number | None = Field(default=None, **limits.TOP_P.field_bounds())
    n: StrictInt = Field(default=1, **limits.N.field_bounds())
    seed: StrictInt | None = Field(default=None, **limits.SEED.field_bounds())
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = Field(default=None, **limits.PENALTY.field_bounds())
    frequency_penalty: Number | None = Field(default=None, **limits.PENALTY.field_bounds())
    user: str | None = None
    # Token id (as a string of digits) → bias in [-100, 100] added to its logit before sampling
    # (at most limits.MAX_LOGIT_BIAS entries; ids >= vocab are the backend's 400).
    logit_bias: dict[str, Number] | None = None
    # vLLM-style extensions (sent by OpenAI clients through ``extra_body``).
    top_k: StrictInt | None = Field(default=None, **limits.TOP_K.field_bounds())
    min_p: Number | None = Field(default=None, **limits.MIN_P.field_bounds())
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[TokenId] | None = None
    repetition_penalty: Number | None = Field(
        default=None, **limits.REPETITION_PENALTY.field_bounds()
    )
    min_tokens: StrictInt | None = Field(default=None, **limits.MIN_TOKENS.field_bounds())
    # vLLM's prefix-cache namespace: prompts share cached KV pages only within one salt.
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=limits.MAX_CACHE_SALT_CHARS
    )

    @field_validator("stop")
    @classmethod
    def _stop_strings_in_bounds(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # The contract's bounds (the engine's own check), here so that an empty string is a
        # 400 rather than a stop condition nobody can meet; the count is the engine's check.
        stops = [stop] if isinstance(stop, str) else stop or []
        most = limits.MAX_STOP_STRING_CHARS
        if not all(0 < len(s) <= most for s in stops):
            raise PydanticCustomError(
                "invalid_value",
                "stop strings must have 1..{most} characters each",
                {"most": most},
            )
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_in_bounds(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # OpenAI's rules: keys are token ids written in decimal, values in [-100, 100], at most
        # MAX_LOGIT_BIAS entries (each a 400 naming logit_bias, code invalid_value).
        if not bias:
            return bias
        most = limits.MAX_LOGIT_BIAS
        if len(bias) > most:
            raise PydanticCustomError(
                "invalid_value",
                "logit_bias may hold at most {most} entries, got {count}",
                {"most": most, "count": len(bias)},
            )
        seen: set[int] = set()
        for key, value in bias.items():
            digits = key.isascii() and key.isdigit() and len(key) <= 10
            if not (digits and int(key) in limits.TOKEN_ID and int(key) not in seen):
                raise PydanticCustomError(
                    "invalid_value",
                    "logit_bias keys must be distinct token ids (non-negative integers as "
                    "strings), got '{key}'",
                    {"key": key[:40]},
                )
            if value not in limits.LOGIT_BIAS:
                raise PydanticCustomError(
                    "invalid_value",
                    "logit_bias[{key}] must be {allowed}, got {value}",
                    {"key": key, "allowed": limits.LOGIT_BIAS.describe(), "value": value},
                )
            seen.add(int(key))
        return bias

    @property
    def logit_bias_json(self) -> str | None:
        """``logit_bias`` as the backend's JSON object (keys in canonical decimal), or None
        when absent or empty (no bias)."""
        if not self.logit_bias:
            return None
        return json.dumps({str(int(k)): v for k, v in self.logit_bias.items()})

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage`` (False when ``stream_options`` is absent)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """``stream_options.continuous_usage_stats`` (False when ``stream_options`` is
        absent)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def wants_logprobs(self) -> bool:
        """Whether the response carries logprobs (set by the endpoint's own field)."""
        return False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings (each 1..``MAX_STOP_STRING_CHARS`` characters)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ContentPart(_Lenient):
    """One part of a message's ``content`` list; ``{"type": "text"}`` parts are served, and in
    an assistant message also ``{"type": "refusal"}`` ones (OpenAI's history of a refusal: its
    text is the message's text)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ChatMessage(_Lenient):
    """One chat message; ``content`` is a string or a list of content parts. Only an
    ``assistant`` message may leave it out or null (OpenAI's rule: there it may carry tool calls
    instead); any other role without content is a 400. A ``tool`` message must name the call it
    answers (``tool_call_id``), as OpenAI requires; the id itself is not used."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    tool_call_id: str | None = Field(default=None, validate_default=True)
    # An assistant's earlier calls ([{"id", "type", "function": {"name", "arguments"}}]) and a
    # tool result's function name: rendered by the chat template (tokenization/tools.py).
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: object, info: ValidationInfo) -> object:
        role = info.data.get("role")  # absent when the role itself failed validation
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a '{role}' message needs content (a string or content parts)")
        return content

    @field_validator("tool_call_id")
    @classmethod
    def _id_for_tool_messages(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if call_id is None and info.data.get("role") == "tool":
            raise ValueError("messages with role 'tool' must have a 'tool_call_id'")
        return call_id


# OpenAI's ``metadata``: at most 16 pairs, keys of at most 64 characters, values of at most 512.
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ChatCompletionRequest(SamplingFields, ToolFields, StructuredOutputFields):
    """The body of ``POST /v1/chat/completions``; ``max_completion_tokens`` (tokens) wins over
    ``max_tokens``. Tools: ``tools.ToolFields``; structured outputs and token masks:
    ``structured.StructuredOutputFields``.

    OpenAI's service options, declared so that each is served at the values this server
    honours and refused (``sampling.check_service_options``) at the others: ``store`` (false:
    nothing is stored), ``metadata`` (empty: it only annotates stored completions),
    ``service_tier`` (``auto`` / ``default``: the one tier), ``modalities`` (``["text"]``).
    ``safety_identifier`` and ``prompt_cache_key`` (OpenAI's successors of ``user``) are served
    at any value, as ``user`` is: nothing here monitors end users, and the radix prefix cache
    reuses every prompt's cached prefix (within its ``cache_salt``) without a key.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(
        default=None, **limits.MAX_TOKENS.field_bounds()
    )
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, **limits.LOGPROBS.field_bounds())
    chat_template_kwargs: dict[str, Any] | None = None
    store: StrictBool | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    service_tier: str | None = None
    modalities: list[str] | None = Field(default=None, min_length=1)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)


class CompletionRequest(SamplingFields, StructuredOutputFields):
    """The body of ``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists
    (at most ``limits.MAX_COMPLETION_PROMPTS`` prompts, none empty); each prompt gets ``n``
    choices, indexed prompt-major (``prompt_index * n + i``) as OpenAI does. ``max_tokens: 0``
    (with ``echo``: the prompt and its logprobs only) generates nothing. ``add_special_tokens``
    (vLLM's; absent: false, the text as is) encodes text prompts with the tokenizer's special
    tokens. Structured outputs and token masks: ``structured.StructuredOutputFields``.
    """

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(
        default=None, **limits.COMPLETION_MAX_TOKENS.field_bounds()
    )
    # OpenAI's legacy endpoint allows at most 5.
    logprobs: StrictInt | None = Field(default=None, ge=0, le=limits.MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = Field(default=None, ge=1)
    add_special_tokens: StrictBool | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_given(cls, prompt: object) -> object:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt is an empty list")
            if isinstance(prompt[0], list | str):
                if len(prompt) > limits.MAX_COMPLETION_PROMPTS:
                    raise ValueError(
                        f"at most {limits.MAX_COMPLETION_PROMPTS} prompts in one request"
                    )
                if any(isinstance(p, list) and not p for p in prompt):
                    raise ValueError("a token-id prompt is an empty list")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


# --- responses -----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request (tokens, not characters)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    """One token and its logprob: ``bytes`` are its UTF-8 bytes, ``token`` them decoded (a
    token holding part of a character shows U+FFFD)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A generated token with its logprob and its most likely alternatives, most likely first."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a legacy text completion, one element per generated token.

    Attributes:
        tokens: token texts (with ``echo``, the prompt's first).
        token_logprobs: their logprobs (null for an echoed prompt's first token).
        top_logprobs: per token ``{token text: logprob}`` of the top alternatives plus the
            chosen token (up to ``logprobs + 1`` entries, as OpenAI documents; null for an
            echoed prompt's first token).
        text_offset: character offset of each token in the choice's text (cumulative length
            of the token texts before it, as vLLM computes it).
    """

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(BaseModel):
    """A called function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The generated message of a non-streamed chat completion (``content`` null when it is
    only tool calls). A message without tool calls has no ``tool_calls`` key, as OpenAI's."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda calls: calls is None)


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class _Response(BaseModel):
    """The fields every completion, and every streamed chunk, opens with (in this order)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)  # Unix time, seconds
    model: str


class ChatCompletion(_Response):
    """A non-streamed chat completion."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A streamed message delta. On the wire unset fields are left out: the first chunk's delta
    is ``{"role": "assistant", "content": ""}``, then ``{"content": ...}``, the last ``{}``
    (``routes/chat.py`` writes them)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's streamed tool-call deltas


class ChatChunkChoice(BaseModel):
    """The choice a streamed chat chunk carries (``index`` says which)."""

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    """A streamed chat chunk (``usage`` only on the last chunk, with ``include_usage``)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    """One choice of a text completion, or the one of a streamed chunk."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Response):
    """A text completion; also the shape of each streamed chunk (``usage`` null until the end)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """The served model, as ``GET /v1/models`` lists it (vLLM's fields: ``root`` the model's
    name, ``max_model_len`` its context limit in tokens, prompt plus output; null while the
    backend is unreachable). ``created`` (Unix seconds) is when the sidecar started serving
    (``ServerState.created``), the same in every answer."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tritonllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``: the one served model."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
