"""Smoke tests of the benchmarks on the tiny CPU model: the workload, the bandwidth bound and the
token accounting of each benchmark are checked; speeds never are."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import bandwidth, common, decode_step, offline, online, profile_step
from tritonllm.triton_config import ServingConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_workload_reproduces_the_published_token_totals():
    # nano-vllm's bench.py: 142,827 prompt and 133,966 output tokens for seed 0.
    w = common.random_workload(256)
    assert (w.num_prompt_tokens, w.num_output_tokens) == (142_827, 133_966)
    assert all(100 <= len(p) <= 1024 for p in w.prompts)
    assert all(0 <= t <= 10_000 for p in w.prompts for t in p)


def test_qwen3_0_6b_bound_matches_design_yardstick():
    # The team yardstick (BENCHMARKS.md): 1.192 GB of weights per decode step, 114,688 B of KV per token, bound ~3.56 s
    # and ~37.7k output tok/s at 4.24 TB/s. Weights counted by transformers' own model.
    from transformers import AutoModelForCausalLM

    from tritonllm.build_model import make_config
    from tritonllm.config import ModelConfig

    hf_config = make_config("qwen3-0.6b")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    weight_bytes = sum(p.numel() for p in hf.parameters()) * 2
    kv_per_token = ModelConfig.from_dict(hf_config.to_dict()).kv_bytes_per_token * 2
    assert kv_per_token == 114_688
    assert weight_bytes == pytest.approx(1.192e9, rel=1e-3)
    w = common.random_workload(256)
    traffic = bandwidth.decode_bytes(
        [len(p) for p in w.prompts], w.output_lens, weight_bytes, kv_per_token
    )
    seconds = traffic.bound_seconds(4.24e12)
    assert seconds == pytest.approx(3.56, abs=0.01)
    assert w.num_output_tokens / seconds == pytest.approx(37_700, rel=0.005)
    assert traffic.total_bytes == pytest.approx(15.09e12, rel=0.005)


def test_qwen3_8b_bound_counts_the_untied_lm_head_not_the_embedding(tmp_path):
    """Qwen3-8B decode reads every weight but the embedding (only gathered by row) once per
    step: 15.14 GB in bf16 with its own lm_head; 147,456 B of K/V per token (36 layers x 8 KV
    heads x 128 x 2 x bf16). The checkpoint's shard headers give the same byte count."""
    from safetensors.torch import save_file

    from tritonllm.build_model import make_config, parameter_shapes, shard_names
    from tritonllm.config import ModelConfig

    hf_config = make_config("qwen3-8b")
    shapes = parameter_shapes(hf_config)
    numel = {n: math.prod(s) for n, s in shapes.items()}
    weight_bytes = 2 * (sum(numel.values()) - numel["model.embed_tokens.weight"])
    assert weight_bytes == 15_136_811_008
    assert ModelConfig.from_dict(hf_config.to_dict()).kv_bytes_per_token * 2 == 147_456
    # Shards holding the same names, as headers only (checkpoint_weight_bytes reads no data):
    # tensors of one element with the 8B shapes written into the header by hand.
    for i, names in enumerate(shard_names(shapes, 2)):
        header = {
            n: {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [0, 0]} for n in names
        }
        data = json.dumps(header).encode()
        path = tmp_path / f"model-{i:05d}.safetensors"
        path.write_bytes(len(data).to_bytes(8, "little") + data)
    assert bandwidth.checkpoint_weight_bytes(tmp_path, 2) == weight_bytes
    # A tied checkpoint (no lm_head stored) counts its embedding once, as the LM head.
    tied = tmp_path / "tied"
    tied.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.zeros(10, 4), "norm": torch.zeros(3)},
        str(tied / "model.safetensors"),
    )
    assert bandwidth.checkpoint_weight_bytes(tied, 2) == 2 * 43
    w = common.random_workload(256)
    traffic = bandwidth.decode_bytes(
        [len(p) for p in w.prompts], w.output_lens, weight_bytes, 147_456
    )
    assert traffic.decode_steps == 1_023
    # KV per token is 1.286x Qwen3-0.6B's and the weights 12.7x: 33.3 TB, 7.85 s at 4.24 TB/s.
    assert traffic.total_bytes == pytest.approx(33.30e12, rel=1e-3)
    assert traffic.bound_seconds(4.24e12) == pytest.approx(7.85, abs=0.02)


def test_decode_schedule_sums_prompt_plus_generated_tokens():
    prompts, outputs = [5, 7, 3], [4, 1, 2]
    # Closed form with all admitted at once: the step emitting token j + 1 reads p + j tokens.
    expected_kv = sum(p + j for p, o in zip(prompts, outputs, strict=True) for j in range(1, o))
    traffic = bandwidth.decode_bytes(prompts, outputs, weight_bytes=100, kv_bytes_per_token=2)
    assert traffic.decode_steps == max(outputs) - 1
    assert traffic.kv_bytes == 2 * expected_kv
    assert traffic.weight_bytes == 100 * (max(outputs) - 1)
    # One at a time: every request's decode steps run alone, the KV read is the same.
    serial = bandwidth.decode_bytes(prompts, outputs, 100, 2, max_running=1)
    assert serial.decode_steps == sum(o - 1 for o in outputs)
    assert serial.kv_bytes == traffic.kv_bytes


def test_model_flops_count_every_matrix_but_the_embedding_once():
    """Qwen3-8B's per-token matrix weights (q, k, v, o, gate, up, down over 36 layers) plus its
    untied LM head are every 2-D parameter of the checkpoint but the embedding; attention costs
    4 x 32 heads x 128 x 36 layers FLOPs per (query, cached token) pair."""
    from tritonllm.build_model import make_config, parameter_shapes
    from tritonllm.config import ModelConfig

    hf_config = make_config("qwen3-8b")
    shapes = parameter_shapes(hf_config)
    matrices = {n: math.prod(s) for n, s in shapes.items() if len(s) == 2}
    flops = bandwidth.ModelFlops.from_config(ModelConfig.from_dict(hf_config.to_dict()))
    assert flops.head_params == matrices["lm_head.weight"] == 4096 * 151_936
    assert flops.body_params + flops.head_params == (
        sum(matrices.values()) - matrices["model.embed_tokens.weight"]
    )
    assert flops.attention_per_pair == 4 * 32 * 128 * 36
    # A 3-token prompt: 3 tokens through the layers, 6 causal pairs, one LM-head row.
    assert flops.prefill(3) == 6 * flops.body_params + 2 * flops.head_params + 6 * (
        flops.attention_per_pair
    )
    assert flops.decode_step(2, 10) == 4 * (flops.body_params + flops.head_params) + 10 * (
        flops.attention_per_pair
    )


def test_roofline_takes_the_slower_of_reads_and_flops_each_step():
    prompts, outputs = [5, 7, 3], [4, 1, 2]
    flops = bandwidth.ModelFlops(body_params=10, head_params=5, attention_per_pair=1)
    traffic = bandwidth.decode_bytes(prompts, outputs, weight_bytes=100, kv_bytes_per_token=2)
    prefill_flops = sum(flops.prefill(p) for p in prompts)
    # FLOPs free: the decode steps are the bandwidth bound, and any prefill hides in them.
    free = bandwidth.roofline(prompts, outputs, 100, 2, flops, bandwidth=1.0, flop_rate=1e30)
    assert free.decode_seconds == pytest.approx(traffic.bound_seconds(1.0))
    assert free.seconds == pytest.approx(traffic.bound_seconds(1.0))
    assert free.compute_bound_steps == 0 and free.steps == traffic.decode_steps
    # Reads free: every step is bound by its FLOPs, and no prefill hides.
    reads_free = bandwidth.roofline(prompts, outputs, 100, 2, flops, 1e30, flop_rate=1.0)
    steps = list(bandwidth.decode_schedule(prompts, outputs))
    assert reads_free.decode_seconds == pytest.approx(
        sum(flops.decode_step(r, kv) for r, kv in steps)
    )
    assert reads_free.hidden_seconds == pytest.approx(0, abs=1e-20)
    assert reads_free.seconds == pytest.approx(reads_free.decode_seconds + prefill_flops)
    assert reads_free.compute_bound_steps == len(steps) == 3
    # In between: the prefill fills the slack of the read-bound steps and the rest adds.
    rate = 4.0
    mixed = bandwidth.roofline(prompts, outputs, 100, 2, flops, bandwidth=1.0, flop_rate=rate)
    reads = [100 + 2 * kv for _, kv in steps]
    computes = [flops.decode_step(r, kv) / rate for r, kv in steps]
    slack = sum(max(0.0, a - b) for a, b in zip(reads, computes, strict=True))
    assert mixed.decode_seconds == pytest.approx(sum(map(max, reads, computes)))
    assert mixed.hidden_seconds == pytest.approx(min(slack, prefill_flops / rate))
    assert mixed.seconds >= traffic.bound_seconds(1.0)


def test_matmul_rate_is_positive_on_cpu():
    assert bandwidth.measure_matmul_rate("cpu", torch.float32, n=64, repeats=2) > 0


def test_checkpoint_weight_bytes_counts_each_parameter_once(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    numel = sum(p.numel() for p in hf.parameters())  # a tied embedding is one parameter
    assert bandwidth.checkpoint_weight_bytes(tiny_model_dir, 2) == 2 * numel


def test_copy_bandwidth_is_positive_on_cpu():
    assert bandwidth.measure_copy_bandwidth("cpu", nbytes=1 << 20, repeats=2) > 0


def test_percentile_matches_numpy():
    import numpy as np

    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 50, 99, 100):
        assert common.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert common.percentile([], 50) is None


def test_append_section_writes_header_once_and_dated_sections(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    table = common.markdown_table(["system", "tok/s"], [["engine", "1,000"]])
    for _ in range(2):
        common.append_section(common.format_section("Offline", "cpu", table, ["a note"]), path)
    text = path.read_text()
    assert text.startswith("# Benchmarks") and text.count("# Benchmarks\n") == 1
    assert text.count("## Offline (") == 2
    assert "- command: `python" in text and "git commit: `" in text and "CPU" in text
    assert "| engine | 1,000 |" in text and "- a note" in text


def test_offline_benchmark_generates_exactly_the_workload(tiny_model_dir):
    """Each tensor-parallel size asked (`--tensor-parallel-size 1,2`: TP=2 behind
    `EngineProcess`) generates exactly the workload, against the bound of as many GPUs as
    ranks; the HF peer runs its padded batch."""
    res = offline.main(
        [
            "--model",
            str(tiny_model_dir),
            "--num-requests",
            "4",
            "--min-len",
            "8",
            "--max-input-len",
            "40",
            "--max-output-len",
            "12",
            "--device",
            "cpu",
            "--attention-backend",
            "torch",
            "--hf-subset",
            "2",
            "--no-append",
            "--tensor-parallel-size",
            "1,2",
        ]
    )
    w = res.workload
    assert len(w) == 4 and all(8 <= len(p) <= 40 for p in w.prompts)
    assert list(res.engines) == [1, 2] and res.engine is res.engines[1]
    for run in res.engines.values():
        assert run.output_tokens == w.num_output_tokens
        assert run.prompt_tokens == w.num_prompt_tokens
        assert run.seconds > 0
    assert res.bound_seconds == res.bound_seconds_at(1)
    assert res.bound_seconds_at(2) == pytest.approx(res.bound_seconds_at(1) / 2)
    assert res.traffic.decode_steps == max(w.output_lens) - 1
    assert res.copy_bandwidth > 0 and res.bound_seconds > 0
    # Each size's prefill alone: every prompt once, one token each; the roofline bound (with
    # the GEMM rate of the same run) is never below the bandwidth bound.
    for size, prefill in res.prefill.items():
        assert (prefill.num_requests, prefill.output_tokens) == (4, 4)
        assert prefill.prompt_tokens == w.num_prompt_tokens and prefill.seconds > 0
        assert res.roofline_at(size).seconds >= res.bound_seconds_at(size) * (1 - 1e-12)
    assert res.matmul_rate > 0
    # HF's padded batch runs every row to the longest output of the subset.
    assert res.hf.output_tokens == sum(w.output_lens[:2])
    assert res.hf.generated_tokens == 2 * max(w.output_lens[:2])


def test_online_benchmark_streams_exact_token_counts(
    tiny_model_dir, triton_server, tokenizer, tmp_path, monkeypatch
):
    """Exact token counts per request; per level the load probe's columns, the generator's
    responses/s against the platform ceiling measured in the same run (`--ceiling`), and the
    concurrency-1 ITL against the batch-1 decode step; the JSON summary and plots are written
    and linked from the appended section. The sidecar streams from `llm_fused` (it has the
    server's control secret): `check_fused` stops a level that went through the detokenizer.
    The clients run in two worker processes (`--client-processes 2`)."""
    import json

    monkeypatch.setenv("TRITONLLM_CONTROL_SECRET", triton_server.control_secret)

    from tritonllm.tokenization.chat import render_prompt

    args = [
        "--model",
        str(tiny_model_dir),
        "--concurrency",
        "1,2",
        "--num-prompts-per-level",
        "4",
        "--min-len",
        "8",
        "--max-input-len",
        "24",
        "--min-output-len",
        "4",
        "--max-output-len",
        "10",
        "--device",
        "cpu",
        "--attention-backend",
        "torch",
        "--triton-url",
        triton_server.grpc_url,
        "--sidecar-workers",
        "2",
        "--client-processes",
        "2",
        "--metrics-url",
        triton_server.metrics_url,
        "--ceiling",
        "--ceiling-seconds",
        "0.5",
        "--ceiling-tokens",
        "8",
        "--ceiling-client-processes",
        "2",
        "--plots-dir",
        str(tmp_path / "plots"),
        "--benchmarks-md",
        str(tmp_path / "BENCHMARKS.md"),
    ]
    run = online.main(args)
    results, offline_tps, loads = run.results, run.offline, run.loads
    assert set(results) == {1, 2} and set(offline_tps) == {1, 2}
    assert run.decode_step_s > 0
    # The generator's responses/s: at least one response per request, and per streamed chunk.
    for c, level in results.items():
        assert run.responses_per_s[c] * level.seconds >= len(level.records)
        for mode in ("alone", "ensemble", "fused"):
            ceiling_level = run.ceiling[mode][c]
            assert ceiling_level.errors == () and ceiling_level.responses > 0
    (summary_file,) = (tmp_path / "plots").glob("online-*.json")
    summary = json.loads(summary_file.read_text())
    assert [lv["concurrency"] for lv in summary["levels"]] == [1, 2]
    for lv in summary["levels"]:
        c = lv["concurrency"]
        assert lv["generator_over_ceiling"] == pytest.approx(
            run.responses_per_s[c] / run.ceiling["fused"][c].responses_per_s
        )
        assert lv["ceiling_mode"] == "fused"  # the sidecar's default streams from llm_fused
        assert lv["online_over_offline"] == pytest.approx(
            results[c].output_tokens_per_s / offline_tps[c]
        )
    assert summary["decode_step_b1_ms"] == pytest.approx(run.decode_step_s * 1e3)
    assert summary["itl_over_decode_step"] == pytest.approx(
        summary["itl_p50_c1_ms"] / summary["decode_step_b1_ms"]
    )
    section = (tmp_path / "BENCHMARKS.md").read_text()
    stem = summary_file.stem
    for kind in ("throughput", "ttft", "chunks"):
        assert (tmp_path / "plots" / f"{stem}-{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](plots/{stem}-{kind}.png)" in section
    assert "Platform ceiling" in section and "ITL p50 at concurrency 1" in section
    # online / offline per engine step: both engines' steps were counted on every level.
    assert "Online against offline per engine step" in section
    for lv in summary["levels"]:
        c = lv["concurrency"]
        assert lv["offline_steps_per_s"] > 0 and lv["engine_steps_per_s"] > 0
        assert lv["tokens_per_step"] == pytest.approx(
            run.engine_rates[c]["tritonllm_generated_tokens_total"] / lv["engine_steps_per_s"]
        )
        assert 0 < lv["step_output_ms"] <= lv["step_busy_ms"]
        # the generator's TTFT is part of the clients' (its engine queue part of it)
        assert 0 <= lv["generator_queue_mean_ms"] <= lv["generator_ttft_mean_ms"]
        assert lv["generator_ttft_mean_ms"] < lv["ttft_mean_ms"]
    assert "sidecar: 2 worker process(es) on one port (--sidecar-workers)" in section
    # Each level's clients ran in 2 worker processes; the records below are in prompt order.
    assert "spread over up to 2 process(es) (--client-processes)" in section
    # Per level: CPU of the sidecar and this client, and the generator's time counters.
    for load in loads.values():
        assert "sidecar" in load["cpu"] and "client" in load["cpu"], load
        assert re.match(
            r"busy \d+%, cpu \d+%, gpu wait \d+%; [\d,]+ steps/s \([\d,]+ prefill/s of [\d,]+ "
            r"tok\), \d+ tok/decode step$",
            load["engine"],
        ), load
        assert re.search(r"[1-9][\d,]* responses/s", load["sender"]), load
    inputs = online.level_workloads(online.parse_args(args), tokenizer)
    for c, level in results.items():
        texts, workload = inputs[c]
        assert [r.error for r in level.records] == [None] * 4
        # ignore_eos + max_tokens: usage reports exactly the requested length.
        assert [r.completion_tokens for r in level.records] == workload.output_lens
        expected_prompt = [
            len(render_prompt(tokenizer, messages=[{"role": "user", "content": t}])) for t in texts
        ]
        assert [r.prompt_tokens for r in level.records] == expected_prompt
        assert level.output_tokens == workload.num_output_tokens
        # Tokens decoding to no text (special ids) add no chunk, so only bounds are exact.
        assert sum(len(r.chunk_times) for r in level.records) > 0
        for r in level.records:
            assert len(r.chunk_times) <= r.completion_tokens
            assert all(r.start < t <= r.end for t in r.chunk_times)
            assert r.chunk_times == sorted(r.chunk_times)
        assert offline_tps[c] > 0


def test_decode_step_bytes_are_weights_plus_live_kv(tiny_model_dir):
    """The decode-step bound counts every weight once plus K/V of each live token."""
    from benchmarks.decode_step import time_decode_step
    from tritonllm.config import ModelConfig

    batch, prompt, steps = 3, 20, 4
    seconds, nbytes = time_decode_step(
        str(tiny_model_dir), "cpu", "torch", batch, "eager", prompt, steps, {}
    )
    cfg = ModelConfig.from_pretrained(str(tiny_model_dir))
    weights = bandwidth.checkpoint_weight_bytes(tiny_model_dir, 4)
    # After prefill, 4 warm-up steps and `steps` timed ones, each live sequence holds K/V for
    # its prompt plus every token fed back (the last sampled one is not yet in the cache).
    live = batch * (prompt + 4 + steps)
    assert seconds > 0
    assert nbytes == weights + live * cfg.kv_bytes_per_token * 4


@pytest.mark.parametrize("steps", [[], ["tests", "no-such-step"]])
def test_gpu_suite_refuses_bad_steps_before_doing_anything(tmp_path, steps):
    """No step, or any unknown one: usage and exit 2, with no checkpoint built (no python3 run:
    a stand-in first on PATH records every call) and no output folder created."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    for tool in ("python3", "nvidia-smi"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\n')
        (bin_dir / tool).chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out))
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_suite.sh"), *steps],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "usage:" in result.stderr
    assert not calls.exists(), calls.read_text()
    assert not out.exists()


def _suite(tmp_path, steps, **env):
    """Run gpu_suite.sh with stand-ins for python3 and nvidia-smi first on PATH: each records its
    arguments and, for the benchmarks, writes the files the real ones would (a log line, the
    JSON, a plot), so that the suite's own logic (steps, limits, packing) is what is tested."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls.txt"
    fake = f"""#!/bin/sh
echo "$*" >> "{calls}"
for a in "$@"; do
  case "$prev" in
  --json) echo '{{}}' > "$a" ;;
  --plots-dir) mkdir -p "$a" && echo png > "$a/plot.png" ;;
  esac
  prev=$a
done
echo "ran $*"
"""
    (bin_dir / "python3").write_text(fake)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho gpu\n")
    for tool in ("python3", "nvidia-smi"):
        (bin_dir / tool).chmod(0o755)
    out = tmp_path / "out"
    env = {"OUT": str(out), **env}
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env)
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_suite.sh"), *steps],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = calls.read_text().splitlines() if calls.exists() else []
    return result, lines, out


def test_gpu_suite_runs_the_issue16_steps_and_packs_their_results(tmp_path):
    """ceiling, gemm, offline8b and online8b run their benchmarks with the flags that write
    into $OUT (the 8B checkpoint built first, once per step, the 0.6B one not at all); every log,
    JSON and plot lands in one archive, the originals are removed, BENCHMARKS.md and the summary
    stay."""
    import tarfile

    result, calls, out = _suite(tmp_path, ["ceiling", "gemm", "bench8b"])
    assert result.returncode == 0, result.stderr
    assert [c.split()[1] for c in calls] == [
        "benchmarks.ceiling",
        "kernels.bench_linear",
        "tritonllm.build_model",
        "benchmarks.offline",
        "tritonllm.build_model",
        "benchmarks.online",
    ]
    assert f"--json {out}/linear-sweep.json" in calls[1]
    assert "--shape qwen3-8b --out models/qwen3-8b" in calls[2]
    assert "--model models/qwen3-8b --hf-subset 0" in calls[3]
    assert "--model models/qwen3-8b" in calls[5] and "--prompts-per-client 2" in calls[5]
    assert all(f"--benchmarks-md {out}/BENCHMARKS.md" in calls[i] for i in (0, 3, 5))
    summary = (out / "suite-summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [
        ["ceiling", "rc=0"],
        ["gemm", "rc=0"],
        ["build-qwen3-8b", "rc=0"],
        ["offline8b", "rc=0"],
        ["build-qwen3-8b", "rc=0"],
        ["online8b", "rc=0"],
    ]
    (archive,) = out.glob("results-ceiling-gemm-offline8b-online8b-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {
        "ceiling.log",
        "gemm.log",
        "linear-sweep.json",
        "offline-8b.log",
        "online-8b.log",
    } <= names
    assert {"build.log", "benchmarks/plots/plot.png", "BENCHMARKS.md", "suite-summary.txt"} <= names
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["BENCHMARKS.md", "suite-summary.txt", archive.name]
    )


def test_gpu_suite_runs_the_tensor_parallel_steps_of_issue20(tmp_path):
    """tests-tp2 runs the two-GPU tests on the built 0.6B checkpoint; bench-tp2 the offline
    table at sizes 1 and 2 and one online level at size 2, with their logs packed."""
    import tarfile

    result, calls, out = _suite(tmp_path, ["tests-tp2", "bench-tp2"])
    assert result.returncode == 0, result.stderr
    assert [c.split()[1] for c in calls] == [
        "tritonllm.build_model",
        "pytest",
        "benchmarks.offline",
        "benchmarks.online",
    ]
    assert calls[1].endswith("tests/test_gpu_tp.py") and "-m gpu" in calls[1]
    assert "--tensor-parallel-size 1,2" in calls[2] and "--hf-subset 0" in calls[2]
    assert "--tensor-parallel-size 2 --concurrency 64" in calls[3]
    assert f"--server-log {out}/server-tp2.log" in calls[3]
    (archive,) = out.glob("results-tests-tp2-offline-tp2-online-tp2-*.tar.gz")
    with tarfile.open(archive) as tar:
        assert {"gpu-tests-tp2.log", "offline-tp2.log", "online-tp2.log"} <= set(tar.getnames())


def test_gpu_suite_skips_steps_the_time_budget_cannot_hold(tmp_path):
    result, calls, out = _suite(tmp_path, ["gemm", "online8b"], SUITE_SECONDS="70")
    assert result.returncode == 1
    assert calls == []
    assert "gemm: skipped" in (out / "suite-summary.txt").read_text()


def test_gpu_suite_refuses_an_output_folder_inside_the_repository(tmp_path):
    result, calls, _ = _suite(tmp_path, ["gemm"], OUT=str(REPO_ROOT / "benchmarks" / "new"))
    assert result.returncode == 2 and "outside the repository" in result.stderr
    assert calls == [] and not (REPO_ROOT / "benchmarks" / "new").exists()


def test_only_publishing_tools_offer_benchmarks_md_flags(capsys):
    """profile_step writes no BENCHMARKS.md section, so its --help offers no flag for one."""
    with pytest.raises(SystemExit):
        profile_step.main(["--help"])
    text = capsys.readouterr().out
    assert "--batch-sizes" in text
    assert "--no-append" not in text and "--benchmarks-md" not in text
    with pytest.raises(SystemExit):
        decode_step.main(["--help"])
    text = capsys.readouterr().out
    assert "--no-append" in text and "--benchmarks-md" in text


def test_host_step_command_line_prints_the_step_and_the_profile(tiny_model_dir, capsys):
    """`python -m benchmarks.host_step --model DIR ... --profile` runs end to end."""
    from benchmarks import host_step

    host_step.main(
        ["--model", str(tiny_model_dir), "--batch-size", "2", "--prompt-len", "8"]
        + ["--steps", "3", "--profile"]
    )
    out = capsys.readouterr().out
    assert re.search(r"batch 2: [0-9.]+ ms host per decode step", out)
    assert "function calls" in out


@pytest.mark.parametrize("sampler", ["fused", "cpu", "stub"])
def test_host_step_times_decode_steps_of_the_whole_batch(tiny_model_dir, sampler):
    """host_step's engine decodes every request each step; "fused" runs the sampler's CUDA fast
    path (host side) and leaves the sampler unpatched afterwards, "cpu" the real CPU path."""
    from benchmarks import host_step
    from tritonllm.engine import sampler as sampler_module

    use_fused = sampler_module.use_fused
    engine = host_step.stubbed_engine(str(tiny_model_dir), 4, 20, 40, sampler)
    assert len(engine.scheduler.running) == 4
    assert all(r.is_decoding for r in engine.scheduler.running)
    before = engine.stats().num_steps
    assert host_step.time_steps(engine, 3, sampler) > 0
    assert engine.stats().num_steps == before + 8  # 5 warm-up steps + 3 timed
    assert engine.stats().max_batch_size_seen == 4
    fast = engine.runner.sampler.fast_steps
    assert (fast > 0) == (sampler == "fused")
    assert sampler_module.use_fused is use_fused


def test_a_fused_level_that_went_through_the_detokenizer_stops_the_run():
    from benchmarks.load_probe import DETOKENIZER_REQUESTS

    fused = {"tritonllm_responses_total": 4000.0, DETOKENIZER_REQUESTS: 3.0}  # health probes
    online.check_fused(fused, 256)
    online.check_fused({}, 1)  # no metrics: nothing to check
    fell_back = {"tritonllm_responses_total": 2300.0, DETOKENIZER_REQUESTS: 2290.0}
    with pytest.raises(RuntimeError, match="control secret"):
        online.check_fused(fell_back, 256)


def test_online_levels_send_prompts_per_client_requests_each(tokenizer):
    """Without --num-prompts-per-level a level has max(8, prompts-per-client x concurrency)."""
    args = online.parse_args(
        ["--concurrency", "1,16", "--prompts-per-client", "3", "--max-input-len", "120"]
        + ["--max-output-len", "110", "--no-append"]
    )
    levels = online.level_workloads(args, tokenizer)
    assert {c: len(w.prompts) for c, (_, w) in levels.items()} == {1: 8, 16: 48}
    assert all(len(texts) == len(w.prompts) for texts, w in levels.values())


def test_prefill_host_times_prefill_and_decode_steps_separately(tiny_model_dir, capsys):
    """prefill_host's arrivals make prefill steps of exactly the case's prompts (admission
    delay off), with the decoding requests riding along (mixed steps: 3, then 5 with the first
    arrivals), between decode steps of the decoding requests plus the admitted ones."""
    from benchmarks import prefill_host

    args = prefill_host.parse_args(
        ["--model", str(tiny_model_dir), "--device", "cpu", "--attention-backend", "torch"]
        + ["--decoding", "3", "--cases", "2x17", "--steps", "6", "--profile"]
    )
    lines = prefill_host.run(args)
    assert len(lines) == 1
    # Arrivals at steps 0 and 3, each admitted in one prefill step of 2 x 17 tokens.
    assert lines[0].startswith("arrivals of 2x17: 2 prefill steps, host ")
    assert "(34 prompt tokens and 4 decode rows on average); 4 decode steps" in lines[0]
    assert "function calls" in capsys.readouterr().out  # the cProfile table
    with pytest.raises(ValueError, match="COUNTxLEN"):
        prefill_host.parse_cases("4x")
    for bad in (["--cases", "0x5"], ["--steps", "-1"], ["--engine-arg", "foo"]):
        with pytest.raises(SystemExit):  # argparse's usage error, not a traceback
            prefill_host.parse_args(bad)
    assert "usage:" in capsys.readouterr().err


def test_structured_decode_times_full_batches_with_constrained_rows(tiny_model_dir):
    """The structured-output decode benchmark keeps every row (constrained ones under its
    schema) decoding through the timed steps (it exits otherwise)."""
    from benchmarks.structured_decode import time_structured_step

    seconds = time_structured_step(str(tiny_model_dir), "cpu", "torch", 3, 2, 8, 3, 0.6, {})
    assert seconds > 0
    host: dict[str, float] = {}
    time_structured_step(str(tiny_model_dir), "cpu", "torch", 3, 2, 8, 3, 0.6, {}, host=host)
    # --host-profile: every part but the CUDA mask kernel ran in the timed steps, the
    # matchers' accept inside the processing of the samples
    parts = {"schedule", "host inputs", "forward", "process", "accept", "mask start"}
    assert set(host) == parts | {"mask finish", "fill"}
    assert all(host[part] > 0 for part in host) and host["accept"] <= host["process"], host


def test_mask_fill_times_every_way_of_making_matchers(tiny_model_dir, capsys):
    """The mask-fill benchmark walks llguidance's copies and own matchers and xgrammar's
    matchers of its schema alike, after a pre-warm walk (each row's token drawn from its own
    mask, so a wrong mask fails the walk) and tables each."""
    from benchmarks import mask_fill

    table = mask_fill.main(
        ["--model", str(tiny_model_dir), "--rows", "3", "--steps", "3", "--threads", "1,2"]
        + ["--prewarm", "2"]
    )
    lines = table.splitlines()
    assert [line.split("|")[1:3] for line in lines[2:]] == [
        [" copy ", " 1 "],
        [" copy ", " 2 "],
        [" own ", " 1 "],
        [" own ", " 2 "],
        [" xgrammar ", " 1 "],
        [" xgrammar ", " 2 "],
    ]
    assert all(float(line.split("|")[3]) > 0 for line in lines[2:])


def test_online_refuses_sidecar_workers_for_a_sidecar_it_does_not_start(capsys):
    with pytest.raises(SystemExit) as exit_:
        online.parse_args(["--openai-url", "http://127.0.0.1:1", "--sidecar-workers", "2"])
    assert exit_.value.code == 2 and "--sidecar-workers" in capsys.readouterr().err
    assert online.parse_args(["--openai-url", "http://127.0.0.1:1"]).sidecar_workers == 1


@pytest.mark.parametrize("url", ["--openai-url", "--triton-url"])
def test_online_refuses_generator_instances_for_a_server_it_does_not_start(url, capsys):
    with pytest.raises(SystemExit) as exit_:
        online.parse_args([url, "http://x", "--generator-instances", "2"])
    assert exit_.value.code == 2 and "--generator-instances" in capsys.readouterr().err
    assert online.parse_args([url, "http://x"]).generator_instances == 1
    assert online.parse_args(["--generator-instances", "3"]).generator_instances == 3
    with pytest.raises(SystemExit):
        online.parse_args(["--generator-instances", "0"])


def test_online_response_budget_comes_from_the_option_the_environment_or_the_default(
    monkeypatch, capsys
):
    monkeypatch.delenv(online.BUDGET_ENV, raising=False)
    assert online.response_budget(online.parse_args([])) == ServingConfig().max_responses_per_s
    monkeypatch.setenv(online.BUDGET_ENV, "12000")
    assert online.response_budget(online.parse_args([])) == 12000.0
    given = online.parse_args(["--max-responses-per-s", "0"])
    assert online.response_budget(given) == 0.0  # no pacing
    refused = [
        [u, "http://x", "--max-responses-per-s", "8000"] for u in ("--triton-url", "--openai-url")
    ]
    refused += [["--max-responses-per-s", v] for v in ("-1", "nan", "inf")]
    for argv in refused:
        with pytest.raises(SystemExit):
            online.parse_args(argv)
        assert "--max-responses-per-s" in capsys.readouterr().err


def test_cpu_prefill_chunks_counts_the_steps_of_one_prompt(tiny_model_dir):
    """A 40-token prompt at a budget of 16 takes 3 prefill steps (16 + 16 + 8)."""
    from benchmarks import cpu_prefill_chunks

    total, steps, longest = cpu_prefill_chunks.prefill_seconds(str(tiny_model_dir), 16, 40)
    assert steps == 3 and 0 < longest <= total


@pytest.mark.parametrize("text", [False, True], ids=["ids", "text"])
def test_response_path_harness_runs_the_served_sender_path(text, tiny_model_dir, capsys):
    """`benchmarks.response_path` drives the generator adapter's real sender path over its
    stand-in `pb_utils` (histograms included), answering ids as through `llm` or text as
    through `llm_fused` (`--text`); every output becomes a response. Speed is not asserted."""
    from benchmarks import response_path

    argv = ["--json", "--no-triton-cost", "--concurrency", "8", "--tokens", "16"]
    argv += ["--step-ms", "5", "--seconds", "0.4", "--warm-s", "0.1", "--budget", "0"]
    if text:
        argv += ["--text", str(tiny_model_dir)]
    response_path.main(argv)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["responses_per_s"] > 0
    assert result["tokens_per_response"] >= 1.0
    # ids: output_ids, prefix_ids and the progress tensors; text: text_output in their place
    assert result["tensors_per_response"] >= (2.0 if text else 3.0)


def test_client_pool_returns_each_level_in_request_order_and_stops_its_workers():
    """`ClientPool` spreads a level over its worker processes (here 3 workers for 4 clients, so
    one worker has two) and puts every record back at its request's index; against a port with
    no server every request fails alone, with its connection error."""
    import asyncio
    import socket

    from benchmarks.streaming_client import ClientPool

    with socket.socket() as s:  # a free port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lens = [3, 5, 7, 11, 13, 17, 19]
    with ClientPool(3) as pool:
        workers = list(pool._executor._processes.values())
        assert len(workers) == 3 and all(w.is_alive() for w in workers)
        level = asyncio.run(
            pool.run_level(f"http://127.0.0.1:{port}", "m", ["hi"] * len(lens), lens, 4)
        )
        assert [r.max_tokens for r in level.records] == lens
        assert all(r.error and "ConnectError" in r.error for r in level.records)
        assert pool.cpu_s > 0
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive()
