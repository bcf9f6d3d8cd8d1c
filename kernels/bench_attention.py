"""Decode-attention bandwidth on the GPU: Triton kernel vs FlashInfer vs the copy roofline.

`python -m kernels.bench_attention` (CUDA only). For Qwen3-0.6B's attention shape (16 query
heads, 8 KV heads, head_dim 128, bf16, page size 16) and several batch sizes and context
lengths, it times one layer's decode attention and reports the KV bytes read per second, next
to the device-to-device copy bandwidth measured in the same run (the physical bound).
"""

from __future__ import annotations

import math

import torch

from kernels.decode_attention import decode_attention, decode_workspace, default_num_kv_splits

HQ, HKV, HEAD_DIM, PAGE = 16, 8, 128, 16


def _time(fn, iters: int = 50) -> float:
    """Seconds per call (CUDA events, after warm-up)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src), iters=20)


def bench_case(batch: int, ctx: int, copy_bw: float, flashinfer) -> str:
    """One line: Triton (and FlashInfer, if given) decode bandwidth for `batch` x `ctx` tokens."""
    dev = torch.device("cuda")
    pages = math.ceil(ctx / PAGE)
    num_pages = batch * pages + 1
    k_cache = torch.randn(num_pages, PAGE, HKV, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    table = (torch.randperm(num_pages - 1, device=dev) + 1).int().view(batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    kv_bytes = 2 * batch * ctx * HKV * HEAD_DIM * 2
    splits = default_num_kv_splits(batch, HKV, ctx, dev)
    ws = decode_workspace(batch, HQ, splits, HEAD_DIM, dev)
    out = torch.empty_like(q)

    def triton_decode():
        decode_attention(
            q, k_cache, v_cache, table, seq_lens, num_kv_splits=splits, out=out, workspace=ws
        )

    t = _time(triton_decode)
    line = (
        f"B={batch:4d} ctx={ctx:6d} splits={splits:2d}  triton "
        f"{kv_bytes / t / 1e12:5.2f} TB/s ({kv_bytes / t / copy_bw:4.0%})"
    )
    if flashinfer is None:
        return line
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    last = torch.full((batch,), (ctx - 1) % PAGE + 1, dtype=torch.int32)
    for tensor_cores in (False, True):
        # use_tensor_cores=True runs FlashInfer's prefill (tensor-core) kernels for decode.
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device=dev),
            "NHD",
            use_tensor_cores=tensor_cores,
        )
        wrapper.plan(
            indptr,
            table.flatten(),
            last,
            HQ,
            HKV,
            HEAD_DIM,
            PAGE,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )

        def flashinfer_decode(wrapper=wrapper):
            return wrapper.run(q, (k_cache, v_cache))

        torch.testing.assert_close(flashinfer_decode(), out, atol=2e-2, rtol=2e-2)
        t = _time(flashinfer_decode)
        name = "flashinfer-tc" if tensor_cores else "flashinfer"
        line += f"  {name} {kv_bytes / t / 1e12:5.2f} TB/s ({kv_bytes / t / copy_bw:4.0%})"
    return line


def main() -> None:
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s")
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    cases = [(1, 512), (1, 4096), (32, 1024), (64, 640), (128, 640), (256, 640), (256, 4096)]
    for batch, ctx in cases:
        print(bench_case(batch, ctx, copy_bw, flashinfer), flush=True)


if __name__ == "__main__":
    main()
