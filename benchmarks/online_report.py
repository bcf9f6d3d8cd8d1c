"""What `benchmarks.online` reports: one run's measurements, its markdown tables, and a plain
summary (JSON-able, what `benchmarks.plots` draws and what a later comparison reads).

Per concurrency level: TTFT, TPOT, chunk gaps (chunk ITL) and tokens per streamed chunk from the
clients; output tokens/s against the offline engine's on the same prompts (online / offline);
the generator's responses/s (`tritonllm_responses_total` over the level's wall time) against
the platform ceiling at the same concurrency (`benchmarks.ceiling`, the ensemble's); once per
run, the chunk ITL p50 at concurrency 1 against the offline engine's batch-1 decode step; and
(`step_report`) online / offline taken apart per engine step: with the served engine's own
counters, online / offline output tokens/s is (online / offline tokens per step) × (online /
offline steps per second), so a level that falls short shows whether its steps carried fewer
tokens (slots empty while a closed-loop client's next request is on its way) or ran slower
(host work in the served engine's loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks import common
from benchmarks.ceiling import CeilingLevel
from benchmarks.common import fmt, percentile
from benchmarks.streaming_client import LevelResult


@dataclass
class OnlineRun:
    """Everything one `benchmarks.online` run measured.

    Attributes:
        results: the served levels, by concurrency.
        offline: the offline engine's output tokens/s per level (None: not run).
        offline_steps_per_s: the offline engine's `step()` calls per second, per level (None:
            not run).
        loads: per level, `LoadProbe.report`'s columns ({} without a probe).
        responses_per_s: per level, the generator's responses/s ({} without its metrics).
        engine_rates: per level, `LoadProbe.rates` of the generator's metrics over the level
            (`tritonllm_*` counters per second; {} without its metrics).
        decode_step_s: the offline engine's batch-1 decode step (seconds; None: not run).
        ceiling: `benchmarks.ceiling.run_ceiling`'s levels (None: not run).
        ceiling_mode: the ceiling mode of the ensemble the sidecar streamed from ("fused" for
            llm_fused, "ensemble" for llm): the one "of ceiling" compares with.
    """

    results: dict[int, LevelResult]
    offline: dict[int, float] | None = None
    offline_steps_per_s: dict[int, float] | None = None
    loads: dict[int, dict[str, str]] = field(default_factory=dict)
    responses_per_s: dict[int, float] = field(default_factory=dict)
    engine_rates: dict[int, dict[str, float]] = field(default_factory=dict)
    decode_step_s: float | None = None
    ceiling: dict[str, dict[int, CeilingLevel]] | None = None
    ceiling_mode: str = "fused"

    def ceiling_per_s(self, mode: str, c: int) -> float | None:
        """The ceiling's responses/s of `mode` (a `benchmarks.ceiling.MODES` key) at
        concurrency `c`."""
        level = (self.ceiling or {}).get(mode, {}).get(c)
        return level.responses_per_s if level else None


def _ms(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else value * 1e3


def ms_pair(values: list[float]) -> str:
    """`p50 / p99` of `values` (seconds) in milliseconds; `-` when empty."""
    p50, p99 = _ms(values, 50), _ms(values, 99)
    return "-" if p50 is None else f"{p50:,.1f} / {p99:,.1f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def level_summary(run: OnlineRun, c: int) -> dict[str, Any]:
    """The numbers of level `c` (times in ms, rates per second; None where not measured)."""
    res = run.results[c]
    ok = res.ok
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    offline = (run.offline or {}).get(c)
    responses = run.responses_per_s.get(c)
    ceiling = run.ceiling_per_s(run.ceiling_mode, c)
    return {
        "concurrency": c,
        "requests": len(res.records),
        "failed": len(res.records) - len(ok),
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
        "output_tokens": res.output_tokens,
        "seconds": res.seconds,
        "output_tokens_per_s": res.output_tokens_per_s,
        "offline_tokens_per_s": offline,
        "online_over_offline": _ratio(res.output_tokens_per_s, offline),
        "ttft_p50_ms": _ms(ttft, 50),
        "ttft_p99_ms": _ms(ttft, 99),
        "tpot_p50_ms": _ms(tpot, 50),
        "tpot_p99_ms": _ms(tpot, 99),
        "chunk_gap_p50_ms": _ms(gaps, 50),
        "chunk_gap_p99_ms": _ms(gaps, 99),
        "tokens_per_chunk": res.tokens_per_chunk,
        "generator_responses_per_s": responses,
        "ceiling_alone_responses_per_s": run.ceiling_per_s("alone", c),
        "ceiling_ensemble_responses_per_s": run.ceiling_per_s("ensemble", c),
        "ceiling_fused_responses_per_s": run.ceiling_per_s("fused", c),
        "ceiling_mode": run.ceiling_mode,
        "generator_over_ceiling": _ratio(responses, ceiling),
        **step_summary(run, c),
    }


def step_summary(run: OnlineRun, c: int) -> dict[str, float | None]:
    """Level `c`'s output tokens/s taken apart per engine step, online and offline.

    Online: the generator's `tritonllm_engine_steps_total` and `..._generated_tokens_total`
    rates over the level; offline: its engine's `step()` calls over the level's seconds and its
    output tokens/s. Per step of the served engine's loop, in ms: `busy` (the loop had work),
    `output` (encoding and sending its outputs), `gpu_wait` (waiting for a launched step).
    And where a request's slot waits, as means over the level in ms: the clients' TTFT, the
    generator's (`tritonllm_time_to_first_token_seconds`: its arrival to its first token's
    response) and, of that, the engine queue (`tritonllm_request_queue_time_seconds`: arrival
    to admission, the admission delay included); the clients' minus the generator's is the
    path outside the generator. None where not measured.
    """
    rates = run.engine_rates.get(c, {})
    steps = rates.get("tritonllm_engine_steps_total")
    tokens = rates.get("tritonllm_generated_tokens_total")
    offline_steps = (run.offline_steps_per_s or {}).get(c)
    offline_tokens = (run.offline or {}).get(c)
    per_step = _ratio(tokens, steps)
    offline_per_step = _ratio(offline_tokens, offline_steps)

    def ms_per_step(name: str) -> float | None:
        value = _ratio(rates.get(f"tritonllm_engine_{name}_seconds_total"), steps)
        return None if value is None else value * 1e3

    def mean_ms(histogram: str) -> float | None:
        name = f"tritonllm_{histogram}_seconds"
        value = _ratio(rates.get(f"{name}_sum"), rates.get(f"{name}_count"))
        return None if value is None else value * 1e3

    ttfts = [r.ttft for r in run.results[c].ok if r.ttft is not None]

    return {
        "engine_steps_per_s": steps,
        "offline_steps_per_s": offline_steps,
        "tokens_per_step": per_step,
        "offline_tokens_per_step": offline_per_step,
        "tokens_per_step_over_offline": _ratio(per_step, offline_per_step),
        "steps_per_s_over_offline": _ratio(steps, offline_steps),
        "step_busy_ms": ms_per_step("busy"),
        "step_output_ms": ms_per_step("output"),
        "step_gpu_wait_ms": ms_per_step("gpu_wait"),
        "ttft_mean_ms": sum(ttfts) / len(ttfts) * 1e3 if ttfts else None,
        "generator_ttft_mean_ms": mean_ms("time_to_first_token"),
        "generator_queue_mean_ms": mean_ms("request_queue_time"),
    }


def summary(run: OnlineRun) -> dict[str, Any]:
    """The whole run: `levels` (one `level_summary` each) and the concurrency-1 ITL check
    (`itl_p50_c1_ms` over `decode_step_b1_ms`)."""
    levels = [level_summary(run, c) for c in run.results]
    c1 = next((lv for lv in levels if lv["concurrency"] == 1), None)
    itl = c1["chunk_gap_p50_ms"] if c1 else None
    step = run.decode_step_s * 1e3 if run.decode_step_s else None
    return {
        "levels": levels,
        "itl_p50_c1_ms": itl,
        "decode_step_b1_ms": step,
        "itl_over_decode_step": _ratio(itl, step),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def report(run: OnlineRun) -> str:
    """The markdown table: one row per concurrency level."""
    headers = [
        "concurrency",
        "requests (failed)",
        "mean prompt tok",
        "output tokens",
        "TTFT p50 / p99 (ms)",
        "TPOT p50 / p99 (ms)",
        "chunk ITL p50 / p99 (ms)",
        "tok/chunk",
        "output tok/s",
        "offline engine tok/s",
        "online / offline",
        "generator responses/s",
        "of ceiling",
    ]
    rows = []
    for c, res in run.results.items():
        ok = res.ok
        s = level_summary(run, c)
        rows.append(
            [
                str(c),
                f"{s['requests']} ({s['failed']})",
                fmt(s["mean_prompt_tokens"], 0),
                fmt(res.output_tokens),
                ms_pair([r.ttft for r in ok if r.ttft is not None]),
                ms_pair([r.tpot for r in ok if r.tpot is not None]),
                ms_pair([g for r in ok for g in r.chunk_gaps]),
                fmt(res.tokens_per_chunk, 2),
                fmt(res.output_tokens_per_s, 0),
                fmt(s["offline_tokens_per_s"], 0),
                _pct(s["online_over_offline"]),
                fmt(s["generator_responses_per_s"], 0),
                _pct(s["generator_over_ceiling"]),
            ]
        )
    return common.markdown_table(headers, rows)


def step_report(run: OnlineRun) -> str:
    """Markdown table of `step_summary` per level; '' unless some level has both the offline
    engine's steps and the generator's metrics."""
    levels = [step_summary(run, c) | {"c": c} for c in run.results]
    levels = [s for s in levels if s["tokens_per_step_over_offline"] is not None]
    if not levels:
        return ""
    headers = [
        "concurrency",
        "steps/s online / offline",
        "output tok per step online / offline",
        "online / offline = tok per step × steps/s",
        "served loop per step: busy / output / GPU wait (ms)",
        "TTFT mean: clients / generator (its queue) (ms)",
    ]

    def ms(value: float | None) -> str:
        return fmt(value, 2)

    rows = [
        [
            str(s["c"]),
            f"{fmt(s['engine_steps_per_s'], 0)} / {fmt(s['offline_steps_per_s'], 0)}",
            f"{fmt(s['tokens_per_step'], 1)} / {fmt(s['offline_tokens_per_step'], 1)}",
            f"{_pct(s['tokens_per_step_over_offline'])} × {_pct(s['steps_per_s_over_offline'])}",
            f"{ms(s['step_busy_ms'])} / {ms(s['step_output_ms'])} / {ms(s['step_gpu_wait_ms'])}",
            f"{fmt(s['ttft_mean_ms'])} / {fmt(s['generator_ttft_mean_ms'])} "
            f"({fmt(s['generator_queue_mean_ms'])})",
        ]
        for s in levels
    ]
    return common.markdown_table(headers, rows)


def itl_note(run: OnlineRun) -> str | None:
    """The note comparing ITL p50 at concurrency 1 with the batch-1 decode step, or None when
    either was not measured."""
    s = summary(run)
    if s["itl_over_decode_step"] is None:
        return None
    return (
        f"ITL p50 at concurrency 1: {s['itl_p50_c1_ms']:.2f} ms = "
        f"{s['itl_over_decode_step']:.2f}x the batch-1 decode step ({s['decode_step_b1_ms']:.3f} "
        "ms: the offline engine's step with one 512-token request decoding, after its levels, "
        "same run)"
    )


def load_report(loads: dict[int, dict[str, str]], generator_instances: int = 1) -> str:
    """Markdown table of the per-level load reports (`LoadProbe.report`); '' without any.
    With several `generator_instances` the sender column says that its fractions are per
    stub (the mean over the instances' sender threads)."""
    if not loads:
        return ""
    keys = sorted(
        {k for load in loads.values() for k in load}, key=["cpu", "engine", "sender"].index
    )
    sender = "generator sender thread"
    if generator_instances > 1:
        sender = f"generator sender threads (busy, cpu: mean of {generator_instances} stubs)"
    names = {
        "cpu": "CPU cores per process",
        "engine": "generator engine loop",
        "sender": sender,
    }
    rows = [[str(c)] + [load.get(k, "-") for k in keys] for c, load in loads.items()]
    return common.markdown_table(["concurrency"] + [names[k] for k in keys], rows)
