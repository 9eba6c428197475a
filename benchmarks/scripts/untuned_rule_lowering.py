"""Where the Mosaic rmsnorm_matmul's untuned rule (``norm_matmul.config.UNTUNED_FROM``) applies on an H200, and
whether forward + backward then lower for CUDA: a grid of shapes, on any machine (no GPU needed).

    PYTHONPATH=$PWD python benchmarks/scripts/untuned_rule_lowering.py [--out DIR]

For each (M, K, N) of the grid below (bfloat16, no residual, no tuned entry): the config a call takes with the
device kind set to the H200's, and, where it is the entry at UNTUNED_FROM, the lowering of jax.vjp's forward and
backward inside ``backends.lowering_for_gpu()`` (shared memory, the kernels' own checks). Prints one line per
failure and the counts; with --out, writes them as JSON. At 3165e46: 348 shapes take the entry and lower, 42 keep
the built-in tables, 0 fail (before the rule's checks, those 42 raised: NOTES.md, sixty-second session); the same at
1dd3b72, with the dx tiles 192 or 160 wide where ``_untuned_dx`` narrows them, and at b5756f0, with the dw kernel's
stream-K split of ``_untuned_dw``. With K = 3584 and 7168 added (450 shapes) at 37c6f62, with the forward's tiles
128 wide at few rows (``_untuned_forward``) and its output stored at the tile's end where it has no stream-K phase,
the dx tiles also 224 and 64 wide, and the dw split wherever stream-K plans one: 406 take the entry and lower, 44
keep the tables, 0 fail (about 8 minutes on 2 cores); the same at 1ac46de, with r from XLA at 1024 rows and fewer
and the dx kernel split by stream-K where its tiles fill at most half the grid; and at 571eb1e, with XLA's
backward there instead (108 shapes), a 6-deep forward ring (108) and 64-wide forward tiles (140); the same at
71a56d3, with the forward's K loop split at few rows and XLA's backward where XLA runs the dw GEMM; and at 19fb873,
with XLA's backward also where the entry's dx tiles would fill at most half the grid (212 shapes take XLA's backward)
and an 8-deep forward ring where 64-wide tiles take it (81 shapes; 27 take 6 stages). At 654d9c2, with the entry's
tiles narrowed before its fit is judged and r from XLA's pass in whole forward tiles at short K (6 shapes): 420 take
the entry and lower, 30 keep the tables (all at K = 40960: rows of 160 dx tiles), 0 fail; the same at 309681c, with
the ping-pong forward below K = 1024 (28 shapes; about 4.5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import backends, tuning
from pallas_kernels.norm_matmul import config as nm_config

MS = (128, 256, 1024, 4096, 32768)
KS = (256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 7168, 8192, 16384, 40960)
NS = (256, 768, 2816, 5632, 14336, 65536)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    counts, failures = dict(entry=0, tables=0, failed=0), []
    with mock.patch.object(tuning, "device_kind", lambda: "NVIDIA H200"):
        for M, K, N in itertools.product(MS, KS, NS):
            if nm_config.mosaic_default_config(M, K, N) == nm_config.mosaic_builtin_config(M, K, N):
                counts["tables"] += 1
                continue
            counts["entry"] += 1
            x, g, w = (jax.ShapeDtypeStruct(s, d) for s, d in (((M, K), jnp.bfloat16), ((K,), jnp.float32),
                                                               ((K, N), jnp.bfloat16)))

            def fwd_bwd(x, g, w, M=M, N=N):
                y, vjp = jax.vjp(lambda *a: pallas_kernels.rmsnorm_matmul(*a, backend="mosaic"), x, g, w)
                return y, vjp(jnp.ones((M, N), jnp.bfloat16))

            try:
                with backends.lowering_for_gpu():
                    jax.jit(fwd_bwd).trace(x, g, w).lower(lowering_platforms=("cuda",))
            except Exception as error:  # noqa: BLE001 - every failing shape is reported, the others still lower
                counts["failed"] += 1
                failures.append(dict(M=M, K=K, N=N, error=f"{type(error).__name__}: {error}"[:600]))
                print("FAIL", M, K, N, failures[-1]["error"], flush=True)
    print(counts)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "untuned_rule_lowering.json"), "w") as f:
            json.dump(dict(counts=counts, failures=failures, shapes=dict(M=MS, K=KS, N=NS)), f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
