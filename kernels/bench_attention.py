"""Decode-attention bandwidth on the GPU: Triton kernel vs FlashInfer vs the copy roofline.

`python -m kernels.bench_attention` (CUDA only). For Qwen3-0.6B's attention shape (16 query
heads, 8 KV heads, head_dim 128, bf16, page size 16, some cases 64) and several batch sizes and
context lengths (equal, and spread over 100..2047 tokens as in the offline workload's mid-run
batches), it times one layer's decode attention and reports the KV bytes read per second, next
to the device-to-device copy bandwidth measured in the same run (the physical bound)."""

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


def bench_case(
    lens: list[int], copy_bw: float, flashinfer, label: str = "", page: int = PAGE
) -> str:
    """One line: Triton (and FlashInfer, if given) decode bandwidth for sequences of `lens`
    tokens (one per batch row; pages of `page` tokens scattered at random over the pool).

    FlashInfer runs four ways: CUDA-core or tensor-core kernels (`-tc`), each planned by a
    plain wrapper or by a `use_cuda_graph=True` wrapper (`-graph`, what the engine's CUDA-graph
    decode replays; its plan may split KV differently). Bandwidth = K/V bytes of all `lens`
    tokens over the kernel time.
    """
    dev = torch.device("cuda")
    batch, ctx = len(lens), max(lens)
    num_seq_pages = [math.ceil(n / page) for n in lens]
    num_pages = sum(num_seq_pages) + 1
    k_cache = torch.randn(num_pages, page, HKV, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    perm = (torch.randperm(num_pages - 1, device=dev) + 1).int()
    max_pages = max(num_seq_pages)
    table = torch.zeros(batch, max_pages, dtype=torch.int32, device=dev)
    indptr = [0]
    for b, n in enumerate(num_seq_pages):
        table[b, :n] = perm[indptr[-1] : indptr[-1] + n]
        indptr.append(indptr[-1] + n)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    kv_bytes = 2 * sum(lens) * HKV * HEAD_DIM * 2
    splits = default_num_kv_splits(batch, HKV, ctx, dev)
    ws = decode_workspace(batch, HQ, splits, HEAD_DIM, dev)
    out = torch.empty_like(q)

    def triton_decode():
        decode_attention(
            q, k_cache, v_cache, table, seq_lens, num_kv_splits=splits, out=out, workspace=ws
        )

    t = _time(triton_decode)
    name = label or f"B={batch:4d} ctx={ctx:6d}"
    line = f"{name} splits={splits:2d}  triton {kv_bytes / t / 1e12:5.2f} TB/s ({kv_bytes / t / copy_bw:4.0%})"
    if flashinfer is None:
        return line
    indptr_t = torch.tensor(indptr, dtype=torch.int32)
    indices = torch.cat([table[b, :n] for b, n in enumerate(num_seq_pages)])
    last = torch.tensor([(n - 1) % page + 1 for n in lens], dtype=torch.int32)
    for tensor_cores in (False, True):
        for graph in (False, True):
            workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
            extra = {}
            if graph:
                extra = dict(
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
                    paged_kv_indices_buffer=torch.zeros(
                        indices.numel(), dtype=torch.int32, device=dev
                    ),
                    paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev),
                )
            # use_tensor_cores=True runs FlashInfer's prefill (tensor-core) kernels for decode.
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores, **extra
            )
            wrapper.plan(
                indptr_t,
                indices,
                last,
                HQ,
                HKV,
                HEAD_DIM,
                page,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
            )

            def flashinfer_decode(wrapper=wrapper):
                return wrapper.run(q, (k_cache, v_cache))

            torch.testing.assert_close(flashinfer_decode(), out, atol=2e-2, rtol=2e-2)
            t = _time(flashinfer_decode)
            name = "flashinfer" + ("-tc" if tensor_cores else "") + ("-graph" if graph else "")
            line += f"  {name} {kv_bytes / t / 1e12:5.2f} TB/s ({kv_bytes / t / copy_bw:4.0%})"
    return line


def mixed_lengths(batch: int, lo: int, hi: int, order: str, seed: int = 0) -> list[int]:
    """`batch` context lengths uniform in [lo, hi] (fixed seed), in `order`: "random" or
    "descending" (longest first: the longest work items start first, so fewer stragglers)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    return sorted(lens, reverse=True) if order == "descending" else lens


def main() -> None:
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth: {copy_bw / 1e12:.2f} TB/s")
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    cases = [(1, 512), (1, 4096), (32, 1024), (64, 640), (128, 640), (256, 640), (256, 4096)]
    for batch, ctx in cases:
        print(bench_case([ctx] * batch, copy_bw, flashinfer), flush=True)
    # Mid-run batches of the offline workload: contexts spread over 100..2047 tokens.
    for batch in (64, 150, 256):
        for order in ("random", "descending"):
            lens = mixed_lengths(batch, 100, 2047, order)
            label = f"B={batch:4d} ctx=100..2047 {order:10s}"
            print(bench_case(lens, copy_bw, flashinfer, label), flush=True)
    # The same longest-first batches (the engine's decode order) with 64-token pages.
    for batch in (64, 150, 256):
        lens = mixed_lengths(batch, 100, 2047, "descending")
        label = f"B={batch:4d} ctx=100..2047 page 64 desc"
        print(bench_case(lens, copy_bw, flashinfer, label, page=64), flush=True)


if __name__ == "__main__":
    main()
