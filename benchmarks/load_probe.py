"""Where a served level's time goes: CPU per process and the generator's time counters.

`LoadProbe.snapshot()` before and after a level; `LoadProbe.report(before, after)` gives, over
that interval:

- CPU cores used by each process of the watched process groups (tritonserver and its Python
  stubs, labelled by model; the generator's engine process; the sidecar) and by this client
  process, from `/proc/<pid>/stat`
  (`utime + stime`, Linux only; elsewhere the column is empty). A process near 1.0 core that
  is single-threaded Python is saturated.
- The generator's `tritonllm_*` time counters (`tritonllm/serving/metrics.py`) as fractions
  of the interval: engine loop busy / its CPU / waiting for the GPU, sender thread busy /
  CPU (with several generator instances, the mean over their stubs' sender threads: each stub
  adds to the same counters), engine steps/s (of which prefill/extend steps, with their mean
  tokens), output tokens per decode step and responses/s. Waiting for a CUDA event spins, so
  GPU wait counts as CPU time too: host work is about `cpu - gpu wait`, and `busy - cpu` is
  time the loop was blocked otherwise (on the GIL, when the engine thread shares the
  generator's process). With overlap scheduling a loop that is busy ~100% of the time but
  rarely waits for the GPU is host-bound.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Snapshot:
    """One reading: monotonic time (s), CPU seconds per process label, metric values."""

    at: float
    cpu_s: dict[str, float]
    metrics: dict[str, float]


def _label(pid: int) -> str:
    """A short name for a process: `stub:<model>` for Triton's Python stubs."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    args = [a.decode(errors="replace") for a in argv if a]
    if not args:
        return f"pid {pid}"
    try:  # EngineProcess names its process (comm is cut to 15 characters)
        if Path(f"/proc/{pid}/comm").read_text().startswith("tritonllm-engin"):
            return "engine process"
    except OSError:
        pass
    exe = Path(args[0]).name
    if "triton_python_backend_stub" in exe:
        # argv[1] is the model's model.py: .../<model>/<version>/model.py
        parts = Path(args[1]).parts if len(args) > 1 else ()
        return f"stub:{parts[-3]}" if len(parts) >= 3 else "stub"
    if exe == "tritonserver":
        return "tritonserver"
    if "openai_frontend" in args:
        return "sidecar"
    return exe


def process_cpu_seconds(pgids: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) of every live process in the process groups `pgids`, summed
    per label; {} where `/proc` is not available."""
    out: dict[str, float] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    wanted = set(pgids)
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ... utime(14) stime(15).
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) not in wanted:
            continue
        label = _label(int(entry))
        out[label] = out.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


# Triton's own counter of the detokenizer model's requests (one per generator response that
# streams through `llm`), kept by `scrape` under this name.
DETOKENIZER_REQUESTS = "detokenizer_requests_total"
_DETOKENIZER_LINE = 'nv_inference_request_success{model="detokenizer",'


def scrape(metrics_url: str | None) -> dict[str, float]:
    """The `tritonllm_*` values on a Triton metrics endpoint, and Triton's count of the
    detokenizer's requests as `DETOKENIZER_REQUESTS` ({} without an endpoint or on error)."""
    if not metrics_url:
        return {}
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith("tritonllm_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            values[name] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(_DETOKENIZER_LINE):
            values[DETOKENIZER_REQUESTS] = float(line.rsplit(" ", 1)[1])
    return values


class LoadProbe:
    """Snapshots of the process groups `pgids` and the metrics at `metrics_url` (either may be
    empty: what is missing is left out of the report). `generator_instances`: the generator's
    Triton instances, whose stubs' sender threads all add to the `tritonllm_sender_*`
    counters. Its attribute `client_cpu`, when set, gives the CPU seconds of the client's worker
    processes so far (`streaming_client.ClientPool.cpu_s`), added to this process's own as
    `client`."""

    def __init__(
        self, pgids: list[int], metrics_url: str | None, generator_instances: int = 1
    ) -> None:
        self.pgids = pgids
        self.metrics_url = metrics_url
        self.generator_instances = generator_instances
        # Set once the client's workers exist (`serve_and_run` builds the probe before them).
        self.client_cpu: Callable[[], float] | None = None

    def snapshot(self) -> Snapshot:
        cpu = process_cpu_seconds(self.pgids)
        cpu["client"] = time.process_time() + (self.client_cpu() if self.client_cpu else 0.0)
        return Snapshot(time.monotonic(), cpu, scrape(self.metrics_url))

    @staticmethod
    def rates(before: Snapshot, after: Snapshot) -> dict[str, float]:
        """Per second of the interval: the increase of every metric `after` holds (a
        counter's rate, e.g. `tritonllm_responses_total` -> responses/s); {} without metrics."""
        dt = max(after.at - before.at, 1e-9)
        return {k: (v - before.metrics.get(k, 0.0)) / dt for k, v in after.metrics.items()}

    def report(self, before: Snapshot, after: Snapshot) -> dict[str, str]:
        """`{column: value}` over the interval: `cpu` (cores per process, busiest first) and,
        with metrics, `engine` and `sender` (busy / CPU / GPU-wait fractions, rates; the
        sender's busy and CPU fractions per stub: the counters' rates over
        `generator_instances`, its responses/s all stubs' together)."""
        dt = max(after.at - before.at, 1e-9)
        cores = {k: (v - before.cpu_s.get(k, 0.0)) / dt for k, v in after.cpu_s.items()}
        cpu = ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(cores.items(), key=lambda kv: -kv[1]) if v >= 0.01
        )
        out = {"cpu": cpu}
        if after.metrics:
            r = LoadProbe.rates(before, after)

            def rate(name: str) -> float:
                return r.get(f"tritonllm_{name}", 0.0)

            steps = rate("engine_steps_total")
            prefills = rate("engine_prefill_steps_total")
            decodes = steps - prefills
            tokens = rate("generated_tokens_total")
            out["engine"] = (
                f"busy {rate('engine_busy_seconds_total'):.0%}, cpu "
                f"{rate('engine_cpu_seconds_total'):.0%}, gpu wait "
                f"{rate('engine_gpu_wait_seconds_total'):.0%}; {steps:,.0f} steps/s "
                f"({prefills:,.0f} prefill/s of "
                f"{rate('engine_prefill_tokens_total') / prefills if prefills else 0:,.0f} tok), "
                f"{tokens / decodes if decodes > 0 else 0:.0f} tok/decode step"
            )
            stubs = self.generator_instances
            out["sender"] = (
                f"busy {rate('sender_busy_seconds_total') / stubs:.0%}, cpu "
                f"{rate('sender_cpu_seconds_total') / stubs:.0%}; "
                f"{rate('responses_total'):,.0f} responses/s"
            )
        return out
