"""Serving benchmark: streaming OpenAI chat clients against tritonserver + the sidecar.

    python -m benchmarks.online [--model DIR] [--concurrency 1,16,64,256]
        [--num-prompts-per-level N] [--device cuda] [--tensor-parallel-size 2]
        [--sidecar-workers 4] [--generator-instances 2] [--max-responses-per-s 0] [--no-append]

For each concurrency level, `c` closed-loop clients stream chat completions (a client sends its
next request when the last one finished) with random prompts and fixed output lengths
(`ignore_eos`, `max_tokens`). Reported: TTFT, TPOT, chunk ITL, output tokens/s, and the offline
engine's tokens/s on the very same prompt ids with the same concurrency cap, measured first in
a subprocess (so its GPU memory is freed before the server starts), in the same run. With
`--ceiling`, the platform ceiling (`benchmarks.ceiling`) too, and the generator's responses/s
against it; `--plots-dir` draws the plots (`benchmarks.plots`). `--tensor-parallel-size N`
splits both engines, the served one and the offline one, across N ranks (GPUs);
`--sidecar-workers N` runs the sidecar this benchmark starts as N processes on its port;
`--generator-instances N` serves the generator of the tritonserver it starts as N Triton
instances (`TritonServer.generator_instances`). What is reported: `benchmarks.online_report`.
With `--triton-url`, the sidecar gets the server's control secret from
`$TRITONLLM_CONTROL_SECRET` (without it the generator refuses its lease and it streams from
`llm`; a run meant for `llm_fused` then stops with an error).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import ceiling, common, online_report
from benchmarks.common import Workload, log
from benchmarks.load_probe import DETOKENIZER_REQUESTS, LoadProbe
from benchmarks.online_report import OnlineRun
from benchmarks.streaming_client import ClientPool, run_level, served_model_name
from openai_frontend.triton_client import FUSED_MODEL
from tritonllm.cli_types import positive_int
from tritonllm.launch import sidecar_command, sidecar_env
from tritonllm.processes import child_pids
from tritonllm.triton_config import serving_config
from tritonllm.triton_server import (
    CONTROL_SECRET_ENV,
    TritonServer,
    free_port,
    start_process_group,
    stop_process_group,
    wait_http_ok,
)


def level_texts(tokenizer: Any, workload: Workload) -> list[str]:
    """Prompt texts: each prompt's random ids decoded (re-encoding gives about as many)."""
    return [tokenizer.decode(p, skip_special_tokens=True) for p in workload.prompts]


def level_workloads(
    args: argparse.Namespace, tokenizer: Any
) -> dict[int, tuple[list[str], Workload]]:
    """Per level: the prompt texts and the workload of the ids the server will see for them.

    Each level draws its own prompts (seed = the level's index), so the prefix cache never
    serves a later level from an earlier one's prompts.
    """
    from tritonllm.tokenization.chat import render_prompt

    out = {}
    for index, c in enumerate(args.concurrency):
        n = args.num_prompts_per_level or max(8, args.prompts_per_client * c)
        raw = common.random_workload(
            n,
            args.min_len,
            args.max_input_len,
            args.max_output_len,
            seed=index,
            min_output_len=args.min_output_len,
        )
        texts = level_texts(tokenizer, raw)
        if args.endpoint == "chat":
            ids = [
                render_prompt(tokenizer, messages=[{"role": "user", "content": t}]) for t in texts
            ]
        else:
            ids = [render_prompt(tokenizer, text_input=t) for t in texts]
        out[c] = (texts, Workload(ids, raw.output_lens))
    return out


def _offline_worker(queue: Any, kwargs: dict[str, Any]) -> None:
    try:
        from benchmarks.offline import run_levels

        runs, step = run_levels(**kwargs, decode_step=True)
        tokens = {c: r.output_tokens_per_s for c, r in runs.items()}
        queue.put((tokens, {c: r.steps / r.seconds for c, r in runs.items()}, step))
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        queue.put(f"{type(exc).__name__}: {exc}")


BUDGET_ENV = "TRITONLLM_MAX_RESPONSES_PER_S"
# Clients per client process by default (no --client-processes): one asyncio process reading
# 256 streams was saturated (BENCHMARKS.md, "The benchmark's client, and instances").
CLIENTS_PER_PROCESS = 64


def response_budget(args: argparse.Namespace) -> float:
    """The generator's response budget (responses/s of all its instances) in the tritonserver
    this benchmark starts: ``--max-responses-per-s``, else ``$TRITONLLM_MAX_RESPONSES_PER_S``
    as the generator reads it (``serving_config``), else ``ServingConfig``'s default.

    Raises:
        ValueError: the environment's value is not a number.
    """
    if args.max_responses_per_s is not None:
        return args.max_responses_per_s
    given = {BUDGET_ENV: os.environ.get(BUDGET_ENV, "")}
    return serving_config({}, given).max_responses_per_s


def engine_args(args: argparse.Namespace) -> dict[str, str]:
    """The `EngineConfig` fields both engines get beyond the defaults: `--engine-arg` and
    `--tensor-parallel-size`."""
    return {**common.engine_args(args), "tensor_parallel_size": str(args.tensor_parallel_size)}


def offline_tokens_per_s(
    args: argparse.Namespace, model: Path, workloads: dict[int, Workload]
) -> tuple[dict[int, float], dict[int, float], float]:
    """The offline engine's output tokens/s per level, its engine steps/s per level, then its
    batch-1 decode step (seconds), run in a spawned subprocess.

    Raises:
        RuntimeError: the subprocess failed (its error message).
    """
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    kwargs = dict(
        model=str(model),
        device=args.device,
        attention_backend=args.attention_backend,
        workloads=workloads,
        temperature=args.temperature,
        engine_args=engine_args(args),
    )
    proc = ctx.Process(target=_offline_worker, args=(queue, kwargs))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, str):
        raise RuntimeError(f"offline engine run failed: {result}")
    return result


class Sidecar:
    """The OpenAI sidecar (`python -m openai_frontend`) on a free local port, in front of the
    tritonserver gRPC endpoint `triton_url`, streaming from `triton_model`, as `workers`
    processes (its `--workers`). A context manager: entering starts it and waits until
    `/health` answers (RuntimeError with its log tail after 120 s); leaving stops its process
    group (its workers stop with it)."""

    def __init__(
        self,
        triton_url: str,
        log_path: Path | None = None,
        triton_model: str | None = None,
        control_secret: str | None = None,
        workers: int = 1,
    ) -> None:
        self.triton_url, self.triton_model, self.workers = triton_url, triton_model, workers
        # The server's control secret: without it the generator refuses the sidecar's lease
        # and the sidecar streams from `llm` whatever `triton_model` says.
        self.control_secret = control_secret
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="sidecar-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Sidecar:
        command = sidecar_command(
            self.triton_url, self.port, triton_model=self.triton_model, workers=self.workers
        )
        env = None if self.control_secret is None else sidecar_env((), self.control_secret)
        self.proc = start_process_group(command, self.log_path, env=env, cwd=common.REPO_ROOT)
        try:
            wait_http_ok(f"{self.base_url}/health", 120, self.proc, "sidecar")
        except RuntimeError as exc:
            self.stop()
            log = self.log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{exc}\n{log}") from exc
        return self

    def pgids(self) -> list[int]:
        """The process groups of the sidecar's processes, for `LoadProbe`: its own, and with
        several workers each worker's (a session of its own: `openai_frontend/workers.py`)."""
        assert self.proc is not None, "not started"
        return [self.proc.pid, *child_pids(self.proc.pid)]

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL after 20 s."""
        stop_process_group(self.proc, 20.0)

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_fused(rates: dict[str, float], concurrency: int) -> None:
    """Raise RuntimeError when a level meant for `llm_fused` went through the detokenizer:
    its requests (one per generator response through `llm`) above a tenth of the generator's
    responses (the sidecar's health probes through `llm` are a few per second). That is the
    sidecar falling back to `llm`, e.g. when it lacks the server's control secret."""
    detokenized = rates.get(DETOKENIZER_REQUESTS, 0.0)
    responses = rates.get("tritonllm_responses_total", 0.0)
    if responses and detokenized > 0.1 * responses:
        raise RuntimeError(
            f"concurrency {concurrency}: the sidecar streamed through llm's detokenizer "
            f"({detokenized:,.0f} requests/s for {responses:,.0f} generator responses/s), not "
            "llm_fused: its lease was refused (does it have the server's control secret, "
            f"${CONTROL_SECRET_ENV}?)"
        )


def client_processes(args: argparse.Namespace) -> int:
    """``--client-processes``, or by default one process per 64 clients of the largest level."""
    if args.client_processes is not None:
        return args.client_processes
    return -(-max(args.concurrency) // CLIENTS_PER_PROCESS)


async def run_levels_online(
    base_url: str,
    level_inputs: dict[int, tuple[list[str], Workload]],
    temperature: float,
    endpoint: str,
    probe: LoadProbe | None = None,
    fused: bool = False,
    clients: ClientPool | None = None,
) -> OnlineRun:
    """Warm up with one short request, then run each level in order. ``fused``: the sidecar
    was asked to stream from `llm_fused` (`check_fused` holds each level to it). ``clients``:
    the processes that run each level's clients (None: this one, ``ClientPool(1)``).

    Returns:
        the results per level and, with a `probe`, its report over each level and the
        generator's responses/s (when the probe reads the generator's metrics).
    """
    clients = clients or ClientPool(1)
    model = served_model_name(base_url)
    warm = await run_level(base_url, model, ["warm up " * 8], [8], 1, temperature, endpoint)
    if warm.records[0].error:
        raise RuntimeError(f"warm-up request failed: {warm.records[0].error}")
    run = OnlineRun({})
    results, loads = run.results, run.loads
    for c, (texts, workload) in level_inputs.items():
        before = probe.snapshot() if probe else None
        results[c] = res = await clients.run_level(
            base_url, model, texts, workload.output_lens, c, temperature, endpoint
        )
        if probe and before:
            after = probe.snapshot()
            loads[c] = probe.report(before, after)
            rates = probe.rates(before, after)
            run.engine_rates[c] = rates
            if "tritonllm_responses_total" in rates:
                run.responses_per_s[c] = rates["tritonllm_responses_total"]
            if fused:
                check_fused(rates, c)
        failed = len(res.records) - len(res.ok)
        log(f"online, concurrency {c}: {res.output_tokens_per_s:,.0f} tok/s, {failed} failed")
        for key, value in loads.get(c, {}).items():
            log(f"  {key}: {value}")
    return run


def serve_and_run(
    args: argparse.Namespace, model: Path, level_inputs: dict[int, tuple[list[str], Workload]]
) -> OnlineRun:
    """Start what `args` does not point at (tritonserver, sidecar), run the levels, stop them.

    Returns `run_levels_online`'s run (CPU per process of what this function started, and the
    generator's time counters when it started tritonserver or `--metrics-url` is given).
    """

    fused = args.triton_model == FUSED_MODEL

    def go(base_url: str, probe: LoadProbe | None = None):
        with ClientPool(client_processes(args)) as clients:
            if probe is not None:
                probe.client_cpu = lambda: clients.cpu_s
            return asyncio.run(
                run_levels_online(
                    base_url, level_inputs, args.temperature, args.endpoint, probe, fused, clients
                )
            )

    if args.openai_url:
        return go(args.openai_url)
    if args.triton_url:
        secret = os.environ.get(CONTROL_SECRET_ENV) or None
        sidecar = Sidecar(args.triton_url, None, args.triton_model, secret, args.sidecar_workers)
        with sidecar:
            return go(sidecar.base_url, LoadProbe(sidecar.pgids(), args.metrics_url))
    env = {
        "TRITONLLM_DEVICE": args.device,
        "TRITONLLM_ATTENTION_BACKEND": args.attention_backend,
        "TRITONLLM_MAX_RUNNING_REQUESTS": str(max(args.concurrency)),
        "TRITONLLM_MAX_MODEL_LEN": "4096",
    }
    env.update({f"TRITONLLM_{k.upper()}": v for k, v in engine_args(args).items()})
    env[BUDGET_ENV] = str(response_budget(args))
    log_path = Path(args.server_log) if args.server_log else None
    instances = args.generator_instances
    server = TritonServer(
        model_path=model, env=env, log_path=log_path, generator_instances=instances
    )
    log(f"starting tritonserver ({env})")
    try:
        server.start(timeout=600)
        log(f"tritonserver ready on {server.grpc_url}; starting the sidecar")
        secret = server.control_secret
        with Sidecar(
            server.grpc_url, None, args.triton_model, secret, args.sidecar_workers
        ) as sidecar:
            pgids = [server.process.pid, *sidecar.pgids()]
            probe = LoadProbe(pgids, server.metrics_url, instances)
            return go(sidecar.base_url, probe)
    except RuntimeError:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()


def run(args: argparse.Namespace) -> OnlineRun:
    """Offline engine per level (subprocess) first, then the platform ceiling (with
    `--ceiling`), then the served stack per level: one after the other, never side by side."""
    from transformers import AutoTokenizer

    model = common.ensure_model(args.model, args.shape)
    tokenizer = AutoTokenizer.from_pretrained(model)
    level_inputs = level_workloads(args, tokenizer)
    offline: dict[int, float] | None = None
    offline_steps: dict[int, float] | None = None
    step = None
    if args.offline_tokens_per_s:
        values = [float(v) for v in args.offline_tokens_per_s.split(",")]
        values = values * len(args.concurrency) if len(values) == 1 else values
        offline = dict(zip(args.concurrency, values, strict=True))
    elif not args.no_offline:
        workloads = {c: w for c, (_, w) in level_inputs.items()}
        offline, offline_steps, step = offline_tokens_per_s(args, model, workloads)
    platform = ceiling.from_args(args) if args.ceiling else None
    result = serve_and_run(args, model, level_inputs)
    result.offline, result.decode_step_s, result.ceiling = offline, step, platform
    result.offline_steps_per_s = offline_steps
    result.ceiling_mode = "fused" if args.triton_model == "llm_fused" else "ensemble"
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags (see the module doc); exits with usage on bad flags."""
    p = common.argument_parser(
        __doc__.splitlines()[0], "extra EngineConfig field for both engines, e.g. page_size=32"
    )
    p.add_argument(
        "--concurrency", default="1,16,64,256", type=lambda s: [int(c) for c in s.split(",")]
    )
    p.add_argument(
        "--num-prompts-per-level",
        type=int,
        default=None,
        help="requests per level (default: max(8, --prompts-per-client x concurrency))",
    )
    p.add_argument(
        "--prompts-per-client",
        type=int,
        default=4,
        help="requests each client sends per level when --num-prompts-per-level is not given; "
        "more make the level's start-up (all clients arriving at once) and tail weigh less",
    )
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt (ids drawn)")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--offline-tokens-per-s", help="skip the offline run: tok/s (one or per level)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    p.add_argument(
        "--triton-url",
        help="use a running tritonserver (gRPC HOST:PORT); the sidecar this benchmark starts "
        f"takes the server's control secret from ${CONTROL_SECRET_ENV} (without it, it streams "
        "from llm and a run meant for llm_fused stops with an error)",
    )
    p.add_argument(
        "--metrics-url",
        help="with --triton-url: its metrics endpoint (http://HOST:PORT/metrics), for the "
        "generator's time counters per level",
    )
    p.add_argument("--openai-url", help="use a running sidecar (http://HOST:PORT)")
    p.add_argument(
        "--triton-model",
        choices=("llm_fused", "llm"),
        default="llm_fused",
        help="the ensemble the sidecar streams from (its --triton-model); the ceiling of the "
        "same shape is the one the generator's responses/s are compared with",
    )
    p.add_argument(
        "--client-processes",
        type=positive_int,
        default=None,
        help="processes that run each level's clients (default: one per 64 clients of the "
        "largest level)",
    )
    p.add_argument(
        "--sidecar-workers",
        type=positive_int,
        default=1,
        help="processes of the sidecar this benchmark starts (its --workers; not with "
        "--openai-url)",
    )
    p.add_argument(
        "--generator-instances",
        type=positive_int,
        default=1,
        help="generator model instances (Triton instance_group) of the tritonserver this "
        "benchmark starts, sharing one engine process (not with --triton-url or --openai-url)",
    )
    p.add_argument(
        "--max-responses-per-s",
        type=float,
        help="the generator's response budget (TRITONLLM_MAX_RESPONSES_PER_S, all instances "
        "together; 0: no pacing) in the tritonserver this benchmark starts (default: the "
        "environment's, else ServingConfig's)",
    )
    p.add_argument("--server-log", help="tritonserver log file (default: a temp file)")
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks (GPUs) both engines split the model across",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="also measure the platform ceiling (benchmarks.ceiling) at the same levels, before "
        "the served levels; the table then reports the generator's responses/s against it",
    )
    ceiling.add_arguments(p)
    p.add_argument(
        "--plots-dir",
        help="draw the PNG plots and write the run's JSON summary into this folder; the "
        "appended section links them relative to --benchmarks-md",
    )
    args = p.parse_args(argv)
    if args.openai_url and args.sidecar_workers != 1:
        p.error("--sidecar-workers: this benchmark starts no sidecar with --openai-url")
    if (args.triton_url or args.openai_url) and args.generator_instances != 1:
        p.error(
            "--generator-instances: this benchmark starts no tritonserver with --triton-url "
            "or --openai-url"
        )
    if (args.triton_url or args.openai_url) and args.max_responses_per_s is not None:
        p.error(
            "--max-responses-per-s: this benchmark starts no tritonserver with --triton-url "
            "or --openai-url"
        )
    budget = args.max_responses_per_s
    if budget is not None and not (math.isfinite(budget) and budget >= 0):
        p.error(f"--max-responses-per-s must be a number >= 0, got {budget}")
    return args


def main(argv: list[str] | None = None) -> OnlineRun:
    """Run the benchmark, print its tables, append them to BENCHMARKS.md (unless `--no-append`),
    draw the plots (with `--plots-dir`). Returns the run."""
    args = parse_args(argv)
    result = run(args)
    notes = [
        f"{args.endpoint} completions, streamed, closed loop; prompts: random ids in "
        f"[{args.min_len}, {args.max_input_len}] decoded to text (+ chat template); outputs "
        f"[{args.min_output_len}, {args.max_output_len}] tokens with ignore_eos; temperature "
        f"{args.temperature}; device {args.device}, attention {args.attention_backend}, "
        f"tensor parallel size {args.tensor_parallel_size}",
        "offline engine: the same prompt ids, same concurrency cap (closed loop), same run",
        f"client: each level's clients spread over up to {client_processes(args)} process(es) "
        "(--client-processes); its CPU is theirs and this process's",
        "generator responses/s: tritonllm_responses_total over the level's wall time; of "
        f"ceiling: against the ceiling of the {args.triton_model} shape (the sidecar's "
        "--triton-model) at the same concurrency, same run",
    ]
    if not args.openai_url:
        notes.append(
            f"sidecar: {args.sidecar_workers} worker process(es) on one port (--sidecar-workers), "
            f"streaming from {args.triton_model} (--triton-model)"
        )
    if not (args.openai_url or args.triton_url):
        notes.append(
            f"generator: {args.generator_instances} Triton instance(s) (--generator-instances; "
            f"several share one engine); response budget {response_budget(args):,.0f}/s over "
            "all instances (--max-responses-per-s; 0: none)"
        )
    itl = online_report.itl_note(result)
    if itl:
        notes.append(itl)
    table = online_report.report(result)
    if result.loads:
        table += "\n\nWhere the time goes per level (averages over the level's wall time):\n\n"
        table += online_report.load_report(result.loads, args.generator_instances)
        notes.append(
            "CPU cores: user+system CPU seconds per process (/proc) over the level's wall time; "
            "engine/sender: the generator's tritonllm_* time counters over the same interval "
            "(busy = had work, cpu = thread CPU time, gpu wait = waiting for a launched step)"
        )
        if args.generator_instances > 1:
            notes.append(
                f"{args.generator_instances} generator instances: stub:generator is their "
                "stubs' CPU together; every stub adds to the same tritonllm_sender_* counters, "
                "so sender busy and cpu are those counters' rates over "
                f"{args.generator_instances} (the mean per stub's sender thread), and "
                "responses/s is all stubs' together"
            )
    steps = online_report.step_report(result)
    if steps:
        table += "\n\nOnline against offline per engine step:\n\n" + steps
        notes.append(
            "per engine step: the served engine's tritonllm_engine_steps_total and "
            "tritonllm_generated_tokens_total rates over the level against the offline "
            "engine's step() calls and output tokens on the same workload; online / offline "
            "output tok/s = (tokens per step ratio) x (steps/s ratio); busy / output / GPU wait: "
            "the served engine loop's time counters per step"
        )
    if result.ceiling:
        table += "\n\nPlatform ceiling (benchmarks.ceiling, same run):\n\n"
        table += ceiling.report(result.ceiling)
        notes += ceiling.notes(args)
    if args.plots_dir:
        from benchmarks import plots

        name = plots.run_name("online", args.model or args.shape)
        summary = online_report.summary(result)
        table += "\n\n" + plots.publish(summary, args.plots_dir, name, args.benchmarks_md)
    common.publish("Online serving", table, notes, args)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
