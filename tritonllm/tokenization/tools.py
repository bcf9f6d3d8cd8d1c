"""Tools in the prompt: OpenAI ``tools`` and tool-call history for the chat template.

- ``validate_tools``: the ``tools`` list (``[{"type": "function", "function": {"name",
  "description", "parameters"}}]``), checked once.
- ``message_tool_fields``: what an assistant message's ``tool_calls`` and a ``tool`` message's
  ``tool_call_id`` / ``name`` become for the template (Hugging Face's convention: a call's
  ``function.arguments`` as a mapping when it is a JSON object's text, as templates expect).
- ``fallback_messages``: for a chat template that does not render tools (its source never
  names ``tools``; e.g. SmolLM2's), the tools and the tool-call history become plain messages
  in the Hermes format that Qwen2.5/Qwen3 templates produce: the tool signatures and the
  ``<tool_call>`` instructions in the system message, each assistant tool call as a
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block after its content, each tool
  result as a user turn of ``<tool_response>`` blocks (only when the request has tools or
  tool calls: other conversations reach the template as given). The model then sees the tools
  at all (vLLM passes them to such a template, which drops them), and the sidecar's Hermes
  parser reads its calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tritonllm.contract.errors import ErrorCode, RequestError, short_repr

MAX_TOOLS = 128

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _bad(param: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_VALUE, param, message)


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The ``tools`` list as plain dicts ``{"type": "function", "function": {...}}``.

    Raises:
        RequestError: (``invalid_value``, param ``tools``) not a list of function tools with a
            string ``name`` and an object (or absent) ``parameters``.
    """
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"tools must be a list of at most {MAX_TOOLS} function tools")
    cleaned = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise _bad("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise _bad("tools", f"tools[{i}].function must be an object with a string 'name'")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise _bad("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        cleaned.append({"type": "function", "function": dict(function)})
    return cleaned


def message_tool_fields(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """The tool fields of ``messages[i]`` for the template: an assistant's ``tool_calls``, a
    tool message's ``tool_call_id`` and ``name``.

    Raises:
        RequestError: (``invalid_value``, param ``messages``) malformed tool calls.
    """
    fields: dict[str, Any] = {}
    role = message.get("role")
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise _bad("messages", f"messages[{i}].tool_calls must be a list")
        fields["tool_calls"] = [_call(i, j, call) for j, call in enumerate(calls)]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                fields[key] = message[key]
    return fields


def _call(i: int, j: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _bad("messages", f"messages[{i}].tool_calls[{j}] needs function.name (a string)")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed  # templates render a mapping (`| tojson`)
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _call_text(call: Mapping[str, Any]) -> str:
    function = call["function"]
    arguments = function["arguments"]
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {args}}}\n</tool_call>'


def hermes_tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes/Qwen tools block of a system message for ``tools``."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return HERMES_TOOLS_PROMPT.format(tools=lines)


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` (validated, with tool fields) rewritten for a template that renders neither
    tools nor tool calls (see the module docstring): plain ``{"role", "content"}`` messages."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message["content"] or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_call_text(call) for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "tool_results": True})
            continue
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_results", None)
    if tools:
        prompt = hermes_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def parse_tools_json(text: str | None) -> list[dict[str, Any]] | None:
    """The ``tools`` input (JSON text) validated, or None when absent or empty.

    Raises:
        RequestError: not JSON (``invalid_input``) or not a valid tools list.
    """
    if text is None or not text.strip():
        return None
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(
            ErrorCode.INVALID_INPUT, "tools", f"tools is not valid JSON: {short_repr(str(exc))}"
        ) from None
    return validate_tools(tools) or None


__all__ = [
    "HERMES_TOOLS_PROMPT",
    "fallback_messages",
    "hermes_tools_prompt",
    "message_tool_fields",
    "parse_tools_json",
    "validate_tools",
]
