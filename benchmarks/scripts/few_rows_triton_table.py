"""The Triton backend's built-in tiles at 17-256 rows (shapes no tuned entry covers): the table's config against
forms whose row block holds every row (w read once, not once per 16-row block) and whose column tiles and K split
give the grid enough programs, forward and forward + backward, against XLA in the same run.

    PYTHONPATH=$PWD python benchmarks/scripts/few_rows_triton_table.py --out $OUT [--shapes 64x4096x14336,...]

At 64x4096x14336 the decode table's 16-row blocks read w four times (the forward 132 µs against XLA's 39), and at
100x2048x8192 the large table's 128x256 tiles make 32 programs (65 µs against 16; H200, 71st session). CUPTI medians
(``bench.time_kernels``), 3 input sets rotated; every form's outputs and gradients checked against the float32
reference. A form Triton cannot compile is recorded with its error. Writes ``few_rows_triton_table.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

import pallas_kernels
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from jaxfuse.suites.runner import reference_outputs
from pallas_kernels.norm_matmul import config as nm_config

SHAPES = "32x4096x14336,64x4096x14336,48x1024x3072,100x2048x8192,128x4096x4096,200x2048x5632,256x4096x11008"


def _whole_rows(M: int) -> int:
    return min(128, max(16, pl.next_power_of_2(M)))


def _decode_whole(M: int, **change) -> dict:
    """The decode table's tiles with every row (up to 128) in one row block of each kernel; dw by XLA's GEMM."""
    rows = _whole_rows(M)  # (128 rows: 3 stages of 128x128 x and w blocks fit in shared memory, 4 do not)
    params = dict(pallas_kernels.tuning.rmsnorm_matmul_table(1, jnp.bfloat16, on_gpu=True), block_m=rows,
                  num_stages=3 if rows == 128 else 4,
                  block_m_dx=rows, block_m_dw=rows, block_n_dx=128, num_stages_dx=3, dw_in_dx=False,
                  dw_in_xla=True, split_n_dx=1)
    return dict(params, **change)


FORMS = {
    "table": lambda M: None,
    "whole": lambda M: _decode_whole(M),
    "whole_w8": lambda M: _decode_whole(M, num_warps=8, num_warps_dx=8),
    "whole_s1": lambda M: _decode_whole(M, split_k=1),
    "whole_s2": lambda M: _decode_whole(M, split_k=2),
    "whole_s8": lambda M: _decode_whole(M, split_k=8),
    "whole_n64_s2": lambda M: _decode_whole(M, block_n=64, split_k=2),
    "whole_dx_k64": lambda M: _decode_whole(M, block_k_dx=64),
    "whole_dx_split2": lambda M: _decode_whole(M, split_n_dx=2),
}


def time_forms(fns: dict, sets: list, mode: str, shape: dict, iterations: int) -> dict:
    """Each of ``fns`` ((x, gamma, w) -> y; "xla" among them) as the suite's program for ``mode`` at ``shape``: its
    CUPTI median µs and per-kernel µs over the input ``sets`` and its largest relative difference from the float32
    reference; a form that does not compile or run is recorded with its error, and the others go on.
    Returns dict(us, per_kernel_us, rel_error, errors, speedup_vs_xla), each keyed by the fns' names."""
    want = [np.asarray(a, np.float32) for a in reference_outputs(suite.SPEC, sets[0], mode, shape, {})]
    out = dict(us={}, per_kernel_us={}, rel_error={}, errors={})
    for name, fn in fns.items():
        try:
            program = jax.jit(suite.SPEC.program(fn, mode, shape, {}))
            got = jax.tree.leaves(program(*sets[0]))
            out["rel_error"][name] = bench.max_difference(zip(got, want), relative=True)
            timing = bench.time_kernels(program, sets, iterations=iterations)
            out["us"][name], out["per_kernel_us"][name] = timing.median_us, timing.per_kernel_us
        except Exception as e:  # noqa: BLE001 -- a form that does not compile or run is a result, recorded
            out["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
    xla = out["us"].get("xla")
    out["speedup_vs_xla"] = {k: xla / v for k, v in out["us"].items() if k != "xla"} if xla else {}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--modes", default="fwd+bwd")
    args = parser.parse_args()
    rows = []
    for text in args.shapes.split(","):
        M, K, N = map(int, text.split("x"))
        shape = dict(M=M, K=K, N=N)
        sets = [suite.make_inputs(M, K, N, seed=s) for s in range(3)]
        table = nm_config.default_config(M, K, N, on_gpu=True)
        for mode in args.modes.split(","):
            row = dict(M=M, K=K, N=N, mode=mode, table=table.to_dict(), configs={})
            fns = {"xla": suite.SPEC.implementations()["xla"]}
            for name in args.forms.split(","):
                params = FORMS[name](M)
                cfg = table if params is None else nm_config.RMSNormMatmulConfig(
                    **nm_config.fit_to_shape(params, M, K, N))
                row["configs"][name] = cfg.to_dict()
                fns[name] = lambda x, g, w, _c=cfg: pallas_kernels.rmsnorm_matmul(x, g, w, backend="triton",
                                                                                  block_sizes=_c)
            row.update(time_forms(fns, sets, mode, shape, args.iterations))
            print(json.dumps({k: row[k] for k in ("M", "K", "N", "mode", "us", "rel_error", "errors")}), flush=True)
            rows.append(row)
    path = os.path.join(args.out, "few_rows_triton_table.json")
    with open(path, "w") as f:
        json.dump(dict(environment=bench.environment(), rows=rows, tolerance="suite: tolerance(bf16, K)"), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
