"""Triton-language GPU kernels for paged attention, each tested against `kernels.reference`.

- `store_kv`: scatter new K/V into the paged KV cache.
- `decode_attention`: paged split-K (flash-decoding) attention, one query token per sequence.
- `extend_attention`: paged causal prefill/extend attention (FlashAttention-2 online softmax).

Importing this package does not import `triton` (the references in `kernels.reference` are plain
PyTorch). On a machine without CUDA it sets `TRITON_INTERPRET=1` unless the variable is already
set, so that the kernels, once imported, run in Triton's CPU interpreter: Triton decides between
compiling and interpreting when a kernel is decorated, so this must happen before
`kernels.store_kv` & co. are imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
