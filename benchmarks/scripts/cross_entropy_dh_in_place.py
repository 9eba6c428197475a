"""Whether XLA writes a GEMM's (Bc, H) result into a loop-carried (B, H) buffer in place: the cross-entropy's dh
chunks, from XLA's own GEMM against the Mosaic-GPU GEMM core (``dh_gemm``), on the H100.

    PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_dh_in_place.py --out $OUT [--shape 16384x4096x32000]
        [--chunk-rows 1024]

A ``fori_loop`` over B / Bc steps writes dh[i·Bc:(i+1)·Bc] = (dl · (i + 1)) @ wᵀ into a buffer that starts as
``lax.empty`` (the loop index keeps XLA from hoisting the GEMM). Per variant: whether the optimized HLO wraps the
update in a dynamic-slice fusion (the GEMM writes into the buffer) and how many async copies it holds, and the
CUPTI time of the loop with its costliest kernels, both variants interleaved. Writes
``cross_entropy_dh_in_place-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax

from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from pallas_kernels.gemm import matmul


def dh_loop(gemm, B: int, H: int, Bc: int):
    """jit of the chunk loop writing gemm(dl_i, w) (Bc, H) into rows [i·Bc, (i+1)·Bc) of a (B, H) buffer."""
    def run(dl, w):
        def step(i, dh):
            return lax.dynamic_update_slice_in_dim(dh, gemm(dl * (i + 1).astype(dl.dtype), w), i * Bc, 0)
        return lax.fori_loop(0, B // Bc, step, lax.empty((B, H), dl.dtype))
    return jax.jit(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", type=bench.shape_arg("BxHxV"), default="16384x4096x32000", help="BxHxV")
    parser.add_argument("--chunk-rows", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    B, H, V = args.shape
    Bc = args.chunk_rows
    result, save, path = results_file(args.out, "cross_entropy_dh_in_place")
    keys = jax.random.split(jax.random.key(0), 2)
    dl = jax.random.normal(keys[0], (Bc, V), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (H, V), jnp.float32) * V**-0.5).astype(jnp.bfloat16)
    loops = {
        "xla": dh_loop(lambda dl, w: lax.dot_general(dl, w, (((1,), (1,)), ((), ())),
                                                     preferred_element_type=jnp.bfloat16), B, H, Bc),
        "mosaic": dh_loop(lambda dl, w: matmul(dl, w, transpose_b=True), B, H, Bc),
    }
    with recorded_row(result, save, dict(shape=f"{B}x{H}x{V}", chunk_rows=Bc)) as row:
        for name, fn in loops.items():
            hlo = fn.lower(dl, w).compile().as_text()
            row[name] = dict(dynamic_slice_fusion="dynamic-slice-fusion" in hlo,
                             async_copies=hlo.count("fusion-start"))
        timings = bench.time_interleaved([(fn, (dl, w)) for fn in loops.values()], iterations=args.iterations)
        for name, t in zip(loops, timings):
            top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:6]
            row[name].update(us=t.median_us, top_kernels=top)
            print(name, row[name], flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
