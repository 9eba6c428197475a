"""Where the Mosaic GEMM core's and the fused rmsnorm_matmul forward's time goes, block by block: Mosaic GPU's
on-device profiler (``pallas_kernels.mosaic_utils.profiling``) records each compute warpgroup's regions per tile
(``k_loop``, ``epilogue``; ``stream_k_loop``, ``stream_k_epilogue``), read back by ``hlo_inspect.mosaic_trace``.

    PYTHONPATH=$PWD python benchmarks/scripts/mosaic_timeline.py --out $OUT \
        [--cases core,fused] [--shapes 4096x4096x14336,8192x4096x6144]

Per shape (M×K×N, bf16) and case:
  core   ``gemm.matmul`` with its default config at that shape (the suite's "pallas_mosaic_matmul_alone")
  fused  ``rmsnorm_matmul(..., backend="mosaic")`` forward with this device's tuned config (the suite's entry)
  fused:<variant>  the same with a variant of ``rmsnorm_matmul_configs.VARIANTS`` ("a+b" combines them)
Each is traced under the profiler (its third call's trace kept: ``traces/<shape>-<case>.json``) and timed with and
without it (CUPTI medians, interleaved), so the record says what the profiler itself costs and the SM clock the
spans imply (the longest span's cycles over the profiled kernel's time). Writes ``mosaic_timeline-<device>.json``.
The profiler's buffer takes 16 bytes of shared memory per region and warpgroup (``--ranges``, default 2 per tile
plus 8): a config that uses nearly all of it may not fit (the case is then recorded as skipped, with the error).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp

from attention_fused_bwd import results_file
from hlo_inspect import mosaic_trace
from jaxfuse import bench
from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm import default_config, matmul
from pallas_kernels.norm_matmul import rmsnorm_matmul
from rmsnorm_matmul_configs import VARIANTS, combined, variant_config

CASES = ("core", "fused")
REGIONS = ("k_loop", "epilogue", "stream_k_loop", "stream_k_epilogue")  # what the GEMM core's warpgroups record


def _program(case: str, M: int, K: int, N: int):
    if case == "core":
        return lambda x, gamma, w: matmul(x, w)
    if case == "fused":
        return lambda x, gamma, w: rmsnorm_matmul(x, gamma, w, backend="mosaic")
    if case.startswith("fused:"):  # a variant of rmsnorm_matmul_configs.VARIANTS (or "a+b")
        config = variant_config(M, K, N, combined(case[len("fused:"):]))
        return lambda x, gamma, w: rmsnorm_matmul(x, gamma, w, backend="mosaic", block_sizes=config)
    raise ValueError(f"--cases: {case!r} is not one of {CASES} or fused:<variant>")


def _traced(program, operands, ranges: int, regions):
    """The kernel's trace of the program's third call under the profiler: (the trace's path, its temporary folder,
    which the caller removes)."""
    folder = tempfile.mkdtemp(prefix="mosaic_timeline_")
    try:
        with mu.profiling(folder, ranges=ranges, regions=regions):
            fn = jax.jit(program)
            for _ in range(3):
                jax.block_until_ready(fn(*operands))
        files = sorted(glob.glob(os.path.join(folder, "*-trace.json")), key=os.path.getmtime)
        if not files:
            raise RuntimeError(f"the profiler wrote no trace into {folder}")
        return files[-1], folder
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("MxKxN"), default="4096x4096x14336,8192x4096x6144")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--ranges", type=int, default=0,
                        help="regions per warpgroup (0: one per tile and region name kept, + 8)")
    parser.add_argument("--regions", default="", help="comma-separated region names to record (default: all: "
                        "k_loop,epilogue,stream_k_loop,stream_k_epilogue; fewer take less shared memory, though at "
                        "32768x4096x4096, 32 tiles a block, even k_loop,stream_k_loop did not fit on the GPU: "
                        "mosaic_timeline_32768-h200-f0be594.json)")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    regions = tuple(r for r in args.regions.split(",") if r) or None
    unknown = sorted(set(regions or ()) - set(REGIONS))
    if unknown:
        parser.error(f"--regions: {', '.join(unknown)} not among the kernels' regions {', '.join(REGIONS)}")
    if args.ranges < 0:
        parser.error(f"--ranges: must be >= 0 (0: from the tiles per block), got {args.ranges}")
    per_tile = 2 if regions is None else max(1, len({r.removeprefix("stream_k_") for r in regions}))
    for c in cases:
        parts = c[len("fused:"):].split("+") if c.startswith("fused:") else []
        if c not in CASES and (not parts or not set(parts) <= set(VARIANTS)):
            parser.error(f"--cases: {c!r} is not one of {CASES} or fused:<variant of rmsnorm_matmul_configs>")
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    result, save, path = results_file(args.out, "mosaic_timeline")
    for M, K, N in args.shapes:
        shape = f"{M}x{K}x{N}"
        keys = jax.random.split(jax.random.key(M + N), 3)
        x = jax.random.normal(keys[0], (M, K), jnp.float32).astype(jnp.bfloat16)
        gamma = (1.0 + 0.1 * jax.random.normal(keys[1], (K,), jnp.float32)).astype(jnp.bfloat16)
        w = (jax.random.normal(keys[2], (K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16)
        operands = (x, gamma, w)
        cfg = default_config(M, N, K)
        tiles = (M // cfg.cta_m) * -(-N // cfg.cta_n)
        ranges = args.ranges or per_tile * -(-tiles // mu.num_sms()) + 8
        for case in cases:
            row = dict(shape=shape, case=case, ranges=ranges, regions=regions)
            program = _program(case, M, K, N)
            jax.clear_caches()  # (the kernels are built at trace time: none traced without the profiler reused)
            try:
                trace_path, folder = _traced(program, operands, ranges, regions)
            except Exception as e:  # noqa: BLE001 (a config the profiler's buffer does not fit beside)
                row["skipped"] = f"{type(e).__name__}: {e}"[:600]
                print(shape, case, "skipped:", row["skipped"], flush=True)
                result["timings"].append(row)
                save()
                continue
            kept = os.path.join(args.out, "traces", f"{shape}-{case.replace(':', '-')}.json")
            shutil.copy(trace_path, kept)
            shutil.rmtree(folder, ignore_errors=True)
            traces = mosaic_trace.load(kept)
            summary = mosaic_trace.summarize(traces)
            # compiled ahead of time: a jit's caches would hand the other variant's kernels back
            jax.clear_caches()
            timed_traces = tempfile.mkdtemp(prefix="mosaic_timeline_timed_")  # every profiled call writes one
            with mu.profiling(timed_traces, ranges=ranges, regions=regions):
                profiled = jax.jit(program).lower(*operands).compile()
            jax.clear_caches()
            plain = jax.jit(program).lower(*operands).compile()
            try:
                timings = bench.time_interleaved([(plain, operands), (profiled, operands)],
                                                 iterations=args.iterations)
            finally:
                shutil.rmtree(timed_traces, ignore_errors=True)
            plain_us, profiled_us = timings[0].median_us, timings[1].median_us
            row.update(trace=os.path.relpath(kept, args.out), us=plain_us, profiled_us=profiled_us,
                       clock_ghz_implied=summary["spans"]["max"] / (profiled_us * 1e3), summary=summary)
            print(f"{shape} {case}: {plain_us:.1f} us (profiled {profiled_us:.1f}), clock implied "
                  f"{row['clock_ghz_implied']:.2f} GHz", flush=True)
            print(mosaic_trace.report(traces, clock_ghz=row["clock_ghz_implied"]), flush=True)
            result["timings"].append(row)
            save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
