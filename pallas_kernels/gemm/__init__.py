"""A Pallas Mosaic-GPU GEMM for Hopper (sm90), and the core the fused Mosaic kernels build on.

  from pallas_kernels.gemm import matmul
  c = matmul(a, b)                                    # a (M, K), b (K, N) -> (M, N); one persistent kernel
                                                      # (N a multiple of 64: a last column of tiles may run past N)
  c = matmul(a_t, b, transpose_a=True)                # a given as (K, M): read transposed from shared memory
  c = matmul(a, b_t, transpose_b=True)                # b given as (N, K)
  c = matmul(a, b, config=MosaicGemmConfig(tile_n=256, wg_split="m", tile_m=64))
  c = matmul(a, b, accumulate_into=c)                 # c + a @ b in one kernel, over c's buffer where XLA can
  c = matmul(a, b, config=MosaicGemmConfig(tile_m=64, tile_n=128, schedule="pingpong", delay_release=1, k_parts=4))
                                                      # each tile's K loop in 4 parts, float32 parts summed by XLA
  y = gemv(x, b)                                      # x (M <= 16, K): run transposed, b streamed by N / 64 tiles
  default_config(M, N, K)                             # the tiles, K loop and tile order a call uses
  gemv_config(N, K)                                   # the GEMV's (its K loop in parts where its tiles are few)

``matmul`` is differentiable: its gradients are the same kernel with the operands read transposed
(da = g @ bᵀ, db = aᵀ @ g), so no XLA transpose runs. The kernel (``gemm.mosaic``): TMA loads pipelined by a
producer warpgroup, wgmma from shared memory in two compute warpgroups, a persistent grid over output tiles, and
hooks for a prologue on the operand tiles and an epilogue on the float32 accumulator (``Fusion``), which the
fused kernels (``norm_matmul.mosaic``) use. Runs on an sm90 GPU; lowers for CUDA on any machine
(``hlo_inspect.mosaic_ir``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backends, mosaic_utils as mu
from pallas_kernels.gemm.mosaic import Fusion, MosaicGemmConfig, TileContext, gemm, smem_bytes, unsupported_reason
from pallas_kernels.gemm.config import BARRIER_BYTES, PARTIAL_ROWS_MULTIPLE, any_rows_reason

__all__ = ["CANDIDATES", "FEW_ROWS", "GEMV", "GEMV_MAX_PARTS", "GEMV_PARTS_STEPS", "PLAIN_EPILOGUE_STORE",
           "SHORT_DEPTH", "SHORT_K", "STREAM_K_MIN_STEPS", "Fusion", "MosaicGemmConfig", "TileContext",
           "default_config", "gemm", "gemv", "gemv_config", "matmul", "pick_config", "smem_bytes",
           "unsupported_reason"]

_OPERAND_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUT_DTYPES = (*_OPERAND_DTYPES, jnp.dtype(jnp.float32))


# Built-in tiles (H100), best first; each takes the config's K loop (``gemm.config``). Against cuBLAS in one run
# (benchmarks/results/mosaic_gemm_tiles-h100-1f83762.json, at 32768x4096x4096 / 4096x4096x14336 / 8192x4096x6144 /
# 8192x4096x128256): 128x256 blocks of two 64x256 accumulators stacked along M, tiles in runs of 8 along M, 0.957 /
# 0.998 / 0.981 / 0.998x, where two 128x128 accumulators side by side (the dataclass default) took 0.956 / 0.981 /
# 0.973 / 0.942x (0.966 / 0.976 / 0.969 / 0.938x in the run before). For N that 256 does not divide, ping-pong
# 128x128 tiles with one wgmma group in flight: 1.016x cuBLAS at 16384x1024x5504, where 256x128 blocks took 0.974x
# (``mosaic_gemm_tiles-h100-6ad8d32.json``); then 64-row blocks.
# A last round less than half full runs as stream-K, each of its tiles on up to 4 blocks (``gemm.stream_k``): 0.973x
# against 0.961x cuBLAS at 32768x4096x4096 (4 tiles left over), 1.014x against 1.001x at 4096x2048x11008 (56, on 2
# blocks each): mosaic_gemm_stream_k-h100-707d605.json.
_STACKED_M = MosaicGemmConfig(tile_m=64, tile_n=256, tile_k=64, num_stages=4, wg_split="m", grid_minor="m",
                              stream_k=4)
_PINGPONG = MosaicGemmConfig(tile_m=128, tile_n=128, tile_k=64, num_stages=6, schedule="pingpong", delay_release=1,
                             grid_minor="m")
CANDIDATES = (
    _STACKED_M,
    _PINGPONG,
    MosaicGemmConfig(tile_m=64, tile_n=128, tile_k=64, num_stages=4, wg_split="m"),
    MosaicGemmConfig(tile_m=64, tile_n=128, tile_k=64, num_stages=4, wg_split="n"),
    MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=64, num_stages=4, wg_split="n"),
)
# accumulate_into (a dw updated over token chunks): short K loops (K <= 512) ping-pong, one warpgroup's read, add
# and store of its c tile under the other's wgmma: 1056 µs against 1154 (two 128x128 accumulators side by side) per
# update at (H, V, Bc) = (2048, 256000, 512), 7403 against 8223 µs (cuBLAS, beta = 1) for a 5% loss's updates; at K
# = 1024 it lost (2053 against 1687 µs at 4096 x 128256): cross_entropy_dw_gemm_pingpong-h100-1f83762.json. Two
# blocks of a cluster along M sharing each dl tile (TMA multicast) took 1025 against 1060 µs per update there
# (cross_entropy_dw_gemm_cluster-h100-725a270.json); along N (sharing h_cᵀ) 1069. Plain GEMMs with long K loops
# lost under ping-pong with a cluster (0.81-0.84x cuBLAS against 0.92-0.96x: mosaic_gemm_tiles-h100-725a270.json).
# A plain product (no fusion) keeps each tile's output in registers and stores it under the next tile's first wgmma
# (``epilogue_store``): on the H100 at 32768x4096x4096 1364.8 against 1386.7 µs tile by tile (cuBLAS 1324.3), equal
# at 4096x4096x14336 and 8192x4096x6144 (mosaic_gemm_tiles_next_tile-h100-63798a7.json). The fused kernels keep
# "end": beside their hooks' registers it cost them 0.4-15% (NOTES.md, 2026-11-28, twenty-second session).
PLAIN_EPILOGUE_STORE = "next_tile"
# Stream-K pays only over long K loops: its partial sums' round trip through the float32 workspace costs about what
# a tile of 24 steps takes. H100, 64x256 stacked tiles storing under the next tile, whole tiles against stream_k=4 at
# a last round of 16-32 tiles (mosaic_gemm_tiles_stream_k_steps-h100-003728a.json, µs): 12 steps 81.5 / 90.0, 16
# steps 56.1 / 61.2, 24 steps 150.3 / 152.5, 32 steps 109.6 / 107.5, 64 steps 211.6 / 195.9. So matmul runs whole
# tiles below STREAM_K_MIN_STEPS pipeline steps.
STREAM_K_MIN_STEPS = 32
# Whole-tile products take their loads from one warp of the memory warpgroup (``MosaicGemmConfig.memory_warps``):
# the other three issued 36% of the kernel's instructions (ncu, H200, 16384x1024x5504 ping-pong: 60.3 → 38.5 M), and
# under the power limit the clock rose 1.56 → 1.57 GHz: 238.4 → 235.5 µs there; against the default tiles in one
# call, 238.7 → 236.6 at 16384x1024x5504, 257.2 against 258.0 at 1024x16384x5504 and 251.3 against 252.9 with
# A read transposed (mosaic_gemm_tiles_memory_warps*-h200-*.json, NOTES.md, forty-first session). Configs with
# stream-K keep four: one measured equal beside it (1368.3 against 1368.8 µs at 32768x4096x4096,
# mosaic_gemm_tiles_memory_warps_stream_k-h200-7047847.json).
# Short K loops (K <= SHORT_K: 8 steps of 64) take ping-pong tiles first, one warpgroup's epilogue under the other's
# K loop: on the H200 at 8192x512x2816 (the small preset's MLP projection) 33.1 µs against 38.0 for the stacked
# tiles (cuBLAS 32.1; mosaic_gemm_tiles_short_k-h200-bf1a6be.json), the tiles the H100 sweep chose for the fused
# forward there too.
_ACCUMULATE_LONG_K = MosaicGemmConfig(tile_m=128, tile_n=128, tile_k=64, num_stages=4, wg_split="n")
_ACCUMULATE_SHORT_K = MosaicGemmConfig(tile_m=128, tile_n=128, tile_k=64, num_stages=5, schedule="pingpong",
                                       delay_release=1, grid_minor="m", cluster="m")
_ACCUMULATE_SHORT_K_PAIRLESS = dataclasses.replace(_ACCUMULATE_SHORT_K, cluster="none")  # M not a pair of tiles
SHORT_K = 512  # the longest K loop (K / tile_k = 8 steps of 64) that runs ping-pong first (matmul, accumulate_into)
# Few rows (decode, small batches: M <= FEW_ROWS, one row of 64-row tiles, TMA loading zeros past M): the product
# streams b from HBM once, and its time is how many SMs pull it. 128x256 tiles gave 16 of them at 16x4096x4096 and
# 56 at 1x4096x14336 (30.1 and 43.3 µs against cuBLAS's 11.3 and 29.1 on the H200: the suite's
# pallas_mosaic_matmul_alone, rmsnorm_matmul-issue15_all-h200-aeabc73.md). 64-row tiles of two 64-wide accumulators
# side by side make N / 128 (32 and 112), and stream-K spreads each over up to 4 blocks where they fill at most half
# the SMs (``gemm.stream_k``: 128 blocks at 16x4096x4096); a deeper ring keeps more of b in flight.
FEW_ROWS = 64
_FEW_ROWS = MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=64, num_stages=6, wg_split="n", stream_k=4)
# Where those tiles are few (N / 128 times 4 parts within the SMs: N <= 4224 on 132), ping-pong 64x128 tiles with
# each K loop in 4 parts run as tiles of their own, float32 parts summed by XLA (``MosaicGemmConfig.k_parts``); in 8
# where 8 fit (N <= 2112). µs forward / b read as stored (--transpose_b), stream-K tiles → parts (cuBLAS), on the H200
# (``mosaic_gemm_tiles.py --configs auto,few_pp_64x128_k64_s6_kp4,...``, mosaic_gemm_tiles_few_kparts{,_tb}-h200-
# ead82c9.json): 17x4096x4096 15.4 / 15.3 → 12.5 / 12.5 (11.6 / 11.9); 32x4096x4096 15.5 / 15.5 → 12.6 / 12.5 (12.5 /
# 12.6); 48x4096x4096 15.6 / 15.7 → 12.6 / 12.6 (13.5 / 13.9); 64x4096x4096 16.0 / 16.2 → 13.2 / 13.1 (14.5 / 14.9);
# 32x14336x4096 35.5 / 36.4 → 31.8 / 32.7 (31.6 / 33.1); 32x8192x2048 18.8 / 18.3 → 15.5 / 15.4 (12.3 / 12.7). Other
# forms within 0.5 µs of it where they ran, none better everywhere; at N = 14336 (112 tiles) the parts lost (32 and
# 64 rows: 35.0 and 34.2 µs with stream-K, 36.0-42.8 in parts). Measured down to 8 steps a part (K = 2048), so taken
# from there. In 8 parts at N = 2048 (16 tiles; mosaic_gemm_tiles_few_kparts8{,_tb}-h200-449d733.json), 4 parts → 8
# (cuBLAS): 17x8192x2048 16.3 / 15.0 → 12.1 / 12.2 (12.1 / 12.2); 32x8192x2048 15.7 / 15.2 → 12.4 / 12.5 (12.9 /
# 13.2); 64x8192x2048 15.1 / 15.4 → 13.1 / 13.4 (14.8 / 15.0); 32x4096x2048 9.1 / 9.4 → 8.7 / 8.6 (8.3 / 8.7);
# 32x14336x2048 23.1 / 24.3 → 18.6 / 19.1 (18.5 / 19.2).
_FEW_ROWS_PARTS = MosaicGemmConfig(tile_m=64, tile_n=128, tile_k=64, num_stages=6, schedule="pingpong",
                                   delay_release=1, k_parts=4)
# Up to 16 rows (wgmma's smallest N; decode: 1-8 and 16), where the tiles above still idle most of a 64-row
# accumulator (39.1 µs at 1x4096x14336 against cuBLAS's 30.5: rmsnorm_matmul-few_rows_matmul-h200-6465dd7.md): the
# product runs transposed, yᵀ (N, 16) = bᵀ @ aᵀ, b read transposed as A in tiles of 64 of its N columns (N / 64
# blocks stream it, 256-deep K steps) and a's rows as B (TMA fills the rows past M with zeros); y's rows are the
# accumulator's first M columns (one row: its row sums), stored from registers as row vectors (no (N, 16) tile).
# norm_matmul's one-row forward measured these tiles (``norm_matmul.config.ONE_ROW_FORWARD``). dA runs the same way
# (one row, forward + backward 140.6 / 47.8 / 50.3 µs at 1x4096x14336 / 1x4096x4096 / 1x2048x8192, where dA on the
# few-row tiles took 145.5 / 51.8 / 53.9, XLA's baseline within 0.2 in both calls:
# rmsnorm_matmul-one_row_matmul-h200-{a7822d7,8075bb5}.json); dB is XLA's where M is not a multiple of 8 (an outer
# product at one row).
GEMV = MosaicGemmConfig(tile_m=64, tile_n=16, tile_k=256, num_stages=4, schedule="pingpong", epilogue_store="end",
                        delay_release=1, epi_tile_n=16)
# The GEMV with each tile's K loop cut into parts run as tiles of their own (``MosaicGemmConfig.k_parts``: float32
# partial rows, summed by XLA), GEMV's tiles otherwise. µs against cuBLAS on the H200, inputs rotated past the L2
# (``benchmarks/scripts/mosaic_gemm_tiles.py --configs gemv,gemv_kp2_k256_s4,gemv_kp4_k256_s4,...``;
# mosaic_gemm_tiles_gemv_kparts{,_da}-h200-ee4384b.json), 1 / 2 / 4 parts (cuBLAS):
#   b read transposed (the product): 16x4096x4096 13.0 / 12.2 / 12.3 (11.6); 1x4096x4096 12.6 / 11.0 / 11.0 (10.9);
#   8x4096x4096 12.8 / 11.4 / 11.6 (11.1); 16x8192x2048 19.0 / 14.4 / 11.9 (11.3); 16x14336x4096 37.6 / 31.2 / 32.0
#   (30.6); 16x4096x14336 31.3 / 33.2 / 34.7 (30.9): parts until N / 64 tiles times parts fill over half the SMs.
#   b read as stored (dA's form, --transpose_b; its N is the product's K): 16x4096x4096 12.3 / 12.3 / 12.2 (11.7);
#   1x4096x4096 12.9 / 10.9 / 10.9 (11.0); 8x4096x4096 12.9 / 11.6 / 11.5 (11.3); 16x8192x2048 18.5 / 16.9 / 12.2
#   (11.6); 16x14336x4096 35.2 / 31.6 / 31.7 (31.9); 16x4096x14336 31.9 / 32.7 / 33.5 (33.7): parts until the 256-deep
#   steps times parts reach 32, whatever the tiles (at 16x4096x14336, 64 tiles of 56 steps, parts lost).
# 8 parts (128-deep steps) were no faster, nor stacked 128-row tiles in 4 parts (64-deep steps; 30.9 against 31.2 at
# 16x14336x4096, 14.5 against 11.9 at 16x8192x2048), nor the K loop split by stream-K (partial sums through a
# workspace and semaphores, 128-row tiles, 64-deep steps): 14.5 / 16.0 / 32.0 µs forward at 16x4096x4096 /
# 16x8192x2048 / 16x14336x4096, 14.8 / 18.5 / 32.1 in dA's form (the same call).
GEMV_MAX_PARTS = 4
GEMV_PARTS_STEPS = 32  # (b read as stored) parts until a tile's K steps times parts reach this
# A contraction of at most 16 (``matmul``'s dB at up to 16 rows, --transpose_a; K = 16 here): one 16-deep step,
# where 64-deep candidates ran one step mostly of TMA's zeros. The output's stores are the work. µs against cuBLAS
# (mosaic_gemm_tiles_depth16-h200-6d21fe0.json): 4096x16x4096 10.4 (10.1), 4096x16x14336 35.1 (34.4),
# 14336x16x4096 33.9 (30.5); the 64-deep tiles took 11.97 and 37.39 for dB at 16x4096x4096 and 16x4096x14336
# (rmsnorm_matmul-gemv16_matmul-h200-b51cd3a.json). Cooperative 128x128 and ping-pong tiles were no faster. Each
# block's time is its epilogue (67% of its span at 4096x16x4096: mosaic_timeline_db16-h200-9de1619.json), 64x64
# pieces each waiting for the store two pieces earlier; in 64x128 pieces, 64x64 → 64x128 / 64x256 (cuBLAS)
# (mosaic_gemm_tiles_depth16_epi-h200-8adab26.json): 10.4 → 10.5 / 10.7 (10.0), 35.4 → 32.7 / 33.1 (34.4),
# 34.0 → 32.5 / 32.6 (30.5).
SHORT_DEPTH = 16
_SHORT_DEPTH = MosaicGemmConfig(tile_m=64, tile_n=256, tile_k=16, num_stages=2, wg_split="m", epi_tile_n=128)


def pick_config(M: int, N: int, K: int, candidates=CANDIDATES, *, partial_columns: bool = False,
                partial_rows: bool = False, partial_k: bool = False, any_rows: bool = False) -> MosaicGemmConfig:
    """The first candidate whose tiles divide (M, N, K); with ``partial_columns`` (a plain product: its last column
    of tiles may run past N), else the first whose tiles divide M and K; with ``partial_rows`` or ``partial_k``
    (``gemm``'s: the last row of tiles or K step may run past M or K; ``any_rows``: M need not be a multiple of 8),
    else the first whose tiles take the shape that way; when none does, the last (the smallest tiles: its
    ``unsupported_reason`` names the constraint no candidate meets)."""
    passes = [dict(partial_columns=False)] + ([dict(partial_columns=True)] if partial_columns else [])
    if partial_rows or partial_k:
        passes.append(dict(partial_columns=partial_columns, partial_rows=partial_rows, partial_k=partial_k,
                           any_rows=any_rows))
    for partial in passes:
        for config in candidates:
            if unsupported_reason(M, N, K, config, **partial) is None:
                return config
    return candidates[-1]


def default_config(M: int, N: int, K: int, dtype=jnp.bfloat16, *, accumulate_dtype=None, out_dtype=None,
                   partial_rows: bool = False, partial_k: bool = False) -> MosaicGemmConfig:
    """The config ``matmul`` uses without one: ``pick_config`` over the built-in candidates (tiles that divide N
    first, else a last column of tiles past N: ``gemm.Fusion.partial_columns``), ping-pong first for
    K <= SHORT_K (cooperative ones storing each output tile under the next tile's first wgmma,
    ``PLAIN_EPILOGUE_STORE``; stream-K only over K loops of ``STREAM_K_MIN_STEPS`` steps or more, whole-tile
    products loading from one warp); with
    ``accumulate_dtype`` (the dtype of ``accumulate_into``), the accumulating tiles first (ping-pong for K <= 512)
    and as many pipeline stages as fit beside the two prefetched (tile_m, tile_n) tiles of the accumulated buffer.
    ``partial_rows`` / ``partial_k`` (``gemm``'s, without accumulate_dtype): tiles whose last row or K step may run
    past M or K; a float32 ``out_dtype`` (default dtype) at M not a multiple of 8 then stores 32-column pieces, one
    swizzled row each (``config.any_rows_reason``). At M <= FEW_ROWS, 64-row tiles with their K loops in 8 or 4
    parts where their tiles are few, else split by stream-K first; at K <= SHORT_DEPTH, one 16-deep step
    (``_SHORT_DEPTH``) where its tiles take the shape."""
    if accumulate_dtype is None and K <= SHORT_DEPTH and unsupported_reason(
            M, N, K, _SHORT_DEPTH, partial_columns=True, partial_rows=partial_rows, partial_k=partial_k) is None:
        return _SHORT_DEPTH  # (as measured: whole tiles, its output stored at each tile's end)
    if accumulate_dtype is None:
        any_rows = partial_rows and M % PARTIAL_ROWS_MULTIPLE != 0
        candidates = (_PINGPONG, *CANDIDATES) if K <= SHORT_K else CANDIDATES
        if M <= FEW_ROWS and (partial_rows or M % _FEW_ROWS.cta_m == 0):
            for parts in (dataclasses.replace(_FEW_ROWS_PARTS, k_parts=8), _FEW_ROWS_PARTS):
                if (-(-N // parts.cta_n) * parts.k_parts <= mu.num_sms() and K // parts.tile_k >= 8 * parts.k_parts
                        and unsupported_reason(M, N, K, parts, partial_columns=True, partial_rows=partial_rows,
                                               any_rows=any_rows) is None):
                    return parts  # (gemm stores its float32 parts in 32-column pieces)
            candidates = (_FEW_ROWS, *candidates)
        config = pick_config(M, N, K, candidates, partial_columns=True, partial_rows=partial_rows,
                             partial_k=partial_k, any_rows=any_rows)
        if any_rows and jnp.dtype(out_dtype or dtype).itemsize == 4:
            config = dataclasses.replace(config, epi_tile_n=32)
        if K // config.tile_k < STREAM_K_MIN_STEPS:
            config = dataclasses.replace(config, stream_k=0)
        if not config.stream_k:
            config = dataclasses.replace(config, memory_warps=1)
        return config if config.pingpong else dataclasses.replace(config, epilogue_store=PLAIN_EPILOGUE_STORE)
    short_k = (_ACCUMULATE_SHORT_K, _ACCUMULATE_SHORT_K_PAIRLESS)
    config = pick_config(M, N, K, (*(short_k if K <= SHORT_K else (_ACCUMULATE_LONG_K,)), *CANDIDATES))
    while config.num_stages > 2 and smem_bytes(config, dtype, accumulate_dtype, tile_input_dtypes=(accumulate_dtype,),
                                               store_in_tile=True) > mu.H100_SMEM_BYTES - BARRIER_BYTES:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def _check(a, b, transpose_a: bool, transpose_b: bool, out_dtype) -> tuple[int, int, int]:
    for name, x in (("a", a), ("b", b)):
        if jnp.ndim(x) != 2:
            raise ValueError(f"{name}: expected a 2-D array, got shape {tuple(jnp.shape(x))}")
        if jnp.dtype(x.dtype) not in _OPERAND_DTYPES:
            raise ValueError(f"{name}: dtype {x.dtype} not supported; allowed: bfloat16, float16")
    if a.dtype != b.dtype:
        raise ValueError(f"b: dtype {b.dtype} must equal a's dtype {a.dtype}")
    M, K = a.shape[::-1] if transpose_a else a.shape
    K_b, N = b.shape[::-1] if transpose_b else b.shape
    if K_b != K:
        raise ValueError(f"b: contraction size {K_b} (shape {tuple(b.shape)}, transpose_b={transpose_b}) must equal "
                         f"a's {K} (shape {tuple(a.shape)}, transpose_a={transpose_a})")
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: {jnp.dtype(out_dtype)} not supported; allowed: bfloat16, float16, float32")
    return M, N, K


def matmul(a: jax.Array, b: jax.Array, *, config: MosaicGemmConfig | None = None, out_dtype=None,
           transpose_a: bool = False, transpose_b: bool = False, accumulate_into: jax.Array | None = None) -> jax.Array:
    """a @ b in one Mosaic-GPU kernel, float32 accumulation.

    Args:
      a: (M, K), or (K, M) with transpose_a. b: (K, N), or (N, K) with transpose_b. bfloat16 or float16, one dtype.
      config: a ``MosaicGemmConfig``, or a mapping of some of its fields over the default; default
        ``default_config(M, N, K)`` (at up to 16 rows read as stored the transposed GEMV, ``GEMV``, where b's N and K
        take its tiles). K must be a multiple of its tile_k; N of its tiles or, without accumulate_into
        or a cluster, a multiple of 64 (the last column of tiles runs past N); M of its tiles or, with a read as
        stored and no accumulate_into or cluster, any count (the last row of tiles runs past M, through untiled
        views where M is not a multiple of 8: ``gemm.config.any_rows_reason``); a ValueError names the constraint
        otherwise.
      out_dtype: default a's dtype (accumulate_into's with one); bfloat16, float16 or float32.
      accumulate_into: None, or an (M, N) array of out_dtype: the result is accumulate_into + a @ b (float32
        sum, rounded once), computed over accumulate_into's buffer when XLA can donate it (a loop carry).
    Returns:
      (M, N) in out_dtype. Gradients (custom VJP) run the same kernel on transposed reads: da (M, K) over N and
      db (K, N) over M, each with ``default_config`` of its own shape (da the GEMV over b's rows where the product
      ran one), or with a given config's tiles (their shapes must tile too; N padded to whole tiles); db's last K
      step may run past M, and where M is not a multiple of 8, XLA's GEMM computes db; accumulate_into's gradient
      is the cotangent.
    """
    if out_dtype is None:
        out_dtype = a.dtype if accumulate_into is None else accumulate_into.dtype
    out_dtype = jnp.dtype(out_dtype)
    M, N, K = _check(a, b, transpose_a, transpose_b, out_dtype)
    if accumulate_into is not None and (tuple(jnp.shape(accumulate_into)) != (M, N)
                                        or jnp.dtype(accumulate_into.dtype) != out_dtype):
        raise ValueError(f"accumulate_into: expected shape ({M}, {N}) and dtype {out_dtype} (a @ b's), got "
                         f"{tuple(jnp.shape(accumulate_into))} {jnp.dtype(accumulate_into.dtype)}")
    given = config is not None  # else each gradient GEMM takes the default of its own shape
    partial_rows = not transpose_a and accumulate_into is None  # (gemm's: A's rows are TMA's outer axis)
    if _takes_gemv(given, M, N, K, transpose_a, accumulate_into):
        config, reason = GEMV, None  # (1-8 or 16 rows: the transposed GEMV)
    else:
        config = backends.resolve_config(config, MosaicGemmConfig, lambda: default_config(
            M, N, K, a.dtype, accumulate_dtype=None if accumulate_into is None else out_dtype, out_dtype=out_dtype,
            partial_rows=partial_rows), arg="config")
        partial_rows = partial_rows and config.cluster == "none"  # (a cluster's pair of tiles: whole, as measured)
        any_rows = partial_rows and M % PARTIAL_ROWS_MULTIPLE != 0
        reason = any_rows_reason(config, a.dtype, out_dtype, transpose_b) if any_rows else None
        if reason:
            reason = f"M={M} is not a multiple of {PARTIAL_ROWS_MULTIPLE} (TMA's 8-row tiles): {reason}"
        reason = reason or unsupported_reason(M, N, K, config, partial_columns=accumulate_into is None,
                                              partial_rows=partial_rows, any_rows=any_rows)
    if not reason and not mu.interpreting() and not isinstance(a, jax.core.Tracer):  # an eager call (traced: the
        # program may be lowered elsewhere, or only shaped: jax.eval_shape)
        reason = backends.unavailable_reason("mosaic")
        if reason:
            reason += (" (lower it for CUDA inside pallas_kernels.backends.lowering_for_gpu(), or run it in GPU "
                       "interpret mode inside pallas_kernels.mosaic_utils.interpret_on_cpu())")
    if reason:
        raise ValueError(f"matmul (mosaic): {reason}")
    return _matmul(a, b, accumulate_into, (config, out_dtype, transpose_a, transpose_b, given,
                                           accumulate_into is not None))


def gemv_config(N: int, K: int, *, transpose_b: bool = False) -> MosaicGemmConfig:
    """The GEMV's tiles for b's N columns over K (``GEMV_MAX_PARTS`` says why): b (K, N) read transposed, its K loop
    in parts (``MosaicGemmConfig.k_parts``, powers of two) until its N / 64 tiles times the parts fill over half the
    SMs; b (N, K) read as stored (``transpose_b``, dA's form), until its K / 256 steps times the parts reach
    ``GEMV_PARTS_STEPS``; at most ``GEMV_MAX_PARTS``, and only as many as divide K into whole steps."""
    tiles, steps = N // GEMV.cta_m, K // GEMV.tile_k
    parts = 1
    while parts < GEMV_MAX_PARTS and (steps * parts < GEMV_PARTS_STEPS if transpose_b
                                      else tiles * parts <= mu.num_sms() // 2):
        parts *= 2
    while parts > 1 and steps % parts:
        parts //= 2
    return GEMV if parts == 1 else dataclasses.replace(GEMV, k_parts=parts)


def _gemv_takes_rows(M: int) -> bool:
    """Whether the GEMV takes M rows: at most 16 (wgmma's N), fewer than 8 or a multiple of 8 (TMA's 8-row tiles)."""
    return M <= GEMV.tile_n and (M < PARTIAL_ROWS_MULTIPLE or M % PARTIAL_ROWS_MULTIPLE == 0)


def _takes_gemv(given: bool, M: int, N: int, K: int, transpose_a: bool, accumulate_into) -> bool:
    """Whether ``matmul`` runs the GEMV (``GEMV``): at most 16 rows read as stored, fewer than 8 or a multiple of 8
    (TMA's 8-row tiles: the rows are B's, read transposed through tiled shared memory; 13 rows failed on the GPU:
    "dimension 0 must have size smaller or a multiple of its tiling 8"), no config given, no accumulate_into, and b's
    N columns and K rows in its tiles both ways (the product's, and dA's over N)."""
    return (_gemv_takes_rows(M) and not given and not transpose_a and accumulate_into is None
            and unsupported_reason(N, GEMV.tile_n, K, GEMV) is None  # y over K, and dA over N
            and unsupported_reason(K, GEMV.tile_n, N, GEMV) is None)


def gemv(a: jax.Array, b: jax.Array, *, transpose_b: bool = False, out_dtype=None,
         config: MosaicGemmConfig | None = None) -> jax.Array:
    """a @ b at 1-8 or 16 rows as the transposed GEMV ``matmul`` runs there, with a config of the caller's (to time
    its tiles); no gradient of its own: differentiate ``matmul``.

    Args:
      a: (M, K), M from 1 to 8 or 16. b: (K, N), or (N, K) with transpose_b. bfloat16 or float16, one dtype.
      out_dtype: default a's dtype; bfloat16, float16 or float32.
      config: default ``gemv_config(N, K, transpose_b=transpose_b)``; its tile_n must be 16 (a's rows) and its
        tiles must take b's N (along its tile_m) and K (k_parts · tile_k dividing K). A ValueError names what does
        not fit.
    Returns:
      (M, N) in out_dtype.
    """
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    M, N, K = _check(a, b, False, transpose_b, out_dtype)
    config = backends.resolve_config(config, MosaicGemmConfig, lambda: gemv_config(N, K, transpose_b=transpose_b),
                                     arg="config")
    if not _gemv_takes_rows(M):
        raise ValueError(f"a: {M} rows; the GEMV takes 1 to {PARTIAL_ROWS_MULTIPLE - 1}, {PARTIAL_ROWS_MULTIPLE} or "
                         f"{GEMV.tile_n} (TMA's 8-row tiles of its B operand, wgmma's 16 columns)")
    reason = (f"config.tile_n: must be {GEMV.tile_n} (the GEMV's columns are a's rows), got {config.tile_n}"
              if config.tile_n != GEMV.tile_n else
              unsupported_reason(N, config.tile_n, K, config, names=("N", "a's rows", "K")))
    if reason:
        raise ValueError(f"gemv (mosaic): {reason}")
    return _gemv(a, b, transpose_b=transpose_b, out_dtype=out_dtype, name="mosaic_gemv", config=config)


def _gemv(rows, b, *, transpose_b: bool, out_dtype, name: str, config: MosaicGemmConfig) -> jax.Array:
    """rows (M, K) @ B (K, N) -> (M, N), M <= 16, run transposed: yᵀ = Bᵀ @ rowsᵀ, B's N columns as the GEMM's rows
    (A), the rows as its 16 columns (TMA zero-fills those past M: B read transposed); y's row j is the accumulator's
    column j (one row: its row sums, the other columns being zeros). ``transpose_b``: b is given as (N, K) (Bᵀ as
    stored), else (K, N). With ``config.k_parts`` P each tile's K ranges store float32 partial rows (P · M, N), summed
    here by XLA. Unchecked (``gemv``, ``matmul``)."""
    M, N = rows.shape[0], (b.shape[0] if transpose_b else b.shape[1])
    parts = config.k_parts

    def columns(ctx, acc, carry):
        del ctx, carry
        if M == 1:
            return acc, {"y": (jnp.sum(acc, axis=1),)}
        col = mu.layout_cast(lax.broadcasted_iota(jnp.int32, acc.shape, 1), mu.TILE)
        return acc, {"y": tuple(jnp.sum(jnp.where(col == j, acc, 0.0), axis=1) for j in range(M))}

    y_type = jax.ShapeDtypeStruct((M, N), out_dtype) if parts == 1 else jax.ShapeDtypeStruct((parts * M, N),
                                                                                               jnp.float32)
    fusion = Fusion(outputs=(("y", y_type),), store_tile=False, partial_columns=True, epilogue=columns)
    y = gemm(b, rows, config=config, out_dtype=rows.dtype, transpose_a=not transpose_b, transpose_b=True,
             fusion=fusion, name=name)[1]
    return y if parts == 1 else jnp.sum(y.reshape(parts, M, N), axis=0).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(a, b, c, static):
    config, out_dtype, transpose_a, transpose_b, given, _ = static
    if config is GEMV and not given:  # (``_takes_gemv``: set by matmul itself, never a caller's config)
        N, K = (b.shape if transpose_b else b.shape[::-1])
        return _gemv(a, b, transpose_b=transpose_b, out_dtype=out_dtype, name="mosaic_matmul_gemv",
                     config=gemv_config(N, K, transpose_b=transpose_b))
    return gemm(a, b, config=config, out_dtype=out_dtype, transpose_a=transpose_a, transpose_b=transpose_b,
                accumulate_into=c, partial_rows=not transpose_a and c is None,
                name="mosaic_matmul" if c is None else "mosaic_matmul_accumulate")[0]


def _matmul_fwd(a, b, c, static):
    return _matmul(a, b, c, static), (a, b)


def _matmul_bwd(static, saved, g):
    da, db = _operand_grads(static, saved, g)
    return da, db, (g if static[-1] else None)


# N padded to this in the gradients of a product with partial columns run with the caller's config (its tile_k and
# tile_n, chosen for the forward). The default configs need no padding: every candidate's tile_k (64) divides N, which
# partial columns keep a multiple of 64, and dB's own last column of tiles runs past N as the forward's did. At
# 16384x1024x5504 on the H200 the padding (g and b padded, dB sliced) took 126 µs beside 713 for the three GEMMs
# (rmsnorm_matmul-issue15_all_core-h200-e59946c.md, pallas_mosaic_matmul_alone: 841.5 µs forward + backward);
# without it 710.7 against cuBLAS's 712.2 (rmsnorm_matmul-core_grads_unpadded-h200-878f826.md; NOTES.md, fifty-sixth
# session).
_GRAD_N_MULTIPLE = 256


def _operand_grads(static, saved, g):
    config, _, transpose_a, transpose_b, given, _ = static
    a, b = saved
    g = g.astype(a.dtype)
    (M, N), K = g.shape, a.shape[0 if transpose_a else 1]
    n_pad = -N % _GRAD_N_MULTIPLE
    if n_pad and given:  # a forward whose last column of tiles ran past N: dA contracts over N, so pad it with zeros
        g = jnp.pad(g, ((0, 0), (0, n_pad)))
        b = jnp.pad(b, ((0, n_pad), (0, 0)) if transpose_b else ((0, 0), (0, n_pad)))
        da, db = _operand_grads(static, (a, b), g)
        return da, (db[:N] if transpose_b else db[:, :N])

    def config_for(rows: int, cols: int, depth: int, **partial) -> MosaicGemmConfig:
        """A gradient GEMM's config: the given one, or the default of its (rows, cols) output over depth (the dw
        GEMM of a short-K forward has few output tiles and a long K loop, where the forward's tiles idle most
        SMs); ``partial``: ``default_config``'s partial_rows or partial_k."""
        return config if given else default_config(rows, cols, depth, a.dtype, **partial)

    # c = A B with A = a or aᵀ, B = b or bᵀ. dA = g Bᵀ, dB = Aᵀ g; each operand read as stored, transposed in SMEM.
    if config is GEMV and not given:  # at most 16 rows: da (M, K) = g Bᵀ, the GEMV over B's rows
        da = _gemv(g, b, transpose_b=not transpose_b, out_dtype=a.dtype, name="mosaic_matmul_da_gemv",
                   config=gemv_config(K, N, transpose_b=not transpose_b))
    elif transpose_a:  # a (K, M): da = B g ᵀ = (g Bᵀ)ᵀ, computed as B-rows @ gᵀ
        da = gemm(b, g, config=config_for(K, M, N), out_dtype=a.dtype, transpose_a=transpose_b, transpose_b=True,
                  name="mosaic_matmul_da")[0]
    else:  # (the forward's rows: its last row of tiles may run past M)
        da = gemm(g, b, config=config_for(M, K, N, partial_rows=True), out_dtype=a.dtype,
                  transpose_b=not transpose_b, partial_rows=True, name="mosaic_matmul_da")[0]
    if M % PARTIAL_ROWS_MULTIPLE and M > 1:  # db contracts over M, which our kernel steps through in TMA's 8-row
        # tiles: XLA's GEMM (cuBLAS) takes the rows as they are (padding a and g for ours cost a pass over each:
        # forward + backward 836.1 against 707.4 µs at 16401 and 16400 rows, x1024x5504 on the H200,
        # rmsnorm_matmul-matmul_rows-h200-9d75639.json). Below 8 rows one 8-row tile takes them, part-filled: at
        # one row XLA's dot is an outer product by a loop fusion (70.5 µs at 1x4096x14336, ours 39.0: forward +
        # backward 140.4 → 108.6), but at 4 and 7 rows its GEMM wins (104.6 → 107.5 at 4x4096x14336, 35.6 → 39.6
        # at 7x4096x4096; toggle_ab_matmul_db_below_8-h200-6d21fe0.json, 64-deep steps then). At 8-64 rows ours
        # stays: XLA's dB gained 0.6 µs at 8 and 16 x4096x4096 (35.4 → 34.8, 36.8 → 36.2) and lost 0.9-4.7
        # elsewhere (16x14336x4096 104.3 → 109.0, 64x4096x4096 38.7 → 40.9; toggle_ab_matmul_db_few_rows_by_xla-h200-
        # 60d9c2e.json, forward + backward µs, ours → XLA's).
        db = lax.dot_general(g, a, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32) if transpose_b \
            else lax.dot_general(a, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return da, db.astype(b.dtype)
    if transpose_b:  # b (N, K): db = g ᵀ A
        db = gemm(g, a, config=config_for(N, K, M, partial_k=True), out_dtype=b.dtype, transpose_a=True,
                  transpose_b=transpose_a, partial_k=not transpose_a, name="mosaic_matmul_db")[0]
    else:
        db = gemm(a, g, config=config_for(K, N, M, partial_k=True), out_dtype=b.dtype, transpose_a=not transpose_a,
                  partial_k=not transpose_a, name="mosaic_matmul_db")[0]
    return da, db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
