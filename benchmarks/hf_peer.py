"""The Hugging Face peer of the offline benchmark: `generate` on a subset of its workload."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.common import Workload
from benchmarks.offline import ThroughputRun


def hf_generate(model: Path | str, workload: Workload, device: str) -> ThroughputRun:
    """Hugging Face `generate` on `workload` as one left-padded batch, greedy, without EOS stop.

    All rows run to the longest output length (`min_new_tokens = max_new_tokens`); the run
    counts the workload's own output tokens, `generated_tokens` counts all of them.
    """
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    width = max(len(p) for p in workload.prompts)
    ids = torch.zeros(len(workload), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(workload.prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    new_tokens = max(workload.output_lens)
    kwargs = dict(
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    with torch.inference_mode():
        hf.generate(ids[:1, -8:], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        common.synchronize(device)
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        common.synchronize(device)
        seconds = time.perf_counter() - start
    generated = out[:, width:].numel()
    del hf
    return ThroughputRun(
        len(workload), workload.num_prompt_tokens, workload.num_output_tokens, seconds, generated
    )
