"""`ConstraintCompiler`: compiles requests' token constraints off the engine's step loop.

A compile builds the llguidance grammar (`StructuredOutputs.grammar`) and validates it against
the model's tokenizer; each choice of a request then gets its own `LLMatcher` built from it
(`CompiledConstraint.new`, `instantiate`). That is about a millisecond for a common schema (more
for large grammars), but the first compile also loads the tokenizer and builds llguidance's
`LLTokenizer` (seconds for a 150k vocabulary), so neither runs on the engine thread: `submit`
hands the compile to one worker thread and `instantiate` the matcher builds to `BUILD_THREADS`
more (llguidance builds grammars outside the GIL); both return a `Future`, and the engine keeps
the request out of the scheduler until it is done (`ConstraintAdmission`'s compiling requests).
Compiles are cached by what they were compiled from (the `StructuredOutputs` spec, the allowed
token ids, the bad words), most recently used kept, so a repeated schema only builds its
matchers, as vLLM's and SGLang's grammar caches do.

A JSON schema of xgrammar's subset (`StructuredOutputs.xgrammar_schema`) is compiled by xgrammar
too, after llguidance validated it: its matchers are xgrammar's (`XGrammarMatcher`), whose masks
of a bounded string cost far less than llguidance's (BENCHMARKS.md, "Bounded strings with
xgrammar"). xgrammar's tokenizer info and compiler are built on the first such compile, after
llguidance's tokenizer, on the same worker thread. A schema xgrammar refuses keeps llguidance.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from tritonllm.contract.errors import ErrorCode, RequestError
from tritonllm.sampling_params import SamplingParams
from tritonllm.structured.constraint import CompiledConstraint, TokenConstraint, ids_bitmask
from tritonllm.structured.spec import StructuredOutputs, short_reason
from tritonllm.structured.stacks import GrammarExecutor

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 512  # compiled constraints kept (grammar texts and token-id masks)
# Threads that build the choices' matchers (llguidance builds outside the GIL), so a burst of
# requests with one schema is admitted sooner than one build after another would allow.
BUILD_THREADS = 4

# xgrammar 0.2.9 writes a character of a string with minLength / maxLength as this class,
# which allows raw control characters (a tab: invalid JSON); the compiler puts JSON's unescaped
# string character in its place (any character but the controls, the quote and the backslash).
# Found by random walks of bounded-string schemas (tests/test_structured_engine.py). Such a
# string still holds no escapes, as xgrammar's own: adding JSON's escapes as an alternative
# made the structured-decode schema's fill slower than llguidance's (BENCHMARKS.md,
# "Bounded strings with xgrammar"); a client that needs them asks for backend "guidance".
XGRAMMAR_STRING_CHAR = r"[^\"\\\r\n]"
JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"

ConstraintKey = tuple[Any, tuple[int, ...] | None, tuple[str, ...]]


def constraint_key(params: SamplingParams) -> ConstraintKey | None:
    """What a request's constraint is compiled from, or None when it has none."""
    if not params.has_token_constraint:
        return None
    return (params.structured_outputs, params.allowed_token_ids, params.bad_words)


def _worker_pools() -> tuple[GrammarExecutor, GrammarExecutor]:
    """The compile thread and the `BUILD_THREADS` matcher-build threads of a compiler (their
    names are what `ConstraintAdmission` looks for when it logs a stuck compile's stacks),
    with stacks large enough for llguidance's recursion (`stacks`)."""
    return (
        GrammarExecutor(1, thread_name_prefix="tritonllm-grammar"),
        GrammarExecutor(BUILD_THREADS, thread_name_prefix="tritonllm-matchers"),
    )


class ConstraintCompiler:
    """Compiles and caches `CompiledConstraint`s on a worker thread.

    Args:
        model_dir: the checkpoint directory whose tokenizer defines the token strings.
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        stop_token_ids: the ids that end a generation (the model's EOS ids): the grammar allows
            them once its output is complete (llguidance's EOS tokens, xgrammar's stop tokens).
        use_xgrammar: whether JSON schemas of xgrammar's subset get xgrammar matchers
            (`EngineConfig.grammar_backend` ``"auto"``); False: llguidance serves every
            constraint.
    """

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        use_xgrammar: bool = True,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.use_xgrammar = use_xgrammar
        self._xgrammar_compiler: Any = None  # xgrammar's `GrammarCompiler` (first use)
        self._executor, self._builders = _worker_pools()
        self._lock = threading.Lock()
        self._cache: OrderedDict[ConstraintKey, Future[CompiledConstraint]] = OrderedDict()
        self._tokenizer: Any = None  # the Hugging Face tokenizer (bad words)
        self._ll_tokenizer: Any = None  # llguidance's `LLTokenizer` over it

    def submit(self, params: SamplingParams) -> Future[CompiledConstraint]:
        """The compiled constraint of ``params`` (which must have one), as a future: done at
        once when cached. A failed compile is not cached (the future holds its exception)."""
        key = constraint_key(params)
        if key is None:
            raise ValueError("submit() needs params with a token constraint")
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def instantiate(self, params: SamplingParams, n: int) -> Future[list[TokenConstraint]]:
        """``n`` fresh `TokenConstraint`s (one per choice of a request) of ``params``' constraint,
        as a future: the compile (`submit`, cached) and then ``n`` matcher builds, on the worker
        thread and then on one of `BUILD_THREADS` (a burst of requests is admitted that much
        sooner). Its exception is the compile's or the build's."""
        compiled = self.submit(params)
        spec = params.structured_outputs

        def build() -> list[TokenConstraint]:
            constraint = compiled.result()
            try:
                return [constraint.new() for _ in range(n)]
            except ValueError as exc:  # llguidance could not build this grammar's matcher
                raise _refused(spec, str(exc)) from None

        return self._builders.submit(build)

    def shutdown(self) -> None:
        """Stop the worker threads (compiles and builds in progress finish first)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._builders.shutdown(wait=False, cancel_futures=True)

    def restart(self) -> None:
        """Leave the worker threads to whatever they are stuck in and go on with fresh ones:
        queued compiles and builds are cancelled, unfinished compiles leave the cache, so the
        next `submit` compiles on a new thread (finished ones stay cached). A thread that never
        returns stays behind (Python cannot stop it)."""
        with self._lock:
            self.shutdown()
            self._executor, self._builders = _worker_pools()
            # Unfinished compiles, and queued ones the shutdown cancelled (a cancelled future
            # is done but has no exception to ask for), are compiled again when asked.
            for key in [k for k, f in self._cache.items() if not f.done() or f.cancelled()]:
                del self._cache[key]

    # ---- worker thread ------------------------------------------------------------------------
    def _load(self) -> None:
        if self._ll_tokenizer is not None:
            return
        import llguidance.hf
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # Every stop id is an EOS token of the matcher: allowed exactly when the output is
        # complete (`TokenConstraint.accept` ends the request on one).
        self._ll_tokenizer = llguidance.hf.from_tokenizer(
            self._tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids
        )

    def _compile(self, params: SamplingParams) -> CompiledConstraint:
        self._load()
        spec = params.structured_outputs
        grammar = xgrammar = None
        if spec is not None:
            grammar = self._validated(spec)
            schema = spec.xgrammar_schema() if self.use_xgrammar else None
            if schema is not None:
                xgrammar = self._xgrammar(schema)
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = ids_bitmask(params.allowed_token_ids, self.vocab_size)
        banned, sequences = self._bad_words(params.bad_words)
        stop_ids = frozenset(self.stop_token_ids)
        tokenizer = None if grammar is None else self._ll_tokenizer
        return CompiledConstraint(
            grammar, tokenizer, stop_ids, allowed, banned, sequences, xgrammar
        )

    def _xgrammar(self, schema: dict[str, Any]) -> Any:
        """xgrammar's `CompiledGrammar` of JSON ``schema`` (compact, as `JSON_OPTIONS`; strict
        mode, as `strict`), or None where xgrammar refuses it or cannot be imported (llguidance
        then serves it; without xgrammar, every later compile too)."""
        try:
            import xgrammar
        except ImportError as exc:  # a broken install: slower masks, not failed requests
            logger.warning("xgrammar cannot be imported, llguidance serves every schema: %s", exc)
            self.use_xgrammar = False
            return None
        if self._xgrammar_compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._xgrammar_compiler = xgrammar.GrammarCompiler(info)
        try:
            grammar = xgrammar.Grammar.from_json_schema(
                json.dumps(schema),
                any_whitespace=False,
                indent=None,
                separators=(", ", ": "),
                strict_mode=True,
            )
            # Its bounded-string characters, JSON's: see `XGRAMMAR_STRING_CHAR`.
            text = str(grammar).replace(XGRAMMAR_STRING_CHAR, JSON_STRING_CHAR)
            return self._xgrammar_compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as exc:
            logger.warning("xgrammar refused a schema of its subset, llguidance serves it: %s", exc)
            return None

    def _validated(self, spec: StructuredOutputs) -> str:
        """``spec``'s llguidance grammar, once llguidance accepted it with this tokenizer.

        Raises:
            RequestError: (``invalid_value``, the constraint's ``param``) llguidance refused
                the grammar with the tokenizer (beyond its limits: "fuel exhausted" say),
                though it took it without one where the request arrived.
        """
        import llguidance

        grammar = spec.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        if error:
            raise _refused(spec, error)
        return grammar

    def _bad_words(self, words: tuple[str, ...]) -> tuple[Any, tuple]:
        """Token sequences of the bad words: each word as given and with one leading space (a
        word inside text usually carries its space), deduplicated; single tokens banned always,
        longer ones when their prefix was just generated (vLLM's rule)."""
        import numpy as np

        banned: set[int] = set()
        sequences: set[tuple[tuple[int, ...], int]] = set()
        for word in words:
            for text in {word, " " + word.lstrip()}:
                try:
                    ids = self._tokenizer.encode(text, add_special_tokens=False)
                except (TypeError, ValueError) as exc:  # a lone surrogate: no UTF-8 text
                    raise RequestError(
                        ErrorCode.INVALID_VALUE,
                        "bad_words",
                        f"bad_words cannot be tokenized: {word!r}: {exc}",
                    ) from None
                if not ids:
                    continue
                if len(ids) == 1:
                    banned.add(ids[0])
                else:
                    sequences.add((tuple(ids[:-1]), ids[-1]))
        banned_ids = np.asarray(sorted(banned), dtype=np.int64) if banned else None
        return banned_ids, tuple(sorted(sequences))


def _refused(spec: StructuredOutputs | None, error: str) -> RequestError:
    """The request's error for a constraint llguidance refused while compiling it with the
    model's tokenizer or building its matcher: ``invalid_value`` naming the client's field."""
    param = "structured_outputs" if spec is None else spec.param
    return RequestError(
        ErrorCode.INVALID_VALUE, param, f"{param} cannot be compiled: {short_reason(error)}"
    )


__all__ = ["BUILD_THREADS", "CACHE_ENTRIES", "ConstraintCompiler", "constraint_key"]
