"""The tensor-parallel process group of one rank: start-up and the collectives the model needs.

Every rank is its own process (see `engine.rank_processes`) and calls `init_tensor_parallel`
once, before building its model: NCCL on CUDA devices (rank r on the r-th GPU after the
configured one), gloo on CPU. The ranks meet through a `torch.distributed.FileStore` whose file
the parent created, so no TCP port has to be picked and none can collide.

NVLink multicast (NVLS, symmetric memory) stays off in every rank: `MULTICAST_OFF_ENV` is put
into the process environment before torch.distributed initialises (and so reaches NCCL and
anything the rank starts), because on the shared multi-GPU hosts this project is tested on a
program that uses it can take the host's GPUs out of service.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Set in each rank's environment before the process group exists (see the module docstring).
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# torch 2.13 renamed `all_gather_into_tensor` (deprecated there) to `all_gather_single`; the GPU
# host's image has an older torch with the first name only.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def disable_multicast() -> None:
    """Put `MULTICAST_OFF_ENV` into this process' environment (inherited by every process it
    starts from now on)."""
    os.environ.update(MULTICAST_OFF_ENV)


def rank_device(device: str, rank: int) -> str:
    """The device of rank `rank` when the engine's device is `device`: "cpu" for every rank on
    CPU; the (index + rank)-th GPU on CUDA ("cuda" counts as "cuda:0")."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    return f"cuda:{(dev.index or 0) + rank}"


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's view of the tensor-parallel group (the default process group).

    The collectives run on the current CUDA stream (NCCL) and can be captured in CUDA graphs;
    on CPU they are gloo's blocking calls. Every rank must issue the same collectives in the
    same order, which holds because every rank runs the same forward of the same batch.

    Attributes:
        rank: this rank, 0 (the one that schedules and samples) to size - 1.
        size: ranks in the group (the tensor-parallel size).
        device: this rank's device.
    """

    rank: int
    size: int
    device: torch.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (any shape, on `device`) over the ranks, in place; returns `x`."""
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """`[size * n, ...]`: the `[n, ...]` tensors of all ranks stacked in rank order."""
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous())
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (in place, same shape and dtype); returns `x`."""
        dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (a blocking collective; start-up only)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def init_tensor_parallel(rank: int, size: int, store_path: str, device: str) -> TensorParallelGroup:
    """Join the tensor-parallel group as `rank` of `size` (once per process).

    Puts `MULTICAST_OFF_ENV` into `os.environ` first, selects the rank's GPU on CUDA (on CPU
    the ranks share the cores: each takes its part as intra-op threads), then initialises the
    default process group (NCCL for a CUDA `device`, gloo otherwise) through the `FileStore` at
    `store_path` (an empty file every rank can open), and runs one all-reduce so that the
    communicator exists before any CUDA-graph capture.

    Args:
        rank, size: this rank and the group size.
        store_path: the rendezvous file (see `torch.distributed.FileStore`).
        device: this rank's device (see `rank_device`).

    Raises:
        RuntimeError: a CUDA device that does not exist, or a failed rendezvous.
    """
    disable_multicast()
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(
                f"tensor-parallel rank {rank} needs {dev}, but {torch.cuda.device_count()} "
                "GPUs are visible"
            )
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    store = dist.FileStore(store_path, size)
    if dev.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=dev)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    group = TensorParallelGroup(rank, size, dev)
    group.min_int(0)  # the communicator is set up by its first collective
    return group
