"""`ConstraintAdmission`: the engine's side of token constraints (structured outputs, allowed
token ids, bad words).

- A constrained request is not queued in the scheduler at once: its constraint compiles on the
  `ConstraintCompiler`'s thread, and then each choice gets its own `TokenConstraint` built on
  the compiler's build threads, while the request waits here (status COMPILING); between
  steps the engine admits the requests whose constraints are built (`ready`). A cached compile
  only builds the matchers, so a repeated schema usually waits no more than a step.
- Overlap scheduling: the mask of step N+1 needs the token of step N accepted by the matcher.
  The engine launches step N+1's forward, then, only when a row that samples in it has a
  constraint that depends on its history (`TokenConstraint.needs_history`) and its last token
  is still a placeholder, processes step N right there (`needs_sync`), before the mask is
  filled and step N+1 samples. The GPU runs N+1's forward meanwhile; batches without such rows
  keep the full overlap (step N is processed after N+1 launched, as before).
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
import time
import traceback
from concurrent.futures import Future

from tritonllm.config import EngineConfig
from tritonllm.contract.errors import ErrorCode, RequestError
from tritonllm.engine.request import Request, RequestStatus
from tritonllm.structured.compiler import ConstraintCompiler
from tritonllm.structured.constraint import TokenConstraint
from tritonllm.structured.spec import short_reason

logger = logging.getLogger(__name__)

# The compiler's threads, by name prefix (`ConstraintCompiler`): whose stacks a timeout logs.
_COMPILER_THREADS = ("tritonllm-grammar", "tritonllm-matchers")


class ConstraintAdmission:
    """Compiling requests and the set of live constrained requests of one engine.

    Args:
        config: the engine's config (the model directory whose tokenizer the grammars use).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._compiler: ConstraintCompiler | None = None
        # (its matchers' future, the request's choices, the monotonic deadline of its wait)
        self._compiling: list[tuple[Future[list[TokenConstraint]], list[Request], float]] = []
        self.live: set[Request] = set()  # admitted, not finished

    @property
    def compiler(self) -> ConstraintCompiler:
        """The compiler (created on first use: a service without constraints never loads it)."""
        if self._compiler is None:
            mc = self.config.model_config
            self._compiler = ConstraintCompiler(
                self.config.model,
                mc.vocab_size,
                mc.eos_token_ids,
                use_xgrammar=self.config.grammar_backend == "auto",
            )
        return self._compiler

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def defer(self, choices: list[Request]) -> None:
        """Start compiling the constraint of a request's ``choices`` (one params for all) and
        building one `TokenConstraint` per choice."""
        future = self.compiler.instantiate(choices[0].params, len(choices))
        for req in choices:
            req.status = RequestStatus.COMPILING
        deadline = time.monotonic() + self.config.grammar_compile_timeout_s
        self._compiling.append((future, choices, deadline))

    def ready(self, timeout_s: float = 0.0) -> list[tuple[Request, BaseException | None]]:
        """The requests whose compile is done, in arrival order, each with its compile error
        (None: it got its `TokenConstraint`, status WAITING, to be queued by the caller).
        Requests aborted meanwhile are dropped. With ``timeout_s`` it first waits up to that
        long for one compile to finish (when none is done).

        A request still compiling past `EngineConfig.grammar_compile_timeout_s` comes back
        with a `TimeoutError`; the compiler's thread stacks are logged and it restarts on fresh
        threads (`ConstraintCompiler.restart`)."""
        if not self._compiling:
            return []
        if timeout_s > 0 and not any(f.done() for f, _, _ in self._compiling):
            futures = [f for f, _, _ in self._compiling]
            concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        done: list[tuple[Request, BaseException | None]] = []
        pending = []
        expired = False
        for future, choices, deadline in self._compiling:
            error: BaseException | None
            if future.done():
                error = future.exception()
            elif now < deadline:
                pending.append((future, choices, deadline))
                continue
            else:
                expired = True
                limit = self.config.grammar_compile_timeout_s
                error = TimeoutError(f"not compiled within {limit:g} s")
            constraints = [None] * len(choices) if error is not None else future.result()
            for req, constraint in zip(choices, constraints, strict=True):
                if req.status != RequestStatus.COMPILING:
                    continue  # aborted while compiling
                if error is None:
                    req.constraint = constraint
                    req.status = RequestStatus.WAITING
                    self.live.add(req)
                done.append((req, error))
        self._compiling = pending
        if expired:
            self._restart_compiler()
        return done

    def _restart_compiler(self) -> None:
        """Log where the compiler's threads are, then restart it (its waiting requests go on
        with fresh threads, their own wait unchanged)."""
        frames = sys._current_frames()
        stacks = [
            f"thread {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
            for t in threading.enumerate()
            if t.name.startswith(_COMPILER_THREADS) and t.ident in frames
        ]
        logger.error(
            "a constraint compile passed %g s; restarting the compiler on fresh threads. "
            "Its threads:\n%s",
            self.config.grammar_compile_timeout_s,
            "\n".join(stacks) or "(none running)",
        )
        assert self._compiler is not None
        self._compiler.restart()
        # Requests still waiting had their compile cancelled or abandoned with the old threads.
        self._compiling = [
            (self._compiler.instantiate(choices[0].params, len(choices)), choices, deadline)
            for _, choices, deadline in self._compiling
        ]

    def rejected(self, req: Request, token: int) -> str | RequestError:
        """A constraint of ``req`` refused its sampled ``token``: the error. A matcher in error
        is the request's fault (its constraint is beyond llguidance's limits while generating:
        ``invalid_value``; the matcher and its lexer are the choice's own, so no other request
        is affected); so is a constraint `blocked` by its allowed ids or bad words (they left no
        token to sample: named as the field); otherwise the mask let through what the matcher
        refuses, an engine bug (a message)."""
        constraint = req.constraint
        detail = None if constraint is None else constraint.error()
        if detail is not None:
            spec = req.params.structured_outputs
            # The client's field, as a validation error names it (StructuredOutputs.param).
            param = "structured_outputs" if spec is None else spec.param
            return RequestError(
                ErrorCode.INVALID_VALUE,
                param,
                f"{param} failed while generating: {short_reason(detail)}",
            )
        if constraint is not None and constraint.blocked:
            # The allowed ids or bad words left nothing the grammar (not in error) allows.
            compiled = constraint.compiled
            param = "allowed_token_ids" if compiled.allowed is not None else "bad_words"
            return RequestError(
                ErrorCode.INVALID_VALUE,
                param,
                f"{param} leaves no token to sample"
                + (
                    ""
                    if compiled.grammar is None
                    else " that the request's output constraint allows"
                ),
            )
        return f"token {token} violates the request's constraint"

    def needs_sync(self, sample_reqs: list[Request]) -> bool:
        """Whether a row of this step samples under a history-dependent constraint while its
        last token is still on its way to the host (see the module docstring)."""
        return any(
            r.constraint is not None and r.constraint.needs_history and r.token_ids[-1] < 0
            for r in sample_reqs
        )

    def shutdown(self) -> None:
        """Stop the compiler's threads (what they are running finishes first)."""
        if self._compiler is not None:
            self._compiler.shutdown()


__all__ = ["ConstraintAdmission"]
