"""One command for a GPU machine: the tests, then each op's sweep (optional) and suite, written into one folder.

    PYTHONPATH=$PWD python -m jaxfuse.gpu_run --out $OUT                        # tests + every op's suite
    PYTHONPATH=$PWD python -m jaxfuse.gpu_run --out $OUT --ops attention --tune --skip-tests --budget-s 500
    PYTHONPATH=$PWD python -m jaxfuse.gpu_run --out $OUT --ops "" --tests tests/test_mosaic_gemm.py \
        --test-workers 4 --test-timeout-s 500                                # the tests only, four processes

Writes into --out, every file named by ``bench.device_tag`` (h100 on an H100): ``pytest-<tag>.txt`` (status line,
then pytest's output), ``<op>-<tag>.json`` / ``.md`` per op (``bench.write_results``), with --tune
``<op>-sweep-<tag>.json`` and ``tuned_configs-<tag>.json`` (the sweep's winners in the ``pallas_kernels.tuning``
format: merge them into pallas_kernels/tuned_configs.json with ``tuning.store``, or copy the file, to make them
the defaults), and ``summary-<tag>.md`` (each op's summary table), which is also printed last. Everything is
time-boxed by --budget-s (default 540 s): pytest gets at most --test-timeout-s, the ops share the rest, and what
is not started in time is recorded as skipped. A failing step or op is printed and the run goes on. Beside the
pytest log, ``pytest-<tag>-progress.tsv`` records each test as it is collected and as it finishes, with its
outcome and seconds (``jaxfuse.pytest_progress``; the log ends with the slowest); a run cut by its timeout lists
the tests it never finished in ``pytest-<tag>-not-run.txt``, and ``--tests @that-file`` runs them next.

With --test-workers N, pytest-xdist runs the tests in N processes sharing the GPU, each allocating GPU memory as it
goes (``XLA_PYTHON_CLIENT_PREALLOCATE=false``; by default the first to start would hold 75% of it) and timing one
call at a time (``bench.CUPTI_LOCK_ENV``: the workers' CUPTI windows take turns). On the H200,
four took 189 GPU tests of the cross-entropy, Mosaic attention and model-site modules in 362 s, their compiles
running side by side (``pytest-gpu_sweep_cross_entropy_attention_sites-h200-bc30400.txt``). The tests run with
XLA's GEMM autotuning off unless --test-xla-autotune. With it on, eight workers compiling and autotuning their
float32 references at once saw 37 of the 150 tests that ran in ``test_norm_matmul_mosaic.py`` fail, likely past
their time limit (the cut run kept no tracebacks); all 37 then passed with it off on four workers, none over 37 s
(``pytest-nm_sweep_*-h200-*.txt``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

__all__ = ["main", "run_pytest"]


def run_pytest(paths: list[str], out_path: str, timeout_s: float, *, marker: str | None = None,
               workers: int = 1, xla_autotune: bool = False) -> tuple[str, str]:
    """``pytest -v PATHS`` in a subprocess for at most ``timeout_s`` seconds (``workers`` > 1: pytest-xdist's ``-n
    workers``, GPU memory allocated as needed; without ``xla_autotune``, XLA's GEMM autotuning off: the tests'
    float32 references then compile in seconds, not 20-40 s a shape); writes the status line and the output to
    ``out_path`` and returns (status, output): status "exit N" or "TIMED OUT after T s" (a timed-out run keeps
    what it printed, each test's outcome on its own line, and its whole process group is killed: no worker, nor
    any process a test started, is left holding the GPU; the node ids it never finished go to ``out_path``'s
    name with ``-not-run.txt``, one a line). The output ends with the slowest tests that finished, from the
    progress file (``jaxfuse.pytest_progress.slowest``), a cut run's too."""
    from jaxfuse import bench, pytest_progress

    progress_path, left_path = (os.path.splitext(out_path)[0] + suffix for suffix in ("-progress.tsv", "-not-run.txt"))
    for stale in (progress_path, left_path):  # an earlier run's, in the same folder
        if os.path.exists(stale):
            os.remove(stale)
    # The child is a pytest session of its own: no xdist worker variables inherited (when this runs inside a test).
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST_")}
    env.update(PYTHONUNBUFFERED="1", **{pytest_progress.ENV: progress_path})
    if workers > 1:  # GPU memory as needed; one CUPTI window at a time (``bench.CUPTI_LOCK_ENV``)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        env[bench.CUPTI_LOCK_ENV] = os.path.join(tempfile.gettempdir(), f"jaxfuse-cupti-{os.getpid()}.lock")
    if not xla_autotune:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "jaxfuse.pytest_progress",
               *(["-m", marker] if marker else []), *(["-n", str(workers)] if workers > 1 else []), *paths]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        status = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        status = f"TIMED OUT after {timeout_s:.0f} s"
        left = pytest_progress.not_run(progress_path)
        if left:
            with open(left_path, "w") as f:
                f.write("".join(f"{nodeid}\n" for nodeid in left))
            text += f"\n{len(left)} tests not run, listed in {left_path} (--tests @{left_path} runs them)\n"
    slow = pytest_progress.slowest(progress_path)
    if slow:  # from the progress file: there even when the run was cut (pytest's --durations prints at the end)
        text += "\nslowest tests (setup and call, seconds):\n" + "".join(
            f"{seconds:8.2f}  {outcome:<8} {nodeid}\n" for seconds, outcome, nodeid in slow)
    with open(out_path, "w") as f:
        f.write(f"{status}\n{text}")
    return status, text


def main(argv: list[str] | None = None) -> int:
    from jaxfuse import suites

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for every result file")
    parser.add_argument("--ops", default=",".join(op for op in suites.OPS if op != "train_step"),
                        help=f"comma-separated ops of {list(suites.OPS)} (default: all but train_step)")
    parser.add_argument("--shapes", default="", help="comma-separated shape names for every op (default: each "
                        "op's GPU shapes; with --tune the sweep runs at its tune shapes)")
    parser.add_argument("--tune", action="store_true", help="sweep each op's Pallas block sizes before its suite")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--tests", default="tests", help="comma-separated pytest paths, or @FILE: one node id a "
                        "line, such as the -not-run.txt a timed-out run writes (default: the whole suite)")
    parser.add_argument("--test-marker", default=None, help='pytest -m expression, e.g. "not slow"')
    parser.add_argument("--test-timeout-s", type=float, default=240.0)
    parser.add_argument("--test-workers", type=int, default=1, help="pytest processes sharing the GPU (pytest-xdist; "
                        "default 1)")
    parser.add_argument("--test-xla-autotune", action="store_true", help="keep XLA's GEMM autotuning on in the tests "
                        "(off by default: the float32 references' 20-40 s a shape)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for everything")
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations per suite measurement")
    parser.add_argument("--no-check", action="store_true", help="suites skip the float32 reference check (its "
                        "float32 GEMMs take 20-40 s to autotune per LM-head shape); sweeps always check")
    parser.add_argument("--allow-cpu", action="store_true", help="run without an NVIDIA GPU too (the ops' CPU "
                        "shapes, Pallas in interpret mode): for testing this script")
    args = parser.parse_args(argv)

    import jax

    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print(f"jaxfuse.gpu_run: runs the tests and times the ops' GPU shapes, so it needs an NVIDIA GPU; this "
              f"machine runs {jax.default_backend()}; --allow-cpu runs it anyway", file=sys.stderr)
        return 2
    start = time.time()
    deadline = start + args.budget_s
    log = lambda message: print(f"[{time.time() - start:6.1f}s] {message}", flush=True)  # noqa: E731
    os.makedirs(args.out, exist_ok=True)
    ops = [op for op in args.ops.split(",") if op]
    unknown = [op for op in ops if op not in suites.OPS]
    if unknown:
        parser.error(f"--ops: unknown {unknown}; one of {list(suites.OPS)}")
    if args.test_workers < 1:
        parser.error(f"--test-workers: got {args.test_workers}; at least 1")
    tests = args.tests.split(",")
    if args.tests.startswith("@"):
        try:
            with open(args.tests[1:], encoding="utf-8") as f:
                tests = [line.strip() for line in f if line.strip()]
        except OSError as e:
            parser.error(f"--tests: cannot read {args.tests[1:]!r} ({e.strerror})")
        if not tests:
            parser.error(f"--tests: {args.tests[1:]!r} names no test")
    if args.test_workers > 1 and importlib.util.find_spec("xdist") is None:
        parser.error(f"--test-workers: got {args.test_workers}, which needs pytest-xdist, not installed here "
                     "(pip install -e \".[test]\"), or 1")

    from jaxfuse import bench

    env = bench.environment()
    tag = bench.device_tag(env["device"])
    log(f"{env['device']}, jax {env['jax']}, commit {env['commit']}; devices {jax.devices()}")
    if not args.skip_tests:
        timeout = min(args.test_timeout_s, max(30.0, deadline - time.time() - 60))
        log(f"pytest -v {args.tests} (timeout {timeout:.0f} s, {args.test_workers} process(es))")
        status, text = run_pytest(tests, os.path.join(args.out, f"pytest-{tag}.txt"), timeout,
                                  marker=args.test_marker, workers=args.test_workers,
                                  xla_autotune=args.test_xla_autotune)
        log(f"pytest {status}:\n" + "\n".join(text.strip().splitlines()[-15:]))

    summaries = []
    for index, op in enumerate(ops):
        op_deadline = time.time() + (deadline - time.time()) / (len(ops) - index)
        log(f"{op}: until {op_deadline - start:.0f} s")
        try:
            result = suites.benchmark(op, [s for s in args.shapes.split(",") if s] or None,
                                      iterations=args.iterations, tune_first=args.tune,
                                      tuned_configs=os.path.join(args.out, f"tuned_configs-{tag}.json"),
                                      out=args.out, deadline=op_deadline, check=not args.no_check,
                                      progress=log)
            summaries.append(f"## {op}\n\n{suites.summary_table(result['records'])}\n")
            for path in result["written"]:
                log(f"wrote {path}")
        except Exception:  # noqa: BLE001 -- the next op still runs
            log(f"{op} FAILED:\n{traceback.format_exc()}")
            summaries.append(f"## {op}\n\nFAILED: {traceback.format_exc(limit=1)}\n")
    summary = (f"{env['device']}, jax {env['jax']}, commit {env['commit']}, {env['date']}\n\n"
               + "\n".join(summaries))
    with open(os.path.join(args.out, f"summary-{tag}.md"), "w") as f:
        f.write(summary)
    print(summary, flush=True)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
