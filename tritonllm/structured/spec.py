"""`StructuredOutputs`: what a constrained request's output must match, validated when built.

The wire form (the ``structured_outputs`` input of ``generator`` / ``llm``, and the key of the
same name in ``sampling_parameters``) is vLLM's ``StructuredOutputsParams`` object: exactly one
of

- ``{"json": <JSON schema object, or its JSON text>}``: a JSON value that validates against the
  schema (OpenAI's ``response_format`` ``json_schema``, vLLM's ``guided_json``);
- ``{"json_object": true}``: any JSON object (OpenAI's ``json_object``);
- ``{"regex": "<pattern>"}``: text that fully matches the regular expression (``guided_regex``);
- ``{"choice": ["a", "b", ...]}``: exactly one of the strings (``guided_choice``);
- ``{"grammar": "<EBNF>"}``: text of the grammar's ``root`` rule (``guided_grammar``; xgrammar's
  EBNF dialect, GBNF-like).

``backend`` may be given as ``"xgrammar"`` or ``"auto"`` (the one backend); other keys of vLLM's
object (``whitespace_pattern``, ``structural_tag``, ...) are refused by name. Validation builds
the xgrammar ``Grammar`` (no tokenizer needed: milliseconds), so an invalid schema, pattern or
grammar is a ``RequestError`` at the trust boundary, never a failure in the engine loop.

JSON is generated compactly (xgrammar's ``any_whitespace=False``: separators ``", "`` and
``": "``, no free whitespace), so a model cannot wander off into endless whitespace: vLLM offers
the same as ``disable_any_whitespace``. Objects get no properties beyond the schema's
(xgrammar's strict mode, which still validates against the schema).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tritonllm.contract import limits
from tritonllm.contract.errors import ErrorCode, RequestError, short_repr

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_BACKENDS = (None, "auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A validated output constraint (hashable: the grammar cache's key).

    Attributes:
        kind: one of ``KINDS``.
        spec: ``json``: the schema as canonical JSON text (sorted keys, compact); ``regex``:
            the pattern; ``choice``: the choices as a JSON list; ``grammar``: the EBNF text;
            ``json_object``: ``""``.
    Raises:
        RequestError: (``invalid_value``, param ``structured_outputs.<kind>``) an unknown kind,
            or a schema / pattern / grammar that xgrammar cannot compile (its reason quoted).
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise _invalid("structured_outputs", f"kind must be one of {', '.join(KINDS)}")
        if len(self.spec) > limits.MAX_GRAMMAR_CHARS:
            raise _invalid(
                self.param,
                f"is longer than {limits.MAX_GRAMMAR_CHARS} characters ({len(self.spec)})",
            )
        try:
            self.grammar()
        except RuntimeError as exc:  # xgrammar's parse errors (schema, regex, EBNF)
            raise _invalid(self.param, f"cannot be compiled: {_reason(exc)}") from None

    @property
    def param(self) -> str:
        """The parameter errors about it name (``structured_outputs.json``, ...)."""
        return f"structured_outputs.{self.kind}"

    def grammar(self) -> Any:
        """The xgrammar ``Grammar`` of this constraint (no tokenizer involved).

        Raises:
            RuntimeError: xgrammar refused the schema, pattern or grammar.
        """
        import xgrammar as xgr

        if self.kind == "json":
            return xgr.Grammar.from_json_schema(self.spec, any_whitespace=False)
        if self.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if self.kind == "regex":
            return xgr.Grammar.from_regex(self.spec)
        if self.kind == "choice":
            choices = json.loads(self.spec)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(_ebnf_literal, choices)))
        return xgr.Grammar.from_ebnf(self.spec)

    def to_wire(self) -> dict[str, Any]:
        """The wire object (see the module docstring) of this constraint."""
        if self.kind == "json":
            return {"json": json.loads(self.spec)}
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind == "choice":
            return {"choice": json.loads(self.spec)}
        return {self.kind: self.spec}

    @classmethod
    def from_wire(cls, value: Any, param: str = "structured_outputs") -> StructuredOutputs:
        """Parse the wire object (a dict, or its JSON text).

        Raises:
            RequestError: not an object with exactly one known kind (``invalid_value``), a key
                this service does not support (``unsupported_parameter``), or an invalid
                constraint (see the class).
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise RequestError(
                    ErrorCode.INVALID_INPUT, param, f"{param} must be a JSON object"
                ) from None
        if not isinstance(value, Mapping):
            raise _invalid(param, f"must be a JSON object with one of {', '.join(KINDS)}")
        given = {k: v for k, v in value.items() if v is not None and v is not False}
        backend = given.pop("backend", None)
        if backend not in _BACKENDS:
            raise RequestError(
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"{param}.backend",
                f"{param}.backend={short_repr(backend)} is not supported (only xgrammar)",
            )
        unknown = sorted(set(given) - set(KINDS))
        if unknown:
            name = f"{param}.{unknown[0]}"
            raise RequestError(
                ErrorCode.UNSUPPORTED_PARAMETER, name, f"{name} is not supported by this server"
            )
        if len(given) != 1:
            raise _invalid(param, f"must give exactly one of {', '.join(KINDS)}")
        ((kind, spec),) = given.items()
        return cls.build(kind, spec, f"{param}.{kind}")

    @classmethod
    def build(cls, kind: str, spec: Any, param: str) -> StructuredOutputs:
        """A constraint of ``kind`` from its client value (a schema dict or JSON text, a
        pattern, a list of choices, EBNF text, ``True`` for ``json_object``).

        Raises:
            RequestError: a value of the wrong type or an invalid constraint, naming ``param``.
        """
        if kind == "json":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except json.JSONDecodeError as exc:
                    raise _invalid(param, f"is not valid JSON: {exc}") from None
            if not isinstance(spec, Mapping):
                raise _invalid(param, "must be a JSON schema (an object)")
            text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            if spec is not True:
                raise _invalid(param, "must be true")
            text = ""
        elif kind == "choice":
            ok = isinstance(spec, list | tuple) and spec and all(isinstance(c, str) for c in spec)
            if not ok or len(spec) > limits.MAX_CHOICES:
                raise _invalid(param, f"must be a list of 1..{limits.MAX_CHOICES} strings")
            text = json.dumps(list(spec), ensure_ascii=False)
        elif kind in ("regex", "grammar"):
            if not isinstance(spec, str) or not spec:
                raise _invalid(param, "must be a non-empty string")
            text = spec
        else:
            raise _invalid(param, f"kind must be one of {', '.join(KINDS)}")
        try:
            return cls(kind, text)
        except RequestError as exc:  # named by the client's own field
            message = exc.message.replace(str(exc.param), param, 1)
            raise RequestError(exc.code, param, message) from None


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON escapes are xgrammar's string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _reason(exc: Exception) -> str:
    # xgrammar prefixes its messages with a timestamp and a C++ source location.
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:300]


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_VALUE, param, f"{param} {message}")


__all__ = ["KINDS", "StructuredOutputs"]
