"""Sampling: per-request seeds, logprobs, penalties and filters against reference semantics."""

from __future__ import annotations

import math

import pytest
import torch
from test_engine_helpers import (
    VOCAB,
    checkpoint,
    hf_greedy,
    hf_logits,
    hf_model,
    prompts,
    sample_host,
)
from transformers import GenerationConfig

from tritonllm.config import EngineConfig
from tritonllm.contract.errors import ErrorCode, RequestError
from tritonllm.engine import LLMEngine
from tritonllm.engine.request import Request
from tritonllm.engine.sampler import Sampler
from tritonllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=checkpoint("qwen3"), page_size=4, num_pages=512))


def collect(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Run requests together; return {id: [RequestOutput, ...]}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def ids_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_seeded_sampling_identical_alone_and_in_batch_of_16(engine):
    ps = prompts([5 + i for i in range(16)], seed=9)
    target = SamplingParams(
        max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    alone = ids_of(collect(engine, {"t": (ps[0], target)})["t"])
    others = {
        f"o{i}": (
            ps[i],
            SamplingParams(
                max_tokens=10 + i, temperature=1.3, seed=i if i % 2 else None, ignore_eos=True
            ),
        )
        for i in range(1, 16)
    }
    batched = collect(engine, {"t": (ps[0], target), **others})
    assert engine.stats().max_batch_size_seen >= 16
    assert ids_of(batched["t"]) == alone
    # A different seed gives a different continuation (the distribution is not degenerate).
    other_seed = SamplingParams(**{**target.__dict__, "seed": 99})
    assert ids_of(collect(engine, {"t": (ps[0], other_seed)})["t"]) != alone


def test_logprobs_match_transformers_log_softmax(engine):
    path = checkpoint("qwen3")
    prompt = prompts([11], seed=10)[0]
    temp = 0.7
    params = SamplingParams(max_tokens=12, temperature=temp, seed=5, logprobs=5, ignore_eos=True)
    outs = collect(engine, {"s": (prompt, params)})["s"]
    tokens = ids_of(outs)
    logits = hf_logits(path, prompt + tokens)[len(prompt) - 1 : -1]  # [12, vocab]
    expected = torch.log_softmax(logits / temp, dim=-1)
    for i, out in enumerate(outs):
        tok = tokens[i]
        assert abs(out.logprobs[0] - float(expected[i, tok])) < 1e-4
        top = out.top_logprobs[0]
        ref_vals, ref_ids = expected[i].topk(5)
        assert list(top) == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), ref_vals, rtol=0, atol=1e-4)


def test_greedy_logprobs_use_temperature_one(engine):
    path = checkpoint("qwen3")
    prompt = prompts([6], seed=11)[0]
    outs = collect(
        engine,
        {"g": (prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True))},
    )["g"]
    ref_tokens, ref_logits = hf_greedy(path, prompt, 6)
    assert ids_of(outs) == ref_tokens
    expected = torch.log_softmax(ref_logits, dim=-1)
    for i, out in enumerate(outs):
        assert abs(out.logprobs[0] - float(expected[i, ref_tokens[i]])) < 1e-4
        assert out.top_logprobs == [{}]


@pytest.mark.parametrize("logprobs", [None, 3])
@pytest.mark.parametrize("seed", [None, 5])
def test_a_tiny_temperature_samples_exactly_as_temperature_zero(engine, seed, logprobs):
    """A temperature below GREEDY_TEMPERATURE_EPS (1e-40: a valid FP32 input, whose 1 / T
    overflows float32) is greedy: transformers' argmax ids, and the same ids and logprobs as
    temperature 0 (at temperature 1, finite), seeded or not. It gave NaN logits, token 0
    repeated and NaN logprobs before."""
    prompt = prompts([8], seed=14)[0]

    def run(temperature: float):
        params = SamplingParams(
            max_tokens=8, temperature=temperature, seed=seed, logprobs=logprobs, ignore_eos=True
        )
        return collect(engine, {"t": (prompt, params)})["t"]

    greedy = run(0.0)
    assert ids_of(greedy) == hf_greedy(checkpoint("qwen3"), prompt, 8)[0]
    for tiny in (1e-40, 9e-6):
        outs = run(tiny)
        assert ids_of(outs) == ids_of(greedy), tiny
        assert [(o.logprobs, o.top_logprobs) for o in outs] == [
            (o.logprobs, o.top_logprobs) for o in greedy
        ]
        if logprobs is not None:
            values = [v for o in outs for v in o.logprobs]
            values += [v for o in outs for top in o.top_logprobs for v in top.values()]
            assert len(values) == 8 * (1 + 3) and all(math.isfinite(v) for v in values)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.5, top_p=0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=2.0, min_p=1.0, ignore_eos=True),
    ],
)
def test_degenerate_filters_reduce_to_greedy(engine, params):
    prompt = prompts([9], seed=12)[0]
    outs = collect(engine, {"f": (prompt, params)})["f"]
    assert ids_of(outs) == hf_greedy(checkpoint("qwen3"), prompt, 10)[0]


def _penalised(logits: torch.Tensor, prompt, output, p: SamplingParams) -> torch.Tensor:
    """OpenAI presence/frequency and vLLM repetition penalty, written from their definitions."""
    logits = logits.clone()
    for tok in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            v = logits[tok]
            logits[tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for tok in set(output):
        count = output.count(tok)
        logits[tok] -= p.frequency_penalty * count + p.presence_penalty
    return logits


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, temperature=0, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, frequency_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(
            max_tokens=16,
            temperature=0,
            repetition_penalty=0.6,
            frequency_penalty=-0.5,
            ignore_eos=True,
        ),
    ],
)
def test_penalties_follow_openai_and_vllm_semantics(engine, params):
    path = checkpoint("qwen3")
    prompt = prompts([7], seed=13)[0]
    tokens = ids_of(collect(engine, {"p": (prompt, params)})["p"])
    logits = hf_logits(path, prompt + tokens)[len(prompt) - 1 : -1]
    for i, tok in enumerate(tokens):
        ref = _penalised(logits[i], prompt, tokens[:i], params)
        assert tok == int(ref.argmax()), f"step {i}"
    # Penalties change the outcome versus plain greedy on this random model.
    if params.frequency_penalty > 0 or params.presence_penalty > 0:
        assert tokens != hf_greedy(path, prompt, 16)[0]


ON_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_every_sampler_path_gives_the_argmax_at_a_tiny_temperature(device, dtype, logprobs):
    """temperature 1e-40 rows, seeded or not, beside rows that sample (so a batch of mixed
    temperatures): the argmax, and finite logprobs, on the CPU path; on CUDA, without logprobs
    the fused Gumbel-max kernel (its inverse temperature must be 0, not 1e40, for these rows)
    and with them the PyTorch path and its seeded-row kernel call."""
    sampler = Sampler(torch.device(device), seed=0)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    logits = torch.stack([order.roll(i).float() * 0.25 for i in range(8)])  # no ties, exact bf16
    logits = logits.to(device, dtype)
    reqs = []
    for i in range(8):
        temperature = 1e-40 if i < 6 else 0.7  # rows 6, 7 sample
        seed = i if i % 2 else None
        params = SamplingParams(temperature=temperature, seed=seed, logprobs=logprobs)
        req = Request(str(i), [1], params, arrival=i)
        if seed is not None:  # as the engine sets a seeded request up
            req.seed, req.generator = seed, sampler.make_generator(seed)
        reqs.append(req)
    out = sample_host(sampler, logits.clone(), reqs)
    assert out.token_ids[:6] == logits[:6].float().argmax(dim=-1).tolist()
    if logprobs is not None:
        values = [v for v in out.logprobs if v is not None]
        values += [v for top in out.top_logprobs if top is not None for v in top.values()]
        assert len(values) == 8 * 3 and all(math.isfinite(v) for v in values)


def test_sampler_masks_stop_ids_until_min_tokens():
    sampler = Sampler(torch.device("cpu"), seed=0)
    req = Request(
        "r", [1, 2], SamplingParams(temperature=0, min_tokens=2), arrival=0, stop_ids=frozenset({3})
    )
    logits = torch.zeros(1, 8)
    logits[0, 3] = 10.0
    assert sample_host(sampler, logits.clone(), [req]).token_ids == [0]
    req.token_ids += [5, 6]  # two outputs: EOS is allowed again
    assert sample_host(sampler, logits.clone(), [req]).token_ids == [3]


def test_unseeded_sampling_follows_the_distribution():
    """top_k=2 over logits [2, 1, -inf...]: token 0 with p = e/(e+1) ≈ 0.731."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    reqs = [Request(str(i), [1], SamplingParams(top_k=2), arrival=i) for i in range(4000)]
    logits = torch.full((4000, 6), -5.0)
    logits[:, 0], logits[:, 1] = 2.0, 1.0
    tokens = torch.tensor(sample_host(sampler, logits, reqs).token_ids)
    assert set(tokens.tolist()) <= {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.7311) < 0.03


def test_cpu_exponential_noise_is_exp1_and_reproducible():
    """The CPU noise (`-log U`) is Exp(1): finite, >= 0, mean and variance 1, its CDF within
    a Kolmogorov-Smirnov bound of 1 - exp(-x); the same generator seed gives the same draws."""
    from tritonllm.engine.sampler import exponential_

    draws = exponential_(torch.empty(200_000), torch.Generator().manual_seed(7))
    assert torch.isfinite(draws).all() and (draws >= 0).all()
    assert abs(draws.mean().item() - 1) < 0.01 and abs(draws.var().item() - 1) < 0.03
    x = draws.sort().values.double()
    empirical = torch.arange(1, len(x) + 1, dtype=torch.float64) / len(x)
    ks = (empirical - (1 - torch.exp(-x))).abs().max().item()
    assert ks < 1.63 / len(x) ** 0.5  # the 1% critical value
    again = exponential_(torch.empty(200_000), torch.Generator().manual_seed(7))
    assert torch.equal(draws, again)


def test_sampling_frequencies_match_softmax_over_many_tokens():
    """Temperature sampling from logits log([0.5, 0.3, 0.15, 0.05]): the frequencies of 40,000
    draws pass a chi-square test at the 0.1% level (3 degrees of freedom: 16.27)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler = Sampler(torch.device("cpu"), seed=3)
    n = 40_000
    reqs = [Request(str(i), [1], SamplingParams(temperature=1.0), arrival=i) for i in range(n)]
    tokens = torch.tensor(sample_host(sampler, probs.log().repeat(n, 1), reqs).token_ids)
    counts = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() * n
    assert ((counts - expected) ** 2 / expected).sum().item() < 16.27


def test_cpu_seeds_that_differ_only_above_32_bits_draw_differently():
    """PyTorch's CPU generator keeps a seed's low 32 bits: seeds outside [0, 2**32) are mixed
    into them first, so s and s + 2**32 (or -1 and 2**63 - 1) do not draw alike; seeds inside
    keep their draws."""
    from tritonllm.engine.sampler import Sampler

    sampler = Sampler(torch.device("cpu"), seed=0)

    def draws(seed: int) -> list[float]:
        return torch.rand(8, generator=sampler.make_generator(seed)).tolist()

    assert draws(7) == torch.rand(8, generator=torch.Generator().manual_seed(7)).tolist()
    pairs = [(0, 1 << 32), (7, (1 << 32) + 7), (-1, (1 << 63) - 1), (0, -(1 << 63)), (-5, -6)]
    for a, b in pairs:
        assert draws(a) != draws(b), (a, b)
    assert draws(-(1 << 63)) == draws(-(1 << 63))  # still a function of the seed


@torch.inference_mode()
def hf_biased_greedy(prompt: list[int], max_new: int, bias: dict[int, float]) -> list[int]:
    """transformers' greedy `generate` with `sequence_bias` of one-token sequences (its
    `SequenceBiasLogitsProcessor`: the bias added to the logits), never stopping at EOS."""
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=None,
        pad_token_id=0,
        sequence_bias={(token,): value for token, value in bias.items()},
    )
    ids = torch.tensor([prompt])
    out = hf_model(checkpoint("qwen3")).generate(
        ids, attention_mask=torch.ones_like(ids), generation_config=config
    )
    return out[0, len(prompt) :].tolist()


def test_logit_bias_matches_transformers_sequence_bias(engine):
    """Greedy with logit_bias equals transformers' greedy with the same bias, token for token:
    -100 on the token greedy picks bans it, +100 on one it never picks forces it every step,
    and small biases shift the argmax exactly as adding them to the logits does. The biased
    requests share a batch with an unbiased one, which stays plain greedy."""
    prompt = prompts([7], seed=21)[0]
    plain = hf_greedy(checkpoint("qwen3"), prompt, 12)[0]
    unused = next(t for t in range(10, VOCAB) if t not in plain)
    biases = {
        "ban": {plain[0]: -100.0},
        "force": {unused: 100.0},
        "shift": {plain[0]: -3.0, plain[1]: 4.0, unused: 2.5},
    }
    requests = {
        name: (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias=b))
        for name, b in biases.items()
    }
    requests["plain"] = (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = {name: ids_of(o) for name, o in collect(engine, requests).items()}
    assert outs["plain"] == plain
    for name, bias in biases.items():
        assert outs[name] == hf_biased_greedy(prompt, 12, bias), name
    assert plain[0] not in outs["ban"]
    assert outs["force"] == [unused] * 12
    assert outs["shift"] != plain  # the small biases changed something on this model


def test_logit_bias_applies_to_sampled_rows_and_their_logprobs(engine):
    """A +100 bias makes a sampled row (temperature, top-p, logprobs) pick that token with
    logprob ~0: the bias is in the logits that temperature, filters and logprobs see."""
    prompt = prompts([5], seed=22)[0]
    params = SamplingParams(
        max_tokens=6, temperature=1.5, top_p=0.9, logprobs=2, seed=3, logit_bias={42: 100}
    )
    outs = collect(engine, {"s": (prompt, params)})["s"]
    assert ids_of(outs) == [42] * 6
    assert all(lp > -1e-3 for o in outs for lp in o.logprobs)


def test_logit_bias_ids_outside_the_vocabulary_are_refused(engine):
    params = SamplingParams(max_tokens=2, logit_bias={3: 1.0, VOCAB: 1.0})
    with pytest.raises(
        RequestError, match=rf"logit_bias token ids must be in \[0, {VOCAB}\)"
    ) as info:
        engine.check_request([1, 2], params)
    assert (info.value.code, info.value.param) == (ErrorCode.INVALID_VALUE, "logit_bias")
