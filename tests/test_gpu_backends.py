"""The `triton` and `flashinfer` attention backends against the `torch` reference backend.

Each test fills two identical KV caches with random K/V, builds an `AttentionMetadata` for a
random batch of sequences on shuffled pages, runs `prepare` + `forward` on a few layers with both
backends, and compares outputs and the written cache slots. CUDA runs (marked `gpu`) use bf16;
without CUDA the `triton` backend runs in Triton's interpreter on small shapes. The CUDA-graph
tests capture one decode step and replay it with other batches, padded to the graph size.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import kernels

pytest.importorskip("triton")
from tritonllm.attention import get_attention_backend  # noqa: E402
from tritonllm.attention.base import AttentionMetadata  # noqa: E402
from tritonllm.config import ModelConfig  # noqa: E402
from tritonllm.engine.kv_cache import KVCache  # noqa: E402

# Triton's interpreter (3.6) converts 1-element arrays to ints the way numpy 1.25 deprecated.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
HAS_CUDA = torch.cuda.is_available()
INTERPRET = kernels.interpreting()
gpu_only = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA, compiled Triton"),
]


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_CUDA = pytest.param("triton", marks=gpu_only)
FLASHINFER_CUDA = pytest.param(
    "flashinfer",
    marks=[*gpu_only, pytest.mark.skipif(not _has_flashinfer(), reason="flashinfer not installed")],
)


def model_config(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": num_heads * head_dim,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "vocab_size": 32,
            "max_position_embeddings": 4096,
        }
    )


class Setup:
    """Two identical random KV caches (reference + backend under test) and a page allocator."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        seed: int = 0,
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.cfg, self.page_size, self.device, self.dtype = cfg, page_size, device, dtype
        self.ref_cache = KVCache(cfg, num_pages, page_size, dtype, torch.device(device))
        self.cache = KVCache(cfg, num_pages, page_size, dtype, torch.device(device))
        k = torch.randn(self.cache.k.shape, generator=self.gen)
        v = torch.randn(self.cache.v.shape, generator=self.gen)
        for c in (self.ref_cache, self.cache):
            c.k.copy_(k)
            c.v.copy_(v)
        self.free = (torch.randperm(num_pages - 1, generator=self.gen) + 1).tolist()

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def metadata(self, prefix_lens: list[int], extend_lens: list[int]) -> AttentionMetadata:
        """A batch whose sequences own fresh pages (prefix K/V = the caches' random content)."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        pages = [math.ceil(n / self.page_size) for n in seq_lens]
        table = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
        slots = []
        for b, (p, n) in enumerate(zip(prefix_lens, seq_lens, strict=True)):
            own = torch.tensor([self.free.pop() for _ in range(pages[b])], dtype=torch.int32)
            table[b, : pages[b]] = own
            pos = torch.arange(p, n)
            slots.append(own[pos // self.page_size].long() * self.page_size + pos % self.page_size)
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        return AttentionMetadata(
            num_seqs=len(seq_lens),
            is_decode=all(e == 1 for e in extend_lens),
            seq_lens=torch.tensor(seq_lens, **i32),
            extend_lens=torch.tensor(extend_lens, **i32),
            prefix_lens=torch.tensor(prefix_lens, **i32),
            cu_extend_lens=torch.tensor([0, *itertools.accumulate(extend_lens)], **i32),
            page_table=table.to(dev),
            out_cache_loc=torch.cat(slots).to(dev),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
        )

    def backends(self, name: str):
        ref = get_attention_backend("torch")(self.cfg, self.ref_cache, torch.device(self.device))
        test = get_attention_backend(name)(self.cfg, self.cache, torch.device(self.device))
        return ref, test


def _compare_step(setup: Setup, ref, test, meta: AttentionMetadata, layers=(0, 1)) -> None:
    hq, hkv, d = setup.cfg.num_heads, setup.cfg.num_kv_heads, setup.cfg.head_dim
    tol = (
        dict(atol=2e-2, rtol=2e-2) if setup.dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    ref.prepare(meta)
    test.prepare(meta)
    t = meta.num_tokens
    for layer in layers:
        q, k, v = setup.randn(t, hq, d), setup.randn(t, hkv, d), setup.randn(t, hkv, d)
        expected = ref.forward(q, k, v, layer)
        out = test.forward(q, k, v, layer)
        assert out.shape == (t, hq, d) and out.dtype == setup.dtype
        torch.testing.assert_close(out, expected, **tol)
    assert torch.equal(setup.cache.k, setup.ref_cache.k)
    assert torch.equal(setup.cache.v, setup.ref_cache.v)


# (num_heads, num_kv_heads, head_dim, page_size, prefix_lens, extend_lens)
CPU_CASES = [
    (4, 2, 64, 4, [0, 0, 3], [5, 1, 18]),  # prefill + extend
    (4, 2, 64, 4, [0, 6, 16, 40], [1, 1, 1, 1]),  # decode
    (6, 2, 64, 16, [17, 0], [1, 20]),
]
GPU_CASES = [
    (16, 8, 128, 16, [0, 0, 0], [1, 257, 1000]),
    (16, 8, 128, 16, [900, 15, 0, 2000], [100, 1, 64, 333]),
    (16, 8, 128, 16, [i * 37 % 3000 for i in range(48)], [1] * 48),
    (32, 8, 128, 16, [4095, 1, 700], [1, 1, 1]),
    (8, 8, 64, 1, [100, 3], [1, 1]),
]


@pytest.mark.parametrize("case", CPU_CASES)
def test_triton_backend_matches_torch_backend_interpreted(case):
    if not INTERPRET:
        pytest.skip("CPU runs need Triton's interpreter")
    hq, hkv, d, page_size, prefix, extend = case
    setup = Setup(model_config(hq, hkv, d), 40, page_size, torch.float32, "cpu")
    _compare_step(setup, *setup.backends("triton"), setup.metadata(prefix, extend))


@pytest.mark.parametrize("name", [TRITON_CUDA, FLASHINFER_CUDA])
@pytest.mark.parametrize("case", CPU_CASES + GPU_CASES)
def test_gpu_backend_matches_torch_backend(name, case):
    hq, hkv, d, page_size, prefix, extend = case
    num_pages = 2 + sum(
        math.ceil((p + e) / page_size) + 1 for p, e in zip(prefix, extend, strict=True)
    )
    setup = Setup(model_config(hq, hkv, d), num_pages, page_size, torch.bfloat16, "cuda")
    _compare_step(setup, *setup.backends(name), setup.metadata(prefix, extend))


def test_triton_backend_cuda_graph_buffers_pad_the_batch_interpreted():
    """prepare_capture/prepare_replay route a smaller batch through fixed, padded buffers."""
    if not INTERPRET:
        pytest.skip("CPU runs need Triton's interpreter")
    cfg = model_config(4, 2, 64)
    setup = Setup(cfg, 64, 4, torch.float32, "cpu")
    ref, test = setup.backends("triton")
    test.init_cuda_graph(max_bs=6, max_pages_per_seq=16)
    for prefix in ([5, 0, 30], [12, 1, 2, 3, 40]):
        bs = 5
        test.prepare_capture(bs)
        meta = setup.metadata(prefix, [1] * len(prefix))
        test.prepare_replay(meta, bs)
        ref.prepare(meta)
        n, hq, hkv = len(prefix), cfg.num_heads, cfg.num_kv_heads
        q, k, v = setup.randn(bs, hq, 64), setup.randn(bs, hkv, 64), setup.randn(bs, hkv, 64)
        out = test.forward(q, k, v, 1)
        expected = ref.forward(q[:n], k[:n], v[:n], 1)
        torch.testing.assert_close(out[:n], expected, atol=1e-4, rtol=1e-4)
        # padding rows wrote only to the reserved page 0
        assert torch.equal(setup.cache.k[:, 1:], setup.ref_cache.k[:, 1:])


# (graph batch size, batches replayed: prefix lengths). Batch 96 is past FlashInfer's
# split limit (2 * SMs / kv_heads, 33 on an H200): its tensor-core graph runs without split-KV.
GRAPH_CASES = [
    (8, ([100, 0, 1500, 31, 15], [7, 2000, 16, 64, 1, 900, 300, 5])),
    (96, ([i * 97 % 700 for i in range(90)], [(i * 53 + 11) % 600 for i in range(96)])),
]


@pytest.mark.parametrize("name", [TRITON_CUDA, FLASHINFER_CUDA])
@pytest.mark.parametrize(("bs", "batches"), GRAPH_CASES, ids=["bs8", "bs96"])
def test_gpu_backend_cuda_graph_decode_replays_new_batches(name, bs, batches):
    cfg = model_config(16, 8, 128)
    setup = Setup(cfg, 512 if bs <= 8 else 4096, 16, torch.bfloat16, "cuda")
    ref, test = setup.backends(name)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    test.init_cuda_graph(max_bs=max(16, bs), max_pages_per_seq=128)
    q, k, v = setup.randn(bs, hq, d), setup.randn(bs, hkv, d), setup.randn(bs, hkv, d)
    test.prepare_capture(bs)
    if name == "flashinfer":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert test._graph_no_split[bs] == (bs > 2 * sms // hkv and bs >= 64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles kernels) outside the capture
        test.forward(q, k, v, 0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = test.forward(q, k, v, 0)
    for prefix in batches:
        n = len(prefix)
        meta = setup.metadata(prefix, [1] * n)
        test.prepare_replay(meta, bs)
        q.copy_(setup.randn(bs, hq, d))
        k.copy_(setup.randn(bs, hkv, d))
        v.copy_(setup.randn(bs, hkv, d))
        graph.replay()
        ref.prepare(meta)
        expected = ref.forward(q[:n], k[:n], v[:n], 0)
        torch.testing.assert_close(out[:n], expected, atol=2e-2, rtol=2e-2)
        assert torch.equal(setup.cache.k[:, 1:], setup.ref_cache.k[:, 1:])
        if name == "flashinfer" and test._graph_no_split[bs]:
            # Padding tiles name the shortest sequence: a padding row, else the shortest real.
            tail, target = test._graph_pad_tiles[bs]
            assert target == (bs - 1 if n < bs else min(range(n), key=prefix.__getitem__))
            assert tail.tolist() == [target] * tail.numel() and tail.numel() > 0


def test_flashinfer_page_list_matches_page_table():
    from tritonllm.attention.flashinfer_backend import paged_kv_args

    table = torch.tensor([[3, 9, 0, 0], [5, 0, 0, 0], [1, 2, 4, 6]], dtype=torch.int32)
    args = paged_kv_args(table, [17, 1, 64], page_size=16)
    assert args.kv_indptr.tolist() == [0, 2, 3, 7]
    assert args.kv_indices.tolist() == [3, 9, 5, 1, 2, 4, 6]
    assert args.kv_last_page_len.tolist() == [1, 1, 16]
    assert args.kv_indices.dtype == torch.int32 and args.kv_indptr.dtype == torch.int32
