"""Tensor-parallel layers: row-parallel `Linear`, vocabulary-parallel embedding and LM head.

The layout is Megatron-LM's (`tritonllm.distributed.partition`). A column-parallel projection
(q/k/v, gate/up) needs no layer of its own: it is a plain `Linear` over the rank's rows of the
weight, and its output slice (the rank's heads, its MLP columns) is consumed where it is. A
row-parallel projection (o, down) multiplies the rank's input slice by its columns of the
weight; the partial products are summed by one all-reduce. The embedding holds the rank's
vocabulary rows (other ids give zero rows; the all-reduce fills them in) and the LM head
all-gathers each rank's logits into the full vocabulary.

At tensor-parallel size 1 none of these is built: the model uses `Linear` and `nn.Embedding`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.distributed import Span, TensorParallelGroup
from tritonllm.layers.linear import Linear


class RowParallelLinear(Linear):
    """`Linear` over this rank's input columns, summed over the ranks.

    Input `[..., in_features]` (this rank's slice of the full input), output `[...,
    out_features]` (the full output, equal on every rank). A bias is added once: only rank 0
    holds it (`bias` is ignored on the others).

    Args:
        in_features: this rank's input width.
        out_features, bias, mode: as for `Linear`.
        tp: the tensor-parallel group.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallelGroup,
        mode: str = "cublas",
    ) -> None:
        super().__init__(in_features, out_features, bias and tp.rank == 0, mode=mode)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows.

    Input `[T]` int64 ids, output `[T, embedding_dim]` (the full embedding, equal on every
    rank): each rank looks up the ids in `vocab`, zeros for the others, and the all-reduce adds
    the ranks' rows (exact: every row is nonzero on one rank only).

    Attributes:
        weight: `[rows, embedding_dim]`; rows past `vocab.size` are padding (see
            `ModelShard.vocab_rows`).
    """

    def __init__(self, vocab: Span, rows: int, embedding_dim: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """LM head over this rank's vocabulary rows, all-gathered.

    Input `[S, in_features]` (equal on every rank), output `[S, vocab_size]` logits (the full
    vocabulary, on every rank; rank 0 samples from them). Each rank computes its `[S, rows]`
    block; the blocks are gathered in rank order and the padding rows of the last one are cut.

    Args:
        in_features: the hidden size.
        rows: rows of this rank's weight (`ModelShard.vocab_rows`, equal on all ranks).
        vocab_size: the full vocabulary.
        tp: the tensor-parallel group.
        mode: as for `Linear`.
    """

    def __init__(
        self,
        in_features: int,
        rows: int,
        vocab_size: int,
        tp: TensorParallelGroup,
        mode: str = "cublas",
    ) -> None:
        super().__init__(in_features, rows, bias=False, mode=mode)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)  # [S, rows]
        num_rows, rows = local.shape
        gathered = self.tp.all_gather(local)  # [size * S, rows], rank-major
        logits = gathered.view(self.tp.size, num_rows, rows).transpose(0, 1)
        logits = logits.reshape(num_rows, self.tp.size * rows)
        if logits.shape[1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()
