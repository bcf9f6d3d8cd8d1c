"""Triton kernels (`kernels/`) against their plain PyTorch references (`kernels/reference.py`).

Runs on CUDA (marked `gpu`, realistic shapes) and, without CUDA, in Triton's CPU interpreter
(small shapes; `import kernels` sets TRITON_INTERPRET=1 before triton is used). Skipped when
`triton` is not installed.

Every cache slot no sequence owns (page 0, spare pages, the tail of each last page) holds NaN,
so a kernel that reads past a sequence's tokens or a masked row poisons its output.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels.reference import ref_decode_attention, ref_extend_attention, ref_store_kv

pytest.importorskip("triton")
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.extend_attention import extend_attention  # noqa: E402
from kernels.store_kv import store_kv  # noqa: E402

# Triton's interpreter (3.6) converts 1-element arrays to ints the way numpy 1.25 deprecated.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
HAS_CUDA = torch.cuda.is_available()
INTERPRET = kernels.interpreting()
CPU = pytest.param(
    "cpu",
    marks=pytest.mark.skipif(
        not INTERPRET, reason="CPU runs need Triton's interpreter (TRITON_INTERPRET=1)"
    ),
)
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA and compiled Triton"),
    ],
)
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


class PagedBatch:
    """Random sequences scattered over shuffled pages of a NaN-filled paged KV cache."""

    def __init__(
        self,
        seq_lens: list[int],
        page_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
        num_pages = 1 + sum(pages_per_seq) + 2  # page 0 reserved, 2 spare pages
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        width = max(pages_per_seq) + 1  # one padding column of page 0
        self.page_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        for b, (n, np_) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
            pages = torch.tensor(order[:np_], dtype=torch.int32)
            order = order[np_:]
            self.page_table[b, :np_] = pages
            pos = torch.arange(n)
            slots = (pages[pos // page_size].long(), pos % page_size)
            self.k_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.v_cache[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.num_q_heads, self.gen = num_q_heads, gen
        for name in ("page_table", "k_cache", "v_cache", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.k_cache)


# ---- store_kv --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize(
    "num_tokens,page_size,num_kv_heads,head_dim",
    [
        (1, 1, 1, 64),
        (7, 4, 2, 64),
        (33, 16, 3, 128),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_exactly_the_given_slots(
    device, num_tokens, page_size, num_kv_heads, head_dim, dtype
):
    gen = torch.Generator().manual_seed(num_tokens)
    num_pages = 2 + num_tokens // page_size + 2
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].to(device)
    # k and v as strided views of a fused qkv projection, as the model produces them.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_store_kv(k, v, ref_k, ref_v, loc)
    store_kv(k, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_store_kv_casts_to_cache_dtype(device):
    k_cache = torch.zeros(4, 4, 2, 64, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(5, 2, 64, device=device)
    v = torch.randn(5, 2, 64, device=device)
    loc = torch.tensor([4, 5, 6, 12, 15], device=device)
    store_kv(k, v, k_cache, v_cache, loc)
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    torch.testing.assert_close(flat_k[loc].float(), k, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(flat_v[loc].float(), v, atol=1e-2, rtol=1e-2)
    assert flat_k[[0, 1, 7]].abs().sum() == 0


def test_store_kv_rejects_mismatched_shapes():
    k = torch.zeros(3, 2, 64)
    cache = torch.zeros(4, 4, 2, 64)
    with pytest.raises(ValueError):
        store_kv(k, k, cache, cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):
        store_kv(k, k, torch.zeros(4, 4, 1, 64), cache, torch.zeros(3, dtype=torch.int64))


# ---- decode ----------------------------------------------------------------------------------

# (seq_lens, page_size, Hq, Hkv, head_dim, num_kv_splits)
DECODE_CPU = [
    ([1], 1, 2, 2, 64, None),
    ([1, 2, 3, 16, 17, 40], 4, 4, 2, 64, None),
    ([5, 33, 64, 65], 16, 8, 2, 128, 3),
    ([1, 100, 7], 8, 6, 2, 64, 8),  # GQA group 3 (not a power of 2), many empty splits
    ([70, 1], 4, 4, 1, 64, 1),  # MQA, no split
]
DECODE_GPU = [
    ([1], 16, 16, 8, 128, None),
    ([random.Random(0).randint(1, 2000) for _ in range(64)], 16, 16, 8, 128, None),
    ([8191, 1, 4097], 16, 32, 8, 128, None),
    ([3000, 17, 900, 1], 1, 8, 8, 64, 16),
    ([300] * 8, 64, 12, 4, 64, None),
]


def _check_decode(seq_lens, page_size, hq, hkv, head_dim, splits, dtype, device, block_n):
    batch = PagedBatch(seq_lens, page_size, hq, hkv, head_dim, dtype, device)
    q = batch.randn(len(seq_lens), hq, head_dim)
    out = decode_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.page_table,
        batch.seq_lens,
        num_kv_splits=splits,
        max_seq_len=max(seq_lens),
        block_n=block_n,
    )
    ref = ref_decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CPU)
def test_decode_attention_matches_reference_interpreted(case, dtype):
    if not INTERPRET:
        pytest.skip("CPU runs need Triton's interpreter")
    _check_decode(*case, dtype, "cpu", block_n=16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA and compiled Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CPU + DECODE_GPU)
def test_decode_attention_matches_reference_cuda(case, dtype):
    _check_decode(*case, dtype, "cuda", block_n=None)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_decode_attention_result_does_not_depend_on_split_count(device):
    batch = PagedBatch([50, 3, 129], 8, 4, 2, 64, torch.float32, device, seed=3)
    q = batch.randn(3, 4, 64)
    outs = [
        decode_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            batch.page_table,
            batch.seq_lens,
            num_kv_splits=s,
            block_n=16,
        )
        for s in (1, 2, 5, 16)
    ]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


# ---- extend ----------------------------------------------------------------------------------

# (prefix_lens, extend_lens, page_size, Hq, Hkv, head_dim)
EXTEND_CPU = [
    ([0], [1], 1, 2, 2, 64),
    ([0, 0], [17, 5], 4, 4, 2, 64),  # pure prefill, crosses a 16-row block
    ([9, 0, 31, 4], [1, 33, 2, 16], 8, 6, 2, 64),  # prefixes, extend of 1, GQA 3
    ([20, 5], [0, 12], 16, 4, 1, 128),  # a sequence with no new tokens
]
EXTEND_GPU = [
    ([0, 0, 0], [1, 300, 1000], 16, 16, 8, 128),
    ([1000, 37, 0, 511], [700, 1, 129, 64], 16, 32, 8, 128),
    ([64, 3], [200, 333], 1, 8, 8, 64),
    ([4000], [2048], 64, 12, 4, 64),
]


def _check_extend(
    prefix_lens, extend_lens, page_size, hq, hkv, head_dim, dtype, device, block_m, block_n
):
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    batch = PagedBatch(seq_lens, page_size, hq, hkv, head_dim, dtype, device)
    cu = torch.tensor([0, *itertools.accumulate(extend_lens)], dtype=torch.int32)
    q = batch.randn(sum(extend_lens), hq, head_dim)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, cu.to(device))
    out = extend_attention(*args, max(extend_lens), block_m=block_m, block_n=block_n)
    ref = ref_extend_attention(*args)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", EXTEND_CPU)
def test_extend_attention_matches_reference_interpreted(case, dtype):
    if not INTERPRET:
        pytest.skip("CPU runs need Triton's interpreter")
    _check_extend(*case, dtype, "cpu", block_m=16, block_n=16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA and compiled Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", EXTEND_CPU + EXTEND_GPU)
def test_extend_attention_matches_reference_cuda(case, dtype):
    _check_extend(*case, dtype, "cuda", block_m=None, block_n=None)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_extend_of_one_token_equals_decode(device):
    """An extend batch of one new token per sequence is the decode problem."""
    batch = PagedBatch([1, 19, 40], 4, 4, 2, 64, torch.float32, device, seed=5)
    q = batch.randn(3, 4, 64)
    cu = torch.arange(4, dtype=torch.int32, device=device)
    ext = extend_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.page_table,
        batch.seq_lens,
        cu,
        1,
        block_m=16,
        block_n=16,
    )
    dec = decode_attention(
        q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens, block_n=16
    )
    torch.testing.assert_close(ext, dec, atol=1e-5, rtol=1e-5)


def test_kernels_compile_to_cubin_for_sm90_without_a_gpu():
    """The compiled path (which the interpreter never exercises) lowers all the way to sm_90
    cubin without register spills or shared-memory overflow."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--quick"],
        cwd=root,
        env=dict(os.environ, TRITON_INTERPRET="0"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
