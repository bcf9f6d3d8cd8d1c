"""Host bitmask fill of llguidance: copies of one prototype matcher vs one matcher per row.

`python -m benchmarks.mask_fill --model DIR [--rows 32] [--steps 40] [--threads 1,4,12]
[--schema maxlength|plain]`

For each way of making the rows' matchers and each executor thread count, ``--rows`` matchers
of `benchmarks.structured_decode`'s schema walk ``--steps`` steps together: each step fills all
their bitmasks in one `fill_next_token_bitmask_par` call (timed) and then every row consumes a
token drawn uniformly from its mask (seeded, so every configuration walks the same way). The
ways: ``copy`` (`LLMatcher.deep_copy` of one prototype: the copies share its lexer behind one
mutex, llguidance 1.9) and ``own`` (one `LLMatcher` built per row, as
`structured.constraint.CompiledConstraint.new` does). The table gives the mean fill per step
after 4 warm-up steps, and its ratio to the same way's one-thread time. No model weights are
read: ``DIR`` only supplies the tokenizer. Prints the table; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from benchmarks import common
from benchmarks.structured_decode import SCHEMAS
from tritonllm.structured.constraint import bitmask_words
from tritonllm.structured.spec import StructuredOutputs

WARMUP_STEPS = 4


def fill_ms(
    tokenizer: object,
    grammar: str,
    vocab: int,
    way: str,
    rows: int,
    steps: int,
    threads: int,
) -> float:
    """Mean milliseconds of one batched fill of ``rows`` masks over ``steps`` steps (after
    `WARMUP_STEPS`), matchers made the ``way`` ``"copy"`` or ``"own"`` (module docstring).

    Raises:
        ValueError: an unknown ``way``; AssertionError: a row's matcher refused a token its own
            mask allowed.
    """
    import llguidance
    import llguidance.numpy

    if way not in ("copy", "own"):
        raise ValueError(f"unknown way {way!r}")
    proto = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    matchers = [
        proto.deep_copy()
        if way == "copy"
        else llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        for _ in range(rows)
    ]
    executor = llguidance.LLExecutor(threads)
    masks = np.zeros((rows, bitmask_words(vocab)), dtype=np.int32)
    rng = random.Random(0)
    times = []
    for _ in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], masks
        )
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, matcher in enumerate(matchers):
            allowed = np.flatnonzero(bits[i])
            assert matcher.consume_token(int(allowed[rng.randrange(len(allowed))]))
    return float(np.mean(times[WARMUP_STEPS:])) * 1e3


def main(argv: list[str] | None = None) -> str:
    """CLI entry point; returns the printed table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model directory (its tokenizer)")
    p.add_argument("--rows", type=common.positive_int, default=32)
    p.add_argument("--steps", type=common.positive_int, default=40)
    p.add_argument("--threads", default="1,4,12", help="executor thread counts, comma-separated")
    p.add_argument("--schema", choices=sorted(SCHEMAS), default="maxlength")
    args = p.parse_args(argv)
    import llguidance.hf
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(args.model), vocab)
    grammar = StructuredOutputs("json", json.dumps(SCHEMAS[args.schema])).grammar()
    rows = []
    for way in ("copy", "own"):
        single = None
        for threads in [int(t) for t in args.threads.split(",")]:
            ms = fill_ms(tokenizer, grammar, vocab, way, args.rows, args.steps, threads)
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
