"""Per-request token masks: a grammar matcher, allowed token ids, bad words.

A `TokenConstraint` is one choice's mask state. Each step the sampler asks every constrained
row for its next-token bitmask (`structured.masks`: llguidance's (and xgrammar's) layout,
`[B, ceil(vocab / 32)]` int32, bit `t % 32` of word `t // 32` set = token t allowed) and
applies it to the logits; the engine then feeds the sampled token back (`accept`, or
`accept_tokens` for a step's rows at once). What each part allows:

- grammar (llguidance `LLMatcher`, or `XGrammarMatcher` for a JSON schema of xgrammar's
  subset): the tokens that keep the output a prefix of the grammar's language, and the stop
  tokens (the model's EOS ids, all of them the matcher's EOS tokens) exactly when the output is
  complete; a constraint is *terminated* once it accepted a stop token, which finishes the
  request ("stop");
- allowed token ids (vLLM's `allowed_token_ids`): only those ids;
- bad words (vLLM's `bad_words`, TensorRT-LLM's `bad_words`): a word's last token is banned
  when the output ends with the word's other tokens (single-token words: always), for the
  word's tokenization with and without a leading space (vLLM's rule).

The grammar and bad words of more than one token depend on the previous token, so under
overlap scheduling their rows make the engine wait for the step in flight (`needs_history`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def ids_bitmask(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """``[ceil(vocab_size / 32)]`` int32 bitmask row with exactly the bits of ``ids`` set."""
    row = np.zeros(bitmask_words(vocab_size), dtype=np.uint32)
    ids_arr = np.asarray(sorted(set(ids)), dtype=np.int64)
    np.bitwise_or.at(row, ids_arr >> 5, (np.uint32(1) << (ids_arr & 31).astype(np.uint32)))
    return row.view(np.int32)


def clear_bits(row: np.ndarray, ids: Sequence[int] | np.ndarray) -> None:
    """Clear the bits of ``ids`` in the int32 bitmask row ``row`` (in place)."""
    ids_arr = np.asarray(ids, dtype=np.int64)
    if ids_arr.size == 0:
        return
    words = row.view(np.uint32)
    np.bitwise_and.at(words, ids_arr >> 5, ~(np.uint32(1) << (ids_arr & 31).astype(np.uint32)))


@dataclass(frozen=True)
class CompiledConstraint:
    """The compiled, shareable part of a constraint (cached per spec; one per many requests).

    Attributes:
        grammar: the llguidance grammar (its JSON text), validated against ``tokenizer``, or
            None without a grammar.
        tokenizer: the llguidance ``LLTokenizer`` the grammar was validated with (None without
            a grammar).
        stop_ids: the stop tokens of the matcher (see the module docstring).
        allowed: ``[W]`` int32 bitmask row of the allowed token ids, or None (all allowed).
        banned: token ids always banned (single-token bad words).
        bad_sequences: multi-token bad words: (prefix ids, last id) pairs.
        xgrammar: xgrammar's `CompiledGrammar` of the same JSON schema as ``grammar``, or None:
            where given, the matchers are xgrammar's (`XGrammarMatcher`).
    """

    grammar: str | None = None
    tokenizer: Any = None
    stop_ids: frozenset[int] = frozenset()
    allowed: np.ndarray | None = None
    banned: np.ndarray | None = None
    bad_sequences: tuple[tuple[tuple[int, ...], int], ...] = ()
    xgrammar: Any = None

    def new(self) -> TokenConstraint:
        """A fresh constraint state for one choice of a request, with its own matcher: an
        `XGrammarMatcher` where ``xgrammar`` is given (microseconds), else an llguidance
        ``LLMatcher`` (a grammar build, outside the GIL; `ConstraintCompiler.instantiate` runs
        it off the engine thread). Not a copy of one prototype: ``LLMatcher.deep_copy`` shares the
        prototype's lexer behind one mutex, so the masks of all copies would be filled one at a
        time however many threads the executor has (llguidance 1.9's ``Matcher::clone``), and
        its DFA state cache, whose limit (250k states) would then count the states of every
        earlier request of the grammar: a request that succeeds alone failed after a dozen
        others (BENCHMARKS.md, "Structured decode: shared lexers tried").

        Raises:
            ValueError: llguidance could not build the matcher (its error message).
        """
        matcher: Any = None
        if self.xgrammar is not None:
            matcher = XGrammarMatcher(self.xgrammar)
        elif self.grammar is not None:
            import llguidance

            # log_level 0: a matcher's errors are read with get_error(), not printed.
            matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
        return TokenConstraint(self, matcher)


class XGrammarMatcher:
    """An xgrammar ``GrammarMatcher`` with the part of llguidance's ``LLMatcher`` interface that
    `TokenConstraint` uses. xgrammar has no error state: a refused token only returns False.
    Its masks are filled by `structured.masks` through xgrammar's ``BatchGrammarMatcher``.

    Args:
        compiled: xgrammar's ``CompiledGrammar`` (its tokenizer info holds the stop tokens).
    """

    __slots__ = ("matcher",)

    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    def consume_token(self, token: int) -> bool:
        """Advance past ``token``; False where the grammar refuses it (the state is kept)."""
        return bool(self.matcher.accept_token(token))

    def is_error(self) -> bool:
        """Always False: xgrammar has no error state (llguidance's interface)."""
        return False

    def get_error(self) -> str:
        """Always empty (see `is_error`)."""
        return ""


class TokenConstraint:
    """One choice's mask state (see the module docstring). Not thread-safe: the engine thread
    alone uses it.

    Args:
        compiled: the shared compiled part.
        matcher: the choice's own llguidance ``LLMatcher`` (None without a grammar).
    """

    __slots__ = (
        "compiled",
        "matcher",
        "needs_history",
        "restricts",
        "terminated",
        "rejected",
        "blocked",
        "_output",
    )

    def __init__(self, compiled: CompiledConstraint, matcher: Any) -> None:
        self.compiled = compiled
        self.matcher = matcher
        # Whether the grammar accepted a stop token (the output is complete).
        self.terminated = False
        # Whether it refused a sampled token (the request ends with an error).
        self.rejected = False
        # Whether `restrict` left no token in the row: the allowed ids and bad words exclude
        # every token the grammar allows (or every token), a conflict of the request's own.
        self.blocked = False
        self.needs_history = matcher is not None or bool(compiled.bad_sequences)
        # Whether `restrict` changes anything (allowed ids or bad words).
        self.restricts = (
            compiled.allowed is not None
            or compiled.banned is not None
            or bool(compiled.bad_sequences)
        )
        self._output: list[int] = []  # accepted ids (for multi-token bad words only)

    @property
    def ended(self) -> bool:
        """Whether it accepted a stop token or refused a token: its request finishes on this
        token, so no later mask is filled for it (the engine may start the next step's fill
        before it marks the request finished)."""
        return self.terminated or self.rejected

    def accept(self, token: int) -> bool:
        """Advance past the sampled ``token``; False when the grammar rejects it (the mask
        was not applied to this row: an engine bug)."""
        self._record(token)
        matcher = self.matcher
        if self.blocked:
            return self._settle(token, False)
        if matcher is None:
            return True
        return self._settle(token, not matcher.is_error() and matcher.consume_token(token))

    def _record(self, token: int) -> None:
        if self.compiled.bad_sequences:
            self._output.append(token)

    def _settle(self, token: int, consumed: bool) -> bool:
        """What `accept` returns once the matcher was fed ``token`` (``consumed``: what it
        said). A matcher in error (a lexer or parser limit of llguidance hit while generating)
        masks every token but EOS and accepts that: never an accepted token, so never a
        "stop"."""
        if not consumed or self.matcher.is_error():
            self.rejected = True
            return False
        # The mask allows a stop token only where the output is complete.
        self.terminated = token in self.compiled.stop_ids
        return True

    def error(self) -> str | None:
        """The grammar matcher's own error (llguidance's message), or None."""
        if self.matcher is None or not self.matcher.is_error():
            return None
        return str(self.matcher.get_error())

    def restrict(self, row: np.ndarray) -> None:
        """Apply allowed ids and bad words to ``row`` (an int32 bitmask row, in place), after
        the grammar filled it (or with every bit set when there is no grammar). Where they
        leave no token, the constraint is `blocked` and the row allows every token instead (the
        sampler never sees a row of only -inf; the token it samples is refused by `accept`)."""
        compiled = self.compiled
        if compiled.allowed is not None:
            np.bitwise_and(row, compiled.allowed, out=row)
        if compiled.banned is not None:
            clear_bits(row, compiled.banned)
        out = self._output
        for prefix, last in compiled.bad_sequences:
            n = len(prefix)
            if len(out) >= n and tuple(out[len(out) - n :]) == prefix:
                clear_bits(row, [last])
        if not row.any():
            self.blocked = True
            row[:] = -1


def restrict_rows(bitmask: np.ndarray, constraints: list[TokenConstraint]) -> None:
    """Apply the allowed ids and bad words of ``constraints`` (one per row) to the int32
    bitmask rows of ``bitmask`` (``[N, W]``, in place), once the grammar rows are filled."""
    for i, c in enumerate(constraints):
        if c.restricts:
            c.restrict(bitmask[i])


def accept_tokens(
    constraints: list[TokenConstraint], tokens: list[int], executor: Any = None
) -> list[bool]:
    """`TokenConstraint.accept` of ``tokens[i]`` by ``constraints[i]``, for every ``i``; with an
    llguidance ``LLExecutor``, the grammar matchers consume their tokens in one batch call
    (``consume_token_par``, on its threads, outside the GIL).

    Returns:
        per constraint, False where it rejected its token.
    """
    if executor is None or len(constraints) < 2:
        return [c.accept(t) for c, t in zip(constraints, tokens, strict=True)]
    ok = [True] * len(constraints)
    batch, where = [], []
    for i, (c, t) in enumerate(zip(constraints, tokens, strict=True)):
        c._record(t)
        if c.blocked:
            ok[i] = c._settle(t, False)
        elif c.matcher is None:
            continue
        elif c.matcher.is_error():
            ok[i] = c._settle(t, False)
        elif isinstance(c.matcher, XGrammarMatcher):  # microseconds: not worth a batch
            ok[i] = c._settle(t, c.matcher.consume_token(t))
        else:
            batch.append((c.matcher, t))
            where.append(i)
    if batch:
        for i, consumed in zip(where, executor.consume_token_par(batch), strict=True):
            ok[i] = constraints[i]._settle(tokens[i], consumed)
    return ok


__all__ = [
    "CompiledConstraint",
    "TokenConstraint",
    "XGrammarMatcher",
    "bitmask_words",
    "clear_bits",
    "accept_tokens",
    "ids_bitmask",
    "restrict_rows",
]
