"""Where the forward's statistics warpgroup costs its time, on the H100: the forward kernel of rmsnorm_matmul at
32768x4096x4096 (bf16) with its two 128x128 accumulators side by side (the tiles the statistics warpgroup needs),
timed as one kernel each (CUPTI medians, inputs alternating, two interleaved passes):

  plain       the GEMM core, no fusion
  rows        + the epilogue scaling rows by r (r an input: what the default forward runs, less XLA's reduction)
  idle_wg     + a fourth warpgroup that waits for each stage and releases it without reading it (its handoff a
                constant): the synchronisation and the registers it takes from the MMA warpgroups
  stats_wg    + the statistics warpgroup summing x² over each x tile (the product's stats_in_kernel forward)
  stats_wg_r<N> the same with N registers per thread for each MMA warpgroup (the fourth gets 512 − 2N − 40)
  stacked     the default core (two 64x256 accumulators stacked along M, stream-K); cublas: XLA's matmul alone

    PYTHONPATH=$PWD OUT=DIR python benchmarks/scripts/rmsnorm_matmul_stats_wg.py

writes DIR/r/rmsnorm_matmul_stats_wg.json."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import bench
from pallas_kernels import gemm as core
from pallas_kernels import mosaic_utils as mu
from pallas_kernels.norm_matmul import config as nm_config
from pallas_kernels.norm_matmul import mosaic as nm_mosaic

M, K, N = 32768, 4096, 4096
EPS = 1e-6


def variants(forward: core.MosaicGemmConfig) -> dict:
    """{name: (x, w, rstd) -> y} forward programs (the product's forward fusions, and one idle fourth warpgroup)."""
    rows = nm_mosaic._forward_fusion(M, K, EPS, forward.tile_m, False)  # epilogue y = r ⊙ acc, r an input
    idle = core.Fusion(handoff_rows=1, prologue_init=lambda ctx: mu.layout_cast(jnp.ones((ctx.config.tile_m,),
                                                                                        jnp.float32), mu.ROWS),
                       prologue_step=lambda ctx, x_ref, carry: carry, epilogue=rows.epilogue)
    stats = nm_mosaic._forward_fusion(M, K, EPS, forward.tile_m, True)
    out = {
        "plain": lambda x, w, r: core.gemm(x, w, config=forward, out_dtype=x.dtype)[0],
        "rows": lambda x, w, r: core.gemm(x, w, config=forward, out_dtype=x.dtype, fusion=rows,
                                          arrays=dict(rstd=r))[0],
        "idle_wg": lambda x, w, r: core.gemm(x, w, config=forward, out_dtype=x.dtype, fusion=idle)[0],
        "stats_wg": lambda x, w, r: core.gemm(x, w, config=forward, out_dtype=x.dtype, fusion=stats)[0],
        "stacked": lambda x, w, r: core.matmul(x, w),
        "cublas": lambda x, w, r: jnp.dot(x, w),  # bf16 out (b61eb60's record: a float32 GEMM plus a convert)
    }
    for regs in (216, 200, 192):
        cfg = dataclasses.replace(forward, mma_registers=regs)
        out[f"stats_wg_r{regs}"] = lambda x, w, r, c=cfg: core.gemm(x, w, config=c, out_dtype=x.dtype,
                                                                     fusion=stats)[0]
    return out


def main() -> int:
    forward = nm_config.mosaic_default_config(M, K, N, jnp.bfloat16, stats_in_kernel=True).forward
    keys = jax.random.split(jax.random.key(3), 4)
    xs = [jax.random.normal(k, (M, K), jnp.float32).astype(jnp.bfloat16) for k in keys[:2]]
    w = (jax.random.normal(keys[2], (K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    rs = [jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=1) + EPS) for x in xs]
    fns = {n: jax.jit(f) for n, f in variants(forward).items()}
    want = np.asarray(fns["rows"](xs[0], w, rs[0]), np.float32)
    res = {"config": str(forward), "us": {}, "max_rel_diff_vs_rows": {}}
    for name, fn in fns.items():  # compile and check; a variant that fails is recorded
        try:
            got = np.asarray(fn(xs[0], w, rs[0]), np.float32)
        except Exception as e:  # noqa: BLE001
            res["us"][name] = f"{type(e).__name__}: {e}"[:300]
            continue
        ref = want if name in ("rows", "stats_wg") or name.startswith("stats_wg_r") else None
        if ref is not None:
            res["max_rel_diff_vs_rows"][name] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        res["us"][name] = []
    for _ in range(2):
        for name, fn in fns.items():
            if isinstance(res["us"][name], list):
                t = bench.time_kernels(fn, [(xs[0], w, rs[0]), (xs[1], w, rs[1])], iterations=20)
                res["us"][name].append(t.median_us)
    for name, v in res["us"].items():
        print(name, v, res["max_rel_diff_vs_rows"].get(name, ""), flush=True)
    os.makedirs(os.environ["OUT"] + "/r", exist_ok=True)
    with open(os.environ["OUT"] + "/r/rmsnorm_matmul_stats_wg.json", "w") as f:
        json.dump({"environment": bench.environment(), "shape": [M, K, N], **res}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
