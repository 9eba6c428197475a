"""The train step with the Mosaic rmsnorm_matmul at every norm site, its backward's row dot on the N side against
the default (the K side), beside the all-XLA step: does the K side's dyr fuse into the
fusion that produces dy, and what does the step gain?

    PYTHONPATH=$PWD python benchmarks/scripts/rmsnorm_matmul_row_dot.py --out $OUT [--presets small,1b] \
        [--iterations 10] [--save-hlo]

Per preset of ``jaxfuse.suites.train_step`` three programs, timed interleaved (CUPTI medians): "xla" (every site
XLA), "mosaic_n" (norm_matmul=pallas_mosaic, the row dot on the N side wherever no tuned entry names it:
``config.ROW_DOT_DEFAULT`` set to "n" while the program is traced and compiled) and "mosaic_auto" (as it is). For each: the step's time,
its costliest kernels, and for the Mosaic programs, per Mosaic kernel of the optimized HLO, the fusions that
produce its operands (``kernel_operand_producers``: is dyr made by the fusion that makes dy?). The per-site op figures
(``row_dot="n"`` against "k" at one shape) come from ``rmsnorm_matmul_configs.py --variants row_dot_n,row_dot_k``.
Writes ``rmsnorm_matmul_row_dot-<device>.json``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import sys

import jax

from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench
from jaxfuse.kernels import KernelSet
from jaxfuse.suites import train_step
from pallas_kernels.norm_matmul import config as nm_config

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.*)$")


def kernel_operand_producers(hlo: str) -> list[dict]:
    """Per Mosaic custom call (target mosaic_gpu_v2) of an optimized HLO text: its line (shortened) and, per operand
    made by a fusion, that fusion's line and the first 40 lines of the computation it calls (where dy or dyr,
    x ⊙ gamma, w_γ come from)."""
    lines = {}
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            lines[match.group(1).lstrip("%")] = line.strip()
    computations = {}
    for block in re.split(r"\n(?=\S)", hlo):
        head = block.split("(", 1)[0].split()
        if head:
            computations[head[-1].lstrip("%")] = block.splitlines()[:40]
    found = []
    for name, line in lines.items():
        if "custom-call(" not in line or "mosaic_gpu" not in line:
            continue
        operands = line.split("custom-call(", 1)[1].split(")", 1)[0]
        made = []
        for operand in (o.strip().split()[-1].lstrip("%") for o in operands.split(",") if o.strip()):
            producer = lines.get(operand, "")
            called = re.search(r"calls=%?([\w.\-]+)", producer)
            if called:
                made.append({"operand": operand, "producer": producer[:400],
                             "fused_computation": computations.get(called.group(1), [])})
        found.append({"kernel": name, "line": line[:300], "fused_operands": made})
    return found


def kernel_kinds(per_kernel_us: dict) -> dict:
    """µs per kind of kernel: the name without its trailing numbers (``input_reduce_fusion_71`` ->
    ``input_reduce_fusion``), so that two programs' fusions compare though XLA numbers them apart."""
    kinds: dict[str, float] = {}
    for name, us in per_kernel_us.items():
        kind = re.sub(r"(_\d+)+$", "", name)
        kinds[kind] = kinds.get(kind, 0.0) + us
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def warmed(program, inputs, side: str | None):
    """jit(program), traced and compiled (one call) with ROW_DOT_DEFAULT = side (None: as it is)."""
    saved = nm_config.ROW_DOT_DEFAULT
    if side is not None:
        nm_config.ROW_DOT_DEFAULT = side
    try:
        fn = jax.jit(program)
        jax.block_until_ready(fn(*inputs))
        hlo = fn.lower(*inputs).compile().as_text()
    finally:
        nm_config.ROW_DOT_DEFAULT = saved
    return fn, hlo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--presets", default="small,1b")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--save-hlo", action="store_true", help="also write each program's optimized HLO "
                        "(rmsnorm_matmul_row_dot-<preset>-<program>.hlo.txt.gz)")
    args = parser.parse_args()
    spec = train_step.SPEC
    result, save, path = results_file(args.out, "rmsnorm_matmul_row_dot")
    programs = {"xla": (KernelSet(), None), "mosaic_n": (KernelSet(norm_matmul="pallas_mosaic"), "n"),
                "mosaic_auto": (KernelSet(norm_matmul="pallas_mosaic"), None)}
    for name in args.presets.split(","):
        preset = train_step.PRESETS[name]
        row = dict(preset=name)
        with recorded_row(result, save, row):
            inputs = spec.make_inputs(preset, 0)
            fns = {}
            for label, (kernels, side) in programs.items():
                fns[label], hlo = warmed(spec.program(kernels, "step", preset, {}), inputs, side)
                if label != "xla":
                    row.setdefault("kernel_operands", {})[label] = kernel_operand_producers(hlo)
                if args.save_hlo:
                    with gzip.open(os.path.join(args.out, f"rmsnorm_matmul_row_dot-{name}-{label}.hlo.txt.gz"),
                                   "wt") as f:
                        f.write(hlo)
            timings = bench.time_interleaved([(f, inputs) for f in fns.values()], iterations=args.iterations)
            for label, t in zip(fns, timings):
                top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:15]
                row[label] = dict(us=t.median_us, samples=list(t.samples_us), top_kernels=top,
                                  by_kind=kernel_kinds(t.per_kernel_us), per_kernel_us=t.per_kernel_us)
            base = row["xla"]["us"]
            row["speedup_vs_xla"] = {label: base / row[label]["us"] for label in fns if label != "xla"}
            print(name, {label: round(row[label]["us"], 1) for label in fns}, row["speedup_vs_xla"], flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
