"""The tensor-parallel partition (`tritonllm.distributed.partition`) over many model shapes.

Oracle: the invariants the layers rely on, checked head by head: every query head on exactly one
rank, each rank's KV heads exactly those its query heads read (GQA: head h reads KV head
h // group), the local GQA mapping intact, KV heads replicated only when there are fewer than
ranks, and the MLP columns and vocabulary rows covering their dimension once.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from tritonllm.config import ModelConfig
from tritonllm.distributed import ModelShard, Span, partition_heads, split_evenly

# (query heads, KV heads): MHA, GQA with even and odd groups, MQA, and real models' shapes
# (SmolLM2-135M 9/3, Qwen3-0.6B 16/8, Qwen3-8B 32/8, Llama-3-70B 64/8, Qwen2-0.5B 14/2).
SHAPES = [(h, h // g) for h in range(1, 25) for g in range(1, h + 1) if h % g == 0]
SHAPES += [(9, 3), (16, 8), (32, 8), (64, 8), (14, 2), (40, 8), (28, 4), (96, 8)]


@pytest.mark.parametrize("heads,kv_heads", sorted(set(SHAPES)))
def test_partition_invariants_hold_for_every_size_up_to_the_head_count(heads, kv_heads):
    group = heads // kv_heads
    for size in range(1, heads + 1):
        shards = partition_heads(heads, kv_heads, size)
        assert len(shards) == size
        # Every query head on exactly one rank, contiguous, in rank order.
        assert shards[0].q.start == 0 and shards[-1].q.stop == heads
        assert all(a.q.stop == b.q.start for a, b in itertools.pairwise(shards))
        assert all(s.q.size >= 1 for s in shards)
        holders = {kv: 0 for kv in range(kv_heads)}
        for s in shards:
            # The rank's KV heads are exactly those its query heads read.
            assert {h // group for h in range(s.q.start, s.q.stop)} == set(
                range(s.kv.start, s.kv.stop)
            )
            # Local GQA: local query head i reads local KV head i // local group.
            local_group = s.q.size // s.kv.size
            assert s.q.size % s.kv.size == 0
            for i in range(s.q.size):
                assert (s.q.start + i) // group - s.kv.start == i // local_group
            for kv in range(s.kv.start, s.kv.stop):
                holders[kv] += 1
        if kv_heads >= size:  # no replication; KV heads dealt out as evenly as possible
            assert set(holders.values()) == {1}
            assert max(s.kv.size for s in shards) - min(s.kv.size for s in shards) <= 1
        else:  # each KV head replicated on a near-even share of the ranks
            assert sum(holders.values()) == size
            assert max(holders.values()) - min(holders.values()) <= 1
            assert all(s.kv.size == 1 for s in shards)


def test_smollm2_at_two_ranks_keeps_each_query_head_with_its_kv_head():
    """9 query heads over 3 KV heads (group 3): rank 0 holds KV heads 0-1 with query heads 0-5,
    rank 1 KV head 2 with query heads 6-8."""
    rank0, rank1 = partition_heads(9, 3, 2)
    assert (rank0.q, rank0.kv) == (Span(0, 6), Span(0, 2))
    assert (rank1.q, rank1.kv) == (Span(6, 9), Span(2, 3))


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head_on_consecutive_ranks():
    shards = partition_heads(4, 2, 4)
    assert [(s.q.start, s.kv.start) for s in shards] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    shards = partition_heads(9, 3, 4)  # KV head 0 on two ranks (query heads 2 + 1), others one
    assert [(s.q, s.kv.start) for s in shards] == [
        (Span(0, 2), 0),
        (Span(2, 3), 0),
        (Span(3, 6), 1),
        (Span(6, 9), 2),
    ]


@pytest.mark.parametrize(
    "heads,kv_heads,size,match",
    [
        (4, 2, 5, "must be in 1..4"),
        (4, 2, 0, "must be in 1..4"),
        (6, 4, 2, "not a multiple"),
    ],
)
def test_impossible_partitions_are_refused_with_the_reason(heads, kv_heads, size, match):
    with pytest.raises(ValueError, match=match):
        partition_heads(heads, kv_heads, size)


def test_split_evenly_covers_the_dimension_with_sizes_one_apart():
    for n, parts in itertools.product(range(0, 40), range(1, 9)):
        spans = split_evenly(n, parts)
        assert [s.start for s in spans[1:]] == [s.stop for s in spans[:-1]]
        assert spans[0].start == 0 and spans[-1].stop == n
        assert max(s.size for s in spans) - min(s.size for s in spans) <= 1


def _config(**changes) -> ModelConfig:
    base = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=1e5,
        rope_scaling=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        o_proj_bias=False,
        qk_norm=False,
        max_position_embeddings=8192,
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("vocab,intermediate", [(49152, 1536), (151936, 3072), (1001, 97)])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_model_shards_cover_the_mlp_and_the_vocabulary_once(vocab, intermediate, size):
    cfg = _config(vocab_size=vocab, intermediate_size=intermediate)
    shards = [ModelShard.of(cfg, rank, size) for rank in range(size)]
    rows = -(-vocab // size)
    assert all(s.vocab_rows == rows for s in shards)  # equal blocks for the all-gather
    assert [s.vocab.start for s in shards] == [min(r * rows, vocab) for r in range(size)]
    assert shards[-1].vocab.stop == vocab and sum(s.vocab.size for s in shards) == vocab
    assert sum(s.intermediate.size for s in shards) == intermediate
    for s in shards:
        local = s.local_config(cfg)
        assert (local.num_heads, local.num_kv_heads) == (s.heads.q.size, s.heads.kv.size)
        assert local.intermediate_size == s.intermediate.size
        assert local.vocab_size == vocab and local.hidden_size == cfg.hidden_size
    with pytest.raises(ValueError, match="rank must be in"):
        ModelShard.of(cfg, size, size)
