"""What one program of each Mosaic attention kernel costs beyond its pipeline steps, on the H100: the kernels' time
at shapes that vary the steps per program with the program count fixed, and a least-squares fit of
  kernel time · SMs / programs = fixed + per_step · steps
per kernel (fixed: launch, prologue loads, the pipeline's fill and drain, the epilogue; per_step: one tile's work).

    PYTHONPATH=$PWD python benchmarks/scripts/attention_program_cost.py --out $OUT [--iterations 20]

One config for every shape (the table's entry for the main shape, B4 T=S=4096 N16 H128, non-causal), bf16,
N = K = 16, H = 128, non-causal. Timing: CUPTI medians of jax.vjp's forward and backward (``attention_fused_bwd.
vjp_fn``, three input sets past the L2), per kernel. Writes ``attention_program_cost-<device>.json``.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from attention_fused_bwd import results_file, vjp_fn
from jaxfuse import bench
from jaxfuse.suites.attention import make_inputs
from pallas_kernels.attention import mosaic
from pallas_kernels.index_math import cdiv

SHAPES = [(64, 256, 256), (16, 1024, 1024), (16, 1024, 2048), (16, 1024, 4096), (4, 4096, 4096), (16, 2048, 1024),
          (8, 1024, 8192)]  # (B, T, S)
N = K = 16
H = 128


def programs_and_steps(cfg, B: int, T: int, S: int) -> dict:
    """kernel name fragment -> (programs, pipeline steps per program) for a non-causal call."""
    fwd_rows = 2 * cfg.block_q
    return {
        "attention_fwd": (B * N * cdiv(T, fwd_rows), cdiv(S, cfg.block_kv)),
        "attention_dq": (B * N * cdiv(T, cfg.compute_wgs_dq * cfg.block_q_dq), cdiv(S, cfg.block_kv_dq)),
        "attention_dkv": (B * K * cdiv(S, cfg.compute_wgs_dkv * cfg.block_kv_dkv), cdiv(T, cfg.block_q_dkv)),
    }


def fit(points: list[tuple[int, int, float]], sms: int) -> dict:
    """Least squares of us · sms / programs = fixed + per_step · steps over (programs, steps, us) points."""
    steps = np.array([s for _, s, _ in points], float)
    per_program = np.array([us * sms / p for p, _, us in points])
    a = np.stack([np.ones_like(steps), steps], 1)
    (fixed, per_step), *_ = np.linalg.lstsq(a, per_program, rcond=None)
    return dict(fixed_us=float(fixed), per_step_us=float(per_step),
                residual_us=[float(r) for r in per_program - a @ np.array([fixed, per_step])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    result, save, path = results_file(args.out, "attention_program_cost")
    sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    q0, k0, v0, _ = make_inputs(4, 4096, 4096, N, K, H)
    cfg = mosaic.default_config(q0, k0, v0, causal=False)
    result["config"], result["sms"] = str(cfg), sms
    points: dict[str, list] = {}
    for B, T, S in SHAPES:
        sets = [make_inputs(B, T, S, N, K, H, seed=i) for i in range(3)]
        try:
            t = bench.time_kernels(vjp_fn(cfg, False), sets, iterations=args.iterations)
        except Exception as e:  # noqa: BLE001
            result["timings"].append(dict(shape=[B, T, S], error=f"{type(e).__name__}: {e}"[:800]))
            save()
            continue
        row = dict(shape=[B, T, S], us=t.median_us, spread=t.spread, per_kernel_us=t.per_kernel_us, kernels={})
        for frag, (programs, steps) in programs_and_steps(cfg, B, T, S).items():
            us = next((v for name, v in t.per_kernel_us.items() if frag in name), None)
            if us is None:
                continue
            row["kernels"][frag] = dict(programs=programs, steps=steps, us=us,
                                        us_per_program_wave=us * sms / programs)
            points.setdefault(frag, []).append((programs, steps, us))
            print(f"B{B} T{T} S{S} {frag:14s} programs {programs:6d} steps {steps:3d} {us:8.1f} µs "
                  f"{us * sms / programs:7.2f} µs per program-wave", flush=True)
        result["timings"].append(row)
        save()
    result["fits"] = {frag: fit(p, sms) for frag, p in points.items() if len(p) >= 2}
    for frag, f in result["fits"].items():
        print(f"{frag:14s} fixed {f['fixed_us']:6.2f} µs + {f['per_step_us']:5.3f} µs per step "
              f"(residuals {np.round(f['residual_us'], 2).tolist()})")
    save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
