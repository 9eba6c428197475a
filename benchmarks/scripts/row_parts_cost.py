"""What sharing a row statistic among a row block's tiles costs the Mosaic GEMM core (``gemm.Fusion.row_parts``).

    PYTHONPATH=$PWD python benchmarks/scripts/row_parts_cost.py --out $OUT [--shape 16384x1024x5504]

At one shape (M×K×N, bf16 x @ w, float32 accumulation, bf16 out) with the rmsnorm_matmul forward's tiles there (its
tuned entry on this device), timed interleaved (CUPTI medians): the plain core; r from XLA's sums of squares
("sum_sq" in: the forward as it runs by default, tiles in snake order); the parts' protocol alone, the tiles walked
row-major, with one contributing column block or 16, each part zeros (no loads); and stats_in_kernel "spread" (16
parts, each the squares of a 64-wide block of x loaded from GMEM). Splits the spread forward's cost into the order,
the waits and the loads. Outputs checked against the first r-scaled one. Writes ``row_parts_cost-<device>.json``.
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
from pallas_kernels.gemm import Fusion, gemm
from pallas_kernels.norm_matmul import config as nm_config
from pallas_kernels.norm_matmul import mosaic as nm

EPS = 1e-6


def _zero_parts(M: int, K: int, num_parts: int) -> Fusion:
    """row_parts with parts of zeros: y = r ⊙ acc with r = rsqrt(eps) (the protocol and the row-major order alone)."""
    return Fusion(outputs=(("rstd", jax.ShapeDtypeStruct((M,), jnp.float32)),
                           ("parts", jax.ShapeDtypeStruct((num_parts, M), jnp.float32))),
                  row_parts=("parts", num_parts,
                             lambda ctx: mu.layout_cast(jnp.zeros((ctx.config.tile_m,), jnp.float32), mu.ROWS)),
                  epilogue=lambda ctx, acc, carry: (acc, {"rstd": carry[0]}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", type=bench.shape_arg("MxKxN"), default="16384x1024x5504")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    M, K, N = args.shape
    config = dataclasses.replace(nm_config.mosaic_default_config(M, K, N).forward, stream_k=0)
    result, save, path = results_file(args.out, "row_parts_cost")
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    sum_sq = jnp.sum(x32 * x32, axis=1)
    variants = {  # name -> (fusion, arrays)
        "plain": (None, {}),
        "sum_sq_in": (nm._forward_fusion(M, K, EPS, config, False), dict(sum_sq=sum_sq)),
        "parts1_zero": (_zero_parts(M, K, 1), {}),
        "parts16_zero": (_zero_parts(M, K, 16), {}),
        "spread": (nm._forward_fusion(M, K, EPS, config, "spread", N=N), dict(x_rows=x)),
    }
    fns = {name: jax.jit(lambda x, w, arrays, _f=fusion: gemm(x, w, config=config, out_dtype=jnp.bfloat16,
                                                                fusion=_f, arrays=arrays))
           for name, (fusion, _) in variants.items()}
    outs = {name: fn(x, w, variants[name][1]) for name, fn in fns.items()}
    ref = np.asarray(outs["sum_sq_in"][0], np.float32)
    row = dict(shape=f"{M}x{K}x{N}", config=config.to_dict(),
               max_rel_diff_spread=float(np.abs(np.asarray(outs["spread"][0], np.float32) - ref).max()
                                         / np.abs(ref).max()))
    timings = bench.time_interleaved([(fn, (x, w, variants[name][1])) for name, fn in fns.items()],
                                     iterations=args.iterations)
    row["us"] = {name: t.median_us for name, t in zip(fns, timings)}
    result["timings"].append(row)
    save()
    print(row, f"wrote {path}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
