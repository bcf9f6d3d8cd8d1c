"""Tool-call parsers: the model's own tool-call syntax → OpenAI ``tool_calls``, streamed or not.

One parser per template family, behind a registry (``TOOL_PARSERS``, chosen with the sidecar's
``--tool-call-parser``, as vLLM's option of that name):

- ``hermes``: Hermes / Qwen2.5 / Qwen3 (and this service's fallback rendering for templates
  without tools, ``tritonllm.tokenization.tools``): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the blocks is
  content. Streamed incrementally: content up to a ``<tool_call>`` tag, then the call's name as
  soon as it is complete, then its arguments' JSON text as it arrives. Whitespace around the
  blocks is not content once the output has calls (``HermesParser``), streamed or not.
- ``llama3_json``: Llama 3.x JSON calls: the whole output is ``{"name": ..., "parameters":
  {...}}`` (several separated by ``;``); an output that does not start with ``{`` is content.
  Streamed once complete (the output is held while it may be a call).

A parser is fed text deltas (``feed``) and ended (``finish``); both return a ``ParsedDelta``:
content text plus ``ToolCallDelta``s in OpenAI's streamed format (a call's first delta has its
index, id, type and name; later ones only argument fragments). The whole output parses with the
same code (``parse_output``), so streamed and non-streamed calls agree. A block that turns out
not to be a valid call is returned as content, as vLLM's parsers do.
"""

from __future__ import annotations

import json
import re
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
# A call's head up to its arguments' first character (so a stream never splits what it matches).
_NAME = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _JsonValueScanner:
    """Finds where a JSON object value ends in text that arrives in pieces (string-aware)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def scan(self, text: str) -> int:
        """Consume ``text``; return how many of its characters belong to the value."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
            elif self.depth == 0 and not ch.isspace():
                return i  # not an object: the caller gives up on this call
        return len(text)


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (module docstring).

    Content is the text outside the blocks (and any block that is no valid call). Once the
    output has a call, content is trimmed as ``str.strip`` would trim it: the ``"\\n"`` between
    two blocks, after the last one or before the first text after a call is no content, so
    an output of calls alone has none, streamed or not. Streamed, a whitespace run is held
    until text that is not whitespace follows (then it is content) or the output ends (then it
    is content only when there was no call). Whitespace before text that precedes the first
    call is content (it goes out before any call is known), whole output or streamed alike.
    """

    def __init__(self) -> None:
        self._buf = ""  # text not yet emitted or decided
        self._in_call = False
        self._raw = ""  # the current block's text (content again if it is no valid call)
        self._index = -1
        self._named = False
        self._args: _JsonValueScanner | None = None
        self._args_text = ""
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
                self._in_call, self._raw, self._named = True, _START, False
                self._args, self._args_text = None, ""
                continue
            if not self._call_step(out):
                break
        return out

    def _call_step(self, out: ParsedDelta) -> bool:
        """Advance inside a block; False when more text is needed."""
        if not self._named:
            match = _NAME.match(self._buf)
            if match is None:
                end = self._buf.find(_END)
                if end >= 0:  # a block without a recognisable call: content
                    self._content(out, self._raw + self._buf[: end + len(_END)])
                    self._buf = self._buf[end + len(_END) :]
                    self._in_call = False
                    return True
                return False
            self._index += 1
            self._named = True
            self._args = _JsonValueScanner()
            name = json.loads(f'"{match.group(1)}"')
            out.calls.append(ToolCallDelta(self._index, "", new_call_id(), name))
            self._raw += self._buf[: match.end()]
            self._buf = self._buf[match.end() :]
            return True
        assert self._args is not None
        if not self._args.done:
            n = self._args.scan(self._buf)
            piece, self._buf = self._buf[:n], self._buf[n:]
            if piece:
                self._args_text += piece
                out.calls.append(ToolCallDelta(self._index, piece))
            if not self._args.done:
                return bool(self._buf)  # not an object value: wait for the end tag below
        end = self._buf.find(_END)
        if end < 0:
            return False
        self._buf = self._buf[end + len(_END) :]
        self._in_call = False
        return True

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call and not self._named:
            self._content(out, self._raw + self._buf)  # an unfinished block that named no call
        elif not self._in_call:
            self._content(out, self._buf)
        if self._index < 0:
            out.content += self._space  # no calls: the content exactly as generated
        self._buf = self._space = ""
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
                obj = json.loads(part)
            except json.JSONDecodeError:
                return ParsedDelta(text)
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ParsedDelta(text)
            arguments = json.dumps(args if args is not None else {}, ensure_ascii=False)
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
    "get_tool_parser",
    "merge_calls",
    "new_call_id",
    "parse_output",
]
