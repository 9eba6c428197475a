"""The rmsnorm_matmul forward's XLA pass (x ⊙ gamma written, the rows' sums of squares) against the same pass as a
Pallas Triton kernel, on the H200: whether a hand-written pass would read and write faster than XLA's fusion.

    PYTHONPATH=$PWD python benchmarks/scripts/rmsnorm_pass_probe.py --out $OUT

Per (M, K) of the model shapes (bf16 x, four input sets rotated past the L2): XLA's multi-output reduction fusion
("xla") and Triton kernels of ``bm`` rows a program and ``w`` warps ("triton_bm{bm}_w{w}"), outputs checked equal
(x ⊙ gamma bit-exact, the sums within 1e-5), CUPTI medians; TB/s counts 2 · M · K · 2 bytes (x read, x ⊙ gamma
written). Writes ``rmsnorm_pass_probe-<device>.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from attention_fused_bwd import results_file
from jaxfuse import bench
from pallas_kernels import triton_utils as tu


def xla_pass(x, gamma):
    x32 = x.astype(jnp.float32)
    return (x32 * gamma.astype(jnp.float32)).astype(x.dtype), jnp.sum(x32 * x32, axis=1)


def triton_pass(x, gamma, bm: int, warps: int):
    M, K = x.shape

    def kernel(x_ref, g_ref, a_ref, s_ref):
        x32 = x_ref[...].astype(jnp.float32)
        a_ref[...] = (x32 * g_ref[...].astype(jnp.float32)[None, :]).astype(a_ref.dtype)
        s_ref[...] = jnp.sum(x32 * x32, axis=1)

    call = tu.pallas_call(kernel, num_warps=warps, num_stages=1, interpret=False, grid=(M // bm,),
                          in_specs=[pl.BlockSpec((bm, K), lambda i: (i, 0)), pl.BlockSpec((K,), lambda i: (0,))],
                          out_specs=[pl.BlockSpec((bm, K), lambda i: (i, 0)), pl.BlockSpec((bm,), lambda i: (i,))],
                          out_shape=[jax.ShapeDtypeStruct((M, K), x.dtype), jax.ShapeDtypeStruct((M,), jnp.float32)])
    return call(x, gamma)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("MxK"), default="16384x1024,8192x512,4096x2048")
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "rmsnorm_pass_probe")
    for M, K in args.shapes:
        gamma = (1 + 0.1 * jax.random.normal(jax.random.key(1), (K,))).astype(jnp.bfloat16)
        sets = [(jax.random.normal(jax.random.key(i), (M, K), jnp.bfloat16), gamma) for i in range(4)]
        calls = {"xla": jax.jit(xla_pass)}
        for bm in (4, 8, 16, 32):
            for warps in (4, 8):
                if bm * K <= 32768:
                    calls[f"triton_bm{bm}_w{warps}"] = jax.jit(functools.partial(triton_pass, bm=bm, warps=warps))
        want = xla_pass(*sets[0])
        for name, fn in list(calls.items())[1:]:
            with tu.quiet_triton_deprecation():
                got = fn(*sets[0])
            assert np.array_equal(np.asarray(got[0]), np.asarray(want[0])), name
            assert np.allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5), name
        with tu.quiet_triton_deprecation():
            timings = bench.time_interleaved([(fn, sets) for fn in calls.values()], iterations=args.iterations)
        us = {name: t.median_us for name, t in zip(calls, timings)}
        row = dict(shape=f"{M}x{K}", us=us, tb_per_s={n: 2 * M * K * 2 / (v * 1e-6) / 1e12 for n, v in us.items()})
        print(row["shape"], {n: round(v, 2) for n, v in us.items()}, flush=True)
        result["timings"].append(row)
        save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
