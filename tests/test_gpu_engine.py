"""The GPU engine: CUDA-graph decode, overlap scheduling, GPU sampling, attention backends.

- Overlap scheduling changes when outputs are reported, never what they are: a mixed workload
  (greedy, seeded sampling, penalties, logit bias, logprobs, n > 1, stop tokens, min_tokens,
  chunked prefill, a KV pool small enough to preempt) gives identical outputs with it on and off. This
  also runs on CPU (the same code path, without the concurrency).
- CUDA-graph decode (padded batch sizes, eager above the largest graph) gives the same ids as
  eager decode.
- Each attention backend gives the torch backend's greedy ids (float32; FlashInfer has no
  float32 kernels, so it is compared in bfloat16).
- bf16 greedy output equals transformers' bf16 greedy output up to the first position whose top-2
  logit margin (transformers' logits) is below bf16 resolution, on the Qwen3-0.6B shape.

GPU tests are marked `gpu` (skipped without CUDA). `TRITONLLM_GPU_TEST_MODEL` may name a built
qwen3-0.6b checkpoint (`python -m tritonllm.build_model --shape qwen3-0.6b`); otherwise one is
built (~15 s).
"""

from __future__ import annotations

import functools
import gc
import os

import pytest
import torch
from test_engine_helpers import _ROOT, _init_, checkpoint, prompts, sample_host

from tritonllm.config import EngineConfig
from tritonllm.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams as SP

HAS_CUDA = torch.cuda.is_available()


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


needs_flashinfer = pytest.mark.skipif(not _has_flashinfer(), reason="flashinfer not installed")


@functools.cache
def checkpoint_hd128() -> str:
    """A 2-layer Qwen3 with Qwen3-0.6B's attention geometry (16/8 heads, head_dim 128), float32,
    initialised for wide logit margins (as the other tiny test checkpoints)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    out = _ROOT / "qwen3-hd128"
    cfg = Qwen3Config(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1e6,
        eos_token_id=7,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _init_(model, 0)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=[7, 8]).save_pretrained(out)
    return str(out)


def _engine(model: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_pages", 512)
    kwargs.setdefault("page_size", 4)
    return LLMEngine(EngineConfig(model=model, **kwargs))


def _release(engine: LLMEngine | None) -> None:
    del engine
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], SP]]) -> dict[str, list]:
    """Run requests together; return {id: [(ids, finished, reason, num_output_tokens,
    logprobs, top_logprobs), ...]} per output (choice i > 0 of an n > 1 request as "id[i]")."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            label = o.request_id if o.index == 0 else f"{o.request_id}[{o.index}]"
            outs.setdefault(label, []).append(
                (
                    tuple(o.new_token_ids),
                    o.finished,
                    o.finish_reason,
                    o.num_output_tokens,
                    o.logprobs,
                    o.top_logprobs,
                )
            )
    return outs


def ids(outs: dict[str, list]) -> dict[str, list[int]]:
    return {rid: [t for o in seq for t in o[0]] for rid, seq in outs.items()}


def assert_same_outputs(got: dict, expected: dict, atol: float) -> None:
    """Identical ids, finish flags/reasons and counts; logprobs equal within `atol` (batch
    composition changes float rounding, not results)."""
    assert got.keys() == expected.keys()
    for rid in expected:
        assert [o[:4] for o in got[rid]] == [o[:4] for o in expected[rid]], rid
        for g, e in zip(got[rid], expected[rid], strict=True):
            assert (g[4] is None) == (e[4] is None)
            if e[4] is not None:
                assert g[4] == pytest.approx(e[4], abs=atol)
                for gt, et in zip(g[5], e[5], strict=True):
                    common = gt.keys() & et.keys()
                    assert len(common) >= len(et) - 1, rid  # a near-tie may swap the last one
                    assert [gt[t] for t in common] == pytest.approx(
                        [et[t] for t in common], abs=atol
                    )


def mixed_workload(stop_from: dict[str, list[int]] | None = None) -> dict[str, tuple]:
    """Requests exercising every sampling path; `stop_from` (greedy ids of r0/r7 from a first
    run) supplies stop tokens that the model really produces."""
    ps = prompts([3, 5, 9, 17, 30, 4, 8, 12, 9, 6, 7, 10], seed=3)
    ps[8] = list(ps[2])  # same prompt: shares the prefix cache
    stop0 = [stop_from["r0"][6]] if stop_from else []
    stop7 = [stop_from["r7"][2]] if stop_from else []
    params = [
        SP(max_tokens=20, temperature=0, stop_token_ids=stop0, ignore_eos=True),
        SP(max_tokens=15, temperature=0.8, seed=7, top_p=0.9, ignore_eos=True),
        SP(max_tokens=25, temperature=0),
        SP(max_tokens=12, temperature=1.0, seed=3, top_k=20, min_p=0.05, logprobs=3),
        SP(
            max_tokens=18,
            temperature=0,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            ignore_eos=True,
        ),
        SP(max_tokens=1, temperature=0, ignore_eos=True),
        SP(max_tokens=16, temperature=0.7, seed=11, n=2, ignore_eos=True),
        SP(max_tokens=30, temperature=0, min_tokens=4, stop_token_ids=stop7, ignore_eos=True),
        SP(max_tokens=20, temperature=0, logprobs=0, ignore_eos=True),
        SP(max_tokens=40, temperature=0, ignore_eos=True),
        SP(max_tokens=14, temperature=0, logit_bias={11: 3.0, 12: -2.0}, ignore_eos=True),
        SP(max_tokens=14, temperature=0.9, seed=5, logit_bias={11: 4.0, 13: 1.5}, ignore_eos=True),
    ]
    return {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(ps, params, strict=True))}


def _check_overlap_identical(model: str, atol: float, **kwargs) -> None:
    plain = _engine(model, overlap_schedule=False, **kwargs)
    first = ids(run_all(plain, mixed_workload()))
    work = mixed_workload(first)
    expected = run_all(plain, work)
    assert [o[2] for o in expected["r0"]][-1] == "stop"  # the stop token paths are exercised
    _release(plain)
    overlap = _engine(model, overlap_schedule=True, **kwargs)
    assert overlap.runner.config.use_overlap_schedule
    got = run_all(overlap, work)
    assert_same_outputs(got, expected, atol)
    stats = overlap.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.free_pages + stats.evictable_pages == stats.total_pages
    _release(overlap)


@pytest.mark.parametrize(("num_pages", "budget"), [(512, 8192), (30, 7)])
def test_overlap_schedule_gives_identical_outputs_cpu(num_pages, budget):
    """(30 pages of 4 and a 7-token prefill budget force chunked prefill and preemption.)"""
    _check_overlap_identical(
        checkpoint("qwen3"), 1e-4, num_pages=num_pages, max_prefill_tokens=budget, device="cpu"
    )


def test_overlap_abort_releases_pages_cpu():
    engine = _engine(checkpoint("qwen3"), overlap_schedule=True)
    for i, p in enumerate(prompts([5, 9, 13], seed=4)):
        engine.add_request(f"a{i}", p, SP(max_tokens=50, temperature=0, ignore_eos=True))
    seen: dict[str, list] = {}
    for _ in range(6):
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    assert engine.abort("a1")
    while engine.has_unfinished():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    last = seen["a1"][-1]
    assert last.finish_reason == "abort" and last.new_token_ids == []
    assert last.num_output_tokens == sum(len(o.new_token_ids) for o in seen["a1"])
    assert [o.finish_reason for o in (seen["a0"][-1], seen["a2"][-1])] == ["length"] * 2
    stats = engine.stats()
    assert stats.free_pages + stats.evictable_pages == stats.total_pages


def test_gpu_knobs_default_on_for_cuda_only():
    cpu = EngineConfig(model="unused")
    assert not cpu.use_cuda_graph and not cpu.use_overlap_schedule
    cuda = EngineConfig(model="unused", device="cuda", attention_backend="flashinfer")
    assert cuda.use_cuda_graph and cuda.use_overlap_schedule
    torch_cuda = EngineConfig(model="unused", device="cuda", attention_backend="torch")
    assert not torch_cuda.use_cuda_graph  # the reference backend has no graph hooks
    auto = EngineConfig(model="unused", device="cuda")
    assert auto.resolved_attention_backend in ("flashinfer", "triton", "torch")
    assert auto.use_cuda_graph == (auto.resolved_attention_backend != "torch")
    assert EngineConfig(model="unused").resolved_attention_backend == "torch"  # CPU
    assert cuda.cuda_graph_batch_sizes == [1, 2, 4, 8] + list(range(16, 257, 8))
    small = EngineConfig(model="unused", cuda_graph_max_bs=20)
    assert small.cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 20]


# ---- GPU -------------------------------------------------------------------------------------

BACKEND_DTYPES = [
    ("triton", "float32"),
    pytest.param("flashinfer", "bfloat16", marks=needs_flashinfer),
]
# Different lengths, so the decode batch shrinks through several padded graph sizes.
GRAPH_WORK = {
    f"g{i}": (p, SP(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True))
    for i, p in enumerate(prompts([1, 4, 5, 8, 9, 16, 17, 30, 3], seed=5))
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("backend", "dtype"), BACKEND_DTYPES)
@pytest.mark.parametrize("max_bs", [16, 4])
def test_cuda_graph_decode_matches_eager(backend, dtype, max_bs):
    """max_bs 4 < 9 requests: the first decode steps run eagerly, the later ones replay."""
    model = checkpoint_hd128()
    common = dict(device="cuda", dtype=dtype, attention_backend=backend, overlap_schedule=False)
    eager = _engine(model, cuda_graph=False, **common)
    assert eager.runner.graph_runner is None
    expected = ids(run_all(eager, GRAPH_WORK))
    _release(eager)
    graphed = _engine(model, cuda_graph=True, cuda_graph_max_bs=max_bs, **common)
    runner = graphed.runner.graph_runner
    assert runner is not None and runner.batch_sizes[-1] == max_bs
    assert ids(run_all(graphed, GRAPH_WORK)) == expected
    assert runner.num_replays > 0
    _release(graphed)


def margins(outs: dict[str, list]) -> dict[str, list[float]]:
    """Per request, the top-2 logprob gap (= logit gap) of each token (runs with logprobs=2)."""
    result = {}
    for rid, seq in outs.items():
        gaps = []
        for o in seq:
            for top in o[5] or []:
                vals = sorted(top.values(), reverse=True)
                gaps.append(vals[0] - vals[1])
        result[rid] = gaps
    return result


def assert_same_until_low_margin(got: dict, expected: dict, threshold: float) -> int:
    """Ids equal up to the first token whose reference top-2 gap is below `threshold`; where
    there is none, the whole output (ids, finish reason, counts) is equal. Returns the number
    of tokens compared."""
    gaps, got_ids, exp_ids = margins(expected), ids(got), ids(expected)
    compared = 0
    for rid in expected:
        low = [i for i, g in enumerate(gaps[rid]) if g < threshold]
        n = low[0] if low else len(exp_ids[rid])
        assert got_ids[rid][:n] == exp_ids[rid][:n], f"{rid} differs before token {n}"
        if not low:
            assert [o[:4] for o in got[rid]] == [o[:4] for o in expected[rid]], rid
        compared += n
    return compared


# bfloat16 runs through different kernels or batch compositions agree only up to rounding:
# ids are compared up to the first token whose top-2 logit gap is within bf16 noise.
BF16_GAP = 0.25


def greedy_workload(stop_from: dict[str, list[int]] | None = None) -> dict[str, tuple]:
    """Greedy requests with top-2 logprobs (for the gaps), stop tokens and min_tokens."""
    ps = prompts([3, 5, 9, 17, 30, 4, 8, 12], seed=9)
    ps[7] = list(ps[2])
    out = {}
    for i, p in enumerate(ps):
        stop = [stop_from[f"r{i}"][5]] if stop_from and i % 3 == 0 else []
        sp = SP(
            max_tokens=12 + 4 * i,
            temperature=0,
            logprobs=2,
            stop_token_ids=stop,
            min_tokens=3 if i == 3 else 0,
            ignore_eos=True,
        )
        out[f"r{i}"] = (p, sp)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_overlap_schedule_gives_identical_outputs_gpu():
    """float32 (triton backend): identical outputs for the whole mixed workload."""
    _check_overlap_identical(
        checkpoint_hd128(),
        1e-4,
        num_pages=40,
        max_prefill_tokens=9,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        cuda_graph_max_bs=16,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@needs_flashinfer
def test_overlap_schedule_gives_the_same_outputs_bf16_flashinfer():
    common = dict(
        num_pages=40,
        max_prefill_tokens=9,
        device="cuda",
        dtype="bfloat16",
        attention_backend="flashinfer",
        cuda_graph_max_bs=16,
    )
    plain = _engine(checkpoint_hd128(), overlap_schedule=False, **common)
    work = greedy_workload(ids(run_all(plain, greedy_workload())))
    expected = run_all(plain, work)
    _release(plain)
    overlap = _engine(checkpoint_hd128(), overlap_schedule=True, **common)
    got = run_all(overlap, work)
    assert assert_same_until_low_margin(got, expected, BF16_GAP) >= 20
    stats = overlap.stats()
    assert stats.free_pages + stats.evictable_pages == stats.total_pages
    _release(overlap)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("torch", "float32"),
        ("triton", "float32"),
        pytest.param("flashinfer", "bfloat16", marks=needs_flashinfer),
    ],
)
def test_attention_backends_give_the_torch_backends_greedy_ids(backend, dtype):
    model = checkpoint_hd128()
    work = {
        f"b{i}": (p, SP(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True))
        for i, p in enumerate(prompts([1, 7, 16, 33, 70, 5], seed=6))
    }
    common = dict(device="cuda", dtype=dtype, max_prefill_tokens=40)
    ref_engine = _engine(model, attention_backend="torch", **common)
    expected = run_all(ref_engine, work)
    _release(ref_engine)
    engine = _engine(model, attention_backend=backend, cuda_graph_max_bs=8, **common)
    got = run_all(engine, work)
    if dtype == "float32":
        assert ids(got) == ids(expected)
    else:
        assert assert_same_until_low_margin(got, expected, BF16_GAP) >= 30
    _release(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_seeded_sampling_is_batch_independent_on_gpu():
    model = checkpoint_hd128()
    engine = _engine(
        model, device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16
    )
    ps = prompts([6 + i for i in range(8)], seed=7)
    target = SP(max_tokens=20, temperature=1.0, top_p=0.95, top_k=100, seed=42, ignore_eos=True)
    alone = ids(run_all(engine, {"t": (ps[0], target)}))["t"]
    others = {
        f"o{i}": (ps[i], SP(max_tokens=5 + i, temperature=1.2, ignore_eos=True))
        for i in range(1, 8)
    }
    assert ids(run_all(engine, {"t": (ps[0], target), **others}))["t"] == alone
    _release(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_sampler_follows_the_distribution():
    from tritonllm.engine.request import Request
    from tritonllm.engine.sampler import Sampler

    sampler = Sampler(torch.device("cuda"), seed=0)
    reqs = [Request(str(i), [1], SP(top_k=2), arrival=i) for i in range(4000)]
    logits = torch.full((4000, 6), -5.0, device="cuda")
    logits[:, 0], logits[:, 1] = 2.0, 1.0
    tokens = torch.tensor(sample_host(sampler, logits, reqs).token_ids)
    assert set(tokens.tolist()) <= {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.7311) < 0.03


@pytest.fixture(scope="module")
def qwen3_06b(tmp_path_factory) -> str:
    path = os.environ.get("TRITONLLM_GPU_TEST_MODEL")
    if path:
        return path
    from tritonllm.build_model import build_model

    return str(build_model(tmp_path_factory.mktemp("q06") / "qwen3-0.6b", shape="qwen3-0.6b"))


@torch.inference_mode()
def _hf_bf16_greedy(model, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    out = model(torch.tensor([prompt], device="cuda"), use_cache=True)
    tokens, logits = [], []
    for _ in range(max_new):
        row = out.logits[0, -1].float()
        logits.append(row)
        tok = int(row.argmax())
        tokens.append(tok)
        cache = out.cache if "cache" in out else out.past_key_values
        key = "cache" if "cache" in out else "past_key_values"
        out = model(torch.tensor([[tok]], device="cuda"), use_cache=True, **{key: cache})
    return tokens, torch.stack(logits)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@needs_flashinfer
def test_bf16_greedy_matches_transformers_until_a_sub_resolution_margin(qwen3_06b):
    from transformers import AutoModelForCausalLM

    work = {
        f"h{i}": (p, SP(max_tokens=32, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts([7, 33, 100, 257], seed=8))
    }
    engine = _engine(
        qwen3_06b,
        device="cuda",
        attention_backend="flashinfer",
        num_pages=1024,
        page_size=16,
        cuda_graph_max_bs=8,
    )
    assert engine.config.torch_dtype == torch.bfloat16 and engine.runner.graph_runner
    got = ids(run_all(engine, work))
    _release(engine)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_06b, dtype=torch.bfloat16).cuda().eval()
    compared = 0
    for rid, (prompt, params) in work.items():
        ref, logits = _hf_bf16_greedy(hf, prompt, params.max_tokens)
        top2 = logits.topk(2, dim=-1).values
        resolution = 2.0**-7 * top2[:, 0].abs()
        low = (top2[:, 0] - top2[:, 1] < resolution).nonzero()
        n = int(low[0]) if len(low) else len(ref)
        diff = [i for i in range(n) if got[rid][i] != ref[i]]
        if diff:
            i = diff[0]
            gap = float((top2[i, 0] - top2[i, 1]) / resolution[i])
            pytest.fail(
                f"{rid}: token {i} differs (transformers' top-2 gap there: {gap:.2f} x "
                f"2^-7|logit|); first low-margin position: {n}"
            )
        compared += n
    assert compared >= 16, "margins too small to compare anything"
    del hf
    _release(None)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_logit_bias_on_gpu_gives_the_cpu_engines_ids():
    """float32: with CUDA-graph decode and overlap scheduling, greedy rows with logit_bias (a
    ban of the first plain greedy token, a forced token, small shifts) give the CPU engine's
    ids, beside an unbiased row."""
    model = checkpoint_hd128()
    prompt = prompts([9], seed=8)[0]
    cpu = _engine(model, device="cpu")
    plain = ids(run_all(cpu, {"p": (prompt, SP(max_tokens=10, temperature=0, ignore_eos=True))}))
    first = plain["p"][0]
    biases = {"ban": {first: -100.0}, "force": {17: 100.0}, "shift": {first: -2.0, 17: 3.0}}
    work = {
        name: (prompt, SP(max_tokens=10, temperature=0, ignore_eos=True, logit_bias=b))
        for name, b in biases.items()
    }
    work["plain"] = (prompt, SP(max_tokens=10, temperature=0, ignore_eos=True))
    expected = ids(run_all(cpu, work))
    _release(cpu)
    gpu = _engine(
        model, device="cuda", dtype="float32", attention_backend="triton", cuda_graph_max_bs=16
    )
    assert gpu.runner.config.use_cuda_graph and gpu.runner.config.use_overlap_schedule
    assert ids(run_all(gpu, work)) == expected
    assert first not in expected["ban"] and expected["force"] == [17] * 10
    assert expected["plain"] == plain["p"]
    _release(gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_logit_bias_rows_on_the_fused_sampler_path():
    """bfloat16 logits on the fused Gumbel-max path: a +100 bias forces its token on greedy
    and sampled rows, -100 bans the greedy row's argmax, and an unbiased row is untouched."""
    from tritonllm.engine.request import Request
    from tritonllm.engine.sampler import Sampler

    sampler = Sampler(torch.device("cuda"), seed=0, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4, 1000, device="cuda", generator=gen).to(torch.bfloat16)
    logits[2:, 100], logits[2:, 200] = 10.0, 9.0  # clear first and second choices (|randn| < 6)
    params = [
        SP(temperature=0, logit_bias={5: 100.0}),
        SP(temperature=1.0, logit_bias={6: 100.0}),
        SP(temperature=0, logit_bias={100: -100.0}),
        SP(temperature=0),
    ]
    reqs = [Request(str(i), [1], p, arrival=i) for i, p in enumerate(params)]
    assert sample_host(sampler, logits.clone(), reqs).token_ids == [5, 6, 200, 100]
