r"""A/B of a module-level switch of the Mosaic rmsnorm_matmul kernels (``--op matmul``: of the plain core,
``pallas_kernels.gemm.matmul``): the suite's forward + backward program with the switch False, then True, each
compiled once and timed interleaved (CUPTI medians), with the largest output difference between the two (NaN
when any output's is: ``bench.max_difference``).

    PYTHONPATH=$PWD python benchmarks/scripts/toggle_ab.py --out $OUT \
        --switch pallas_kernels.gemm.mosaic:SIGNAL_BEFORE_COPY --shapes 8192x512x2816,16384x1024x5504 \
        [--variant default]

The switch exists only at the commit that measured it (``rmsnorm_matmul_signal_before_copy-h200-5b80b9e.json``:
``gemm.mosaic.SIGNAL_BEFORE_COPY``; ``rmsnorm_matmul_gamma_at_tile_start-h200-76f6f05.json``:
``norm_matmul.mosaic.GAMMA_AT_TILE_START``; ``toggle_ab_cols_early-h200-1553984.json``:
``norm_matmul.mosaic.COLS_EARLY``; ``toggle_ab_{ring_freed_under_next_tile,sum_rows_no_reset,gamma_cols_by_tma,
dx_epilogue_three}-h200-d3eb5e4.json``: ``gemm.specialized.RING_FREED_UNDER_NEXT_TILE``,
``gemm.mosaic.SUM_ROWS_NO_RESET``, ``norm_matmul.mosaic.GAMMA_COLS_BY_TMA`` and the three together;
``toggle_ab_prefetch_under_first-h200-0ee5e84.json``: ``gemm.specialized.PREFETCH_UNDER_FIRST``;
``toggle_ab_dx_apart_probe_{no_reload,no_tile_copy,no_hook}-h200-ab4af0d.json``: the probes ``gemm.mosaic.
PROBE_NO_RELOAD``, ``PROBE_NO_TILE_COPY``, ``PROBE_NO_HOOK`` at the tag ``dx-apart-probes-ab4af0d``;
``toggle_ab_dw_no_dgamma_probe-h200-6b7afb1.json``: ``norm_matmul.mosaic.PROBE_DW_NO_DGAMMA``;
``toggle_ab_sum_rows_widen-h200-cda668d.json``: ``gemm.mosaic.SUM_ROWS_WIDEN``;
``toggle_ab_dw_gamma_on_a-h200-e0b114f.json``: ``norm_matmul.mosaic.DW_GAMMA_ON_A``;
``toggle_ab_matmul_db_below_8-h200-6d21fe0.json`` (``--op matmul``): ``gemm.DB_BELOW_8_OURS``;
``toggle_ab_matmul_rotate_k-h200-f47b35f.json`` (``--op matmul``): ``gemm.specialized.ROTATE_K``;
``toggle_ab_matmul_db_few_rows_by_xla-h200-60d9c2e.json`` (``--op matmul``): ``gemm.DB_FEW_ROWS_BY_XLA``;
``toggle_ab_dx_tile_n-h200-94a3001.json``: ``norm_matmul.config.SWITCH_DX_TILE_N``, a config choice: before 94a3001
each side took the config chosen with the switch True, as ``toggle_ab_dx_tile_n_config_fixed_both-h200-edfe77b.json``
did); the kernels
are built at trace time, so each side's program is traced with the switch set. Bf16 inputs of
``jaxfuse.suites.rmsnorm_matmul.make_inputs``, as many sets rotated as the suite rotates (``runner.input_sets``;
one set until b75d1a6); this device's tuned configs, or with ``--variant`` a variant of
``rmsnorm_matmul_configs.VARIANTS`` ("a+b" combines them) on both sides. Writes ``<out>/toggle_ab-<device>.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys

import jax

from attention_fused_bwd import results_file
from jaxfuse import bench, costmodel
from jaxfuse.suites import rmsnorm_matmul as suite
from jaxfuse.suites.runner import input_sets
from pallas_kernels.gemm import matmul
from pallas_kernels.norm_matmul import rmsnorm_matmul
from rmsnorm_matmul_configs import VARIANTS, combined, variant_config


def _program(x, gamma, w, dy, config=None):
    y, vjp = jax.vjp(lambda x, gamma, w: rmsnorm_matmul(x, gamma, w, backend="mosaic", block_sizes=config),
                     x, gamma, w)
    return y, vjp(dy)


def _matmul_program(x, gamma, w, dy, config=None):
    """(``--op matmul``) The plain core's x @ w and its gradients, default configs (gamma and config unused)."""
    del gamma, config
    y, vjp = jax.vjp(matmul, x, w)
    return y, vjp(dy)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--switch", required=True, help="module:NAME of a bool the kernels (or the config choice) "
                        "read at trace time (several, comma-separated: set together)")
    parser.add_argument("--shapes", type=bench.shapes_arg("MxKxN"), default="8192x512x2816,16384x1024x5504")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--variant", default="default", help="a variant of rmsnorm_matmul_configs (\"a+b\" "
                        "combines them) on both sides; default: this device's tuned config")
    parser.add_argument("--op", choices=("rmsnorm_matmul", "matmul"), default="rmsnorm_matmul",
                        help="matmul: the plain core's product and gradients (pallas_kernels.gemm.matmul)")
    args = parser.parse_args()
    program = _program if args.op == "rmsnorm_matmul" else _matmul_program
    if not set(args.variant.split("+")) <= set(VARIANTS):
        parser.error(f"--variant: {args.variant!r} is not a variant of rmsnorm_matmul_configs (or a+b of them)")
    switches = []  # (module, attribute name)
    for switch in args.switch.split(","):
        module_name, _, name = switch.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            parser.error(f"--switch: cannot import {module_name!r} ({e})")
        if not isinstance(getattr(module, name, None), bool):
            parser.error(f"--switch: {switch!r} is not a bool of that module (at this commit)")
        switches.append((module, name))
    result, save, path = results_file(args.out, "toggle_ab")
    result.update(switch=args.switch, variant=args.variant, op=args.op)
    dev = costmodel.detect()
    for M, K, N in args.shapes:
        sets = input_sets(suite.SPEC, suite.SPEC.shape(f"{M}x{K}x{N}"), dev)
        operands = sets[0]
        compiled = {}
        for value in (False, True):
            for module, name in switches:
                setattr(module, name, value)
            jax.clear_caches()  # (the kernels are built at trace time)
            config = variant_config(M, K, N, combined(args.variant))  # (a switch may change the config chosen)
            compiled[value] = jax.jit(functools.partial(program, config=config)).lower(*operands).compile()
        outs = {value: jax.tree.leaves(fn(*operands)) for value, fn in compiled.items()}
        diff = bench.max_difference(zip(outs[False], outs[True]))
        off, on = bench.time_interleaved([(compiled[False], sets), (compiled[True], sets)],
                                         iterations=args.iterations)
        row = dict(shape=f"{M}x{K}x{N}", false_us=off.median_us, true_us=on.median_us, max_abs_diff=diff,
                   input_sets=len(sets),
                   kernels={"false": off.per_kernel_us, "true": on.per_kernel_us})
        print(row["shape"], f"{off.median_us:.1f} -> {on.median_us:.1f} us", "diff", diff, flush=True)
        result["timings"].append(row)
        save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
