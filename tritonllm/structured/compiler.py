"""`ConstraintCompiler`: compiles requests' token constraints off the engine's step loop.

A grammar compile (xgrammar's `GrammarCompiler`: the grammar's token-mask cache over the whole
vocabulary) takes tens to hundreds of milliseconds, and the first one also loads the tokenizer
and builds xgrammar's `TokenizerInfo` (seconds for a 150k vocabulary), so it never runs on the
engine thread: `submit` hands it to one worker thread and returns a `Future`; the engine keeps
the request out of the scheduler until the future is done (`LLMEngine`'s compiling requests).
Results are cached by what they were compiled from (the `StructuredOutputs` spec, the allowed
token ids, the bad words), most recently used kept, so a repeated schema is ready at once, as
vLLM's and SGLang's grammar caches do.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tritonllm.sampling_params import SamplingParams
from tritonllm.structured.constraint import CompiledConstraint, ids_bitmask

CACHE_ENTRIES = 512  # compiled constraints kept (a compiled JSON grammar is ~100 KB-1 MB)

ConstraintKey = tuple[Any, tuple[int, ...] | None, tuple[str, ...]]


def constraint_key(params: SamplingParams) -> ConstraintKey | None:
    """What a request's constraint is compiled from, or None when it has none."""
    if not params.has_token_constraint:
        return None
    return (params.structured_outputs, params.allowed_token_ids, params.bad_words)


class ConstraintCompiler:
    """Compiles and caches `CompiledConstraint`s on a worker thread.

    Args:
        model_dir: the checkpoint directory whose tokenizer defines the token strings.
        vocab_size: the model's vocabulary (logits width; may exceed the tokenizer's).
        stop_token_ids: the ids that end a generation (the model's EOS ids): the grammar allows
            them once its output is complete.
        max_threads: xgrammar's compile threads (default: up to 8, at most the CPU count).
    """

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_threads: int | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_threads = max_threads or max(1, min(8, os.cpu_count() or 1))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tritonllm-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[ConstraintKey, Future[CompiledConstraint]] = OrderedDict()
        self._tokenizer: Any = None
        self._compiler: Any = None

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

    def shutdown(self) -> None:
        """Stop the worker thread (compiles in progress finish first)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- worker thread ------------------------------------------------------------------------
    def _load(self) -> None:
        if self._compiler is not None:
            return
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)

    def _compile(self, params: SamplingParams) -> CompiledConstraint:
        self._load()
        spec = params.structured_outputs
        grammar = None if spec is None else self._compiler.compile_grammar(spec.grammar())
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = ids_bitmask(params.allowed_token_ids, self.vocab_size)
        banned, sequences = self._bad_words(params.bad_words)
        return CompiledConstraint(grammar, allowed, banned, sequences)

    def _bad_words(self, words: tuple[str, ...]) -> tuple[Any, tuple]:
        """Token sequences of the bad words: each word as given and with one leading space (a
        word inside text usually carries its space), deduplicated; single tokens banned always,
        longer ones when their prefix was just generated (vLLM's rule)."""
        import numpy as np

        banned: set[int] = set()
        sequences: set[tuple[tuple[int, ...], int]] = set()
        for word in words:
            for text in {word, " " + word.lstrip()}:
                ids = self._tokenizer.encode(text, add_special_tokens=False)
                if not ids:
                    continue
                if len(ids) == 1:
                    banned.add(ids[0])
                else:
                    sequences.add((tuple(ids[:-1]), ids[-1]))
        banned_ids = np.asarray(sorted(banned), dtype=np.int64) if banned else None
        return banned_ids, tuple(sorted(sequences))


__all__ = ["CACHE_ENTRIES", "ConstraintCompiler", "constraint_key"]
