"""On one H100: the flash-attention tests, a short block-size sweep at the main shape, then the attention suite.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_attention.py --out $OUT [--skip-tests] [--skip-tune] [--budget-s 480]

1. ``pytest -q tests/test_flash_attention.py`` (GPU shapes), capped at --test-timeout-s (150 s); output in
   $OUT/pytest.txt.
2. Sweep of ``flash_attention`` configs at the suite's "main" shape (B=4, T=S=4096, N=K=16, H=128), non-causal and
   causal: forward tiles / warps / stages timed on the forward alone, then backward tiles / warps / stages timed on
   fwd+bwd with the best forward fixed (device-kernel time, 2 rotated input sets). Each candidate's time is
   printed; the sweep stops starting candidates when its share of the budget is spent (the suite's time,
   --suite-reserve-s, is kept back). The best config per causal setting goes into $OUT/tuned_configs.json in the
   pallas_kernels.tuning cache format (merge into pallas_kernels/tuned_configs.json with ``tuning.store`` to make
   it the default); every timing into $OUT/attention-sweep.json and sweep.txt.
3. The suite (``jaxfuse.suites.attention``) at every shape, causal and not: pallas (with the sweep's winner where
   there is one: ``extra["config_source"]``), cuDNN, plain-jnp XLA; fwd and fwd+bwd. Prints the tables and writes
   $OUT/attention-<device tag>.json (+ .md; ``bench.device_tag``) with ``bench.write_results``. Shapes not started
   by the end of the budget are recorded as skipped.
Every step, shape, implementation and candidate that fails is printed and recorded; the rest goes on. The whole run
stays within about --budget-s plus one (shape, causal) pair (~30 s): with the defaults, tests <= 150 s, the sweep
until 240 s after the start, the suite after that; no suite pair starts after 480 s (those left are recorded as
skipped: rerun them with ``--skip-tests --skip-tune --shapes NAME``; ``--skip-tests`` alone gives the sweep ~150 s
more). On CPU, ``--shapes cpu --tune-shape cpu`` runs everything at the smoke shape in interpret mode (a check of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback

T0 = time.time()

FWD_FIELDS = ("block_q", "block_k", "query_chains", "num_warps", "num_stages")
BWD_FIELDS = ("block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq", "num_warps_bwd", "num_stages_bwd")
# Sweep candidates for head dim <= 128, most promising first (the budget may cut the tail). Forward:
# (block_q, block_k, query_chains, num_warps, num_stages); 128x128 tiles with 4 stages exceed the H100's shared
# memory at H=128. Two query chains are tried with 4 warps only: with 8 they lost in the minimal kernel
# (attention-forward-floor-chains-packed-h100.json).
FWD_CANDIDATES = [(128, 64, 2, 4, 2), (128, 64, 1, 4, 2), (128, 64, 2, 4, 3), (128, 128, 1, 8, 3), (64, 64, 1, 4, 3),
                  (128, 32, 2, 4, 3), (128, 64, 1, 8, 4), (128, 64, 1, 4, 3), (128, 128, 1, 8, 2), (128, 32, 1, 4, 4),
                  (64, 128, 1, 4, 3), (128, 64, 1, 8, 2), (64, 64, 1, 4, 4), (64, 32, 1, 4, 3)]
# Backward: (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, num_warps_bwd, num_stages_bwd).
BWD_CANDIDATES = [(64, 128, 128, 64, 8, 3), (32, 128, 128, 32, 8, 2), (64, 64, 64, 64, 4, 3),
                  (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 3),
                  (64, 64, 64, 64, 8, 3), (16, 128, 128, 16, 8, 3), (64, 128, 128, 32, 8, 3),
                  (32, 128, 64, 32, 8, 3)]


def log(message: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# 1. tests
# ---------------------------------------------------------------------------------------------------------------
def run_tests(out_dir: str, timeout_s: float) -> None:
    from jaxfuse import bench

    log(f"step 1: pytest -q tests/test_flash_attention.py (timeout {timeout_s:.0f} s)")
    status, text = bench.run_pytest("tests/test_flash_attention.py", os.path.join(out_dir, "pytest.txt"), timeout_s)
    tail = "\n".join(text.strip().splitlines()[-25:])
    log(f"pytest {status}:\n{tail}")


# ---------------------------------------------------------------------------------------------------------------
# 2. sweep
# ---------------------------------------------------------------------------------------------------------------
def _configs(fa, base: dict, overrides: list[dict], T: int, S: int) -> list[dict]:
    """base, then base with each override, fitted to the shape, invalid ones dropped, duplicates removed."""
    seen, out = set(), []
    for o in [{}] + overrides:
        params = dict(base, **o)
        if hasattr(fa, "_fit_to_shape"):
            params = fa._fit_to_shape(params, T, S)
        try:
            params = fa.FlashAttentionConfig(**params).to_dict()
        except (TypeError, ValueError) as e:
            log(f"  candidate {o} invalid: {e}")
            continue
        key = tuple(sorted(params.items()))
        if key not in seen:
            seen.add(key)
            out.append(params)
    return out


def sweep(out_dir: str, shape_name: str, deadline: float, iterations: int, fwd_only: bool = False) -> None:
    import jax

    from jaxfuse import bench
    from jaxfuse.suites import attention as suite
    from pallas_kernels import triton_utils, tuning

    fa = importlib.import_module("pallas_kernels.flash_attention")
    s = suite.SHAPES[shape_name]
    B, T, S, N, K, H = (s[x] for x in "BTSNKH")
    log(f"step 2: sweep at {shape_name} (B={B} T={T} S={S} N={N} K={K} H={H}) until {deadline - T0:.0f} s")
    if jax.default_backend() != "gpu" and shape_name != "cpu":
        log("sweep: skipped, interpret-mode timings at this shape would take hours (use --tune-shape cpu on CPU)")
        return
    sets = [suite.make_inputs(B, T, S, N, K, H, seed=100 + i) for i in range(2)]
    q, k = sets[0][0], sets[0][1]
    cache_path = os.path.join(out_dir, "tuned_configs.json")
    lines: list[str] = []
    summary: dict = {"shape": shape_name, "dims": dict(B=B, T=T, S=S, N=N, K=K, H=H), "settings": []}

    def time_us(params: dict, causal: bool, mode: str) -> float:
        cfg = fa.FlashAttentionConfig(**params)
        attn = lambda q, k, v, causal: fa.flash_attention(q, k, v, causal=causal, block_sizes=cfg)  # noqa: E731
        if mode == "fwd":
            fn, args = jax.jit(lambda q, k, v: attn(q, k, v, causal)), [a[:3] for a in sets]
        else:
            fn, args = jax.jit(suite._fwd_bwd(attn, causal)), sets
        with triton_utils.quiet_triton_deprecation():
            fn.lower(*args[0]).compile()
            return bench.time_kernels(fn, args, iterations=iterations, warmup=1).median_us

    def measure(params: dict, causal: bool, mode: str, fields) -> float:
        label = ",".join(f"{f}={params[f]}" for f in fields)
        try:
            t = time_us(params, causal, mode)
            log(f"  {'causal' if causal else 'full  '} {mode:7s} {t:10.1f} µs  {label}")
        except Exception as e:  # noqa: BLE001 -- e.g. shared memory exhausted: not a winner
            t = math.inf
            log(f"  {'causal' if causal else 'full  '} {mode:7s}     FAILED  {label}: {type(e).__name__}: "
                f"{str(e)[:200]}")
        return t

    settings = (False, True)
    for idx, causal in enumerate(settings):
        remaining = deadline - time.time()
        if remaining < 20:
            log(f"sweep: out of time before causal={causal}")
            break
        setting_deadline = time.time() + remaining / (len(settings) - idx)
        fwd_deadline = time.time() + 0.4 * remaining / (len(settings) - idx)
        base = fa.default_config(q, k, causal=causal).to_dict()
        if H <= 128:
            fwd_over = [dict(zip(FWD_FIELDS, c)) for c in FWD_CANDIDATES]
            bwd_over = [dict(zip(BWD_FIELDS, c)) for c in BWD_CANDIDATES]
        else:  # the kernel's own search space for other head dims
            cands = fa._candidates(H, q.dtype, T, S)
            fwd_over = [{f: c[f] for f in FWD_FIELDS} for c in cands]
            bwd_over = [{f: c[f] for f in BWD_FIELDS} for c in cands]
        if fwd_only:  # the backward as configured, timed once with the best forward
            bwd_over = []
        fwd_cands = _configs(fa, base, fwd_over, T, S)
        results_fwd: list[tuple[float, dict]] = []
        for params in fwd_cands:
            if results_fwd and time.time() > fwd_deadline:
                log(f"  fwd: budget spent after {len(results_fwd)}/{len(fwd_cands)} candidates")
                break
            results_fwd.append((measure(params, causal, "fwd", FWD_FIELDS), params))
        t_fwd, best_fwd = min(results_fwd, key=lambda r: r[0])
        if not math.isfinite(t_fwd):
            best_fwd = base
        fixed = {f: best_fwd[f] for f in FWD_FIELDS}
        bwd_cands = _configs(fa, dict(base, **fixed), bwd_over, T, S)
        results_bwd: list[tuple[float, dict]] = []
        for params in bwd_cands:
            if results_bwd and time.time() > setting_deadline:
                log(f"  fwd+bwd: budget spent after {len(results_bwd)}/{len(bwd_cands)} candidates")
                break
            results_bwd.append((measure(params, causal, "fwd+bwd", BWD_FIELDS), params))
        t_bwd, best = min(results_bwd, key=lambda r: r[0])
        t_base_fwd = results_fwd[0][0]
        t_base_bwd_fixed = results_bwd[0][0]  # the base backward with the best forward
        name = "causal" if causal else "non-causal"
        lines.append(f"== {shape_name} {name}: {len(results_fwd)}/{len(fwd_cands)} forward, "
                     f"{len(results_bwd)}/{len(bwd_cands)} fwd+bwd candidates timed; base = {base}")
        for t, p in sorted(results_fwd, key=lambda r: r[0]):
            lines.append(f"  fwd     {t:10.1f} µs  " + ",".join(f"{f}={p[f]}" for f in FWD_FIELDS))
        for t, p in sorted(results_bwd, key=lambda r: r[0]):
            lines.append(f"  fwd+bwd {t:10.1f} µs  " + ",".join(f"{f}={p[f]}" for f in BWD_FIELDS))
        entry = {"causal": causal, "base": base, "fwd": [{"time_us": t, "params": p} for t, p in results_fwd],
                 "fwd+bwd": [{"time_us": t, "params": p} for t, p in results_bwd]}
        if math.isfinite(t_bwd):
            key = fa._shape_key(q, k, causal)
            tuning.store("flash_attention", key, best, time_us=t_bwd, path=cache_path)
            lines.append(f"  best: fwd {t_fwd:.1f} µs (base {t_base_fwd:.1f}), fwd+bwd {t_bwd:.1f} µs "
                         f"(base bwd with best fwd {t_base_bwd_fixed:.1f}) -> {key}: {best}")
            entry.update(best=best, key=key, best_fwd_us=t_fwd, best_fwd_bwd_us=t_bwd)
        else:
            lines.append("  no candidate ran: nothing stored")
        summary["settings"].append(entry)
        print("\n".join(lines[-(len(results_fwd) + len(results_bwd) + 2):]), flush=True)
        log(f"sweep: {shape_name} {name} done")
    with open(os.path.join(out_dir, "sweep.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "attention-sweep.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    if os.path.exists(cache_path):
        log(f"wrote {cache_path}")
    del sets
    jax.clear_caches()


# ---------------------------------------------------------------------------------------------------------------
# 3. suite
# ---------------------------------------------------------------------------------------------------------------
def run_suite(out_dir: str, shapes: list[str] | None, iterations: int, deadline: float,
              impls: list[str] | None = None) -> None:
    from jaxfuse import bench
    from jaxfuse.suites import attention as suite

    cache_path = os.path.join(out_dir, "tuned_configs.json")
    cache_path = cache_path if os.path.exists(cache_path) else None
    names = list(shapes or suite.DEFAULT_SHAPES)
    log(f"step 3: suite at {names}, {iterations} iterations, tuned configs from {cache_path or 'the repo defaults'}")
    start = time.time()
    records = suite.run(names, iterations=iterations, impls=tuple(impls or suite.IMPLEMENTATIONS),
                        cache_path=cache_path, deadline=deadline, progress=log)
    log(f"suite took {time.time() - start:.0f} s")
    if not records:
        log("suite: no records")
        return
    tag = bench.device_tag(bench.environment()["device"])  # attention-h100.json on an H100
    path = bench.write_results(records, os.path.join(out_dir, f"attention-{tag}.json"))
    print(bench.markdown_table(records))
    print()
    print(suite.summary_table(records), flush=True)
    print("\nimplementation / mode / shape: temp MiB, rel_error, config source, top kernels (µs) or error")
    for r in records:
        e = r.extra
        print(f"  {r.implementation:>7} {r.mode:>8} {r.shape:>32}: temp {e.get('temp_mib')} MiB, "
              f"err {e.get('rel_errors')}, {e.get('config_source', '')} "
              f"{e.get('top_kernels') or e.get('error')}", flush=True)
    log(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations per suite measurement")
    parser.add_argument("--shapes", nargs="*", default=None, help="suite shape names (default: the suite's)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for everything")
    parser.add_argument("--test-timeout-s", type=float, default=150.0)
    parser.add_argument("--suite-reserve-s", type=float, default=240.0,
                        help="time kept back from the sweep for the suite")
    parser.add_argument("--impls", nargs="*", default=None,
                        help="suite implementations (default pallas cudnn xla; xla_f32 = the float32 reference)")
    parser.add_argument("--tune-shape", default="main", help="suite shape the sweep runs at")
    parser.add_argument("--tune-iterations", type=int, default=10, help="timed iterations per sweep candidate")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-tune", action="store_true")
    parser.add_argument("--tune-fwd-only", action="store_true",
                        help="sweep forward candidates only; the backward keeps its configured tiles")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    deadline = T0 + args.budget_s

    if not args.skip_tests:
        try:
            run_tests(args.out, min(args.test_timeout_s, max(30.0, deadline - time.time() - args.suite_reserve_s)))
        except Exception:  # noqa: BLE001
            log(f"tests step failed:\n{traceback.format_exc()}")

    import jax

    log(f"jax {jax.__version__}, devices {jax.devices()}")
    try:
        import triton

        log(f"triton {triton.__version__}")
    except ImportError:
        pass

    if not args.skip_tune:
        try:
            sweep(args.out, args.tune_shape, deadline - args.suite_reserve_s, args.tune_iterations,
                  fwd_only=args.tune_fwd_only)
        except Exception:  # noqa: BLE001
            log(f"sweep step failed:\n{traceback.format_exc()}")

    try:
        run_suite(args.out, args.shapes, args.iterations, deadline, args.impls)
    except Exception:  # noqa: BLE001
        log(f"suite step failed:\n{traceback.format_exc()}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
