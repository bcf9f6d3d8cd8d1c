"""Prompt rendering: a raw ``text_input`` or chat ``messages`` become prompt token ids.

``QWEN3_CHAT_TEMPLATE`` reproduces the prompt format of Qwen3's chat template (ChatML turns
``<|im_start|>role\\n...<|im_end|>\\n``; earlier assistant turns lose their ``<think>`` reasoning,
turns after the last user query keep it; consecutive ``tool`` results are grouped into one user
turn of ``<tool_response>`` blocks; ``enable_thinking=False`` pre-fills an empty think block)
and its function calling: with ``tools`` the system turn lists their signatures in ``<tools>``
with the ``<tool_call>`` instructions, and an assistant's ``tool_calls`` render as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks after its content. Templates
that do not render tools get them as plain messages (``tokenization.tools.fallback_messages``)
when the request has tools or tool calls; a conversation without either is rendered as given.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from jinja2.exceptions import TemplateError

from tritonllm.contract.errors import ErrorCode, RequestError, short_repr
from tritonllm.tokenization.control_tokens import guard_for
from tritonllm.tokenization.tools import fallback_messages, message_tool_fields, validate_tools

CHAT_ROLES = ("system", "user", "assistant", "tool")

QWEN3_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- set ns = namespace(last_query=messages | length - 1, found=false) -%}"
    # The last real user query: later assistant turns keep their reasoning.
    "{%- for i in range(messages | length - 1, -1, -1) -%}"
    "{%- set m = messages[i] -%}"
    "{%- if not ns.found and m.role == 'user' and m.content is string"
    " and not (m.content.startswith('<tool_response>')"
    " and m.content.endswith('</tool_response>')) -%}"
    "{%- set ns.found = true -%}{%- set ns.last_query = i -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content if m.content is string else '' -%}"
    "{%- if m.role == 'system' and loop.first and tools -%}"
    "{%- elif m.role == 'user' or m.role == 'system' -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if m.reasoning_content is not string and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- endif -%}"
    "{%- for call in (m.tool_calls or []) -%}"
    "{%- if (loop.first and content) or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set f = call.function if call.function else call -%}"
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' -}}'
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}"
    "{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages: a non-empty list of ``{"role": str, "content": str}``.

    Roles are ``system``, ``user``, ``assistant``, ``tool``. An assistant message may carry
    ``tool_calls`` (then its content may be null), a tool message ``tool_call_id`` and
    ``name`` (``tokenization.tools.message_tool_fields``). Other keys are ignored.

    Returns:
        The messages as plain ``{"role", "content"}`` dicts, plus their tool fields.
    Raises:
        RequestError: (``invalid_value``, param ``messages``) with a message naming the first
            offending entry.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise _bad_messages("messages must be a non-empty list of {'role': str, 'content': str}")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad_messages(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise _bad_messages(f"messages[{i}].role must be a string")
        if role not in CHAT_ROLES:
            raise _bad_messages(
                f"messages[{i}].role {short_repr(role)} is not one of {', '.join(CHAT_ROLES)}"
            )
        tool_fields = message_tool_fields(i, message)
        if content is None and "tool_calls" in tool_fields:
            content = ""
        if not isinstance(content, str):
            raise _bad_messages(f"messages[{i}].content must be a string")
        cleaned.append({"role": role, "content": content, **tool_fields})
    return cleaned


def _bad_messages(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_VALUE, "messages", message)


def template_uses(template: str, variable: str) -> bool:
    """Whether the chat template ``template`` (Jinja source) refers to ``variable``.

    A name match on the source: a template option such as Qwen3's ``enable_thinking`` is a
    plain variable of the template, never spelled inside another identifier.
    """
    return re.search(rf"\b{re.escape(variable)}\b", template) is not None


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    enable_thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of ``messages`` with the generation prompt, by the tokenizer's own chat
    template (``tokenizer_config.json`` / ``chat_template.jinja`` of the model directory).

    Args:
        enable_thinking: passed to the template only when given; None leaves the template's
            default (Qwen3: thinking on).
        tools: OpenAI function tools; passed to a template that names ``tools``; for any other
            template the tools and tool-call history become plain Hermes-format messages
            (``tokenization.tools.fallback_messages``), when there are tools or tool calls.
    Raises:
        RequestError: invalid messages (see ``validate_messages``), no chat template
            (``unsupported_parameter``), or ``enable_thinking`` given for a template that has
            no such option (``unsupported_parameter``).
    """
    guard = guard_for(tokenizer)
    return guard.unmark(_render_marked(tokenizer, messages, enable_thinking, tools))


def encode_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    enable_thinking: bool | None = None,
    check_chars: Callable[[int, str], None] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids of ``messages`` (``render_chat``'s text, ``tools`` as there), where only
    the template places control tokens: special-token text inside the messages is encoded as
    text (``control_tokens.ContentGuard``).

    Args:
        check_chars: called with the rendered prompt's length in characters and ``"messages"``
            before it is encoded (it raises to refuse a prompt too long to tokenize).
    Raises:
        RequestError: as ``render_chat``, or from ``check_chars``.
    """
    guard = guard_for(tokenizer)
    rendered = _render_marked(tokenizer, messages, enable_thinking, tools)
    if check_chars is not None:
        check_chars(len(guard.unmark(rendered)), "messages")
    return guard.encode(rendered)


def _render_marked(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    enable_thinking: bool | None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The template's text of ``messages`` with special-token text in their strings marked."""
    cleaned = validate_messages(messages)
    template = tokenizer.chat_template
    if not template:
        raise RequestError(
            ErrorCode.UNSUPPORTED_PARAMETER,
            "messages",
            "the tokenizer has no chat template; send text_input instead",
        )
    options: dict[str, Any] = {}
    if enable_thinking is not None:
        if not template_uses(str(template), "enable_thinking"):
            raise RequestError(
                ErrorCode.UNSUPPORTED_PARAMETER,
                "enable_thinking",
                "enable_thinking is not supported: the model's chat template has no such option",
            )
        options["enable_thinking"] = enable_thinking
    tools = validate_tools(tools) if tools else None
    if template_uses(str(template), "tools"):
        if tools:
            options["tools"] = tools
    elif tools or any(m.get("tool_calls") for m in cleaned):
        # Only a conversation with tools is rewritten: without them its messages (a ``tool``
        # role included) reach the template as they do in Hugging Face's rendering.
        cleaned = fallback_messages(cleaned, tools)
    try:
        return tokenizer.apply_chat_template(
            guard_for(tokenizer).mark(cleaned),
            tokenize=False,
            add_generation_prompt=True,
            **options,
        )
    except TemplateError as exc:
        # The template's own raise_exception(...) (a plain TemplateError) says what the model
        # refuses; any other (the sandbox's SecurityError, an undefined name) is internal text.
        own = type(exc) is TemplateError
        reason = str(exc) if own else "the model's chat template could not render these messages"
        raise RequestError(ErrorCode.INVALID_VALUE, "messages", reason) from None


def render_prompt(
    tokenizer: Any,
    text_input: str | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    check_chars: Callable[[int, str], None] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Prompt token ids from exactly one of ``text_input`` or ``messages``.

    ``text_input`` is encoded as is: no chat template, no special tokens added (special-token
    text such as ``<|im_start|>`` inside it is still recognised, as Hugging Face does: a raw
    prompt's client writes the whole prompt). ``messages`` go through the chat template with the
    assistant generation prompt, and special-token text inside them is encoded as text
    (``encode_chat``: only the template places control tokens);
    ``enable_thinking=False`` pre-fills an empty ``<think>`` block (Qwen3 convention; refused
    for a template without that option, see ``render_chat``).

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerFast``-like).
        check_chars: called with the prompt text's length in characters and the input's name
            before it is encoded (``prompt_limits.PromptLimits.check_chars``: it raises to
            refuse a prompt that cannot fit the context, so it is never tokenized).
    Returns:
        Prompt ids, ``list[int]`` (may be empty for ``text_input=""``).
    Raises:
        RequestError: neither (``missing_input``) or both inputs given, ``text_input`` not a
            string, invalid messages (``invalid_value``), ``enable_thinking`` for a template
            without it (``unsupported_parameter``).
    """
    if text_input is None and messages is None:
        raise RequestError(
            ErrorCode.MISSING_INPUT, "text_input", "give exactly one of text_input or messages"
        )
    if text_input is not None and messages is not None:
        raise RequestError(
            ErrorCode.INVALID_VALUE, "messages", "give exactly one of text_input or messages"
        )
    if tools and messages is None:
        raise RequestError(ErrorCode.INVALID_VALUE, "tools", "tools needs messages (chat)")
    if messages is None:
        if not isinstance(text_input, str):
            raise RequestError(ErrorCode.INVALID_VALUE, "text_input", "text_input must be a string")
        if check_chars is not None:
            check_chars(len(text_input), "text_input")
        return list(tokenizer.encode(text_input, add_special_tokens=False))
    return encode_chat(tokenizer, messages, enable_thinking, check_chars, tools)
