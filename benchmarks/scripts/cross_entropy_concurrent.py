"""The dh GEMM beside the dw update (``dh_gemm="concurrent"``), on the H100: each chunk's dh = dl·wᵀ on a second
GPU stream and its own SMs while the Mosaic dw update (dw += h_cᵀ dl) runs on the others, against the product's
default (the two one after the other) and plain XLA's loss, value and gradient, in the same run.

    PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_concurrent.py --out $OUT [--shapes 4k_256k,lm_head_1b]
        [--temp-fraction 0.05] [--dh-sms 0,48,56,72] [--rounds 7]

Two kernels that overlap in time make CUPTI's per-kernel sum overcount, so each variant is timed twice: CUPTI
(the kernels, each kernel's median: how much each slowed when sharing the GPU) and "queued": the wall clock of
``--calls`` calls launched back to back and blocked once, divided by their number (host dispatch, about 0.1 ms
per call, runs under the previous call's 10-20 ms of kernels). Medians over rounds, variants interleaved. The
sequential variants calibrate the queued time against CUPTI's in the same run. Also records each variant's largest
difference of dh and dw from the default's (relative to the largest |dh|, |dw|), the temporaries, and whether
XLA's optimized program runs the dh GEMM asynchronously (``call-start``). Writes
``cross_entropy_concurrent-<device>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench, kernels
from jaxfuse.suites.cross_entropy import SHAPES, make_inputs
from pallas_kernels.cross_entropy import config as ce_config


def queued_us(fn, args, calls: int) -> float:
    """µs per call of ``calls`` calls launched back to back, blocked once."""
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) * 1e6 / calls


def loss_variants(labels, Bc: int, dh_sms_list) -> dict:
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))  # noqa: E731

    def fused(**sizes):
        return grad(lambda h, w: pallas_kernels.linear_cross_entropy(
            h, w, labels, backend="triton", block_sizes=dict(sizes, chunk_rows=Bc)))

    fns = {"xla_plain": grad(lambda h, w: kernels.plain_cross_entropy(h, w, labels)),
           "auto": fused(),
           "dh_mosaic_then_dw": fused(dh_gemm="mosaic", dw_gemm="mosaic")}
    for sms in dh_sms_list:
        fns[f"concurrent_{sms or 'tiles'}"] = fused(dh_gemm="concurrent", dw_gemm="mosaic", dh_sms=sms)
    return fns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="4k_256k,lm_head_1b")
    parser.add_argument("--temp-fraction", type=float, default=0.05)
    parser.add_argument("--dh-sms", default="0,48,56,72", help="dh_sms values of the concurrent variants (0: auto)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "cross_entropy_concurrent")
    for name in args.shapes.split(","):
        s = SHAPES[name]
        B, H, V = s["B"], s["H"], s["V"]
        Bc = ce_config.chunk_rows_for(B, H, V, jnp.bfloat16, args.temp_fraction)
        row = dict(shape=name, B=B, H=H, V=V, chunk_rows=Bc, temp_fraction=args.temp_fraction)
        with recorded_row(result, save, row):
            h, w, labels = make_inputs(B, H, V, seed=0)
            fns = loss_variants(labels, Bc, [int(x) for x in args.dh_sms.split(",")])
            compiled = {k: fn.lower(h, w).compile() for k, fn in fns.items()}
            row["temp_mib"] = {k: c.memory_analysis().temp_size_in_bytes / 2**20 for k, c in compiled.items()}
            row["async_dh"] = {k: c.as_text().count("call-start") for k, c in compiled.items()}
            _, (dh0, dw0) = fns["auto"](h, w)
            dh0, dw0 = np.asarray(dh0, np.float32), np.asarray(dw0, np.float32)
            row["diff_rel"] = {}
            for k, fn in fns.items():
                _, (dh, dw) = fn(h, w)
                row["diff_rel"][k] = [float(np.abs(np.asarray(dh, np.float32) - dh0).max() / np.abs(dh0).max()),
                                      float(np.abs(np.asarray(dw, np.float32) - dw0).max() / np.abs(dw0).max())]
            print(name, "temp", row["temp_mib"], "async", row["async_dh"], "diff", row["diff_rel"], flush=True)
            cupti = bench.time_interleaved([(fn, (h, w)) for fn in fns.values()], iterations=args.rounds)
            queued = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    queued[k].append(queued_us(fn, (h, w), args.calls))
            for (k, fn), t in zip(fns.items(), cupti):
                top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:10]
                row[k] = dict(cupti_us=t.median_us, queued_us=statistics.median(queued[k]),
                              queued_samples=queued[k], top_kernels=top)
                print(name, k, "cupti", round(t.median_us), "queued", round(row[k]["queued_us"]),
                      [(n[:36], round(v)) for n, v in top[:5]], flush=True)
            base = row["xla_plain"]["queued_us"]
            row["speedup_vs_xla_queued"] = {k: base / row[k]["queued_us"] for k in fns}
            print(name, "speedup (queued)", {k: round(v, 3) for k, v in row["speedup_vs_xla_queued"].items()},
                  flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
