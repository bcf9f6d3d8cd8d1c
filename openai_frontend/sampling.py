"""OpenAI request fields → ``llm`` ensemble inputs.

Only fields the client gave are sent; the backend's documented defaults apply to the rest. A field
the served ensemble has no input for is rejected with a 400 ("not supported") unless its value is
the no-op one (``presence_penalty=0``, ``repetition_penalty=1``, ...). Which inputs exist is read
from Triton's model metadata, so a backend that grows an input is used without changes here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tritonllm.contract import limits

from .errors import OpenAIError, unsupported, unsupported_value
from .extensions import check_extensions
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from .structured import constraint_inputs
from .triton_client import InputSpec, InputValue

# Request field → the value at which it changes nothing (None: never a no-op once given).
_OPTIONAL_FIELDS: dict[str, Any] = {
    "temperature": None,
    "top_p": None,
    "seed": None,
    "top_k": None,
    "min_p": None,
    "stop_token_ids": [],
    "ignore_eos": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
}


def _put(inputs: dict, specs: Mapping[str, InputSpec], name: str, value: Any, noop: Any) -> None:
    if value is None or (isinstance(value, list) and not value):
        return
    if name in specs:
        inputs[name] = value
    elif noop is None or value != noop:
        raise unsupported(name)


def sampling_inputs(
    req: SamplingFields,
    specs: Mapping[str, InputSpec],
    max_tokens: int | None,
    backend_stream: bool,
) -> dict[str, InputValue]:
    """The sampling inputs of ``req`` for an ensemble with inputs ``specs``.

    Args:
        max_tokens: the resolved token limit (chat: ``max_completion_tokens`` or ``max_tokens``;
            None: until EOS, a stop or the context limit).
        backend_stream: whether the ensemble should answer token by token (else one response).
    Raises:
        OpenAIError: 400 for a field the backend cannot honour (e.g. ``n > 1`` on a backend
            without an ``n`` input, a vLLM or OpenAI field this server does not implement:
            ``extensions.py``, ``stream_options.include_obfuscation`` true), or
            ``stream_options`` without ``stream`` (as OpenAI answers).
    """
    check_extensions(req)
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(
            "stream_options is only allowed when stream is true",
            param="stream_options",
            code="invalid_value",
        )
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise unsupported_value(
            "stream_options.include_obfuscation",
            True,
            "its stream events carry no obfuscation padding (give false or leave it out)",
        )
    inputs: dict[str, InputValue] = {}
    # An empty object is no bias; a backend without the input refuses a non-empty one.
    _put(inputs, specs, "logit_bias", req.logit_bias_json, None)
    _put(inputs, specs, "max_tokens", max_tokens, None)
    _put(inputs, specs, "n", req.n, 1)
    # Stop strings are applied in the engine, which stops at once and frees the KV cache.
    _put(inputs, specs, "stop", list(req.stop_strings), None)
    for name, noop in _OPTIONAL_FIELDS.items():
        _put(inputs, specs, name, getattr(req, name), noop)
    if "stream" in specs:
        inputs["stream"] = backend_stream
    return inputs


def check_service_options(req: ChatCompletionRequest) -> None:
    """Refuse OpenAI's service options (``protocol.ChatCompletionRequest``) at the values this
    server cannot honour; the others change nothing here, as they change no output at OpenAI.

    ``metadata`` only annotates a stored completion (OpenAI answers it without ``store`` true
    with a 400), and this server stores none, so a non-empty one is refused rather than
    dropped.

    Raises:
        OpenAIError: 400 naming the field (and the value): ``store`` true, a ``service_tier``
            other than ``auto`` / ``default``, ``modalities`` other than text
            (``unsupported_value``); a non-empty ``metadata`` (``unsupported_parameter``).
    """
    if req.store:
        raise unsupported_value("store", True, "it stores no completions (give false or null)")
    if req.metadata:
        raise unsupported(
            "metadata",
            reason="metadata only annotates stored completions, and none are stored here",
        )
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported_value(
            "service_tier", req.service_tier, 'it has one tier (give "auto" or "default")'
        )
    if req.modalities is not None and set(req.modalities) != {"text"}:
        raise unsupported_value("modalities", req.modalities, 'it generates text only (["text"])')


def _message_text(index: int, message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for j, part in enumerate(message.content):
        # An assistant's refusal part (OpenAI's history of a refused turn) is its text.
        field = "refusal" if part.type == "refusal" and message.role == "assistant" else "text"
        if part.type != field:
            raise OpenAIError(
                f"content part type {part.type!r} is not supported (text only)",
                param=f"messages.{index}.content",
                code="unsupported_value",
            )
        value = getattr(part, field)
        if value is None:
            raise OpenAIError(
                f"a content part of type '{field}' needs a '{field}' string",
                param=f"messages.{index}.content.{j}.{field}",
                code="missing_required_parameter",
            )
        parts.append(value)
    return "".join(parts)


def _message(index: int, message: ChatMessage) -> dict[str, Any]:
    """One message for the tokenizer: role, text and its tool fields."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": _message_text(index, message),
    }
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def chat_inputs(
    req: ChatCompletionRequest, specs: Mapping[str, InputSpec], backend_stream: bool
) -> dict[str, InputValue]:
    """Ensemble inputs of a chat request: ``messages`` as JSON plus sampling inputs.

    ``developer`` messages are sent as ``system`` (OpenAI treats them alike for chat models).

    Raises:
        OpenAIError: 400 for unsupported features (non-text content, a service option at a
            value ``check_service_options`` refuses, ...), an invalid tool choice or
            constraint, or ``top_logprobs`` without ``logprobs: true`` (as OpenAI answers).
    """
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(
            "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value"
        )
    check_service_options(req)
    mode = req.tool_mode()
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    # Chat without a limit runs until EOS, a stop or the context limit (OpenAI semantics): the
    # backend reads an absent max_tokens that way.
    max_tokens = req.max_completion_tokens or req.max_tokens
    inputs: dict[str, InputValue] = {"messages": json.dumps(messages, ensure_ascii=False)}
    tools = req.tools_json()
    if tools is not None:
        _put(inputs, specs, "tools", tools, None)
    inputs.update(sampling_inputs(req, specs, max_tokens, backend_stream))
    inputs.update(constraint_inputs(req, specs, req.tool_constraint(mode)))
    if req.logprobs:
        _put(inputs, specs, "logprobs", req.top_logprobs or 0, None)
    thinking = (req.chat_template_kwargs or {}).get("enable_thinking")
    if thinking is not None:
        if not isinstance(thinking, bool):
            raise OpenAIError(
                "chat_template_kwargs.enable_thinking must be a boolean",
                param="chat_template_kwargs",
            )
        _put(inputs, specs, "enable_thinking", thinking, None)
    return inputs


def completion_inputs(
    req: CompletionRequest,
    specs: Mapping[str, InputSpec],
    backend_stream: bool,
    prompt: str | list[int],
) -> dict[str, InputValue]:
    """Ensemble inputs of one prompt of a text completion: the prompt as ``text_input`` (a
    string) or ``input_ids`` (token ids), plus sampling. ``echo`` asks for the prompt text in
    front of each choice (``exclude_input_in_output`` false) and, with ``logprobs``, for the
    prompt's logprobs (``prompt_logprobs``, the same number of alternatives).

    Raises:
        OpenAIError: 400 for suffix, best_of below n (invalid) or above it (unsupported), or
            a field the backend cannot honour (``sampling_inputs``).
    """
    if req.suffix:
        raise unsupported("suffix")
    if req.best_of is not None and req.best_of < req.n:
        raise OpenAIError(
            f"best_of ({req.best_of}) must be at least n ({req.n})",
            param="best_of",
            code="invalid_value",
        )
    if req.best_of not in (None, req.n):
        raise unsupported("best_of", "best_of other than n")
    inputs: dict[str, InputValue] = {}
    if isinstance(prompt, str):
        inputs["text_input"] = prompt
        _put(inputs, specs, "add_special_tokens", req.add_special_tokens, False)
    else:
        _put(inputs, specs, "input_ids", prompt, None)
    # OpenAI's legacy completions default to 16 tokens (absent would mean no limit).
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = limits.DEFAULT_COMPLETION_MAX_TOKENS
    inputs.update(sampling_inputs(req, specs, max_tokens, backend_stream))
    _put(inputs, specs, "logprobs", req.logprobs, None)
    if req.echo:
        _put(inputs, specs, "exclude_input_in_output", False, None)
        _put(inputs, specs, "prompt_logprobs", req.logprobs, None)
    inputs.update(constraint_inputs(req, specs))
    return inputs
