"""``make chat``: a terminal chat with the service, through its OpenAI API.

    python -m tritonllm.chat [--url http://127.0.0.1:9000/v1] [--model DIR] [--temperature T]
                             [--top-p P] [--max-tokens N] [--system TEXT] [--api-key KEY]

The counterpart of mini-sglang's ``--shell``. It talks to the service at ``--url``; when nothing
answers there (and the URL is on this machine), it starts one with ``python -m tritonllm.launch``
on that port (``--model``, else the built-in default model, converted first if needed) and stops
it on exit. Each reply streams as it is generated (``/v1/chat/completions`` with ``stream``), the
conversation is kept and sent with every turn, and after each reply one line reports its tokens,
tokens/s (the decode rate after the first token) and the time to the first token (TTFT).

API key (sent as ``Authorization: Bearer``): ``--api-key``, else the first of
``TRITONLLM_API_KEY``'s comma-separated keys (the variable ``make serve`` and the launcher read),
else ``OPENAI_API_KEY``, else none. A service the chat starts requires that same key (none: no
key). A service that refuses the request (401 without the right key, 503 while it drains, ...)
ends the chat with a one-line error and exit status 1.

Commands: ``/reset`` forgets the conversation (not the system prompt), ``/system <text>`` sets
the system prompt (``/system`` alone clears it) and starts over, ``/exit`` quits (so does
Ctrl-D). Ctrl-C during a reply stops it: the HTTP stream is closed, which makes the sidecar
abort the generation and free its KV cache; what arrived stays in the conversation.
Ctrl-C at the prompt only clears the line.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import openai
from openai.types.chat import ChatCompletionMessageParam

from tritonllm.triton_server import (
    REPO_ROOT,
    start_process_group,
    stop_process_group,
    wait_http_ok,
)

DEFAULT_URL = "http://127.0.0.1:9000/v1"
# The service's API keys, comma-separated (the launcher's and the sidecar's variable).
API_KEY_ENV = "TRITONLLM_API_KEY"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
HELP = "/reset, /system <text>, /exit; Ctrl-C stops a reply, Ctrl-D exits"
# Tokens per reply unless --max-tokens says otherwise: a small model at temperature 0 can
# repeat itself until the service's limit (16,384 tokens, minutes on a CPU).
DEFAULT_MAX_TOKENS = 512


@dataclass
class ReplyStats:
    """What one reply took.

    Attributes:
        text: the reply text received (all of it, or what arrived before Ctrl-C).
        completion_tokens: tokens generated (from the stream's usage; None when stopped).
        finish_reason: ``"stop"``, ``"length"``, ... (None when stopped).
        ttft_s: seconds from the request to the first text (None without any).
        total_s: seconds from the request to the end of the stream.
        decode_s: seconds from the first text to the end.
        stopped: Ctrl-C ended the reply.
    """

    text: str
    completion_tokens: int | None
    finish_reason: str | None
    ttft_s: float | None
    total_s: float
    decode_s: float
    stopped: bool

    def summary(self) -> str:
        """The line printed after the reply."""
        if self.stopped:
            return f"[stopped after {self.total_s:.2f} s: generation aborted]"
        tokens = self.completion_tokens or 0
        rate = (tokens - 1) / self.decode_s if tokens > 1 and self.decode_s > 0 else 0.0
        ttft = f"{self.ttft_s:.2f} s" if self.ttft_s is not None else "-"
        return (
            f"[{tokens} tokens, {rate:.1f} tokens/s, TTFT {ttft}, "
            f"finish_reason {self.finish_reason}]"
        )


@dataclass(frozen=True)
class Sampling:
    """The sampling settings sent with every request (None: the service's default)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None


@dataclass
class Conversation:
    """The messages sent with each turn: an optional system prompt, then the turns."""

    system: str | None = None
    turns: list[ChatCompletionMessageParam] = field(default_factory=list)

    def messages(self) -> list[ChatCompletionMessageParam]:
        head: list[ChatCompletionMessageParam] = (
            [{"role": "system", "content": self.system}] if self.system else []
        )
        return head + self.turns


def _given(value):
    return openai.omit if value is None else value


def stream_reply(
    client: openai.OpenAI,
    model: str,
    messages: list[ChatCompletionMessageParam],
    sampling: Sampling,
    out: TextIO,
) -> ReplyStats:
    """Stream one assistant reply to ``out``; Ctrl-C (KeyboardInterrupt) stops it.

    Closing the stream closes the HTTP connection: the sidecar sees the disconnect and aborts
    the generation (ARCHITECTURE.md, the sidecar's abort on disconnect).

    Raises:
        openai.APIError: the service refused the request or failed.
    """
    start = time.perf_counter()
    first = None
    parts: list[str] = []
    usage, finish, stream = None, None, None
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            temperature=_given(sampling.temperature),
            top_p=_given(sampling.top_p),
            max_tokens=_given(sampling.max_tokens),
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    parts.append(choice.delta.content)
                    out.write(choice.delta.content)
                    out.flush()
                finish = choice.finish_reason or finish
        stopped = False
    except KeyboardInterrupt:
        stopped = True
        if stream is not None:
            stream.close()
    end = time.perf_counter()
    return ReplyStats(
        text="".join(parts),
        completion_tokens=None if stopped or usage is None else usage.completion_tokens,
        finish_reason=None if stopped else finish,
        ttft_s=None if first is None else first - start,
        total_s=end - start,
        decode_s=0.0 if first is None else end - first,
        stopped=stopped,
    )


def run_chat(
    client: openai.OpenAI,
    model: str,
    sampling: Sampling,
    system: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """The read-reply loop until ``/exit`` or end of input; returns the exit status."""
    conversation = Conversation(system=system)
    print(f"chatting with {model} at {client.base_url} ({HELP})", file=out, flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:  # Ctrl-D
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit quits)", file=out, flush=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command, _, argument = text.partition(" ")
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                conversation.turns.clear()
                print("(conversation cleared)", file=out, flush=True)
            elif command == "/system":
                conversation.system = argument.strip() or None
                conversation.turns.clear()
                shown = conversation.system or "none"
                print(f"(system prompt: {shown}; conversation cleared)", file=out, flush=True)
            else:
                print(f"(unknown command {command}; {HELP})", file=out, flush=True)
            continue
        conversation.turns.append({"role": "user", "content": line})
        try:
            stats = stream_reply(client, model, conversation.messages(), sampling, out)
        except openai.APIError as exc:
            conversation.turns.pop()
            print(f"\n(error: {exc})", file=out, flush=True)
            continue
        conversation.turns.append({"role": "assistant", "content": stats.text})
        print(f"\n{stats.summary()}", file=out, flush=True)


@dataclass(frozen=True)
class ApiKey:
    """The API key the chat sends, and where it came from.

    Attributes:
        value: the key (None: none; the client then sends a placeholder, which only a
            service without keys accepts).
        source: ``--api-key``, ``TRITONLLM_API_KEY`` or ``OPENAI_API_KEY`` (None without a key).
    """

    value: str | None = field(default=None, repr=False)
    source: str | None = None


def resolve_api_key(flag: str | None, environ: Mapping[str, str]) -> ApiKey:
    """The key to send: ``--api-key``, else the first of ``TRITONLLM_API_KEY``'s comma-separated
    keys, else ``OPENAI_API_KEY``, else none. ``TRITONLLM_API_KEY`` comes before the generic
    ``OPENAI_API_KEY`` (often a key of api.openai.com): it is the one this project's service
    requires, a service ``make serve`` or the chat started from the same shell included."""
    if flag:
        return ApiKey(flag, "--api-key")
    first = next((k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()), None)
    if first:
        return ApiKey(first, API_KEY_ENV)
    if environ.get("OPENAI_API_KEY"):
        return ApiKey(environ["OPENAI_API_KEY"], "OPENAI_API_KEY")
    return ApiKey()


def refusal(url: str, status: int, detail: str, key: ApiKey) -> str:
    """The one-line error for a service at ``url`` that answered ``GET models`` with HTTP
    ``status`` (an error; ``detail``: its message): a 401 says how to give the key, a 404 that
    ``--url`` is the OpenAI base URL."""
    if status == 401 and key.value is None:
        return (
            f"error: the service at {url} needs an API key (401): pass --api-key KEY or set "
            f"{API_KEY_ENV}"
        )
    if status == 401:
        return (
            f"error: the service at {url} refused the API key from {key.source} (401): pass the "
            f"right one with --api-key KEY or {API_KEY_ENV}"
        )
    hint = " (is --url its OpenAI base URL, ending in /v1?)" if status == 404 else ""
    return f"error: the service at {url} answered {status} to GET models: {detail}{hint}"


def _service_alive(client: openai.OpenAI, key: ApiKey) -> str | None:
    """The served model's name, or None when nothing answers at the client's URL.

    Raises:
        SystemExit: the service answered with an error status (``refusal``'s message).
    """
    try:
        return client.with_options(timeout=5.0).models.list().data[0].id
    except openai.APIConnectionError:
        return None
    except openai.APIStatusError as exc:
        # An OpenAI error body is {"error": {"message": ...}}; anything else: the status' reason.
        error = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else None
        detail = error.get("message") if isinstance(error, dict) else None
        detail = detail if isinstance(detail, str) and detail else exc.response.reason_phrase
        url = str(client.base_url).rstrip("/")
        raise SystemExit(refusal(url, exc.status_code, detail, key)) from None


def service_env(key: ApiKey, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a service the chat starts: ``environ`` with ``TRITONLLM_API_KEY``
    set to the key the chat sends (removed without one), so the service requires that key."""
    env = {k: v for k, v in environ.items() if k != API_KEY_ENV}
    return {**env, API_KEY_ENV: key.value} if key.value is not None else env


@contextmanager
def local_service(
    url: str, model: str | None, serve_args: list[str], timeout_s: float, env: dict[str, str]
):
    """Start ``python -m tritonllm.launch`` serving at ``url``'s port, in environment ``env``
    (``service_env``'s); stop it on exit.

    Raises:
        SystemExit: the URL is not on this machine, or the service did not come up.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname not in LOCAL_HOSTS:
        raise SystemExit(f"error: no service answers at {url} (and it is not on this machine)")
    if model is None:
        from tritonllm.default_model import ensure_default_model

        try:
            model = str(ensure_default_model())  # its progress bar shows here, not in a log
        except FileNotFoundError as exc:
            raise SystemExit(f"error: {exc}") from None
    port = parsed.port or 80
    command = [sys.executable, "-m", "tritonllm.launch", f"--model={model}", f"--port={port}"]
    log = Path(tempfile.mkstemp(prefix="tritonllm-chat-serve-", suffix=".log")[1])
    print(f"no service at {url}: starting one (log: {log}) ...", flush=True)
    process = start_process_group(command + serve_args, log, env, REPO_ROOT)
    try:
        health = f"{parsed.scheme}://{parsed.hostname}:{port}/health"
        try:
            wait_http_ok(health, timeout_s, process, "the service")
        except RuntimeError as exc:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"error: {exc}\n{tail}") from None
        yield
    finally:
        stop_process_group(process, 60.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The chat's flags; exits with usage on bad flags."""
    p = argparse.ArgumentParser(
        prog="python -m tritonllm.chat", description=__doc__.splitlines()[0]
    )
    p.add_argument("--url", default=DEFAULT_URL, help="the service's OpenAI base URL")
    p.add_argument("--model", default=None, help="model directory to serve if none runs")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"the service's API key (default: the first of ${API_KEY_ENV}'s comma-separated "
        "keys, else $OPENAI_API_KEY, else none); a service the chat starts requires it",
    )
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"per reply (default {DEFAULT_MAX_TOKENS}, so a model that repeats itself stops; "
        "0: the service's limit)",
    )
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-start", action="store_true", help="never start a service")
    p.add_argument(
        "--serve-args",
        default="",
        help='launcher flags when the chat starts the service, e.g. "--grpc-port 8101"',
    )
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Chat until ``/exit`` or Ctrl-D."""
    args = parse_args(argv)
    # Ctrl-C must reach this process even when started with SIGINT ignored (a background job
    # of a non-interactive shell inherits that): it stops a reply.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    key = resolve_api_key(args.api_key, os.environ)
    # The client needs some key: without one, a placeholder only a keyless service accepts.
    client = openai.OpenAI(base_url=args.url, api_key=key.value or "none", max_retries=0)
    sampling = Sampling(args.temperature, args.top_p, args.max_tokens or None)
    name = _service_alive(client, key)
    if name is not None:
        sys.exit(run_chat(client, name, sampling, args.system))
    if args.no_start:
        sys.exit(f"error: no service answers at {args.url}")
    serve_args = shlex.split(args.serve_args)
    env = service_env(key, os.environ)
    with local_service(args.url, args.model, serve_args, args.startup_timeout, env):
        name = _service_alive(client, key)
        if name is None:
            sys.exit(f"error: the service at {args.url} does not answer /v1/models")
        status = run_chat(client, name, sampling, args.system)
    sys.exit(status)


if __name__ == "__main__":
    main()
