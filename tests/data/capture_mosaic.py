"""Capture a Mosaic-GPU program's optimized HLO and the names its launches have under CUPTI (sm90 GPU only).

    PYTHONPATH=$PWD python tests/data/capture_mosaic.py --out tests/data

Writes `h200_mosaic_norm_matmul.hlo.txt` (the GPU's short name first): the rmsnorm_matmul forward on the Mosaic
backend at 4096x1024x2048, compiled; and prints each kernel of the report beside the launches
`jaxfuse.measure` attributes to it, which tests/test_measure.py takes as the launches of one call.
"""

from __future__ import annotations

import argparse
import os

import jax

import hlo_inspect
import pallas_kernels
from jaxfuse import costmodel, measure
from jaxfuse.suites.rmsnorm_matmul import make_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    x, gamma, w, _ = make_inputs(4096, 1024, 2048, seed=0)
    fn = jax.jit(lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic"))
    prefix = jax.devices()[0].device_kind.lower().split()[-1]  # "NVIDIA H200" -> "h200"
    with open(os.path.join(args.out, f"{prefix}_mosaic_norm_matmul.hlo.txt"), "w") as f:
        f.write(fn.lower(x, gamma, w).compile().as_text())
    report = hlo_inspect.inspect(fn, x, gamma, w)
    rows, _ = measure.measure_kernels(report, fn, (x, gamma, w), device=costmodel.detect(), iterations=10)
    for row in rows:
        print(row.kernel.name if row.kernel else "(unattributed)", row.kernel and row.kernel.category,
              row.device_names, f"{row.measured_us:.1f} µs")


if __name__ == "__main__":
    main()
