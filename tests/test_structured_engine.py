"""Token constraints in the engine (in-process `LLMEngine`, the tiny random-weight Qwen3 and
its tokenizer), the guarantees `tritonllm.structured` gives:

- Every output of a generated JSON schema (10 seeded schemas, greedy and seeded sampling)
  parses and validates and ends with finish_reason "stop" (the grammar ends the generation),
  with overlap scheduling and mixed prefill/decode steps on, requests arriving while others
  decode (constrained decode rows inside mixed steps), twins of a request (same prompt, schema
  and seed) giving its output; the same constrained outputs with
  overlap scheduling off; unconstrained requests batched with them give the ids they give alone.
- A grammar step's deferred sampling (masks filled while the engine builds the next step)
  gives the outputs of the same run without it.
- Overlap scheduling waits for the step in flight only for rows whose mask depends on their
  history (a grammar, multi-token bad words); unconstrained batches and allowed-token-id rows
  keep the full overlap.
- regex, choice, EBNF grammar and json_object outputs match; allowed_token_ids and bad_words
  (single- and multi-token) mask what they name.
- An invalid schema, pattern or grammar is a RequestError naming the field, before the engine.
- JSON schemas of xgrammar's subset get xgrammar's matchers, others (and any constraint with
  backend "guidance", or an engine with grammar_backend "llguidance") llguidance's; a bounded
  schema's outputs validate under either.
- GPU (marked `gpu`): the same with CUDA graphs (the mask applied after the replay) and
  overlap scheduling.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from structured_helpers import generated_schemas

from tritonllm.config import EngineConfig, ModelConfig
from tritonllm.contract.errors import RequestError
from tritonllm.engine import LLMEngine
from tritonllm.sampling_params import SamplingParams
from tritonllm.structured.constraint import bitmask_words
from tritonllm.structured.spec import StructuredOutputs

# The first 10 of the 20 generated schemas (all 20 go through the service in
# test_structured_outputs; their longest outputs would dominate this test's time).
SCHEMAS = generated_schemas(10)
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _engine(model, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_pages", 1024)
    kwargs.setdefault("page_size", 4)
    return LLMEngine(EngineConfig(model=str(model), **kwargs))


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]], late=()):
    """Run ``requests`` (those whose id is in ``late`` arrive after 3 steps); return
    {id: (output ids, finish_reason, error)}."""
    ids: dict[str, list[int]] = {}
    ends: dict[str, tuple] = {}
    pending = [r for r in requests if r[0] in late]
    for rid, prompt, params in requests:
        if rid not in late:
            engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished() or pending:
        steps += 1
        if steps == 4:
            for rid, prompt, params in pending:
                engine.add_request(rid, prompt, params)
            pending = []
        for o in engine.step():
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                ends[o.request_id] = (o.finish_reason, o.error)
    return {rid: (ids.get(rid, []), *ends[rid]) for rid, _, _ in requests}


def _json(schema: dict) -> StructuredOutputs:
    return StructuredOutputs("json", json.dumps(schema))


def _schema_workload(tok):
    constrained = [
        (
            f"s{k}",
            tok.encode(f"JSON number {k}, please:"),
            SamplingParams(
                max_tokens=300,
                temperature=0.0 if k % 2 == 0 else 1.0,
                seed=k,
                structured_outputs=_json(SCHEMAS[k % len(SCHEMAS)]),
            ),
        )
        for k in range(len(SCHEMAS))
    ]
    plain = [
        (
            f"p{i}",
            tok.encode(f"Tell me a story {i}"),
            SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.8, seed=50 + i),
        )
        for i in range(4)
    ]
    return constrained, plain


def _check_schema_outputs(tok, outs: dict) -> None:
    for k in range(len(SCHEMAS)):
        ids, reason, error = outs[f"s{k}"]
        text = tok.decode(ids, skip_special_tokens=True)
        assert (reason, error) == ("stop", None), (k, text)
        jsonschema.validate(json.loads(text), SCHEMAS[k % len(SCHEMAS)])
        if f"xs{k}" in outs:  # the same prompt, schema and seed elsewhere in the batch
            assert outs[f"xs{k}"] == outs[f"s{k}"], k


def test_generated_schemas_validate_with_overlap_and_mixed_steps_and_neighbours_unchanged(
    tiny_model_dir, tok
):
    constrained, plain = _schema_workload(tok)
    constrained += [(f"x{rid}", p, params) for rid, p, params in constrained]  # batch of 24
    late = {rid for rid, _, _ in constrained[::3]} | {"p1", "p3"}
    engine = _engine(tiny_model_dir, overlap_schedule=True, mixed_steps=True)
    alone = _run(engine, plain)
    together = _run(engine, constrained + plain, late)
    _check_schema_outputs(tok, together)
    for rid, _, _ in plain:
        assert together[rid] == alone[rid], rid
    serial = _run(_engine(tiny_model_dir, overlap_schedule=False), constrained + plain, late)
    assert serial == together


def test_outputs_do_not_depend_on_the_mask_fill_threads(tiny_model_dir, tok):
    """The generated schemas' outputs (greedy and sampled, twins in the batch) are the same
    whether one thread or three fill the masks (`EngineConfig.grammar_threads`)."""
    constrained, _ = _schema_workload(tok)
    constrained += [(f"x{rid}", p, params) for rid, p, params in constrained]
    one = _run(_engine(tiny_model_dir, grammar_threads=1), constrained)
    three = _run(_engine(tiny_model_dir, grammar_threads=3), constrained)
    _check_schema_outputs(tok, three)
    assert three == one


def _warm(engine: LLMEngine, requests) -> None:
    """Compile the constraints of ``requests`` (cached) before they arrive."""
    for _, _, params in requests:
        engine.constraints.compiler.submit(params).result()


def test_deferred_sampling_changes_no_output(tiny_model_dir, tok, monkeypatch):
    """A grammar step's sampling is deferred (its masks fill on the mask thread while the
    engine finishes processing the step before, commits the step and builds the next one's
    inputs) unless a row of it uses penalties: the outputs equal those of the same run with the deferral off, token for token,
    under overlap scheduling and mixed steps, with late arrivals, seeded sampling, allowed ids,
    bad words and a penalised row in the batch."""
    constrained, plain = _schema_workload(tok)
    prompt = tok.encode("Tell me more")
    others = [
        # seeded: an unseeded row's draws depend on which rows share its steps, and when a
        # constrained request joins depends on its compile's timing
        (
            "ids",
            prompt,
            SamplingParams(max_tokens=12, seed=1, allowed_token_ids=[*range(100, 140)]),
        ),
        ("bad", prompt, SamplingParams(max_tokens=12, temperature=0.9, seed=3, bad_words=["a b"])),
        ("pen", prompt, SamplingParams(max_tokens=12, seed=2, repetition_penalty=1.3)),
    ]
    workload = constrained + plain + others
    late = {rid for rid, _, _ in constrained[::2]} | {"p1", "pen"}
    engine = _engine(tiny_model_dir, overlap_schedule=True, mixed_steps=True)
    # The first compile loads the tokenizers (seconds): done before the run, so the constrained
    # requests are admitted while the penalised one still runs, as in the reference run.
    _warm(engine, constrained)
    runner = engine.runner
    deferred, filled_here = [], []
    defer, sample = runner._deferred_sampling, runner.sampler.sample_device

    def spy(logits, reqs, ids_to_device=None, masks=None, positions=None):
        grammar = [r for r in reqs if r.constraint and r.constraint.matcher and not r.finish_reason]
        if masks is None and grammar:
            filled_here.append(any(r.uses_penalties for r in reqs))
        return sample(logits, reqs, ids_to_device, masks, positions)

    # A deferred fill starts as soon as the step in flight's tokens are accepted, before that
    # step's stop checks (`_append_token`): "early" counts those starts.
    phase, early = {"accepted": False}, []
    accept, append, start = engine._accept, engine._append_token, runner.sampler.start_masks

    def spy_accept(*a):
        phase["accepted"] = True
        return accept(*a)

    def spy_append(*a):
        phase["accepted"] = False
        return append(*a)

    def spy_start(*a):
        early.append(phase["accepted"])
        return start(*a)

    monkeypatch.setattr(runner, "_deferred_sampling", lambda *a: deferred.append(1) or defer(*a))
    monkeypatch.setattr(runner.sampler, "sample_device", spy)
    monkeypatch.setattr(runner.sampler, "start_masks", spy_start)
    monkeypatch.setattr(engine, "_accept", spy_accept)
    monkeypatch.setattr(engine, "_append_token", spy_append)
    outs = _run(engine, workload, late)
    assert len(deferred) > 10  # steps with a grammar row deferred their sampling, ...
    assert len(filled_here) > 5 and all(filled_here)  # ... all but those with the penalty
    assert sum(early) > 10  # most deferred fills started before the stop checks
    _check_schema_outputs(tok, outs)
    off = _engine(
        tiny_model_dir, overlap_schedule=True, mixed_steps=True, defer_grammar_sampling=False
    )
    _warm(off, constrained)
    reference = _run(off, workload, late)
    assert reference == outs


def test_overlap_waits_only_for_history_dependent_constraints(tiny_model_dir, tok):
    engine = _engine(tiny_model_dir, overlap_schedule=True)
    decisions: list[bool] = []
    needs_sync = engine.constraints.needs_sync

    def spy(reqs):
        decisions.append(needs_sync(reqs))
        return decisions[-1]

    engine.constraints.needs_sync = spy  # type: ignore[method-assign]
    prompt = tok.encode("hello there")
    _run(engine, [("plain", prompt, SamplingParams(max_tokens=8))])
    assert decisions == []  # no constrained request: the hook is not even installed
    allowed = list(range(1000, 1010))
    outs = _run(
        engine,
        [
            ("plain", prompt, SamplingParams(max_tokens=8)),
            ("ids", prompt, SamplingParams(max_tokens=8, allowed_token_ids=allowed)),
        ],
    )
    assert decisions and not any(decisions)  # a history-independent mask: full overlap
    assert set(outs["ids"][0]) <= set(allowed)
    decisions.clear()
    choice = StructuredOutputs("choice", json.dumps(["alpha beta gamma", "delta"]))
    outs = _run(engine, [("c", prompt, SamplingParams(max_tokens=30, structured_outputs=choice))])
    assert any(decisions)
    assert tok.decode(outs["c"][0], skip_special_tokens=True) in ("alpha beta gamma", "delta")


GRAMMAR = 'root ::= "yes" | "no" | ("n=" [0-9] [0-9]? " " item)\nitem ::= "apple" | "pear"'


def test_regex_choice_grammar_and_json_object_outputs_match(tiny_model_dir, tok):
    engine = _engine(tiny_model_dir, overlap_schedule=True)
    cases = {
        "regex": (
            StructuredOutputs("regex", r"[a-z]{3,6}-[0-9]{2}"),
            lambda t: re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", t),
        ),
        "choice": (
            StructuredOutputs("choice", json.dumps(["red", "green", "blue sky"])),
            lambda t: t in ("red", "green", "blue sky"),
        ),
        "grammar": (
            StructuredOutputs("grammar", GRAMMAR),
            lambda t: re.fullmatch(r"yes|no|n=[0-9]{1,2} (apple|pear)", t),
        ),
    }
    requests = [
        (
            f"{name}{i}",
            tok.encode(f"{name} {i}"),
            SamplingParams(max_tokens=400, temperature=float(i), seed=i, structured_outputs=so),
        )
        for name, (so, _) in cases.items()
        for i in range(2)
    ]
    # Any JSON object is unbounded: a random-weight model writes one string forever. Allowed
    # ids without a quote compose with the grammar's mask: after `{` only `}` is left, then
    # EOS (without the grammar `1` and `:` would come; without the allowed ids, strings).
    allowed = [tok.convert_tokens_to_ids(t) for t in ("{", "}", ":", "1")]
    allowed += list(engine.model_config.eos_token_ids)
    cases["json_object"] = (None, lambda t: isinstance(json.loads(t), dict))
    requests += [
        (
            f"json_object{i}",
            tok.encode(f"object {i}"),
            SamplingParams(
                max_tokens=400,
                temperature=float(i),
                seed=i,
                allowed_token_ids=allowed,
                structured_outputs=StructuredOutputs("json_object"),
            ),
        )
        for i in range(2)
    ]
    outs = _run(engine, requests)
    for rid, (ids, reason, error) in outs.items():
        text = tok.decode(ids, skip_special_tokens=True)
        assert (reason, error) == ("stop", None), (rid, text)
        assert cases[rid[:-1]][1](text), (rid, text)
    assert [tok.decode(outs[f"json_object{i}"][0], skip_special_tokens=True) for i in (0, 1)] == [
        "{}",
        "{}",
    ]


def _reference_chain(links: int) -> dict:
    """A JSON schema whose root is a chain of ``links`` ``$ref``s to a bounded integer."""
    defs: dict = {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(links)}
    defs[str(links)] = {"type": "integer", "minimum": 0, "maximum": 99}
    return {"$ref": "#/$defs/0", "$defs": defs}


def test_long_reference_chains_compile_and_generate(tiny_model_dir, tok):
    """QA (a fuzzing session): llguidance recurses per link of a reference chain, and a chain of
    2,500 ``$ref``s or 2,700 Lark rules (well under the 100,000-character limit) overflowed an
    8 MiB stack: SIGSEGV in the generator's stub. Validation, compile, matcher builds and mask
    fills now run on large stacks (`tritonllm.structured.stacks`); these chains, near the
    length limit, are served (this test's process would die, not fail, without that)."""
    lark = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(7500)) + 'r7500: "a"\n'
    constraints = {
        "ref": StructuredOutputs.build("json", _reference_chain(3200), "guided_json"),
        "lark": StructuredOutputs.build("grammar", lark, "guided_grammar"),
    }
    engine = _engine(tiny_model_dir, overlap_schedule=True)
    requests = [
        (
            f"{name}{i}",
            tok.encode(f"{name} {i}"),
            SamplingParams(max_tokens=20, temperature=float(i), seed=i, structured_outputs=so),
        )
        for name, so in constraints.items()
        for i in range(2)
    ]
    for rid, (ids, reason, error) in _run(engine, requests).items():
        text = tok.decode(ids, skip_special_tokens=True)
        assert (reason, error) == ("stop", None), (rid, text)
        if rid.startswith("ref"):
            assert 0 <= json.loads(text) <= 99, (rid, text)
        else:
            assert text == "a", (rid, text)


def test_allowed_token_ids_and_bad_words_mask_what_they_name(tiny_model_dir, tok):
    engine = _engine(tiny_model_dir)
    prompt = tok.encode("Once upon a time")
    base = _run(engine, [("base", prompt, SamplingParams(max_tokens=12, ignore_eos=True))])
    base_ids = base["base"][0]
    allowed = sorted(set(base_ids[1::2]) | {7, 8, 9})
    # Words as the model wrote them: a single-token word and a two-token sequence.
    single = tok.decode([base_ids[0]])
    pair = tok.decode(base_ids[2:4])
    outs = _run(
        engine,
        [
            (
                "ids",
                prompt,
                SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=allowed),
            ),
            (
                "bad",
                prompt,
                SamplingParams(max_tokens=12, ignore_eos=True, bad_words=[single, pair]),
            ),
        ],
    )
    assert set(outs["ids"][0]) <= set(allowed) and len(outs["ids"][0]) == 12
    bad_ids = outs["bad"][0]
    banned_first = tok.encode(single, add_special_tokens=False)
    assert len(banned_first) == 1 and banned_first[0] not in bad_ids
    pair_ids = tok.encode(pair, add_special_tokens=False)
    windows = [tuple(bad_ids[i : i + len(pair_ids)]) for i in range(len(bad_ids))]
    assert tuple(pair_ids) not in windows
    assert bad_ids != base_ids


def test_logit_bias_never_lifts_a_token_mask(tiny_model_dir, tok):
    """The mask comes first: +100 on a token outside allowed_token_ids never makes it
    sampled, while -100 inside them still bans that one (greedy and sampled rows alike)."""
    engine = _engine(tiny_model_dir)
    prompt = tok.encode("Once upon a time")
    allowed = [100, 101, 102]
    bias = {5: 100.0, 100: -100.0, 101: -100.0}
    outs = _run(
        engine,
        [
            (
                rid,
                prompt,
                SamplingParams(
                    max_tokens=8,
                    temperature=temperature,
                    ignore_eos=True,
                    allowed_token_ids=allowed,
                    logit_bias=bias,
                ),
            )
            for rid, temperature in (("greedy", 0.0), ("sampled", 1.0))
        ],
    )
    assert outs["greedy"][0] == outs["sampled"][0] == [102] * 8


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json", '{"type": "object", "properties": '),
        ("json", '{"type": "no-such-type"}'),
        ("regex", "[a-z"),
        ("grammar", "root ::= missing_rule"),
        ("choice", "[]"),
        # llguidance 1.9.1's validation crashes the process (SIGSEGV) on these integers
        ("json", '{"enum": [-9223372036854775808]}'),
        ("json", '{"properties": {"a": {"const": -9223372036854775296}}}'),
        ("grammar", 'start: %json{"const": -9223372036854775808}'),
        ("json", '{"type": "integer", "maximum": 18446744073709551616}'),
        # a matcher of this one grew past 4 GB without end (validation took it at once)
        ("json", '{"type": "integer", "multipleOf": 2147483648}'),
        ("grammar", 'start: %json{"type": "number", "multipleOf": 10001}'),
    ],
)
def test_an_invalid_constraint_is_a_request_error_naming_its_field(kind, spec):
    with pytest.raises(RequestError) as info:
        StructuredOutputs(kind, spec)
    assert info.value.param == f"structured_outputs.{kind}"


def test_integers_up_to_llguidances_edges_still_compile():
    for schema in (
        {"enum": [-9223372036854775295]},  # the last above -2^63 + 512
        {"type": "integer", "maximum": 2**64 - 1},
        {"description": "-9223372036854775808"},  # a string, not an integer
        {"type": "integer", "multipleOf": 9973},
        {"type": "number", "multipleOf": 0.0025},
        {"type": "integer", "multipleOf": 86400},  # 864 * 10^2
        {"properties": {"multipleOf": {"type": "integer"}}},  # a property's name
    ):
        StructuredOutputs.build("json", schema, "guided_json")  # no RequestError


def test_a_constraint_names_the_clients_field_without_splitting_the_grammar_cache():
    """The field a client gave the constraint as is what its errors name (also the ones
    found later, while generating), yet the same constraint under two names is one cache key."""
    param = "sampling_parameters.guided_decoding.regex"
    named = StructuredOutputs.from_wire({"regex": "[a-z]+"}, "sampling_parameters.guided_decoding")
    assert named.param == param
    plain = StructuredOutputs("regex", "[a-z]+")
    assert plain.param == "structured_outputs.regex"
    assert named == plain and hash(named) == hash(plain)
    with pytest.raises(RequestError) as info:
        StructuredOutputs.build("regex", "[a-z", param)
    assert info.value.param == param and info.value.message.startswith(param)


def test_properties_come_in_the_schemas_order(tiny_model_dir, tok):
    schema = {
        "type": "object",
        "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}, "mid": {"enum": [3]}},
        "required": ["zeta", "alpha", "mid"],
    }
    params = SamplingParams(
        max_tokens=60, structured_outputs=StructuredOutputs.build("json", schema, "s")
    )
    ((ids, reason, error),) = _run(
        _engine(tiny_model_dir), [("o", tok.encode("x"), params)]
    ).values()
    assert (reason, error) == ("stop", None)
    assert tok.decode(ids, skip_special_tokens=True) == '{"zeta": 1, "alpha": 2, "mid": 3}'


OBJECT_OF_A_BOUNDED_STRING = {
    "type": "object",
    "properties": {"a": {"type": "string", "minLength": 1, "maxLength": 4}},
    "required": ["a"],
}


def _compiler(model_dir, use_xgrammar: bool = True):
    """A `ConstraintCompiler` of the model in ``model_dir``, as the engine makes one; the caller
    shuts it down."""
    from tritonllm.structured.compiler import ConstraintCompiler

    mc = ModelConfig.from_pretrained(str(model_dir))
    return ConstraintCompiler(str(model_dir), mc.vocab_size, mc.eos_token_ids, use_xgrammar)


@pytest.mark.parametrize(
    ("schema", "xgrammar"),
    [
        (OBJECT_OF_A_BOUNDED_STRING, True),
        ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}}, True),
        ({"enum": ["x", 1, None]}, True),
        ({"type": "string", "enum": ["a", "b"], "title": "Colour"}, True),  # a pydantic Enum
        ({"type": "number", "const": 2}, True),
        # xgrammar drops every keyword beside an enum or a const: these keep llguidance.
        ({"type": "string", "enum": ["a", "bbbbbbbb"], "maxLength": 3}, False),
        ({"type": "integer", "enum": [1, 50], "maximum": 10}, False),
        ({"type": "string", "enum": ["x", 1]}, False),
        ({"enum": ["x"], "const": "x"}, False),
        ({"type": "number"}, True),
        ({"type": "string", "pattern": "^a+$"}, False),  # patterns: llguidance
        ({"type": "number", "minimum": 0, "maximum": 1}, False),  # `strict`'s multipleOf
        ({"type": "object"}, False),  # open object: the two libraries' defaults differ
        ({"type": "array"}, False),
        ({"type": ["string", "null"]}, False),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, False),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "additionalProperties": True,
            },
            False,
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/x"}},
                "$defs": {"x": {"type": "integer"}},
            },
            False,
        ),
    ],
)
def test_json_schemas_of_xgrammars_subset_get_xgrammar_matchers(tiny_model_dir, schema, xgrammar):
    from tritonllm.structured.constraint import XGrammarMatcher

    compiler = _compiler(tiny_model_dir)
    llguidance_only = _compiler(tiny_model_dir, use_xgrammar=False)
    try:
        spec = StructuredOutputs.build("json", schema, "guided_json")
        guidance = StructuredOutputs.from_wire({"json": schema, "backend": "guidance"})
        compiled = compiler.submit(SamplingParams(structured_outputs=spec)).result()
        assert (compiled.xgrammar is not None) is xgrammar
        assert isinstance(compiled.new().matcher, XGrammarMatcher) is xgrammar
        for other in (
            compiler.submit(SamplingParams(structured_outputs=guidance)).result(),
            llguidance_only.submit(SamplingParams(structured_outputs=spec)).result(),
        ):
            assert other.xgrammar is None and other.grammar == compiled.grammar
    finally:
        compiler.shutdown()
        llguidance_only.shutdown()


def _xgrammar_allowed(matcher, vocab: int) -> set[int]:
    mask = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
    matcher.matcher.fill_next_token_bitmask(mask, 0)
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_without_xgrammar_llguidance_serves_every_schema(tiny_model_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar: ImportError
    compiler = _compiler(tiny_model_dir)
    try:
        spec = StructuredOutputs.build("json", OBJECT_OF_A_BOUNDED_STRING, "s")
        compiled = compiler.submit(SamplingParams(structured_outputs=spec)).result()
    finally:
        compiler.shutdown()
    assert compiled.xgrammar is None and compiled.grammar is not None
    assert not compiler.use_xgrammar


def test_random_walks_of_xgrammar_matchers_end_in_valid_json(tiny_model_dir, tok):
    """Seeded schemas of xgrammar's subset (two generated properties each), three walks each
    that take a uniformly drawn allowed token (the stop token, once allowed, half of the time):
    every walk that ends is JSON that validates. Found xgrammar 0.2.9's raw tab in bounded
    strings; the compiler's `JSON_STRING_CHAR` replaces its character class."""
    import random

    from structured_helpers import random_schema

    compiler = _compiler(tiny_model_dir)
    vocab, stops = compiler.vocab_size, set(compiler.stop_token_ids)
    schemas = ended = 0
    try:
        for seed in range(130):
            rng = random.Random(seed)
            schema = {
                "type": "object",
                "properties": {"root": random_schema(rng), "x": random_schema(rng)},
                "required": ["root"],
            }
            spec = StructuredOutputs.build("json", schema, "s")
            if spec.xgrammar_schema() is None:
                continue
            schemas += 1
            compiled = compiler.submit(SamplingParams(structured_outputs=spec)).result()
            for _ in range(3):
                matcher, ids = compiled.new().matcher, []
                for _ in range(300):
                    allowed = sorted(_xgrammar_allowed(matcher, vocab))
                    stop = [t for t in allowed if t in stops]
                    token = stop[0] if stop and rng.random() < 0.5 else rng.choice(allowed)
                    assert matcher.consume_token(token)
                    if token in stops:
                        ended += 1
                        jsonschema.validate(json.loads(tok.decode(ids)), schema)
                        break
                    ids.append(token)
    finally:
        compiler.shutdown()
    assert schemas >= 40 and ended >= 100, (schemas, ended)


def test_a_bounded_string_under_xgrammar_refuses_raw_control_characters(tiny_model_dir, tok):
    compiler = _compiler(tiny_model_dir)
    try:
        spec = StructuredOutputs.build("json", OBJECT_OF_A_BOUNDED_STRING, "s")
        matcher = compiler.submit(SamplingParams(structured_outputs=spec)).result().new().matcher
    finally:
        compiler.shutdown()
    for token in tok.encode('{"a": "', add_special_tokens=False):
        assert matcher.consume_token(token)
    allowed = _xgrammar_allowed(matcher, compiler.vocab_size)
    (tab,) = tok.encode("\t", add_special_tokens=False)
    (letter,) = tok.encode("b", add_special_tokens=False)
    assert letter in allowed and tab not in allowed


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_a_bounded_schema_validates_under_either_grammar_backend(tiny_model_dir, tok, backend):
    """The structured-decode benchmark's items (bounded strings, integers and arrays), where
    the two libraries' masks cost the most differently, with overlap scheduling and a plain
    neighbour: every output validates and ends with "stop"."""
    from benchmarks.structured_decode import ITEM

    schemas = [
        {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 2},
        OBJECT_OF_A_BOUNDED_STRING,
    ]
    requests = [
        (
            f"s{k}",
            tok.encode(f"JSON {k}:"),
            SamplingParams(
                max_tokens=200,
                temperature=0.0 if k < 2 else 1.0,
                seed=k,
                structured_outputs=_json(schemas[k % 2]),
            ),
        )
        for k in range(4)
    ]
    requests.append(("p", tok.encode("Hello"), SamplingParams(max_tokens=8, temperature=0.0)))
    engine = _engine(tiny_model_dir, overlap_schedule=True, grammar_backend=backend)
    outs = _run(engine, requests)
    for k in range(4):
        ids, reason, error = outs[f"s{k}"]
        text = tok.decode(ids, skip_special_tokens=True)
        assert (reason, error) == ("stop", None), (k, text)
        jsonschema.validate(json.loads(text), schemas[k % 2])


def test_a_bounded_number_with_a_narrow_range_stays_satisfiable():
    schema = {"type": "number", "exclusiveMinimum": 0, "maximum": 0.0000001}
    StructuredOutputs.build("json", schema, "guided_json")  # no RequestError


def test_a_constraint_that_breaks_while_generating_fails_every_time_never_stops(
    tiny_model_dir, tok
):
    """A regex that passes validation but exceeds llguidance's lexer limits at the first token
    (QA: "b{500000}"): the request fails with the matcher's error, and so does a retry (the
    compile cache drops it), instead of an empty "stop" output that does not match."""
    engine = _engine(tiny_model_dir)
    for attempt in range(2):
        params = SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputs("regex", "b{500000}")
        )
        engine.add_request(f"r{attempt}", tok.encode("say"), params)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        (last,) = [o for o in outs if o.finished]
        assert last.finish_reason == "error", (attempt, last)
        # the request's own fault, by code (the sidecar's 400 naming the client's field)
        assert (last.error_code, last.error_param) == ("invalid_value", "structured_outputs.regex")
        assert "<state>" not in last.error and "<grammar>" not in last.error, last.error
    plain = SamplingParams(max_tokens=4)
    ((ids, reason, _),) = _run(engine, [("p", tok.encode("say"), plain)]).values()
    assert len(ids) == 4 and reason == "length"  # the engine serves on


def test_allowed_ids_that_leave_no_token_fail_naming_them_and_spare_the_batch(tiny_model_dir, tok):
    """QA: allowed_token_ids that exclude every token a grammar allows (or that bad_words ban
    entirely) left an empty mask: the request failed mid-generation as an engine fault ("token
    N violates the request's constraint"). Now it is the request's own error naming the field,
    and a plain request in the same batch is unchanged."""
    engine = _engine(tiny_model_dir)
    prompt = tok.encode("Once upon a time")
    plain = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    alone = _run(engine, [("p", prompt, plain)])["p"]
    (seven,) = tok.encode("7", add_special_tokens=False)
    regex = StructuredOutputs("regex", "a+")  # no token of it is "7"
    requests = [
        ("p", prompt, plain),
        (
            "grammar",
            prompt,
            SamplingParams(
                max_tokens=6, temperature=0.0, structured_outputs=regex, allowed_token_ids=[seven]
            ),
        ),
        ("ids", prompt, SamplingParams(max_tokens=6, allowed_token_ids=[seven], bad_words=["7"])),
        (
            "sampled",
            prompt,
            SamplingParams(
                max_tokens=6,
                temperature=1.0,
                seed=1,
                structured_outputs=regex,
                allowed_token_ids=[seven],
            ),
        ),
    ]
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert [t for o in outs["p"] for t in o.new_token_ids] == alone[0]
    for rid in ("grammar", "ids", "sampled"):
        last = outs[rid][-1]
        assert last.finished and last.finish_reason == "error", (rid, last)
        assert (last.error_code, last.error_param) == ("invalid_value", "allowed_token_ids")
        assert last.error.startswith("allowed_token_ids leaves no token to sample"), last.error


def test_earlier_requests_of_a_grammar_never_fail_a_later_one(tiny_model_dir, tok):
    """Each choice's matcher has a lexer of its own: llguidance's lexer limit (250k DFA states)
    counts one generation's states, never those earlier requests of the same (cached) grammar
    explored. QA: with lexers shared across requests, sampled requests of ``.*[ae].{26}`` failed
    with "too many states" every dozen requests, and the generator's memory grew by the
    retained states."""
    engine = _engine(tiny_model_dir)
    regex = StructuredOutputs("regex", ".*[ae].{26}")
    for i in range(16):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=regex)
        ((ids, reason, error),) = _run(
            engine, [(f"r{i}", tok.encode(f"topic {i}"), params)]
        ).values()
        assert error is None and reason in ("stop", "length"), (i, reason, error)


@pytest.mark.parametrize(
    ("pattern", "ascii"),
    [
        (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
        (r"[\d_]+\w", "[0-9_]+[A-Za-z0-9_]"),
        (r"\D\W", "[^0-9][^A-Za-z0-9_]"),
        (r"\\d\.\s", r"\\d\.\s"),  # an escaped backslash, other escapes: unchanged
        (r"[]\d]", "[]0-9]"),
    ],
)
def test_shorthand_classes_are_ascii(pattern, ascii):
    from tritonllm.structured.spec import ascii_classes

    assert ascii_classes(pattern) == ascii


def test_a_digit_class_allows_ascii_digits_only(tiny_model_dir, tok):
    """`\\d` is [0-9] as in JSON Schema's regexes (llguidance alone allows every script's
    digits, and a random-weight model picks them: QA saw U+1FBF8 for a phone number)."""
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": r"^\d{4}$"}}}
    requests = [
        (
            f"{kind}{i}",
            tok.encode(f"number {i}"),
            SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=so),
        )
        for i in range(4)
        for kind, so in (
            ("regex", StructuredOutputs("regex", r"\d{3}-\d{4}")),
            ("json", StructuredOutputs.build("json", schema, "guided_json")),
        )
    ]
    for rid, (ids, reason, error) in _run(_engine(tiny_model_dir), requests).items():
        text = tok.decode(ids, skip_special_tokens=True)
        assert (reason, error) == ("stop", None), (rid, text)
        if rid.startswith("regex"):
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), (rid, text)
        else:
            assert re.fullmatch(r"[0-9]{4}", json.loads(text).get("p", "0000")), (rid, text)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_gpu_masks_with_cuda_graphs_and_overlap(tiny_model_dir, tok):
    constrained, plain = _schema_workload(tok)
    late = {rid for rid, _, _ in constrained[::3]}
    # float32 on the Triton backend: FlashInfer (bf16's default) has no kernels for the tiny
    # model's head_dim of 32, and float32 keeps the outputs those of the CPU tests' model.
    engine = _engine(
        tiny_model_dir,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        overlap_schedule=True,
        cuda_graph_max_bs=64,
    )
    assert engine.runner.graph_runner is not None
    outs = _run(engine, constrained + plain, late)
    _check_schema_outputs(tok, outs)
    assert engine.runner.graph_runner.num_replays > 0  # constrained decode rows replayed graphs


def test_a_compile_that_never_returns_fails_its_request_and_the_compiler_restarts(
    tiny_model_dir, tok, monkeypatch, caplog
):
    """A compile stuck past `grammar_compile_timeout_s` (here the first compile blocks until
    released): its request fails with a server error by code, the compiler's thread stack is
    logged, a request that waited for the same compile is compiled again on fresh threads and
    validates, and an unconstrained request beside them is untouched."""
    import logging
    import threading
    import time

    from tritonllm.structured.compiler import ConstraintCompiler

    release = threading.Event()
    compile_once = ConstraintCompiler._compile
    calls = []

    def stuck_first(self, params):
        calls.append(threading.get_ident())  # the stuck thread is alive: idents differ
        if len(calls) == 1:
            release.wait(30)  # "never" returns within the test
        return compile_once(self, params)

    monkeypatch.setattr(ConstraintCompiler, "_compile", stuck_first)
    engine = _engine(tiny_model_dir, grammar_compile_timeout_s=2.0)
    engine.constraints.compiler._load()  # the tokenizer: the compile after the restart is quick
    schema = SCHEMAS[0]
    constrained = SamplingParams(max_tokens=200, structured_outputs=_json(schema))
    plain = SamplingParams(max_tokens=4)
    ids: dict[str, list[int]] = {}
    outs: dict[str, tuple] = {}
    try:
        with caplog.at_level(logging.ERROR, logger="tritonllm.structured.admission"):
            engine.add_request("stuck", tok.encode("a"), constrained)
            engine.add_request("plain", tok.encode("say"), plain)
            start, late = time.monotonic(), False
            while engine.has_unfinished() or not late:
                if not late and time.monotonic() - start > 1.0:
                    # waits for the same (stuck, cached) compile, with a later deadline
                    engine.add_request("late", tok.encode("b"), constrained)
                    late = True
                for o in engine.step():
                    ids.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.finished:
                        outs[o.request_id] = (ids.get(o.request_id, []), o.finish_reason, o.error)
                time.sleep(0.005)
    finally:
        release.set()
        engine.shutdown()
    ids, reason, error = outs["stuck"]
    assert reason == "error" and ids == [], outs["stuck"]
    assert "not compiled within 2 s" in error
    ids, reason, error = outs["late"]
    assert reason == "stop" and error is None, outs["late"]
    jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), schema)
    assert len(outs["plain"][0]) == 4 and outs["plain"][1] == "length"
    # the stuck thread's stack was logged, and the late request compiled on a fresh thread
    assert "in stuck_first" in caplog.text and "thread tritonllm-grammar" in caplog.text
    assert len(calls) == 2 and calls[0] != calls[1]


def test_a_compiler_restart_drops_the_compiles_it_cancelled(tiny_model_dir, monkeypatch):
    """A compile queued behind a stuck one is cancelled by the restart; asking for the same
    constraint afterwards compiles it again instead of failing on the cancelled future."""
    import threading

    from tritonllm.structured.compiler import ConstraintCompiler

    release = threading.Event()
    compile_once = ConstraintCompiler._compile
    engine = _engine(tiny_model_dir)
    compiler = engine.constraints.compiler
    compiler._load()
    first = SamplingParams(structured_outputs=StructuredOutputs("regex", "a+"))
    queued = SamplingParams(structured_outputs=StructuredOutputs("regex", "b+"))

    def stuck_on_first(self, params):
        if params is first:
            release.wait(30)
        return compile_once(self, params)

    monkeypatch.setattr(ConstraintCompiler, "_compile", stuck_on_first)
    try:
        compiler.submit(first)
        cancelled = compiler.submit(queued)  # waits behind the stuck compile
        compiler.restart()
        assert cancelled.cancelled()
        again = compiler.submit(queued)
        assert again is not cancelled and again.result(timeout=30).grammar is not None
    finally:
        release.set()
        engine.shutdown()
