"""Does CUPTI timing survive several processes timing kernels on one GPU at once?

    PYTHONPATH=$PWD python benchmarks/scripts/cupti_concurrency.py --out $OUT [--processes 1,2,4] [--seconds 20]

Why: in the fifty-fourth session, eight pytest workers shared the H200 (``gpu_run --test-workers 8``). Two of them
aborted inside jax's CUPTI extension (``_cupti_get_timings``: "Fatal Python error: Aborted"), each in a test that
timed kernels with ``bench.time_kernels``. Was it the other processes?

For each count P, P processes start together. Each one times a jitted 2048x2048 bf16 matmul with
``bench.time_kernels`` (10 iterations a call) until --seconds have passed. The parent records per process:
- its exit status (a signal such as SIGABRT as its negative number);
- how many timing calls it finished;
- its median time and timing method;
- the end of its stderr.
One row per count is printed and saved to ``cupti_concurrency-<device>.json``.
--allow-cpu runs the same on the CPU (wall-clock timing): for testing this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(seconds: float) -> None:
    """Times one matmul over and over for ``seconds``; prints one JSON line: calls, median µs, method."""
    import jax
    import jax.numpy as jnp

    from jaxfuse import bench

    x = jax.random.normal(jax.random.key(os.getpid()), (2048, 2048), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    medians, method = [], ""
    deadline = time.time() + seconds
    while time.time() < deadline:
        timing = bench.time_kernels(f, [(x,), (x + 1,)], iterations=10, warmup=1)
        medians.append(timing.median_us)
        method = timing.method
    print(json.dumps({"calls": len(medians), "median_us": statistics.median(medians) if medians else None,
                      "method": method}), flush=True)


def run_together(processes: int, seconds: float) -> dict:
    """``processes`` workers started at once; their exit codes, calls, medians, methods and stderr tails."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(seconds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(processes)]
    row: dict = {"processes": processes, "seconds": seconds, "exit_codes": [], "calls": [], "median_us": [],
                 "method": [], "stderr_tails": []}
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=seconds + 300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {}
        row["exit_codes"].append(proc.returncode)
        row["calls"].append(result.get("calls"))
        row["median_us"].append(result.get("median_us"))
        row["method"].append(result.get("method"))
        row["stderr_tails"].append(err[-1500:] if proc.returncode else "")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for cupti_concurrency-<device>.json")
    parser.add_argument("--processes", default="1,2,4", help="comma-separated process counts, each run in turn")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each process keeps timing")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU too (wall-clock timing)")
    parser.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    if not args.out:
        parser.error("--out: a folder for the results is needed")
    try:
        counts = [int(p) for p in args.processes.split(",")]
    except ValueError:
        parser.error(f"--processes: expected comma-separated counts such as 1,2,4, got {args.processes!r}")
    if any(p < 1 for p in counts):
        parser.error(f"--processes: each count must be at least 1, got {args.processes!r}")
    if args.seconds <= 0:
        parser.error(f"--seconds: must be positive, got {args.seconds}")

    import jax

    from attention_fused_bwd import results_file

    if jax.default_backend() != "gpu" and not args.allow_cpu:
        parser.error(f"this machine runs {jax.default_backend()}: CUPTI needs a GPU (--allow-cpu to test the script)")
    result, save, path = results_file(args.out, "cupti_concurrency")
    for count in counts:
        row = run_together(count, args.seconds)
        result["timings"].append(row)
        save()
        print(f"{count} process(es): exit codes {row['exit_codes']}, calls {row['calls']}, median µs "
              f"{row['median_us']}, {row['method']}", flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
