"""Where the Mosaic GEMM core's and the fused rmsnorm_matmul forward's time goes, block by block: Mosaic GPU's
on-device profiler (``pallas_kernels.mosaic_utils.profiling``) records each compute warpgroup's regions per tile
(``k_loop``, ``epilogue``; ``stream_k_loop``, ``stream_k_epilogue``), read back by ``hlo_inspect.mosaic_trace``.

    PYTHONPATH=$PWD python benchmarks/scripts/mosaic_timeline.py --out $OUT \
        [--cases core,fused] [--shapes 4096x4096x14336,8192x4096x6144]

Per shape (M×K×N, bf16) and case:
  core   ``gemm.matmul`` with its default config at that shape (the suite's "pallas_mosaic_matmul_alone")
  fused  ``rmsnorm_matmul(..., backend="mosaic")`` forward with this device's tuned config (the suite's entry)
  fused:<variant>  the same with a variant of ``rmsnorm_matmul_configs.VARIANTS`` ("a+b" combines them)
  dx, dw (or dx:<variant>, dw:<variant>)  that kernel of the fused forward + backward (the suite's "fwd+bwd"
         program, a random cotangent); its times are the whole program's, so no clock is implied
Each is traced under the profiler, that kernel alone (its third call's trace kept: ``traces/<shape>-<case>.json``),
and timed with and without it (CUPTI medians, interleaved), so the record says what the profiler itself costs and
the SM clock the spans imply (the longest span's cycles over the profiled kernel's time). Writes
``mosaic_timeline-<device>.json``. The profiler's buffer takes 16 bytes of shared memory per region and warpgroup
(``--ranges``, default one per region name per tile of the kernel's block, plus 8): a config that uses nearly all of
it may not fit (the case is then recorded as skipped, with the error).
By default the tile loop's regions are recorded; ``--regions`` may also name the epilogue's parts (SUB_REGIONS).
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
from pallas_kernels.norm_matmul import config as nm_config
from pallas_kernels.norm_matmul import rmsnorm_matmul
from rmsnorm_matmul_configs import VARIANTS, combined, variant_config

CASES = ("core", "fused", "dx", "dw")
TILE_REGIONS = ("k_loop", "epilogue", "stream_k_loop", "stream_k_epilogue")  # the core's tile loop (the default)
# inside a fused kernel's epilogue: waiting for the tile inputs (prefetched, or through the ring), the fusion's
# epilogue hook (its row vectors stored), the tile copy (Fusion.tile_copy), waiting for the other tiles of the row
# (Fusion.sum_rows) and the finish after it, a TMA store leaving the SMEM the next step writes, and the output
# written into a tile input's buffer and stored from there (Fusion.store_in)
SUB_REGIONS = ("tile_inputs", "epilogue_hook", "tile_copy", "sum_rows", "finish", "store_wait", "store_in_tile",
               "accumulators_wait", "epilogue_apart")  # (the last two: the fourth warpgroup's, epilogue_in "fourth")
REGIONS = TILE_REGIONS + SUB_REGIONS
_KERNELS = {"core": "mosaic_matmul", "fused": "rmsnorm_matmul_fwd", "dx": "rmsnorm_matmul_dx",
            "dw": "rmsnorm_matmul_dw"}  # the kernel each case traces (the start of its trace file's name)


def _kind(case: str) -> str:
    return case.split(":", 1)[0]


def _tiles_per_block(case: str, M: int, K: int, N: int) -> int:
    """Output tiles per block of the case's kernel (the profiler's buffer holds a few regions for each)."""
    if case == "core":
        cfg, rows, cols = default_config(M, N, K), M, N
    else:
        kind, _, variant = case.partition(":")
        config = variant_config(M, K, N, combined(variant)) if variant else nm_config.mosaic_default_config(M, K, N)
        cfg, rows, cols = {"fused": (config.forward, M, N), "dx": (config.dx, M, K), "dw": (config.dw, K, N)}[kind]
    return -(-(rows // cfg.cta_m) * -(-cols // cfg.cta_n) // mu.num_sms())


def _program(case: str, M: int, K: int, N: int):
    """(x, gamma, w, dy) -> the case's outputs."""
    if case == "core":
        return lambda x, gamma, w, dy: matmul(x, w)
    kind, _, variant = case.partition(":")  # a variant of rmsnorm_matmul_configs.VARIANTS (or "a+b")
    options = dict(block_sizes=variant_config(M, K, N, combined(variant))) if variant else {}

    def forward(x, gamma, w):
        return rmsnorm_matmul(x, gamma, w, backend="mosaic", **options)

    if kind == "fused":
        return lambda x, gamma, w, dy: forward(x, gamma, w)
    if kind in ("dx", "dw"):
        def forward_backward(x, gamma, w, dy):
            y, vjp = jax.vjp(forward, x, gamma, w)
            return y, vjp(dy)
        return forward_backward
    raise ValueError(f"--cases: {case!r} is not one of {CASES} or <fused|dx|dw>:<variant>")


def _traced(program, operands, ranges: int, regions, kernel: str):
    """The trace of ``kernel`` (its name's start) in the program's third call under the profiler: (the trace's path,
    its temporary folder, which the caller removes)."""
    folder = tempfile.mkdtemp(prefix="mosaic_timeline_")
    try:
        with mu.profiling(folder, ranges=ranges, regions=regions, kernels=(kernel,)):
            fn = jax.jit(program)
            for _ in range(3):
                jax.block_until_ready(fn(*operands))
        files = sorted(glob.glob(os.path.join(folder, f"{kernel}-*-trace.json")), key=os.path.getmtime)
        if not files:
            raise RuntimeError(f"the profiler wrote no trace of {kernel} into {folder}")
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
    parser.add_argument("--regions", default="", help="comma-separated region names to record (default: the tile "
                        "loop's, k_loop,epilogue,stream_k_loop,stream_k_epilogue; the epilogue's parts too: "
                        f"{','.join(SUB_REGIONS)}; fewer take less shared memory, though at "
                        "32768x4096x4096, 32 tiles a block, even k_loop,stream_k_loop did not fit on the GPU: "
                        "mosaic_timeline_32768-h200-f0be594.json)")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    regions = tuple(r for r in args.regions.split(",") if r) or TILE_REGIONS
    unknown = sorted(set(regions) - set(REGIONS))
    if unknown:
        parser.error(f"--regions: {', '.join(unknown)} not among the kernels' regions {', '.join(REGIONS)}")
    if args.ranges < 0:
        parser.error(f"--ranges: must be >= 0 (0: from the tiles per block), got {args.ranges}")
    per_tile = max(1, len({r.removeprefix("stream_k_") for r in regions}) + ("store_wait" in regions))
    for c in cases:
        kind, colon, variant = c.partition(":")
        if kind not in CASES or (colon and (kind == "core" or not set(variant.split("+")) <= set(VARIANTS))):
            parser.error(f"--cases: {c!r} is not one of {CASES} or <fused|dx|dw>:<variant of "
                         "rmsnorm_matmul_configs>")
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    result, save, path = results_file(args.out, "mosaic_timeline")
    for M, K, N in args.shapes:
        shape = f"{M}x{K}x{N}"
        keys = jax.random.split(jax.random.key(M + N), 3)
        x = jax.random.normal(keys[0], (M, K), jnp.float32).astype(jnp.bfloat16)
        gamma = (1.0 + 0.1 * jax.random.normal(keys[1], (K,), jnp.float32)).astype(jnp.bfloat16)
        w = (jax.random.normal(keys[2], (K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16)
        dy = jax.random.normal(jax.random.fold_in(keys[0], 1), (M, N), jnp.float32).astype(jnp.bfloat16)
        operands = (x, gamma, w, dy)
        for case in cases:
            ranges = args.ranges or per_tile * _tiles_per_block(case, M, K, N) + 8
            row = dict(shape=shape, case=case, ranges=ranges, regions=regions)
            program = _program(case, M, K, N)
            jax.clear_caches()  # (the kernels are built at trace time: none traced without the profiler reused)
            try:
                trace_path, folder = _traced(program, operands, ranges, regions, _KERNELS[_kind(case)])
            except Exception as e:  # noqa: BLE001 (a config the profiler's buffer does not fit beside)
                row["skipped"] = f"{type(e).__name__}: {e}"[:600]
                print(shape, case, "skipped:", row["skipped"], flush=True)
                result["timings"].append(row)
                save()
                continue
            kept = os.path.join(args.out, "traces", f"{shape}-{case.replace(':', '-').replace('+', '-')}.json")
            shutil.copy(trace_path, kept)
            shutil.rmtree(folder, ignore_errors=True)
            traces = mosaic_trace.load(kept)
            summary = mosaic_trace.summarize(traces)
            # compiled ahead of time: a jit's caches would hand the other variant's kernels back
            jax.clear_caches()
            timed_traces = tempfile.mkdtemp(prefix="mosaic_timeline_timed_")  # every profiled call writes one
            with mu.profiling(timed_traces, ranges=ranges, regions=regions, kernels=(_KERNELS[_kind(case)],)):
                profiled = jax.jit(program).lower(*operands).compile()
            jax.clear_caches()
            plain = jax.jit(program).lower(*operands).compile()
            try:
                timings = bench.time_interleaved([(plain, operands), (profiled, operands)],
                                                 iterations=args.iterations)
            finally:
                shutil.rmtree(timed_traces, ignore_errors=True)
            plain_us, profiled_us = timings[0].median_us, timings[1].median_us
            one_kernel = _kind(case) in ("core", "fused")  # (dx, dw: the time is the whole program's)
            clock = summary["spans"]["max"] / (profiled_us * 1e3) if one_kernel else None
            row.update(trace=os.path.relpath(kept, args.out), us=plain_us, profiled_us=profiled_us,
                       clock_ghz_implied=clock, summary=summary)
            print(f"{shape} {case}: {plain_us:.1f} us (profiled {profiled_us:.1f})"
                  + (f", clock implied {clock:.2f} GHz" if clock else " for the program"), flush=True)
            print(mosaic_trace.report(traces, clock_ghz=clock), flush=True)
            result["timings"].append(row)
            save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
