"""Host bitmask fill of a constrained batch: the grammar library, how the rows' matchers are
made, by executor threads.

`python -m benchmarks.mask_fill --model DIR [--rows 32] [--steps 40] [--threads 1,4,12]
[--schema maxlength|plain] [--ways copy,own,xgrammar] [--prewarm 0]`

For each way of making the rows' matchers and each executor thread count, ``--rows`` matchers
of `benchmarks.structured_decode`'s schema walk ``--steps`` steps together: each step fills all
their bitmasks in one batch call (timed: llguidance's `fill_next_token_bitmask_par`, xgrammar's
`BatchGrammarMatcher.batch_fill_next_token_bitmask`) and then every row consumes a token drawn
uniformly from its mask (seeded, so every configuration of one library walks the same way). The
ways:

- ``copy``: llguidance, `LLMatcher.deep_copy` of one prototype (the copies share its lexer
  behind one mutex, llguidance 1.9);
- ``own``: llguidance, one `LLMatcher` built per row, as `structured.constraint.
  CompiledConstraint.new` does for constraints outside xgrammar's subset;
- ``xgrammar``: one xgrammar `GrammarMatcher` per row, compiled as `structured.compiler` does
  for a schema of its subset (both schemas here are).

The two libraries allow slightly different token sets (llguidance refuses some non-canonical
tokenizations at forced positions), so their walks differ after a few tokens; both stay inside
the schema.

With ``--prewarm N`` an earlier batch of the same way's matchers first walks N steps (another
seed), as earlier requests of a schema do in a server: ``copy`` then starts from a warm lexer,
``own`` from new ones. The table gives the mean fill per step after 4
warm-up steps, and its ratio to the same way's one-thread time. No model weights are read:
``DIR`` only supplies the tokenizer. Prints the table; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.structured_decode import SCHEMAS
from tritonllm.cli_types import positive_int
from tritonllm.sampling_params import SamplingParams
from tritonllm.structured.constraint import bitmask_words
from tritonllm.structured.spec import StructuredOutputs

WARMUP_STEPS = 4
WAYS = ("copy", "own", "xgrammar")


def make_matchers(tokenizer: object, grammar: Any, way: str, rows: int) -> Any:
    """A function that returns ``rows`` new matchers made the ``way`` of the module docstring
    (the prototype, if any, lives as long as the function): ``tokenizer`` and ``grammar`` are
    llguidance's `LLTokenizer` and grammar text, or for ``xgrammar`` None and its
    `CompiledGrammar`.

    Raises:
        ValueError: an unknown ``way``.
    """
    import llguidance

    if way == "xgrammar":
        import xgrammar

        return lambda: [xgrammar.GrammarMatcher(grammar) for _ in range(rows)]
    if way == "copy":
        proto = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return lambda: [proto.deep_copy() for _ in range(rows)]
    if way == "own":
        return lambda: [llguidance.LLMatcher(tokenizer, grammar, log_level=0) for _ in range(rows)]
    raise ValueError(f"unknown way {way!r}")


def walk(executor: Any, matchers: list[Any], vocab: int, steps: int, seed: int) -> list[float]:
    """Seconds of each of ``steps`` batched fills of ``matchers``' masks, each followed by every
    row consuming a token drawn from its mask. ``executor``: llguidance's `LLExecutor` of
    `LLMatcher`s, or xgrammar's `BatchGrammarMatcher` of its `GrammarMatcher`s.

    Raises:
        AssertionError: a row's matcher refused a token its own mask allowed.
    """
    import llguidance
    import llguidance.numpy
    import torch

    masks = torch.zeros((len(matchers), bitmask_words(vocab)), dtype=torch.int32)
    if isinstance(executor, llguidance.LLExecutor):
        batch = [(matcher, i) for i, matcher in enumerate(matchers)]
        array = masks.numpy()

        def fill() -> None:
            llguidance.numpy.fill_next_token_bitmask_par(executor, batch, array)

        def consume(matcher: Any, token: int) -> bool:
            return bool(matcher.consume_token(token))
    else:

        def fill() -> None:
            executor.batch_fill_next_token_bitmask(matchers, masks)

        def consume(matcher: Any, token: int) -> bool:
            return bool(matcher.accept_token(token))

    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, matcher in enumerate(matchers):
            allowed = np.flatnonzero(bits[i])
            assert consume(matcher, int(allowed[rng.randrange(len(allowed))]))
    return times


def fill_ms(
    tokenizer: object,
    grammar: Any,
    vocab: int,
    way: str,
    rows: int,
    steps: int,
    threads: int,
    prewarm: int = 0,
) -> float:
    """Mean milliseconds of one batched fill of ``rows`` masks over ``steps`` steps (after
    `WARMUP_STEPS`), matchers made the ``way`` of the module docstring, after a ``prewarm``
    walk of an earlier batch.

    Raises:
        ValueError: an unknown ``way``; AssertionError: a row's matcher refused a token its own
            mask allowed.
    """
    import llguidance

    make = make_matchers(tokenizer, grammar, way, rows)
    if way == "xgrammar":
        import xgrammar

        executor = xgrammar.BatchGrammarMatcher(threads)
    else:
        executor = llguidance.LLExecutor(threads)
    if prewarm:
        walk(executor, make(), vocab, prewarm, seed=1)
    times = walk(executor, make(), vocab, WARMUP_STEPS + steps, seed=0)
    return float(np.mean(times[WARMUP_STEPS:])) * 1e3


def main(argv: list[str] | None = None) -> str:
    """CLI entry point; returns the printed table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory (its tokenizer)")
    p.add_argument("--rows", type=positive_int, default=32)
    p.add_argument("--steps", type=positive_int, default=40)
    p.add_argument("--threads", default="1,4,12", help="executor thread counts, comma-separated")
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="maxlength")
    p.add_argument("--ways", default=",".join(WAYS), help="of: " + ", ".join(WAYS))
    p.add_argument("--prewarm", type=int, default=0, help="steps of an earlier batch first")
    args = p.parse_args(argv)
    ways = args.ways.split(",")
    if any(way not in WAYS for way in ways):
        p.error(f"--ways: each of {', '.join(WAYS)}")
    from tritonllm.model_config import ModelConfig
    from tritonllm.structured.compiler import ConstraintCompiler

    mc = ModelConfig.from_pretrained(args.model)
    vocab = mc.vocab_size
    # As the engine compiles it: llguidance's grammar and tokenizer, and xgrammar's grammar.
    compiler = ConstraintCompiler(args.model, vocab, mc.eos_token_ids)
    spec = StructuredOutputs("json", json.dumps(SCHEMAS[args.schema]))
    compiled = compiler.submit(SamplingParams(structured_outputs=spec)).result()
    compiler.shutdown()
    if "xgrammar" in ways and compiled.xgrammar is None:
        p.error(f"--ways xgrammar: the {args.schema} schema is outside xgrammar's subset")
    rows = []
    for way in ways:
        single = None
        for threads in [int(t) for t in args.threads.split(",")]:
            tokenizer, grammar = (
                (None, compiled.xgrammar)
                if way == "xgrammar"
                else (compiled.tokenizer, compiled.grammar)
            )
            ms = fill_ms(
                tokenizer, grammar, vocab, way, args.rows, args.steps, threads, args.prewarm
            )
            single = ms if single is None and threads == 1 else single
            ratio = "" if single is None else f"{ms / single:.2f}"
            rows.append([way, str(threads), f"{ms:.2f}", ratio])
            common.log(f"{way} threads={threads}: {ms:.2f} ms per fill of {args.rows} rows")
    table = common.markdown_table(
        ["matchers", "executor threads", f"fill of {args.rows} rows (ms)", "vs 1 thread"], rows
    )
    print(table)
    return table


if __name__ == "__main__":
    main()
