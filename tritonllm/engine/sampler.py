"""Batched token sampling with per-request `SamplingParams`, on the logits' device.

Order of logit processing (vLLM's): logit bias (OpenAI's `logit_bias`, added to the logits) →
repetition penalty (prompt + output tokens; positive logits
divided, negative multiplied, as in CTRL, Keskar et al. 2019) → presence/frequency penalties
(output tokens, OpenAI's formula `logit -= frequency * count + presence * (count > 0)`) →
min_tokens masking of EOS/stop ids → temperature → logprobs are taken here → top-k → top-p
(nucleus, Holtzman et al. 2019, on the top-k renormalised distribution) → min-p (relative to
the most likely token) → sample.

Sampling draws `argmax(p / E)` with `E ~ Exp(1)` i.i.d. (the exponential-race form of
sampling from a categorical, as used by vLLM/SGLang). Seeded requests draw `E` from their own
`torch.Generator`, so their tokens do not depend on the rest of the batch (on CUDA, a seeded
request of plain sampling takes the fast path's kernel instead, below).

`sample_device` never reads a device value on the host: parameters go to the device in pinned,
non-blocking copies and the result stays on the device (`DeviceSamples`), so the model runner can
copy it back asynchronously. Greedy, temperature, top-k/top-p/min-p are one vectorised pass over
the batch; only penalties and seeded generators of the PyTorch path loop over their rows.

Logits arrive in the model's dtype (bfloat16 on GPU). Everything above works on a float32 copy
(`Tensor.float()`: no copy when they are float32 already, as on CPU), made only when needed.

Fast path (CUDA with the fused kernels on, `Sampler(fused=True)`): a batch where every row is
greedy or plain temperature sampling (no top-k/top-p/min-p, no logprobs) skips all of the above
after the penalties and runs `kernels.sampling.gumbel_argmax`: one pass over the logits as they
are (bfloat16 read directly when no penalty applies), `argmax(logits / T + Gumbel noise)`
(greedy rows: plain argmax), a sample of the same distribution. Its noise comes from Philox:

- unseeded rows: keyed by the sampler's seed, with counters `step << 32 | row *
  counters_per_row + ...` (`kernels.sampling`), `step` counting the sampler's fast-path calls
  from 1: every call draws fresh numbers, and the same seed and sequence of batches draw the
  same ones;
- seeded rows (`Request.seed`): keyed by the request's seed, with counters `position << 32 |
  ...`, `position` the index in the request's ids of the token being sampled: the draws depend
  on the seed and the position alone, neither on the batch nor on the steps before (a request
  recomputed after preemption samples the same tokens). A batch that takes the PyTorch path
  (a neighbour asks for logprobs or top-p, say) samples its seeded plain rows with the same
  kernel call on the same logits, so their tokens never depend on their neighbours. This spares
  the host a generator launch per seeded row per step (BENCHMARKS.md, "Seeded rows on the fast
  path").

The CPU path never takes it (seeded rows there draw from their generators).

Token masks (structured outputs, allowed token ids, bad words; `tritonllm.structured`) come
first, before penalties: the rows of constrained requests get their next-token bitmask filled
on the host (`structured.constraint.fill_bitmasks`: llguidance's matchers, in one batch call),
copied in pinned non-blocking uploads and applied in place (`structured.masks`: the Triton
kernel `kernels.token_bitmask` on CUDA, PyTorch on CPU; masked logits become -inf), so every
path after it, the fused one included, samples only allowed tokens, greedy or not. Decode
logits of a CUDA graph are masked after the replay, in the graph's output buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tritonllm.engine.request import Request
from tritonllm.layers.fused import use_fused
from tritonllm.structured.masks import MaskFill, TokenMaskBuffers


def exponential_(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill float tensor `out` (any shape, in place) with `Exp(1)` draws from `generator`;
    returns it.

    On CUDA `Tensor.exponential_`. On CPU `-log(U)` with `U ~ Uniform[0, 1)` clamped to the
    dtype's smallest normal (so every draw is finite): the same distribution (inverse-CDF
    sampling), several times faster than CPU `exponential_`, which had made the CPU sampler
    cost more than the model's layers (BENCHMARKS.md, "CPU sampler noise").
    """
    if out.is_cuda:
        return out.exponential_(generator=generator)
    out.uniform_(generator=generator).clamp_min_(torch.finfo(out.dtype).tiny)
    return out.log_().neg_()


@dataclass
class SamplerOutput:
    """token_ids: `[B]` sampled ids; logprobs / top_logprobs: per row, None unless the row
    asked for logprobs."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


@dataclass
class DeviceSamples:
    """One step's samples, still on the device.

    Attributes:
        token_ids: `[B]` int64.
        logprobs: `[B]` float32 logprob of each sampled token, or None if no row asked.
        top_ids, top_vals: `[B, K]` int64 / float32, the K = max requested most likely tokens
            and their logprobs, or None.
        num_top: per row, None (no logprobs) or how many of the K to report.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_vals: torch.Tensor | None
    num_top: list[int | None]

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors to copy back to the host, token ids first."""
        extra = [self.logprobs, self.top_ids, self.top_vals]
        return [self.token_ids] + [t for t in extra if t is not None]

    @staticmethod
    def to_output(host: list[torch.Tensor], num_top: list[int | None]) -> SamplerOutput:
        """Build the `SamplerOutput` from host copies of `tensors()` (same order)."""
        token_list = host[0].tolist()
        batch = len(token_list)
        out_lp: list[float | None] = [None] * batch
        out_top: list[dict[int, float] | None] = [None] * batch
        if len(host) > 1:
            lps, top_ids, top_vals = host[1].tolist(), host[2].tolist(), host[3].tolist()
            for i, k in enumerate(num_top):
                if k is None:
                    continue
                out_lp[i] = lps[i]
                out_top[i] = dict(zip(top_ids[i][:k], top_vals[i][:k], strict=True))
        return SamplerOutput(token_list, out_lp, out_top)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA through pinned memory, non-blocking (no sync)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


# token ids (host list, may hold not-yet-known ids) → `[N]` int64 device tensor of real ids
IdsToDevice = Callable[[list[int]], torch.Tensor]


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        device: where logits arrive and generators live.
        seed: seed of the generator for rows without a generator of their own.
        fused: take the fused Gumbel-max fast path on CUDA where it applies (module docstring;
            `EngineConfig.fused_layers`).
        grammar_threads: threads that fill token masks (`EngineConfig.grammar_threads`).
    """

    def __init__(
        self, device: torch.device, seed: int, fused: bool = True, grammar_threads: int = 1
    ) -> None:
        self.device = device
        self.fused = fused
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.seed = seed
        self.fast_steps = 0  # fast-path calls so far: the high word of their Philox counters
        self.masks = TokenMaskBuffers(device, grammar_threads)

    def start_masks(self, vocab: int, reqs: list[Request]) -> MaskFill | None:
        """Start filling the token masks of a step's ``reqs`` (rows of ``[B, vocab]`` logits) on
        the mask fill thread (`TokenMaskBuffers.start`), for a later
        `sample_device(..., masks=)`; None when no row is constrained."""
        masked = _masked_rows(reqs)
        if not masked:
            return None
        return self.masks.start(vocab, masked, [reqs[i] for i in masked])

    def make_generator(self, seed: int) -> torch.Generator:
        """A per-request generator on the sampling device, seeded with ``seed`` (an int64).

        PyTorch's CPU generator (a Mersenne Twister) keeps only a seed's low 32 bits, so seeds
        that differ above them (``s`` and ``s + 2**32``, ``-1`` and ``2**63 - 1``) would draw
        alike: on CPU a seed outside ``[0, 2**32)`` is first mixed into 32 bits
        (`_cpu_seed`). CUDA's generator (Philox) keeps all 64 bits."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if self.device.type == "cuda" else _cpu_seed(seed))
        return gen

    @torch.inference_mode()
    def sample_device(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        ids_to_device: IdsToDevice | None = None,
        masks: MaskFill | None = None,
        positions: list[int] | None = None,
    ) -> DeviceSamples:
        """Sample the next token of each request without a host sync.

        Args:
            logits: `[B, vocab]` float32, bfloat16 or float16 (float32 logits may be modified
                in place; others are read, or copied to float32 where a step needs it).
            reqs: the B requests, for their params, token history and generators.
            ids_to_device: maps a request's token ids to a device tensor (the model runner's
                version resolves ids that are still on the device under overlap scheduling);
                default: a plain copy.
            masks: the step's token masks from `start_masks` (they are applied, not filled
                here), or None: the constrained rows' masks are filled and applied here.
            positions: per row, the index in the request's ``token_ids`` of the token being
                sampled, which keys a seeded row's draws on the fast path (module docstring);
                default ``len(token_ids)`` (right for a step not yet committed).

        Returns:
            the samples, on the device.
        """
        device = logits.device
        if ids_to_device is None:
            ids_to_device = lambda ids: to_device(ids, torch.int64, device)  # noqa: E731
        params = [r.params for r in reqs]
        if masks is not None:
            self.masks.finish(logits, masks)
        else:
            masked = _masked_rows(reqs)
            if masked:
                self.masks.apply(logits, masked, [reqs[i] for i in masked])
        penalised = [i for i, r in enumerate(reqs) if r.uses_penalties]
        kernel = use_fused(self.fused, logits) and _kernel_fits(logits)
        fast = kernel and all(r.plain_sampling for r in reqs)
        if fast and not penalised:
            return self._gumbel_sample(logits, reqs, positions)  # the model's logits as they are
        logits = logits.float()  # the in-place steps below need float32
        if penalised:
            self._apply_penalties(logits, reqs, penalised, ids_to_device)
        if fast:
            return self._gumbel_sample(logits, reqs, positions)
        # Seeded plain rows: the fast path's draws, before the temperature scaling below.
        keyed = [] if not kernel else _seeded_plain_rows(reqs)
        keyed_tokens = None
        if keyed:
            keyed_tokens = self._seeded_sample(logits, reqs, positions, keyed)
        # (no tiny temperature here either: SamplingParams stores one below 1e-5 as 0, greedy)
        if any(p.temperature > 0 and p.temperature != 1.0 for p in params):
            temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
            logits.div_(to_device(temps, torch.float32, device)[:, None])
        num_top = [p.logprobs for p in params]
        logprobs = None
        if any(k is not None for k in num_top):
            logprobs = torch.log_softmax(logits, dim=-1)

        tokens = logits.argmax(dim=-1)
        skip = set(keyed)
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy and i not in skip]
        if sampled_rows:
            all_rows = len(sampled_rows) == len(reqs)
            rows = None if all_rows else to_device(sampled_rows, torch.int64, device)
            sub = _filter(logits if all_rows else logits[rows], [params[i] for i in sampled_rows])
            probs = torch.softmax(sub, dim=-1)
            noise = self._noise(probs, [reqs[i] for i in sampled_rows])
            picked = (probs / noise).argmax(dim=-1)
            if all_rows:
                tokens = picked
            else:
                tokens[rows] = picked
        if keyed_tokens is not None:
            tokens[to_device(keyed, torch.int64, device)] = keyed_tokens

        lp = top_ids = top_vals = None
        if logprobs is not None:
            lp = logprobs.gather(1, tokens[:, None]).squeeze(1)
            k = max(max(k for k in num_top if k is not None), 1)
            top_vals, top_ids = logprobs.topk(k, dim=-1)
        return DeviceSamples(tokens, lp, top_ids, top_vals, num_top)

    def _gumbel_sample(
        self, logits: torch.Tensor, reqs: list[Request], positions: list[int] | None
    ) -> DeviceSamples:
        """The fast path: one `gumbel_argmax` over `[B, vocab]` logits (float32, bfloat16 or
        float16; see the module docstring); greedy rows get inverse temperature 0 (exact
        argmax); seeded rows are keyed by their seed and ``positions`` (`sample_device`)."""
        from kernels.sampling import BLOCK, counters_per_row, gumbel_argmax, iters_for

        params = [r.params for r in reqs]
        # A temperature is 0 or >= GREEDY_TEMPERATURE_EPS (SamplingParams): 1 / T <= 1e5, finite.
        inv_temps = [0.0 if p.temperature == 0.0 else 1.0 / p.temperature for p in params]
        inv: float | torch.Tensor
        if len(set(inv_temps)) == 1:
            inv = inv_temps[0]  # one shared temperature (the usual batch): a kernel argument
        else:
            inv = to_device(inv_temps, torch.float32, logits.device)
        self.fast_steps += 1
        # offset >= 2^32 always: Triton then types it int64 on every call (one compiled variant)
        offset = self.fast_steps << 32
        seeds = offsets = None
        if any(r.seed is not None for r in reqs):
            batch, vocab = logits.shape
            per_row = counters_per_row(vocab, BLOCK, iters_for(batch, vocab))
            if positions is None:
                positions = [len(r.token_ids) for r in reqs]
            keys = [self.seed if r.seed is None else _int64(r.seed) for r in reqs]
            bases = [
                offset + b * per_row if r.seed is None else positions[b] << 32
                for b, r in enumerate(reqs)
            ]
            both = to_device(keys + bases, torch.int64, logits.device)  # one upload
            seeds, offsets = both[:batch], both[batch:]
        tokens = gumbel_argmax(logits, inv, self.seed, offset, row_seeds=seeds, row_offsets=offsets)
        return DeviceSamples(tokens, None, None, None, [None] * len(params))

    def _seeded_sample(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        positions: list[int] | None,
        rows: list[int],
    ) -> torch.Tensor:
        """`[len(rows)]` int64 device tokens of the seeded plain ``rows`` of a batch that takes
        the PyTorch path: the fast path's draws for them (same kernel, same float32 values,
        same keys), from ``logits`` (``[B, vocab]`` float32, before temperature scaling)."""
        index = to_device(rows, torch.int64, logits.device)
        pos = None if positions is None else [positions[i] for i in rows]
        return self._gumbel_sample(logits[index], [reqs[i] for i in rows], pos).token_ids

    def _noise(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """`Exp(1)` noise `[N, vocab]`: rows of seeded requests from their own generator (one
        draw of a whole row each, so independent of the batch), the rest from the shared one."""
        seeded = [j for j, r in enumerate(reqs) if r.generator is not None]
        if not seeded:
            return exponential_(torch.empty_like(probs), self.generator)
        noise = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(reqs) if r.generator is None]
        if unseeded:
            idx = to_device(unseeded, torch.int64, probs.device)
            rows = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
            noise[idx] = exponential_(rows, self.generator)
        for j in seeded:
            exponential_(noise[j], reqs[j].generator)
        return noise

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor, reqs: list[Request], rows: list[int], ids_to_device: IdsToDevice
    ) -> None:
        """Logit bias, repetition/presence/frequency penalties and min_tokens masking of
        `logits` rows `rows` (the requests with `uses_penalties`), in place."""
        vocab = logits.shape[1]
        device = logits.device
        _add_logit_bias(logits, reqs, rows)
        for i in rows:
            req = reqs[i]
            p = req.params
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                seen[ids_to_device(req.token_ids)] = True
                row = logits[i]
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                logits[i] = torch.where(seen, penalised, row)
            if (p.presence_penalty or p.frequency_penalty) and req.num_output_tokens:
                out = ids_to_device(req.output_ids)
                counts = torch.bincount(out, minlength=vocab)[:vocab].float()
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if req.num_output_tokens < p.min_tokens and req.stop_ids:
                stop = [t for t in sorted(req.stop_ids) if t < vocab]
                logits[i, to_device(stop, torch.int64, device)] = float("-inf")


def _add_logit_bias(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    """Add each request's `SamplingParams.logit_bias` to its row of `[B, vocab]` float32
    `logits`, in place, for the rows of `rows` that have one; one upload of the (row, id) pairs
    and one of the biases for the whole batch. Masked logits (-inf: a token mask or min_tokens)
    stay -inf, so a bias never lets a forbidden token through."""
    where: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i in rows:
        bias = reqs[i].params.logit_bias
        where += [i] * len(bias)
        ids += [token for token, _ in bias]
        values += [value for _, value in bias]
    if not values:
        return
    index = to_device(where + ids, torch.int64, logits.device)
    bias_t = to_device(values, torch.float32, logits.device)
    # Ids are distinct within a row (SamplingParams), so no (row, id) pair repeats.
    logits.index_put_((index[: len(where)], index[len(where) :]), bias_t, accumulate=True)


def _masked_rows(reqs: list[Request]) -> list[int]:
    """The rows whose token mask applies: a constraint, and not finished (nor finishing on
    the token its constraint just took: `TokenConstraint.ended`)."""
    return [
        i
        for i, r in enumerate(reqs)
        if r.constraint is not None and not r.finish_reason and not r.constraint.ended
    ]


def _kernel_fits(logits: torch.Tensor) -> bool:
    """Whether `_gumbel_sample` can take these logits: float32/bfloat16/float16 with a
    contiguous last dim, and a call's Philox counters within the low 32 bits."""
    from kernels.sampling import LOGIT_DTYPES, counters_per_row, iters_for

    batch, vocab = logits.shape
    if logits.dtype not in LOGIT_DTYPES or logits.stride(1) != 1:
        return False
    return batch * counters_per_row(vocab, iters=iters_for(batch, vocab)) <= 1 << 32


def _cpu_seed(seed: int) -> int:
    """A seed for PyTorch's CPU generator, which keeps 32 bits: ``seed`` itself in ``[0,
    2**32)``, else the low 32 bits of SplitMix64's output for it (Steele et al., "Fast
    splittable pseudorandom number generators", 2014), so that seeds differing only in their
    high bits do not draw alike."""
    if 0 <= seed < 1 << 32:
        return seed
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def _int64(value: int) -> int:
    """``value`` wrapped into [-2^63, 2^63) (a seed + index past INT64_MAX stays a valid key)."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _seeded_plain_rows(reqs: list[Request]) -> list[int]:
    """The rows of seeded requests that sample with a plain temperature: on CUDA they take the
    fast path's kernel whichever path their batch takes (module docstring)."""
    return [
        i
        for i, r in enumerate(reqs)
        if r.seed is not None and r.plain_sampling and not r.params.is_greedy
    ]


def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Top-k, top-p and min-p masking of `[N, vocab]` temperature-scaled logits (-inf out)."""
    vocab = logits.shape[1]
    top_k = [p.top_k if p.top_k >= 1 else vocab for p in params]
    # top_p == 1 disables the cut (inf), so cumsum rounding never drops a row's tail.
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    min_p = [p.min_p for p in params]
    device = logits.device
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_vals, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)
        k_t = to_device(top_k, torch.int64, device)
        sorted_vals = sorted_vals.masked_fill(ranks[None, :] >= k_t[:, None], float("-inf"))
        probs = torch.softmax(sorted_vals, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        p_t = to_device(top_p, probs.dtype, device)
        sorted_vals = sorted_vals.masked_fill(mass_before >= p_t[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_vals)
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        m_t = to_device(min_p, probs.dtype, device)
        threshold = probs.max(dim=-1, keepdim=True).values * m_t[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
