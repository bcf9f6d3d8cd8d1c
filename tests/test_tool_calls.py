"""Tool calling's parts without a server: the tool-call parsers (each supported template
family, whole outputs and streamed in any split, OpenAI's delta order: id, type and name first,
then argument fragments; a block that is no valid call stays content; streamed token by token,
the same content as the whole output, without the whitespace around calls) and the chat
rendering of tools and tool-call history (the Qwen3 template renders them; a template without
tools gets the Hermes-format fallback messages); ``required`` and named outputs cut short keep
all their text (a cut array as content, a cut call's incomplete arguments)."""

from __future__ import annotations

import copy
import json

import pytest

from openai_frontend.tool_parsers import (
    TOOL_PARSERS,
    call_arguments,
    get_tool_parser,
    hermes_call,
    merge_calls,
    parse_output,
)
from tritonllm.tokenization.chat import render_chat

WEATHER = {"city": "Paris", "units": {"c": True, "list": [1, 2, "x}"]}}
HERMES_OUT = (
    "Let me check.\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": WEATHER})
    + "\n</tool_call>\n<tool_call>\n"
    + json.dumps({"name": "get_time", "arguments": {"tz": "CET"}})
    + "\n</tool_call>"
)
LLAMA_OUT = (
    json.dumps({"name": "get_weather", "parameters": WEATHER})
    + "; "
    + json.dumps({"name": "get_time", "parameters": {"tz": "CET"}})
)
FAMILIES = {"hermes": (HERMES_OUT, "Let me check.\n"), "llama3_json": (LLAMA_OUT, "")}


def _stream(parser_name: str, text: str, size: int):
    parser = get_tool_parser(parser_name)
    content, deltas = "", []
    for i in range(0, len(text), size):
        out = parser.feed(text[i : i + size])
        content, deltas = content + out.content, deltas + out.calls
    out = parser.finish()
    return content + out.content, deltas + out.calls


@pytest.mark.parametrize("family", sorted(TOOL_PARSERS))
def test_parsers_read_each_familys_calls_whole_and_streamed_alike(family):
    text, expected_content = FAMILIES[family]
    content, calls = parse_output(get_tool_parser(family), text)
    assert content.strip() == expected_content.strip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", WEATHER),
        ("get_time", {"tz": "CET"}),
    ]
    assert all(c.id.startswith("call_") for c in calls)
    for size in (1, 3, 7, 1000):
        s_content, deltas = _stream(family, text, size)
        assert s_content.strip() == expected_content.strip(), size
        merged = merge_calls(deltas)
        assert [(c.name, json.loads(c.arguments)) for c in merged] == [
            (c.name, json.loads(c.arguments)) for c in calls
        ]
        # OpenAI's order: each call's first delta has id, type and name; then only arguments.
        seen: set[int] = set()
        for d in deltas:
            wire = d.openai()
            if d.index not in seen:
                assert wire["id"].startswith("call_") and wire["type"] == "function"
                assert wire["function"]["name"] in ("get_weather", "get_time")
                seen.add(d.index)
            else:
                assert set(wire) == {"index", "function"} and set(wire["function"]) == {"arguments"}
        assert seen == {0, 1}


def test_hermes_holds_a_block_until_its_end_tag_and_a_split_tag():
    parser = get_tool_parser("hermes")
    # the tag's start is held, not content (and the space before it, until text follows)
    assert parser.feed("Hi <tool_").content == "Hi"
    out = parser.feed('call>{"name": "f", "arguments": {"a"')
    assert (out.content, out.calls) == ("", [])  # no part of a block before its end tag
    out = parser.feed(": 1}}</tool_")
    assert (out.content, out.calls) == ("", [])
    rest = parser.feed("call> bye")
    (call,) = rest.calls  # the whole call in one delta: id, name and all its arguments
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "f", {"a": 1})
    assert call.openai()["id"].startswith("call_") and call.openai()["type"] == "function"
    end = parser.finish()
    assert end.calls == [] and (rest.content + end.content).strip() == "bye"


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all, just <b>text</b>",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "argu',
    ],
)
def test_hermes_text_without_a_valid_call_is_content(text):
    content, calls = parse_output(get_tool_parser("hermes"), text)
    assert calls == [] and content == text


# Blocks that are no valid call (the body is no one JSON object with a string name and object
# arguments): each stays content, verbatim, streamed or not, and no call delta is ever sent.
INVALID_BLOCKS = [
    # malformed JSON (a bare word, and the outer object left open)
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
    # a string that is no JSON object, and other values that are no object
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": "[1, 2]"}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": null}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather"}\n</tool_call>',  # no arguments
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # a name that is no string
    '<tool_call>\n[{"name": "f", "arguments": {}}]\n</tool_call>',  # no object
    # text after the object, or two objects
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}}{"name": "g", "arguments": {}}</tool_call>',
    # NaN and Infinity are no JSON (Python's json reads them)
    '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": -Infinity}"}\n</tool_call>',
    # a number too large for a float reads as an infinity, which JSON cannot write back (QA:
    # arguments '{"n": -Infinity}' went to the client), as an object or inside a string
    '<tool_call>\n{"name": "f", "arguments": {"n": -1e400}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": "{\\"n\\": 1e999}"}\n</tool_call>',
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',  # an empty name (OpenAI: 1..64)
    # the first end tag closes the block, also inside a string
    '<tool_call>{"name": "f", "arguments": {"html": "</tool_call>"}}</tool_call>',
    "<tool_call></tool_call>",
]


def _chunkings(tokenizer, text: str) -> list[list[str]]:
    """``text`` split as a stream may deliver it: whole, per token, per 1, 3 and 7 chars."""
    sized = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 3, 7)]
    return [[text], _token_pieces(tokenizer, text), *sized]


def _feed_all(parser_name: str, pieces: list[str]):
    """(content, call deltas in the order sent) of an output fed as ``pieces``, then ended."""
    parser = get_tool_parser(parser_name)
    content, deltas = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content, deltas = content + out.content, deltas + out.calls
    out = parser.finish()
    return content + out.content, deltas + out.calls


@pytest.mark.parametrize("block", INVALID_BLOCKS)
@pytest.mark.parametrize("around", [("", ""), ("Checking.\n", "\nDone.")])
def test_hermes_an_invalid_block_stays_content_verbatim_streamed_or_not(tokenizer, block, around):
    text = around[0] + block + around[1]
    content, calls = parse_output(get_tool_parser("hermes"), text)
    assert (content, calls) == (text, [])
    for pieces in _chunkings(tokenizer, text):
        assert _feed_all("hermes", pieces) == (text, []), pieces


STRING_ARGUMENTS = (  # the tester's case: the arguments' JSON as a string
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>'
)


def test_hermes_arguments_given_as_a_json_string_become_the_object(tokenizer):
    """The arguments are the object the string holds, re-serialized: never the string's JSON,
    nor text past the object (the closing tag); streamed in any split, the same call."""
    assert json.loads(STRING_ARGUMENTS[12:-13]) == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    content, calls = parse_output(get_tool_parser("hermes"), STRING_ARGUMENTS)
    expected = [("get_weather", '{"city": "Paris"}')]
    assert content == "" and [(c.name, c.arguments) for c in calls] == expected
    for pieces in _chunkings(tokenizer, STRING_ARGUMENTS):
        s_content, deltas = _feed_all("hermes", pieces)
        assert s_content == "" and [(d.name, d.arguments) for d in deltas] == expected, pieces


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


A_CALL, B_CALL = _call("get_weather", WEATHER), _call("get_time", {"tz": "CET"})
# (a model's output, its content): OpenAI's content of an output with calls has no whitespace
# that only separates or trails them; an output without calls is content exactly as generated.
WHITESPACE_CASES = [
    (A_CALL + "\n" + B_CALL, ""),  # QA D7: a "\n" content chunk between two streamed calls
    ("\n" + A_CALL + "\n\n" + B_CALL + "\n", ""),
    ("Let me check.\n" + A_CALL + "\n" + B_CALL + "\n", "Let me check."),
    (A_CALL + "\n\nDone.\n", "Done."),
    ("A\n" + A_CALL + "\nB \n" + B_CALL + "\n", "A\n\nB"),
    ("<tool_call>not json</tool_call>\n" + A_CALL + "\n", "<tool_call>not json</tool_call>"),
    ("\n\nSure.\n" + A_CALL, "\n\nSure."),  # sent before any call is known
    ("\n  no calls, spaces kept \n\n", "\n  no calls, spaces kept \n\n"),
    (" \n ", " \n "),
]


def _token_pieces(tokenizer, text: str) -> list[str]:
    """``text`` as the detokenizer streams it: one piece per token of the model's tokenizer."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for i in range(len(ids)):
        upto = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        pieces.append(upto[len(done) :])
        done = upto
    assert done == text
    return pieces


@pytest.mark.parametrize(("text", "expected"), WHITESPACE_CASES)
def test_hermes_streamed_token_by_token_gives_the_whole_outputs_content(tokenizer, text, expected):
    """Streamed and non-streamed responses agree: the same content (no whitespace-only chunk
    between or after calls) and the same calls, fed one token (or character) at a time."""
    content, calls = parse_output(get_tool_parser("hermes"), text)
    assert content == expected
    whole = [(c.name, c.arguments) for c in calls]
    for pieces in (_token_pieces(tokenizer, text), list(text)):
        parser = get_tool_parser("hermes")
        chunks, deltas = [], []
        for piece in pieces:
            out = parser.feed(piece)
            chunks.append(out.content)
            deltas += out.calls
        out = parser.finish()
        chunks.append(out.content)
        deltas += out.calls
        assert "".join(chunks) == expected
        if calls:  # no content chunk that is whitespace alone
            assert all(chunk.strip() for chunk in chunks if chunk), chunks
        assert [(c.name, c.arguments) for c in merge_calls(deltas)] == whole


def test_chat_stream_and_whole_response_agree_on_content_between_calls(tokenizer):
    """The chat route's two paths (``_ChoiceStream`` per delta, ``_choice`` whole): an output
    of two calls separated by a newline has null content and no content delta."""
    from openai_frontend.generation import Choice
    from openai_frontend.routes.chat import _choice, _ChoiceStream
    from openai_frontend.tools import ToolMode

    text, mode = A_CALL + "\n" + B_CALL + "\n", ToolMode("auto")
    whole = _choice(0, Choice(text, "stop", None), mode, "hermes")
    assert whole.message.content is None and len(whole.message.tool_calls) == 2
    assert whole.finish_reason == "tool_calls"
    stream = _ChoiceStream(mode, "hermes")
    deltas = [d for piece in _token_pieces(tokenizer, text) for d in stream.feed(piece)]
    deltas += stream.finish()
    assert not [d for d in deltas if "content" in d], deltas
    names = [c["function"]["name"] for d in deltas for c in d["tool_calls"] if "id" in c]
    assert names == [c.function.name for c in whole.message.tool_calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # valid, invalid, valid: the calls numbered 0, 1; the invalid block is content
        (
            "Let me check.\n" + STRING_ARGUMENTS + "\n" + INVALID_BLOCKS[0] + "\n" + B_CALL,
            "Let me check.\n\n" + INVALID_BLOCKS[0],  # the text's whitespace kept ("A\n\nB")
            [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
        ),
        # the output ends inside a block whose body is whole: a call (vLLM's too)
        (A_CALL.removesuffix("</tool_call>"), "", [("get_weather", WEATHER)]),
        # ... or whose body is cut (max_tokens): content, as generated
        (A_CALL[:40], A_CALL[:40], []),
        ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', "", [("f", {"a": 1})]),
    ],
)
def test_hermes_streamed_calls_and_content_equal_the_whole_outputs(tokenizer, text, content, calls):
    whole_content, whole_calls = parse_output(get_tool_parser("hermes"), text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    expected = [(c.name, c.arguments) for c in whole_calls]
    for pieces in _chunkings(tokenizer, text):
        s_content, deltas = _feed_all("hermes", pieces)
        assert s_content == content, pieces
        assert [(c.name, c.arguments) for c in merge_calls(deltas)] == expected, pieces
        assert [d.index for d in deltas] == list(range(len(calls)))  # one whole delta per call


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "f", "arguments": {"a": [1, "x"]}}', ("f", '{"a": [1, "x"]}')),
        (' \n{"name": "f", "arguments": {}}\n', ("f", "{}")),
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', ("f", '{"a": 1}')),
        ('{"name": "f", "arguments": {"é": "ü"}}', ("f", '{"é": "ü"}')),  # not \\u-escaped
        ('{"name": "f", "arguments": {"a":1}, "id": "x"}', ("f", '{"a": 1}')),  # extra key
        ('{"name": "f", "arguments": {"a": 1}', None),
        ('{"name": "f", "arguments": "{\\"a\\": 1"}', None),
        ('{"name": "f", "arguments": "1"}', None),
        ('"f"', None),
        ("[" * 100_000, None),  # too deep for json: no call, no RecursionError
    ],
)
def test_hermes_call_accepts_only_a_whole_object_with_object_arguments(body, expected):
    assert hermes_call(body) == expected
    for value in (None, 1, "x", "[]", [], "null"):
        assert call_arguments(value) is None, value


def _through_the_chat_route(tokenizer, text: str, tool_choice: str, finish_reason: str):
    """``text`` as the chat route answers it (hermes parser): the non-streamed choice, then the
    streamed deltas (fed token by token) and the stream that made them."""
    from openai_frontend.generation import Choice
    from openai_frontend.routes.chat import _choice, _ChoiceStream
    from openai_frontend.tools import ToolMode

    mode = ToolMode(tool_choice)
    whole = _choice(0, Choice(text, finish_reason, None), mode, "hermes")
    stream = _ChoiceStream(mode, "hermes")
    deltas = [d for piece in _token_pieces(tokenizer, text) for d in stream.feed(piece)]
    deltas += stream.finish()
    return whole, deltas, stream


def test_chat_route_returns_an_invalid_block_as_content_streamed_and_not(tokenizer):
    """The chat route's two paths agree on an invalid block: content, no tool_calls, "stop"."""
    text = INVALID_BLOCKS[0]
    whole, deltas, stream = _through_the_chat_route(tokenizer, text, "auto", "stop")
    assert (whole.message.content, whole.message.tool_calls) == (text, None)
    assert whole.finish_reason == "stop"
    assert not stream.called and not [d for d in deltas if "tool_calls" in d]
    assert "".join(d["content"] for d in deltas) == text


def test_llama3_content_that_is_not_a_call_passes_through():
    for text in (
        "Hello {there}",
        '{"not": "a call"}',
        "{broken",
        '{"name": "f", "parameters": [1]}',  # arguments that are no object
        '{"name": "f", "parameters": {"x": NaN}}',
    ):
        content, calls = parse_output(get_tool_parser("llama3_json"), text)
        assert calls == [] and content == text


def test_llama3_arguments_as_a_json_string_become_the_object():
    text = '{"name": "f", "parameters": "{\\"a\\": 1}"}'
    content, calls = parse_output(get_tool_parser("llama3_json"), text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_qwen3_template_renders_tools_calls_and_results(tokenizer):
    prompt = render_chat(tokenizer, HISTORY, tools=TOOLS)
    assert "get_weather" in prompt and "Weather of a city" in prompt  # the tool signature
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_a_template_without_tools_gets_the_hermes_fallback(tokenizer):
    plain = copy.copy(tokenizer)
    plain.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    prompt = render_chat(plain, HISTORY, tools=TOOLS)
    assert "<tools>" in prompt and "Weather of a city" in prompt  # in a system message
    assert prompt.startswith("<|system|>")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert "<|tool|>" not in prompt  # the tool result became a user turn


def test_a_required_choice_keeps_each_tools_defs_and_refs_resolvable():
    """pydantic's nested models give parameters with "$defs" and "#/$defs/..." references; a
    required choice nests every tool's parameters in one schema, where they must still
    resolve (they pointed at the root before: "Pointer '/$defs/d' does not exist")."""
    import jsonschema

    from openai_frontend.tools import ToolFields
    from tritonllm.structured.spec import StructuredOutputs

    place = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "day": {"type": "integer"}},
        "required": ["city", "day"],
    }
    book = {
        "$defs": {"d": place},
        "type": "object",
        "properties": {"frm": {"$ref": "#/$defs/d"}, "to": {"$ref": "#/$defs/d"}},
        "required": ["frm", "to"],
    }
    tree = {  # a recursive reference to the parameters' own root, and a property named "default"
        "type": "object",
        "properties": {
            "default": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["default"],
    }
    fields = ToolFields(
        tools=[
            {"type": "function", "function": {"name": "book", "parameters": book}},
            {"type": "function", "function": {"name": "tree", "parameters": tree}},
        ],
        tool_choice="required",
    )
    param, constraint = fields.tool_constraint(fields.tool_mode())
    schema = constraint["json"]
    StructuredOutputs.build("json", schema, param)  # llguidance compiles it: no RequestError
    good = [
        {
            "name": "book",
            "parameters": {"frm": {"city": "a", "day": 1}, "to": {"city": "b", "day": 2}},
        },
        {"name": "tree", "parameters": {"default": "x", "children": [{"default": "y"}]}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [{"name": "book", "parameters": {"frm": {"city": "a"}, "to": {"city": "b", "day": 2}}}],
        [{"name": "tree", "parameters": {"default": "x", "children": [{"default": 5}]}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert book["properties"]["frm"] == {"$ref": "#/$defs/d"}  # the client's schema unchanged


REQUIRED_OUT = json.dumps(
    [
        {"name": "get_weather", "parameters": {"city": "Pa]r{is", "days": 3}},
        {"name": "get_time", "parameters": {"tz": "CET"}},
    ]
)


def test_a_required_array_is_calls_only_when_whole():
    """A ``required`` choice's output is its calls when it is the whole array; cut anywhere
    short of its end (max_tokens, a stop string) it is no list of calls (None: the route
    returns the text as content)."""
    from openai_frontend.tools import ToolMode, constrained_calls

    mode = ToolMode("required")
    items = json.loads(REQUIRED_OUT)
    calls = constrained_calls(mode, REQUIRED_OUT)
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (i["name"], i["parameters"]) for i in items
    ]
    for cut in range(len(REQUIRED_OUT)):
        assert constrained_calls(mode, REQUIRED_OUT[:cut]) is None, cut
    for text in ("[]", '{"name": "get_time", "parameters": {}}', '[{"parameters": {}}]'):
        assert constrained_calls(mode, text) is None, text


@pytest.mark.parametrize("cut", [1, 20, len(REQUIRED_OUT) - 30, len(REQUIRED_OUT) - 1])
def test_a_required_array_cut_by_max_tokens_is_content_streamed_and_not(tokenizer, cut):
    """OpenAI keeps a cut output: a required array cut by max_tokens (finish_reason
    "length") is returned whole as content, with no tool_calls, by the chat route's two paths
    alike (``_choice`` whole, ``_ChoiceStream`` per delta), wherever the cut falls (inside the
    first call, or after a complete one)."""
    text = REQUIRED_OUT[:cut]
    whole, deltas, stream = _through_the_chat_route(tokenizer, text, "required", "length")
    assert (whole.message.content, whole.message.tool_calls) == (text, None)
    assert whole.finish_reason == "length"
    assert deltas == [{"content": text}] and not stream.called


def test_a_cut_named_call_keeps_its_arguments_as_generated():
    """A named choice's output is its call's arguments: cut short, they stay the call's
    (incomplete) arguments, as streamed, never content."""
    from openai_frontend.tools import ToolMode, constrained_calls

    (call,) = constrained_calls(ToolMode("named", "get_time"), '{"tz": "C')
    assert (call.name, call.arguments) == ("get_time", '{"tz": "C')
