"""The dw finish where XLA runs the dw GEMM (``norm_matmul.dw_finish``) under rows a program and warps, against
XLA's fusions of the same work (the backward's expressions without the kernel: G = the parts' sum, dw = (s · gamma)
⊙ G and dgamma = s · Σ_N(G ⊙ w)).

    PYTHONPATH=$PWD python benchmarks/scripts/dw_finish_blocks.py --out $OUT [--shapes 512x2816,512x768]

Per (K, N): float32 g of two parts (the split M: (2, K, N)), bf16 w and gamma (random), s = 1, CUPTI medians
interleaved (``bench.time_interleaved``; g fits in L2 here as it does after the GEMM that writes it), the bytes
floor 12KN (g and w read, dw written) as TB/s. The first form (a loop over N's column blocks a program, a (K, N) g)
is in ``dw_finish_blocks_loop-h200-35b3731.json``.
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

CANDIDATES = [(None, 4), (None, 8), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (8, 8)]  # (block_k, num_warps)


def _xla_dw_dgamma(g, w, gamma, scale):
    g = jnp.sum(g, axis=0)
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
        g = jax.random.normal(keys[0], (2, K, N), jnp.float32)
        w = jax.random.normal(keys[1], (K, N), jnp.bfloat16)
        gamma = jax.random.normal(keys[2], (K,), jnp.bfloat16)
        row = dict(shape=name, K=K, N=N, floor_bytes=12 * K * N)
        with recorded_row(result, save, row):
            fns = {"xla": lambda g, w, gamma: _xla_dw_dgamma(g, w, gamma, jnp.ones((), jnp.float32))}
            for block_k, warps in CANDIDATES:
                if block_k is not None and K % block_k:
                    continue
                fns[f"k{block_k or 'default'}_w{warps}"] = (
                    lambda g, w, gamma, _k=block_k, _w=warps: finish_dw(
                        g, w, gamma, jnp.ones((1,), jnp.float32), block_k=_k, num_warps=_w))
            programs = [(jax.jit(f), (g, w, gamma)) for f in fns.values()]
            timings = bench.time_interleaved(programs, iterations=args.iterations)
            row["us"] = {k: t.median_us for k, t in zip(fns, timings)}
            row["tb_per_s"] = {k: 12 * K * N / t.median_us / 1e6 for k, t in zip(fns, timings)}
            print(name, {k: round(v, 2) for k, v in row["us"].items()}, flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
