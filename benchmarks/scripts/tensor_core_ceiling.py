"""The H100's bf16 tensor-core rate with no memory traffic: how fast can any GEMM go, against what issue 15's bar asks.

    PYTHONPATH=$PWD python benchmarks/scripts/tensor_core_ceiling.py --out $OUT [--steps 20000] [--iterations 20]

One Mosaic-GPU kernel, one block per SM, two compute warpgroups as in our GEMM core (each a (64, 256) float32
accumulator): A (128, 64) and B (64, 256) bf16 random tiles are loaded into shared memory once, then each warpgroup
issues ``--steps`` wgmma of its (64, 256, 64) share back to back (one in flight, as the core's K loop), and stores
its accumulator's row sums (so nothing is dead code). FLOPs = SMs · steps · 2 · 128 · 256 · 64; no HBM or L2 traffic
inside the loop, so its rate bounds every GEMM of this tile shape on this chip (power and clocks included: random
operands, as a real GEMM's). Beside it, in the same run (CUPTI medians): cuBLAS's matmul alone and XLA's norm +
matmul (``jaxfuse.suites.rmsnorm_matmul``) at the suite shapes, and per shape the rate a fused forward would need to
be 1.06x XLA's norm + matmul with its GEMM's FLOPs alone (``needed_tflops``). Writes
``tensor_core_ceiling-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from pallas_kernels import mosaic_utils as mu

TILE_M, TILE_N, TILE_K = 128, 256, 64  # a block's share of one wgmma step: two warpgroups of (64, 256, 64)
BAR = 1.06  # issue 15: the fused op >= 1.06x XLA's norm + matmul


def wgmma_loop(steps: int, num_sms: int | None = None):
    """f(a (128, 64) bf16, b (64, 256) bf16) -> (SMs · 128,) float32 row sums after ``steps`` wgmma per warpgroup."""
    sms = num_sms or mu.num_sms()
    half = TILE_M // 2

    def body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, loaded):
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _load():
            plgpu.copy_gmem_to_smem(a_gmem, a_smem, loaded.at[0])
            plgpu.copy_gmem_to_smem(b_gmem, b_smem, loaded.at[1])

        plgpu.barrier_wait(loaded.at[0])
        plgpu.barrier_wait(loaded.at[1])

        def accumulate(acc_ref):
            def step(_, carry):
                plgpu.wgmma(acc_ref, a_smem.at[pl.ds(wg * half, half)], b_smem)
                plgpu.wgmma_wait(1)
                return carry

            lax.fori_loop(0, steps, step, 0)
            plgpu.wgmma_wait(0)
            rows = jnp.sum(acc_ref[...], axis=1)  # (64,) in the accumulator's row layout
            out_gmem.at[pl.ds(lax.axis_index("sm") * TILE_M + wg * half, half)][...] = rows

        pl.run_scoped(accumulate, plgpu.ACC((half, TILE_N), jnp.float32))

    return mu.kernel(body, out_type=jax.ShapeDtypeStruct((sms * TILE_M,), jnp.float32),
                     scratch_types=[plgpu.SMEM((TILE_M, TILE_K), jnp.bfloat16,
                                               transforms=mu.smem_transforms(TILE_K, jnp.bfloat16)),
                                    plgpu.SMEM((TILE_K, TILE_N), jnp.bfloat16,
                                               transforms=mu.smem_transforms(TILE_N, jnp.bfloat16)),
                                    plgpu.Barrier(num_barriers=2)],
                     grid=(sms,), grid_names=("sm",), num_threads=2, thread_name="wg", name="tensor_core_ceiling")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--shapes", default="32768x4096x4096,4096x4096x14336,8192x4096x6144-qkv")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "tensor_core_ceiling")
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (TILE_M, TILE_K), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (TILE_K, TILE_N), jnp.float32).astype(jnp.bfloat16)
    ceiling = jax.jit(wgmma_loop(args.steps))
    calls, names = [(ceiling, (a, b))], ["ceiling"]
    impls = suite.SPEC.implementations()
    shapes = args.shapes.split(",")
    for name in shapes:
        s = suite.SHAPES[name]
        x, g, w, _ = suite.make_inputs(s["M"], s["K"], s["N"])
        for impl in ("xla", "xla_matmul_alone"):
            calls.append((jax.jit(impls[impl]), (x, g, w)))
            names.append(f"{name}/{impl}")
    timings = bench.time_interleaved(calls, iterations=args.iterations)
    flops = mu.num_sms() * args.steps * 2.0 * TILE_M * TILE_N * TILE_K
    row = dict(steps=args.steps, sms=mu.num_sms(), ceiling_us=timings[0].median_us,
               ceiling_tflops=flops / timings[0].median_us / 1e6)
    with recorded_row(result, save, row):
        by_name = dict(zip(names, timings))
        for name in shapes:
            s = suite.SHAPES[name]
            gemm_flops = 2.0 * s["M"] * s["K"] * s["N"]
            xla_us = by_name[f"{name}/xla"].median_us
            cublas_us = by_name[f"{name}/xla_matmul_alone"].median_us
            row[name] = dict(xla_us=xla_us, cublas_us=cublas_us, cublas_tflops=gemm_flops / cublas_us / 1e6,
                             needed_tflops=gemm_flops / (xla_us / BAR) / 1e6,
                             floor_us_at_ceiling=gemm_flops / row["ceiling_tflops"] / 1e6)
        print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items() if not isinstance(v, dict)})
        for name in shapes:
            print(name, {k: round(v, 1) for k, v in row[name].items()}, flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
