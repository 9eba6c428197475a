"""What the rmsnorm_matmul forward's row scaling costs its GEMM kernel, part by part, at the forward's own tiles.

    PYTHONPATH=$PWD python benchmarks/scripts/forward_epilogue_cost.py --out $OUT \
        [--shapes 8192x512x2816,16384x1024x5504] [--iterations 30]

Per shape (M×K×N, bf16, the shape's Mosaic forward config: its tuned entry on this device, or the built-in tiles),
timed interleaved (CUPTI medians of the kernels), A = x ⊙ gamma as the forward with gamma_on "x" reads it:
  cublas         jnp.dot (XLA's cuBLAS call)
  plain          the GEMM core alone (``gemm.matmul``)
  scale_const    an epilogue multiplying the accumulator by a constant (the epilogue's arithmetic, no input)
  load_rows      the rows' (M,) float32 sums of squares loaded at the tile's start and multiplied in unchanged
  r_from_sums    the forward's fusion: r = rsqrt(sum / K + eps) formed in the epilogue from the loaded sums
  program        the whole forward, ``rmsnorm_matmul(x, gamma, w, backend="mosaic")``: its GEMM kernel alone
                 ("program_kernel") and every kernel of the program ("program")
Each fused output is checked against r ⊙ cuBLAS's product (relative max difference). Writes
``forward_epilogue_cost-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attention_fused_bwd import results_file
from jaxfuse import bench
from pallas_kernels.gemm import Fusion, gemm, matmul
from pallas_kernels.norm_matmul import config as nm_config
from pallas_kernels.norm_matmul import mosaic as nm_mosaic
from pallas_kernels.norm_matmul import rmsnorm_matmul

EPS = 1e-6


def fusions(M: int, K: int, cfg) -> dict:
    """name -> (Fusion, whether it reads "sum_sq")."""
    def rows(ctx):
        return ctx.load_rows("sum_sq")

    def times_rows(ctx, acc, sum_sq):
        return acc * nm_mosaic._bcast_rows(sum_sq, acc.shape), {}

    return {
        "scale_const": (Fusion(epilogue=lambda ctx, acc, carry: (acc * 1.5, {})), False),
        "load_rows": (Fusion(inputs=("sum_sq",), prologue_init=rows, epilogue=times_rows), True),
        "r_from_sums": (nm_mosaic._forward_fusion(M, K, EPS, cfg, False), True),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("MxKxN"), default="8192x512x2816,16384x1024x5504")
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "forward_epilogue_cost")
    for M, K, N in args.shapes:
        shape = f"{M}x{K}x{N}"
        config = nm_config.mosaic_default_config(M, K, N, jnp.bfloat16)
        cfg = config.forward
        kx, kg, kw = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (M, K), jnp.bfloat16)
        gamma = (1 + 0.1 * jax.random.normal(kg, (K,), jnp.float32)).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (K, N), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
        x32 = x.astype(jnp.float32)
        sum_sq = jnp.sum(x32 * x32, axis=1)
        a = (x32 * gamma.astype(jnp.float32)).astype(jnp.bfloat16)
        r = jax.lax.rsqrt(sum_sq / K + EPS)
        calls = {"cublas": (jax.jit(lambda a, w, s: jnp.dot(a, w, preferred_element_type=jnp.bfloat16)), False),
                 "plain": (jax.jit(lambda a, w, s: matmul(a, w, config=cfg)), False)}
        for name, (fusion, _) in fusions(M, K, cfg).items():
            calls[name] = (jax.jit(lambda a, w, s, fusion=fusion: gemm(
                a, w, config=cfg, out_dtype=jnp.bfloat16, fusion=fusion, arrays=dict(sum_sq=s),
                name="forward_epilogue_cost")[0]), name != "scale_const")
        program = jax.jit(lambda x, g, w: rmsnorm_matmul(x, g, w, eps=EPS, backend="mosaic", block_sizes=config))
        product = np.asarray(jnp.dot(a, w, preferred_element_type=jnp.float32))
        want = {"cublas": product, "plain": product, "scale_const": product * 1.5,
                "load_rows": product * np.asarray(sum_sq)[:, None], "r_from_sums": product * np.asarray(r)[:, None]}
        row = dict(shape=shape, forward_config=cfg.to_dict(), max_rel_diff={})
        for name, (fn, _) in calls.items():
            got = np.asarray(fn(a, w, sum_sq), np.float32)
            row["max_rel_diff"][name] = float(np.abs(got - want[name]).max() / np.abs(want[name]).max())
        got = np.asarray(program(x, gamma, w), np.float32)
        row["max_rel_diff"]["program"] = float(np.abs(got - want["r_from_sums"]).max() / np.abs(want["r_from_sums"]).max())
        timed = [(fn, (a, w, sum_sq)) for fn, _ in calls.values()] + [(program, (x, gamma, w))]
        timings = bench.time_interleaved(timed, iterations=args.iterations)
        row["us"] = {name: t.median_us for name, t in zip([*calls, "program"], timings)}
        row["program_kernels"] = timings[-1].per_kernel_us
        row["us"]["program_kernel"] = max(timings[-1].per_kernel_us.values())
        print(shape, {k: round(v, 2) for k, v in row["us"].items()}, flush=True)
        print(shape, "max_rel_diff", {k: f"{v:.1e}" for k, v in row["max_rel_diff"].items()}, flush=True)
        result["timings"].append(row)
        save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
