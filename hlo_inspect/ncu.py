"""What Nsight Compute (ncu) says about each kernel: its text report read back as numbers, and where its cycles go.

    from hlo_inspect import ncu
    kernels = ncu.parse(open("report.txt").read())   # one NcuKernel per profiled launch, in launch order
    rows = ncu.summary(kernels)                      # per kernel (and shape): launches, the median of each metric
    ncu.opcode_lines(rows[0])                        # its most executed SASS opcodes (sass__inst_executed_per_opcode)
    python -m hlo_inspect.ncu report.txt [--json out.json --meta device=H200 --meta commit=...]

The report is what ``ncu`` prints by default (its "details" page): per launch a header line, "  <kernel> (grid)x(block),
Context c, Stream s, Device d, CC x.y", then sections of "<metric name>  <unit>  <value>" rows (values with thousands
separators, units as ncu prints them: us, Ghz, Mbyte, %, cycle, ...). Lines that are not such rows (warnings, rule
notes, the profiler's own "==PROF==" lines, the program's output) are skipped.

Where a launch's cycles go (``NcuKernel.cycle_shares``), from the "GPU Speed Of Light Throughput" section's "Elapsed
Cycles" and "SM Active Cycles" and, when it was collected, the metric
``sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active``:
  tensor       cycles the average SM's tensor pipe was busy, of the elapsed cycles
  sm_idle      cycles the average SM had no work (a grid's last, part-empty round; launch and drain)
  active_other cycles an SM was active but its tensor pipe was not (waits, epilogues, the rest)
The tensor share is also what a GEMM gets of the chip's tensor peak at the clock it ran: on the H200 at 4096x4096x
14336 the Mosaic core's busy tensor cycles equal 2·M·K·N / (132 SMs · 4096 FLOP per cycle) to 0.1%
(benchmarks/results/ncu_core_14336_6144-h200-9e45f8b.txt).

Instanced metrics (``--print-metric-instances details``), such as ``sass__inst_executed_per_opcode``, print a total
and then "(NAME: value; NAME: value; ...)" wrapped over lines: the total reads back as the metric's value and the
instances into ``NcuKernel.instances`` (names as ncu printed them: SASS opcodes there). Printed with "values" only,
the instances have no names and only the total is kept. What the per-opcode counts showed on the H200:
benchmarks/results/ncu_fused_opcodes-h200-87a5a1a.txt (the fused forward's γ products, HMUL2, 20% of its
instructions; the dx kernel's wgmma descriptors, uniform-datapath integer ops, 49%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys

__all__ = ["NcuKernel", "PER_OPCODE", "TENSOR_BUSY", "opcode_lines", "parse", "summary"]

TENSOR_BUSY = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
PER_OPCODE = "sass__inst_executed_per_opcode"
_HEADER = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context \d+, Stream \d+")
_ROW = re.compile(r"^    (\S.*?)\s{2,}(\S+)\s{2,}([-+]?[\d,]*\.?\d+(?:[eE][-+]?\d+)?)\s*$")
_NOT_METRICS = {"Metric Name"}
# an instanced metric's first line: name, unit (often none), total, then "(" and the first instances
_INSTANCED = re.compile(r"^    (\S+)\s{2,}(?:(\S+)\s{2,})?([\d,]*\.?\d+) \((.*)$")
_INSTANCE = re.compile(r"([^\s:;()][^:;()]*?):\s*([-+]?[\d,]*\.?\d+)")


@dataclasses.dataclass(frozen=True)
class NcuKernel:
    """One profiled launch: kernel name, grid and block, and each metric as (unit, value)."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    metrics: dict[str, tuple[str, float]]
    instances: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def value(self, metric: str) -> float | None:
        """The metric's value in the unit ncu printed, or None when the report has no such row."""
        return self.metrics[metric][1] if metric in self.metrics else None

    def cycle_shares(self) -> dict[str, float] | None:
        """Fractions of the elapsed cycles: "tensor", "active_other", "sm_idle" (module docstring); None without
        the Speed Of Light cycle counts. Without the tensor metric, only "sm_active" and "sm_idle"."""
        elapsed, active = self.value("Elapsed Cycles"), self.value("SM Active Cycles")
        if not elapsed or active is None:
            return None
        shares = {"sm_active": active / elapsed, "sm_idle": 1.0 - active / elapsed}
        busy = self.value(TENSOR_BUSY)
        if busy is not None:
            shares["tensor"] = busy / 100.0 * active / elapsed
            shares["active_other"] = shares["sm_active"] - shares["tensor"]
        return shares


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _instances(listed: str) -> dict[str, float]:
    """{name: value} of an instance list's text up to its ")"; empty where ncu printed values without names."""
    return {name.strip(): _number(value) for name, value in _INSTANCE.findall(listed.split(")")[0])}


def parse(text: str) -> list[NcuKernel]:
    """Every profiled launch of an ncu text report, in order. A metric printed twice for one launch (in two
    sections) keeps its first value; an instanced metric's named instances go to ``NcuKernel.instances``."""
    kernels: list[NcuKernel] = []
    current = None
    listing = None  # (metric, its instance list's text so far) until the list's ")"
    for line in text.splitlines():
        if listing is None and current is not None:
            instanced = _INSTANCED.match(line)
            if instanced:
                metric = instanced.group(1)
                current.metrics.setdefault(metric, (instanced.group(2) or "", _number(instanced.group(3))))
                listing, line = (metric, ""), instanced.group(4)
        if listing is not None:
            metric, listed = listing
            listing = metric, f"{listed} {line.strip()}"
            if ")" in line:
                named = _instances(listing[1])
                if named:
                    current.instances.setdefault(metric, named)
                listing = None
            continue
        header = _HEADER.match(line)
        if header:
            current = NcuKernel(header.group(1), tuple(map(int, header.group(2, 3, 4))),
                                tuple(map(int, header.group(5, 6, 7))), {})
            kernels.append(current)
            continue
        row = _ROW.match(line) if current is not None else None
        if row and row.group(1).strip() not in _NOT_METRICS:
            current.metrics.setdefault(row.group(1).strip(), (row.group(2), _number(row.group(3))))
    return kernels


def _duration(k: NcuKernel) -> float | None:
    return k.value("Elapsed Cycles") or k.value("Duration") or k.value("gpu__time_duration.sum")


def _groups(kernels: list[NcuKernel], tolerance: float) -> list[list[NcuKernel]]:
    """Launches of one kernel (name, grid, block), split where their durations, sorted, jump by more than
    ``tolerance`` (relative): the same kernel at two shapes. Groups in order of their first launch."""
    by_kernel: dict[tuple, list[NcuKernel]] = {}
    for k in kernels:
        by_kernel.setdefault((k.name, k.grid, k.block), []).append(k)
    groups = []
    for launches in by_kernel.values():
        timed = sorted((k for k in launches if _duration(k)), key=_duration)
        split = [[timed[0]]] if timed else []
        for k in timed[1:]:
            if _duration(k) > _duration(split[-1][-1]) * (1 + tolerance):
                split.append([])
            split[-1].append(k)
        untimed = [k for k in launches if not _duration(k)]
        groups += split + ([untimed] if untimed else [])
    order = {id(k): i for i, k in enumerate(kernels)}
    return sorted(groups, key=lambda g: min(order[id(k)] for k in g))


def summary(kernels: list[NcuKernel], tolerance: float = 0.03) -> list[dict]:
    """One row per kernel and duration group (``_groups``: the same kernel at another shape is another row), in
    first-launch order: {"kernel", "launches", "grid", "block", "median": {metric: (unit, median)}, "cycle_shares":
    medians of ``NcuKernel.cycle_shares`` (or None), "instances": {metric: {name: median over the launches that
    have the metric's instances, an absent name counting 0}}}."""
    rows = []
    for launches in _groups(kernels, tolerance):
        metrics = {}
        for metric in launches[0].metrics:
            values = [k.metrics[metric] for k in launches if metric in k.metrics]
            metrics[metric] = (values[0][0], statistics.median(v for _, v in values))
        shares = [s for s in (k.cycle_shares() for k in launches) if s is not None]
        instances = {}
        for metric in dict.fromkeys(m for k in launches for m in k.instances):
            listed = [k.instances[metric] for k in launches if metric in k.instances]
            names = dict.fromkeys(name for one in listed for name in one)
            instances[metric] = {name: statistics.median(one.get(name, 0.0) for one in listed) for name in names}
        rows.append(dict(kernel=launches[0].name, launches=len(launches), grid=launches[0].grid,
                         block=launches[0].block, median=metrics,
                         cycle_shares=None if not shares else {key: statistics.median(s[key] for s in shares)
                                                               for key in shares[0]},
                         instances=instances))
    return rows


def opcode_lines(row: dict, top: int = 8) -> list[str]:
    """A summary row's most executed SASS opcodes (``PER_OPCODE`` instances), each with its share of the kernel's
    instructions and, where it ran wgmma, its count per HGMMA; [] without the per-opcode metric."""
    counts = row.get("instances", {}).get(PER_OPCODE)
    if not counts:
        return []
    total, wgmma = sum(counts.values()), counts.get("HGMMA")
    lines = []
    for name, count in sorted(counts.items(), key=lambda item: -item[1])[:top]:
        per = f", {count / wgmma:.2f} per HGMMA" if wgmma else ""
        lines.append(f"{name} {count / 1e6:.2f} M ({100 * count / total:.1f}%{per})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlo_inspect.ncu", description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="a saved ncu text report")
    parser.add_argument("--json", help="also write the summary (and every launch) to this JSON file")
    parser.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                        help="recorded under 'meta' in the JSON (device, jax version, commit, date of the run)")
    args = parser.parse_args(argv)
    bad = [m for m in args.meta if "=" not in m]
    if bad:
        parser.error(f"--meta: expected KEY=VALUE, got {bad[0]!r}")
    try:
        with open(args.report, encoding="utf-8", errors="replace") as f:
            kernels = parse(f.read())
    except OSError as e:
        print(f"report: cannot read {args.report!r}: {e.strerror}", file=sys.stderr)
        return 2
    if not kernels:
        print(f"report: {args.report!r} holds no profiled kernel (no '  <name> (grid)x(block), Context ...' line)",
              file=sys.stderr)
        return 2
    table = summary(kernels)
    for row in table:
        median = row["median"]
        cols = [f"{row['launches']}x"]
        for metric in ("Duration", "SM Frequency", TENSOR_BUSY):  # in the unit ncu printed (us or ms; Ghz)
            if metric in median:
                unit, value = median[metric]
                cols.append(f"{value:.2f} {'tensor %' if metric == TENSOR_BUSY else unit}")
        if row["cycle_shares"]:
            cols.append(", ".join(f"{k} {v:.3f}" for k, v in row["cycle_shares"].items()))
        print(f"{row['kernel']}: " + "; ".join(cols))
        opcodes = opcode_lines(row)
        if opcodes:
            print("  most executed: " + "; ".join(opcodes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(report=args.report, meta=dict(m.split("=", 1) for m in args.meta), kernels=table,
                           launches=[dataclasses.asdict(k) for k in kernels]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
