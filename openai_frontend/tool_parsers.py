"""Tool-call parsers: the model's own tool-call syntax → OpenAI ``tool_calls``, streamed or not.

One parser per template family, behind a registry (``TOOL_PARSERS``, chosen with the sidecar's
``--tool-call-parser``, as vLLM's option of that name):

- ``hermes``: Hermes / Qwen2.5 / Qwen3 (and this service's fallback rendering for templates
  without tools, ``tritonllm.tokenization.tools``): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the blocks is
  content. A block is a call only if its body is one complete JSON object with a string
  ``name`` and ``arguments`` that are an object, or a string holding an object's JSON (models
  write both); any other block stays content, verbatim (``hermes_call``; vLLM's hermes parser
  is the reference for the behaviour, no code is taken from it).
  Streamed: content goes out as it arrives, up to a ``<tool_call>`` tag; a block is held until
  its ``</tool_call>`` (or the output's end), then sent whole, as one delta with the call's id,
  name and arguments, or as content. Holding it is what keeps a stream correct: the body's
  validity is known only at its end tag (text after the object, or a malformed value, makes it
  content), and a call's name or argument fragments once sent cannot be taken back, so an
  invalid block would have left a half-sent call that the whole response does not have. A
  client runs a call only once it is complete, so what holding costs is the name's early
  display; content around the calls still streams token by token. Whitespace around the
  blocks is not content once the output has calls (``HermesParser``), streamed or not.
- ``llama3_json``: Llama 3.x JSON calls: the whole output is ``{"name": ..., "parameters":
  {...}}`` (several separated by ``;``); an output that does not start with ``{`` is content.
  Streamed once complete (the output is held while it may be a call).

A parser is fed text deltas (``feed``) and ended (``finish``); both return a ``ParsedDelta``:
content text plus ``ToolCallDelta``s in OpenAI's streamed format (a call's first delta has its
index, id, type and name; later ones only argument fragments; both parsers here send a call's
arguments whole in its first delta). The whole output parses with the same code
(``parse_output``), so streamed and non-streamed calls and content agree. A block that is not a
valid call is returned as content, as vLLM's parsers do. A call's ``arguments`` are always the
JSON text of an object (``call_arguments``), re-serialized from what the model wrote.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    """A tool call id (OpenAI's ``call_`` prefix)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One streamed piece of tool call ``index``: the first carries ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        """OpenAI's ``delta.tool_calls[i]`` object."""
        out: dict = {"index": self.index}
        function: dict = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass
class ParsedDelta:
    """What one ``feed`` / ``finish`` produced."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    """A whole parsed call."""

    id: str
    name: str
    arguments: str  # JSON text


class ToolParser:
    """The parser interface (see the module docstring)."""

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        raise NotImplementedError


_START, _END = "<tool_call>", "</tool_call>"


def _no_constant(name: str) -> object:
    # Python's json reads NaN and Infinity, which are no JSON (and could not be sent on).
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> object:
    """``text`` as one strict JSON value. Raises: ValueError (RecursionError: too deep)."""
    return json.loads(text, parse_constant=_no_constant)


def call_arguments(value: object) -> str | None:
    """A call's ``arguments`` as OpenAI sends them: the JSON text of an object.

    Args:
        value: the decoded ``arguments`` (or ``parameters``) value of a model's call: a dict,
            or a string holding an object's JSON text (models write both).
    Returns:
        the object re-serialized (``json.dumps``, non-ASCII kept), or None when ``value`` is
        no object (nor a string that parses to one), or holds a number JSON cannot carry (a
        literal like ``1e400`` reads as an infinity, which strict JSON has no text for): such a
        call is no valid call.
    """
    if isinstance(value, str):
        try:
            value = _loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # an overflowing number literal (QA: arguments '{"n": -Infinity}')
        return None


def hermes_call(body: str) -> tuple[str, str] | None:
    """The ``(name, arguments JSON text)`` of one ``<tool_call>`` block's body, or None.

    A body is a call only if it is one complete JSON object (whitespace around it allowed)
    with a string ``name`` and ``arguments`` (or ``parameters``) that is an object or a string
    holding one (`call_arguments`). Anything else (malformed JSON, text after the object, a
    missing or empty name, arguments of another type, NaN or an overflowing number) is None:
    the block stays content. As in
    vLLM's hermes parser, the block is judged by one JSON parse of its whole text.
    """
    try:
        call = _loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call_arguments(call["arguments"] if "arguments" in call else call.get("parameters"))
    return None if arguments is None else (call["name"], arguments)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (module docstring).

    A block is held from its ``<tool_call>`` to its ``</tool_call>`` (the first one after it)
    or the end of the output, then judged whole (`hermes_call`): a valid call is sent as one
    delta (id, name and all its arguments), anything else as content, verbatim, tags included.

    Content is the text outside the blocks (and any block that is no valid call). Once the
    output has a call, content is trimmed as ``str.strip`` would trim it: the ``"\\n"`` between
    two blocks, after the last one or before the first text after a call is no content, so
    an output of calls alone has none, streamed or not. Streamed, a whitespace run is held
    until text that is not whitespace follows (then it is content) or the output ends (then it
    is content only when there was no call). Whitespace before text that precedes the first
    call is content (it goes out before any call is known), whole output or streamed alike.
    """

    def __init__(self) -> None:
        self._buf = ""  # text not yet emitted or decided (in a block: its body so far)
        self._in_call = False
        self._searched = 0  # characters of a block's body searched for the end tag
        self._index = -1  # the last call's index
        self._space = ""  # content whitespace held (see the class docstring)
        self._wrote = False  # any content other than whitespace emitted

    def _content(self, out: ParsedDelta, text: str) -> None:
        """Emit ``text`` (outside the blocks) as content, holding its trailing whitespace."""
        text = self._space + text
        end = len(text.rstrip())
        body, self._space = text[:end], text[end:]
        if not body:
            return
        if not self._wrote and self._index >= 0:
            body = body.lstrip()  # the first text after a call: its separating whitespace
        self._wrote = True
        out.content += body

    def _block(self, out: ParsedDelta, body: str, end_tag: str) -> None:
        """A whole block (``end_tag`` is "" for one the output ended inside): call or content."""
        call = hermes_call(body)
        if call is None:
            self._content(out, _START + body + end_tag)
            return
        self._index += 1
        out.calls.append(ToolCallDelta(self._index, call[1], new_call_id(), call[0]))

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf:
            if not self._in_call:
                at = self._buf.find(_START)
                if at < 0:
                    keep = _held_prefix(self._buf, _START)
                    self._content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._content(out, self._buf[:at])
                self._buf = self._buf[at + len(_START) :]
                self._in_call, self._searched = True, 0
                continue
            end = self._buf.find(_END, self._searched)
            if end < 0:  # the body so far; an end tag may still be split across feeds
                self._searched = max(0, len(self._buf) - len(_END) + 1)
                break
            self._block(out, self._buf[:end], _END)
            self._buf = self._buf[end + len(_END) :]
            self._in_call = False
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:
            self._block(out, self._buf, "")  # a call only if its body is already whole
        else:
            self._content(out, self._buf)
        if self._index < 0:
            out.content += self._space  # no calls: the content exactly as generated
        self._buf = self._space = ""
        self._in_call = False
        return out


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` (``;``-separated)."""

    def __init__(self) -> None:
        self._buf = ""
        self._content_mode: bool | None = None  # None: undecided (only whitespace so far)

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        if self._content_mode is None and self._buf.strip():
            self._content_mode = not self._buf.lstrip().startswith("{")
        if self._content_mode:
            out, self._buf = ParsedDelta(self._buf), ""
            return out
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        text, self._buf = self._buf, ""
        if self._content_mode or not text.strip():
            return ParsedDelta(text)
        calls = []
        for i, part in enumerate(p for p in text.split(";") if p.strip()):
            try:
                obj = _loads(part)
            except (ValueError, RecursionError):
                return ParsedDelta(text)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ParsedDelta(text)
            args = obj.get("parameters", obj.get("arguments"))
            arguments = call_arguments({} if args is None else args)
            if arguments is None:  # arguments that are no object: no call
                return ParsedDelta(text)
            calls.append(ToolCallDelta(i, arguments, new_call_id(), obj["name"]))
        return ParsedDelta("", calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """A new parser of the registered family ``name``. Raises: KeyError for an unknown one."""
    return TOOL_PARSERS[name]()


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their streamed deltas."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = ToolCall(d.id, d.name or "", d.arguments)
        elif d.index in calls:
            calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def parse_output(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole output, through ``parser``'s streaming code."""
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, merge_calls(first.calls + last.calls)


__all__ = [
    "TOOL_PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "ParsedDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "call_arguments",
    "get_tool_parser",
    "hermes_call",
    "merge_calls",
    "new_call_id",
    "parse_output",
]
