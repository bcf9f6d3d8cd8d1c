"""Batched token sampling with per-request `SamplingParams`.

Order of logit processing (vLLM's): repetition penalty (prompt + output tokens; positive logits
divided, negative multiplied, as in CTRL, Keskar et al. 2019) → presence/frequency penalties
(output tokens, OpenAI's formula `logit -= frequency * count + presence * (count > 0)`) →
min_tokens masking of EOS/stop ids → temperature → logprobs are taken here → top-k → top-p
(nucleus, Holtzman et al. 2019, on the top-k renormalised distribution) → min-p (relative to
the most likely token) → sample.

Sampling draws `argmax(p / E)` with `E ~ Exp(1)` i.i.d. (the exponential-race form of
sampling from a categorical, as used by vLLM/SGLang). Seeded requests draw `E` from their own
`torch.Generator`, so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonllm.engine.request import Request


@dataclass
class SamplerOutput:
    """token_ids: `[B]` sampled ids; logprobs / top_logprobs: per row, None unless the row
    asked for logprobs."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


class Sampler:
    """Samples one token per row of a logits batch."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        """A per-request generator on the sampling device."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """Sample the next token of each request.

        Args:
            logits: `[B, vocab]` float32 (modified in place).
            reqs: the B requests, for their params, token history and generators.

        Returns:
            the sampled ids and the requested logprobs.
        """
        batch = len(reqs)
        self._apply_penalties(logits, reqs)
        params = [r.params for r in reqs]
        temps = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params],
            dtype=torch.float32,
            device=logits.device,
        )
        logits.div_(temps[:, None])
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        greedy = [p.is_greedy for p in params]
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i in range(batch) if not greedy[i]]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            sub = _filter(logits[rows], [params[i] for i in sampled_rows])
            probs = torch.softmax(sub, dim=-1)
            noise = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(sampled_rows) if reqs[i].generator is None]
            if unseeded:
                noise[unseeded] = torch.empty(
                    (len(unseeded), probs.shape[1]), device=probs.device
                ).exponential_(generator=self.generator)
            for j, i in enumerate(sampled_rows):
                if reqs[i].generator is not None:
                    noise[j].exponential_(generator=reqs[i].generator)
            tokens[rows] = (probs / noise).argmax(dim=-1)

        token_list = tokens.tolist()
        out_lp: list[float | None] = [None] * batch
        out_top: list[dict[int, float] | None] = [None] * batch
        if logprobs is not None:
            for i in range(batch):
                if not want_logprobs[i]:
                    continue
                out_lp[i] = float(logprobs[i, token_list[i]])
                k = params[i].logprobs
                if k:
                    vals, ids = logprobs[i].topk(k)
                    out_top[i] = dict(zip(ids.tolist(), vals.tolist(), strict=True))
                else:
                    out_top[i] = {}
        return SamplerOutput(token_list, out_lp, out_top)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
        vocab = logits.shape[1]
        for i, req in enumerate(reqs):
            p = req.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(req.token_ids)), device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            if (p.presence_penalty or p.frequency_penalty) and req.num_output_tokens:
                out = torch.tensor(req.output_ids, device=logits.device)
                counts = torch.bincount(out, minlength=vocab)[:vocab].float()
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if req.num_output_tokens < p.min_tokens and req.stop_ids:
                stop = torch.tensor(sorted(req.stop_ids), device=logits.device)
                logits[i, stop[stop < vocab]] = float("-inf")


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
        k_t = torch.tensor(top_k, device=device)
        sorted_vals = sorted_vals.masked_fill(ranks[None, :] >= k_t[:, None], float("-inf"))
        probs = torch.softmax(sorted_vals, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        p_t = torch.tensor(top_p, device=device, dtype=probs.dtype)
        sorted_vals = sorted_vals.masked_fill(mass_before >= p_t[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_vals)
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        m_t = torch.tensor(min_p, device=device, dtype=probs.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * m_t[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
