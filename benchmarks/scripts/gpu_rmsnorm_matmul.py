"""On one H100: the rmsnorm_matmul tests at GPU shapes, the benchmark suite, then a short block-size sweep.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_rmsnorm_matmul.py --out $OUT

Writes into --out: pytest.txt (the test run), rmsnorm_matmul-<device tag>.json/.md (bench.write_results), sweep.txt and
tuned_configs.json (the best config per shape, in pallas_kernels.tuning's cache format: merge the entries into
pallas_kernels/tuned_configs.json with tuning.store to make them the defaults). Everything is time-boxed
(--budget-s, default 450 s in all); a failing step, shape or candidate is reported and the rest goes on.

Every sweep candidate is first checked against the float32 reference (pallas_kernels.reference) on the very inputs
it is timed on: y for forward candidates, y and dx, dgamma, dw for forward + backward ones. A candidate whose
relative error (max |got - want| / max |want|) exceeds MAX_REL_ERR, or is not finite, is REJECTED (printed with its
error, never timed, never chosen): a fast wrong kernel must not reach tuned_configs.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

T0 = time.time()
# Largest accepted relative error of a sweep candidate vs the float32 reference (bf16 kernels: ~5e-3).
MAX_REL_ERR = 2e-2


def log(message: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {message}", flush=True)


def run_tests(out_dir: str, timeout_s: float) -> None:
    from jaxfuse import bench

    log(f"step 1: pytest -q tests/test_rmsnorm_matmul.py (timeout {timeout_s:.0f} s)")
    status, text = bench.run_pytest("tests/test_rmsnorm_matmul.py", os.path.join(out_dir, "pytest.txt"), timeout_s)
    tail = "\n".join(text.strip().splitlines()[-25:])
    log(f"pytest {status}:\n{tail}")


def run_suite(out_dir: str, shapes: list[str] | None, iterations: int) -> None:
    from jaxfuse import bench
    from jaxfuse.suites import rmsnorm_matmul as suite

    log(f"step 2: suite at {shapes or suite.DEFAULT_SHAPES}, {iterations} iterations")
    records = suite.run(shapes, iterations=iterations)
    tag = bench.device_tag(bench.environment()["device"])  # rmsnorm_matmul-h100.json on an H100
    path = bench.write_results(records, os.path.join(out_dir, f"rmsnorm_matmul-{tag}.json"))
    print(bench.markdown_table(records))
    print()
    print(suite.summary_table(records), flush=True)
    log(f"wrote {path}")


def sweep(out_dir: str, shapes: list[str] | None, deadline: float) -> None:
    import jax
    import jax.numpy as jnp

    from jaxfuse import bench
    from jaxfuse.suites import rmsnorm_matmul as suite
    from pallas_kernels import reference, triton_utils, tuning
    from pallas_kernels.rmsnorm_matmul import RMSNormMatmulConfig, rmsnorm_matmul, shape_key, sweep_candidates

    cache_path = os.path.join(out_dir, "tuned_configs.json")
    lines: list[str] = []
    names = [n for n in (shapes or ["32768x4096x4096", "16x4096x4096-decode", "4096x4096x14336",
                                    "1x4096x14336-decode", "8192x4096x6144-qkv"]) if n != "cpu"]
    log(f"step 3: block-size sweep at {names} until {deadline - T0:.0f} s")

    def time_us(fn, args_sets):
        with triton_utils.quiet_triton_deprecation():
            return bench.time_kernels(fn, args_sets, iterations=10, warmup=1).median_us

    @jax.jit
    def rel_err(got, want):
        """max |got - want| / max |want| in float32, on the device (NaN/inf in got give a non-finite error)."""
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        return jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30)

    @jax.jit
    def reference_outputs(x, g, w, dy):
        """float32 reference (y, (dx, dgamma, dw)) for one input set."""
        f32 = lambda a: a.astype(jnp.float32)
        y, vjp = jax.vjp(reference.rmsnorm_matmul, f32(x), f32(g), f32(w))
        return y, vjp(f32(dy))

    def check(fn, args_sets, wants, with_grads):
        """Worst relative error of fn's outputs over the input sets (y, then dx, dgamma, dw with_grads)."""
        worst, worst_name = 0.0, "y"
        names = ("y", "dx", "dgamma", "dw") if with_grads else ("y",)
        with triton_utils.quiet_triton_deprecation():
            for args, (y_ref, grads_ref) in zip(args_sets, wants):
                out = fn(*args)
                got = (out[0], *out[1]) if with_grads else (out,)
                want = (y_ref, *grads_ref) if with_grads else (y_ref,)
                for name, g, r in zip(names, got, want):
                    err = float(rel_err(g, r))
                    if not err <= worst:  # a NaN error sticks
                        worst, worst_name = err, name
        return worst, worst_name

    def check_and_time(kind, name, params, fn, args_sets, wants, with_grads):
        """Time of one candidate in µs, or inf when it fails or is REJECTED for its error."""
        try:
            err, err_name = check(fn, args_sets, wants, with_grads)
            if not err <= MAX_REL_ERR:  # also rejects NaN
                log(f"  {name} {kind} candidate REJECTED: relative error {err:.2e} in {err_name} "
                    f"> {MAX_REL_ERR:.0e}: {params}")
                return math.inf, err
            return time_us(fn, args_sets), err
        except Exception as e:  # noqa: BLE001 -- e.g. shared memory exhausted: not a winner
            log(f"  {name} {kind} candidate failed: {type(e).__name__}: {str(e)[:200]}")
            return math.inf, math.nan

    for i, name in enumerate(names):
        remaining = deadline - time.time()
        if remaining < 20:
            log(f"sweep: out of time before {name}")
            break
        shape_deadline = time.time() + remaining / (len(names) - i)
        s = suite.SHAPES[name]
        M, K, N = s["M"], s["K"], s["N"]
        # Inputs that fit in L2 (50 MB) rotate over three sets, as in the suite.
        num_sets = 3 if 2 * (M * K + K * N + 2 * M * N) < 50 * 2**20 else 1
        sets = [suite.make_inputs(M, K, N, seed) for seed in range(num_sets)]
        wants = [reference_outputs(*a) for a in sets]  # float32 reference on the timing inputs
        fwd_cands, bwd_cands = sweep_candidates(M, K, N)

        def fwd_fn(cfg):
            return jax.jit(lambda x, g, w: rmsnorm_matmul(x, g, w, block_sizes=cfg))

        def fwd_bwd_fn(cfg):
            @jax.jit
            def fn(x, g, w, dy):
                y, vjp = jax.vjp(lambda x, g, w: rmsnorm_matmul(x, g, w, block_sizes=cfg), x, g, w)
                return y, vjp(dy)
            return fn

        results_fwd, results_bwd = [], []  # (time µs or inf, params, relative error)
        for params in fwd_cands:
            if time.time() > shape_deadline:
                break
            t, err = check_and_time("fwd", name, params, fwd_fn(RMSNormMatmulConfig(**params)),
                                    [a[:3] for a in sets], wants, with_grads=False)
            results_fwd.append((t, params, err))
        best_fwd = min(results_fwd, key=lambda r: r[0], default=(math.inf, None, math.nan))
        fwd_fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "gamma_on_w", "split_k")
        for params in bwd_cands:
            if time.time() > shape_deadline:
                break
            if best_fwd[1] is not None and math.isfinite(best_fwd[0]):  # only a checked, timed forward
                params = dict(params, **{f: best_fwd[1][f] for f in fwd_fields})
            t, err = check_and_time("fwd+bwd", name, params, fwd_bwd_fn(RMSNormMatmulConfig(**params)), sets,
                                    wants, with_grads=True)
            results_bwd.append((t, params, err))
        best_bwd = min(results_bwd, key=lambda r: r[0], default=(math.inf, None, math.nan))

        def fmt(params, fields):
            return ",".join(f"{f}={params[f]}" for f in fields)

        def timing(t, err):
            if math.isfinite(t):
                return f"{t:10.1f} µs  err {err:.1e}"
            if math.isnan(err):
                return f"{'FAILED':>13}  err   n/a"
            return f"{'REJECTED':>13}  err {err:.1e}"

        bwd_fields = [f for f in RMSNormMatmulConfig.__dataclass_fields__ if f not in fwd_fields]
        n_bad = sum(not math.isfinite(r[0]) for r in results_fwd + results_bwd)
        lines.append(f"== {name}: {len(results_fwd)}/{len(fwd_cands)} forward, "
                     f"{len(results_bwd)}/{len(bwd_cands)} backward candidates checked (max relative error "
                     f"{MAX_REL_ERR:.0e} vs float32 reference), {n_bad} rejected or failed")
        for t, p, err in sorted(results_fwd, key=lambda r: r[0]):
            lines.append(f"  fwd     {timing(t, err)}  {fmt(p, fwd_fields)}")
        for t, p, err in sorted(results_bwd, key=lambda r: r[0]):
            lines.append(f"  fwd+bwd {timing(t, err)}  {fmt(p, bwd_fields)}")
        if best_bwd[1] is not None and math.isfinite(best_bwd[0]):
            tuning.store("rmsnorm_matmul", shape_key(M, K, N, jnp.bfloat16), best_bwd[1], time_us=best_bwd[0],
                         path=cache_path)
            lines.append(f"  best: fwd {best_fwd[0]:.1f} µs, fwd+bwd {best_bwd[0]:.1f} µs (err {best_bwd[2]:.1e}) "
                         f"-> {best_bwd[1]}")
        else:
            lines.append("  best: none (no candidate passed the check); nothing stored")
        print("\n".join(lines[-(len(results_fwd) + len(results_bwd) + 2):]), flush=True)
        log(f"sweep: {name} done")
        del sets, wants
    with open(os.path.join(out_dir, "sweep.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations per suite measurement")
    parser.add_argument("--shapes", nargs="*", default=None, help="suite shape names (default: the suite's)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget for everything")
    parser.add_argument("--test-timeout-s", type=float, default=150.0)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-suite", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    deadline = T0 + args.budget_s

    if not args.skip_tests:
        try:
            run_tests(args.out, min(args.test_timeout_s, max(30.0, deadline - time.time() - 240)))
        except Exception:  # noqa: BLE001
            log(f"tests step failed:\n{traceback.format_exc()}")

    import jax

    log(f"jax {jax.__version__}, devices {jax.devices()}")
    if not args.skip_suite:
        try:
            run_suite(args.out, args.shapes, args.iterations)
        except Exception:  # noqa: BLE001
            log(f"suite step failed:\n{traceback.format_exc()}")

    if not args.skip_sweep:
        try:
            sweep(args.out, args.shapes, deadline)
        except Exception:  # noqa: BLE001
            log(f"sweep step failed:\n{traceback.format_exc()}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
