"""The benchmarks' PNG plots (`benchmarks.plots`) and the online summary they draw from
(`benchmarks.online_report`), on small synthetic results: no server, no engine."""

from __future__ import annotations

import sys

import pytest

from benchmarks import online_report, plots
from benchmarks.ceiling import CeilingLevel
from benchmarks.load_probe import LoadProbe, Snapshot
from benchmarks.streaming_client import LevelResult, RequestRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _level(c: int, gap: float, tokens_per_chunk: int) -> dict:
    return {
        "concurrency": c,
        "output_tokens_per_s": 600.0 * c**0.6,
        "offline_tokens_per_s": 610.0 * c**0.6,
        "ttft_p50_ms": 40.0 + c,
        "ttft_p99_ms": 90.0 + 3 * c,
        "tpot_p50_ms": gap / tokens_per_chunk,
        "chunk_gap_p50_ms": gap,
        "chunk_gap_p99_ms": 2.5 * gap,
        "tokens_per_chunk": float(tokens_per_chunk),
        "generator_responses_per_s": 600.0 + c,
        "ceiling_alone_responses_per_s": 9000.0,
        "ceiling_ensemble_responses_per_s": None if c == 256 else 7000.0,  # not measured
    }


def _image_size(path) -> tuple[int, int]:
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def test_online_plots_render_every_figure_and_link_them(tmp_path):
    summary = {"levels": [_level(1, 1.4, 1), _level(16, 7.5, 4), _level(256, 130.0, 14)]}
    paths = plots.online_plots(summary, tmp_path / "plots", "online-x")
    assert [p.name for p in paths] == [
        "online-x-throughput.png",
        "online-x-ttft.png",
        "online-x-chunks.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC
        width, height = _image_size(path)
        assert width >= 600 and height >= 400
    links = plots.markdown_images(paths, tmp_path / "BENCHMARKS.md")
    assert links.splitlines() == [
        f"![online-x-{kind}](plots/online-x-{kind}.png)"
        for kind in ("throughput", "ttft", "chunks")
    ]
    with pytest.raises(ValueError, match="no levels"):
        plots.online_plots({"levels": []}, tmp_path, "empty")


def test_offline_plot_renders_engine_against_bound(tmp_path):
    summary = {
        "model": "qwen3-0.6b",
        "rows": [
            {"system": "tritonllm engine (flashinfer)", "output_tokens_per_s": 25_600.0},
            {"system": "bandwidth bound", "output_tokens_per_s": 37_700.0},
        ],
    }
    path = plots.offline_plot(summary, tmp_path, "offline-x")
    assert path.name == "offline-x-offline.png" and path.read_bytes()[:8] == PNG_MAGIC
    assert plots.write_json(summary, tmp_path, "offline-x").read_text().startswith("{")


def _record(start: float, chunk_times: list[float], tokens: int) -> RequestRecord:
    return RequestRecord(
        max_tokens=tokens,
        start=start,
        end=chunk_times[-1],
        chunk_times=chunk_times,
        completion_tokens=tokens,
        prompt_tokens=10,
    )


def _ceiling(mode: str, c: int, responses: int) -> CeilingLevel:
    return CeilingLevel(mode, c, responses, 10, (), 2.0, 0.5, 0.5, "")


def test_summary_relates_each_level_to_offline_ceiling_and_decode_step():
    """online / offline, generator responses/s over the ceiling of the sidecar's ensemble at
    the same concurrency, and chunk-ITL p50 at concurrency 1 over the batch-1 decode step."""
    c1 = LevelResult(1, [_record(0.0, [0.05, 0.052, 0.055, 0.059], 4)], seconds=0.1)
    c4 = LevelResult(4, [_record(0.0, [0.1, 0.2], 6)] * 4, seconds=0.5)
    run = online_report.OnlineRun(
        results={1: c1, 4: c4},
        offline={1: 50.0, 4: 40.0},
        responses_per_s={1: 40.0, 4: 16.0},
        decode_step_s=0.002,
        ceiling={
            "alone": {1: _ceiling("alone", 1, 20_000), 4: _ceiling("alone", 4, 24_000)},
            "ensemble": {1: _ceiling("ensemble", 1, 8_000), 4: _ceiling("ensemble", 4, 10_000)},
            "fused": {1: _ceiling("fused", 1, 12_000), 4: _ceiling("fused", 4, 14_000)},
        },
    )
    s = online_report.summary(run)
    one, four = s["levels"]
    assert one["output_tokens_per_s"] == pytest.approx(40.0)  # 4 tokens in 0.1 s
    assert one["online_over_offline"] == pytest.approx(0.8)
    assert four["online_over_offline"] == pytest.approx(48.0 / 40.0)
    # against the ceiling of the shape the sidecar streamed from (llm_fused by default)
    assert one["generator_over_ceiling"] == pytest.approx(40.0 / 6_000)  # 12,000 in 2 s
    assert one["ceiling_ensemble_responses_per_s"] == pytest.approx(4_000)
    run.ceiling_mode = "ensemble"  # a sidecar that streamed from llm
    one = online_report.summary(run)["levels"][0]
    assert one["generator_over_ceiling"] == pytest.approx(40.0 / 4_000)  # 8,000 in 2 s
    assert four["ceiling_alone_responses_per_s"] == pytest.approx(12_000)
    assert one["chunk_gap_p50_ms"] == pytest.approx(3.0)  # gaps 2, 3, 4 ms
    assert four["tokens_per_chunk"] == pytest.approx(3.0)
    assert s["decode_step_b1_ms"] == pytest.approx(2.0)
    assert s["itl_over_decode_step"] == pytest.approx(1.5)
    table = online_report.report(run)
    assert "| 1 | 1 (0) |" in table and "| 40 | 1.0% |" in table
    assert "1.50x the batch-1 decode step" in online_report.itl_note(run)
    # Without the offline run, the ceiling or the metrics, those cells stay empty.
    bare = online_report.summary(online_report.OnlineRun(results={1: c1}))
    assert bare["levels"][0]["generator_over_ceiling"] is None
    assert bare["itl_over_decode_step"] is None
    assert online_report.itl_note(online_report.OnlineRun(results={1: c1})) is None


def test_step_summary_splits_online_over_offline_into_tokens_per_step_and_steps_per_s():
    """Per level: the served engine's steps/s and tokens per step (its counters' rates) against
    the offline engine's, whose product is online / offline, and the loop's ms per step."""
    c4 = LevelResult(4, [_record(0.0, [0.1, 0.2], 6)] * 4, seconds=0.5)
    rates = {
        "tritonllm_engine_steps_total": 180.0,
        "tritonllm_generated_tokens_total": 540.0,  # 3 tokens a step
        "tritonllm_engine_busy_seconds_total": 0.9,
        "tritonllm_engine_output_seconds_total": 0.18,
        "tritonllm_engine_gpu_wait_seconds_total": 0.36,
        "tritonllm_time_to_first_token_seconds_sum": 0.2,  # 8 requests/s of 25 ms
        "tritonllm_time_to_first_token_seconds_count": 8.0,
        "tritonllm_request_queue_time_seconds_sum": 0.08,
        "tritonllm_request_queue_time_seconds_count": 8.0,
    }
    run = online_report.OnlineRun(
        results={4: c4},
        offline={4: 800.0},
        offline_steps_per_s={4: 200.0},  # 4 tokens a step
        engine_rates={4: rates},
    )
    s = online_report.summary(run)["levels"][0]
    assert s["tokens_per_step"] == pytest.approx(3.0)
    assert s["offline_tokens_per_step"] == pytest.approx(4.0)
    assert s["tokens_per_step_over_offline"] == pytest.approx(0.75)
    assert s["steps_per_s_over_offline"] == pytest.approx(0.9)
    # the product is the engine's tokens/s over the offline engine's
    assert 0.75 * 0.9 == pytest.approx(540.0 / 800.0)
    assert s["step_busy_ms"] == pytest.approx(5.0)
    assert s["step_output_ms"] == pytest.approx(1.0)
    assert s["step_gpu_wait_ms"] == pytest.approx(2.0)
    assert s["ttft_mean_ms"] == pytest.approx(100.0)  # the clients' first chunks at 0.1 s
    assert s["generator_ttft_mean_ms"] == pytest.approx(25.0)
    assert s["generator_queue_mean_ms"] == pytest.approx(10.0)
    table = online_report.step_report(run)
    row = "| 4 | 180 / 200 | 3.0 / 4.0 | 75.0% × 90.0% | 5.00 / 1.00 / 2.00 | 100.0 / 25.0 (10.0) |"
    assert row in table
    # Without the offline steps or the metrics there is nothing to take apart.
    assert online_report.step_report(online_report.OnlineRun(results={4: c4})) == ""
    no_offline = online_report.OnlineRun(results={4: c4}, engine_rates={4: rates})
    assert online_report.step_report(no_offline) == ""
    assert online_report.summary(no_offline)["levels"][0]["tokens_per_step"] == 3.0


def test_load_probe_rates_are_counter_increase_per_second():
    before = Snapshot(10.0, {}, {"tritonllm_responses_total": 100.0})
    after = Snapshot(12.0, {}, {"tritonllm_responses_total": 5_100.0, "tritonllm_new": 4.0})
    rates = LoadProbe.rates(before, after)
    assert rates == {"tritonllm_responses_total": 2_500.0, "tritonllm_new": 2.0}
    assert LoadProbe.rates(before, Snapshot(11.0, {}, {})) == {}


def test_load_probe_reports_the_sender_fractions_per_generator_stub():
    """Every generator stub adds to the same tritonllm_sender_* counters: with N instances the
    sender's busy and CPU fractions are those counters' rates over N, its responses/s the sum,
    and the table's column says so."""
    counters = ("sender_busy_seconds_total", "sender_cpu_seconds_total", "responses_total")
    before = Snapshot(10.0, {}, dict.fromkeys((f"tritonllm_{c}" for c in counters), 0.0))
    after = Snapshot(12.0, {}, dict(zip(before.metrics, (3.0, 1.0, 2_000.0), strict=True)))
    one = LoadProbe([], None).report(before, after)["sender"]
    assert one == "busy 150%, cpu 50%; 1,000 responses/s"
    three = LoadProbe([], None, generator_instances=3).report(before, after)["sender"]
    assert three == "busy 50%, cpu 17%; 1,000 responses/s"
    assert "| generator sender thread |" in online_report.load_report({1: {"sender": one}})
    table = online_report.load_report({1: {"sender": three}}, generator_instances=3)
    assert "| generator sender threads (busy, cpu: mean of 3 stubs) |" in table


def test_plots_drawn_later_from_the_saved_summary_where_matplotlib_is_missing(
    tmp_path, monkeypatch, capsys
):
    """A GPU host without matplotlib keeps the run's numbers and names the command; that command
    draws the same images from the JSON on another machine."""
    summary = {"levels": [_level(1, 1.4, 1), _level(64, 30.0, 6)]}
    out = tmp_path / "plots"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "matplotlib", None)  # import fails as when absent
        text = plots.publish(summary, out, "online-y", tmp_path / "BENCHMARKS.md")
    assert (
        text
        == "Plots not drawn on this host (no matplotlib): `python -m benchmarks.plots plots/online-y.json`."
    )
    assert not list(out.glob("*.png"))
    images = plots.main(
        [str(out / "online-y.json"), "--benchmarks-md", str(tmp_path / "BENCHMARKS.md")]
    )
    assert [p.name for p in images] == [
        f"online-y-{k}.png" for k in ("throughput", "ttft", "chunks")
    ]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in images)
    assert (
        capsys.readouterr().out.splitlines()[0]
        == "![online-y-throughput](plots/online-y-throughput.png)"
    )
    assert plots.publish(summary, out, "online-z", tmp_path / "BENCHMARKS.md").startswith(
        "![online-z-throughput](plots/online-z-throughput.png)"
    )
    with pytest.raises(ValueError, match="neither"):
        plots.draw({"x": 1}, out, "bad")
