"""Compile every kernel ahead of time for NVIDIA targets, on any machine (no GPU needed).

`python -m kernels.compile_check [--quick]` lowers each kernel, in the configurations the wrappers launch,
through Triton's full pipeline (TTIR → TTGIR → LLVM → PTX → cubin with the bundled ptxas) for
sm_80 and sm_90, and fails if a kernel does not compile, spills registers or needs more shared
memory than the target has (all 104 configurations: about a minute of CPU; `--quick`: sm_90,
head_dim 128, bf16/fp32, GQA groups 2 and 3, a few seconds). The CPU tests run it in a subprocess: Triton must not be in
interpreter mode for this, and a process cannot have both.

Exit status: 0 when all compile, 1 otherwise (the failures are printed).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.decode_attention import _decode_reduce_kernel, _decode_stage1_kernel  # noqa: E402
from kernels.extend_attention import _extend_kernel  # noqa: E402
from kernels.rmsnorm import _rmsnorm_kernel  # noqa: E402
from kernels.rotary import _rotary_kernel  # noqa: E402
from kernels.silu_mul import _silu_mul_kernel  # noqa: E402
from kernels.store_kv import _store_kv_kernel  # noqa: E402

# Shared memory per block (bytes, opt-in maximum) of each target.
TARGETS = {80: 166912, 90: 232448}
FLOAT_ARGS = {"sm_scale_log2", "eps"}


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
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
    """The layers' kernels (RMSNorm, rotary, SiLU-mul) at Qwen3-0.6B-like sizes."""
    for dt in ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32"):
        for block_d, warps in ((128, 1), (1024, 4), (4096, 8)):
            yield (
                _rmsnorm_kernel,
                {"x_ptr": dt, "w_ptr": dt, "out_ptr": dt},
                dict(BLOCK_D=block_d),
                warps,
                3,
            )
        yield (
            _rotary_kernel,
            {
                "q_ptr": dt,
                "k_ptr": dt,
                "q_out_ptr": dt,
                "k_out_ptr": dt,
                "pos_ptr": "i64",
                "cos_ptr": "fp32",
                "sin_ptr": "fp32",
            },
            dict(BLOCK_HQ=16, BLOCK_HK=8, BLOCK_HALF=64),
            4,
            3,
        )
        yield (_silu_mul_kernel, {"x_ptr": dt, "out_ptr": dt}, dict(BLOCK=1024), 4, 3)


def main(argv: list[str] | None = None) -> int:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    targets = {90: TARGETS[90]} if quick else TARGETS
    failures = []
    count = 0
    configs = list(_configs(quick)) + list(_layer_configs(quick))
    for fn, pointers, constexprs, warps, stages in configs:
        sig = _signature(fn, {k: "*" + v for k, v in pointers.items()}, constexprs)
        for arch, smem_limit in targets.items():
            count += 1
            what = f"{fn.__name__} sm_{arch} {pointers} {constexprs} warps={warps}"
            try:
                kernel = triton.compile(
                    ASTSource(fn, sig, constexprs),
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
