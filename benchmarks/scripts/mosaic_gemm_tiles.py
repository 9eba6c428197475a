"""The Mosaic-GPU GEMM core's tile shapes and tile orders against cuBLAS on the H100, at the rmsnorm_matmul suite's
GEMMs: which config comes nearest to (or beats) XLA's cuBLAS call.

    PYTHONPATH=$PWD python benchmarks/scripts/mosaic_gemm_tiles.py --out $OUT [--shapes 32768x4096x4096,...] \
        [--transpose_a] [--transpose_b]

Per shape (M×K×N, bf16, y = x @ w in bf16, float32 accumulation): every config of CONFIGS that tiles the shape (the
core's default first; "auto": ``default_config`` of the shape, what ``matmul`` takes without one except at 1-8 and 16
rows, where it runs its GEMV: the ``GEMV_CONFIGS``, named "gemv*", time ``gemm.gemv``), and ``AUTO_VARIANTS`` of it),
and ``jnp.dot`` (cuBLAS), timed interleaved (CUPTI medians); each config's output checked against cuBLAS's first
(relative max difference). ``--transpose_a``: x given as (K, M), read transposed (the rmsnorm_matmul dw kernel's A,
x); cuBLAS then computes xᵀ @ w. ``--transpose_b``: w given as (N, K), read transposed (the rmsnorm_matmul dx kernel's
B, w_γ); cuBLAS then computes x @ wᵀ. Rows need not fill the tiles (x read as stored: the last row of tiles runs past
M, as in ``matmul``). The inputs rotate over 3 sets where one set fits in the L2
(``jaxfuse.suites.runner.input_sets``' rule), so that no call reads w from the L2 where the call before left it.
Writes ``mosaic_gemm_tiles-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attention_fused_bwd import results_file
from jaxfuse import bench, costmodel
from pallas_kernels.gemm import GEMV, MosaicGemmConfig, default_config, gemv, matmul, unsupported_reason
from pallas_kernels.gemm.config import PARTIAL_ROWS_MULTIPLE

BASE = MosaicGemmConfig()
CONFIGS = {
    "default_128x128_n": BASE,
    "64x256_m": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m"),
    "64x256_m_w4": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_tile_width=4),
    "64x256_m_w16": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_tile_width=16),
    "64x256_m_minor_m": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m"),
    "128x128_m": dataclasses.replace(BASE, wg_split="m"),
    "default_w4": dataclasses.replace(BASE, grid_tile_width=4),
    "default_minor_m": dataclasses.replace(BASE, grid_minor="m"),
    "64x256_m_delay1": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", delay_release=1),
    # the rmsnorm_matmul forward's tiles (H100 entries of 4096x4096x14336 and 8192x4096x6144)
    "64x256_m_minor_m_delay1": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                   delay_release=1),
    # the output tile stored under the next tile's first wgmma (epilogue_store="next_tile")
    "64x256_m_minor_m_delay1_next_tile": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m",
                                                             grid_minor="m", delay_release=1,
                                                             epilogue_store="next_tile"),
    "64x256_m_minor_m_next_tile": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                      epilogue_store="next_tile"),
    "default_next_tile": dataclasses.replace(BASE, epilogue_store="next_tile"),
    "64x256_m_minor_m_stream_k4_next_tile": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m",
                                                                grid_minor="m", stream_k=4, epilogue_store="next_tile"),
    # ping-pong: each warpgroup owns whole (tile_m, tile_n) tiles; its epilogue runs under the other's K loop
    "pingpong_128x128_s6": dataclasses.replace(BASE, schedule="pingpong", num_stages=6),
    "pingpong_128x128_s4": dataclasses.replace(BASE, schedule="pingpong", num_stages=4),
    "pingpong_128x128_s6_w16": dataclasses.replace(BASE, schedule="pingpong", num_stages=6, grid_tile_width=16),
    "pingpong_64x256_s4": dataclasses.replace(BASE, tile_m=64, tile_n=256, schedule="pingpong", num_stages=4),
    "pingpong_128x128_s6_delay1": dataclasses.replace(BASE, schedule="pingpong", num_stages=6, delay_release=1),
    "pingpong_128x128_s6_delay2": dataclasses.replace(BASE, schedule="pingpong", num_stages=6, delay_release=2),
    "pingpong_128x128_s6_delay1_minor_m": dataclasses.replace(BASE, schedule="pingpong", num_stages=6,
                                                              delay_release=1, grid_minor="m"),
    "pingpong_128x128_s6_delay1_w4": dataclasses.replace(BASE, schedule="pingpong", num_stages=6, delay_release=1,
                                                         grid_tile_width=4),
    "pingpong_128x128_s6_delay1_w16": dataclasses.replace(BASE, schedule="pingpong", num_stages=6,
                                                          delay_release=1, grid_tile_width=16),
    "pingpong_64x256_s4_delay1": dataclasses.replace(BASE, tile_m=64, tile_n=256, schedule="pingpong",
                                                     num_stages=4, delay_release=1),
    "pingpong_64x256_s4_delay2": dataclasses.replace(BASE, tile_m=64, tile_n=256, schedule="pingpong",
                                                     num_stages=4, delay_release=2),
    # 128-wide K steps (half the barrier waits, arrivals and TMA issues per FLOP), 3 stages in the same SMEM
    **{f"pingpong_128x128_k128_s3_delay{d}_minor_m": dataclasses.replace(
        BASE, schedule="pingpong", tile_k=128, num_stages=3, delay_release=d, grid_minor="m") for d in (1, 2)},
    "pingpong_128x128_k128_s3_delay1_minor_m_cluster_m": dataclasses.replace(
        BASE, schedule="pingpong", tile_k=128, num_stages=3, delay_release=1, grid_minor="m", cluster="m"),
    # clusters of two blocks sharing one operand's tiles by TMA multicast (B's along "m", A's along "n")
    "64x256_m_minor_m_cluster_m": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                      cluster="m"),
    "64x256_m_minor_m_cluster_n": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                      cluster="n"),
    "64x256_m_cluster_m": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", cluster="m"),
    "64x256_m_cluster_n": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", cluster="n"),
    # stream-K: the last rounds' tiles split by K steps over all blocks (gemm.stream_k)
    **{f"64x256_m_minor_m_stream_k{s}": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m",
                                                             grid_minor="m", stream_k=s) for s in (1, 2, 4, 8)},
    # with 3 stages, as the rmsnorm_matmul backward kernels beside their prefetched x / w tile
    "64x256_m_minor_m_stream_k4_s3": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                         stream_k=4, num_stages=3),
    "64x256_m_minor_m_s3": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                               num_stages=3),
    "default_cluster_m": dataclasses.replace(BASE, cluster="m"),
    "default_cluster_n": dataclasses.replace(BASE, cluster="n"),
    "pingpong_128x128_s6_delay1_minor_m_cluster_m": dataclasses.replace(BASE, schedule="pingpong", num_stages=6,
                                                                        delay_release=1, grid_minor="m",
                                                                        cluster="m"),
    "pingpong_128x128_s6_delay1_minor_m_cluster_n": dataclasses.replace(BASE, schedule="pingpong", num_stages=6,
                                                                        delay_release=1, grid_minor="m",
                                                                        cluster="n"),
    # tiles that do not divide N (``Fusion.partial_columns``): the last column of tiles runs past N, as cuBLAS's
    # 128x160 tiles do at 4096x4096x14336, so that the rounds come out even (64-byte swizzle where 160 needs it)
    **{f"64x{n}_m_minor_m_e32{d}": dataclasses.replace(BASE, tile_m=64, tile_n=n, wg_split="m", grid_minor="m",
                                                        epi_tile_n=32, delay_release=int(bool(d)))
       for n in (160, 192, 224) for d in ("", "_delay1")},
    "64x256_m_minor_m_e32": dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                epi_tile_n=32),
}
# cuBLAS's forward tiles at the suite's shapes (128x160, 5 stages of 64-deep K steps), which B read as stored cannot
# take at the 128-byte swizzle: with w given as (N, K) (``--transpose_b``) any tile_n takes it (K is B's minor axis)
CONFIGS.update({f"64x{n}_m_minor_m_s{s}{'_mw1' if mw == 1 else ''}": dataclasses.replace(
    BASE, tile_m=64, tile_n=n, wg_split="m", grid_minor="m", num_stages=s, epi_tile_n=32, memory_warps=mw)
    for n in (160, 192, 224) for s in (4, 5) for mw in (1, 4) if n * s < 1120})
CONFIGS.update({f"pingpong_128x160_s{s}": dataclasses.replace(
    BASE, tile_n=160, schedule="pingpong", num_stages=s, epi_tile_n=32, grid_minor="m", memory_warps=1)
    for s in (4, 5)})
# the rmsnorm_matmul dw kernel's tiles at 16384x1024x5504 (its H200 entry, without the ring tile input)
CONFIGS["64x128_m_minor_m_s6"] = dataclasses.replace(BASE, tile_m=64, tile_n=128, wg_split="m", grid_minor="m",
                                                     num_stages=6)
# the memory warpgroup's loads from one warp (``memory_warps=1``): fewer instructions per K step
CONFIGS.update({f"{name}_mw1": dataclasses.replace(CONFIGS[name], memory_warps=1) for name in (
    "pingpong_128x128_s6_delay1_minor_m", "pingpong_128x128_s6_delay1_minor_m_cluster_m", "64x256_m_minor_m_delay1",
    "64x256_m_minor_m", "64x256_m_minor_m_next_tile", "default_128x128_n", "64x128_m_minor_m_s6")})
# The ping-pong warpgroups' K loops issued in turn (``mma_turns`` at tag mma-turns-measured-b88b75c: each warpgroup
# waited for the other to have issued its whole K loop, so each K loop had the tensor cores to itself) lost at both
# short-K shapes, with one or two groups in flight: 33.5 against 32.9 µs at 8192x512x2816, 241.8 against 239.1 at
# 16384x1024x5504 (mosaic_gemm_tiles_mma_turns-h200-b88b75c.json); removed.
# The output tile stored from registers straight into global memory (no SMEM staging, no waits for TMA stores;
# ``out_store="direct"`` at a5bfb81) lost at every shape and tile: 0.61-0.89x cuBLAS against 0.93-1.01x through SMEM
# by TMA (mosaic_gemm_tiles_direct_store-h100-a5bfb81.json); removed.
# few rows (decode, small batches): 64-row tiles, two 64- or 128-wide accumulators side by side, K loops split over
# up to 4 blocks by stream-K (or whole), rings of 4-8 stages
CONFIGS.update({f"few_64x{n}n_s{s}{'_sk4' if sk else ''}": dataclasses.replace(
    BASE, tile_m=64, tile_n=n, wg_split="n", num_stages=s, stream_k=sk, memory_warps=1 if sk == 0 else 4)
    for n, s, sk in ((64, 4, 4), (64, 6, 4), (64, 8, 4), (128, 4, 4), (64, 6, 0))})
# few rows on narrow ping-pong tiles: 64-row accumulators (the rows past M TMA's zeros) 32 or 64 columns wide, so
# that N / 32 tiles give most SMs a slice of b without stream-K (the transposed GEMV's tiles are 64 of b's columns)
CONFIGS.update({f"few_pp_64x{n}_k{k}_s{s}": dataclasses.replace(
    BASE, tile_m=64, tile_n=n, tile_k=k, num_stages=s, schedule="pingpong", epi_tile_n=n, delay_release=1,
    memory_warps=1) for n, k, s in ((32, 128, 8), (32, 256, 4), (64, 128, 6))})
CONFIGS["few_64x32n_k128_s6_sk2"] = dataclasses.replace(BASE, tile_m=64, tile_n=32, tile_k=128, num_stages=6,
                                                        epi_tile_n=32, stream_k=2)
# few rows with each tile's K loop cut into parts run as tiles of their own, float32 parts summed by XLA (k_parts)
CONFIGS.update({f"few_64x{n}n_k{k}_s{s}_kp{p}": dataclasses.replace(
    BASE, tile_m=64, tile_n=n, tile_k=k, wg_split="n", num_stages=s, k_parts=p)
    for n, k, s, p in ((64, 64, 6, 2), (64, 64, 6, 4), (64, 128, 4, 4), (128, 64, 4, 2), (128, 64, 4, 4))})
CONFIGS.update({f"few_pp_64x{n}_k{k}_s{s}_kp{p}": dataclasses.replace(
    BASE, tile_m=64, tile_n=n, tile_k=k, num_stages=s, schedule="pingpong", delay_release=1, k_parts=p)
    for n, k, s, p in ((64, 128, 6, 2), (128, 128, 4, 2), (128, 64, 6, 4), (128, 64, 6, 8), (64, 64, 6, 4))})
CONFIGS["few_64x64n_k64_s6_kp8"] = dataclasses.replace(CONFIGS["few_64x64n_k64_s6_kp4"], k_parts=8)
# the GEMV (``gemm.gemv``, what ``matmul`` runs at 1-8 and 16 rows): yᵀ = wᵀ @ xᵀ, N / 64 tiles of 64 of w's columns
# ("gemv": ``gemm.GEMV``, ping-pong: each block's two warpgroups take a tile each), or 128 of them per block (the
# warpgroups stacked) with each tile's K loop split over up to 4 blocks by stream-K where the tiles leave SMs idle
# (deeper K steps: with b as stored, --transpose_b, each of a tile's 64 rows of b is read in runs of 2 tile_k bytes)
GEMV_CONFIGS = {"gemv": GEMV, "gemv_pp_k128_s8": dataclasses.replace(GEMV, tile_k=128, num_stages=8),
                "gemv_pp_k512_s2": dataclasses.replace(GEMV, tile_k=512, num_stages=2)}
GEMV_CONFIGS.update({f"gemv_sk4_k{k}_s{s}": dataclasses.replace(
    GEMV, tile_k=k, num_stages=s, schedule="cooperative", wg_split="m", stream_k=4)
    for k, s in ((64, 8), (128, 4), (128, 6), (256, 3))})
GEMV_CONFIGS["gemv_sk8_k64_s8"] = dataclasses.replace(GEMV_CONFIGS["gemv_sk4_k64_s8"], stream_k=8)
# each tile's K loop cut into P ranges run as tiles of their own, their partial rows summed by XLA (k_parts)
GEMV_CONFIGS.update({f"gemv_kp{p}_k{k}_s{s}": dataclasses.replace(GEMV, tile_k=k, num_stages=s, k_parts=p)
                     for p, k, s in ((2, 256, 4), (2, 128, 8), (4, 256, 4), (4, 128, 6), (8, 128, 4))})
GEMV_CONFIGS.update({f"gemv_kp{p}_coop_k{k}_s{s}": dataclasses.replace(
    GEMV, tile_k=k, num_stages=s, schedule="cooperative", wg_split="m", k_parts=p)
    for p, k, s in ((4, 64, 8), (4, 128, 6), (2, 128, 6), (8, 64, 8))})
# a short contraction (matmul's dB at 16 rows, ``--transpose_a`` and K = 16): one 16-deep K step, not a 64-deep one
# past K; the output's stores are the work
# (not in the default --configs)
DEPTH16 = {f"depth16_{name}": dataclasses.replace(cfg, tile_k=16, num_stages=2) for name, cfg in (
    ("64x256_m", dataclasses.replace(BASE, tile_m=64, tile_n=256, wg_split="m")), ("128x128_n", BASE),
    ("128x64_n", dataclasses.replace(BASE, tile_n=64)),
    ("pingpong_128x128", dataclasses.replace(BASE, schedule="pingpong")),
    ("pingpong_64x256", dataclasses.replace(BASE, schedule="pingpong", tile_m=64, tile_n=256)))}
CONFIGS.update(DEPTH16)
# "auto" and its variants: ``default_config`` of each shape (what ``matmul`` takes), with these fields replaced
AUTO_VARIANTS = {"auto": {}, "auto_stream_k0": dict(stream_k=0),
                 # the output stored at the tile's end, or its left half there and its right half under the next
                 # tile's first wgmma (the default: all of it under that wgmma)
                 "auto_end": dict(epilogue_store="end"), "auto_split": dict(epilogue_store="split"),
                 # the tile order: strips of w row blocks (minor "m") or of w column blocks (minor "n"); the
                 # operand along the strip streams from HBM once per strip
                 **{f"auto_{minor}{w}": dict(grid_minor=minor, grid_tile_width=w)
                    for minor, widths in (("m", (4, 8, 16, 32)), ("n", (4, 8, 16))) for w in widths},
                 # clusters of two blocks sharing B's tiles ("m") or A's ("n") by TMA multicast (no stream-K)
                 "auto_cluster_m": dict(cluster="m", stream_k=0), "auto_cluster_n": dict(cluster="n", stream_k=0),
                 # the loads from one warp of the memory warpgroup (no stream-K there)
                 "auto_mw1": dict(memory_warps=1, stream_k=0), "auto_mw1_sk": dict(memory_warps=1),
                 # the accumulator stored in wider pieces: fewer TMA stores, each piece's slot waiting for the store
                 # two pieces earlier (at a 16-deep contraction the stores are the work)
                 "auto_e128": dict(epi_tile_n=128), "auto_e256": dict(epi_tile_n=256),
                 "auto_e128_s5": dict(epi_tile_n=128, num_stages=5)}  # (a stage given up for the wider slots)
SHAPES = "32768x4096x4096,4096x4096x14336,8192x4096x6144,16384x1024x5504"


def _inputs(seed: int, M: int, K: int, N: int, transpose_a: bool, transpose_b: bool):
    """x (M, K) or (K, M), w (K, N) or (N, K): bfloat16, random, w scaled by K^-1/2."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (K, M) if transpose_a else (M, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (N, K) if transpose_b else (K, N), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
    return x, w


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("MxKxN"), default=SHAPES)
    parser.add_argument("--configs", default=",".join(name for name in CONFIGS if name not in DEPTH16))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--transpose_a", action="store_true", help="x given as (K, M), read transposed")
    parser.add_argument("--transpose_b", action="store_true", help="w given as (N, K), read transposed")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "mosaic_gemm_tiles")
    result["configs"] = {name: {**CONFIGS, **GEMV_CONFIGS}[name].to_dict() for name in args.configs.split(",")
                         if name in CONFIGS or name in GEMV_CONFIGS}
    result["transpose_a"], result["transpose_b"] = args.transpose_a, args.transpose_b
    dev = costmodel.detect()
    for M, K, N in args.shapes:
        shape = f"{M}x{K}x{N}"
        ta, t = args.transpose_a, args.transpose_b
        one_set_bytes = 2 * (M * K + K * N)
        sets = [_inputs(seed, M, K, N, ta, t) for seed in range(
            3 if dev is None or (dev.l2_bytes and one_set_bytes < dev.l2_bytes) else 1)]
        x, w = sets[0]
        rows_past = not ta  # (matmul's partial rows: A read as stored)
        calls = {"cublas": jax.jit(lambda x, w: jnp.dot(x.T if ta else x, w.T if t else w,
                                                        preferred_element_type=jnp.bfloat16))}
        row = dict(shape=shape, skipped={}, max_rel_diff={})
        for name in args.configs.split(","):
            if name in GEMV_CONFIGS:
                fn = jax.jit(lambda x, w, cfg=GEMV_CONFIGS[name]: gemv(x, w, transpose_b=t, config=cfg))
                try:  # (gemv's own checks: its rows, tiles and dtypes)
                    if ta:
                        raise ValueError("the GEMV takes x as stored (no --transpose_a)")
                    jax.eval_shape(fn, x, w)
                    calls[name] = fn
                except ValueError as e:
                    row["skipped"][name] = str(e).split("\n")[0]
                continue
            try:  # (a variant the shape's default tiles cannot take, e.g. pieces wider than its tiles)
                cfg = CONFIGS[name] if name in CONFIGS else dataclasses.replace(
                    default_config(M, N, K, partial_rows=rows_past), **AUTO_VARIANTS[name])
            except ValueError as e:
                row["skipped"][name] = str(e)
                continue
            if name in AUTO_VARIANTS:
                row[name] = cfg.to_dict()
            reason = unsupported_reason(M, N, K, cfg, partial_columns=True, partial_rows=rows_past,
                                        any_rows=rows_past and M % PARTIAL_ROWS_MULTIPLE != 0)
            if reason:
                row["skipped"][name] = reason
                continue
            calls[name] = jax.jit(lambda x, w, cfg=cfg: matmul(x, w, config=cfg, transpose_a=ta, transpose_b=t))
        want = np.asarray(calls["cublas"](x, w), np.float32)
        for name in list(calls)[1:]:
            try:
                got = np.asarray(calls[name](x, w), np.float32)
                row["max_rel_diff"][name] = float(np.abs(got - want).max() / np.abs(want).max())
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is recorded, the others run
                row["skipped"][name] = f"{type(e).__name__}: {e}"[:600]
                del calls[name]
        timings = bench.time_interleaved([(fn, sets) for fn in calls.values()], iterations=args.iterations)
        row["input_sets"] = len(sets)
        row["us"] = {name: t.median_us for name, t in zip(calls, timings)}
        row["vs_cublas"] = {name: row["us"]["cublas"] / us for name, us in row["us"].items()}
        print(shape, {k: (round(v, 1), round(row["vs_cublas"][k], 3)) for k, v in row["us"].items()}, flush=True)
        if row["skipped"]:
            print(shape, "skipped", row["skipped"], flush=True)
        result["timings"].append(row)
        save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
