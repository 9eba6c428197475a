"""Row counts the Mosaic tiles do not divide: the Mosaic backend with its last row of tiles past M (``gemm``'s
partial_rows and partial_k: TMA loads zeros there and stores nothing) against the Triton backend, XLA, and the
Mosaic built-in tables' tiles with XLA's backward (the H200's few-row form before it), forward and forward +
backward, and which backend ``backend="auto"`` takes.

    PYTHONPATH=$PWD python benchmarks/scripts/ragged_rows.py --out $OUT [--shapes 1000x4096x14336,...]

Before partial rows, a row count not a multiple of 64 ran the Triton backend: 2.3-4.0x slower than XLA forward at
1000-16400 rows (H200, 72nd session: rmsnorm_matmul-padded_rows-h200-867fb92.json); one a multiple of 64 but not of
128 ran the tables' 64-row tiles (16448x1024x5504: 428 µs forward, XLA 251). CUPTI medians (``bench.time_kernels``),
3 input sets rotated; outputs and gradients checked against the float32 reference. Writes ``ragged_rows<tag>.json``
after each row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import pallas_kernels
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from pallas_kernels.norm_matmul import config as nm_config

sys.path.insert(0, os.path.dirname(__file__))
from few_rows_triton_table import time_forms  # noqa: E402 -- (a sibling script)

SHAPES = ("16x4096x4096,16x4096x14336,64x4096x14336,64x2048x8192,192x2048x8192,200x2048x5632,320x4096x4096,"
          "1000x4096x14336,4000x2048x8192,4104x4096x4096,16400x1024x5504,24576x1024x5504")


FORMS = ("xla", "triton", "mosaic", "mosaic_tables_xla_bwd", "mosaic_xla_bwd", "mosaic_own_bwd")


def forms(M: int, K: int, N: int, names) -> dict:
    """name -> (x, gamma, w) -> y for the ``names`` of FORMS: XLA, each backend's default config, the tables
    with XLA's backward (where their tiles take the shape), and the default config with XLA's backward
    ("mosaic_xla_bwd") or with our backward kernels ("mosaic_own_bwd", rows not a multiple of 8 padded there)."""
    tables = dataclasses.replace(nm_config.mosaic_builtin_config(M, K, N), backward_in_xla=True)
    default = nm_config.mosaic_default_config(M, K, N)
    out = {"xla": suite.SPEC.implementations()["xla"],
           "triton": lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="triton"),
           "mosaic": lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic")}
    for name, xla_bwd in (("mosaic_xla_bwd", True), ("mosaic_own_bwd", False)):
        out[name] = functools.partial(_with_config, dataclasses.replace(default, backward_in_xla=xla_bwd))
    if tables.unsupported_reason(M, K, N) is None:
        out["mosaic_tables_xla_bwd"] = functools.partial(_with_config, tables)
    return {k: v for k, v in out.items() if k in names}


def _with_config(config, x, g, w):
    return pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=config)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--tag", default="", help="suffix of the record's name (ragged_rows<tag>.json)")
    args = parser.parse_args()
    unknown = sorted(set(args.forms.split(",")) - set(FORMS))
    if unknown:
        parser.error(f"--forms: unknown {unknown}; allowed: {', '.join(FORMS)}")
    path = os.path.join(args.out, f"ragged_rows{args.tag}.json")
    rows = []
    for text in args.shapes.split(","):
        M, K, N = map(int, text.split("x"))
        shape = dict(M=M, K=K, N=N)
        sets = [suite.make_inputs(M, K, N, seed=s) for s in range(3)]
        config = nm_config.mosaic_default_config(M, K, N)
        for mode in args.modes.split(","):
            row = dict(M=M, K=K, N=N, mode=mode, mosaic_config=config.to_dict(),
                       auto_backend=pallas_kernels.norm_matmul.plan(*sets[0][:3]).backend)
            row.update(time_forms(forms(M, K, N, args.forms.split(",")), sets, mode, shape, args.iterations))
            print(json.dumps({k: row[k] for k in ("M", "K", "N", "mode", "auto_backend", "us", "rel_error", "errors")}),
                  flush=True)
            rows.append(row)
            with open(path, "w") as f:  # (after every row: a call cut short keeps what it measured)
                json.dump(dict(environment=bench.environment(), rows=rows, tolerance="suite: tolerance(bf16, K)"), f,
                          indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
