"""The SM clock, board power and clock-event reasons under each GEMM, sustained: whether the power limit sets the
GEMMs' clock.

    PYTHONPATH=$PWD python benchmarks/scripts/gemm_clocks.py --out $OUT [--seconds 2] \
        [--shapes 32768x4096x4096,4096x4096x14336,8192x4096x6144-qkv]

Cases: the tensor-core ceiling kernel in each of its operand cases (``tensor_core_ceiling.OPERANDS``: wgmma on
operands loaded into shared memory once, no memory traffic), and per suite shape cuBLAS's matmul alone, XLA's
norm + matmul and our Mosaic forward in its default config (``jaxfuse.suites.rmsnorm_matmul``). Each case first
gets its CUPTI time (``bench.time_kernels``, median), then runs back to back for ``--seconds`` while ``nvidia-smi
-lms`` samples the SM clock, the board power and the active clock-event (throttle) reasons; the samples of the
second half (steady state) give the medians.
What the samples can and cannot say (H100, gemm_clocks-h100-9055c87.json): every case ran at the 700 W limit with
the software power cap (reason 0x4) active, at sampled clocks of 1.34-1.64 GHz; but the sampled clock is not the
clock a kernel ran at on average (the power cap moves it faster than 20 ms samples see): the first record divided
each rate by it and got more FLOP per clock than the tensor cores have (132 SMs x 4096), so this script no longer
reports rates per clock. Nsight Compute's per-kernel clock (``ncu_kernels.py``) is the one to divide by.
Writes ``gemm_clocks-<device>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import jax

import pallas_kernels
from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from pallas_kernels import mosaic_utils as mu
from tensor_core_ceiling import OPERANDS, TILE_K, TILE_M, TILE_N, ceiling_case

QUERIES = ("clocks.sm,power.draw,clocks_event_reasons.active", "clocks.sm,power.draw,clocks_throttle_reasons.active")


def smi_query() -> str:
    """The first of QUERIES this driver's nvidia-smi answers (the reasons' field was renamed)."""
    for query in QUERIES:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.count(",") == 2:
            return query
    raise RuntimeError(f"nvidia-smi answers none of {QUERIES}")


def sample_clocks(fn, args, seconds: float, query: str) -> dict:
    """Runs fn(*args) back to back for ``seconds`` under ``nvidia-smi -lms 20``; medians of the second half."""
    with tempfile.NamedTemporaryFile("w+", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "20"],
                               stdout=log, stderr=subprocess.DEVNULL)
        calls, start = 0, time.perf_counter()
        try:
            while time.perf_counter() - start < seconds:
                for _ in range(8):
                    out = fn(*args)
                    calls += 1
                jax.block_until_ready(out)
        finally:
            smi.terminate()
            smi.wait()
        log.seek(0)
        rows = [line.split(", ") for line in log.read().splitlines() if line.count(",") == 2]
    steady = rows[len(rows) // 2:]
    if not steady:
        return dict(samples=0)
    mhz = [float(r[0]) for r in steady]
    watts = [float(r[1]) for r in steady]
    reasons = sorted({r[2].strip() for r in steady})
    return dict(samples=len(steady), sm_mhz=statistics.median(mhz), sm_mhz_min=min(mhz), sm_mhz_max=max(mhz),
                power_w=statistics.median(watts), clock_event_reasons=reasons,
                calls_per_s=calls / (time.perf_counter() - start))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=20000, help="the ceiling kernel's wgmma steps per warpgroup")
    parser.add_argument("--operands", default=",".join(OPERANDS), help="the ceiling kernel's operand cases")
    parser.add_argument("--shapes", default="32768x4096x4096,4096x4096x14336,8192x4096x6144-qkv")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "gemm_clocks")
    unknown = sorted(set(args.operands.split(",")) - set(OPERANDS))
    if unknown:
        parser.error(f"--operands: unknown {unknown}; allowed: {sorted(OPERANDS)}")
    query = smi_query()
    ceiling_flops = mu.num_sms() * args.steps * 2.0 * TILE_M * TILE_N * TILE_K
    cases = [(f"ceiling/{c}", *ceiling_case(c, args.steps), ceiling_flops) for c in args.operands.split(",")]
    impls = suite.SPEC.implementations()
    for name in args.shapes.split(","):
        s = suite.SHAPES[name]
        x, g, w, _ = suite.make_inputs(s["M"], s["K"], s["N"])
        flops = 2.0 * s["M"] * s["K"] * s["N"]
        mosaic = lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic")  # noqa: E731
        for impl, fn in (("xla_matmul_alone", impls["xla_matmul_alone"]), ("xla", impls["xla"]),
                         ("pallas_mosaic", mosaic)):
            cases.append((f"{name}/{impl}", jax.jit(fn), (x, g, w), flops))
    for name, fn, fn_args, flops in cases:
        row = dict(case=name)
        with recorded_row(result, save, row):
            timing = bench.time_kernels(fn, [fn_args], iterations=10, warmup=2)
            row.update(us=timing.median_us, tflops=flops / timing.median_us / 1e6)
            row.update(sample_clocks(fn, fn_args, args.seconds, query))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
