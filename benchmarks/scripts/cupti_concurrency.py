"""Does CUPTI timing survive several processes timing kernels on one GPU at once?

    PYTHONPATH=$PWD python benchmarks/scripts/cupti_concurrency.py --out $OUT [--processes 1,2,4] [--seconds 20] \
        [--program matmul|attention] [--detach never,each]

Why: in the fifty-fourth session, eight pytest workers shared the H200 (``gpu_run --test-workers 8``). Two of them
aborted inside jax's CUPTI extension (``_cupti_get_timings``: "Fatal Python error: Aborted"), each in a test that
timed kernels with ``bench.time_kernels``. Was it the other processes? Not alone: 1, 2, 4 and 8 processes timing a
matmul ran 10 s each without an abort (``cupti_concurrency-h200-c5f01fd.json``). In the next device call, four
pytest workers ran the notebooks, and notebook 04's worker aborted in the same place
(``pytest-gpu_rerun_cpu_fixes-h200-c5f01fd.txt``). So the script also times XLA's attention (``--program
attention``), and compares CUPTI detached after every timed call (``--detach each``, the harness until 2026-11-30)
with CUPTI left attached (``never``, its default now). Four processes timing attention for 25 s did not abort in
either mode (``cupti_concurrency_attention-h200-10acd51.json``), so the abort is still not reproduced; detaching
cost each process about 20 ms a window (125 timed calls against about 1600).

For each --detach value and count P, P processes start together. Each one times --program with
``bench.time_kernels`` (10 iterations a call) until --seconds have passed. The parent records per process:
- its exit status (a signal such as SIGABRT as its negative number);
- how many timing calls it finished;
- its median time and timing method;
- the end of its stderr.
One row per (detach, count) is printed and saved to ``cupti_concurrency-<device>.json``.
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


def _program(name: str):
    """(jitted fn, two argument sets) for --program: "matmul", one 2048x2048 bf16 matmul (one kernel), or
    "attention", XLA's softmax attention at 2x1024x16x64 bf16 (several kernels, 128 MiB of float32 scores freed
    after each call: the form of notebook 04's program, where a worker aborted)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(os.getpid())
    if name == "matmul":
        x = jax.random.normal(key, (2048, 2048), jnp.bfloat16)
        return jax.jit(lambda a: a @ a), [(x,), (x + 1,)]

    def attention(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)

    sets = [tuple(jax.random.normal(k, (2, 1024, 16, 64), jnp.bfloat16) for k in jax.random.split(seed, 3))
            for seed in jax.random.split(key, 2)]
    return jax.jit(attention), sets


def worker(seconds: float, program: str) -> None:
    """Times --program over and over for ``seconds``; prints one JSON line: calls, median µs, method."""
    from jaxfuse import bench

    f, sets = _program(program)
    medians, method = [], ""
    deadline = time.time() + seconds
    while time.time() < deadline:
        timing = bench.time_kernels(f, sets, iterations=10, warmup=1)
        medians.append(timing.median_us)
        method = timing.method
    print(json.dumps({"calls": len(medians), "median_us": statistics.median(medians) if medians else None,
                      "method": method}), flush=True)


def run_together(processes: int, seconds: float, program: str, detach: str) -> dict:
    """``processes`` workers started at once; their exit codes, calls, medians, methods and stderr tails."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", JAXFUSE_CUPTI_DETACH=detach)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(seconds),
                               "--program", program],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(processes)]
    row: dict = {"processes": processes, "seconds": seconds, "program": program, "detach": detach, "exit_codes": [],
                 "calls": [], "median_us": [], "method": [], "stderr_tails": []}
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
    parser.add_argument("--program", default="matmul", choices=("matmul", "attention"),
                        help="what each process times: one matmul, or XLA's attention (several kernels)")
    parser.add_argument("--detach", default="never,each",
                        help="comma-separated: never (CUPTI stays attached between windows, jaxfuse's default), "
                             "each (detached after every timed call, as before 2026-11-30); each run in turn")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU too (wall-clock timing)")
    parser.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.program)
        return 0
    if not args.out:
        parser.error("--out: a folder for the results is needed")
    try:
        counts = [int(p) for p in args.processes.split(",")]
    except ValueError:
        parser.error(f"--processes: expected comma-separated counts such as 1,2,4, got {args.processes!r}")
    if any(p < 1 for p in counts):
        parser.error(f"--processes: each count must be at least 1, got {args.processes!r}")
    detaches = args.detach.split(",")
    if not detaches or any(d not in ("never", "each") for d in detaches):
        parser.error(f"--detach: expected never, each or both (comma-separated), got {args.detach!r}")
    if args.seconds <= 0:
        parser.error(f"--seconds: must be positive, got {args.seconds}")

    import jax

    from attention_fused_bwd import results_file

    if jax.default_backend() != "gpu" and not args.allow_cpu:
        parser.error(f"this machine runs {jax.default_backend()}: CUPTI needs a GPU (--allow-cpu to test the script)")
    result, save, path = results_file(args.out, "cupti_concurrency")
    for detach in detaches:
        for count in counts:
            row = run_together(count, args.seconds, args.program, detach)
            result["timings"].append(row)
            save()
            print(f"{args.program}, detach {detach}, {count} process(es): exit codes {row['exit_codes']}, calls "
                  f"{row['calls']}, median µs {row['median_us']}, {row['method']}", flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
