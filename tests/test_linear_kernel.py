"""The skinny-GEMM kernel (`kernels.linear`) against a float32 matmul, and `Linear`, the
`nn.Linear` that chooses per shape between it and cuBLAS.

Without CUDA the kernel runs in Triton's interpreter on small shapes, every candidate
configuration (dot-free GEMV, padded MMA, split-K or not) on weights and inputs that are views
into NaN-filled buffers, so a read past K or N poisons the result. On CUDA (marked `gpu`) it
runs Qwen3-0.6B's projection shapes, the chooser is checked in both forced modes, and a CUDA
graph that contains a `Linear` is captured and replayed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_engine_helpers import checkpoint

import kernels
from tritonllm.layers import Linear, SwiGLUMLP
from tritonllm.layers import linear as linear_layer

pytest.importorskip("triton")
from kernels.linear import (  # noqa: E402
    LinearConfig,
    candidate_configs,
    m_bucket,
    skinny_linear,
    tuned_config,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
HAS_CUDA = torch.cuda.is_available()
CPU = pytest.param(
    "cpu", marks=pytest.mark.skipif(not kernels.interpreting(), reason="needs the interpreter")
)
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_CUDA or kernels.interpreting(), reason="needs CUDA"),
    ],
)
# Qwen3-0.6B: qkv_proj, o_proj, gate_up_proj, down_proj, lm_head as (N, K).
QWEN3_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


def _padded(rows: int, cols: int, dtype, device, seed: int, scale: float = 1.0):
    """A `[rows, cols]` random view into a NaN-filled buffer with 3 spare rows and 24 spare
    columns (row stride cols + 24, a multiple of 8: 16-byte rows stay aligned)."""
    gen = torch.Generator(device).manual_seed(seed)
    buf = torch.full((rows + 3, cols + 24), float("nan"), dtype=dtype, device=device)
    values = torch.randn(rows, cols, generator=gen, device=device) * scale
    buf[:rows, :cols] = values.to(dtype)
    return buf[:rows, :cols]


def _reference(x, w, b):
    out = x.float() @ w.float().T
    return out if b is None else out + b.float()


def _check(out, x, w, b):
    """float32 reference; bf16/fp16 output rounding is the only allowed difference."""
    expected = _reference(x, w, b)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel < 1e-2, rel
    atol = 2e-2 * expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=atol)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize(
    ("n", "k", "bias", "dtype"),
    [
        (70, 300, True, torch.bfloat16),  # N, K not multiples of any block; K split in 2-3
        (96, 768, False, torch.bfloat16),  # even K: unmasked loads; a shorter last K-range
        (40, 72, True, torch.float16),  # K shorter than one block
    ],
)
def test_skinny_linear_every_config_matches_fp32_matmul(device, m, n, k, bias, dtype):
    x = _padded(m, k, dtype, device, seed=m)
    w = _padded(n, k, dtype, device, seed=100 + n, scale=k**-0.5)
    b = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dtype) if bias else None
    configs = candidate_configs(m, n, k)
    assert any(c.use_dot for c in configs)
    assert m > 8 or any(not c.use_dot for c in configs)  # the GEMV path for small M
    if k >= 300:
        assert any(c.split_k > 1 for c in configs)
    for cfg in configs:
        _check(skinny_linear(x, w, b, config=cfg), x, w, b)


@pytest.mark.parametrize("device", [CPU])
def test_skinny_linear_split_k_with_bias_and_strided_rows(device):
    """A 4-way split of K = 1000 (last range partly masked), bias added once, x a strided view
    of a wider activation (as the q part of a fused qkv output would be)."""
    x = _padded(5, 1000, torch.bfloat16, device, seed=1)
    assert x.stride(0) != x.shape[1]
    w = _padded(24, 1000, torch.bfloat16, device, seed=2, scale=0.03)
    b = torch.randn(24).bfloat16()
    for use_dot, bm in ((False, 8), (True, 16)):
        cfg = LinearConfig(use_dot, bm, 16, 64, split_k=4, num_warps=4, num_stages=2)
        _check(skinny_linear(x, w, b, config=cfg), x, w, b)


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize(("m", "use_dot", "block_m"), [(3, False, 4), (20, True, 16)])
def test_split_k_fixup_gives_the_reduce_kernels_bits_in_one_launch(device, m, use_dot, block_m):
    """The fix-up variant (the tile's last program sums the partials) adds them in the reduce
    kernel's order: bit-identical output, bias added once, every tile counter back at 0 after
    each launch, so a second launch (as a CUDA-graph replay) gives the same result."""
    import kernels.linear as kl

    x = _padded(m, 1000, torch.bfloat16, device, seed=3)
    w = _padded(40, 1000, torch.bfloat16, device, seed=4, scale=0.03)
    b = torch.randn(40, generator=torch.Generator().manual_seed(5)).bfloat16()
    for split in (2, 3, 4):
        reduce_cfg = LinearConfig(use_dot, block_m, 16, 64, split, num_warps=4, num_stages=2)
        fixup_cfg = reduce_cfg._replace(fixup=True)
        expected = skinny_linear(x, w, b, config=reduce_cfg)
        for _ in range(2):
            out = skinny_linear(x, w, b, config=fixup_cfg)
            assert torch.equal(out, expected), split
            assert not kl._locks(x.device, 1).any()
        _check(out, x, w, b)
    # Without a split there is nothing to fix up: the plain kernel's result.
    one = LinearConfig(use_dot, block_m, 16, 64, 1, 4, 2)
    assert torch.equal(
        skinny_linear(x, w, b, one._replace(fixup=True)), skinny_linear(x, w, b, one)
    )


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("m", [3, 20, 100])
def test_every_sweep_kernel_matches_fp32_matmul(device, m):
    """Each distinct kernel `kernels.bench_linear` times (`linear_sweep.sweep_configs`: tuned,
    more tiles, fix-up splits), once, on NaN-padded views: what the GPU sweep reports as a
    candidate computes the product."""
    from kernels.linear_sweep import FAMILIES, compile_key, sweep_configs

    families = sweep_configs(m, 48, 1024, sms=8)
    assert list(families) == list(FAMILIES)
    assert families["tuned"] == candidate_configs(m, 48, 1024, 8)
    assert families["fixup"] and all(c.fixup and c.split_k > 1 for c in families["fixup"])
    distinct = {}
    for configs in families.values():
        assert len(set(configs)) == len(configs)
        for cfg in configs:
            assert cfg.block_m >= min(m, 16) or not cfg.use_dot
            assert cfg.split_k * cfg.block_k <= 1024 and cfg.split_k <= 16
            distinct.setdefault(compile_key(cfg, 1024), cfg)
    x = _padded(m, 1024, torch.bfloat16, device, seed=m)
    w = _padded(48, 1024, torch.bfloat16, device, seed=9, scale=1024**-0.5)
    for cfg in distinct.values():
        _check(skinny_linear(x, w, None, config=cfg), x, w, None)


def test_bench_linear_keeps_cublas_unless_a_candidate_beats_the_margin():
    from kernels.bench_linear import best_of, config_text

    cfg = LinearConfig(False, 1, 16, 256, 8, 4, 3, fixup=True)
    point = {
        "cublas_us": 5.0,
        "families": {
            "tuned": {"us": 4.9, "config": cfg._replace(fixup=False)._asdict()},
            "fixup": {"us": 4.0, "config": cfg._asdict()},
            "sweep": {"us": None, "config": None},  # every candidate wrong: not timed
        },
    }
    assert best_of(point) == ("fixup", 4.0, cfg._asdict())
    point["families"]["fixup"]["us"] = 4.9  # within 3% of cuBLAS: noise, keep the library
    assert best_of(point) == ("cublas", 5.0, None)
    assert config_text(cfg) == "fma 1x16x256 s8 w4 st3 fix"


def test_bench_linear_times_every_candidate_and_leaves_wrong_ones_out(monkeypatch, tmp_path):
    """The sweep harness on CPU with stand-ins for the kernel and the graph timer: per point
    every candidate is checked against F.linear before it is timed, each family reports its
    fastest, the choice follows the margin, the layer row sums the projections, and the JSON
    on disk is the result."""
    import json

    import kernels.bench_linear as bench

    bad = LinearConfig(False, 1, 16, 256, 1, 4, 3)  # the first sweep tile at M = 1, no split
    broken = LinearConfig(False, 1, 8, 512, 1, 2, 4)  # a sweep tile that fails to launch
    launched = []

    def fake_skinny(x, w, b=None, config=None):
        if config == broken:
            raise RuntimeError("out of resources")
        launched.append(config)
        return torch.zeros_like(F.linear(x, w)) if config == bad else F.linear(x, w)

    def fake_graph_time(fn, weights):
        launched.clear()
        fn(weights[0])
        cfg = launched[-1] if launched else None  # None: the cuBLAS lambda
        if cfg is None:
            return 5e-6
        return (4e-6 if cfg.fixup else 6e-6) + 1e-9 * cfg.block_n  # ties broken by tile

    monkeypatch.setattr(bench, "skinny_linear", fake_skinny)
    monkeypatch.setattr(bench, "graph_time", fake_graph_time)
    models = {"tiny": {"qkv_proj": (64, 1024), "lm_head": (96, 512)}}
    out = tmp_path / "linear.json"
    result = bench.run(models, [1, 20], list(bench.FAMILIES), 8, 4e12, str(out), device="cpu")
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(p["shape"], p["m"]) for p in result["points"]] == [
        ("qkv_proj", 1),
        ("qkv_proj", 20),
        ("lm_head", 1),
        ("lm_head", 20),
    ]
    first = result["points"][0]
    # `bad` is in both the tuned set and the sweep, and wrong wherever it runs (M = 1).
    assert first["families"]["tuned"]["wrong"] == [bench.config_text(bad)]
    assert first["families"]["sweep"]["wrong"] == [
        bench.config_text(bad),
        f"{bench.config_text(broken)} (RuntimeError: out of resources)",
    ]
    assert first["families"]["fixup"]["wrong"] == []
    assert first["families"]["tuned"]["us"] == pytest.approx(6.016)  # no fix-up, block_n 16
    for point, choice in zip(result["points"], result["choices"], strict=True):
        assert point["cublas_us"] == pytest.approx(5.0)
        assert point["families"]["fixup"]["us"] < 4.1 and point["winner"] == "fixup"
        assert choice["impl"] == "triton" and choice["config"]["fixup"]
        assert (choice["n"], choice["k"], choice["m_bucket"]) == (
            point["n"],
            point["k"],
            point["m"],
        )
    # Only qkv_proj is a layer projection here: the layer row is its best alone.
    assert [(r["m"], r["cublas_us"]) for r in result["layers"]] == [(1, 5.0), (20, 5.0)]
    assert all(r["best_us"] < 4.1 for r in result["layers"])
    wrong = [line.split(": ", 1)[0] for line in bench.wrong_results(result)]
    assert wrong == ["tiny qkv_proj M=1"] * 3 + ["tiny lm_head M=1"] * 3


def test_bench_linear_precompiles_each_distinct_kernel_of_the_sweep_once():
    from kernels.bench_linear import BATCH_SIZES, MODELS, compile_items
    from kernels.linear_sweep import compile_key, sweep_configs

    points = [(m, n, k) for s in MODELS.values() for n, k in s.values() for m in BATCH_SIZES]
    items = compile_items(points, 132)
    keys = [compile_key(cfg, k) for cfg, _, k in items]
    assert len(set(keys)) == len(keys)
    for m, n, k in points:
        for configs in sweep_configs(m, n, k, 132).values():
            assert {compile_key(c, k) for c in configs} <= set(keys)
    assert all(n % 16 == 0 and n <= 4096 and k % 16 == 0 for _, n, k in items)


def test_m_bucket_is_the_cuda_graph_batch_size_that_serves_m():
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8))
    for m in range(1, 257):
        assert m_bucket(m) == min(s for s in sizes if s >= m), m


def test_auto_split_k_fills_the_gpu_for_small_n():
    """o_proj/down_proj (N = 1024) at M = 1: every SM of an H200 gets a program, each
    K-range at least one BLOCK_K step."""
    for n, k in ((1024, 2048), (1024, 3072)):
        for cfg in candidate_configs(1, n, k, sms=132):
            if cfg.split_k > 1:
                programs = -(-n // cfg.block_n) * cfg.split_k
                assert programs >= 132 and k // cfg.split_k >= cfg.block_k
    assert all(c.split_k == 1 for c in candidate_configs(1, 151936, 1024, sms=132))


def test_skinny_linear_rejects_bad_inputs():
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shapes"):
        skinny_linear(x, w[:, :4])
    with pytest.raises(ValueError, match="dtypes"):
        skinny_linear(x.float(), w.float())
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(x, w.T.contiguous().T)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, torch.zeros(3, dtype=torch.bfloat16))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_nn_linear_on_cpu(bias, dtype):
    torch.manual_seed(0)
    ref = torch.nn.Linear(48, 20, bias=bias, dtype=dtype)
    torch.manual_seed(0)
    ours = Linear(48, 20, bias=bias, dtype=dtype)
    assert isinstance(ours, torch.nn.Linear)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for name, p in ours.state_dict().items():
        assert torch.equal(p, ref.state_dict()[name]), name  # same default init
    ours.load_state_dict({k: torch.randn_like(v) for k, v in ref.state_dict().items()})
    ref.load_state_dict(ours.state_dict())
    for x in (torch.randn(5, 48, dtype=dtype), torch.randn(2, 3, 48, dtype=dtype)):
        assert torch.equal(ours(x), ref(x))
    x = torch.randn(4, 48, requires_grad=True, dtype=dtype)
    ours(x).sum().backward()  # autograd works as in nn.Linear
    assert x.grad is not None and ours.weight.grad is not None


def test_loader_fills_linear_projections():
    """load_model builds the MLP projections as `Linear` and fills them by the HF names."""
    from safetensors.torch import load_file

    from tritonllm.config import ModelConfig
    from tritonllm.models import load_model

    path = checkpoint("qwen3")
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, torch.device("cpu"), torch.float32)
    state = load_file(f"{path}/model.safetensors")
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp.gate_up_proj, Linear) and isinstance(mlp.down_proj, Linear)
    gate_up = torch.cat(
        [state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]]
    )
    assert torch.equal(mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(mlp.down_proj.weight, state["model.layers.1.mlp.down_proj.weight"])


def test_linear_mode_comes_from_the_engine_config():
    """`EngineConfig.linear_kernel` (env `TRITONLLM_LINEAR_KERNEL` for the Triton model) reaches
    every `Linear` of the model as its constructor argument; "auto" with the layer kernels off
    is cuBLAS; an unknown mode is refused by the config and by `Linear` itself."""
    from tritonllm.config import EngineConfig
    from tritonllm.layers.fused import LayerKernels
    from tritonllm.models import load_model
    from tritonllm.triton_config import engine_config

    config = engine_config({"model": checkpoint("qwen3")}, {"TRITONLLM_LINEAR_KERNEL": "triton"})
    assert config.linear_kernel == "triton"
    assert EngineConfig(model=checkpoint("qwen3")).linear_kernel == "cublas"
    with pytest.raises(ValueError, match="linear_kernel"):
        EngineConfig(model=checkpoint("qwen3"), linear_kernel="fast")
    with pytest.raises(ValueError, match="mode"):
        Linear(4, 4, mode="fast")
    assert Linear(4, 4).mode == "cublas"
    assert LayerKernels(fused=False, linear="auto").linear_mode == "cublas"
    assert LayerKernels(fused=False, linear="triton").linear_mode == "triton"
    model = load_model(
        checkpoint("qwen3"),
        config.model_config,
        torch.device("cpu"),
        torch.float32,
        kernels=LayerKernels(linear=config.linear_kernel),
    )
    modes = {m.mode for m in model.modules() if isinstance(m, Linear)}
    assert modes == {"triton"}


@pytest.mark.parametrize(
    ("t_triton", "t_cublas", "expected"), [(2.0, 5.0, True), (4.9, 5.0, False)]
)
def test_chooser_picks_the_faster_and_remembers(monkeypatch, t_triton, t_cublas, expected):
    """`_choose` times both once per (M bucket, N, K, ...) key, keeps the faster (cuBLAS on a
    near-tie), and answers later calls of the same bucket without timing; while a CUDA graph
    is being captured an unknown shape takes cuBLAS and nothing is remembered."""
    import kernels.linear as kl

    monkeypatch.setattr(linear_layer, "_CHOICES", {})
    ran_triton = []

    def fake_skinny(x, w, b=None, config=None):
        ran_triton.append(True)
        return F.linear(x, w, b)

    timed = []

    def fake_timer(fn, **_):
        ran_triton.clear()
        fn()
        timed.append(ran_triton[:])
        return t_triton if ran_triton else t_cublas

    monkeypatch.setattr(kl, "skinny_linear", fake_skinny)
    monkeypatch.setattr(kl, "gpu_time_ms", fake_timer)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    assert linear_layer._choose(torch.randn(3, 16, dtype=torch.bfloat16), w, None) is expected
    assert sorted(timed) == [[], [True]]  # each implementation timed once
    assert linear_layer._choose(torch.randn(4, 16, dtype=torch.bfloat16), w, None) is expected
    assert len(timed) == 2  # same bucket (4): remembered
    assert linear_layer._CHOICES == {(4, 32, 16, torch.bfloat16, False, w.device): expected}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert linear_layer._choose(torch.randn(9, 16, dtype=torch.bfloat16), w, None) is False
    assert len(timed) == 2 and len(linear_layer._CHOICES) == 1


# ---- GPU ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("m", [1, 8, 64, 256])
@pytest.mark.parametrize(("n", "k"), QWEN3_SHAPES)
def test_skinny_linear_qwen3_shapes_every_config(device, m, n, k):
    x = _padded(m, k, torch.bfloat16, device, seed=m)
    w = _padded(n, k, torch.bfloat16, device, seed=n, scale=k**-0.5)
    for cfg in candidate_configs(
        m, n, k, torch.cuda.get_device_properties(0).multi_processor_count
    ):
        _check(skinny_linear(x, w, config=cfg), x, w, None)
    _check(skinny_linear(x, w), x, w, None)  # the tuned configuration
    assert tuned_config(x, w, None) in candidate_configs(
        m, n, k, torch.cuda.get_device_properties(0).multi_processor_count
    )


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize(("n", "k"), QWEN3_SHAPES[:4])
def test_split_k_fixup_replays_in_a_cuda_graph_as_the_reduce_kernel(device, m, n, k):
    """Fix-up launches on the GPU, eager and replayed 20 times from one CUDA graph with new
    inputs, match the two-kernel split-K bit for bit: no replay reads a partial before it is
    written or finds a counter left over."""
    from kernels.linear import candidate_configs as configs

    w = _padded(n, k, torch.bfloat16, device, seed=n, scale=k**-0.5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = [c for c in configs(m, n, k, sms) if c.split_k > 1]
    assert splits
    with torch.inference_mode():
        for cfg in splits:
            fixup = cfg._replace(fixup=True)
            x = _padded(m, k, torch.bfloat16, device, seed=m)
            assert torch.equal(skinny_linear(x, w, None, fixup), skinny_linear(x, w, None, cfg))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = skinny_linear(x, w, None, fixup)
            for seed in range(20):
                x.copy_(
                    torch.randn(
                        m, k, device=device, generator=torch.Generator(device).manual_seed(seed)
                    )
                )
                graph.replay()
                assert torch.equal(out, skinny_linear(x, w, None, cfg)), (cfg, seed)


@pytest.mark.parametrize("device", [CUDA])
def test_skinny_linear_fp16_with_bias(device):
    x = _padded(3, 2048, torch.float16, device, seed=0)
    w = _padded(1000, 2048, torch.float16, device, seed=1, scale=2048**-0.5)
    b = torch.randn(1000, device=device, dtype=torch.float16)
    _check(skinny_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("mode", ["cublas", "triton", "auto"])
def test_linear_modes_on_cuda(device, mode, monkeypatch):
    """Forced modes run exactly the forced implementation; auto runs the remembered winner.
    All agree with the float32 reference."""
    monkeypatch.setattr(linear_layer, "_CHOICES", {})
    layer = Linear(1024, 3072, bias=False, device=device, dtype=torch.bfloat16, mode=mode)
    with torch.inference_mode():
        for m in (1, 5, 24, 200, 300):
            x = torch.randn(m, 1024, device=device, dtype=torch.bfloat16)
            out = layer(x)
            _check(out, x, layer.weight, None)
            cublas = F.linear(x, layer.weight)
            triton_out = skinny_linear(x, layer.weight)
            if mode == "cublas" or m > 256:
                assert torch.equal(out, cublas)
            elif mode == "triton":
                assert torch.equal(out, triton_out)
            else:
                key = (m_bucket(m), 3072, 1024, torch.bfloat16, False, x.device)
                chosen = linear_layer._CHOICES[key]
                assert torch.equal(out, triton_out if chosen else cublas)
        out3d = layer(torch.ones(2, 3, 1024, device=device, dtype=torch.bfloat16))
        assert out3d.shape == (2, 3, 3072)
    if mode != "auto":
        assert linear_layer._CHOICES == {}


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("mode", ["triton", "auto"])
def test_cuda_graph_with_linear_replays_correctly(device, mode, monkeypatch):
    """Warm-up outside the capture decides; the captured graph (split-K workspace included)
    replays the same result for new input data."""
    monkeypatch.setattr(linear_layer, "_CHOICES", {})
    layer = Linear(3072, 1024, bias=True, device=device, dtype=torch.bfloat16, mode=mode)
    static_x = torch.randn(4, 3072, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = layer(static_x)
        for seed in (1, 2):
            torch.manual_seed(seed)
            static_x.copy_(torch.randn_like(static_x))
            graph.replay()
            torch.cuda.synchronize()
            _check(static_out, static_x, layer.weight, layer.bias)
            eager = layer(static_x)
            if mode == "triton":  # same kernel, fixed-order split-K sum: bit-identical
                assert torch.equal(static_out, eager)
            else:
                torch.testing.assert_close(static_out, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", [CUDA])
def test_unseen_shape_during_capture_takes_cublas(device, monkeypatch):
    monkeypatch.setattr(linear_layer, "_CHOICES", {})
    layer = Linear(1024, 4096, bias=False, device=device, dtype=torch.bfloat16, mode="auto")
    static_x = torch.randn(8, 1024, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            F.linear(static_x, layer.weight)  # cuBLAS warm-up only: the layer has not run
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = layer(static_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, F.linear(static_x, layer.weight))
    assert linear_layer._CHOICES == {}


@pytest.mark.parametrize("device", [CUDA])
def test_swiglu_mlp_with_triton_linear_matches_cpu(device):
    from tritonllm.layers.fused import LayerKernels

    torch.manual_seed(0)
    mlp = SwiGLUMLP(1024, 3072, LayerKernels(linear="triton")).to(torch.bfloat16)
    x = torch.randn(8, 1024, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = mlp.float()(x.float())
        got = mlp.to(device=device, dtype=torch.bfloat16)(x.to(device)).float().cpu()
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2 * expected.abs().max())
