"""Programmatic dependent launch (PDL) for the project's Triton kernels on sm_90+.

A decode step is a chain of ~300 short kernels (10 per layer); each kernel boundary costs the
GPU a launch, a ramp-up and a drain of a few microseconds, which at decode sizes is as long as
the kernels' own work (BENCHMARKS.md, "Session 5 diagnostics"). With PDL (CUDA
programming guide, "Programmatic Dependent Launch and Synchronization"; PTX `griddepcontrol`)
a kernel launched with the programmatic-stream-serialization attribute may start while the
kernel before it in the stream is still running: its programs are launched and scheduled while
the predecessor drains, then block in `griddepcontrol.wait` until the predecessor has completed
and its writes are visible. A kernel lets its dependents launch early with
`griddepcontrol.launch_dependents`. FlashInfer's attention kernels do the same on sm_90 (their
`enable_pdl`), and CUDA graphs keep the relaxed edges.

The rule every kernel with a `PDL` switch keeps: with PDL on, it calls `pdl_wait` before any
global memory access. So each kernel still completes after its predecessor, and a kernel
launched without PDL (cuBLAS, PyTorch) waits as usual.

PDL stays on because on the H200 it cost nothing on the default (cuBLAS) path and is the
precondition for overlapping kernel boundaries at all; with the skinny GEMM it was mixed.
Prefetching each GEMM program's weight slice into L2 before the wait
(`cp.async.bulk.prefetch`) was tried and made the chain slower, so it is not done
(BENCHMARKS.md, "A decode layer's kernel chain, with and without PDL").

`set_enabled(False)` turns it off for the process (the engine calls it with
`EngineConfig.pdl` when it starts on CUDA); it is never on in Triton's CPU interpreter or below
sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernels

_CAPABLE: dict[int, bool] = {}
# The process-wide switch (`set_enabled`); on by default.
_ENABLED = True


def set_enabled(on: bool) -> None:
    """Turn PDL on or off for every kernel launched from now on, in this process."""
    global _ENABLED
    _ENABLED = on


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL: a CUDA device of compute capability
    >= 9.0, not Triton's interpreter, and not switched off (`set_enabled`)."""
    if not _ENABLED or device.type != "cuda" or kernels.interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch with a `PDL` constexpr: `PDL` and Triton's
    `launch_pdl` launch option, both from `enabled(device)` (the option is left out when off,
    so the interpreter never sees it)."""
    on = enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has completed (its writes are
    visible), then let the next kernel launch. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
