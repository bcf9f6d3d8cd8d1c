"""SamplingParams validates on construction: every out-of-range value is a RequestError (a
ValueError) with code invalid_value naming the parameter; the ranges are the contract's."""

from __future__ import annotations

import math

import pytest

from tritonllm.contract import limits
from tritonllm.contract.errors import ErrorCode
from tritonllm.sampling_params import SamplingParams

INVALID = [
    ("max_tokens", True),  # 0 is valid (prefill only), False is no number
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("temperature", -0.1),
    ("temperature", 2.01),  # OpenAI's range, the same in the sidecar
    ("temperature", math.nan),
    ("temperature", "hot"),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("seed", 1.5),
    ("seed", "7"),
    ("min_tokens", -1),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("n", 0),
    ("n", 17),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("stop_token_ids", (5, -1)),
    ("logit_bias", {5: 100.5}),  # OpenAI's range is [-100, 100]
    ("logit_bias", {5: -101}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: math.inf}),
    ("logit_bias", {5: True}),
    ("logit_bias", {5: "1"}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),  # ids are ints here: the trust boundaries parse OpenAI's keys
    ("logit_bias", {5.0: 1.0}),
    ("logit_bias", ((5, 1.0), (5, 2.0))),  # an id twice
    ("logit_bias", ((5, 1.0, 2.0),)),
    ("logit_bias", "5"),
    ("logit_bias", {i: 1.0 for i in range(301)}),  # OpenAI's limit is 300 entries
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_value_raises_value_error_naming_parameter(name, value):
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**{name: value})
    assert (info.value.code, info.value.param) == (ErrorCode.INVALID_VALUE, name)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=16, min_tokens=17)


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_infinity_is_refused_as_not_finite(name):
    """A huge JSON number becomes inf in a Triton FP32 input: the message says why it fails."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number .*got inf"):
        SamplingParams(**{name: math.inf})


VALID = [
    {},
    {"temperature": 0.0},
    {"temperature": 2.0},
    {"top_p": 1.0},
    {"top_p": 1e-3},
    {"top_k": 50, "top_p": 0.5},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 0.5},
    {"logprobs": 0},
    {"logprobs": 20},
    {"n": 16},
    {"seed": 0},
    {"min_tokens": 16},
    {"min_tokens": 16, "max_tokens": 16},
    {"stop_token_ids": [1, 2]},
    {"logit_bias": ((3, -100.0), (9, 100.0))},
]


@pytest.mark.parametrize("kwargs", VALID)
def test_valid_values_pass(kwargs):
    params = SamplingParams(**kwargs)
    assert all(
        getattr(params, k) == (tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()
    )


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_p_zero_is_the_most_likely_token_alone(top_k):
    """OpenAI takes top_p in [0, 1]: 0, nucleus sampling's limit p -> 0, keeps the most likely
    token alone, which the samplers see as top_k 1 (and no top_p cut, which would keep none)."""
    p = SamplingParams(temperature=1.0, top_p=0, top_k=top_k)
    assert (p.top_p, p.top_k, p.top_k_enabled) == (1.0, 1, True)
    assert p == SamplingParams(temperature=1.0, top_k=1)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6, 9.99e-6, 0])
def test_a_temperature_below_the_greedy_eps_is_stored_as_zero(temperature):
    """vLLM's _SAMPLING_EPS: a temperature in [0, 1e-5) is greedy, stored as 0.0, so every
    sampler (CPU, the GPU kernel's 1 / T) sees temperature 0; seed and logprobs unchanged."""
    assert limits.GREEDY_TEMPERATURE_EPS == 1e-5
    p = SamplingParams(temperature=temperature, seed=3, logprobs=2)
    assert p.temperature == 0.0 and isinstance(p.temperature, float) and p.is_greedy
    assert p == SamplingParams(temperature=0.0, seed=3, logprobs=2)
    for kept in (1e-5, 1e-3, 2.0):
        assert SamplingParams(temperature=kept).temperature == kept
        assert not SamplingParams(temperature=kept).is_greedy


def test_defaults_and_greedy_flag():
    p = SamplingParams()
    # max_tokens None: until EOS, a stop or the context limit (its one "no limit" encoding).
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n) == (None, 1.0, 1.0, -1, 1)
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy
    # Lists are accepted and stored as tuples, so params stay hashable (frozen).
    assert hash(SamplingParams(stop_token_ids=[3, 4])) == hash(
        SamplingParams(stop_token_ids=(3, 4))
    )


def test_logit_bias_is_stored_as_pairs_ascending_by_id():
    """A mapping or pairs in any order give the same (hashable) params; ints become floats."""
    by_map = SamplingParams(logit_bias={9: 100, 3: -0.5})
    assert by_map.logit_bias == ((3, -0.5), (9, 100.0))
    assert all(type(b) is float for _, b in by_map.logit_bias)
    assert by_map == SamplingParams(logit_bias=[(9, 100.0), (3, -0.5)])
    assert hash(by_map) == hash(SamplingParams(logit_bias=[[3, -0.5], [9, 100]]))
    assert SamplingParams(logit_bias={i: 1.0 for i in range(300)}).logit_bias[-1] == (299, 1.0)
    assert SamplingParams().logit_bias == SamplingParams(logit_bias={}).logit_bias == ()
