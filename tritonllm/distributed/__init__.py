"""Tensor parallelism: how a model is split across ranks (`partition`) and each rank's process
group with the collectives the layers call (`group`)."""

from tritonllm.distributed.group import (
    MULTICAST_OFF_ENV,
    TensorParallelGroup,
    disable_multicast,
    init_tensor_parallel,
    rank_device,
)
from tritonllm.distributed.partition import (
    HeadShard,
    ModelShard,
    Span,
    partition_heads,
    split_evenly,
)

__all__ = [
    "MULTICAST_OFF_ENV",
    "HeadShard",
    "ModelShard",
    "Span",
    "TensorParallelGroup",
    "disable_multicast",
    "init_tensor_parallel",
    "partition_heads",
    "rank_device",
    "split_evenly",
]
