"""Who adds each token chunk's dw update, on the H100: cuBLAS with beta = 1 (``dw_gemm="xla"``) against the
Mosaic-GPU GEMM core updating dw in place with its tiles prefetched (``dw_gemm="mosaic"``), inside the fused linear
cross-entropy's value and gradient and alone, plain XLA's loss in the same run.

    PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_dw_gemm.py --out $OUT [--shapes 8k_128k,4k_256k,16k_32k]

Per shape (bf16, the suite's inputs, the memory rule's chunk): (1) one chunk's dw update alone, dw (H, V) +=
h_cᵀ (H, Bc) @ dl_c (Bc, V), in a 4-step loop over fresh chunks (cuBLAS via XLA's fused add, and the Mosaic
kernel), µs per update, with the floor of its FLOPs (at 805 TFLOP/s) and of its bytes (dw read and written, the
chunk's dl read once: 2.94 TB/s); (2) value_and_grad of the loss, all three ways, interleaved (CUPTI medians and
each run's costliest kernels), with the largest difference of dw between the two fused variants relative to the
largest |dw|. Writes ``cross_entropy_dw_gemm-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from attention_fused_bwd import results_file
from jaxfuse import bench, kernels
from jaxfuse.suites.cross_entropy import SHAPES, make_inputs
from pallas_kernels.cross_entropy import config as ce_config
from pallas_kernels.gemm import matmul

PEAK_FLOPS, PEAK_BYTES = 805e12, 2.94e12  # shared/anchors.md: the H100's measured bf16 GEMM and copy rates
STEPS = 4


def dw_update_fns(H: int, V: int, Bc: int):
    """(xla, mosaic): dw after STEPS chunk updates dw += h_iᵀ dl_i, h (STEPS·Bc, H), dl (STEPS·Bc, V)."""
    def loop(update):
        def run(h, dl, dw):
            rows = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * Bc, Bc)  # noqa: E731
            return jax.lax.fori_loop(0, STEPS, lambda i, dw: update(rows(h, i), rows(dl, i), dw), dw)
        return jax.jit(run, donate_argnums=2)

    xla = loop(lambda h_c, dl_c, dw: dw + jax.lax.dot_general(h_c, dl_c, (((0,), (0,)), ((), ())),
                                                              preferred_element_type=dw.dtype))
    mosaic = loop(lambda h_c, dl_c, dw: matmul(h_c, dl_c, transpose_a=True, accumulate_into=dw))
    return {"xla": xla, "mosaic": mosaic}


def time_dw_update(H: int, V: int, Bc: int, iterations: int) -> dict:
    keys = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(keys[0], (STEPS * Bc, H), jnp.bfloat16)
    dl = (jax.random.normal(keys[1], (STEPS * Bc, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    fns = dw_update_fns(H, V, Bc)
    out = {}
    want = None
    for name, fn in fns.items():
        dw = jax.random.normal(keys[2], (H, V), jnp.bfloat16)
        got = np.asarray(fn(h, dl, dw), np.float32)
        want = got if want is None else want
        out[f"{name}_vs_xla_max_rel"] = float(np.abs(got - want).max() / np.abs(want).max())
        dws = [jax.random.normal(k, (H, V), jnp.bfloat16) for k in jax.random.split(keys[2], iterations + 4)]
        samples = []
        for i in range(iterations + 2):  # each call donates its dw: a fresh one per call
            t = bench.time_kernels(fn, [(h, dl, dws[i])], iterations=1, warmup=0, jit=False)
            if i >= 2:
                samples.append(t.median_us / STEPS)
        out[f"{name}_us_per_update"] = float(np.median(samples))
    flops, bytes_ = 2.0 * Bc * H * V, 2.0 * (2 * H * V + Bc * V)
    out.update(floor_flops_us=flops / PEAK_FLOPS * 1e6, floor_bytes_us=bytes_ / PEAK_BYTES * 1e6)
    return out


def loss_fns(labels, Bc: int):
    def fused(dw_gemm):
        sizes = {"chunk_rows": Bc, "dw_gemm": dw_gemm}
        return jax.jit(jax.value_and_grad(lambda h, w: pallas_kernels.linear_cross_entropy(
            h, w, labels, backend="triton", block_sizes=sizes), argnums=(0, 1)))

    plain = jax.jit(jax.value_and_grad(lambda h, w: kernels.plain_cross_entropy(h, w, labels), argnums=(0, 1)))
    return {"xla_plain": plain, "dw_xla": fused("xla"), "dw_mosaic": fused("mosaic")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="8k_128k,4k_256k,16k_32k")
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "cross_entropy_dw_gemm")
    for name in args.shapes.split(","):
        s = SHAPES[name]
        B, H, V = s["B"], s["H"], s["V"]
        Bc = ce_config.chunk_rows_for(B, H, V, jnp.bfloat16)
        row = dict(shape=name, B=B, H=H, V=V, chunk_rows=Bc)
        try:
            row["dw_update"] = time_dw_update(H, V, Bc, args.iterations)
            print(name, "dw update", row["dw_update"], flush=True)
            h, w, labels = make_inputs(B, H, V, seed=0)
            fns = loss_fns(labels, Bc)
            grads = {k: np.asarray(fns[k](h, w)[1][1], np.float32) for k in ("dw_xla", "dw_mosaic")}
            row["dw_diff_rel"] = float(np.abs(grads["dw_xla"] - grads["dw_mosaic"]).max()
                                       / np.abs(grads["dw_xla"]).max())
            timings = bench.time_interleaved([(fn, (h, w)) for fn in fns.values()], iterations=args.iterations)
            for impl, t in zip(fns, timings):
                top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:8]
                row[impl] = dict(us=t.median_us, top_kernels=top)
                print(name, impl, round(t.median_us, 1), [(k[:40], round(v, 1)) for k, v in top[:5]], flush=True)
            base = row["xla_plain"]["us"]
            row["speedup_vs_xla"] = {k: base / row[k]["us"] for k in ("dw_xla", "dw_mosaic")}
            print(name, "speedup vs plain XLA", row["speedup_vs_xla"], "dw diff", row["dw_diff_rel"], flush=True)
        except Exception as e:  # noqa: BLE001 - the other shapes still run
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
            print(name, "error", row["error"], flush=True)
        result["timings"].append(row)
        save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
