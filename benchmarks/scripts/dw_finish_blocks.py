"""The dw finish where XLA runs the dw GEMM (``norm_matmul.dw_finish``) under block sizes, warps and stages,
against XLA's fusions of the same work (the backward's expressions before the kernel: dw = (s · gamma) ⊙ g and
dgamma = s · Σ_N(g ⊙ w)).

    PYTHONPATH=$PWD python benchmarks/scripts/dw_finish_blocks.py --out $OUT [--shapes 512x2816,512x768]

Per (K, N): float32 g, bf16 w and gamma (random), s = 1, CUPTI medians interleaved (``bench.time_interleaved``; g
fits in L2 here as it does after the GEMM that writes it), the bytes floor 8KN (g and w read, dw written) as TB/s.
Writes ``dw_finish_blocks-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from pallas_kernels.norm_matmul.dw_finish import finish_dw

CANDIDATES = [((4, 256), 4, 2), ((4, 256), 4, 3), ((4, 256), 8, 2), ((2, 256), 4, 2), ((8, 256), 4, 2),
              ((8, 256), 8, 3), ((4, 128), 4, 2), ((2, 128), 2, 2)]  # (block_k, block_n), warps, stages


def _xla_dw_dgamma(g, w, gamma, scale):
    gamma_s = gamma.astype(jnp.float32) * scale
    dw = (g * gamma_s[:, None]).astype(w.dtype)
    return dw, (jnp.sum(g * w.astype(jnp.float32), axis=1) * scale).astype(gamma.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("KxN"), default="512x2816,512x768")
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "dw_finish_blocks")
    for K, N in args.shapes:
        name = f"{K}x{N}"
        keys = jax.random.split(jax.random.key(K + N), 3)
        g = jax.random.normal(keys[0], (K, N), jnp.float32)
        w = jax.random.normal(keys[1], (K, N), jnp.bfloat16)
        gamma = jax.random.normal(keys[2], (K,), jnp.bfloat16)
        row = dict(shape=name, K=K, N=N, floor_bytes=8 * K * N)
        with recorded_row(result, save, row):
            fns = {"xla": lambda g, w, gamma: _xla_dw_dgamma(g, w, gamma, jnp.ones((), jnp.float32))}
            for blocks, warps, stages in CANDIDATES:
                if K % blocks[0] or N % blocks[1]:
                    continue
                fns[f"{blocks[0]}x{blocks[1]}_w{warps}_s{stages}"] = (
                    lambda g, w, gamma, _b=blocks, _w=warps, _s=stages: finish_dw(
                        g, w, gamma, jnp.ones((1,), jnp.float32), blocks=_b, num_warps=_w, num_stages=_s))
            programs = [(jax.jit(f), (g, w, gamma)) for f in fns.values()]
            timings = bench.time_interleaved(programs, iterations=args.iterations)
            row["us"] = {k: t.median_us for k, t in zip(fns, timings)}
            row["tb_per_s"] = {k: 8 * K * N / t.median_us / 1e6 for k, t in zip(fns, timings)}
            print(name, {k: round(v, 2) for k, v in row["us"].items()}, flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
