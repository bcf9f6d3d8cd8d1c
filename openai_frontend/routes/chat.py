"""POST /v1/chat/completions: OpenAI chat JSON → ``llm`` ensemble (``messages``) → JSON or SSE.

Tool calls (``tools.ToolFields``): ``auto`` outputs go through the server's tool-call parser,
streamed as OpenAI's ``delta.tool_calls`` (a call's id, type and name first, then its
arguments' fragments); a named choice streams its arguments as they are generated; a
``required`` choice's JSON array is parsed once the choice finished and sent as whole calls.
An output cut by ``max_tokens`` (finish_reason ``length``) loses nothing it generated, as
OpenAI keeps a cut output: a named call keeps the arguments as generated (incomplete JSON), and
a ``required`` array that was cut, no list of calls, is the content (``tools.constrained_calls``),
streamed and not.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from ..errors import OpenAIError
from ..generation import Choice, Generation
from ..logprobs import chat_logprobs
from ..protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    DeltaMessage,
    FunctionCall,
    ToolCall,
)
from ..sampling import chat_inputs
from ..structured import rename_param
from ..tool_parsers import ToolCall as ParsedCall
from ..tool_parsers import ToolCallDelta, get_tool_parser, new_call_id, parse_output
from ..tools import ToolMode, constrained_calls
from .common import collect_choices, get_state, start_generation
from .sse import ChunkEncoder, stream_response

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletion | EventSourceResponse:
    """Generate the assistant's reply (``n`` of them); stream SSE chunks when ``stream``.

    Raises:
        OpenAIError: before the first byte (see ``start_generation``); later errors of a
            stream are sent in-band.
    """
    mode = body.tool_mode()

    def rename(exc: OpenAIError) -> None:  # a constraint error names the client's field
        tool = body.tool_constraint(mode)
        rename_param(exc, body, tool[0] if tool is not None else None)

    try:
        gen = await start_generation(request, body, "chatcmpl", "messages", chat_inputs)
    except OpenAIError as exc:
        rename(exc)
        raise
    state = get_state(request)
    if body.stream:
        choice = ChatChunkChoice(delta=DeltaMessage())
        template = ChatCompletionChunk(id=gen.request_id, model=state.model_name, choices=[choice])
        prompt_usage = gen.usage if body.continuous_usage else None
        encoder = ChunkEncoder(template, body.include_usage, prompt_usage)
        events = _events(gen, encoder, mode, state.tool_call_parser)
        return stream_response(gen, events, encoder, rename)
    try:
        choices = await collect_choices(request, gen)
    except OpenAIError as exc:  # a choice's constraint failed while generating
        rename(exc)
        raise
    return ChatCompletion(
        id=gen.request_id,
        model=state.model_name,
        choices=[_choice(i, c, mode, state.tool_call_parser) for i, c in enumerate(choices)],
        usage=gen.usage,
    )


def _finish_reason(reason: str | None, mode: ToolMode, called: bool) -> str | None:
    # OpenAI: "tool_calls" when the model called tools on its own or had to; "stop" for a
    # forced (named) function.
    if called and reason == "stop" and mode.kind in ("auto", "required"):
        return "tool_calls"
    return reason


def _choice(index: int, c: Choice, mode: ToolMode, parser: str) -> ChatChoice:
    content: str | None = c.text
    calls: list[ParsedCall] | None = None
    if mode.kind == "auto":
        # The parser's content, whitespace around the calls left out (as streamed: HermesParser).
        content, calls = parse_output(get_tool_parser(parser), c.text)
        calls = calls[:1] if calls and not mode.parallel else calls
        content = content or None if calls else content
    elif mode.kind in ("named", "required"):
        calls = constrained_calls(mode, c.text)
        content = None if calls is not None else c.text
    tool_calls = None
    if calls:
        tool_calls = [
            ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
            for t in calls
        ]
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=content, tool_calls=tool_calls),
        logprobs=chat_logprobs(c.logprobs),
        finish_reason=_finish_reason(c.finish_reason, mode, bool(calls)),
    )


class _ChoiceStream:
    """One streamed choice's tool-call state: what each text delta becomes."""

    def __init__(self, mode: ToolMode, parser: str) -> None:
        self.mode = mode
        self.parser = get_tool_parser(parser) if mode.kind == "auto" else None
        self.buffer: list[str] = []  # required: the whole JSON array
        self.called = False
        self.named_id = new_call_id() if mode.kind == "named" else None

    def start(self) -> list[dict[str, Any]]:
        """Deltas before any text (a named call's head)."""
        if self.named_id is None:
            return []
        self.called = True
        return [_calls_delta([ToolCallDelta(0, "", self.named_id, self.mode.name)])]

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.parser is not None:
            parsed = self.parser.feed(text)
            return self._parsed(parsed.content, parsed.calls)
        if self.mode.kind == "named":
            return [_calls_delta([ToolCallDelta(0, text)])] if text else []
        if self.mode.kind == "required":
            self.buffer.append(text)
            return []
        return [{"content": text}]

    def finish(self) -> list[dict[str, Any]]:
        if self.parser is not None:
            parsed = self.parser.finish()
            return self._parsed(parsed.content, parsed.calls)
        if self.mode.kind != "required":
            return []
        text = "".join(self.buffer)
        calls = constrained_calls(self.mode, text)
        if calls is None:
            return [{"content": text}] if text else []
        self.called = bool(calls)
        return [
            _calls_delta([ToolCallDelta(i, c.arguments, c.id, c.name)]) for i, c in enumerate(calls)
        ]

    def _parsed(self, content: str, calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
        if not self.mode.parallel:
            calls = [c for c in calls if c.index == 0]
        out = [{"content": content}] if content else []
        if calls:
            self.called = True
            out.append(_calls_delta(calls))
        return out


def _calls_delta(calls: list[ToolCallDelta]) -> dict[str, Any]:
    return {"tool_calls": [c.openai() for c in calls]}


async def _events(
    gen: Generation, encoder: ChunkEncoder, mode: ToolMode, parser: str
) -> AsyncGenerator[str, None]:
    # OpenAI's chunk sequence per choice: the role first, content (or tool-call) deltas, then
    # an empty delta that carries finish_reason. Deltas are written as dicts: unset fields are
    # left out, not null. Chunks carry the logprobs of their tokens (also when a token
    # completes no character yet and the content is ""); a response whose tokens have no
    # entries (the stop token alone) adds no chunk.
    streams = [_ChoiceStream(mode, parser) for _ in range(gen.n)]
    for index, stream in enumerate(streams):
        yield encoder.event(index=index, delta={"role": "assistant", "content": ""})
        for delta in stream.start():
            yield encoder.event(index=index, delta=delta)
    async for piece in gen.deltas():
        stream = streams[piece.index]
        deltas = stream.feed(piece.text) if piece.text else []
        if piece.finish_reason:
            deltas += stream.finish()
        logprobs = chat_logprobs(piece.logprobs)
        if piece.logprobs and not deltas:
            deltas = [{"content": ""}]
        tokens = piece.num_output_tokens
        for j, delta in enumerate(deltas):
            yield encoder.event(
                index=piece.index,
                logprobs=logprobs if j == 0 else None,
                num_output_tokens=tokens,
                delta=delta,
            )
        if piece.finish_reason:
            reason = _finish_reason(piece.finish_reason, mode, stream.called)
            yield encoder.event(reason, index=piece.index, num_output_tokens=tokens, delta={})
