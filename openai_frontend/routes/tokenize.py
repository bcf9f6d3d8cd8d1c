"""vLLM's POST /tokenize, POST /detokenize and GET /version.

Both go through the Triton ``tokenizer`` model, the one that renders every generation's prompt,
so that the ids are exactly those a generation would get (one tokenizer and one chat template,
the model directory's): a ``prompt`` is encoded as ``text_input`` (with the tokenizer's special
tokens unless ``add_special_tokens`` is false, vLLM's default for /tokenize), ``messages`` are
rendered as the chat endpoint renders them (``sampling.chat_inputs``, with the generation
prompt), ``tools`` included, as vLLM's /tokenize takes them. /detokenize sends the ids as
``input_ids`` and reads their text from ``echo_text``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

import tritonllm

from ..errors import unsupported
from ..extensions import check_extensions
from ..generation import to_openai_error
from ..protocol import ChatCompletionRequest, ChatMessage, TokenId, _Lenient
from ..sampling import chat_inputs
from ..tools import ToolDef
from ..triton_client import InputValue, TritonError
from .common import ServerState, check_model, get_state

router = APIRouter()
TOKENIZER_MODEL = "tokenizer"


class TokenizeRequest(_Lenient):
    """``POST /tokenize``: exactly one of ``prompt`` (raw text) or ``messages`` (chat, with
    the ``tools`` a chat completion would render with them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDef] | None = None
    add_special_tokens: StrictBool | None = None  # prompt: default true; messages: false only
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            # A code of its own (the error's class), the words for people.
            raise PydanticCustomError(
                "invalid_value", "give exactly one of prompt or messages, not both or neither"
            )
        return self


class TokenizeResponse(_Lenient):
    """``tokens``: the prompt's ids; ``count``: how many; ``max_model_len``: the context
    limit (tokens; null while the engine cannot be reached)."""

    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(_Lenient):
    """``POST /detokenize``: token ids → text (no ids: the empty text, as vLLM answers)."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Lenient):
    """``prompt``: the ids' text (special tokens kept, as vLLM decodes them)."""

    prompt: str


async def _tokenizer(state: ServerState, inputs: Mapping[str, InputValue], param: str) -> Any:
    """The tokenizer model's outputs. Raises: OpenAIError (400 for bad input, 503 when
    Triton is unavailable), the error naming ``param``."""
    try:
        return await state.client.infer(TOKENIZER_MODEL, f"tok-{uuid.uuid4().hex}", inputs)
    except TritonError as exc:
        raise to_openai_error(exc, param) from exc


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """The ids a prompt (or chat, with its tools) becomes: those a completion of it would
    feed the model.

    Raises:
        OpenAIError: 404 for another model; 400 for bad input (a tool's ``parameters`` that is
            no JSON schema, as for a chat completion) or an unsupported field (``tools`` or
            ``add_special_tokens`` with the other form).
    """
    state = get_state(request)
    check_model(state, body.model)
    check_extensions(body)
    inputs: dict[str, InputValue]
    if body.messages is not None:
        if body.add_special_tokens:
            raise unsupported("add_special_tokens", "add_special_tokens with messages")
        chat = ChatCompletionRequest(
            messages=body.messages,
            chat_template_kwargs=body.chat_template_kwargs,
            tools=body.tools,
        )
        specs = await state.client.input_specs(TOKENIZER_MODEL)
        rendered = chat_inputs(chat, specs, False)
        prompt_inputs = ("messages", "tools", "enable_thinking")
        inputs = {k: v for k, v in rendered.items() if k in prompt_inputs}
        param = "messages"
    else:
        assert body.prompt is not None
        if body.tools is not None:
            raise unsupported("tools", "tools with prompt (they are rendered with messages)")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        inputs, param = {"text_input": body.prompt, "add_special_tokens": special}, "prompt"
    outputs = await _tokenizer(state, inputs, param)
    tokens = [int(t) for t in outputs["input_ids"].reshape(-1)]
    limit = await state.context_limit()
    return TokenizeResponse(count=len(tokens), max_model_len=limit, tokens=tokens)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids (``""`` for none, without asking the tokenizer model, which
    takes no empty prompt). Raises: OpenAIError 404 for another model; 400 for an id outside
    the vocabulary."""
    state = get_state(request)
    check_model(state, body.model)
    if not body.tokens:
        return DetokenizeResponse(prompt="")
    inputs: dict[str, InputValue] = {"input_ids": body.tokens, "exclude_input_in_output": False}
    outputs = await _tokenizer(state, inputs, "tokens")
    text = outputs["echo_text"].reshape(-1)[0]
    return DetokenizeResponse(prompt=text.decode("utf-8", errors="replace"))


@router.get("/version")
async def version() -> dict[str, str]:
    """``{"version": the tritonllm version}``."""
    return {"version": tritonllm.__version__}
