"""What a prologue costs the Mosaic GEMM core, by where it runs (``MosaicGemmConfig.prologue_in``), on the H100.

    PYTHONPATH=$PWD python benchmarks/scripts/gemm_prologue_cost.py --out $OUT [--shape 32768x4096x4096]

At one shape (M×K×N, bf16 x @ w, float32 accumulation, bf16 out), timed interleaved (CUPTI medians): the plain core
with stacked 64x256 accumulators and with 128x128 side by side (whole tiles, no stream-K); the same with a
prologue in the memory warpgroup that only passes its carry on ("noop": the handoff protocol alone) or sums each
row of A over K ("row_sums": the rmsnorm statistics' work), at the default 72 memory registers and at 104
(mma_registers=200); and the row sums in a fourth warpgroup with the 128x128 tiles. Each output is checked against
the plain core's (product) and against A's float32 row sums. Writes ``gemm_prologue_cost-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attention_fused_bwd import results_file
from jaxfuse import bench
from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm import Fusion, MosaicGemmConfig, gemm

STACKED = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m")
SIDE_BY_SIDE = MosaicGemmConfig()
MEMORY = dataclasses.replace(STACKED, prologue_in="memory")
VARIANTS = {  # name -> (config, prologue step or None)
    "plain_64x256_m": (STACKED, None),
    "plain_128x128_n": (SIDE_BY_SIDE, None),
    "memory_noop": (MEMORY, "noop"),
    "memory_row_sums": (MEMORY, "row_sums"),
    "memory_row_sums_r200": (dataclasses.replace(MEMORY, mma_registers=200), "row_sums"),
    "fourth_row_sums_128x128_n": (SIDE_BY_SIDE, "row_sums"),
}


def _fusion(M: int, step: str) -> Fusion:
    def row_sums(ctx, a_ref, sums):
        del ctx
        return sums + jnp.sum(mu.load(a_ref, layout=mu.TILE).astype(jnp.float32), axis=1)

    return Fusion(outputs=(("sums", jax.ShapeDtypeStruct((M,), jnp.float32)),), handoff_rows=1,
                  prologue_init=lambda ctx: mu.layout_cast(jnp.zeros((ctx.config.cta_m,), jnp.float32), mu.ROWS),
                  prologue_step=row_sums if step == "row_sums" else (lambda ctx, a_ref, sums: sums),
                  epilogue=lambda ctx, acc, sums: (acc, {"sums": sums}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", type=bench.shape_arg("MxKxN"), default="32768x4096x4096")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    M, K, N = args.shape
    result, save, path = results_file(args.out, "gemm_prologue_cost")
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    fns = {}
    for name, (config, step) in VARIANTS.items():
        fusion = None if step is None else _fusion(M, step)
        fns[name] = jax.jit(lambda x, w, _c=config, _f=fusion: gemm(x, w, config=_c, out_dtype=jnp.bfloat16,
                                                                      fusion=_f))
    outs = {name: fn(x, w) for name, fn in fns.items()}
    ref = np.asarray(outs["plain_64x256_m"][0], np.float32)
    sums = np.asarray(x, np.float64).sum(axis=1)
    row = dict(shape=f"{M}x{K}x{N}", configs={n: c.to_dict() for n, (c, _) in VARIANTS.items()}, max_rel_diff={},
               sums_max_abs_err={})
    for name, out in outs.items():
        got = np.asarray(out[0], np.float32)
        row["max_rel_diff"][name] = float(np.abs(got - ref).max() / np.abs(ref).max())
        if VARIANTS[name][1] == "row_sums":
            row["sums_max_abs_err"][name] = float(np.abs(np.asarray(out[1], np.float64) - sums).max())
    timings = bench.time_interleaved([(fn, (x, w)) for fn in fns.values()], iterations=args.iterations)
    row["us"] = {name: t.median_us for name, t in zip(fns, timings)}
    result["timings"].append(row)
    save()
    print(row["us"], row["max_rel_diff"], row["sums_max_abs_err"], f"wrote {path}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
