"""The linear cross-entropy's dw update alone on the H100, dw (H, V) += h_cᵀ (H, Bc) @ dl_c (Bc, V), 4 updates in a
loop: the GEMM core's accumulating update (``accumulate_into``, its default config) against the update with h_cᵀ's
row block resident in shared memory (``gemm.resident``, several configs) and cuBLAS with beta = 1, at the 5% loss's
chunks of 4096x2048x256000 (512 rows) and of the 1b model's head 4096x2048x128256 (384 and 256 rows). CUPTI µs per
update (median of 10 calls, two passes interleaved, two dw buffers alternating), each variant's max relative
difference from cuBLAS's update, and the floors (FLOPs at 805 TFLOP/s, bytes at 2.94 TB/s):

    PYTHONPATH=$PWD OUT=DIR python benchmarks/scripts/cross_entropy_dw_update_resident.py

writes DIR/r/dw_update_resident.json."""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import bench
from pallas_kernels.gemm import matmul
from pallas_kernels.gemm.resident import ResidentConfig, accumulate_resident, resident_reason

STEPS = 4  # chunk updates per timed call
SHAPES = [(2048, 256000, 512), (2048, 128256, 384), (2048, 128256, 256)]  # (H, V, Bc)
RESIDENT = {"k32_s4_d1": ResidentConfig(), "k32_s3_d1": ResidentConfig(num_stages=3),
            "k32_s4_d0": ResidentConfig(delay_release=0), "k64_s2_d0": ResidentConfig(tile_k=64, num_stages=2,
                                                                                    delay_release=0),
            "k64_s4_d1": ResidentConfig(tile_k=64, num_stages=4), "k32_s8_d1": ResidentConfig(num_stages=8)}
FLOPS_PER_S, BYTES_PER_S = 805e12, 2.94e12


def update_loops(H: int, V: int, Bc: int) -> dict:
    """{name: jitted (h, dl, dw) -> dw after STEPS chunk updates}."""
    rows = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * Bc, Bc)  # noqa: E731

    def loop(update):
        return jax.jit(lambda h, dl, dw: jax.lax.fori_loop(
            0, STEPS, lambda i, dw: update(rows(h, i), rows(dl, i), dw), dw))

    fns = {"cublas_badd": loop(lambda a, b, dw: dw + jax.lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)),
           "core_acc": loop(lambda a, b, dw: matmul(a, b, transpose_a=True, accumulate_into=dw))}
    for name, config in RESIDENT.items():
        if resident_reason(H, V, Bc, jnp.bfloat16, config) is None:
            fns[f"resident_{name}"] = loop(lambda a, b, dw, c=config: accumulate_resident(a, b, dw, config=c))
    return fns


def main() -> int:
    out = {}
    for H, V, Bc in SHAPES:
        k = jax.random.split(jax.random.key(1), 3)
        h = jax.random.normal(k[0], (STEPS * Bc, H), jnp.bfloat16)
        dl = (jax.random.normal(k[1], (STEPS * Bc, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
        dws = [jax.random.normal(key, (H, V), jnp.bfloat16) for key in jax.random.split(k[2], 2)]
        fns = update_loops(H, V, Bc)
        want = np.asarray(fns["cublas_badd"](h, dl, dws[0]), np.float32)
        res = {"floor_flops_us": 2 * H * V * Bc / FLOPS_PER_S * 1e6,
               "floor_bytes_us": (2 * H * V + Bc * (H + V)) * 2 / BYTES_PER_S * 1e6}
        for name, fn in fns.items():
            try:
                got = np.asarray(fn(h, dl, dws[0]), np.float32)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded
                res[name] = f"{type(e).__name__}: {e}"[:400]
                continue
            res[name] = {"max_rel_diff_vs_cublas": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
                         "us_per_update": []}
        for _ in range(2):  # two passes over the variants, interleaved
            for name, fn in fns.items():
                if isinstance(res.get(name), dict):
                    t = bench.time_kernels(fn, [(h, dl, dws[0]), (h, dl, dws[1])], iterations=10)
                    res[name]["us_per_update"].append(t.median_us / STEPS)
        key = f"{H}x{V}x{Bc}"
        out[key] = res
        for name, r in res.items():
            print(key, name, r, flush=True)
    os.makedirs(os.environ["OUT"] + "/r", exist_ok=True)
    with open(os.environ["OUT"] + "/r/dw_update_resident.json", "w") as f:
        json.dump({"environment": bench.environment(), "results": out,
                   "configs": {k: str(v) for k, v in RESIDENT.items()}}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
