"""PNG plots of the benchmarks, for BENCHMARKS.md to show beside the tables (matplotlib, the
`bench` extra; drawn off-screen with the Agg backend).

- `online_plots`: from `benchmarks.online_report.summary`, against concurrency (log2 axis):
  throughput (output tokens/s online and offline; the generator's responses/s and the platform
  ceiling's), TTFT p50/p99, and the streamed chunks (chunk gap p50/p99 with TPOT p50; tokens per
  chunk).
- `offline_plot`: from `offline_summary`, the engine's output tokens/s against its bandwidth
  bound (and the HF peer's).

`markdown_images` writes the `![...](...)` lines that link them, relative to BENCHMARKS.md.
`publish` is what the benchmarks call: it writes the run's JSON summary and draws its plots, or,
on a host without matplotlib (the offline GPU host's image), says how to draw them later from
that JSON on another machine: `python -m benchmarks.plots [--benchmarks-md FILE] SUMMARY.json ...`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(levels: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(concurrencies, values) of the levels where `key` was measured."""
    pairs = [(lv["concurrency"], lv[key]) for lv in levels if lv.get(key) is not None]
    return [c for c, _ in pairs], [v for _, v in pairs]


def _line(ax, levels, key: str, label: str, style: str = "o-") -> None:
    xs, ys = _series(levels, key)
    if xs:
        ax.plot(xs, ys, style, label=label)


def _concurrency_axis(ax, levels) -> None:
    ax.set_xscale("log", base=2)
    ticks = [lv["concurrency"] for lv in levels]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("concurrency (streaming clients)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def _log_y(ax) -> None:
    """A log y axis labelled with plain numbers (5, 10, 20, not 2x10^1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def online_plots(summary: dict[str, Any], out_dir: Path | str, name: str) -> list[Path]:
    """Draw `{name}-throughput.png`, `{name}-ttft.png` and `{name}-chunks.png` into `out_dir`
    (created) from an online summary; series that were not measured are left out.

    Raises:
        ValueError: the summary has no levels.
    """
    levels = summary["levels"]
    if not levels:
        raise ValueError("no levels to plot")
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, (tok, resp) = plt.subplots(1, 2, figsize=(11, 4))
    _line(tok, levels, "output_tokens_per_s", "online (served)")
    _line(tok, levels, "offline_tokens_per_s", "offline engine, same prompts", "s--")
    tok.set_ylabel("output tokens/s")
    tok.set_title("Throughput")
    _concurrency_axis(tok, levels)
    _line(resp, levels, "generator_responses_per_s", "generator")
    _line(resp, levels, "ceiling_fused_responses_per_s", "ceiling, llm_fused shape", "D--")
    _line(resp, levels, "ceiling_ensemble_responses_per_s", "ceiling, llm shape", "s--")
    _line(resp, levels, "ceiling_alone_responses_per_s", "ceiling, one model", "^:")
    resp.set_ylabel("responses/s")
    resp.set_title("Responses against the platform ceiling")
    _concurrency_axis(resp, levels)
    paths.append(_save(fig, out / f"{name}-throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    _line(ax, levels, "ttft_p50_ms", "p50")
    _line(ax, levels, "ttft_p99_ms", "p99", "s--")
    _log_y(ax)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token")
    _concurrency_axis(ax, levels)
    paths.append(_save(fig, out / f"{name}-ttft.png"))

    fig, (gap, per) = plt.subplots(1, 2, figsize=(11, 4))
    _line(gap, levels, "chunk_gap_p50_ms", "chunk gap p50")
    _line(gap, levels, "chunk_gap_p99_ms", "chunk gap p99", "s--")
    _line(gap, levels, "tpot_p50_ms", "TPOT p50", "^:")
    _log_y(gap)
    gap.set_ylabel("ms")
    gap.set_title("Gaps between streamed chunks")
    _concurrency_axis(gap, levels)
    _line(per, levels, "tokens_per_chunk", "tokens per chunk")
    per.set_ylabel("tokens per streamed chunk")
    per.set_ylim(bottom=0)
    per.set_title("Tokens per chunk")
    _concurrency_axis(per, levels)
    paths.append(_save(fig, out / f"{name}-chunks.png"))
    return paths


def offline_summary(res: Any, attention_backend: str, model: str) -> dict[str, Any]:
    """The numbers `offline_plot` draws, from a `benchmarks.offline.OfflineResult` of `model`
    (its name, for the title)."""
    w = res.workload
    rows = [
        {
            "system": f"tritonllm engine ({attention_backend})",
            "seconds": res.engine.seconds,
            "output_tokens_per_s": res.engine.output_tokens_per_s,
        },
        {
            "system": "bandwidth bound",
            "seconds": res.bound_seconds,
            "output_tokens_per_s": w.num_output_tokens / res.bound_seconds,
        },
    ]
    roofline = res.roofline_at(next(iter(res.engines))).seconds
    rows.append(
        {
            "system": "roofline bound",
            "seconds": roofline,
            "output_tokens_per_s": w.num_output_tokens / roofline,
        }
    )
    if res.hf is not None:
        rows.append(
            {
                "system": f"HF generate (batch {res.hf.num_requests})",
                "seconds": res.hf.seconds,
                "output_tokens_per_s": res.hf.output_tokens_per_s,
            }
        )
    return {
        "model": model,
        "rows": rows,
        "of_bound": res.bound_seconds / res.engine.seconds,
        "of_roofline": roofline / res.engine.seconds,
        "matmul_rate": res.matmul_rate,
        "prefill_alone_seconds": res.prefill[next(iter(res.engines))].seconds,
        "copy_bandwidth": res.copy_bandwidth,
        "weight_bytes": res.weight_bytes,
        "kv_bytes_per_token": res.kv_bytes_per_token,
        "decode_steps": res.traffic.decode_steps,
    }


def offline_plot(summary: dict[str, Any], out_dir: Path | str, name: str) -> Path:
    """Draw `{name}-offline.png` into `out_dir` (created): output tokens/s per system, each
    bar labelled with its fraction of the bound."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary["rows"]
    bound = next(r["output_tokens_per_s"] for r in rows if r["system"] == "bandwidth bound")
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.5))
    names = [r["system"] for r in rows][::-1]
    values = [r["output_tokens_per_s"] for r in rows][::-1]
    bars = ax.barh(
        names, values, color=["#4c72b0" if "bound" not in n else "#bbbbbb" for n in names]
    )
    for bar, value in zip(bars, values, strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {value / bound:.0%}",
            va="center",
        )
    ax.set_xlabel("output tokens/s (label: of the bandwidth bound)")
    model = f" ({summary['model']})" if summary.get("model") else ""
    ax.set_title(f"Offline engine against its bandwidth bound{model}")
    ax.set_xlim(0, max(values) * 1.15)
    return _save(fig, out / f"{name}-offline.png")


def run_name(kind: str, model: str | Path) -> str:
    """`{kind}-{model folder name}-{UTC date and minute}`: the file name stem of one run's plots
    (e.g. `online-qwen3-0.6b-20261201T0930`)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    return f"{kind}-{Path(model).name}-{stamp}"


def write_json(data: dict[str, Any], out_dir: Path | str, name: str) -> Path:
    """Write `data` as `{name}.json` into `out_dir` (created)."""
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def markdown_images(paths: Sequence[Path], benchmarks_md: Path | str) -> str:
    """One `![stem](relative path)` line per image, relative to `benchmarks_md`'s folder."""
    return "\n".join(f"![{Path(p).stem}]({_relative(p, benchmarks_md)})" for p in paths)


def _relative(path: Path | str, benchmarks_md: Path | str) -> str:
    """`path` relative to `benchmarks_md`'s folder, with forward slashes."""
    base = Path(benchmarks_md).resolve().parent
    return Path(os.path.relpath(Path(path).resolve(), base)).as_posix()


def draw(summary: dict[str, Any], out_dir: Path | str, name: str) -> list[Path]:
    """The plots of one run's summary: `online_plots` for an online summary (it has `levels`),
    `offline_plot` for an offline one (it has `rows`).

    Raises:
        ValueError: the summary is neither, or an online one has no levels.
        ModuleNotFoundError: matplotlib is not installed.
    """
    if "levels" in summary:
        return online_plots(summary, out_dir, name)
    if "rows" in summary:
        return [offline_plot(summary, out_dir, name)]
    raise ValueError("not an online or offline summary: it has neither 'levels' nor 'rows'")


def publish(
    summary: dict[str, Any], out_dir: Path | str, name: str, benchmarks_md: Path | str
) -> str:
    """Write `{name}.json` into `out_dir` and draw its plots there; returns the markdown that
    links them (relative to `benchmarks_md`), or, where matplotlib is missing, a line naming the
    command that draws them later from the JSON (the numbers are kept either way).

    Raises:
        ValueError: as `draw`.
    """
    path = write_json(summary, out_dir, name)
    try:
        images = draw(summary, out_dir, name)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        rel = _relative(path, benchmarks_md)
        return f"Plots not drawn on this host (no matplotlib): `python -m benchmarks.plots {rel}`."
    return markdown_images(images, benchmarks_md)


def main(argv: list[str] | None = None) -> list[Path]:
    """Draw the plots of saved JSON summaries beside them (each file's stem names its images) and
    print the markdown lines that link them.

    Raises:
        ValueError, ModuleNotFoundError: as `draw`; OSError, json.JSONDecodeError: a file that
            cannot be read as JSON.
    """
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("summaries", nargs="+", help="JSON summaries written by --plots-dir runs")
    p.add_argument("--benchmarks-md", default="BENCHMARKS.md", help="links are relative to it")
    args = p.parse_args(argv)
    images = []
    for file in map(Path, args.summaries):
        images += draw(json.loads(file.read_text()), file.parent, file.stem)
    print(markdown_images(images, args.benchmarks_md))
    return images


if __name__ == "__main__":
    main(sys.argv[1:])
