"""How a model is split across tensor-parallel ranks: heads, MLP columns, vocabulary rows.

Megatron-LM's layout (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism"), as vLLM and SGLang serve it: the q/k/v and gate/up
projections are split by output (each rank computes its own attention heads and MLP columns,
with no communication), the o and down projections by input (each rank's partial product is
summed by one all-reduce), and the embedding and LM head by vocabulary rows.

Head counts need not divide evenly. Every rank's query heads are contiguous and come with the
KV heads they read (GQA: query head h reads KV head h // group), so a rank's local heads are
again a GQA layout with the same mapping:

- at least as many KV heads as ranks: the KV heads are dealt out as evenly as possible (the
  first ranks take one more), each with its whole group of query heads. SmolLM2-135M (9 query
  heads, 3 KV heads) at 2 ranks: rank 0 KV heads 0-1 and query heads 0-5, rank 1 KV head 2 and
  query heads 6-8;
- fewer KV heads than ranks: each KV head is replicated on a set of consecutive ranks (as even
  as possible) that split its group of query heads. 4 query / 2 KV heads at 4 ranks: one query
  head per rank, KV head 0 on ranks 0-1, KV head 1 on ranks 2-3.

Everything here is plain arithmetic on the model's shape (`ModelShard.of`); the layers build
their local weights from it and the loader reads the matching slices of the checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tritonllm.config import ModelConfig


@dataclass(frozen=True)
class Span:
    """The half-open index range `[start, stop)` of a split dimension held by one rank."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def split_evenly(n: int, parts: int) -> list[Span]:
    """`n` items in `parts` contiguous spans whose sizes differ by at most one (the first
    `n % parts` spans are the longer ones).

    Raises:
        ValueError: `parts < 1` or `n < 0`.
    """
    if parts < 1 or n < 0:
        raise ValueError(f"cannot split {n} items into {parts} parts")
    base, extra = divmod(n, parts)
    spans, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        spans.append(Span(start, stop))
        start = stop
    return spans


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads `q` and the KV heads `kv` they read."""

    q: Span
    kv: Span


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """Each rank's query and KV heads (see the module docstring for the layout).

    Invariants (tested over many shapes): every query head is on exactly one rank, in rank
    order; each rank holds exactly the KV heads its query heads read, and its local query head
    i reads its local KV head `i // (q.size // kv.size)`; no KV head is replicated when
    `num_kv_heads >= tp_size`.

    Raises:
        ValueError: `num_heads` is not a multiple of `num_kv_heads`, or `tp_size` is not in
            `1..num_heads` (a rank without a query head would have nothing to compute).
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads (GQA)"
        )
    if not 1 <= tp_size <= num_heads:
        raise ValueError(
            f"tensor_parallel_size must be in 1..{num_heads} (the model's query heads), "
            f"got {tp_size}"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        return [
            HeadShard(Span(kv.start * group, kv.stop * group), kv)
            for kv in split_evenly(num_kv_heads, tp_size)
        ]
    shards = []
    # Ranks per KV head: at most ceil(tp / kv) <= ceil(heads / kv) = group, so every rank of a
    # KV head gets at least one of its query heads.
    for kv_head, ranks in enumerate(split_evenly(tp_size, num_kv_heads)):
        for q in split_evenly(group, ranks.size):
            first = kv_head * group
            shards.append(
                HeadShard(Span(first + q.start, first + q.stop), Span(kv_head, kv_head + 1))
            )
    return shards


@dataclass(frozen=True)
class ModelShard:
    """What one rank of `size` holds of a model.

    Attributes:
        rank, size: this rank and the tensor-parallel size.
        heads: its query and KV heads.
        intermediate: its columns of the MLP's intermediate dimension (gate/up rows, down
            columns).
        vocab: its rows of the vocabulary (embedding and LM head).
        vocab_rows: rows of its embedding / LM head weight: `ceil(vocab / size)` on every rank,
            so the all-gathered logits are `size` equal blocks; rows past `vocab.size` are zero
            padding.
    """

    rank: int
    size: int
    heads: HeadShard
    intermediate: Span
    vocab: Span
    vocab_rows: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> ModelShard:
        """Rank `rank`'s part of model `cfg` at tensor-parallel size `size`.

        Raises:
            ValueError: see `partition_heads`; `rank` not in `0..size-1`.
        """
        heads = partition_heads(cfg.num_heads, cfg.num_kv_heads, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in 0..{size - 1}, got {rank}")
        rows = -(-cfg.vocab_size // size)
        start = min(rank * rows, cfg.vocab_size)
        return cls(
            rank=rank,
            size=size,
            heads=heads[rank],
            intermediate=split_evenly(cfg.intermediate_size, size)[rank],
            vocab=Span(start, min(start + rows, cfg.vocab_size)),
            vocab_rows=rows,
        )

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with this rank's head counts and MLP width: the shape its KV cache and
        attention backend see (a GQA layout of `heads.q.size` query heads over `heads.kv.size`
        KV heads)."""
        return dataclasses.replace(
            cfg,
            num_heads=self.heads.q.size,
            num_kv_heads=self.heads.kv.size,
            intermediate_size=self.intermediate.size,
        )
