"""The K side's dx finish (``norm_matmul.dx_finish``) under block sizes and warps, against XLA's fusions of the same
work: dx alone (what the backward runs without dgamma from u) and dx with dgamma's column sum (two fusions).

    PYTHONPATH=$PWD python benchmarks/scripts/dx_finish_blocks.py --out $OUT [--shapes 4096x4096,8192x4096]

Per (M, K): bf16 u and x, float32 coef and gamma (random), CUPTI medians interleaved (``bench.time_interleaved``),
the bytes floor 6MK (u and x read, dx written) as TB/s. Writes ``dx_finish_blocks-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from pallas_kernels.norm_matmul.dx_finish import finish_dx

CANDIDATES = [((64, 256), 4), ((64, 256), 8), ((32, 256), 4), ((32, 256), 8), ((64, 128), 4), ((32, 128), 4),
              ((16, 256), 4), ((128, 128), 8), ((16, 512), 4), ((32, 512), 8)]


def _xla_dx(u, x, coef, gamma):
    return (gamma * u.astype(jnp.float32) - coef[:, None] * x.astype(jnp.float32)).astype(x.dtype)


def _xla_dx_dgamma(u, x, coef, gamma):
    u32, x32 = u.astype(jnp.float32), x.astype(jnp.float32)
    return (gamma * u32 - coef[:, None] * x32).astype(x.dtype), jnp.sum(u32 * x32, axis=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("MxK"), default="4096x4096,8192x4096,4096x2048")
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "dx_finish_blocks")
    for M, K in args.shapes:
        name = f"{M}x{K}"
        keys = jax.random.split(jax.random.key(M + K), 4)
        inputs = (jax.random.normal(keys[0], (M, K), jnp.bfloat16), jax.random.normal(keys[1], (M, K), jnp.bfloat16),
                  jax.random.normal(keys[2], (M,)), jax.random.normal(keys[3], (K,)))
        row = dict(shape=name, M=M, K=K, floor_bytes=6 * M * K)
        with recorded_row(result, save, row):
            fns = {"xla_dx": _xla_dx, "xla_dx_dgamma": _xla_dx_dgamma}
            for blocks, warps in CANDIDATES:
                if M % blocks[0] or K % blocks[1]:
                    continue
                fns[f"{blocks[0]}x{blocks[1]}_w{warps}"] = (
                    lambda *a, _b=blocks, _w=warps: finish_dx(*a, blocks=_b, num_warps=_w))
            programs = [(jax.jit(f), inputs) for f in fns.values()]
            timings = bench.time_interleaved(programs, iterations=args.iterations)
            row["us"] = {k: t.median_us for k, t in zip(fns, timings)}
            row["tb_per_s"] = {k: 6 * M * K / t.median_us / 1e6 for k, t in zip(fns, timings)}
            print(name, {k: round(v, 1) for k, v in row["us"].items()}, flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
