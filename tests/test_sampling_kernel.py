"""`kernels.sampling.gumbel_argmax` and the sampler's fast path that uses it.

Oracles: `torch.argmax` for greedy rows (exact, ties to the lowest index); for sampled rows the
empirical frequency of every token, over many rows with the same logits, against
`softmax(logits / T)` within 4.5 binomial standard deviations (a false alarm about once in
150,000 runs per token). On CUDA (marked `gpu`) with the Qwen3 vocab (151,936) and many draws;
without CUDA in Triton's CPU interpreter, on small shapes and fewer draws (Philox is slow there:
about 7 ms per program).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_engine_helpers import sample_host

import kernels

pytest.importorskip("triton")
import kernels.sampling  # noqa: E402
from kernels.sampling import BLOCK, counters_per_row, gumbel_argmax, iters_for  # noqa: E402
from tritonllm.engine import sampler as sampler_module  # noqa: E402
from tritonllm.engine.request import Request  # noqa: E402
from tritonllm.engine.sampler import Sampler  # noqa: E402
from tritonllm.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
HAS_CUDA = torch.cuda.is_available()
INTERPRET = kernels.interpreting()
CPU_MARKS = [pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter")]
CUDA_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA and compiled Triton"),
]
QWEN3_VOCAB = 151_936
# 8 tokens, two of them impossible; at T = 0.7 the probabilities are far from those at T = 1.
SMALL_LOGITS = [2.0, 1.0, float("-inf"), 0.5, 0.0, -0.5, float("-inf"), -1.0]


def _expected(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.double().cpu() / temperature, dim=-1)


def _assert_frequencies(samples: torch.Tensor, probs: torch.Tensor, sigmas: float = 4.5) -> None:
    """Every token's empirical frequency within `sigmas` binomial std of its probability;
    tokens of probability 0 never drawn."""
    n = samples.numel()
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    assert counts.numel() == probs.numel(), "a token id past the vocab"
    for tok, (count, p) in enumerate(zip(counts.tolist(), probs.tolist(), strict=True)):
        band = sigmas * math.sqrt(p * (1 - p) / n) + 1e-12
        assert abs(count / n - p) <= band, f"token {tok}: {count / n:.4f} vs p={p:.4f}"


GREEDY_CASES = [
    pytest.param("cpu", 7, 300, 64, None, marks=CPU_MARKS, id="cpu-B7"),
    pytest.param("cpu", 7, 300, 16, 4, marks=CPU_MARKS, id="cpu-B7-iters4"),
    *[
        pytest.param("cuda", b, QWEN3_VOCAB, BLOCK, None, marks=CUDA_MARKS, id=f"cuda-B{b}")
        for b in (1, 7, 256)
    ],
    pytest.param("cuda", 7, QWEN3_VOCAB, BLOCK, 8, marks=CUDA_MARKS, id="cuda-B7-iters8"),
]


@pytest.mark.parametrize(("device", "batch", "vocab", "block", "iters"), GREEDY_CASES)
def test_greedy_rows_equal_torch_argmax_among_sampled_rows(device, batch, vocab, block, iters):
    gen = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    logits[0, vocab - 1] = logits[0, 2] = 100.0  # a tie across chunks: the lowest index wins
    if batch > 2:
        logits[2] = float("-inf")  # an all -inf row: index 0, like torch.argmax
        logits[4, : vocab // 2] = float("-inf")  # max in a later chunk of a greedy row
    logits = logits.to(device)
    greedy = torch.arange(batch) % 2 == 0
    inv = torch.where(greedy, 0.0, 1 / 0.7).float().to(device)
    expected = logits.argmax(dim=-1)

    got = gumbel_argmax(logits, inv, seed=3, offset=1 << 32, block=block, iters=iters)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got[greedy.to(device)].tolist() == expected[greedy.to(device)].tolist()
    assert got[0].item() == 2
    picked = logits.gather(1, got[:, None]).squeeze(1)
    assert torch.isfinite(picked[~greedy.to(device)]).all(), "sampled a -inf logit"
    # One float for every row (the scalar path): all greedy.
    all_greedy = gumbel_argmax(logits, 0.0, seed=3, offset=0, block=block, iters=iters)
    assert all_greedy.tolist() == expected.tolist()
    # A strided view (logits of every other row): the row stride is free.
    view = logits[::2]
    assert not view.is_contiguous() or view.shape[0] == 1
    got = gumbel_argmax(view, 0.0, seed=3, offset=0, block=block, iters=iters)
    assert got.tolist() == view.argmax(dim=-1).tolist()


BF16_CASES = [
    pytest.param("cpu", 16, 8, 200, marks=CPU_MARKS, id="cpu"),
    pytest.param("cuda", QWEN3_VOCAB, BLOCK, 20_000, marks=CUDA_MARKS, id="cuda"),
]


@pytest.mark.parametrize(("device", "vocab", "block", "num_rows"), BF16_CASES)
def test_bfloat16_logits_are_read_as_they_are(device, vocab, block, num_rows):
    """The model's bf16 logits: greedy rows equal torch.argmax of the bf16 tensor (ties in bf16
    included) and sampled rows follow softmax of the bf16 values, with no float32 copy."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, vocab, generator=gen) * 3).to(torch.bfloat16)
    logits[1, 7] = logits[1, vocab - 2] = 50.0  # a tie: the lowest index wins
    logits = logits.to(device)
    greedy = gumbel_argmax(logits, 0.0, seed=1, offset=0, block=block)
    assert greedy.tolist() == logits.argmax(dim=-1).tolist() and greedy[1].item() == 7
    row = torch.full((vocab,), float("-inf"))
    row[-len(SMALL_LOGITS) :] = torch.tensor(SMALL_LOGITS)  # exact in bf16
    many = row.to(torch.bfloat16).repeat(num_rows, 1).to(device)
    samples = gumbel_argmax(many, 1 / 0.7, seed=2, offset=3 << 32, block=block)
    _assert_frequencies(samples, _expected(row, 0.7))


DISTRIBUTION_CASES = [
    pytest.param("cpu", 300, True, marks=CPU_MARKS, id="cpu-per-row"),
    pytest.param("cuda", 20_000, True, marks=CUDA_MARKS, id="cuda-per-row"),
    pytest.param("cuda", 20_000, False, marks=CUDA_MARKS, id="cuda-scalar"),
]


@pytest.mark.parametrize(("device", "num_rows", "per_row"), DISTRIBUTION_CASES)
def test_samples_follow_softmax_of_logits_over_temperature(device, num_rows, per_row):
    row = torch.tensor(SMALL_LOGITS)
    logits = row.repeat(num_rows, 1).to(device)
    inv = torch.full((num_rows,), 1 / 0.7, device=device) if per_row else 1 / 0.7
    samples = gumbel_argmax(logits, inv, seed=11, offset=7 << 32, block=8)
    _assert_frequencies(samples, _expected(row, 0.7))


CROSS_CHUNK_CASES = [
    pytest.param("cpu", 40, 40, 8, 1, marks=CPU_MARKS, id="cpu"),
    pytest.param("cpu", 24, 64, 4, 4, marks=CPU_MARKS, id="cpu-iters4"),
    pytest.param("cuda", 2000, QWEN3_VOCAB, BLOCK, None, marks=CUDA_MARKS, id="cuda"),
]


@pytest.mark.parametrize(("device", "num_rows", "vocab", "block", "iters"), CROSS_CHUNK_CASES)
def test_reduction_across_chunks_finds_mass_in_first_middle_and_last_chunk(
    device, num_rows, vocab, block, iters
):
    row = torch.full((vocab,), -30.0)
    row[1::2] = float("-inf")
    mass = {1: 0.3, vocab // 2 + 1: 0.2, vocab - 1: 0.5}  # first, a middle and the last chunk
    for tok, p in mass.items():
        row[tok] = math.log(p)
    chunk = block * (iters or iters_for(num_rows, vocab, block))
    assert vocab // chunk >= 4
    samples = gumbel_argmax(
        row.repeat(num_rows, 1).to(device), 1.0, seed=5, offset=0, block=block, iters=iters
    )
    assert set(samples.tolist()) == set(mass), "only (and each of) the likely tokens"
    _assert_frequencies(samples, _expected(row, 1.0))


SEED_CASES = [
    pytest.param("cpu", 64, 64, marks=CPU_MARKS, id="cpu"),
    pytest.param("cuda", QWEN3_VOCAB, BLOCK, marks=CUDA_MARKS, id="cuda"),
]


@pytest.mark.parametrize(("device", "vocab", "block"), SEED_CASES)
def test_seed_and_offset_select_the_draws(device, vocab, block):
    rows = 16
    logits = torch.zeros(rows, vocab, device=device)  # uniform: 16 draws repeat with p = V^-16

    iters = iters_for(rows, vocab, block)

    def draw(seed: int, offset: int) -> list[int]:
        return gumbel_argmax(logits, 1.0, seed=seed, offset=offset, block=block).tolist()

    first = draw(5, 0)
    assert draw(5, 0) == first
    assert draw(6, 0) != first
    assert draw(5, 1 << 32) != first
    # Row r's counters start at offset + r * counters_per_row(V, block, iters): one row's worth
    # of offset shifts the draws by one row.
    per_row = counters_per_row(vocab, block, iters)
    assert per_row == -(-vocab // (iters * block)) * iters * block // 4
    assert draw(5, per_row)[:-1] == first[1:]


ROW_KEY_CASES = [
    pytest.param("cpu", 300, 64, marks=CPU_MARKS, id="cpu"),
    pytest.param("cuda", QWEN3_VOCAB, BLOCK, marks=CUDA_MARKS, id="cuda"),
]


@pytest.mark.parametrize(("device", "vocab", "block"), ROW_KEY_CASES)
def test_per_row_keys_make_a_rows_draws_independent_of_its_call(device, vocab, block):
    rows = 6
    logits = torch.zeros(rows, vocab, device=device)  # uniform: equal draws mean equal noise

    def keys(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    # The shared form, written out per row, gives the same draws.
    iters = iters_for(rows, vocab, block)
    per_row = counters_per_row(vocab, block, iters)
    shared = gumbel_argmax(logits, 1.0, seed=9, offset=3 << 32, block=block)
    written = gumbel_argmax(
        logits,
        1.0,
        seed=0,
        offset=0,
        block=block,
        row_seeds=keys([9] * rows),
        row_offsets=keys([(3 << 32) + b * per_row for b in range(rows)]),
    )
    assert written.tolist() == shared.tolist()
    # A keyed row draws the same alone, at another place in a larger call, and with other
    # iterations per program.
    seeds, bases = [11, 12, 13, 14, 15, 16], [(b + 1) << 32 for b in range(rows)]
    together = gumbel_argmax(
        logits, 1.0, 0, 0, block=block, row_seeds=keys(seeds), row_offsets=keys(bases)
    ).tolist()
    for b in range(rows):
        alone = gumbel_argmax(
            logits[:1], 1.0, 0, 0, block=block, iters=1,
            row_seeds=keys([seeds[b]]), row_offsets=keys([bases[b]]),
        )  # fmt: skip
        assert alone.tolist() == [together[b]]
    flipped = gumbel_argmax(
        logits, 1.0, 0, 0, block=block, row_seeds=keys(seeds[::-1]), row_offsets=keys(bases[::-1])
    ).tolist()
    assert flipped == together[::-1]
    assert len(set(together)) > 1  # distinct keys, distinct draws (p = V^-5 of a false alarm)


def test_iterations_per_program_grow_with_the_batch():
    assert [iters_for(b, QWEN3_VOCAB) for b in (1, 2, 4, 8, 16, 256)] == [1, 1, 2, 4, 8, 8]
    assert iters_for(1000, 64, block=64) == 1  # one chunk per row already: nothing to merge


def test_invalid_arguments_raise_value_error():
    logits = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        gumbel_argmax(logits.double(), 1.0, 0, 0)
    with pytest.raises(ValueError, match="contiguous"):
        gumbel_argmax(torch.zeros(16, 2).t(), 1.0, 0, 0)
    with pytest.raises(ValueError, match="inv_temperature"):
        gumbel_argmax(logits, torch.ones(3), 0, 0)
    with pytest.raises(ValueError, match="inv_temperature"):
        gumbel_argmax(logits, torch.ones(2, dtype=torch.float64), 0, 0)
    with pytest.raises(ValueError, match="power-of-two"):
        gumbel_argmax(logits, 1.0, 0, 0, block=12)
    with pytest.raises(ValueError, match=">= 4"):
        gumbel_argmax(logits, 1.0, 0, 0, block=2)
    with pytest.raises(ValueError, match="iters"):
        gumbel_argmax(logits, 1.0, 0, 0, iters=16)
    keys = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="row_offsets"):
        gumbel_argmax(logits, 1.0, 0, 0, row_seeds=keys)
    with pytest.raises(ValueError, match="row_seeds"):
        gumbel_argmax(logits, 1.0, 0, 0, row_seeds=keys.int(), row_offsets=keys)
    assert gumbel_argmax(torch.zeros(0, 16), 1.0, 0, 0).shape == (0,)


# --- the sampler's fast path -------------------------------------------------------------------


def _req(i: int, params: SamplingParams, outputs: tuple[int, ...] = ()) -> Request:
    req = Request(str(i), [1], params, arrival=i)
    req.token_ids += list(outputs)
    return req


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Counts `gumbel_argmax` calls (the sampler imports it at each call)."""
    calls: list[int] = []
    real = kernels.sampling.gumbel_argmax

    def counting(logits, *args, **kwargs):
        calls.append(logits.shape[0])
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(kernels.sampling, "gumbel_argmax", counting)
    return calls


def test_cpu_sampler_keeps_the_pytorch_path(kernel_calls):
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    reqs = [_req(i, SamplingParams(temperature=0.0 if i % 2 else 0.8)) for i in range(4)]
    out = sample_host(sampler, logits.clone(), reqs)
    assert kernel_calls == []
    assert out.token_ids[1::2] == logits.argmax(dim=-1)[1::2].tolist()


SAMPLER_DEVICES = [
    pytest.param("cpu", 300, marks=CPU_MARKS, id="cpu-interpreted"),
    pytest.param("cuda", QWEN3_VOCAB, marks=CUDA_MARKS, id="cuda"),
]

SLOW_PATH_ROWS = {
    "top_p": (SamplingParams(temperature=0.9, top_p=0.9), False),
    "top_k": (SamplingParams(temperature=0.9, top_k=5), False),
    "min_p": (SamplingParams(temperature=0.9, min_p=0.1), False),
    "logprobs": (SamplingParams(temperature=0.0, logprobs=2), False),
    "seeded top_p": (SamplingParams(temperature=0.9, top_p=0.9, seed=3), True),
}


@pytest.mark.parametrize(("device", "vocab"), SAMPLER_DEVICES)
def test_sampler_takes_the_kernel_only_for_plain_batches(device, vocab, kernel_calls, monkeypatch):
    if device == "cpu":
        # Exercise the CUDA-only fast path in the interpreter (the CPU path is otherwise kept).
        monkeypatch.setattr(sampler_module, "use_fused", lambda enabled, logits: enabled)
    sampler = Sampler(torch.device(device), seed=0)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    logits[2, 5], logits[2, 9] = 10.0, 9.5  # row 2 has generated token 5 (presence penalty 2)
    logits = logits.to(device)
    plain = [
        _req(0, SamplingParams(temperature=0.0)),
        _req(1, SamplingParams(temperature=0.7)),
        _req(2, SamplingParams(temperature=0.0, presence_penalty=2.0), outputs=(5,)),
        _req(3, SamplingParams(temperature=1.3, repetition_penalty=1.2), outputs=(7,)),
    ]
    samples = sampler.sample_device(logits.clone(), plain)
    assert kernel_calls == [4] and sampler.fast_steps == 1
    assert samples.logprobs is None and samples.num_top == [None] * 4
    tokens = samples.token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == 9  # penalties still applied
    assert 0 <= min(tokens) and max(tokens) < vocab

    for name, (params, seeded) in SLOW_PATH_ROWS.items():
        reqs = plain[:3] + [_req(9, params)]
        if seeded:
            reqs[-1].seed = params.seed
            reqs[-1].generator = sampler.make_generator(params.seed)
        samples = sampler.sample_device(logits.clone(), reqs)
        assert kernel_calls == [4], f"{name} must take the PyTorch path"
        assert samples.token_ids[:3:2].tolist() == [tokens[0], 9]
        assert (samples.logprobs is not None) == (name == "logprobs")
    # A seeded row of plain sampling takes the kernel.
    seeded = _req(9, SamplingParams(temperature=0.9, seed=3))
    seeded.seed = 3
    sampler.sample_device(logits.clone(), plain[:3] + [seeded])
    assert kernel_calls == [4, 4]


def _seeded(i: int, seed: int, params: SamplingParams, outputs: tuple[int, ...] = ()) -> Request:
    req = _req(i, params, outputs)
    req.seed = seed
    req.generator = torch.Generator().manual_seed(seed)  # the PyTorch path's (unused here)
    return req


@pytest.mark.parametrize(("device", "vocab"), SAMPLER_DEVICES)
def test_a_seeded_rows_token_depends_on_its_seed_and_position_not_on_its_batch(
    device, vocab, kernel_calls, monkeypatch
):
    """On the fast path a seeded row is keyed by its seed and the position of its token: the
    same token alone, among other rows in any order, in a batch that takes the PyTorch path
    (a neighbour with top-p or logprobs), and after other calls; another seed or position draws
    afresh."""
    if device == "cpu":
        monkeypatch.setattr(sampler_module, "use_fused", lambda enabled, logits: enabled)
    sampler = Sampler(torch.device(device), seed=0)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1, vocab, generator=gen) * 0.1  # near uniform: draws spread widely
    logits = base.repeat(4, 1).to(device, torch.bfloat16)
    params = SamplingParams(temperature=0.8, seed=21)

    def token(reqs: list[Request], row: int) -> int:
        return sampler.sample_device(logits[: len(reqs)].clone(), reqs).token_ids[row].item()

    alone = token([_seeded(0, 21, params)], 0)
    others = [_req(i, SamplingParams(temperature=0.8)) for i in (1, 2)]
    assert token([*others, _seeded(0, 21, params)], 2) == alone
    assert token([others[0], _seeded(0, 21, params), others[1]], 1) == alone
    slow = [
        _req(5, SamplingParams(temperature=0.8, top_p=0.5)),
        _req(6, SamplingParams(temperature=0.0, logprobs=1)),
    ]
    calls = len(kernel_calls)
    for neighbour in slow:  # the PyTorch path: the seeded row alone goes to the kernel
        assert token([neighbour, _seeded(0, 21, params)], 1) == alone
    assert kernel_calls[calls:] == [1, 1]
    # With a presence penalty (a float32 copy on both paths) the two paths agree too.
    penalised = SamplingParams(temperature=0.8, seed=21, presence_penalty=0.5)
    fast = token([_seeded(0, 21, penalised, outputs=(3,))], 0)
    assert token([slow[0], _seeded(0, 21, penalised, outputs=(3,))], 1) == fast
    # Other seeds and other positions draw afresh (each a false alarm with p = 1/vocab).
    draws = {token([_seeded(0, s, SamplingParams(temperature=0.8, seed=s))], 0) for s in range(8)}
    later = {token([_seeded(0, 21, params, outputs=(7,) * k)], 0) for k in range(1, 8)}
    assert len(draws) > 2 and len(later) > 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA and compiled Triton")
def test_sampler_fast_path_samples_follow_the_distribution(kernel_calls):
    n, vocab = 20_000, 4099  # five chunks, the last one partial
    sampler = Sampler(torch.device("cuda"), seed=0)
    row = torch.full((vocab,), float("-inf"))
    row[-len(SMALL_LOGITS) :] = torch.tensor(SMALL_LOGITS)  # the likely tokens in the last chunk
    logits = row.repeat(n, 1).cuda()
    # Mixed temperatures: the per-row copy of inverse temperatures.
    temps = [0.7 if i % 2 else 1.5 for i in range(n)]
    reqs = [_req(i, SamplingParams(temperature=t)) for i, t in enumerate(temps)]
    samples = sampler.sample_device(logits.clone(), reqs).token_ids
    _assert_frequencies(samples[1::2], _expected(row, 0.7))
    _assert_frequencies(samples[0::2], _expected(row, 1.5))
    # One shared temperature: the scalar path; every call draws fresh noise.
    reqs = [_req(i, SamplingParams(temperature=0.7)) for i in range(n)]
    first = sampler.sample_device(logits.clone(), reqs).token_ids
    second = sampler.sample_device(logits.clone(), reqs).token_ids
    assert kernel_calls == [n, n, n] and sampler.fast_steps == 3
    assert not torch.equal(first, second)
    _assert_frequencies(first, _expected(row, 0.7))


@pytest.mark.parametrize(("device", "vocab"), SAMPLER_DEVICES)
def test_sampler_reads_bfloat16_logits_without_a_float32_copy(device, vocab, monkeypatch):
    """The model's bf16 logits go to the kernel as they are; a penalised batch and the PyTorch
    path work on a float32 copy and leave the caller's logits untouched."""
    if device == "cpu":
        monkeypatch.setattr(sampler_module, "use_fused", lambda enabled, logits: enabled)
    seen: list[tuple[torch.dtype, int]] = []
    real = kernels.sampling.gumbel_argmax

    def recording(logits, *args, **kwargs):
        seen.append((logits.dtype, logits.data_ptr()))
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(kernels.sampling, "gumbel_argmax", recording)
    sampler = Sampler(torch.device(device), seed=0)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * 2
    logits[2, 5], logits[2, 9] = 10.0, 9.5
    logits = logits.to(device, torch.bfloat16)
    before = logits.clone()
    reqs = [_req(i, SamplingParams(temperature=0.7 if i == 1 else 0.0)) for i in range(3)]
    tokens = sampler.sample_device(logits, reqs).token_ids.tolist()
    assert seen == [(torch.bfloat16, logits.data_ptr())]
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == 5
    # Row 2 has generated token 5 (presence penalty 2): a float32 copy is penalised.
    reqs[2] = _req(2, SamplingParams(temperature=0.0, presence_penalty=2.0), outputs=(5,))
    tokens = sampler.sample_device(logits, reqs).token_ids.tolist()
    assert seen[-1][0] == torch.float32 and tokens[2] == 9
    # The PyTorch path (top-k) on bf16 logits.
    reqs[1] = _req(1, SamplingParams(temperature=0.7, top_k=1))
    tokens = sampler.sample_device(logits, reqs).token_ids.tolist()
    assert len(seen) == 2 and tokens[1] == int(logits[1].argmax())
    assert torch.equal(logits, before)
