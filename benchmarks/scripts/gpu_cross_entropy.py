"""On the H100: test, benchmark and sweep the fused linear cross-entropy, writing everything into --out.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_cross_entropy.py --out $OUT

1. ``pytest -q tests/test_cross_entropy.py`` (GPU shapes; the output goes to $OUT/pytest.txt);
2. the suite (``jaxfuse.suites.cross_entropy``) at the issue's three shapes: xla / pallas (/ tokamax), fwd and
   fwd+bwd, device-kernel time, temp memory and error against the float32 reference; table printed, records in
   $OUT/cross_entropy-<device tag>.json (+ .md);
3. while time is left (the whole run stays under --budget-s, 450 s by default), a block-size sweep at 8192×4096×128256
   ($OUT/cross_entropy-sweep.json): forward tiles timed on the forward, backward tiles and chunk_v on fwd+bwd.
A failing step, shape or config is printed and recorded; the rest still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def run_tests(out: str, timeout_s: int) -> None:
    from jaxfuse import bench

    log("pytest -q tests/test_cross_entropy.py ...")
    status, text = bench.run_pytest("tests/test_cross_entropy.py", os.path.join(out, "pytest.txt"), timeout_s)
    log(f"pytest: {status}")
    print("\n".join(text.strip().splitlines()[-25:]), flush=True)


def run_suite(out: str, iterations: int, shapes: list[str]) -> None:
    from jaxfuse import bench
    from jaxfuse.suites import cross_entropy as suite

    records = []
    for name in shapes:  # one shape at a time, so a crash in one still leaves the others
        log(f"suite shape {name} ...")
        try:
            records += suite.run([name], iterations=iterations, progress=log)
        except Exception:  # noqa: BLE001
            log(f"suite shape {name} FAILED:\n{traceback.format_exc()}")
    if records:
        tag = bench.device_tag(bench.environment()["device"])  # cross_entropy-h100.json on an H100
        path = bench.write_results(records, os.path.join(out, f"cross_entropy-{tag}.json"))
        log(f"wrote {path}")
        print(bench.markdown_table(records), flush=True)
        print("\nimplementation / mode / shape: temp MiB, rel_error, top kernels (µs)", flush=True)
        for r in records:
            e = r.extra
            print(f"  {r.implementation:>20} {r.mode:>8} {r.shape:>18}: temp {e.get('temp_mib')} MiB, "
                  f"err {e.get('rel_error')}, {e.get('per_kernel_us') or e.get('error')}", flush=True)


def run_sweep(out: str, budget_s: float, iterations: int) -> None:
    import jax

    from jaxfuse import bench
    from jaxfuse.suites import cross_entropy as suite
    from pallas_kernels import triton_utils
    from pallas_kernels.cross_entropy import LinearCrossEntropyConfig

    B, H, V = 8192, 4096, 128256
    args = suite.make_inputs(B, H, V)
    base = LinearCrossEntropyConfig()
    fwd_candidates = [
        {},
        {"block_v": 256},
        {"block_v": 256, "num_stages": 4},
        {"num_stages": 4},
        {"num_splits": 8},
        {"num_splits": 16},
        {"block_b": 64, "block_v": 256, "num_warps": 4},
        {"block_h": 32, "num_stages": 4},
    ]
    bwd_candidates = [
        {"chunk_v": 8192},
        {"chunk_v": 16384},
        {"block_v_bwd": 256},
        {"block_v_bwd": 256, "num_stages_bwd": 4},
        {"group_b": 16},
        {"num_stages_bwd": 4},
    ]
    results = []

    def measure(mode: str, overrides: dict):
        cfg = dataclasses.replace(base, **overrides)
        loss = lambda h, w, y: suite._pallas_loss(h, w, y, block_sizes=cfg)  # noqa: E731
        fn = jax.jit(loss) if mode == "fwd" else jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        with triton_utils.quiet_triton_deprecation():
            temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
        t = bench.time_kernels(fn, [args], iterations=iterations)
        row = {"mode": mode, "overrides": overrides, "time_us": round(t.median_us, 1),
               "temp_mib": round(temp / 2**20, 1), "per_kernel_us": dict(sorted(
                   t.per_kernel_us.items(), key=lambda kv: -kv[1])[:6])}
        log(f"sweep {mode:8} {overrides}: {t.median_us / 1e3:.2f} ms, temp {row['temp_mib']} MiB")
        return row

    for mode, candidates in (("fwd", fwd_candidates), ("fwd+bwd", [{}] + bwd_candidates)):
        for overrides in candidates:
            if time.time() - START > budget_s:
                log(f"sweep: time budget reached, skipping the rest ({mode} {overrides} ...)")
                break
            try:
                results.append(measure(mode, overrides))
            except Exception as e:  # noqa: BLE001
                log(f"sweep {mode} {overrides} FAILED: {type(e).__name__}: {str(e)[:500]}")
                results.append({"mode": mode, "overrides": overrides, "error": f"{type(e).__name__}: {e}"[:2000]})
            jax.clear_caches()
    with open(os.path.join(out, "cross_entropy-sweep.json"), "w") as f:
        json.dump({"shape": f"{B}x{H}x{V}", "base": base.to_dict(), "results": results}, f, indent=1)
    log("wrote cross_entropy-sweep.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--iterations", type=int, default=10, help="timed iterations per measurement")
    parser.add_argument("--shapes", default="8k_128k,4k_256k,16k_32k", help="suite shapes, comma separated")
    parser.add_argument("--budget-s", type=float, default=450.0, help="no new sweep config starts after this")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    log(f"jax {jax.__version__}, devices {jax.devices()}")
    try:
        import triton
        log(f"triton {triton.__version__}")
    except ImportError:
        pass
    if not args.skip_tests:
        run_tests(args.out, timeout_s=200)
    run_suite(args.out, args.iterations, [s for s in args.shapes.split(",") if s])
    if not args.skip_sweep:
        try:
            run_sweep(args.out, args.budget_s, iterations=5)
        except Exception:  # noqa: BLE001
            log(f"sweep FAILED:\n{traceback.format_exc()}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
