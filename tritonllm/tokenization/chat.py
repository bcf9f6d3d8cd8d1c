"""Prompt rendering: a raw ``text_input`` or chat ``messages`` become prompt token ids.

``QWEN3_CHAT_TEMPLATE`` reproduces the prompt format of Qwen3's chat template (ChatML turns
``<|im_start|>role\\n...<|im_end|>\\n``; earlier assistant turns lose their ``<think>`` reasoning,
turns after the last user query keep it; consecutive ``tool`` results are grouped into one user
turn of ``<tool_response>`` blocks; ``enable_thinking=False`` pre-fills an empty think block). It
is written here, without function-calling support, since the service takes no ``tools``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool")

QWEN3_CHAT_TEMPLATE = (
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
    "{%- if m.role == 'user' or m.role == 'system' -%}"
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


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check chat messages: a non-empty list of ``{"role": str, "content": str}``.

    Roles are ``system``, ``user``, ``assistant``, ``tool``. Extra keys are ignored.

    Returns:
        The messages as plain ``{"role", "content"}`` dicts.
    Raises:
        ValueError: with a message naming the first offending entry.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role must be a string")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        cleaned.append({"role": role, "content": content})
    return cleaned


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], enable_thinking: bool = True
) -> str:
    """The prompt text of ``messages`` with the generation prompt, by the tokenizer's template.

    Raises:
        ValueError: invalid messages (see ``validate_messages``) or no chat template.
    """
    cleaned = validate_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; send text_input instead")
    return tokenizer.apply_chat_template(
        cleaned, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )


def render_prompt(
    tokenizer: Any,
    text_input: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    enable_thinking: bool = True,
) -> list[int]:
    """Prompt token ids from exactly one of ``text_input`` or ``messages``.

    ``text_input`` is encoded as is: no chat template, no special tokens added (special-token
    text such as ``<|im_start|>`` inside it is still recognised, as Hugging Face does).
    ``messages`` go through the chat template with the assistant generation prompt;
    ``enable_thinking=False`` pre-fills an empty ``<think>`` block (Qwen3 convention).

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizerFast``-like).
    Returns:
        Prompt ids, ``list[int]`` (may be empty for ``text_input=""``).
    Raises:
        ValueError: neither or both inputs given, ``text_input`` not a string, invalid messages.
    """
    if (text_input is None) == (messages is None):
        raise ValueError("give exactly one of text_input or messages")
    if messages is None:
        if not isinstance(text_input, str):
            raise ValueError("text_input must be a string")
        return list(tokenizer.encode(text_input, add_special_tokens=False))
    text = render_chat(tokenizer, messages, enable_thinking=enable_thinking)
    return list(tokenizer.encode(text, add_special_tokens=False))
