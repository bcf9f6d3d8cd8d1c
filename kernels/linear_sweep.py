"""Candidate configurations of the skinny GEMM for `kernels.bench_linear` to time against cuBLAS.

Three families per `[m, k] x [n, k]` product, each timed for its best member:

- `tuned`: `kernels.linear.candidate_configs`, what `TRITONLLM_LINEAR_KERNEL=triton|auto` tries today;
- `sweep`: more tiles (for M <= 8 five GEMV tiles, from 8 x 512 to 32 x 128 weight elements per
  step, and three padded-MMA tiles; for larger M five MMA tiles, up to 128 x 128), each with
  split-K 1, the automatic split (`_auto_split_k`: >= 2 programs per SM) and twice that, the
  splits reduced by the second kernel;
- `fixup`: the sweep's split configurations reduced in the same launch by each tile's last
  program (`LinearConfig.fixup`), which saves the reduce kernel's launch and its ramp.

Nothing here is used by the engine: what wins once measured is folded into `candidate_configs`.
"""

from __future__ import annotations

import triton

from kernels.linear_configs import _SPLIT_K_MAX, LinearConfig, _auto_split_k, candidate_configs

FAMILIES = ("tuned", "sweep", "fixup")

# (block_n, block_k, num_warps, num_stages) of the GEMV tiles (M <= 8, no tl.dot).
_GEMV_TILES = ((16, 256, 4, 3), (32, 128, 4, 3), (16, 512, 4, 3), (32, 256, 8, 4), (8, 512, 2, 4))
# (block_n, block_k, num_warps, num_stages) of the MMA tiles at M <= 8 (block_m 16) ...
_SMALL_MMA_TILES = ((64, 128, 4, 4), (128, 64, 4, 4), (64, 256, 4, 3))
# ... at 8 < M <= 64 (block_m = M rounded up to a power of 2) ...
_MID_MMA_TILES = (
    (64, 128, 4, 4),
    (128, 64, 4, 4),
    (64, 256, 4, 3),
    (128, 128, 8, 3),
    (32, 128, 4, 4),
)
# ... and (block_m, block_n, block_k, num_warps, num_stages) at M > 64.
_LARGE_MMA_TILES = (
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (64, 64, 128, 4, 4),
    (64, 128, 128, 8, 3),
    (128, 64, 128, 8, 3),
)


def _tiles(m: int) -> list[tuple[bool, int, int, int, int, int]]:
    """(use_dot, block_m, block_n, block_k, num_warps, num_stages) tried at `m` rows."""
    bm = triton.next_power_of_2(m)
    if m <= 8:
        gemv = [(False, bm, *t) for t in _GEMV_TILES]
        return gemv + [(True, 16, *t) for t in _SMALL_MMA_TILES]
    if m <= 64:
        return [(True, max(16, bm), *t) for t in _MID_MMA_TILES]
    return [(True, *t) for t in _LARGE_MMA_TILES]


def _splits(m: int, n: int, k: int, tile: tuple, sms: int) -> list[int]:
    """1, the automatic split and twice it, each keeping >= one BLOCK_K step per K-range."""
    _, block_m, block_n, block_k, _, _ = tile
    auto = _auto_split_k(m, n, k, block_m, block_n, block_k, sms)
    out = []
    for s in (1, auto, 2 * auto):
        if s not in out and s <= _SPLIT_K_MAX and k >= s * block_k:
            out.append(s)
    return out


def sweep_configs(m: int, n: int, k: int, sms: int) -> dict[str, list[LinearConfig]]:
    """The configurations of each family (`FAMILIES`) for an `[m, k] x [n, k]` product on a
    GPU with `sms` SMs, without duplicates within a family."""
    sweep = []
    for tile in _tiles(m):
        use_dot, block_m, block_n, block_k, warps, stages = tile
        for s in _splits(m, n, k, tile, sms):
            cfg = LinearConfig(use_dot, block_m, block_n, block_k, s, warps, stages)
            if cfg not in sweep:
                sweep.append(cfg)
    return {
        "tuned": candidate_configs(m, n, k, sms),
        "sweep": sweep,
        "fixup": [c._replace(fixup=True) for c in sweep if c.split_k > 1],
    }


def compile_key(cfg: LinearConfig, k: int) -> tuple:
    """What Triton compiles a configuration into (M and split_k are not specialized; the split
    only matters as to whether the fix-up runs)."""
    fixup = cfg.fixup and cfg.split_k > 1
    tile = (cfg.use_dot, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    return (*tile, fixup, k % cfg.block_k == 0)
