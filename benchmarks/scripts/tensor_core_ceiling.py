"""The H100's bf16 tensor-core rate with no memory traffic: how fast can any GEMM go, against what issue 15's bar asks.

    PYTHONPATH=$PWD python benchmarks/scripts/tensor_core_ceiling.py --out $OUT [--steps 20000] [--iterations 20]

One Mosaic-GPU kernel, one block per SM, two compute warpgroups as in our GEMM core (each a (64, 256) float32
accumulator): A (128, 64) and B (64, 256) bf16 tiles are loaded into shared memory once, then each warpgroup issues
``--steps`` wgmma of its (64, 256, 64) share back to back (one in flight, as the core's K loop), and stores its
accumulator's row sums (so nothing is dead code). FLOPs = SMs · steps · 2 · 128 · 256 · 64; no HBM or L2 traffic
inside the loop. The chip runs these at its power limit, where the clock falls as the tensor cores' inputs switch
more (KINDS.md: a matmul ran 788 TFLOP/s on random data, 894 on zeros), so the operand cases (``OPERANDS``) differ
in what the wgmma read from step to step: "fixed" the same tiles every step (the first version's only case), the
"rotating" ones another of four random stages each step, as a GEMM's K loop does, with A from shared memory or from
registers; "rotating_zeros" for contrast. The fastest case on random operands bounds every GEMM of random data on
this chip. Beside them, in the same run (CUPTI medians, ``bench.time_interleaved``): per suite shape and mode (fwd,
fwd+bwd), XLA's norm + matmul, cuBLAS's matmul alone and our Mosaic kernel (``--impls``); per shape and mode
``floor_us`` (the GEMMs' FLOPs, 1 or 3 GEMMs, at that ceiling), ``bar_us`` (XLA's time / 1.06, issue 15's bar) and
their ratio (below 1: no implementation can meet the bar). Writes ``tensor_core_ceiling-<device>.json``.
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


OPERANDS = {  # name -> (shared-memory stages the steps cycle through, A from "smem" or "registers", data)
    "fixed": (1, "smem", "random"),  # the same operands every step (the first version's kernel)
    "rotating": (4, "smem", "random"),  # another random stage each step: the tensor cores' inputs change as a GEMM's
    "rotating_regs_a": (4, "registers", "random"),  # the same, A held in registers (loaded once per stage)
    "rotating_zeros": (4, "smem", "zeros"),  # zero operands: the least switching, for contrast
}


def ceiling_operands(case: str, seed: int = 0):
    """(a (stages, 128, 64), b (stages, 64, 256)) bf16 for OPERANDS[case]: random normal, or zeros."""
    stages, _, data = OPERANDS[case]
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (stages, TILE_M, TILE_K), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (stages, TILE_K, TILE_N), jnp.float32).astype(jnp.bfloat16)
    return (jnp.zeros_like(a), jnp.zeros_like(b)) if data == "zeros" else (a, b)


def wgmma_loop(steps: int, num_sms: int | None = None, stages: int = 1, a_from: str = "smem"):
    """f(a (stages, 128, 64) bf16, b (stages, 64, 256) bf16) -> (SMs · 128,) float32 row sums after ``steps`` wgmma
    per warpgroup, step i on stage i % stages (``steps`` a multiple of ``stages``); A read from shared memory by each
    wgmma, or (``a_from="registers"``) loaded into registers once per stage before the loop."""
    if steps <= 0 or steps % stages:
        raise ValueError(f"steps: must be a positive multiple of stages={stages}, got {steps}")
    if a_from not in ("smem", "registers"):
        raise ValueError(f"a_from: must be 'smem' or 'registers', got {a_from!r}")
    sms = num_sms or mu.num_sms()
    half = TILE_M // 2

    def body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, loaded):
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _load():
            for s in range(stages):
                plgpu.copy_gmem_to_smem(a_gmem.at[s], a_smem.at[s], loaded.at[2 * s])
                plgpu.copy_gmem_to_smem(b_gmem.at[s], b_smem.at[s], loaded.at[2 * s + 1])

        for i in range(2 * stages):
            plgpu.barrier_wait(loaded.at[i])
        a_ops = [a_smem.at[s].at[pl.ds(wg * half, half)] for s in range(stages)]
        if a_from == "registers":  # loop-invariant registers: nothing redefines them under a wgmma in flight
            a_ops = [mu.load(a, layout=mu.TILE) for a in a_ops]

        def accumulate(acc_ref):
            def step(_, carry):
                for s in range(stages):
                    plgpu.wgmma(acc_ref, a_ops[s], b_smem.at[s])
                    plgpu.wgmma_wait(1)
                return carry

            lax.fori_loop(0, steps // stages, step, 0)
            plgpu.wgmma_wait(0)
            rows = jnp.sum(acc_ref[...], axis=1)  # (64,) in the accumulator's row layout
            out_gmem.at[pl.ds(lax.axis_index("sm") * TILE_M + wg * half, half)][...] = rows

        pl.run_scoped(accumulate, plgpu.ACC((half, TILE_N), jnp.float32))

    return mu.kernel(body, out_type=jax.ShapeDtypeStruct((sms * TILE_M,), jnp.float32),
                     scratch_types=[plgpu.SMEM((stages, TILE_M, TILE_K), jnp.bfloat16,
                                               transforms=mu.smem_transforms(TILE_K, jnp.bfloat16)),
                                    plgpu.SMEM((stages, TILE_K, TILE_N), jnp.bfloat16,
                                               transforms=mu.smem_transforms(TILE_N, jnp.bfloat16)),
                                    plgpu.Barrier(num_barriers=2 * stages)],
                     grid=(sms,), grid_names=("sm",), num_threads=2, thread_name="wg", name="tensor_core_ceiling")


def ceiling_case(case: str, steps: int):
    """(jitted kernel, its operands) of OPERANDS[case]."""
    stages, a_from, _ = OPERANDS[case]
    return jax.jit(wgmma_loop(steps, stages=stages, a_from=a_from)), ceiling_operands(case)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--operands", default=",".join(OPERANDS), help=f"ceiling cases, of {', '.join(OPERANDS)}")
    parser.add_argument("--shapes", default="32768x4096x4096,4096x4096x14336,8192x4096x6144-qkv")
    parser.add_argument("--impls", default="xla,xla_matmul_alone,pallas_mosaic",
                        help="timed per shape and mode (fwd, fwd+bwd) beside the ceilings")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "tensor_core_ceiling")
    cases = args.operands.split(",")
    unknown = sorted(set(cases) - set(OPERANDS))
    if unknown:
        parser.error(f"--operands: unknown {unknown}; allowed: {sorted(OPERANDS)}")
    calls, names = [ceiling_case(c, args.steps) for c in cases], [f"ceiling/{c}" for c in cases]
    impls = suite.SPEC.implementations()
    shapes = args.shapes.split(",")
    for name in shapes:
        s = suite.SHAPES[name]
        inputs = suite.make_inputs(s["M"], s["K"], s["N"])
        for impl in args.impls.split(","):
            for mode in ("fwd", "fwd+bwd"):
                calls.append((jax.jit(suite.SPEC.program(impls[impl], mode, s, {})), inputs))
                names.append(f"{name}/{impl}/{mode}")
    timings = bench.time_interleaved(calls, iterations=args.iterations)
    by_name = {n: t.median_us for n, t in zip(names, timings)}
    flops = mu.num_sms() * args.steps * 2.0 * TILE_M * TILE_N * TILE_K
    row = dict(steps=args.steps, sms=mu.num_sms(), ceilings={
        c: dict(us=by_name[f"ceiling/{c}"], tflops=flops / by_name[f"ceiling/{c}"] / 1e6, stages=OPERANDS[c][0],
                a_from=OPERANDS[c][1], data=OPERANDS[c][2]) for c in cases})
    with recorded_row(result, save, row):
        best = max(v["tflops"] for c, v in row["ceilings"].items() if OPERANDS[c][2] == "random")
        row["ceiling_random_tflops"] = best  # the fastest case on random operands: the rate no GEMM of them beats
        for c, v in row["ceilings"].items():
            print(f"ceiling {c}: {v['us']:.1f} us, {v['tflops']:.1f} TFLOP/s", flush=True)
        for name in shapes:
            s = suite.SHAPES[name]
            gemm_flops = 2.0 * s["M"] * s["K"] * s["N"]
            per = row[name] = {}
            for mode, gemms in (("fwd", 1), ("fwd+bwd", 3)):
                xla_us = by_name[f"{name}/xla/{mode}"]
                floor_us = gemms * gemm_flops / best / 1e6  # the GEMMs' FLOPs at the ceiling, nothing else
                per[mode] = dict({impl: by_name[f"{name}/{impl}/{mode}"] for impl in args.impls.split(",")},
                                 bar_us=xla_us / BAR, floor_us=floor_us, bar_over_floor=xla_us / BAR / floor_us,
                                 needed_tflops=gemms * gemm_flops / (xla_us / BAR) / 1e6)
                print(name, mode, {k: round(v, 3) for k, v in per[mode].items()}, flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
