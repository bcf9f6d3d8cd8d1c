"""Closed-loop streaming OpenAI clients and their per-request timings (TTFT, TPOT, chunk ITL).

Clients speak plain HTTP + server-sent events through `httpx` (lighter per chunk than the
`openai` package). Token counts come from the final `usage` chunk
(`stream_options.include_usage`); chunks may carry several tokens, so TPOT is per request,
`(last chunk - first chunk) / (completion tokens - 1)`, and chunk ITL is the raw gap
between text-carrying chunks.

One asyncio process was what limited a 256-client level (it read the chunks late and in bursts,
which adds to TTFT and hides chunk gaps: BENCHMARKS.md, "The benchmark's client, and
instances"), so `ClientPool` spreads a level's clients over several processes.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """Client-side timings of one streamed request (seconds, `time.perf_counter`).

    Attributes:
        chunk_times: arrival of each chunk that carried text.
        completion_tokens, prompt_tokens: from the final `usage` chunk.
    """

    max_tokens: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Time to the first text chunk (seconds); None without one."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """(last chunk - first chunk) / (completion tokens - 1): time per output token."""
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    @property
    def chunk_gaps(self) -> list[float]:
        """Gaps between consecutive text chunks (seconds): chunk ITL."""
        return [b - a for a, b in zip(self.chunk_times[:-1], self.chunk_times[1:], strict=True)]


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level: its records and the level's wall time (first send to last end)."""

    concurrency: int
    records: list[RequestRecord]
    seconds: float

    @property
    def ok(self) -> list[RequestRecord]:
        """The requests that succeeded."""
        return [r for r in self.records if r.error is None]

    @property
    def output_tokens(self) -> int:
        """Completion tokens of the successful requests."""
        return sum(r.completion_tokens for r in self.ok)

    @property
    def output_tokens_per_s(self) -> float:
        """`output_tokens` per second of the level's wall time."""
        return self.output_tokens / self.seconds

    @property
    def tokens_per_chunk(self) -> float | None:
        """Mean completion tokens per text chunk; None without chunks."""
        chunks = sum(len(r.chunk_times) for r in self.ok)
        return self.output_tokens / chunks if chunks else None


def chunk_text(event: dict[str, Any]) -> str:
    """The text an SSE event adds (chat `delta.content` or completions `text`); "" if none."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
    return text or ""


async def stream_request(
    client: Any, url: str, body: dict[str, Any], record: RequestRecord
) -> RequestRecord:
    """POST one streaming request and fill `record` from its server-sent events.

    Chunks with no text (the role-only first chat chunk, the usage chunk) carry no token time.
    """
    record.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"])[:200]
                    break
                if chunk_text(event):
                    record.chunk_times.append(time.perf_counter())
                usage = event.get("usage")
                if usage:
                    record.completion_tokens = usage["completion_tokens"]
                    record.prompt_tokens = usage["prompt_tokens"]
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, not fatal)
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    if record.error is None and record.completion_tokens != record.max_tokens:
        record.error = f"{record.completion_tokens} completion tokens, expected {record.max_tokens}"
    return record


def request_body(
    model: str, text: str, max_tokens: int, temperature: float, endpoint: str
) -> dict[str, Any]:
    """The JSON body of one streamed request (`endpoint` `chat` or `completions`) that must
    generate exactly `max_tokens` tokens (`ignore_eos`), with a final usage chunk."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def run_level(
    base_url: str,
    model: str,
    texts: list[str],
    output_lens: list[int],
    concurrency: int,
    temperature: float = 0.6,
    endpoint: str = "chat",
) -> LevelResult:
    """`concurrency` closed-loop clients stream the requests in order; all are awaited."""
    import httpx

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    records = [RequestRecord(max_tokens=n) for n in output_lens]
    next_index = iter(range(len(texts)))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=1800) as client:

        async def client_loop() -> None:
            for i in next_index:  # a shared iterator: each index is taken by one client
                body = request_body(model, texts[i], output_lens[i], temperature, endpoint)
                await stream_request(client, path, body, records[i])

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return LevelResult(concurrency, records, seconds)


# Seconds a `ClientPool` waits for all its workers to have started.
WORKER_START_TIMEOUT_S = 120.0


def _start_worker(started: Any) -> None:
    """A `ClientPool` worker's initializer: import what a level needs, then wait until every
    worker of the pool is up (`started`, a barrier over them)."""
    import httpx  # noqa: F401

    started.wait(WORKER_START_TIMEOUT_S)


def _level_share(args: tuple) -> tuple[list[RequestRecord], float]:
    """A `ClientPool` worker's share of a level: its records and its CPU seconds for them."""
    cpu = time.process_time()
    result = asyncio.run(run_level(*args))
    return result.records, time.process_time() - cpu


class ClientPool:
    """Closed-loop clients spread over `processes` worker processes (started and warmed up
    before the first level, reused by every level), so that reading the streams is not what
    limits a level.

    A level uses `n = min(processes, concurrency, requests)` workers. Client slot `k` (of
    `concurrency`) belongs to worker `k % n`, and request `i` to the worker of slot
    `i % concurrency`, so each worker's share of the requests matches its share of the clients;
    a worker's clients take its requests in order. `time.perf_counter` is the system's monotonic
    clock, so the records of all workers share one time line.

    Args:
        processes: worker processes (>= 1); 1 runs each level in the calling process.
    Raises:
        ValueError: `processes` < 1.
    """

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = processes
        self.cpu_s = 0.0  # the workers' CPU seconds over the levels so far
        self._executor: ProcessPoolExecutor | None = None
        if processes > 1:
            context = multiprocessing.get_context("spawn")
            self._executor = ProcessPoolExecutor(
                processes,
                mp_context=context,
                initializer=_start_worker,
                initargs=(context.Barrier(processes),),
            )
            # With no worker idle yet, each call starts one more (a spawn pool's workers start
            # on demand), and none runs before all have started and imported httpx: all are up
            # before a level's window opens.
            for future in [self._executor.submit(time.sleep, 0) for _ in range(processes)]:
                future.result()

    async def run_level(
        self,
        base_url: str,
        model: str,
        texts: list[str],
        output_lens: list[int],
        concurrency: int,
        temperature: float = 0.6,
        endpoint: str = "chat",
    ) -> LevelResult:
        """`run_level` over the workers; records in the order of `texts`."""
        if self._executor is None:
            return await run_level(
                base_url, model, texts, output_lens, concurrency, temperature, endpoint
            )
        n = min(self.processes, concurrency, len(texts))
        owned: list[list[int]] = [[] for _ in range(n)]
        for i in range(len(texts)):
            owned[(i % concurrency) % n].append(i)
        loop = asyncio.get_running_loop()
        shares = [
            loop.run_in_executor(
                self._executor,
                _level_share,
                (
                    base_url,
                    model,
                    [texts[i] for i in indices],
                    [output_lens[i] for i in indices],
                    len(range(p, concurrency, n)),
                    temperature,
                    endpoint,
                ),
            )
            for p, indices in enumerate(owned)
        ]
        records: list[RequestRecord] = [RequestRecord(max_tokens=m) for m in output_lens]
        for indices, (share, cpu) in zip(owned, await asyncio.gather(*shares), strict=True):
            for i, record in zip(indices, share, strict=True):
                records[i] = record
            self.cpu_s += cpu
        started = [r.start for r in records if r.start]
        seconds = max(r.end for r in records) - min(started) if started else 0.0
        return LevelResult(concurrency, records, seconds)

    def close(self, kill: bool = False) -> None:
        """Stop the workers; with `kill` (an interrupted or failed run) without waiting for the
        levels they may still be running."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        if not kill:
            executor.shutdown(wait=True)
            return
        processes = list(getattr(executor, "_processes", {}).values())  # CPython's pool
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(5)

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(kill=exc_type is not None)


def served_model_name(base_url: str) -> str:
    """The first model `GET /v1/models` lists. Raises: OSError when the sidecar is unreachable."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]
