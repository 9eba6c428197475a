"""The fused chunk step (``pallas_kernels.cross_entropy.mosaic_step``) against the two kernels it replaces, on the
H100: chunk c − 1's dw update (the Mosaic GEMM core accumulating in place) and chunk c's logits GEMM with its
softmax statistics (``mosaic_logits``), each alone, and the fused kernel with both tile kinds, with update tiles
only and with logits tiles only (a measurement hook: incomplete results).

    PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_fused_step.py --out $OUT [--shapes 4k_256k,8k_128k]
        [--temp-fraction 0.05] [--iterations 20] [--stages 3,5]

Per shape (the suite's H and V, the memory rule's chunk Bc): µs of each kernel (CUPTI, medians, interleaved), with
the floors of one chunk's work: the FLOPs of both GEMMs (2 · 2·Bc·H·V at 805 TFLOP/s) and the bytes they must move
(dw read and written, dl read, w read once, the logits written: 2.94 TB/s). Writes
``cross_entropy_fused_step-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

import jax
import jax.numpy as jnp

from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from jaxfuse.suites.cross_entropy import SHAPES
from pallas_kernels import gemm as mosaic_gemm
from pallas_kernels.cross_entropy import config as ce_config
from pallas_kernels.cross_entropy import mosaic_logits, mosaic_step

PEAK_FLOPS, PEAK_BYTES = 805e12, 2.94e12  # shared/anchors.md: the H100's measured bf16 GEMM and copy rates


def kernel_us(timing, prefix: str) -> float:
    """The summed median µs of the kernels whose name starts with ``prefix``."""
    return sum(us for name, us in timing.per_kernel_us.items() if name.startswith(prefix))


def with_parts(parts: tuple, stages: int | None = None):
    """update_and_logits traced with only the tile kinds ``parts`` (``mosaic_step._PARTS``) and ``stages`` ring
    stages (default: mosaic_step.NUM_STAGES)."""
    def fn(*args):
        with mock.patch.object(mosaic_step, "_PARTS", parts), \
                mock.patch.object(mosaic_step, "NUM_STAGES", stages or mosaic_step.NUM_STAGES):
            return mosaic_step.update_and_logits(*args)

    return fn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="4k_256k,8k_128k")
    parser.add_argument("--temp-fraction", type=float, default=0.05)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--stages", default="", help="ring depths the fused kernel also runs with (e.g. 3,5)")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "cross_entropy_fused_step")
    for name in args.shapes.split(","):
        s = SHAPES[name]
        B, H, V = s["B"], s["H"], s["V"]
        Bc = ce_config.chunk_rows_for(B, H, V, jnp.bfloat16, args.temp_fraction)
        keys = jax.random.split(jax.random.key(0), 5)
        normal = lambda k, shape, scale: (scale * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16)  # noqa
        h_prev, h_next = normal(keys[0], (Bc, H), 1.0), normal(keys[1], (Bc, H), 1.0)
        dl, w, dw = normal(keys[2], (Bc, V), 1e-3), normal(keys[3], (H, V), 0.05), normal(keys[4], (H, V), 1e-2)
        fused = jax.jit(mosaic_step.update_and_logits)
        calls = {
            "update": (jax.jit(lambda a, b, c: mosaic_gemm.matmul(a, b, transpose_a=True, accumulate_into=c)),
                       (h_prev, dl, dw), "mosaic_matmul_accumulate"),
            "logits": (jax.jit(mosaic_logits.logits_and_lse), (h_next, w), "linear_cross_entropy_logits"),
            "fused": (fused, (h_prev, dl, h_next, w, dw), "linear_cross_entropy_update_and_logits"),
        }
        for parts in ("update", "logits"):
            calls[f"fused_{parts}_tiles_only"] = (jax.jit(with_parts((parts,))), (h_prev, dl, h_next, w, dw),
                                                  "linear_cross_entropy_update_and_logits")
        for stages in [int(x) for x in args.stages.split(",") if x]:
            for parts, label in (((mosaic_step._UPDATE, mosaic_step._LOGITS), ""), (("update",), "_update_tiles_only")):
                calls[f"fused{label}_{stages}_stages"] = (jax.jit(with_parts(parts, stages)),
                                                          (h_prev, dl, h_next, w, dw),
                                                          "linear_cross_entropy_update_and_logits")
        row = dict(shape=name, B=B, H=H, V=V, chunk_rows=Bc,
                   floor_flops_us=2 * 2 * Bc * H * V / PEAK_FLOPS * 1e6,
                   floor_bytes_us=2 * (2 * H * V + 2 * Bc * V + H * V) / PEAK_BYTES * 1e6)
        with recorded_row(result, save, row):
            timings = bench.time_interleaved([(fn, a) for fn, a, _ in calls.values()], iterations=args.iterations)
            row["kernel_us"] = {k: kernel_us(t, prefix) for (k, (_, _, prefix)), t in zip(calls.items(), timings)}
            row["separate_us"] = row["kernel_us"]["update"] + row["kernel_us"]["logits"]
            print(name, Bc, {k: round(v) for k, v in row["kernel_us"].items()}, "separate", round(row["separate_us"]),
                  "floors", round(row["floor_flops_us"]), round(row["floor_bytes_us"]), flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
