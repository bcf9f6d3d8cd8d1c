"""The platform's own ceiling: how many streamed responses per second Triton's decoupled Python
backend delivers when the model does nothing else.

    python -m benchmarks.ceiling [--concurrency 1,16,64,256] [--ceiling-seconds 4]
        [--ceiling-tokens 128] [--ceiling-client-processes N] [--ceiling-instances 1]
        [--ceiling-sender-threads 4]

A tritonserver on `benchmarks/ceiling_repository` serves `ceiling_stream`, a decoupled Python
model whose sender threads (as many as the generator's: `--ceiling-sender-threads`, default the
generator's 4 with its engine in its own process) stream one-token responses with the
generator's tensors, alone
inside `ceiling_llm`, an ensemble shaped like `llm` (a Python step before it, and one after
it batched as the detokenizer is: one request per response), and inside `ceiling_fused`, shaped
like `llm_fused` (the Python step before it only; the stream answers text itself). At each concurrency level, closed-loop clients
stream requests of `--ceiling-tokens` responses over gRPC with the sidecar's own client
(`openai_frontend.triton_client.TritonClient`, one stream per request), spread over several
client processes so that the client is not what limits; the first requests have staggered
lengths so that the clients do not finish in step. The ceiling of a level is the responses
received during a fixed window (after a short warm-up) over the window's length.
`benchmarks.online --ceiling` runs it in the same command as the served levels and reports the
generator's responses/s as a fraction of the ceiling of the ensemble the sidecar streams from
(`ceiling_fused`, shaped like `llm_fused`) at the same concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import common
from benchmarks.common import fmt, log
from benchmarks.load_probe import process_cpu_seconds
from tritonllm.cli_types import positive_int
from tritonllm.triton_config import ServingConfig

REPOSITORY = Path(__file__).resolve().parent / "ceiling_repository"
STREAM_MODEL = "ceiling_stream"
ENSEMBLE_MODEL = "ceiling_llm"
FUSED_MODEL = "ceiling_fused"
MODES = {"alone": STREAM_MODEL, "ensemble": ENSEMBLE_MODEL, "fused": FUSED_MODEL}
PROMPT = "ceiling " * 64  # 512 bytes, 512 ids through ceiling_pre
VOCAB = 151936  # = ceiling_stream's VOCAB
WARM_S = 0.5  # of each level, before its window opens


@dataclass(frozen=True)
class ClientResult:
    """What one client process saw in a level.

    Attributes:
        responses: responses received inside the window.
        requests: requests that ended (in or after the window).
        errors: one line per failed or wrong stream.
        cpu_s, wall_s: the process' CPU and wall seconds from its start to its last stream's end.
    """

    responses: int
    requests: int
    errors: tuple[str, ...]
    cpu_s: float
    wall_s: float


@dataclass(frozen=True)
class CeilingLevel:
    """One model at one concurrency.

    Attributes:
        mode: "alone" (`ceiling_stream`), "ensemble" (`ceiling_llm`) or "fused"
            (`ceiling_fused`).
        window_s: the counting window (seconds).
        client_cores: CPU cores the client processes used together while they ran.
        client_max_cores: the busiest client process' cores (near 1.0: the client limited).
        server_cpu: CPU cores per server process over the level (`LoadProbe.report`'s "cpu").
    """

    mode: str
    concurrency: int
    responses: int
    requests: int
    errors: tuple[str, ...]
    window_s: float
    client_cores: float
    client_max_cores: float
    server_cpu: str

    @property
    def responses_per_s(self) -> float:
        """Responses received in the window over its length."""
        return self.responses / self.window_s


def _check(chunks: int, last, length: int, num_input: int, ensemble: bool) -> str | None:
    """Why a finished stream is wrong, or None: `length` responses, the last one counting
    `length` tokens with finish_reason "length" (and, through an ensemble, its token written
    out, by ceiling_post or by the stream itself)."""
    if chunks != length or last is None:
        return f"{chunks} responses, expected {length}"
    if last.num_output_tokens != length or last.finish_reason != "length":
        return f"last response: {last.num_output_tokens} tokens, {last.finish_reason!r}"
    if ensemble and last.text != str((num_input + 7919 * (length - 1)) % VOCAB):
        return f"last text {last.text!r}"
    return None


async def _clients(
    url: str, mode: str, first: int, count: int, total: int, tokens: int, times: tuple
) -> ClientResult:
    from openai_frontend.triton_client import TritonClient, TritonError

    start_at, window_start, window_end = times
    ensemble = mode != "alone"
    if ensemble:
        inputs, num_input = {"text_input": PROMPT}, len(PROMPT.encode())
    else:
        inputs, num_input = {"input_ids": list(range(512))}, 512
    client = TritonClient(url, model=MODES[mode])
    await client.input_specs()
    responses = requests = 0
    errors: list[str] = []

    async def loop(i: int) -> None:
        nonlocal responses, requests
        length = max(1, tokens * (i + 1) // total)  # staggered first request
        n = 0
        while time.monotonic() < window_end:
            stream = await client.stream(f"{mode}-{i}-{n}", {**inputs, "max_tokens": length})
            chunks, last = 0, None
            try:
                while (chunk := await stream.read()) is not None:
                    chunks += 1
                    if window_start <= time.monotonic() < window_end:
                        responses += 1
                    last = chunk
            except TritonError as exc:
                errors.append(f"client {i} request {n}: {exc.message}")
                return
            problem = _check(chunks, last, length, num_input, ensemble)
            if problem:
                errors.append(f"client {i} request {n}: {problem}")
            requests += 1
            n += 1
            length = tokens

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(loop(first + j) for j in range(count))),
            window_end - time.monotonic() + 120,
        )
    except asyncio.TimeoutError:
        errors.append("streams still open 120 s after the window closed")
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    await client.close()
    return ClientResult(responses, requests, tuple(errors), cpu, wall)


def _client_process(*args) -> ClientResult:
    return asyncio.run(_clients(*args))


def _ready() -> None:
    import openai_frontend.triton_client  # noqa: F401  (imported once, before any window)


class CeilingServer:
    """tritonserver on a copy of the ceiling repository, and a pool of client processes.

    A context manager: entering starts both (RuntimeError with the server log's tail when the
    server does not come up); leaving stops them and removes the copy.

    Args:
        instances: `ceiling_stream` instances.
        sender_threads: sender threads of each instance (`CEILING_SENDER_THREADS`).
        client_processes: most client processes per level (a level of concurrency c uses
            min(c, client_processes)).
        log_path: the server's log (default: a temporary file).
    """

    def __init__(
        self,
        instances: int = 1,
        client_processes: int = 4,
        log_path: Path | None = None,
        sender_threads: int = 1,
    ) -> None:
        self.instances, self.client_processes, self.log_path = instances, client_processes, log_path
        self.sender_threads = sender_threads

    def __enter__(self) -> CeilingServer:
        from tritonllm.triton_server import TritonServer, repository_with_instances

        self._tmp = tempfile.TemporaryDirectory(prefix="ceiling-")
        tmp = Path(self._tmp.name)
        repo = repository_with_instances(REPOSITORY, STREAM_MODEL, self.instances, tmp)
        self.server = TritonServer(
            model_repository=repo,
            log_path=self.log_path,
            env={"CEILING_SENDER_THREADS": str(self.sender_threads)},
        )
        self.pool = None
        try:
            self.server.start(timeout=180)
            ctx = multiprocessing.get_context("spawn")
            self.pool = concurrent.futures.ProcessPoolExecutor(self.client_processes, ctx)
            for f in [self.pool.submit(_ready) for _ in range(self.client_processes)]:
                f.result()
        except BaseException:
            if self.server.process is not None:
                print(self.server.log_tail(), file=sys.stderr)
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        self.server.stop()
        self._tmp.cleanup()

    def level(self, mode: str, concurrency: int, tokens: int, seconds: float) -> CeilingLevel:
        """Run `concurrency` closed-loop clients of `mode` (a key of `MODES`) for a
        `seconds` window after `WARM_S` of warm-up; clients start no request after the window
        and read every stream to its end (a cancelled ensemble stream leaks in Triton 2.51).

        Raises:
            KeyError: unknown mode. ValueError: concurrency, tokens or seconds not positive.
        """
        if concurrency < 1 or tokens < 1 or seconds <= 0:
            raise ValueError(f"concurrency {concurrency}, tokens {tokens}, seconds {seconds}")
        if mode not in MODES:
            raise KeyError(f"mode must be one of {list(MODES)}, got {mode!r}")
        procs = min(concurrency, self.client_processes)
        sizes = [concurrency // procs + (p < concurrency % procs) for p in range(procs)]
        start_at = time.monotonic() + 0.3
        times = (start_at, start_at + WARM_S, start_at + WARM_S + seconds)
        pgids = [self.server.process.pid]
        cpu0, wall0 = process_cpu_seconds(pgids), time.monotonic()
        futures, first = [], 0
        for size in sizes:
            args = (self.server.grpc_url, mode, first, size, concurrency, tokens, times)
            futures.append(self.pool.submit(_client_process, *args))
            first += size
        results = [f.result() for f in futures]
        client = [r.cpu_s / r.wall_s if r.wall_s > 0 else 0.0 for r in results]
        wall = time.monotonic() - wall0
        cores = {k: (v - cpu0.get(k, 0.0)) / wall for k, v in process_cpu_seconds(pgids).items()}
        server_cpu = ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(cores.items(), key=lambda kv: -kv[1]) if v >= 0.01
        )
        return CeilingLevel(
            mode=mode,
            concurrency=concurrency,
            responses=sum(r.responses for r in results),
            requests=sum(r.requests for r in results),
            errors=tuple(e for r in results for e in r.errors),
            window_s=seconds,
            client_cores=sum(client),
            client_max_cores=max(client),
            server_cpu=server_cpu,
        )


def run_ceiling(
    concurrency: list[int],
    seconds: float = 4.0,
    tokens: int = 128,
    client_processes: int = 4,
    instances: int = 1,
    log_path: Path | None = None,
    sender_threads: int = 1,
) -> dict[str, dict[int, CeilingLevel]]:
    """Every level of `concurrency` for every mode (after one short warm-up stream each), with
    `instances` instances of `ceiling_stream` of `sender_threads` sender threads each.

    Returns:
        mode (a key of `MODES`) -> concurrency -> its `CeilingLevel`.
    Raises:
        RuntimeError: the server did not start, or a warm-up stream failed.
    """
    out: dict[str, dict[int, CeilingLevel]] = {mode: {} for mode in MODES}
    with CeilingServer(instances, client_processes, log_path, sender_threads) as bench:
        for mode in MODES:
            warm = bench.level(mode, 1, 8, 0.2)
            if warm.errors or not warm.requests:
                raise RuntimeError(f"ceiling warm-up ({mode}) failed: {warm.errors}")
            for c in concurrency:
                out[mode][c] = level = bench.level(mode, c, tokens, seconds)
                log(
                    f"ceiling {mode}, concurrency {c}: {level.responses_per_s:,.0f} responses/s, "
                    f"client {level.client_cores:.2f} cores, {len(level.errors)} errors"
                )
    return out


def report(levels: dict[str, dict[int, CeilingLevel]]) -> str:
    """The markdown table: one row per concurrency, every mode."""
    headers = [
        "concurrency",
        "alone: responses/s",
        "ensemble (llm-shaped): responses/s",
        "fused (llm_fused-shaped): responses/s",
        "ensemble / alone",
        "fused / alone",
        "requests (failed) alone / ensemble / fused",
        "client CPU cores (busiest process) alone / ensemble / fused",
        "server CPU cores per process (ensemble)",
    ]

    def ratio(level: CeilingLevel, alone: CeilingLevel) -> str:
        return f"{level.responses_per_s / alone.responses_per_s:.0%}" if alone.responses else "-"

    rows = []
    for c, alone in levels["alone"].items():
        ens, fused = levels["ensemble"][c], levels["fused"][c]
        rows.append(
            [
                str(c),
                fmt(alone.responses_per_s, 0),
                fmt(ens.responses_per_s, 0),
                fmt(fused.responses_per_s, 0),
                ratio(ens, alone),
                ratio(fused, alone),
                " / ".join(f"{x.requests} ({len(x.errors)})" for x in (alone, ens, fused)),
                " / ".join(
                    f"{x.client_cores:.2f} ({x.client_max_cores:.2f})" for x in (alone, ens, fused)
                ),
                ens.server_cpu,
            ]
        )
    return common.markdown_table(headers, rows)


def notes(args: argparse.Namespace) -> list[str]:
    """The section notes of a ceiling run with `args` (`add_arguments`' flags)."""
    return [
        f"ceiling: {args.ceiling_instances} instance(s) of ceiling_stream "
        f"({args.ceiling_sender_threads} sender thread(s) each, the generator's tensors per "
        "one-token response: 4, 6 in a stream's first and last), alone, as the middle step "
        f"of ceiling_llm (shaped like llm) and as the last step of ceiling_fused (shaped like "
        f"llm_fused); closed-loop gRPC streams of {args.ceiling_tokens} "
        f"responses from {client_processes(args)} client processes (at most); responses "
        f"counted in a {args.ceiling_seconds:g} s window after {WARM_S:g} s of warm-up",
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ceiling's flags (shared with `benchmarks.online --ceiling`)."""
    p.add_argument("--ceiling-seconds", type=float, default=4.0, help="window per level (s)")
    p.add_argument("--ceiling-tokens", type=positive_int, default=128)
    p.add_argument(
        "--ceiling-client-processes",
        type=positive_int,
        default=None,
        help="client processes per level, at most (default: 2 per server instance, at least 4)",
    )
    p.add_argument("--ceiling-instances", type=positive_int, default=1)
    p.add_argument(
        "--ceiling-sender-threads",
        type=positive_int,
        default=ServingConfig().senders(own_process=True),
        help="sender threads per ceiling_stream instance (default: the generator's, with its "
        "engine in its own process as on a GPU)",
    )
    p.add_argument("--ceiling-log", help="the ceiling server's log file (default: a temp file)")


def client_processes(args: argparse.Namespace) -> int:
    """``--ceiling-client-processes``, or by default 2 per server instance and at least 4: at 4
    instances 4 client processes were not enough (the busiest used 1.1 cores, BENCHMARKS.md,
    "The benchmark's client, and instances")."""
    if args.ceiling_client_processes is not None:
        return args.ceiling_client_processes
    return max(4, 2 * args.ceiling_instances)


def from_args(args: argparse.Namespace) -> dict[str, dict[int, CeilingLevel]]:
    """`run_ceiling` with `add_arguments`' flags and `args.concurrency`."""
    return run_ceiling(
        args.concurrency,
        args.ceiling_seconds,
        args.ceiling_tokens,
        client_processes(args),
        args.ceiling_instances,
        Path(args.ceiling_log) if args.ceiling_log else None,
        args.ceiling_sender_threads,
    )


def main(argv: list[str] | None = None) -> dict[str, dict[int, CeilingLevel]]:
    """Run the ceiling alone, print its table and append it to BENCHMARKS.md (unless
    `--no-append`). Returns `run_ceiling`'s levels."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--concurrency", default="1,16,64,256", type=lambda s: [int(c) for c in s.split(",")]
    )
    add_arguments(p)
    p.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    p.add_argument("--benchmarks-md", default=str(common.BENCHMARKS_MD))
    args = p.parse_args(argv)
    args.device = common.default_device()  # for the hardware line only
    levels = from_args(args)
    common.publish("Platform ceiling", report(levels), notes(args), args)
    return levels


if __name__ == "__main__":
    main(sys.argv[1:])
