"""dw from the dx kernel (``dw_in_dx``) at decode shapes with no tuned entry: the built-in Triton table's decode
config against the same config with dw_in_dx (the table's dx tiles, and the H200 entries' 32x128 tiles with N split
4 ways), forward + backward, against XLA in the same run.

    PYTHONPATH=$PWD python benchmarks/scripts/decode_dw_in_dx_table.py --out $OUT

CUPTI medians over 40 calls, 3 input sets rotated (``bench.time_kernels``); every config's outputs and gradients
checked against the float32 reference within the suite's tolerance. Writes ``decode_dw_in_dx_table.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from jaxfuse.suites.runner import reference_outputs
from pallas_kernels.norm_matmul import config as nm_config

SHAPES = [(1, 2048, 8192), (4, 1024, 3072), (8, 4096, 12288), (16, 2048, 5632), (16, 8192, 8192)]
FORMS = {"table": {}, "dw_in_dx": dict(dw_in_dx=True, rowdot_in_dx=False),
         "dw_in_dx_32x128_s4": dict(dw_in_dx=True, rowdot_in_dx=False, block_k_dx=32, block_n_dx=128, split_n_dx=4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=40)
    args = parser.parse_args()
    rows = []
    for M, K, N in SHAPES:
        shape = dict(M=M, K=K, N=N)
        sets = [suite.make_inputs(M, K, N, seed=s) for s in range(3)]
        table = nm_config.RMSNormMatmulConfig(**nm_config.fit_to_shape(
            pallas_kernels.tuning.rmsnorm_matmul_table(M, jnp.bfloat16, on_gpu=True), M, K, N))
        want = [np.asarray(a, np.float32) for a in reference_outputs(suite.SPEC, sets[0], "fwd+bwd", shape, {})]
        fns = {"xla": suite.SPEC.implementations()["xla"]}
        for name, change in FORMS.items():
            cfg = dict(table.to_dict(), **change)
            fns[name] = lambda x, g, w, _c=cfg: pallas_kernels.rmsnorm_matmul(x, g, w, backend="triton",
                                                                              block_sizes=_c)
        row = dict(M=M, K=K, N=N, table=table.to_dict(), us={}, rel_error={})
        for name, fn in fns.items():
            program = jax.jit(suite.SPEC.program(fn, "fwd+bwd", shape, {}))
            got = jax.tree.leaves(program(*sets[0]))
            row["rel_error"][name] = bench.max_difference(zip(got, want), relative=True)
            row["us"][name] = bench.time_kernels(program, sets, iterations=args.iterations).median_us
        row["speedup_vs_xla"] = {k: row["us"]["xla"] / v for k, v in row["us"].items() if k != "xla"}
        print(json.dumps({k: row[k] for k in ("M", "K", "N", "us", "rel_error")}), flush=True)
        rows.append(row)
    path = os.path.join(args.out, "decode_dw_in_dx_table.json")
    with open(path, "w") as f:
        json.dump(dict(environment=bench.environment(), rows=rows, tolerance="suite: tolerance(bf16, K)"), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
