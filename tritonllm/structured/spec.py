"""`StructuredOutputs`: what a constrained request's output must match, validated when built.

The wire form (the ``structured_outputs`` input of ``generator`` / ``llm``, and the key of the
same name in ``sampling_parameters``) is vLLM's ``StructuredOutputsParams`` object: exactly one
of

- ``{"json": <JSON schema object, or its JSON text>}``: a JSON value that validates against the
  schema (OpenAI's ``response_format`` ``json_schema``, vLLM's ``guided_json``);
- ``{"json_object": true}``: any JSON object (OpenAI's ``json_object``);
- ``{"regex": "<pattern>"}``: text that fully matches the regular expression (``guided_regex``);
- ``{"choice": ["a", "b", ...]}``: exactly one of the strings (``guided_choice``);
- ``{"grammar": "<EBNF>"}``: text of the grammar's ``root`` rule (``guided_grammar``; GBNF, the
  EBNF dialect of llama.cpp and xgrammar, or llguidance's Lark syntax with a ``start`` rule).

Every constraint is an llguidance grammar (`grammar`), and validation builds and checks it (no
tokenizer needed: about a millisecond), so an invalid schema, pattern or grammar is a
``RequestError`` at the trust boundary, never a failure in the engine loop. A JSON schema of the
subset that xgrammar enforces in full (`xgrammar_schema`: objects, arrays, strings with length
bounds, integers with bounds, unbounded numbers, booleans, null, enum and const) has its token
masks filled by xgrammar instead, whose precomputed per-state token sets make a bounded string's
mask much cheaper than llguidance's trie walk (BENCHMARKS.md, "Bounded strings with
xgrammar"). Outputs validate against the schema either way, and have the same shape; one
difference: a string with ``minLength`` / ``maxLength`` holds no escape sequences under xgrammar
(no ``\\"`` or ``\\n`` inside it; xgrammar's own rule, kept for its speed, `structured.compiler`).
``backend`` may be given as ``"auto"`` (that choice) or ``"guidance"`` (vLLM's name of
llguidance: llguidance fills every mask); another backend (``"xgrammar"``, ``"outlines"``) is
refused by name, since neither serves every kind here; other keys of vLLM's object
(``whitespace_pattern``, ``structural_tag``, ...) are refused by name.

JSON is generated compactly (llguidance's ``whitespace_flexible`` off, separators ``", "`` and
``": "``, no free whitespace), so a model cannot wander off into endless whitespace: vLLM offers
the same as ``disable_any_whitespace``. Objects with declared properties get none beyond them,
and arrays with ``prefixItems`` no further items, unless the schema says otherwise (`strict`:
the strict mode of xgrammar, which served these constraints before, so outputs keep their shape;
they still validate against the schema).
"""

from __future__ import annotations

import decimal
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tritonllm.contract import limits
from tritonllm.contract.errors import ErrorCode, RequestError, short_repr
from tritonllm.structured.stacks import on_grammar_stack

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_BACKENDS = (None, *limits.STRUCTURED_OUTPUT_BACKENDS)
# llguidance's JSON options: compact output (see the module docstring).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class StructuredOutputs:
    """A validated output constraint (hashable: the grammar cache's key).

    Attributes:
        kind: one of ``KINDS``.
        spec: ``json``: the schema as canonical JSON text (sorted keys, compact); ``regex``:
            the pattern; ``choice``: the choices as a JSON list; ``grammar``: the EBNF text;
            ``json_object``: ``""``.
        client_param: the request field the client gave it as (``guided_regex``'s wire name
            ``structured_outputs.regex``, ``sampling_parameters.guided_decoding.regex``), which
            every error about it names (``param``); None: ``structured_outputs.<kind>``. Data
            about the request, not the constraint: equality and the hash (the grammar cache's
            key) leave it out.
        backend: ``"guidance"``: llguidance fills its masks whatever the kind; None (the
            client's ``"auto"`` or nothing): xgrammar where `xgrammar_schema` allows it.
    Raises:
        RequestError: (``invalid_value``, param ``param``) an unknown kind, or a schema /
            pattern / grammar that llguidance refuses (its reason quoted).
    """

    kind: str
    spec: str = ""
    client_param: str | None = field(default=None, compare=False)
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in (None, "guidance"):
            raise _invalid("structured_outputs.backend", "must be auto or guidance")
        if self.kind not in KINDS:
            raise _invalid("structured_outputs", f"kind must be one of {', '.join(KINDS)}")
        if len(self.spec) > limits.MAX_GRAMMAR_CHARS:
            raise _invalid(
                self.param,
                f"is longer than {limits.MAX_GRAMMAR_CHARS} characters ({len(self.spec)})",
            )
        problem = _number_problem(self)
        if problem is not None:
            raise _invalid(self.param, f"cannot be compiled: {problem}")
        try:  # on a large stack: llguidance recurses per link of a reference chain
            error = on_grammar_stack(_validate, self)
        except (ValueError, RuntimeError) as exc:  # unparsable JSON text or GBNF
            error = str(exc)
        if error:
            raise _invalid(self.param, f"cannot be compiled: {short_reason(error)}")

    @property
    def param(self) -> str:
        """The parameter errors about it name: ``client_param``, or ``structured_outputs.<kind>``
        (``structured_outputs.json``, ...)."""
        return self.client_param or f"structured_outputs.{self.kind}"

    def grammar(self) -> str:
        """The llguidance grammar (its JSON text) of this constraint, not yet validated (the
        constructor validates it; no tokenizer involved).

        Raises:
            ValueError: a schema that is no JSON, no choices, or a grammar that is neither GBNF
                nor Lark.
        """
        import llguidance

        if self.kind == "json":
            schema = strict(json.loads(self.spec))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_classes(self.spec))
        if self.kind == "choice":
            if not json.loads(self.spec):
                raise ValueError("needs at least one choice")
            return llguidance.grammar_from("choice", self.spec)
        return llguidance.grammar_from("grammar", self.spec)

    def xgrammar_schema(self) -> dict[str, Any] | None:
        """The JSON schema that xgrammar fills this constraint's masks from: a ``json``
        constraint of no ``backend`` whose schema stays inside `XGRAMMAR_KEYWORDS` (see
        `in_xgrammar_subset`); None: llguidance fills them."""
        if self.kind != "json" or self.backend is not None:
            return None
        schema = json.loads(self.spec)
        return schema if in_xgrammar_subset(schema) else None

    def to_wire(self) -> dict[str, Any]:
        """The wire object (see the module docstring) of this constraint."""
        wire: dict[str, Any]
        if self.kind == "json":
            wire = {"json": json.loads(self.spec)}
        elif self.kind == "json_object":
            wire = {"json_object": True}
        elif self.kind == "choice":
            wire = {"choice": json.loads(self.spec)}
        else:
            wire = {self.kind: self.spec}
        if self.backend is not None:
            wire["backend"] = self.backend
        return wire

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
                f"{param}.backend={short_repr(backend)} is not supported (only auto or guidance)",
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
        return cls.build(kind, spec, f"{param}.{kind}", None if backend == "auto" else backend)

    @classmethod
    def build(
        cls, kind: str, spec: Any, param: str, backend: str | None = None
    ) -> StructuredOutputs:
        """A constraint of ``kind`` from its client value (a schema dict or JSON text, a
        pattern, a list of choices, EBNF text, ``True`` for ``json_object``), with the
        client's ``backend`` (None or ``"guidance"``).

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
            # Not sorted: the grammar writes properties in this text's order (the client's).
            text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
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
        # Its errors, now and while generating, name ``param``.
        return cls(kind, text, param, backend)


# The keywords of the JSON schemas whose masks xgrammar fills (`in_xgrammar_subset`): each one
# of them xgrammar 0.2.9 enforces in full, with the same output shape as llguidance under
# `JSON_OPTIONS` and `strict` (compact separators, no properties beyond the declared ones).
XGRAMMAR_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "enum",
        "const",
        "title",
        "description",
    }
)
_XGRAMMAR_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_XGRAMMAR_ENUM_KEYWORDS = frozenset({"enum", "const", "type", "title", "description"})
_JSON_SCALARS: dict[str | None, tuple[type, ...]] = {
    None: (str, int, float, bool, type(None)),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _of_type(value: Any, kind: Any) -> bool:
    """Whether ``value`` is a JSON scalar of JSON Schema type ``kind`` (None: of any scalar
    type); a bool is no integer or number here, as in JSON Schema."""
    types = _JSON_SCALARS.get(kind) if isinstance(kind, str) or kind is None else None
    if types is None or not isinstance(value, types):
        return False
    return kind in (None, "boolean") or not isinstance(value, bool)


def in_xgrammar_subset(schema: Any) -> bool:
    """Whether xgrammar fills the masks of JSON ``schema`` (`StructuredOutputs.xgrammar_schema`):
    every subschema has only `XGRAMMAR_KEYWORDS`, one ``type`` (or one ``enum`` / ``const`` of
    strings, numbers, booleans and null, beside at most a ``type`` that each of its values has
    and annotations), objects with ``properties``, arrays with ``items``,
    ``required`` names it declares, no
    ``additionalProperties`` but ``false``, ``items`` of one subschema, non-negative integer
    length and count bounds, and integer ``minimum`` / ``maximum`` on integers only (a bounded
    number keeps llguidance: `strict` gives it the 6-decimal ``multipleOf``). Anything else, a
    ``pattern`` or a ``$ref`` say, keeps llguidance, which implements more of JSON Schema."""
    if not isinstance(schema, dict) or not schema.keys() <= XGRAMMAR_KEYWORDS:
        return False
    kind = schema.get("type")
    if "enum" in schema or "const" in schema:
        # xgrammar 0.2.9 builds an enum's or a const's grammar from its values alone and drops
        # every other keyword beside it (a maxLength, a minimum, the type itself), so those go
        # to llguidance; a type stays here only when every value already is of that type.
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return (
            schema.keys() <= _XGRAMMAR_ENUM_KEYWORDS
            and ("enum" not in schema or "const" not in schema)
            and isinstance(values, list)
            and bool(values)
            and all(_of_type(v, kind) for v in values)
        )
    if not isinstance(kind, str) or kind not in _XGRAMMAR_TYPES:
        return False
    # An object without properties or an array without items: llguidance's open defaults
    # (any members) and xgrammar's strict mode differ there.
    if (kind == "object" and not schema.get("properties")) or (
        kind == "array" and "items" not in schema
    ):
        return False
    if any(k in schema for k in ("minimum", "maximum")):
        bounds = [schema.get(k, 0) for k in ("minimum", "maximum")]
        if kind != "integer" or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in bounds
        ):
            return False
    for key in ("minItems", "maxItems", "minLength", "maxLength"):
        if key in schema and not _count(schema[key]):
            return False
    if schema.get("additionalProperties", False) is not False:
        return False
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(
        in_xgrammar_subset(s) for s in properties.values()
    ):
        return False
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(
        isinstance(n, str) and n in properties for n in required
    ):
        return False
    return "items" not in schema or in_xgrammar_subset(schema["items"])


# Keywords whose value is one subschema / a list of them / a map of names to them.
_SUBSCHEMA = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# The shorthand classes of ECMA-262 (JSON Schema's regex dialect) are ASCII; llguidance's regex
# engine (Rust's `regex`) reads Unicode ones, so `\d` would allow every script's digits.
_ASCII_CLASSES = {"d": "0-9", "w": "A-Za-z0-9_"}


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d`` / ``\\w`` as ASCII classes (``[0-9]`` / ``[A-Za-z0-9_]``, their
    ranges inside a ``[...]`` class) and ``\\D`` / ``\\W`` outside one as their complements;
    every other escape, an escaped backslash included, is kept as it is."""
    out: list[str] = []
    in_class, i = False, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            ranges = _ASCII_CLASSES.get(nxt.lower())
            if ranges is not None and (nxt.islower() or not in_class):
                out.append(ranges if in_class else f"[{'' if nxt.islower() else '^'}{ranges}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            if pattern[i + 1 : i + 2] == "^":  # a leading ^ (and then ]) is part of the class
                out.append("^")
                i += 1
            if pattern[i + 1 : i + 2] == "]":
                out.append("]")
                i += 1
        elif ch == "]" and in_class:
            in_class = False
            out.append(ch)
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _room_for_decimals(schema: Mapping[str, Any]) -> bool:
    """Whether a number schema has a bound and its range holds many multiples of 1e-6: a range
    narrower than 1e-3 (or bounds that are not numbers) keeps the client's schema as it is, so
    the added ``multipleOf`` never makes a satisfiable schema unsatisfiable."""
    bounds = {k: schema[k] for k in _NUMBER_BOUNDS if k in schema}
    if not bounds:
        return False
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in bounds.values()):
        return False
    low = [bounds[k] for k in ("minimum", "exclusiveMinimum") if k in bounds]
    high = [bounds[k] for k in ("maximum", "exclusiveMaximum") if k in bounds]
    return not (low and high) or min(high) - max(low) >= 1e-3


def strict(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` (a JSON schema, not changed) with xgrammar's strict-mode defaults made
        explicit, for llguidance, which follows JSON Schema's open defaults: an object schema with
        ``properties``, ``patternProperties`` or ``required`` and neither ``additionalProperties``
        nor ``unevaluatedProperties`` gets ``additionalProperties: false``; an array schema with
        ``prefixItems`` and neither ``items`` nor ``unevaluatedItems`` gets ``items: false``. A
        given ``unevaluatedProperties`` / ``unevaluatedItems`` (which llguidance does not implement)
        becomes ``additionalProperties`` / ``items`` when that is absent: the same outside
        ``allOf``. A required name that ``properties`` lacks is declared (any value). A ``number``
        with a bound and no ``multipleOf`` gets ``multipleOf: 1e-6`` (xgrammar writes a bounded
        number with at most 6 decimals, so a model cannot write digits forever; not where the range
    is narrower than 1e-3). Members of
        an ``allOf`` stay open (a closed member would refuse the others'
        properties; xgrammar allows extra properties there too)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = strict(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(s, key == "allOf") for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(s) for name, s in out[key].items()}
    if "unevaluatedProperties" in out:
        value = out.pop("unevaluatedProperties")
        out.setdefault("additionalProperties", value)
    if "unevaluatedItems" in out:
        value = out.pop("unevaluatedItems")
        if "prefixItems" in out:
            out.setdefault("items", value)
        elif "items" not in out:
            out["items"] = value
    if in_all_of:
        return out
    if "additionalProperties" not in out and any(
        k in out for k in ("properties", "patternProperties", "required")
    ):
        out["additionalProperties"] = False
        required = out.get("required")
        if isinstance(required, list):  # a required name not declared: any value, as xgrammar
            props = dict(out.get("properties") or {})
            extra: dict[str, Any] = {
                n: {} for n in required if isinstance(n, str) and n not in props
            }
            out["properties"] = props | extra  # declared order first: the output's order
    if "prefixItems" in out and "items" not in out:
        out["items"] = False
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ascii_classes(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {
            ascii_classes(k): v for k, v in out["patternProperties"].items()
        }
    types = out.get("type")
    is_number = types == "number" or (isinstance(types, list) and "number" in types)
    if is_number and "multipleOf" not in out and _room_for_decimals(out):
        out["multipleOf"] = 1e-6  # a bounded number: at most 6 decimals, as xgrammar's
    return out


# Numbers of a JSON schema (a grammar's %json one too) that llguidance 1.9.1 cannot take
# (found 2026-12-08 by fuzzing it):
# - an integer from 2^64 up it refuses; one from -2^63 + 512 down (a float64 rounds it to
#   -2^63) crashes its validation (SIGSEGV: `{"enum": [-2**63]}`);
# - a ``multipleOf`` m = c * 10^e (c without trailing zeros) it validates at once, but builds
#   each matcher in time and memory growing with c, without end at 2^31 (BENCHMARKS.md,
#   "multipleOf and llguidance's matcher builds"); up to MAX_MULTIPLE_OF_DIGITS is served.
MAX_MULTIPLE_OF_DIGITS = 10_000
_INTEGER_LITERAL = re.compile(r"(?<![\w.])-?[0-9]{19,}(?![\w.])")
_MULTIPLE_OF = re.compile(r'"multipleOf"\s*:\s*(-?[0-9][0-9.eE+-]*)')


def _out_of_range(value: int) -> bool:
    return value >= 2**64 or float(value) <= -(2.0**63)


def _multiple_of_digits(value: float) -> int:
    """c of ``value`` = c * 10^e, c an integer without trailing zeros (0 for 0 or no finite
    number)."""
    try:
        digits = decimal.Decimal(repr(value)).normalize().as_tuple().digits
    except (decimal.InvalidOperation, ValueError):
        return 0
    return int("".join(map(str, digits)) or "0")


def _number_problem(constraint: StructuredOutputs) -> str | None:
    """Why llguidance cannot take a number of ``constraint``'s schema (any place: a bound, an
    enum value, a default) or of a grammar's text, or None."""
    if constraint.kind == "grammar":
        integers = [int(m) for m in _INTEGER_LITERAL.findall(constraint.spec)]
        multiples = []
        for m in _MULTIPLE_OF.findall(constraint.spec):
            try:
                multiples.append(float(m) if set(m) & set(".eE") else int(m))
            except ValueError:  # not a number: llguidance's parser reports it
                pass
    elif constraint.kind == "json":
        integers, multiples = [], []
        try:
            stack = [json.loads(constraint.spec)]
        except ValueError:  # no JSON: llguidance's parser reports it
            return None
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack.extend(value.values())
                bound = value.get("multipleOf")
                if isinstance(bound, (int, float)) and not isinstance(bound, bool):
                    multiples.append(bound)
            elif isinstance(value, list):
                stack.extend(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                integers.append(value)
    else:
        return None
    wide = next((v for v in integers if _out_of_range(v)), None)
    if wide is not None:
        return (
            f"the integer {wide} is outside the range the grammar library takes (above"
            " -2^63 + 512 and below 2^64)"
        )
    costly = next((m for m in multiples if _multiple_of_digits(m) > MAX_MULTIPLE_OF_DIGITS), None)
    if costly is not None:
        return (
            f"multipleOf {costly} is not supported: written as c * 10^e, c must be at most"
            f" {MAX_MULTIPLE_OF_DIGITS:,} (the grammar library's build for it grows with c)"
        )
    return None


def _validate(constraint: StructuredOutputs) -> str:
    """llguidance's reason to refuse ``constraint``'s grammar ("" when it takes it)."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(constraint.grammar())


def short_reason(error: str) -> str:
    """llguidance's error message without the parser state and grammar it appends (``<state>``
    and ``<grammar>`` blocks: internal details), at most 300 characters."""
    for block in ("<state>", "<grammar>"):
        error = error.split(block, 1)[0]
    return error.strip()[:300]


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_VALUE, param, f"{param} {message}")


__all__ = ["KINDS", "XGRAMMAR_KEYWORDS", "StructuredOutputs", "in_xgrammar_subset"]
