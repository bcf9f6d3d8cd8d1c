"""Turns a `ScheduledBatch` into model inputs, runs the forward pass and samples.

`run(batch)` only enqueues device work: the batch's metadata travels in two pinned,
non-blocking host-to-device copies (one int64, one int32 buffer; the tensors of
`AttentionMetadata` are views into them), decode batches of up to `cuda_graph_max_bs` sequences
replay a CUDA graph (`engine.cuda_graph`), prefill and mixed batches (a mixed batch's decode
rows are extend rows of one token) run eagerly, and the sampled ids stay on the device (see
`engine.overlap`). Nothing here reads a device value on the host.

Tensor parallelism (`tp`): every rank holds a `ModelRunner` over its shard of the model.
Rank 0's `run` sends the step's host arrays (`StepInputs`) to the other ranks before its
forward, samples from the all-gathered logits alone, and broadcasts the sampled ids, which
every rank keeps in its own future map; ranks 1..N-1 run `run_follower` on what they receive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tritonllm.attention import get_attention_backend
from tritonllm.attention.base import AttentionMetadata, AttentionOptions
from tritonllm.config import EngineConfig
from tritonllm.distributed import TensorParallelGroup
from tritonllm.engine.kv_cache import KVCache, derive_num_pages
from tritonllm.engine.overlap import FutureMap, LaunchedStep
from tritonllm.engine.prompt_logprobs import LaunchedScores, PromptRows
from tritonllm.engine.request import Request
from tritonllm.engine.sampler import Sampler
from tritonllm.engine.scheduler import ScheduledBatch
from tritonllm.layers.fused import LayerKernels
from tritonllm.models import load_model

if TYPE_CHECKING:
    from tritonllm.engine.process_messages import StepBroadcast
    from tritonllm.structured.masks import MaskFill

# `ModelRunner.run`'s hook: (the step's sampling requests, the start of its deferred mask fill
# or None).
BeforeSample = Callable[[list[Request], Callable[[], None] | None], None]


@dataclass
class StepInputs:
    """The host side of a forward: the two arrays `build_inputs` uploads, and their layout.

    Attributes:
        int64: `[3T + L]`: T token ids (future-map slots instead when `all_future`), their T
            positions, their T K/V slots, the L logits indices.
        int32: `[4B + 1 + B * W]`: seq_lens, extend_lens, prefix_lens (B each),
            cu_extend_lens (B + 1), the page table (B rows of W page ids).
        num_seqs, num_tokens: B and T.
        is_decode: a decode batch (one new token per sequence).
        all_future: every id is a placeholder (`int64[:T]` holds future-map slots).
        any_future: some ids are placeholders (`engine.overlap`).
    """

    int64: np.ndarray
    int32: np.ndarray
    num_seqs: int
    num_tokens: int
    is_decode: bool
    all_future: bool
    any_future: bool


@dataclass
class ForwardInputs:
    """A batch flattened for the model.

    input_ids: `[T]` int64 (placeholders already resolved on the device); positions: `[T]`
    int64; meta: the attention metadata; logits_indices: `[S + R]` int64 (last new token of
    each sampling request, then the R scored prompt positions); sample_reqs: those S requests,
    in order; host: the host arrays the device tensors were uploaded from; prompt_rows: the
    scored prompt positions (`engine/prompt_logprobs.py`), or None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_reqs: list[Request]
    host: StepInputs
    prompt_rows: PromptRows | None = None


class ModelRunner:
    """Owns the model, the KV cache, the attention backend, the sampler and the CUDA graphs.

    Construction sets the process-wide kernel switches (`kernels.pdl`, on CUDA), loads the
    weights (straight onto the device), sizes the KV pool (`derive_num_pages`: on CUDA it uses
    the memory left after the weights), then captures the decode graphs when
    `config.use_cuda_graph` and the backend supports them. Every other engine setting reaches
    the model, the backend and the sampler as a constructor argument.

    Args:
        config: the engine settings (`config.device`: this rank's device).
        tp: this rank's tensor-parallel group (None: size 1, no process group). The rank
            loads its shard; its KV cache and attention backend hold its heads only; the ranks
            agree on the smallest pool size.
        followers: rank 0 only: the links to ranks 1..N-1 that `run` sends each step to.

    Raises:
        ValueError: `tp` does not match `config.tensor_parallel_size` (a size above 1 needs
            its ranks' processes: `EngineProcess` starts them).
    """

    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallelGroup | None = None,
        followers: StepBroadcast | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.device = config.torch_device
        self.page_size = config.page_size
        if (1 if tp is None else tp.size) != config.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={config.tensor_parallel_size} runs one process per rank: "
                "use EngineProcess (an engine in this process holds the whole model)"
            )
        self.tp, self.followers = tp, followers
        if self.device.type == "cuda":
            _set_kernel_switches(config)
        self.model = load_model(
            config.model,
            self.model_config,
            self.device,
            config.torch_dtype,
            max_positions=config.effective_max_model_len,
            kernels=LayerKernels(fused=config.fused_layers, linear=config.linear_kernel),
            tp=tp,
        )
        # The shape this rank's KV cache and attention see: its heads only under tp.
        local = self.model_config
        if tp is None:
            self.num_pages = derive_num_pages(config)
        else:
            assert self.model.shard is not None  # built with tp
            local = self.model.shard.local_config(self.model_config)
            elem = torch.empty((), dtype=config.torch_dtype).element_size()
            page_bytes = local.kv_bytes_per_token * elem * config.page_size
            # Rank 0 schedules pages for all: every rank's pool has the smallest size.
            self.num_pages = tp.min_int(derive_num_pages(config, page_bytes))
        self.kv_cache = KVCache(
            local, self.num_pages, config.page_size, config.torch_dtype, self.device
        )
        backend_cls = get_attention_backend(config.resolved_attention_backend)
        options = AttentionOptions(tensor_core_decode_min_batch=config.tensor_core_decode_min_batch)
        self.backend = backend_cls(local, self.kv_cache, self.device, options)
        self.model.set_attention_backend(self.backend)
        self.sampler = Sampler(
            self.device,
            config.seed,
            fused=config.fused_layers,
            grammar_threads=config.resolved_grammar_threads,
        )
        self.future = FutureMap(config.max_running_requests, self.device)
        self.defer_grammar_sampling = config.defer_grammar_sampling and tp is None
        self._deferred: LaunchedStep | None = None  # its sampling not yet enqueued
        self._is_cuda = self.device.type == "cuda"
        # Set after each backend plan: the next plan waits for it, because FlashInfer stages
        # its plan in one pinned host buffer per wrapper (see `_plan_fence`).
        self._plan_done: torch.cuda.Event | None = None
        self.graph_runner = None
        if config.use_cuda_graph and self.backend.supports_cuda_graph:
            from tritonllm.engine.cuda_graph import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(
                self.model,
                self.backend,
                config.cuda_graph_batch_sizes,
                config.max_pages_per_seq,
                self.model_config.vocab_size,
                self.device,
                capture_error_mode="global" if tp is None else "thread_local",
            )

    # ---- inputs -----------------------------------------------------------------------------
    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """One host array → device, through pinned memory without blocking on CUDA."""
        host = torch.from_numpy(values)
        if not self._is_cuda:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def build_inputs(
        self, batch: ScheduledBatch, before_upload: Callable[[], None] | None = None
    ) -> ForwardInputs:
        """Flatten `batch` (before its requests' `num_computed` advance) into model inputs:
        `host_inputs`, then ``before_upload()`` (if given), then `device_inputs`."""
        host = self.host_inputs(batch)
        if before_upload is not None:
            before_upload()
        return self.device_inputs(*host)

    def host_inputs(
        self, batch: ScheduledBatch
    ) -> tuple[StepInputs, list[Request], PromptRows | None]:
        """The host half of `build_inputs`: `batch` flattened into the step's host arrays, its
        sampling requests and its scored prompt rows. Nothing is enqueued on the device.

        Per request only its counters and new token ids are read in Python; positions, slots
        and the page table are numpy over the whole batch (the page table is one gather from
        the cache manager's `HostPageTable`).
        """
        ps = self.page_size
        reqs, exts = batch.reqs, batch.extend_lens
        num_seqs = len(reqs)
        computed = np.fromiter((r.num_computed for r in reqs), np.int64, count=num_seqs)
        # The new tokens, flattened: token t is row rows[t]'s token at position positions[t];
        # row b's tokens start at cu[b].
        extend: int | np.ndarray  # new tokens per row: 1 in decode
        logits_idx: np.ndarray | list[int]
        prompt_rows = None
        if batch.is_decode:  # one token per row (the last sampled one); every row samples
            ids = [r.token_ids[r.num_computed] for r in reqs]
            rows = np.arange(num_seqs)
            positions, cu, extend = computed, np.arange(num_seqs + 1), 1
            sample_reqs, logits_idx = list(reqs), rows
        else:  # prefill rows, then the decode rows of a mixed batch (one token each, sampling)
            num_prefill = batch.num_prefill_rows
            ids = []
            for r, ext in zip(reqs[:num_prefill], exts[:num_prefill], strict=True):
                ids.extend(r.token_ids[r.num_computed : r.num_computed + ext])
            ids.extend([r.token_ids[r.num_computed] for r in reqs[num_prefill:]])
            extend = np.asarray(exts, dtype=np.int64)
            cu = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(extend, out=cu[1:])
            rows = np.repeat(np.arange(num_seqs), extend)
            positions = computed[rows] + np.arange(len(ids)) - cu[rows]
            sample_rows = [i for i in range(num_prefill) if batch.samples(i)]
            sample_rows += range(num_prefill, num_seqs)
            sample_reqs = [reqs[i] for i in sample_rows]
            # Each sampling row projects its last new token, then come the scored prompt
            # positions; with only unscored prompt chunks the forward still wants one row.
            logits_idx = cu[1:][sample_rows] - 1
            prompt_rows = PromptRows.plan(reqs, exts, cu)
            if prompt_rows is not None:
                logits_idx = np.concatenate([logits_idx, prompt_rows.token_index])
            elif not sample_rows:
                logits_idx = [0]
        num_tokens = len(ids)
        seq_lens = computed + extend
        width = -(-int(seq_lens.max()) // ps)
        int32 = np.empty(4 * num_seqs + 1 + num_seqs * width, dtype=np.int32)
        int32[:num_seqs] = seq_lens
        int32[num_seqs : 2 * num_seqs] = extend
        int32[2 * num_seqs : 3 * num_seqs] = computed
        int32[3 * num_seqs : 4 * num_seqs + 1] = cu
        table = int32[4 * num_seqs + 1 :].reshape(num_seqs, width)
        batch.page_table.gather(reqs, width, out=table)
        pages = table[rows, positions // ps].astype(np.int64)
        int64 = np.empty(3 * num_tokens + len(logits_idx), dtype=np.int64)
        int64[:num_tokens] = ids
        int64[num_tokens : 2 * num_tokens] = positions
        int64[2 * num_tokens : 3 * num_tokens] = pages * ps + positions % ps  # K/V slots
        int64[3 * num_tokens :] = logits_idx
        # Placeholders stand for ids of a step still on the device (see `engine.overlap`). When
        # every id is one, the first segment carries their future-map slots instead.
        all_future = max(ids) < 0
        if all_future:
            int64[:num_tokens] = -int64[:num_tokens] - 1
        any_future = all_future or min(ids) < 0
        host = StepInputs(
            int64, int32, num_seqs, num_tokens, batch.is_decode, all_future, any_future
        )
        return host, sample_reqs, prompt_rows

    def device_inputs(
        self,
        host: StepInputs,
        sample_reqs: list[Request],
        prompt_rows: PromptRows | None = None,
    ) -> ForwardInputs:
        """Upload `host` (two copies) and view it as the forward's inputs (`prompt_rows`: the
        scored prompt positions among its logits indices, rank 0's; followers score none)."""
        num_seqs, num_tokens = host.num_seqs, host.num_tokens
        d64, d32 = self._upload(host.int64), self._upload(host.int32)
        input_ids = d64[:num_tokens]
        if host.all_future:
            input_ids = self.future.lookup(input_ids)
        elif host.any_future:
            input_ids = self.future.resolve(input_ids)
        lens = host.int32[: 2 * num_seqs]
        meta = AttentionMetadata(
            num_seqs=num_seqs,
            is_decode=host.is_decode,
            seq_lens=d32[:num_seqs],
            extend_lens=d32[num_seqs : 2 * num_seqs],
            prefix_lens=d32[2 * num_seqs : 3 * num_seqs],
            cu_extend_lens=d32[3 * num_seqs : 4 * num_seqs + 1],
            page_table=d32[4 * num_seqs + 1 :].view(num_seqs, -1),
            out_cache_loc=d64[2 * num_tokens : 3 * num_tokens],
            seq_lens_cpu=lens[:num_seqs].tolist(),
            extend_lens_cpu=lens[num_seqs:].tolist(),
        )
        return ForwardInputs(
            input_ids,
            d64[num_tokens : 2 * num_tokens],
            meta,
            d64[3 * num_tokens :],
            sample_reqs,
            host,
            prompt_rows,
        )

    def ids_to_device(self, ids: list[int]) -> torch.Tensor:
        """A request's token ids → `[N]` int64 device tensor of real ids (for penalties)."""
        dev = self._upload(np.asarray(ids, dtype=np.int64))
        return self.future.resolve(dev) if ids and min(ids) < 0 else dev

    # ---- forward ----------------------------------------------------------------------------
    def _plan_fence(self) -> None:
        # FlashInfer's plan() writes a pinned host buffer and copies it to the device
        # asynchronously; the next plan must not overwrite that buffer before the copy ran.
        # Under overlap scheduling the previous plan's copy is right behind work the engine has
        # already waited for, so this wait is short.
        if self._plan_done is not None:
            self._plan_done.synchronize()

    def _planned(self) -> None:
        if self._is_cuda:
            if self._plan_done is None:
                self._plan_done = torch.cuda.Event()
            self._plan_done.record()

    def forward(self, fwd: ForwardInputs) -> torch.Tensor:
        """Logits `[S, vocab]` of the batch in the model's dtype (one row if nothing samples)."""
        meta = fwd.meta
        graphs = self.graph_runner
        self._plan_fence()
        if graphs is not None and graphs.can_run(meta):
            bs = graphs.prepare(fwd.input_ids, fwd.positions, meta)
            self._planned()
            return graphs.replay(bs, meta.num_seqs)
        self.backend.prepare(meta)
        self._planned()
        return self.model(fwd.input_ids, fwd.positions, meta, fwd.logits_indices)

    @torch.inference_mode()
    def run(
        self,
        batch: ScheduledBatch,
        before_sample: BeforeSample | None = None,
    ) -> LaunchedStep:
        """Enqueue the forward and sampling of `batch`; no host sync. The engine commits the
        returned step and later takes its samples with `LaunchedStep.result()`.
        `before_sample(sample_reqs, start_masks)` runs after the forward is enqueued and before
        the sampler fills token masks (overlap scheduling: the engine may process the step in
        flight there, see `structured.admission`). ``start_masks`` is None unless this step's
        sampling is deferred; then calling it (once its rows' constraints took their last
        tokens) starts the masks filling while the caller goes on, and it is called after
        `before_sample` returns in any case.

        Raises:
            SystemExit: tensor-parallel rank 0 only, when the step failed (a rank is gone, a
                collective failed, ...): the ranks would be out of step, so no caller may go
                on; the process ends and `EngineProcess` fails the engine.
        """
        if self.tp is None:
            return self._launch(batch, before_sample)
        try:
            return self._launch(batch, before_sample)
        except Exception as exc:
            raise SystemExit(f"tensor-parallel rank 0: step failed: {exc!r}") from exc

    def _launch(self, batch: ScheduledBatch, before_sample: BeforeSample | None) -> LaunchedStep:
        # A deferred sampling is enqueued before the uploads: its ids are this forward's inputs.
        fwd = self.build_inputs(batch, self.complete_deferred)
        if self.followers is not None:  # before the forward: its collectives need every rank
            self.followers.send(fwd.host, len(fwd.sample_reqs))
        logits = self.forward(fwd)
        scores = None
        if fwd.prompt_rows is not None:  # the rows after the sampling rows score the prompts
            num_sampled = len(fwd.sample_reqs)
            scores = fwd.prompt_rows.score(logits[num_sampled:])
            logits = logits[:num_sampled]
        if not fwd.sample_reqs:
            return LaunchedStep(batch, [], scores=scores)
        if self.defer_grammar_sampling and _defers_sampling(fwd.sample_reqs):
            return self._deferred_sampling(batch, fwd.sample_reqs, logits, scores, before_sample)
        if before_sample is not None:
            before_sample(fwd.sample_reqs, None)
        samples = self.sampler.sample_device(logits, fwd.sample_reqs, self.ids_to_device)
        if self.tp is not None:  # the other ranks' future maps get the same ids
            self.tp.broadcast(samples.token_ids)
        slots = self.future.store(samples.token_ids)
        return LaunchedStep.from_samples(batch, fwd.sample_reqs, samples, slots, scores)

    def _deferred_sampling(
        self,
        batch: ScheduledBatch,
        reqs: list[Request],
        logits: torch.Tensor,
        scores: LaunchedScores | None,
        before_sample: BeforeSample | None,
    ) -> LaunchedStep:
        """The step with its sampling deferred (`engine.overlap`): the token masks start
        filling on the mask thread and the step returns at once, so the engine commits it and
        builds the next step's host inputs while llguidance works; `LaunchedStep.complete`
        (called before the next forward's uploads, or by `result`) then applies the masks and
        samples into the future-map slots reserved here. The device sees the same work in the
        same order as without the deferral, and the sampler's random streams advance alike.

        ``before_sample`` gets the fill's start: the engine processing the step in flight
        calls it as soon as the constraints took that step's tokens, so the fill also runs
        while the engine does the rest of that processing (stop checks, outputs)."""
        slots = self.future.reserve(len(reqs))
        step = LaunchedStep(batch, reqs, slots=slots, scores=scores)
        started: list[MaskFill | None] = []
        # Where each row's token goes, taken before the engine commits the step (which appends
        # the placeholders): it keys a seeded row's draws (`Sampler.sample_device`).
        positions = [len(r.token_ids) for r in reqs]

        def start_masks() -> None:
            if not started:
                started.append(self.sampler.start_masks(logits.shape[1], reqs))

        def finish() -> None:
            start_masks()
            samples = self.sampler.sample_device(
                logits, reqs, self.ids_to_device, started[0], positions
            )
            self.future.write(slots, samples.token_ids)
            step.copy_samples(samples)

        if before_sample is not None:
            before_sample(reqs, start_masks)
        start_masks()
        step.finish = finish
        self._deferred = step
        return step

    def complete_deferred(self) -> None:
        """Enqueue the sampling of the step launched last, if it was deferred."""
        step, self._deferred = self._deferred, None
        if step is not None:
            step.complete()

    def discard_deferred(self) -> None:
        """Forget a deferred sampling without running it (the engine dropped its step after a
        failure); its mask fill, if still running, finishes on its own."""
        self._deferred = None

    @torch.inference_mode()
    def run_follower(self, host: StepInputs, num_samples: int) -> None:
        """Ranks 1..N-1 of a tensor-parallel engine: run the forward rank 0 sent (`host`),
        then receive rank 0's `num_samples` sampled ids into this rank's future map (the same
        slots as rank 0's), so that later steps' placeholders resolve alike on every rank."""
        self.forward(self.device_inputs(host, []))
        if num_samples:
            assert self.tp is not None  # only tensor-parallel ranks follow
            ids = torch.empty(num_samples, dtype=torch.int64, device=self.device)
            self.future.store(self.tp.broadcast(ids))


def _defers_sampling(reqs: list[Request]) -> bool:
    """Whether a step's sampling waits for its token masks on the mask thread
    (`ModelRunner._deferred_sampling`): some row samples under a grammar and no row uses
    penalties (they read the token history, which gains this step's placeholders when the
    engine commits the step)."""
    grammar = False
    for r in reqs:
        if r.uses_penalties:
            return False
        c = r.constraint
        grammar = grammar or (c is not None and c.matcher is not None and not r.finish_reason)
    return grammar


def _set_kernel_switches(config: EngineConfig) -> None:
    """Set the process-wide switches of `kernels/` from `config` (CUDA only): programmatic
    dependent launch (`kernels.pdl`). Without Triton installed none of those kernels can run, so
    there is nothing to set."""
    try:
        from kernels import pdl
    except ImportError:
        return
    pdl.set_enabled(config.pdl)
