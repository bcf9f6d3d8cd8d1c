"""Structured outputs and token masks in OpenAI requests → the ensemble's inputs.

Fields (both endpoints): OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema`` with ``json_schema.schema``; ``strict`` or not, the output always matches the
schema, as vLLM does), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and their newer form ``structured_outputs`` (one object,
``tritonllm.structured.spec``), ``guided_decoding_backend`` (``auto``: the generator picks
xgrammar for JSON schemas of its subset and llguidance otherwise; ``guidance``: llguidance for
all, sent on as the constraint's ``backend``; any other name, ``xgrammar`` included, is
refused: no other library serves every kind),
``allowed_token_ids`` and ``bad_words``. ``guided_whitespace_pattern`` is not declared: JSON is
always compact here (``spec``), so ``extensions.py`` refuses it by name (as ``spec`` refuses
``whitespace_pattern``). At most one constraint per request (a named or
``required`` tool choice is one too), except that ``response_format`` gives way to a named or
``required`` tool choice (it shapes content, which a forced call has none of; OpenAI and
vLLM take both, and the OpenAI Agents SDK sends both for an agent with an ``output_type`` and
``tool_choice="required"``); they all travel as one ``structured_outputs`` input in
vLLM's object form. The generator validates the schema, pattern or grammar with llguidance
(the sidecar has no grammar library): its error names ``structured_outputs.<kind>``, which
``rename_param`` turns back into the client's own field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from tritonllm.contract import limits

from .errors import OpenAIError, unsupported
from .triton_client import InputSpec, InputValue

BACKEND_PARAM = "structured_outputs"  # the backend's name of the constraint (its errors')


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: ``schema`` (absent: any JSON object)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    # OpenAI requires the name, of at most 64 letters, digits, underscores and dashes.
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputFields(BaseModel):
    """The request fields of structured outputs and token masks (module docstring)."""

    model_config = ConfigDict(extra="allow")

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: (
        list[Annotated[StrictInt, Field(**limits.TOKEN_ID.field_bounds())]] | None
    ) = None
    bad_words: list[str] | None = None

    def output_constraint(self) -> tuple[str, dict[str, Any]] | None:
        """(the client's field, the constraint in vLLM's object form), or None.

        Raises:
            OpenAIError: 400 for two constraints at once, a ``json_schema`` format without its
                ``json_schema`` object, or an unsupported option.
        """
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise OpenAIError(
                    "response_format of type json_schema needs a json_schema object",
                    param="response_format.json_schema",
                    code="missing_required_parameter",
                )
            schema = fmt.json_schema.schema_
            if schema:
                given.append(("response_format.json_schema.schema", {"json": schema}))
            else:
                given.append(("response_format", {"json_object": True}))
        for name, kind in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                given.append((name, {kind: value}))
        if self.structured_outputs:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        if self.guided_decoding_backend not in (None, *limits.STRUCTURED_OUTPUT_BACKENDS):
            raise unsupported(
                "guided_decoding_backend",
                "guided_decoding_backend other than auto or guidance",
            )
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise OpenAIError(
                f"give at most one output constraint (got {names})",
                param=given[1][0],
                code="invalid_value",
            )
        if not given:
            return None
        name, constraint = given[0]
        if self.guided_decoding_backend == "guidance":  # an object's own backend wins
            constraint = {"backend": "guidance", **constraint}
        return name, constraint


def _gives_way(constraint: tuple[str, dict[str, Any]] | None) -> bool:
    """Whether the client's constraint gives way to a named or ``required`` tool choice's:
    OpenAI's ``response_format`` shapes the assistant's content, which a forced call has none
    of (OpenAI and vLLM take both; the Agents SDK sends both when an agent with an
    ``output_type`` forces a tool). vLLM's own constraint fields still conflict with it."""
    return constraint is None or constraint[0].startswith("response_format")


def constraint_inputs(
    req: StructuredOutputFields,
    specs: Mapping[str, InputSpec],
    tool_constraint: tuple[str, dict[str, Any]] | None = None,
) -> dict[str, InputValue]:
    """The ``structured_outputs``, ``allowed_token_ids`` and ``bad_words`` inputs of ``req``
    (plus a tool choice's constraint, ``tool_constraint``).

    Raises:
        OpenAIError: 400 for conflicting constraints, empty ``allowed_token_ids``, or a field
            the backend has no input for.
    """
    inputs: dict[str, InputValue] = {}
    constraint = req.output_constraint()
    if tool_constraint is not None and _gives_way(constraint):
        constraint = None
    if constraint is not None and tool_constraint is not None:
        raise OpenAIError(
            f"{constraint[0]} cannot be combined with a required or named tool_choice",
            param=constraint[0],
            code="invalid_value",
        )
    constraint = constraint or tool_constraint
    if constraint is not None:
        if BACKEND_PARAM not in specs:
            raise unsupported(constraint[0])
        inputs[BACKEND_PARAM] = json.dumps(constraint[1], ensure_ascii=False)
    if req.allowed_token_ids == []:  # vLLM refuses it too: no token could ever be sampled
        raise OpenAIError(
            "allowed_token_ids must name at least one token id",
            param="allowed_token_ids",
            code="invalid_value",
        )
    for name in ("allowed_token_ids", "bad_words"):
        value = getattr(req, name)
        if value:
            if name not in specs:
                raise unsupported(name)
            inputs[name] = list(value)
    return inputs


def rename_param(exc: OpenAIError, req: StructuredOutputFields, tool_field: str | None) -> None:
    """Name the client's own field in a backend error about the constraint (in place): its
    ``param``, and the message where it begins with the backend's name of the field."""
    if exc.param is None or not exc.param.startswith(BACKEND_PARAM):
        return
    constraint = req.output_constraint()
    if tool_field is not None and _gives_way(constraint):
        constraint = None  # the tool choice's constraint was sent (constraint_inputs)
    field = constraint[0] if constraint is not None else tool_field
    if field is not None and field != BACKEND_PARAM:
        if exc.message.startswith(exc.param):
            exc.message = field + exc.message[len(exc.param) :]
        exc.param = field


__all__ = [
    "JsonSchemaFormat",
    "ResponseFormat",
    "StructuredOutputFields",
    "constraint_inputs",
    "rename_param",
]
