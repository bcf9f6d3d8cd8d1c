"""Compile every kernel ahead of time for NVIDIA targets, on any machine (no GPU needed).

`python -m kernels.compile_check [--quick] [--aligned]` lowers each kernel, in the configurations
the wrappers launch, through Triton's full pipeline (TTIR → TTGIR → LLVM → PTX → cubin with the
bundled ptxas) for sm_80 and sm_90, and fails if a kernel does not compile, spills registers or
needs more shared memory than the target has.

All 173 configurations × 2 targets = 346 compilations (about 2 minutes of CPU): the
attention kernels (52), the layer kernels incl. fused add + RMSNorm and q/k-norm + RoPE with
and without the K/V store (33), the sampler's Gumbel-max kernels (9: bf16 and float32 logits),
and the skinny GEMM (`kernels/linear.py`: the 15 distinct tiles
`candidate_configs` yields for Qwen3-0.6B's projections at M = 1..256 × bf16/fp16 × bias or
not, the same tiles' split-K fix-up variant in bf16 without bias, plus 4 split-K reduces).
`--quick` (what the CPU tests run, a few seconds): sm_90 only, 28 configurations: attention at head_dim 128, bf16/fp32, GQA groups 2 and 3; the older layer
kernels in bf16/fp32; one bf16 configuration of each kernel added since (fused add + RMSNorm,
q/k-norm + RoPE + K/V store, Gumbel chunk + chunk argmax, skinny GEMM with and without the
fix-up + split-K reduce). The CPU tests run
it in a subprocess: Triton must not be in interpreter mode for this, and a process cannot have
both.

By default the arguments carry no alignment hints, so Triton compiles its generic variant, whose
loads it can neither vectorize nor software-pipeline (no cp.async, one stage of shared memory).
`--aligned` also compiles each configuration as the launcher specializes it for aligned tensors
(every pointer 16-byte aligned, every specializable integer a multiple of 16, as Qwen3-0.6B's
sizes mostly are): vectorized, pipelined loads and more shared memory (e.g. the skinny GEMM's
64x64x128 tile: 32 KB → 128 KB on sm_90). That doubles the compilations.

Exit status: 0 when all compile, 1 otherwise (the failures are printed).
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any, NamedTuple

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.decode_attention import _decode_reduce_kernel, _decode_stage1_kernel  # noqa: E402
from kernels.extend_attention import _extend_kernel  # noqa: E402
from kernels.linear import _REDUCE_BLOCK, MAX_M, candidate_configs  # noqa: E402
from kernels.linear_kernels import _skinny_linear_kernel, _splitk_reduce_kernel  # noqa: E402
from kernels.rmsnorm import _fused_add_rmsnorm_kernel, _rmsnorm_kernel  # noqa: E402
from kernels.rotary import _rotary_kernel  # noqa: E402
from kernels.sampling import BLOCK as SAMPLING_BLOCK  # noqa: E402
from kernels.sampling import _chunk_argmax_kernel, _gumbel_chunk_kernel  # noqa: E402
from kernels.silu_mul import _silu_mul_kernel  # noqa: E402
from kernels.store_kv import _store_kv_kernel  # noqa: E402

# Shared memory per block (bytes, opt-in maximum) of each target.
TARGETS = {80: 166912, 90: 232448}
FLOAT_ARGS = {"sm_scale_log2", "eps", "inv_temp"}
# Qwen3-0.6B: hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072, vocab 151,936.
QWEN3_VOCAB = 151936
# The (N, K) of its projections (`tritonllm.layers.Linear`): fused qkv, o_proj, fused gate/up,
# down_proj, lm_head.
QWEN3_PROJECTIONS = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (QWEN3_VOCAB, 1024))
H200_SMS = 132
_PDL_SWITCHES = {"PDL"}


class Launch(NamedTuple):
    """One compiled configuration: the kernel, its pointer arguments' element types, its
    constexprs, num_warps, num_stages, and the scalar arguments that are neither i32 nor in
    FLOAT_ARGS (name -> Triton type, e.g. `{"offset": "i64"}`)."""

    fn: Any  # a triton.JITFunction
    pointers: dict[str, str]
    constexprs: dict
    num_warps: int
    num_stages: int
    scalars: dict[str, str] = {}


def _signature(
    fn, pointers: dict[str, str], constexprs: dict, scalars: dict[str, str] | None = None
) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif scalars and name in scalars:
            sig[name] = scalars[name]
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return sig


def _configs(quick: bool):
    """(kernel, pointer types, constexprs, num_warps, num_stages) as the wrappers launch them."""
    for dt in ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32"):
        fp32 = dt == "fp32"
        for head_dim in (128,) if quick else (64, 128):
            for group in (2, 3) if quick else (1, 2, 3, 4, 8):
                yield (
                    _decode_stage1_kernel,
                    {
                        "q_ptr": dt,
                        "k_cache_ptr": dt,
                        "v_cache_ptr": dt,
                        "page_table_ptr": "i32",
                        "seq_lens_ptr": "i32",
                        "part_o_ptr": "fp32",
                        "part_lse_ptr": "fp32",
                    },
                    dict(
                        GROUP=group,
                        BLOCK_H=max(16, triton.next_power_of_2(group)),
                        BLOCK_N=32 if fp32 else 64,
                        BLOCK_D=head_dim,
                        UPCAST=False,
                        FP32_DOT=fp32,
                    ),
                    4,
                    2,
                )
            for block_m, block_n, warps in ((128, 64, 8), (64, 32, 4)):
                if fp32 and block_m == 128:
                    continue  # the wrapper uses the small tiles for float32
                yield (
                    _extend_kernel,
                    {
                        "q_ptr": dt,
                        "k_cache_ptr": dt,
                        "v_cache_ptr": dt,
                        "out_ptr": dt,
                        "page_table_ptr": "i32",
                        "seq_lens_ptr": "i32",
                        "cu_extend_lens_ptr": "i32",
                    },
                    dict(
                        GROUP=2,
                        BLOCK_M=block_m,
                        BLOCK_N=block_n,
                        BLOCK_D=head_dim,
                        UPCAST=False,
                        FP32_DOT=fp32,
                    ),
                    warps,
                    2,
                )
            yield (
                _decode_reduce_kernel,
                {"part_o_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": dt},
                dict(BLOCK_S=32, BLOCK_D=head_dim),
                4 if head_dim >= 128 else 2,
                3,
            )
            yield (
                _store_kv_kernel,
                {"k_ptr": dt, "v_ptr": dt, "k_cache_ptr": dt, "v_cache_ptr": dt, "loc_ptr": "i64"},
                dict(BLOCK_H=8, BLOCK_D=head_dim),
                4,
                3,
            )


def _layer_configs(quick: bool):
    """The layers' kernels (RMSNorm, rotary, SiLU-mul, fused add + RMSNorm, fused q/k-norm +
    rotary) at Qwen3-0.6B-like sizes."""
    for dt in ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32"):
        for block_d, warps in ((128, 1), (1024, 4), (4096, 8)):
            yield (
                _rmsnorm_kernel,
                {"x_ptr": dt, "w_ptr": dt, "out_ptr": dt},
                dict(BLOCK_D=block_d),
                warps,
                3,
            )
        # RoPE alone (Qwen2/Llama, `rotary` without norm weights or a KV store).
        yield (
            _rotary_kernel,
            _rotary_pointers(dt),
            dict(BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64, NORM=False, STORE=False),
            4,
            3,
        )
        yield (_silu_mul_kernel, {"x_ptr": dt, "out_ptr": dt}, dict(BLOCK=1024), 4, 3)
        if quick and dt != "bf16":
            continue  # --quick: one bf16 configuration of each fused kernel below
        # Fused residual add + RMSNorm (`fused_add_rmsnorm`): hidden 1024 is (1024, 4 warps);
        # the other two sizes follow the RMSNorm matrix.
        for block_d, warps in ((1024, 4),) if quick else ((128, 1), (1024, 4), (4096, 8)):
            yield (
                _fused_add_rmsnorm_kernel,
                {"x_ptr": dt, "res_ptr": dt, "w_ptr": dt, "out_ptr": dt, "res_out_ptr": dt},
                dict(BLOCK_D=block_d),
                warps,
                3,
            )
        # Qwen3's q/k RMSNorm + RoPE (`rotary` with norm weights): 16 q heads, 8 kv heads, D 128;
        # what the engine launches stores K/V into the cache in the same kernel (STORE).
        for norm, store in (
            ((True, True),) if quick else ((True, True), (True, False), (False, True))
        ):
            yield (
                _rotary_kernel,
                _rotary_pointers(dt),
                dict(BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64, NORM=norm, STORE=store),
                4,
                3,
            )


def _rotary_pointers(dt: str) -> dict[str, str]:
    """Pointer types of `_rotary_kernel` for activations and KV cache of dtype `dt`."""
    names = ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "q_w_ptr", "k_w_ptr", "v_ptr")
    return {
        **dict.fromkeys(names, dt),
        "k_cache_ptr": dt,
        "v_cache_ptr": dt,
        "pos_ptr": "i64",
        "cos_ptr": "fp32",
        "sin_ptr": "fp32",
        "loc_ptr": "i64",
    }


def _sampling_configs(quick: bool):
    """The sampler's Gumbel-max kernels (`kernels.sampling.gumbel_argmax`) on Qwen3-0.6B's vocab:
    the model's bf16 logits (and float32 ones, after penalties); one shared inverse temperature
    (a scalar) or one per row (a pointer); `offset` is always >= 2^32 (int64); `seed` is int32
    for the default seed 0, int64 for seeds outside int32; the iteration count is a runtime
    argument (one variant for all); with seeded rows, each row's key and counter base come
    from int64 pointers (`PER_ROW_SEED`)."""
    for logits in ("bf16",) if quick else ("bf16", "fp32"):
        for per_row in (False,) if quick else (False, True):
            for seed in ("i32",) if quick else ("i32", "i64"):
                for per_row_seed in (False,) if quick else (False, True):
                    yield (
                        _gumbel_chunk_kernel,
                        {
                            "logits_ptr": logits,
                            "inv_temp_ptr": "fp32",
                            "row_seed_ptr": "i64",
                            "row_offset_ptr": "i64",
                            "chunk_val_ptr": "fp32",
                            "chunk_idx_ptr": "i32",
                        },
                        dict(
                            BLOCK=SAMPLING_BLOCK,
                            PER_ROW_TEMP=per_row,
                            PER_ROW_SEED=per_row_seed,
                            FAST_LOG=True,
                        ),
                        max(1, min(4, SAMPLING_BLOCK // 256)),
                        3,
                        {"seed": seed, "offset": "i64", "iters": "i32", "num_chunks": "i32"},
                    )
    yield (
        _chunk_argmax_kernel,
        {"chunk_val_ptr": "fp32", "chunk_idx_ptr": "i32", "out_ptr": "i64"},
        dict(BLOCK_C=triton.next_power_of_2(triton.cdiv(QWEN3_VOCAB, SAMPLING_BLOCK))),
        1,
        3,
    )


def _linear_configs(quick: bool):
    """The skinny GEMM (`kernels.linear.skinny_linear`): every candidate of `candidate_configs`
    for Qwen3-0.6B's projections at every M it serves (1..MAX_M), bf16/fp16, with and without
    bias, deduplicated by what is compiled (M and split_k are not specialized); the split-K
    reduce kernel for each dtype and bias. `--quick`: bf16, no bias, the first candidate at M=1
    of the qkv projection, and the reduce."""
    # ((tile), num_stages, EVEN_K), in first-seen order; the SM count sets only split_k
    tiles: dict[tuple[tuple[bool, int, int, int, int], int, bool], None] = {}
    for n, k in QWEN3_PROJECTIONS[:1] if quick else QWEN3_PROJECTIONS:
        for m in (1,) if quick else range(1, MAX_M + 1):
            candidates = candidate_configs(m, n, k, H200_SMS)
            for cfg in candidates[:1] if quick else candidates:
                tile = (cfg.use_dot, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps)
                tiles[(tile, cfg.num_stages, k % cfg.block_k == 0)] = None
    for dt in ("bf16",) if quick else ("bf16", "fp16"):
        for bias in (False,) if quick else (False, True):
            # The split-K fix-up variant (`LinearConfig.fixup`): bf16 without bias, as the
            # Qwen3 projections run.
            fixups = (False, True) if dt == "bf16" and not bias else (False,)
            for (
                (use_dot, block_m, block_n, block_k, warps),
                stages,
                even_k,
            ), fixup in itertools.product(tiles, fixups):
                yield (
                    _skinny_linear_kernel,
                    {
                        "x_ptr": dt,
                        "w_ptr": dt,
                        "b_ptr": dt,  # the bias, or `out` standing in for it
                        "out_ptr": dt,
                        "part_ptr": "fp32",
                        "lock_ptr": "i32",
                    },
                    dict(
                        BLOCK_M=block_m,
                        BLOCK_N=block_n,
                        BLOCK_K=block_k,
                        USE_DOT=use_dot,
                        EVEN_K=even_k,
                        HAS_BIAS=bias,
                        UPCAST=False,
                        NUM_STAGES=stages,
                        FIXUP=fixup,
                    ),
                    warps,
                    stages,
                )
            yield (
                _splitk_reduce_kernel,
                {"part_ptr": "fp32", "b_ptr": dt, "out_ptr": dt},
                dict(BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias),
                4,
                3,
            )


def _aligned_attrs(fn, pointers: dict[str, str], sig: dict[str, str]) -> dict:
    """Triton's `tt.divisibility = 16` hints on every pointer and every integer argument the
    launcher may specialize (not in the kernel's `do_not_specialize`): what `fn[grid](...)`
    compiles for 16-byte-aligned tensors and sizes/strides that are multiples of 16."""
    fixed = {fn.arg_names[a] if isinstance(a, int) else a for a in fn.do_not_specialize}
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name in pointers or (sig[name] in ("i32", "i64") and name not in fixed)
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    quick = "--quick" in args
    variants = (False, True) if "--aligned" in args else (False,)
    targets = {90: TARGETS[90]} if quick else TARGETS
    failures = []
    count = 0
    configs = [
        Launch(*config)
        for gen in (_configs, _layer_configs, _sampling_configs, _linear_configs)
        for config in gen(quick)
    ]
    for fn, pointers, constexprs, warps, stages, scalars in configs:
        for (arch, smem_limit), aligned in itertools.product(targets.items(), variants):
            # PDL exists from sm_90, where the wrappers turn it on (`kernels.pdl`).
            pdl = {c: arch >= 90 for c in _PDL_SWITCHES & set(fn.arg_names)}
            constexprs = {**constexprs, **pdl}
            sig = _signature(fn, {k: "*" + v for k, v in pointers.items()}, constexprs, scalars)
            count += 1
            what = (
                f"{fn.__name__} sm_{arch} {pointers} {scalars or ''} {constexprs} "
                f"warps={warps} stages={stages}{' aligned' if aligned else ''}"
            )
            attrs = _aligned_attrs(fn, pointers, sig) if aligned else None
            try:
                kernel = triton.compile(
                    ASTSource(fn, sig, constexprs, attrs),
                    target=GPUTarget("cuda", arch, 32),
                    options={"num_warps": warps, "num_stages": stages},
                )
            except Exception as exc:  # report every failing configuration, not just the first
                failures.append(f"{what}: {type(exc).__name__}: {exc}")
                continue
            if kernel.metadata.shared > smem_limit:
                failures.append(f"{what}: shared memory {kernel.metadata.shared} > {smem_limit}")
            if "ld.local" in kernel.asm["ptx"]:
                failures.append(f"{what}: spills registers to local memory")
    for line in failures:
        print("FAIL", line)
    print(f"compiled {count - len(failures)}/{count} kernel configurations")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
