"""Tool calling in chat requests: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

What each ``tool_choice`` does (OpenAI's semantics; the guarantees are vLLM's design):

- ``none``: the tools are rendered in the prompt, the output is plain content;
- ``auto`` (the default with tools): the output is parsed with the model family's tool-call
  parser (``tool_parsers``); calls found become ``tool_calls`` with finish_reason
  ``"tool_calls"``, the rest is content; ``parallel_tool_calls: false`` keeps the first call;
- ``required``: the output is constrained (structured outputs) to a JSON array of
  ``{"name": <one of the tools>, "parameters": <its parameters schema>}`` (exactly one item
  with ``parallel_tool_calls: false``), so it always parses and validates;
  finish_reason ``"tool_calls"``;
- a named function: the output is constrained to that function's ``parameters`` schema and is
  the call's arguments (``{}`` for a function without ``parameters``: an empty parameter list); finish_reason ``"stop"`` (OpenAI's, for a forced function).

An output cut short by ``max_tokens`` keeps finish_reason ``"length"`` and everything it
generated, as OpenAI keeps a cut output: a named function's call has the arguments generated so
far (possibly incomplete JSON); a ``required`` array that was cut is no list of calls, so its
text is the message's content (``constrained_calls``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from .errors import OpenAIError
from .tool_parsers import ToolCall, new_call_id

# A function without ``parameters`` (or with ``{}``) has an empty parameter list (OpenAI's
# reference: "Omitting parameters defines a function with an empty parameter list"): its
# forced call's arguments are ``{}``.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDef(BaseModel):
    """A tool's function: its name, description and parameters (a JSON schema)."""

    model_config = ConfigDict(extra="allow")

    # OpenAI's rule for a function's name (it answers 400 otherwise).
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function."""

    type: Literal["function"] = "function"
    function: NamedFunction


@dataclass(frozen=True)
class ToolMode:
    """How a request's output relates to tools: ``kind`` is ``off`` (no tools), ``none``,
    ``auto``, ``required`` or ``named`` (then ``name`` is the function)."""

    kind: str
    name: str | None = None
    parallel: bool = True


class ToolFields(BaseModel):
    """The tool fields of a chat request (module docstring)."""

    model_config = ConfigDict(extra="allow")

    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    def tool_mode(self) -> ToolMode:
        """The request's ``ToolMode``; every tool's ``parameters`` checked first
        (``check_parameters``), whatever the choice.

        Raises:
            OpenAIError: 400 for a tool_choice without tools or naming an unknown one, two
                tools of one function name (a call names its function: which one it means, and
                whose ``parameters`` apply, would be a guess), or a ``parameters`` that is no
                valid JSON schema.
        """
        choice = self.tool_choice
        parallel = self.parallel_tool_calls is not False
        if not self.tools:
            if choice not in (None, "none"):
                raise OpenAIError(
                    "tool_choice needs tools", param="tool_choice", code="invalid_value"
                )
            return ToolMode("off")
        seen: set[str] = set()
        for i, tool in enumerate(self.tools):
            if tool.function.name in seen:
                raise OpenAIError(
                    f"tools[{i}] repeats the function name {tool.function.name!r}; each tool "
                    "needs a name of its own",
                    param=f"tools[{i}].function.name",
                    code="invalid_value",
                )
            seen.add(tool.function.name)
            if tool.function.parameters is not None:
                check_parameters(tool.function.parameters, f"tools[{i}].function.parameters")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise OpenAIError(
                    f"tool_choice names {name!r}, which is not in tools",
                    param="tool_choice",
                    code="invalid_value",
                )
            return ToolMode("named", name, parallel)
        return ToolMode(choice or "auto", None, parallel)

    def tools_json(self) -> str | None:
        """The tools as the tokenizer's ``tools`` input (JSON), or None."""
        if not self.tools:
            return None
        return json.dumps([t.model_dump(exclude_none=True) for t in self.tools], ensure_ascii=False)

    def tool_constraint(self, mode: ToolMode) -> tuple[str, dict[str, Any]] | None:
        """(the field an invalid schema is reported as, the structured-outputs constraint) of
        a ``required`` or named tool choice (the named tool's ``parameters``, or ``tools``)."""
        if mode.kind == "named":
            i = [t.function.name for t in self.tools or ()].index(mode.name or "")
            parameters = _object_root((self.tools or [])[i].function.parameters)
            return (f"tools[{i}].function.parameters", {"json": parameters})
        if mode.kind != "required":
            return None
        # Each tool's parameters schema sits whole under the root's $defs, its own references
        # rebased there, so "#/$defs/..." (pydantic's nested models) still resolves.
        tools = list(self.tools or ())
        defs = {
            f"tool_{i}": _rebase_refs(_object_root(t.function.parameters), f"#/$defs/tool_{i}")
            for i, t in enumerate(tools)
        }
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": {"$ref": f"#/$defs/tool_{i}"},
                },
                "required": ["name", "parameters"],
            }
            for i, t in enumerate(tools)
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": items},
            "$defs": defs,
        }
        if not mode.parallel:
            schema["maxItems"] = 1
        return ("tools", {"json": schema})


def _object_root(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a call's arguments are generated under: ``parameters`` with ``"type":
    "object"`` added where it names no type (arguments are always a JSON object), and
    ``NO_PARAMETERS`` for a function without them."""
    if not parameters:
        return NO_PARAMETERS
    return parameters if "type" in parameters else {"type": "object", **parameters}


def check_parameters(schema: dict[str, Any], param: str) -> None:
    """Check a tool's ``parameters`` against the JSON Schema meta-schema of its ``$schema``
    (Draft 2020-12 without one), and that its root is an object schema (a ``type`` of
    ``"object"``, or none), as OpenAI refuses an invalid function schema with any
    ``tool_choice``: a call's arguments are a JSON object. Structure only, no grammar compile
    (that is for a ``required`` or named choice, whose constraint the generator builds) and
    no ``format`` checks (a ``pattern`` is ECMA-262, which Python's ``re`` would misjudge).

    Raises:
        OpenAIError: 400 ``invalid_value`` naming ``param``, with jsonschema's reason or the
            root's type.
    """
    declared = schema.get("$schema")
    cls = validator_for(schema, Draft202012Validator) if isinstance(declared, str) else None
    try:
        (cls or Draft202012Validator).check_schema(schema, format_checker=None)
    except SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)[1:]
        reason = exc.message if len(exc.message) <= 200 else exc.message[:197] + "..."
        raise OpenAIError(
            f"{param} is not a valid JSON schema: {reason} (at {where or 'its root'})",
            param=param,
            code="invalid_value",
        ) from None
    except RecursionError:
        raise OpenAIError(
            f"{param} is nested too deeply", param=param, code="invalid_value"
        ) from None
    if schema.get("type", "object") != "object":
        raise OpenAIError(
            f'{param} must be a JSON schema of type "object" (a call\'s arguments are a JSON'
            f" object), not of type {json.dumps(schema['type'])}",
            param=param,
            code="invalid_value",
        )


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names (any names, "default" included) to schemas.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` (not changed) with every local ``$ref`` (``#`` + a JSON pointer) moved under
    ``base`` (``#/$defs/tool_0``): ``#`` → ``base``, ``#/$defs/d`` → ``base + "/$defs/d"``."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names → schemas, any names
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, base)
    return out


def constrained_calls(mode: ToolMode, text: str) -> list[ToolCall] | None:
    """The tool calls of a ``required`` or named choice's output:

    - named: the one call, its arguments the text as generated; cut short by ``max_tokens``
      (finish_reason ``length``) they are incomplete JSON, as OpenAI returns a cut call's
      arguments, and as they were streamed;
    - required: a call per item of the JSON array when the output is the whole array, which
      the grammar guarantees unless ``max_tokens`` or a stop string cut it short.

    Returns:
        the calls; None for a ``required`` output that is no whole, non-empty array of
        ``{"name", "parameters"}`` calls (a cut one): the caller then returns the text as
        content, so that nothing generated is lost.
    """
    if mode.kind == "named":
        return [ToolCall(new_call_id(), mode.name or "", text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    if not all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items):
        return None
    return [
        ToolCall(
            new_call_id(), item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)
        )
        for item in items
    ]


__all__ = [
    "FunctionDef",
    "NamedToolChoice",
    "ToolDef",
    "ToolFields",
    "ToolMode",
    "check_parameters",
    "constrained_calls",
]
