"""The generator's response path on CPU, without a GPU or a model: what one response costs.

    python -m benchmarks.response_path [--concurrency 256] [--step-ms 10] [--tokens 128]
        [--seconds 5] [--budget 2000] [--profile 25] [--against DIR] [--text MODEL_DIR]

A benchmark harness, not a test and not an engine: `SyntheticEngine` (below) stands in for the
engine front (an `EngineClient`). It "decodes" one token for every live request every
`--step-ms` and delivers the step's outputs as `EngineProcess`'s receiver thread does (a step
message decoded with `process_messages.decode_step`, each output routed through a
`CallbackTable`), so the stub-side cost of the engine's outputs shares the GIL as it does in the
served generator. The rest is the served code: `GeneratorCore` (sender thread: coalescing,
pacing, cancellation checks, metrics ticks) and the generator adapter's own `_Sink`,
`_tensors` and `_Metrics` (`model_repository/generator/1/model.py`, loaded from its file).
Triton's C++ side is replaced by `FakeTriton`, a stand-in module for `triton_python_backend_utils`
whose tensors, responses and metrics only keep what they are given: the numbers are the Python
cost of the response path, not Triton's IPC (benchmarks/ceiling.py measures that ceiling).

`--concurrency` closed-loop clients keep that many requests of `--tokens` tokens in flight
(a finished one is replaced by a new one on a client thread, as Triton's execute thread
would). Reported: responses/s, tokens per response, the sender thread's busy seconds and CPU
seconds per response, and with `--profile N` the N most expensive functions of the sender
thread (cProfile, its own time). `--against DIR` runs the same measurement on another checkout
(e.g. a `git worktree` of main) in alternation with this one, three rounds each, for an A/B in
one run. `--sender-threads K --send-sleeps` models several sender threads (Triton's send waits
for tritonserver without the GIL); then only responses/s compares (the CPU columns count the
first sender thread only). `--text MODEL_DIR` answers text as through `llm_fused` (the
generator detokenizes, with that model's tokenizer) instead of ids for a detokenizer step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import queue
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.response_path_harness import (
    COSTS_US,
    ROOT,
    SEND_RELEASES_GIL,
    SPUN_S,
    Sender,
    SyntheticEngine,
    adapter,
)


def measure(args: argparse.Namespace) -> dict:
    """One run in this process (this checkout's code); returns its numbers."""
    from tritonllm.serving.generator_core import GeneratorCore

    if args.no_triton_cost:
        COSTS_US.update(dict.fromkeys(COSTS_US, 0.0))
    SEND_RELEASES_GIL[0] = args.send_sleeps
    model = adapter()
    engine = SyntheticEngine(args.step_ms / 1e3)
    metrics = model._Metrics(lambda: True, print)
    core = GeneratorCore(
        engine,
        on_tick=metrics.update,
        parent_alive=lambda: True,
        log_warning=print,
        log_error=print,
        max_responses_per_s=args.budget,
        sender_threads=args.sender_threads,
    )
    profile = cProfile.Profile() if args.profile else None
    if profile is not None:  # the sender thread's calls only
        streamer = core.streamer
        for owner, name in (
            (streamer, "_deliver"),
            (streamer, "_tick"),
            (streamer._pacer, "admit"),
        ):
            fn = getattr(owner, name)

            def profiled(*a, _fn=fn):
                profile.enable()
                try:
                    return _fn(*a)
                finally:
                    profile.disable()

            setattr(owner, name, profiled)
    core.start()
    stats = {"responses": 0, "tensors": 0, "cancel_checks": 0}
    finished: queue.SimpleQueue = queue.SimpleQueue()
    inputs = {
        "input_ids": np.arange(512, dtype=np.int32),
        "max_tokens": np.array([args.tokens], np.int32),
    }
    counter = [0]

    detokenizer = None
    if args.text:  # the llm_fused path: the generator answers text (one detokenizer shared)
        from tritonllm.tokenization.detokenizer import Detokenizer
        from tritonllm.tokenization.loading import load_tokenizer

        detokenizer = Detokenizer(load_tokenizer(args.text))

    def submit(slot):
        counter[0] += 1
        sink = model._Sink(Sender(slot, finished.put, stats), detokenizer)
        core.execute(f"r{slot}-{counter[0]}", inputs, "", sink)

    for slot in range(args.concurrency):
        submit(slot)
    deadline = time.monotonic() + args.warm_s + args.seconds
    window = None
    while time.monotonic() < deadline:
        try:
            submit(finished.get(timeout=0.05))
        except queue.Empty:
            pass
        if window is None and time.monotonic() >= deadline - args.seconds:
            window = (time.monotonic(), dict(stats), core.streamer.times(), engine.outputs)
            spun0 = SPUN_S[0]
    end = (time.monotonic(), dict(stats), core.streamer.times(), engine.outputs)
    spun = SPUN_S[0] - spun0
    engine_cpu = engine.cpu_s
    core.finalize()
    metrics.observer.close()
    wall = end[0] - window[0]
    responses = end[1]["responses"] - window[1]["responses"]
    busy = end[2].busy_s - window[2].busy_s
    cpu = end[2].cpu_s - window[2].cpu_s
    result = {
        "responses_per_s": responses / wall,
        "tokens_per_response": (end[3] - window[3]) / max(responses, 1),
        "tensors_per_response": (end[1]["tensors"] - window[1]["tensors"]) / max(responses, 1),
        "cancel_checks_per_s": (end[1]["cancel_checks"] - window[1]["cancel_checks"]) / wall,
        "sender_busy": busy / wall,
        "sender_busy_us_per_response": 1e6 * busy / max(responses, 1),
        "sender_cpu_us_per_response": 1e6 * cpu / max(responses, 1),
        "python_us_per_response": (
            1e6 * (cpu - spun) / max(responses, 1) if args.sender_threads == 1 else float("nan")
        ),
        "engine_outputs_per_s": (end[3] - window[3]) / wall,
        "engine_cpu_s": engine_cpu,
    }
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile)
        result["profile"] = text.getvalue()
    return result


def triton_costs(count: int, log_path: Path | None = None) -> dict[str, float]:
    """µs per call of each pb_utils call of the response path, timed inside a real stub
    (`response_path_repository/rp_costs`; `send_*` include building their tensors).

    Raises:
        RuntimeError: the server did not start or the request failed.
    """
    import tritonclient.grpc as grpcclient

    from tritonllm.triton_server import TritonServer

    done: queue.SimpleQueue = queue.SimpleQueue()
    received = [0]

    def on_response(result, error):
        if error is not None:
            done.put(error)
            return
        received[0] += 1
        report = result.as_numpy("report")
        if report is not None:
            done.put(json.loads(report.reshape(-1)[0]))

    repository = ROOT / "benchmarks" / "response_path_repository"
    with TritonServer(model_repository=repository, log_path=log_path) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
        client.start_stream(callback=on_response)
        for i, value in enumerate([0] * 4 + [count]):  # 4 held requests for threaded sends
            tensor = grpcclient.InferInput("count", [1], "INT32")
            tensor.set_data_from_numpy(np.array([value], np.int32))
            client.async_stream_infer("rp_costs", [tensor], request_id=f"costs-{i}")
        result = done.get(timeout=600)
        client.stop_stream()
    if not isinstance(result, dict):
        raise RuntimeError(f"rp_costs failed: {result}")
    result["responses_received"] = received[0]
    return result


def _row(label: str, r: dict) -> str:
    return (
        f"| {label} | {r['responses_per_s']:,.0f} | {r['tokens_per_response']:.2f} | "
        f"{r['tensors_per_response']:.1f} | {r['cancel_checks_per_s']:,.0f} | "
        f"{r['sender_busy']:.0%} | {r['sender_busy_us_per_response']:.0f} | "
        f"{r['sender_cpu_us_per_response']:.0f} | {r['python_us_per_response']:.0f} |"
    )


HEADER = (
    "| code | responses/s | tokens/response | tensors/response | is_cancelled/s | sender busy "
    "| sender busy µs/response | sender CPU µs/response | of it Python µs/response |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _child(checkout: Path, argv: list[str]) -> dict:
    """`measure` in a fresh interpreter on `checkout`'s tritonllm and generator adapter."""
    command = [sys.executable, "-m", "benchmarks.response_path", "--json", *argv]
    env = {"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=10.0, help="synthetic decode step (ms)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--seconds", type=float, default=5.0, help="measured window (s)")
    p.add_argument("--warm-s", type=float, default=1.0)
    p.add_argument(
        "--budget",
        type=float,
        default=5000.0,
        help="max_responses_per_s in the pacer's cost units (0: none); the harness sends ids, "
        "which cost DETOKENIZED_RESPONSE_COST (2.5) each: the default is 2,000 responses/s",
    )
    p.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    p.add_argument("--against", help="another checkout to A/B against (3 rounds each)")
    p.add_argument(
        "--no-triton-cost", action="store_true", help="stand-in calls cost nothing (Python only)"
    )
    p.add_argument(
        "--send-sleeps",
        action="store_true",
        help="a send's base cost is slept, not spun (Triton's send waits without the GIL)",
    )
    p.add_argument("--sender-threads", type=int, default=1, help="GeneratorCore sender_threads")
    p.add_argument(
        "--text",
        metavar="MODEL_DIR",
        help="answer text as through llm_fused, detokenized with MODEL_DIR's tokenizer (its "
        "vocabulary must hold the synthetic ids, < 151,936: a Qwen tokenizer); default: ids",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line (no table)")
    p.add_argument(
        "--triton", type=int, metavar="N", help="time each pb_utils call N times in a real stub"
    )
    args = p.parse_args(argv)
    if args.triton:
        costs = triton_costs(args.triton, Path("/tmp/response_path_triton.log"))
        print("| pb_utils call | µs per call |\n|---|---|")
        for name, value in costs.items():
            print(f"| {name} | {value:,.1f} |")
        return
    if args.json:
        result = measure(args)
        result.pop("profile", None)
        print(json.dumps(result))
        return
    if args.against:
        own = [a for a in (argv if argv is not None else sys.argv[1:])]
        i = own.index("--against")
        own = own[:i] + own[i + 2 :]
        print(HEADER)
        for round_ in range(3):
            for label, checkout in (("this", ROOT), ("against", Path(args.against))):
                print(_row(f"{label} #{round_ + 1}", _child(checkout.resolve(), own)), flush=True)
        return
    result = measure(args)
    print(HEADER)
    print(_row("this", result))
    if "profile" in result:
        print(result["profile"])


if __name__ == "__main__":
    main()
