"""The Mosaic logits GEMM with its softmax statistics (``mosaic_logits.logits_and_lse``) alone, per chunk size and
tile order, on the H100: µs per B rows (the chunk's time × B / Bc), the orders interleaved.

    PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_logits_order.py --out $OUT [--chunks 1024,1536,2048,3328]
        [--H 4096] [--V 32000] [--B 16384]

Orders (overrides of ``mosaic_logits.config_for``'s config): its default, runs along the vocabulary ("minor_n"),
and runs of 1, 2, 4, 8 and 16 row tiles. Writes ``cross_entropy_logits_order-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from unittest import mock

import jax
import jax.numpy as jnp

from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from pallas_kernels.cross_entropy import mosaic_logits

ORDERS = {"default": {}, "minor_n": dict(grid_minor="n"), "runs_1": dict(grid_tile_width=1),
          "runs_2": dict(grid_tile_width=2), "runs_4": dict(grid_tile_width=4), "runs_8": dict(grid_tile_width=8),
          "runs_16": dict(grid_tile_width=16)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", default="1024,1536,2048,3328")
    parser.add_argument("--H", type=int, default=4096)
    parser.add_argument("--V", type=int, default=32000)
    parser.add_argument("--B", type=int, default=16384, help="rows the times are scaled to")
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "cross_entropy_logits_order")
    default = mosaic_logits.config_for
    w = (jax.random.normal(jax.random.key(1), (args.H, args.V), jnp.bfloat16) * args.H**-0.5).astype(jnp.bfloat16)
    for Bc in [int(c) for c in args.chunks.split(",")]:
        row = dict(H=args.H, V=args.V, chunk_rows=Bc, B=args.B,
                   default_config=default(Bc, args.H, args.V, jnp.bfloat16).to_dict())
        with recorded_row(result, save, row):
            h_c = jax.random.normal(jax.random.key(0), (Bc, args.H), jnp.bfloat16)
            fns = {}
            for name, overrides in ORDERS.items():
                fn = jax.jit(lambda h, w: mosaic_logits.logits_and_lse(h, w))
                patched = lambda *a, o=overrides: dataclasses.replace(default(*a), **o)  # noqa: E731
                with mock.patch.object(mosaic_logits, "config_for", patched):
                    jax.block_until_ready(fn(h_c, w))  # traced under the patch; jit's cache keeps this trace
                fns[name] = fn
            timings = bench.time_interleaved([(fn, (h_c, w)) for fn in fns.values()], iterations=args.iterations)
            row["us_per_B_rows"] = {name: t.median_us * args.B / Bc for name, t in zip(fns, timings)}
            print(Bc, {k: round(v) for k, v in row["us_per_B_rows"].items()}, flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
