"""Row counts the Mosaic tiles do not divide (not a multiple of 64) run the Triton backend, 1.4-3.7x slower than XLA
at 32-256 rows (H200, 71st session: ``few_rows_triton_table.py``). This measures what padding the rows would buy
before any library change: the Mosaic backend on x padded with rows of ones to the next multiple of ``--multiple``
(its default config at the padded count: on an H200 the untuned rule's forms, XLA's backward at few rows), y sliced
back, against Triton (``backend="auto"`` at the true count) and XLA, forward and forward + backward.

    PYTHONPATH=$PWD python benchmarks/scripts/padded_rows_mosaic.py --out $OUT [--shapes 100x2048x8192,...]

Rows of ones keep r finite at eps = 0 (zero rows would give r = inf and 0 · inf = NaN in dw); the padded rows' dy
is zero under autodiff of the slice, so they add nothing to dw or dgamma. CUPTI medians (``bench.time_kernels``),
3 input sets rotated; outputs and gradients checked against the float32 reference. Writes ``padded_rows_mosaic.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import sys

import jax.numpy as jnp

import pallas_kernels
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite

sys.path.insert(0, os.path.dirname(__file__))
from few_rows_triton_table import time_forms  # noqa: E402 -- (a sibling script)

SHAPES = "100x2048x8192,200x2048x5632,320x4096x4096,1000x4096x14336,4000x2048x8192,16400x1024x5504"


def padded_mosaic(x, gamma, w, multiple: int):
    """rmsnorm_matmul on the Mosaic backend with x's rows padded by rows of ones to a multiple of ``multiple``."""
    M, K = x.shape
    pad = -M % multiple
    x_padded = jnp.concatenate([x, jnp.ones((pad, K), x.dtype)]) if pad else x
    return pallas_kernels.rmsnorm_matmul(x_padded, gamma, w, backend="mosaic")[:M]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--multiple", type=int, default=64)
    args = parser.parse_args()
    rows = []
    for text in args.shapes.split(","):
        M, K, N = map(int, text.split("x"))
        shape = dict(M=M, K=K, N=N)
        sets = [suite.make_inputs(M, K, N, seed=s) for s in range(3)]
        fns = {"xla": suite.SPEC.implementations()["xla"],
               "auto": lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w),
               "mosaic_padded": lambda x, g, w: padded_mosaic(x, g, w, args.multiple)}
        for mode in args.modes.split(","):
            row = dict(M=M, K=K, N=N, mode=mode, auto_backend=pallas_kernels.norm_matmul.plan(*sets[0][:3]).backend)
            row.update(time_forms(fns, sets, mode, shape, args.iterations))
            print(json.dumps({k: row[k] for k in ("M", "K", "N", "mode", "auto_backend", "us", "rel_error", "errors")}),
                  flush=True)
            rows.append(row)
    path = os.path.join(args.out, "padded_rows_mosaic.json")
    with open(path, "w") as f:
        json.dump(dict(environment=bench.environment(), rows=rows, multiple=args.multiple,
                       tolerance="suite: tolerance(bf16, K)"), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
