"""Token bitmasks applied to logits: `kernels.token_bitmask.apply_token_bitmask` (CUDA's path)
and `tritonllm.structured.masks.apply_token_bitmask_torch` (the path off CUDA) both equal
`kernels.reference.ref_apply_token_bitmask` (a per-token loop): disallowed tokens of the listed
rows become -inf, allowed ones and the other rows keep their exact values, in float32, bfloat16
and float16, for a vocabulary that is no multiple of 32 and for one past the bitmask's words
(those tokens disallowed). Without CUDA the kernel runs in Triton's CPU interpreter, on small
shapes; on CUDA (marked `gpu`) also with the Qwen3 vocabulary.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.reference import ref_apply_token_bitmask
from tritonllm.structured.masks import apply_token_bitmask_torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = kernels.interpreting()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (batch, vocab, bitmask words, logits rows masked)
SHAPES = [
    (5, 300, 10, [3, 0, 4]),  # 300 tokens in 10 words: the last word half used
    (3, 300, 8, [1]),  # tokens 256..299 have no word: all disallowed
    (4, 64, 2, []),  # no row masked: nothing changes
]


def _case(batch, vocab, words, rows, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (len(rows) + 1, words), generator=gen)
    bitmask = bitmask.to(torch.int32)
    if rows:
        bitmask[0] = -1  # every token allowed
        bitmask[-2 if len(rows) > 1 else 0, :2] = 0  # a row with its first 64 tokens disallowed
    index = torch.tensor(rows, dtype=torch.int32)
    expected = logits.clone()
    ref_apply_token_bitmask(expected, bitmask, index)
    return logits, bitmask, index, expected


def _assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype
    assert torch.equal(got.isneginf(), expected.isneginf())
    finite = ~expected.isneginf()
    assert torch.equal(got[finite], expected[finite])  # untouched: bit-exact


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("batch", "vocab", "words", "rows"), SHAPES)
def test_torch_path_equals_reference(batch, vocab, words, rows, dtype):
    logits, bitmask, index, expected = _case(batch, vocab, words, rows, dtype)
    apply_token_bitmask_torch(logits, bitmask, index)
    _assert_same(logits, expected)


def test_reference_masks_by_bit_position():
    logits = torch.zeros(2, 40)
    bitmask = torch.tensor([[0b101, 1 << 7]], dtype=torch.int32)  # tokens 0, 2 and 39
    ref_apply_token_bitmask(logits, bitmask, torch.tensor([1]))
    assert (logits[0] == 0).all()
    assert torch.nonzero(logits[1] == 0).flatten().tolist() == [0, 2, 39]


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("batch", "vocab", "words", "rows"), SHAPES)
def test_kernel_equals_reference_in_the_interpreter(batch, vocab, words, rows, dtype):
    pytest.importorskip("triton")
    from kernels.token_bitmask import apply_token_bitmask

    logits, bitmask, index, expected = _case(batch, vocab, words, rows, dtype)
    apply_token_bitmask(logits, bitmask, index)
    _assert_same(logits, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA and compiled Triton")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_torch_path_on_cuda_with_the_qwen3_vocab(dtype):
    from kernels.token_bitmask import apply_token_bitmask

    vocab = 151_936
    rows = list(range(0, 64, 3))
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, vocab, generator=gen) * 4).to(dtype).cuda()
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), (vocab + 31) // 32), generator=gen)
    bitmask = bitmask.to(torch.int32).cuda()
    index = torch.tensor(rows, dtype=torch.int32).cuda()
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask, index)
    apply_token_bitmask(logits, bitmask, index)
    _assert_same(logits, expected)
    small = _case(5, 300, 8, [4, 1], dtype)
    got = small[0].cuda()
    apply_token_bitmask(got, small[1].cuda(), small[2].cuda())
    _assert_same(got.cpu(), small[3])
