"""`LLMEngine`: requests in, tokens out, one scheduler step at a time.

Not thread-safe: one thread calls it (see `EngineThread` for serving). The data path of a step
is scheduler (which requests, which pages) → model runner (forward + sampling) → here (append
tokens, stop checks, release finished requests).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from tritonllm.config import EngineConfig
from tritonllm.contract.errors import ErrorCode, RequestError, short_repr
from tritonllm.engine.cache_manager import CacheManager
from tritonllm.engine.model_runner import ModelRunner
from tritonllm.engine.overlap import LaunchedStep, num_unknown_tail
from tritonllm.engine.prefix_cache import NoPrefixCache, PrefixCache
from tritonllm.engine.radix_cache import RadixCache
from tritonllm.engine.request import Request, RequestOutput, RequestStatus
from tritonllm.engine.request_limits import RequestLimits
from tritonllm.engine.scheduler import Scheduler
from tritonllm.engine.stats import EngineStats
from tritonllm.engine.stop_strings import StopStringChecker, check_stop_strings
from tritonllm.sampling_params import SamplingParams
from tritonllm.structured.admission import ConstraintAdmission
from tritonllm.structured.constraint import accept_tokens
from tritonllm.tokenization.detokenizer import Detokenizer


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (see ARCHITECTURE.md, "Engine API").

    `n > 1` in SamplingParams expands a request into n choices, each reported under the
    request's id with its `RequestOutput.index` (seed + i when seeded); they share the prompt's
    KV pages through the radix cache once the first has prefilled, `abort(id)` aborts all of
    them, and the output that ends the last one has `request_finished` set (the engine is the
    one place that counts a request's live choices).

    `runner`: the model runner to drive (default `ModelRunner(config)`); rank 0 of a
    tensor-parallel engine passes its own (`engine.engine_child`).
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        self.runner = ModelRunner(config) if runner is None else runner
        prefix_cache: PrefixCache = (
            RadixCache(config.page_size) if config.enable_prefix_cache else NoPrefixCache()
        )
        # One page-table row per running request, plus the one being admitted.
        self.cache = CacheManager(
            self.runner.num_pages, config.page_size, prefix_cache, config.max_running_requests + 1
        )
        self.scheduler = Scheduler(
            self.cache,
            config.max_running_requests,
            config.max_prefill_tokens,
            config.prefill_delay_steps,
            config.mixed_steps,
        )
        self.max_model_len = config.effective_max_model_len
        self.limits = RequestLimits.of(self)  # what check_request validates against
        self._requests: dict[tuple[str, int], Request] = {}  # by Request.key
        self._choices: dict[str, set[int]] = {}  # request id -> indices of its live choices
        self._pending: list[RequestOutput] = []
        self._arrival = itertools.count()
        self._gen_ids = itertools.count()
        self._num_steps = 0
        self._gpu_wait_s = 0.0
        self._overlap = config.use_overlap_schedule
        self._in_flight: LaunchedStep | None = None  # overlap: launched, not yet processed
        self._detok: Detokenizer | None = None
        self.constraints = ConstraintAdmission(config)  # structured outputs, token masks

    # ---- requests ------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate a request without touching engine state (safe from any thread); return its
        resolved output limit in tokens (see `RequestLimits.check`).

        Raises:
            RequestError: an empty prompt, prompt or stop token ids outside the vocabulary,
                prompt + max_tokens over max_model_len, or more KV pages than the pool has.
        """
        return self.limits.check(prompt_ids, params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request (its `params.n` choices); it joins the running batch at a later step.

        Raises:
            RequestError: see `check_request`; or `request_id` is already in use.
        """
        # max_tokens=None becomes the room left in the context (and the KV pool) for this prompt.
        max_tokens = self.limits.check(prompt_ids, params)
        if request_id in self._choices:
            raise RequestError(
                ErrorCode.INVALID_VALUE,
                "request_id",
                f"request id {short_repr(request_id)} is already in use",
            )
        self._choices[request_id] = set(range(params.n))
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model_config.eos_token_ids)
        choices = []
        for index in range(params.n):  # the choices share the prompt's pages once cached
            req = Request(request_id, list(prompt_ids), params, next(self._arrival), index)
            req.max_tokens, req.stop_ids = max_tokens, frozenset(stop)
            if params.seed is not None:
                req.seed = params.seed + index
                req.generator = self.runner.sampler.make_generator(req.seed)
            if params.stop:
                req.stop_checker = StopStringChecker(self._detokenizer(), params.stop)
            self._requests[req.key] = req
            choices.append(req)
        if params.has_token_constraint:  # queued once its constraint has compiled (`step`)
            self.constraints.defer(choices)
        else:
            for req in choices:
                self.scheduler.add(req)

    def _detokenizer(self) -> Detokenizer:
        # Loaded on first use: only requests with stop strings need text in the engine.
        if self._detok is None:
            from transformers import AutoTokenizer

            self._detok = Detokenizer(AutoTokenizer.from_pretrained(self.config.model))
        return self._detok

    def abort(self, request_id: str) -> bool:
        """Abort a request (or all n children of one); its KV pages are freed at once.

        The next `step()` reports it with finish_reason "abort". Returns False if unknown or
        already finished.
        """
        indices = sorted(self._choices.get(request_id, ()))
        for index in indices:
            self._finish(self._requests[(request_id, index)], "abort", release=True)
        return bool(indices)

    def abort_all(self, error: str) -> list[RequestOutput]:
        """Fail every request (after an engine error); returns their final outputs."""
        self._in_flight = None
        for req in list(self._requests.values()):
            self._finish(req, "error", release=True, error=error)
        outs, self._pending = self._pending, []
        return outs

    def _finish(
        self, req: Request, reason: str, release: bool, error: str | RequestError | None = None
    ) -> None:
        if release:
            self.scheduler.abort(req)
        self.constraints.live.discard(req)
        req.finish_reason = reason
        del self._requests[req.key]
        num_output = req.num_output_tokens - num_unknown_tail(req.token_ids)
        self._pending.append(self._output(req, [], num_output, error=error))

    # ---- stepping --------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step (a prefill, mixed or decode batch); return the outputs it made,
        plus final outputs of requests aborted since the last step.

        With overlap scheduling the step launches batch N+1 and then reports the tokens of
        batch N (see `engine.overlap`): outputs arrive one step late, otherwise identical.
        """
        outputs, self._pending = self._pending, []
        try:
            if self.constraints.num_compiling:
                self._admit_compiled(outputs)
            batch = self.scheduler.schedule()
            launched = None
            if batch is not None:
                hook = None
                if self._in_flight is not None and self.constraints.live:
                    hook = lambda reqs, start: self._sync_constrained(reqs, start, outputs)  # noqa: E731
                launched = self.runner.run(batch, hook)
                launched.commit()
                self._num_steps += 1
            previous, self._in_flight = self._in_flight, launched
            if not self._overlap:
                previous, self._in_flight = launched, None
            if previous is not None:
                self._process(previous, outputs)
            elif batch is None and self._requests and not outputs:
                if not self.constraints.num_compiling:
                    raise RuntimeError("scheduler stalled: requests pending but nothing runnable")
                self._admit_compiled(outputs, timeout_s=0.05)  # only compiles are left to wait for
        except BaseException:
            # Outputs made before the failure (aborts, finished requests) are no longer in
            # `_requests`: keep them so `abort_all` still delivers them and no request is lost.
            self._pending[:0] = outputs
            self._in_flight = None
            self.runner.discard_deferred()
            raise
        return outputs

    def _admit_compiled(self, outputs: list[RequestOutput], timeout_s: float = 0.0) -> None:
        """Queue the requests whose constraint has compiled; fail those whose compile failed."""
        for req, error in self.constraints.ready(timeout_s):
            if error is None:
                self.scheduler.add(req)
            else:
                # The request's own fault (RequestError: its code and field), else a server's.
                fault = error if isinstance(error, RequestError) else f"constraint compile: {error}"
                self._finish(req, "error", release=True, error=fault)
                outputs.append(self._pending.pop())

    def _sync_constrained(
        self,
        sample_reqs: list[Request],
        start_masks: Callable[[], None] | None,
        outputs: list[RequestOutput],
    ) -> None:
        """Overlap scheduling: process the step in flight now, before the masks of the step
        being launched are filled, when one of its rows needs it (`ConstraintAdmission`);
        a deferred fill (``start_masks``) starts as soon as the constraints took its tokens."""
        if self._in_flight is not None and self.constraints.needs_sync(sample_reqs):
            step, self._in_flight = self._in_flight, None
            self._process(step, outputs, start_masks)

    def _process(
        self,
        step: LaunchedStep,
        outputs: list[RequestOutput],
        after_accept: Callable[[], None] | None = None,
    ) -> None:
        """Fill in the sampled tokens of a finished step; stop checks; append to `outputs`.
        ``after_accept`` runs once the constraints took the step's tokens, before the stop
        checks (the next step's mask fill starts there: `ModelRunner.run`)."""
        start = time.perf_counter()
        samples = step.result()
        self._gpu_wait_s += time.perf_counter() - start
        if samples is None:
            return
        live, prefilled = self._requests, len(step.sample_reqs) - step.batch.num_decode_rows
        tokens, logprobs, top_logprobs = samples.token_ids, samples.logprobs, samples.top_logprobs
        accepted = self._accept(step, tokens) if self.constraints.live else {}
        if after_accept is not None:
            after_accept()
        for j, (req, pos) in enumerate(zip(step.sample_reqs, step.token_pos, strict=True)):
            if live.get(req.key) is not req:
                continue  # finished (overlap: its extra token is discarded) or aborted
            req.token_ids[pos] = tokens[j]
            if j < prefilled:  # a prefill row that finished its prompt (they sample first)
                self.cache.cache_prefix(req)
            outputs.append(
                self._append_token(req, pos, logprobs[j], top_logprobs[j], accepted.get(j))
            )

    def _accept(self, step: LaunchedStep, tokens: list[int]) -> dict[int, bool]:
        """Feed the step's sampled ``tokens`` to its live constrained rows' constraints, all at
        once (`accept_tokens`: one llguidance batch call); row index → accepted."""
        live, rows = self._requests, []
        for j, req in enumerate(step.sample_reqs):
            if req.constraint is not None and req.max_tokens and live.get(req.key) is req:
                rows.append(j)
        if not rows:
            return {}
        constraints = [step.sample_reqs[j].constraint for j in rows]
        executor = self.runner.sampler.masks.executor
        ok = accept_tokens(constraints, [tokens[j] for j in rows], executor)  # type: ignore[arg-type]
        return dict(zip(rows, ok, strict=True))

    def _append_token(
        self,
        req: Request,
        pos: int,
        lp: float | None,
        top: dict[int, float] | None,
        accepted: bool | None = None,
    ) -> RequestOutput:
        """Stop checks for the token just filled in at `req.token_ids[pos]` (with its logprob
        and top logprobs when asked); finishes the request if it stops. Returns its output.
        ``accepted``: what the request's constraint said of the token when `_accept` fed it
        already (None: it is fed here)."""
        if req.max_tokens == 0:  # prefill only (it scored or echoes its prompt): no output id
            del req.token_ids[pos:]
            req.finish_reason = "length"
            self.scheduler.abort(req)
            del self._requests[req.key]
            return self._output(req, [], 0)
        token = req.token_ids[pos]
        p = req.params
        num_out = pos + 1 - req.num_prompt_tokens  # every id after `pos` is a placeholder
        reason = error = None
        constraint = req.constraint
        if constraint is not None and not (
            constraint.accept(token) if accepted is None else accepted
        ):
            reason, error = "error", self.constraints.rejected(req, token)
        elif token in req.stop_ids and num_out >= p.min_tokens:
            reason = "stop"
        elif constraint is not None and constraint.terminated:
            reason = "stop"  # the grammar's output is complete (it accepted a stop token)
        elif num_out >= req.max_tokens or pos + 1 >= self.max_model_len:
            reason = "length"
        lps = None if lp is None else [lp]
        tops = None if top is None else [top]
        released, trim = [token], 0
        if req.stop_checker is not None:
            released, trim, stopped, lps, tops = check_stop_strings(
                req, req.stop_checker, token, reason, lps, tops
            )
            if stopped:
                reason = "stop"
        if reason is not None:
            del req.token_ids[pos + 1 :]  # overlap: a token computed after the finish
            req.finish_reason = reason
            self.scheduler.abort(req)  # running (pages released) or preempted (dequeued)
            self.constraints.live.discard(req)
            del self._requests[req.key]
        return self._output(req, released, num_out, lps, tops, trim, error)

    def _output(
        self,
        req: Request,
        tokens: list[int],
        num_output: int,
        lp: list[float] | None = None,
        top: list[dict[int, float]] | None = None,
        trim: int = 0,
        error: str | RequestError | None = None,
    ) -> RequestOutput:
        """`req`'s output releasing `tokens`; `num_output`: its known output ids (sampled and
        filled in), of which those the stop-string checker holds do not count (yet).
        A `RequestError` as `error` is the request's own fault: its code and parameter go
        with the message."""
        fault = error if isinstance(error, RequestError) else None
        message = error.message if isinstance(error, RequestError) else error
        finished = req.finish_reason is not None
        request_finished = finished and self._choice_finished(req)
        if req.stop_checker is not None:
            num_output -= req.stop_checker.num_held
        # Positional (once per request per step: keyword arguments would double its cost).
        out = RequestOutput(
            req.request_id,
            tokens,
            finished,
            req.finish_reason,
            req.num_prompt_tokens,
            num_output,
            req.cached_tokens,
            lp,
            top,
            message,
            trim,
            req.index,
            request_finished,
        )
        if fault is not None:
            out.error_code, out.error_param = fault.code.value, fault.param
        return req.add_details(out)

    def _choice_finished(self, req: Request) -> bool:
        """Count `req`'s choice as finished; True when it was its request's last."""
        live = self._choices[req.request_id]
        live.discard(req.index)
        if live:
            return False
        del self._choices[req.request_id]
        return True

    def shutdown(self) -> None:
        """Stop the threads this engine started for structured outputs (the constraint
        compiler's and the mask fill's; what they are running finishes first). Requests in
        flight get no further outputs; the engine is not used afterwards."""
        self.constraints.shutdown()
        self.runner.sampler.masks.shutdown()

    # ---- introspection and offline use ---------------------------------------------------------
    def stats(self) -> EngineStats:
        cache, sched = self.cache, self.scheduler
        total, free = cache.num_usable_pages, cache.num_free_pages
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            total_pages=total,
            free_pages=free,
            used_pages=total - free,
            cached_pages=cache.prefix_cache.num_pages,
            evictable_pages=cache.prefix_cache.num_evictable_pages,
            max_batch_size_seen=sched.max_decode_rows,
            num_steps=self._num_steps,
            num_preemptions=sched.num_preemptions,
            gpu_wait_s=self._gpu_wait_s,
            num_prefill_steps=sched.num_prefill_steps,
            prefill_tokens=sched.prefill_tokens,
            num_mixed_steps=sched.num_mixed_steps,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion as one continuous batch; return their generated ids.

        With `n > 1` the result holds n lists per prompt, prompt-major. Other requests already
        in the engine keep running alongside.
        """
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        order: list[tuple[str, int]] = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = f"generate-{next(self._gen_ids)}"
            self.add_request(rid, prompt, p)
            order.extend((rid, i) for i in range(p.n))
        results: dict[tuple[str, int], list[int]] = {key: [] for key in order}
        remaining = set(order)
        while remaining:
            for out in self.step():
                key = (out.request_id, out.index)
                if key in results:
                    results[key].extend(out.new_token_ids)
                    if out.finished:
                        remaining.discard(key)
        return [results[key] for key in order]


__all__ = ["EngineStats", "LLMEngine", "RequestStatus"]
