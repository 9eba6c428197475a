"""`Report`: a parsed program's kernels with totals, XLA's own cost analysis beside ours, text and JSON.

    rep = hlo_inspect.inspect(f, x, w)          # jit + lower + compile + parse
    print(rep.table())
    rep.to_json()                               # schema "hlo_inspect.report/1", see README

Totals count each kernel `launches` times (a while loop with a known trip count runs its body that often).
A program with collectives (an SPMD-partitioned one) also lists, per collective, the bytes one device sends and
receives over the interconnect (`hlo_inspect.collectives`), in the table, the totals and the JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import numbers
import textwrap
from typing import Any, Callable

from hlo_inspect.formatting import format_bytes
from hlo_inspect.kernels import Kernel, kernels as list_kernels, tiled_layouts, trip_count, written_shape
from hlo_inspect.ledger import NO_SCOPE, Ledger, ledger as build_ledger
from hlo_inspect.parser import Module, gc_paused, parse
from hlo_inspect.shapes import hbm_resident
from hlo_inspect.unfused import Unfused, counterfactual

__all__ = ["Report", "Totals", "inspect", "from_text", "JSON_SCHEMA"]

JSON_SCHEMA = "hlo_inspect.report/1"
_OPAQUE = ("pallas", "mosaic", "custom_call")  # categories whose work XLA cannot see into
_LIBRARY = ("cublas", "cudnn")


@dataclasses.dataclass(frozen=True)
class Totals:
    kernels: int
    launches: int
    bytes_read: int
    bytes_written: int
    flops: int
    transcendentals: int
    flops_unknown_kernels: int  # kernels whose FLOPs we cannot know (opaque custom calls)
    collectives: int = 0
    bytes_sent: int = 0  # interconnect bytes one device sends per run (collectives)
    bytes_received: int = 0

    @property
    def bytes_total(self) -> int:
        return self.bytes_read + self.bytes_written


def _totals(ks: list[Kernel], once: bool = False) -> Totals:
    """Sums over kernels, each counted `launches` times (or once, as XLA's cost analysis counts loop bodies)."""
    n = (lambda k: 1) if once else (lambda k: k.launches)
    return Totals(
        kernels=len(ks), launches=sum(n(k) for k in ks),
        bytes_read=sum(k.bytes_read * n(k) for k in ks),
        bytes_written=sum(k.bytes_written * n(k) for k in ks),
        flops=sum((k.flops or 0) * n(k) for k in ks),
        transcendentals=sum(k.transcendentals * n(k) for k in ks),
        flops_unknown_kernels=sum(1 for k in ks if k.flops is None),
        collectives=sum(1 for k in ks if k.collective),
        bytes_sent=sum(k.bytes_sent * n(k) for k in ks),
        bytes_received=sum(k.bytes_received * n(k) for k in ks))


def _format_flops(n: int | None) -> str:
    """421_300_000 -> '421.3M' (a count in a FLOP column); None -> '?'; past 10**15, '1.2e18'."""
    if n is None:
        return "?"
    if n >= 10 ** 15:
        return _scientific(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _flop_text(n: int | None) -> str:
    """421_300_000 -> '421.3 MFLOP', 12 -> '12 FLOP': a quantity with its unit."""
    count = _format_flops(n)
    return f"{count[:-1]} {count[-1]}FLOP" if count[-1] in "KMGT" else f"{count} FLOP"


def _scientific(n: int) -> str:
    """An int of any size as '1.2e18', without converting it to float (which overflows past 1e308)."""
    e = int((n.bit_length() - 1) * 0.30102999566398)
    while 10 ** (e + 1) <= n:
        e += 1
    while e > 0 and 10 ** e > n:
        e -= 1
    return f"{n * 10 // 10 ** e / 10:.1f}e{e}"


def _ratio_text(a: int, b: int) -> str:
    """a / b to one decimal, for ints of any size."""
    try:
        return f"{a / b:.1f}"
    except OverflowError:
        return _scientific(a // b)


def _format_us(us: float) -> str:
    """A duration in microseconds, in the unit that reads best: '12.34 µs', '56.7 ms', '2567.4 s'."""
    if us < 1e3:
        return f"{us:.2f} µs"
    if us < 1e6:
        return f"{us / 1e3:.1f} ms"
    return f"{us / 1e6:.1f} s"


def _rate(value, name: str, example: str) -> float:
    """A rate argument (bytes or FLOPs per second, µs per launch) as a float; a ValueError naming it unless it is a
    finite number > 0 (a string such as '3e12' included: the caller converts, as for any number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0 ({example}), got {value!r} ({type(value).__name__})")
    return float(value)


def _count(value, name: str) -> int:
    """A row-count argument as an int; a ValueError naming it unless it is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r} ({type(value).__name__})")
    return int(value)


def _plural(n: int, word: str, plural: str = "") -> str:
    """(1, 'tensor') -> '1 tensor'; (2, 'tensor') -> '2 tensors'; (2, 'launch', 'launches') -> '2 launches'."""
    return f"{n:,} " + (word if n == 1 else plural or word + "s")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _clip_left(text: str, width: int) -> str:
    """Keep the end (file name and line) of a long path."""
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _short_path(location: str) -> str:
    """`/work/repo/pkg/mod.py:12` -> `pkg/mod.py:12` when under the current directory."""
    import os

    cwd = os.getcwd() + os.sep
    return location[len(cwd):] if location.startswith(cwd) else location


@dataclasses.dataclass(eq=False)
class Report:
    """Kernels of one compiled program. `xla_cost` is `compiled.cost_analysis()` when we compiled it."""

    module: Module
    kernels: list[Kernel]
    xla_cost: dict[str, float] | None = None
    platform: str = ""
    title: str = ""
    unfused: Unfused | None = None  # one kernel per op, from the pre-optimization HLO (inspect() fills it)
    caveats: list[str] = dataclasses.field(default_factory=list)  # what the caller knows that the text cannot say

    @property
    def totals(self) -> Totals:
        return _totals(self.kernels)

    @property
    def warnings(self) -> list[str]:
        """What a reader should know about the numbers: the caller's ``caveats`` (Pallas kernels that ran in
        interpret mode), the parser's (several modules in one text), HLO that looks unoptimized (every op its own
        kernel), conditionals and while loops of unknown trip count (counted as every branch, and once),
        shapes with unbounded dynamic dimensions (`f32[?]`), which count 0 bytes, and kernels' results outside HBM
        (a TPU's VMEM, host memory), which count none either."""
        if getattr(self, "_warnings", None) is None:
            unbounded = sum(1 for inst in self.module.instructions() if inst.shape.has_unbounded)
            notes = [f"collective {k.name}: {k.collective.note}" for k in self.kernels
                     if k.collective and k.collective.note]
            self._warnings = list(self.module.warnings) + _unoptimized_warning(self.module) + \
                _control_flow_warnings(self.module) + _memory_space_warnings(self.module, self.kernels) + ([
                f"{unbounded} instruction{'s' if unbounded != 1 else ''} with an unbounded dynamic dimension ('?', "
                "sized only at run time) count 0 bytes and 0 FLOPs for it"] if unbounded else []) + notes
        return list(self.caveats) + self._warnings

    @property
    def ledger(self) -> Ledger:
        """Tensors written by one kernel and read back by another (see hlo_inspect.ledger)."""
        if getattr(self, "_ledger", None) is None:
            with gc_paused():
                self._ledger = build_ledger(self.module, self.kernels)
        return self._ledger

    def fusion_saving(self, hbm_bytes_per_s: float, flops_per_s: float, launch_us: float) -> dict[str, Any] | None:
        """Kernels, bytes and roofline-predicted time without fusion (one kernel per op) and with XLA's fusion.

        Like with like: the unfused program comes from the HLO before optimization, which has no loop trip counts,
        so it counts each while-loop body once; the fused side here does the same (``loop_bodies_once`` says
        whether that mattered), unlike ``totals``, which counts every launch."""
        hbm_bytes_per_s = _rate(hbm_bytes_per_s, "hbm_bytes_per_s", "bytes per second, e.g. 3.35e12")
        flops_per_s = _rate(flops_per_s, "flops_per_s", "FLOPs per second, e.g. 989e12")
        if isinstance(launch_us, bool) or not isinstance(launch_us, numbers.Real) or not launch_us >= 0:
            raise ValueError(f"launch_us: expected a number >= 0 (µs per kernel launch), got {launch_us!r}")
        if self.unfused is None:
            return None
        fused_us = sum(max(k.bytes_total / hbm_bytes_per_s, (k.flops or 0) / flops_per_s) * 1e6 + launch_us
                       for k in self.kernels)
        unfused_us = self.unfused.predicted_us(hbm_bytes_per_s, flops_per_s, launch_us)
        once = _totals(self.kernels, once=True)
        return {"kernels": [self.unfused.kernels, once.kernels], "bytes": [self.unfused.bytes_total, once.bytes_total],
                "predicted_us": [unfused_us, fused_us], "speedup": unfused_us / fused_us if fused_us else None,
                "loop_bodies_once": any(k.launches != 1 for k in self.kernels)}

    def fusion_saving_text(self, device_name: str, hbm_bytes_per_s: float, flops_per_s: float,
                           launch_us: float) -> str | None:
        """``fusion_saving`` as the one paragraph `jaxfuse inspect` prints, or None without the unfused program."""
        saving = self.fusion_saving(hbm_bytes_per_s, flops_per_s, launch_us)
        if not saving:
            return None
        speedup = f"{saving['speedup']:.1f}× from fusion" if saving["speedup"] else "no kernels"
        return (f"fusion saving on {device_name} (roofline + {launch_us:g} µs per launch): "
                f"{saving['kernels'][0]:,} -> {saving['kernels'][1]:,} kernels, "
                f"{format_bytes(saving['bytes'][0])} -> {format_bytes(saving['bytes'][1])}, "
                f"{_format_us(saving['predicted_us'][0])} -> {_format_us(saving['predicted_us'][1])} predicted "
                f"({speedup}); unfused = one kernel per op, as eager JAX runs it"
                + ("; while-loop bodies counted once on both sides (the unfused program has no trip counts)"
                   if saving["loop_bodies_once"] else ""))

    def ledger_table(self, hbm_bytes_per_s: float | None = None, limit: int = 25) -> str:
        """The round trips, most traffic first; with a bandwidth, their cost in microseconds."""
        if hbm_bytes_per_s is not None:
            hbm_bytes_per_s = _rate(hbm_bytes_per_s, "hbm_bytes_per_s", "bytes per second, e.g. 3.35e12, or None")
        limit = _count(limit, "limit")
        led = self.ledger
        trips = sorted(led.round_trips, key=lambda t: -t.traffic_bytes)
        header = ("tensor", "shape", "size", "traffic", "time" if hbm_bytes_per_s else "", "producer -> consumers",
                  "scope (producer -> consumers)")
        rows = []
        for t in trips[:limit]:
            cost = _format_us(t.cost_us(hbm_bytes_per_s)) if hbm_bytes_per_s else ""
            flow = t.producer.name + " -> " + ", ".join(c.name for c in t.consumers)
            scopes = ((t.producer_scopes[0] if t.producer_scopes else NO_SCOPE) + " -> " +
                      (", ".join(t.consumer_scopes[:2]) or NO_SCOPE))
            rows.append((_clip(t.name, 30), _clip(str(t.shape).split("{")[0], 26), format_bytes(t.bytes),
                         format_bytes(t.traffic_bytes), cost, _clip(flow, 60), _clip(scopes, 60)))
        widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]
        fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
        lines = [f"HBM round trips: {_plural(len(trips), 'tensor')}, {format_bytes(led.traffic_bytes)} of avoidable "
                 "traffic" + (f" ({_format_us(led.traffic_bytes / hbm_bytes_per_s * 1e6)} at "
                              f"{hbm_bytes_per_s / 1e12:.2f} TB/s)" if hbm_bytes_per_s else ""),
                 fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
        if len(trips) > limit:
            lines.append(f"... {len(trips) - limit} more")
        for t, shapes in led.from_constants():
            lines.append(textwrap.fill(_from_constants_note(t, shapes), width=120, subsequent_indent="  "))
        lines.append("")
        lines.append("by producer scope:")
        for row in led.by_scope(hbm_bytes_per_s)[:10]:
            cost = f", {_format_us(row['cost_us'])}" if "cost_us" in row else ""
            lines.append(f"  {row['scope']:40s} {_plural(row['tensors'], 'tensor'):>11s}, "
                         f"{format_bytes(row['traffic_bytes'])}{cost}")
        lines.append(f"program inputs read: {len(led.inputs)}, outputs written: {len(led.outputs)}")
        return "\n".join(lines)

    def comparison(self) -> list[dict[str, Any]]:
        """Our totals beside XLA's cost analysis, one row per quantity, with the reason for any difference."""
        if not self.xla_cost:
            return []
        ours = self.totals
        opaque = [k for k in self.kernels if k.category in _OPAQUE]
        library = [k for k in self.kernels if k.category in _LIBRARY and k.instruction.opcode == "custom-call"]
        uncounted = opaque + library
        looped = any(k.launches != 1 for k in self.kernels)
        # XLA's cost analysis counts a while body once, whatever its trip count: compare like with like.
        visible = _totals([k for k in self.kernels if k not in uncounted], once=True)
        rows = []
        for quantity, key, mine, mine_visible in (
                ("bytes accessed", "bytes accessed", ours.bytes_total, visible.bytes_total),
                ("flops", "flops", ours.flops, visible.flops),
                ("transcendentals", "transcendentals", ours.transcendentals, visible.transcendentals)):
            theirs = self.xla_cost.get(key)
            if theirs is None:
                continue
            reasons = []
            if looped:
                reasons.append("XLA counts each while-loop body once, ours per trip; compared once")
            if uncounted:
                names = ", ".join(sorted({k.target or k.category for k in uncounted}))
                reasons.append(f"XLA's cost analysis cannot see into {len(uncounted)} custom call(s) ({names}); "
                               "compared without them")
            ratio = (mine_visible / theirs) if theirs > 0 else None
            if ratio is not None and abs(ratio - 1) > 0.005:
                reasons.append(_difference_reason(quantity))
            rows.append({"quantity": quantity, "ours": mine, "ours_compared": mine_visible,
                         "xla": theirs, "ratio": ratio, "reason": "; ".join(reasons) or "equal"})
        return rows

    # ---- rendering -------------------------------------------------------------------------------------------

    def table(self, max_scope_width: int = 34) -> str:
        """Aligned text: one row per kernel, then totals and the comparison with XLA's cost analysis."""
        collectives = [k for k in self.kernels if k.collective]
        header = ("#", "kernel", "category", "read", "written") + (("sent", "received") if collectives else ()) + (
            "FLOP", "FLOP/B", "fused ops", "scope", "source")
        rows = []
        for i, k in enumerate(self.kernels):
            intensity = "" if k.flops is None or not k.bytes_total else _ratio_text(k.flops, k.bytes_total)
            ops = ",".join(f"{op}" + (f"×{n}" if n > 1 else "") for op, n in k.ops.most_common(3))
            name = k.name + (f" [{k.launches}× in {k.loop}]" if k.loop else "")
            label = k.label + (f" ({k.target})" if k.category in ("custom_call", "custom_fusion") and k.target
                               else "")
            if k.collective:
                label += f" ({k.collective.opcode} ×{k.collective.group_size})"
            network = ((format_bytes(k.bytes_sent) if k.collective else "",
                        format_bytes(k.bytes_received) if k.collective else "") if collectives else ())
            rows.append((str(i), _clip(name, 40), _clip(label, 36), format_bytes(k.bytes_read),
                         format_bytes(k.bytes_written)) + network + (
                        _format_flops(k.flops), intensity, _clip(ops, 30),
                        _clip(", ".join(k.scopes[:2]) or NO_SCOPE, max_scope_width),
                        _clip_left(_short_path(k.source_lines[0]) if k.source_lines else "", 40)))
        widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]
        right = {3, 4, 5, 6, 7, 8} if collectives else {3, 4, 5, 6}

        def fmt(row):
            return "  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                             for c, (cell, w) in enumerate(zip(row, widths))).rstrip()

        t = self.totals
        lines = []
        if self.title:
            lines.append(self.title)
        lines += [f"warning: {w}" for w in self.warnings]
        lines.append(f"module {self.module.name}" + (f" on {self.platform}" if self.platform else "") +
                     f": {_plural(t.kernels, 'kernel')}, {_plural(t.launches, 'launch', 'launches')} per run")
        lines += [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
        lines.append("")
        by_category: dict[str, int] = {}
        for k in self.kernels:
            by_category[k.label] = by_category.get(k.label, 0) + 1
        lines.append("kernels by category: " + ", ".join(f"{n} {c}" for c, n in
                                                        sorted(by_category.items(), key=lambda x: -x[1])))
        lines.append(f"total: read {format_bytes(t.bytes_read)}, written {format_bytes(t.bytes_written)}, "
                     f"{_flop_text(t.flops)}" + (f" (+{_plural(t.flops_unknown_kernels, 'kernel')} of unknown FLOPs)"
                                                 if t.flops_unknown_kernels else ""))
        if collectives:
            kinds = collections.Counter(k.collective.opcode for k in collectives)
            lines.append(f"collectives: {', '.join(f'{n} {op}' for op, n in kinds.most_common())}; per device "
                         f"{format_bytes(t.bytes_sent)} sent, {format_bytes(t.bytes_received)} received per run "
                         "(ring algorithm)")
        comparison = self.comparison()
        if comparison:
            lines.append("")
            lines.append("ours vs XLA's compiled.cost_analysis():")
            for row in comparison:
                ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "n/a"
                compared = row["ours_compared"]
                lines.append(f"  {row['quantity']:16s} ours {row['ours']:>16,}  compared {compared:>16,}  "
                             f"xla {row['xla']:>16,.0f}  compared/xla {ratio}  ({row['reason']})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        t = self.totals
        return {
            "schema": JSON_SCHEMA,
            "module": self.module.name,
            "title": self.title,
            "platform": self.platform,
            "warnings": self.warnings,
            "totals": dataclasses.asdict(t) | {"bytes_total": t.bytes_total},
            "xla_cost_analysis": self.xla_cost,
            "comparison": self.comparison(),
            "unfused": None if self.unfused is None else {
                "kernels": self.unfused.kernels, "bytes_total": self.unfused.bytes_total,
                "flops": self.unfused.flops, "transcendentals": self.unfused.transcendentals},
            "kernels": [_kernel_dict(k) for k in self.kernels],
            "ledger": {
                "traffic_bytes": self.ledger.traffic_bytes,
                "round_trips": [_round_trip_dict(t) for t in self.ledger.round_trips],
                "from_constants": [{"tensor": t.name, "shape": str(t.shape), "bytes": t.bytes,
                                    "producer": t.producer.name, "consumers": [c.name for c in t.consumers],
                                    "broadcast_to": [None if shape is None else str(shape) for shape in shapes],
                                    "note": _from_constants_note(t, shapes)}
                                   for t, shapes in self.ledger.from_constants()],
                "inputs": [{"tensor": t.name, "shape": str(t.shape), "bytes": t.bytes,
                            "readers": [k.name for k in readers]} for t, readers in self.ledger.inputs],
                "outputs": [{"tensor": t.name, "shape": str(t.shape), "bytes": t.bytes,
                             "writer": k.name if k else None} for t, k in self.ledger.outputs],
            },
        }

    def to_json(self, indent: int | None = 1) -> str:
        """The report as JSON: compact with `indent=None`; else one line per key of the outer objects and per
        element of their lists (one kernel, one round trip per line), which keeps it readable and fast to write
        (json's indenting encoder is pure Python: seconds for a 4 MB program's report)."""
        with gc_paused():
            return _json_text(self.to_dict(), indent)

    def to_html(self, path: str | None = None, *, title: str | None = None) -> str:
        """Self-contained HTML page (sortable kernel table, ledger, kernel graph); also written to `path`."""
        from hlo_inspect.html import render_report, write_html

        page = render_report(self.to_dict(), title=title)
        if path is not None:
            write_html(path, page)
        return page


def _json_text(value: Any, indent: int | None, depth: int = 0) -> str:
    """JSON with objects expanded down to depth 2 and lists down to depth 3; below that, compact (C encoder)."""
    expand = isinstance(value, dict) and depth < 2 or isinstance(value, list) and depth < 3
    if indent is None or not expand or not value:
        return json.dumps(value)
    pad, outer = " " * (indent * (depth + 1)), " " * (indent * depth)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(str(k))}: {_json_text(v, indent, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + outer + "}"
    return "[\n" + ",\n".join(pad + json.dumps(v) for v in value) + "\n" + outer + "]"


def _difference_reason(quantity: str) -> str:
    if quantity == "bytes accessed":
        return ("XLA counts bytes per HLO op with its own rules (e.g. operands used through several slices, "
                "in-place updates); see the per-kernel JSON")
    if quantity == "flops":
        return "XLA counts some ops differently (e.g. compare/select, convert, or library calls)"
    return "XLA's transcendental count differs"


def _kernel_dict(k: Kernel) -> dict[str, Any]:
    return {
        "name": k.name, "category": k.category, "label": k.label, "target": k.target,
        "opcode": k.instruction.opcode, "shape": str(k.instruction.shape), "ops": dict(k.ops),
        "bytes_read": k.bytes_read, "bytes_written": k.bytes_written, "flops": k.flops,
        "transcendentals": k.transcendentals, "scopes": k.scopes,
        "source_lines": [_short_path(line) for line in k.source_lines],  # as the table shows them
        "loop": k.loop, "launches": k.launches, "xla_estimate_us": k.xla_estimate_us,
        "operands": [{"name": src.name, "bytes_read": n} for src, n in k.reads],
        "bytes_sent": k.bytes_sent, "bytes_received": k.bytes_received,
        "collective": None if k.collective is None else dataclasses.asdict(k.collective),
        "done": k.done.name if k.done is not None else None,
    }


def _from_constants_note(t, shapes: list) -> str:
    """What the ledger table and the HTML page say of a round trip in ``Ledger.from_constants``."""
    layout_free = lambda shape: str(shape).split("{")[0]  # noqa: E731
    broadcast = [f"{c.name} reads it broadcast to {layout_free(shape)}"
                 for c, shape in zip(t.consumers, shapes) if shape is not None]
    return (f"{t.producer.name} computes {layout_free(t.shape)} from iotas and constants alone"
            + (f"; {', '.join(broadcast)}" if broadcast else "") + ". Its row counts its bytes only: a fusion reading "
            "such a value broadcast can run far slower than they say (a causal mask made this way cost an H200 softmax "
            "fusion 2.7x its time). Written from iotas of the consumer's shape, it is computed inside the consumer.")


def _round_trip_dict(t) -> dict[str, Any]:
    return {"tensor": t.name, "shape": str(t.shape), "bytes": t.bytes, "traffic_bytes": t.traffic_bytes,
            "producer": t.producer.name, "consumers": [c.name for c in t.consumers], "read_bytes": t.read_bytes,
            "is_output": t.is_output, "producer_scopes": t.producer_scopes, "consumer_scopes": t.consumer_scopes}


def _control_flow_warnings(module: Module) -> list[str]:
    """Warnings for control flow whose run-time count the text does not fix: conditionals (the kernels of every
    branch are listed and counted, one branch runs) and while loops without `known_trip_count` (counted once)."""
    branches = sum(1 for inst in module.instructions() if inst.opcode == "conditional")
    unknown = sum(1 for inst in module.instructions() if inst.opcode == "while" and trip_count(inst) is None)
    out = []
    if branches:
        out.append(f"{branches} conditional{'s' if branches != 1 else ''}: the kernels of every branch are listed "
                   "and counted, though one branch runs per call")
    if unknown:
        out.append(f"{unknown} while loop{'s' if unknown != 1 else ''} with a trip count the HLO does not give (no "
                   "known_trip_count): each body is counted once")
    return out


def _memory_space_warnings(module: Module, kernels: list[Kernel]) -> list[str]:
    """[a note] when kernels write results outside HBM (``shapes.hbm_resident``): how many, in which memory
    spaces, and that their bytes are not counted; else []."""
    tiled = tiled_layouts(module)
    spaces = collections.Counter(leaf.memory_space for k in kernels for leaf in written_shape(k.instruction).leaves()
                                 if not hbm_resident(leaf, tiled))
    if not spaces:
        return []
    where = ", ".join(f"{n} in S({space}) ({_SPACE_NAMES.get((tiled, space), 'on chip' if tiled else 'host memory')})"
                      for space, n in sorted(spaces.items()))
    return [f"kernel results outside HBM count no HBM bytes: {where}" +
            ("; sizes count the TPU tiles' padding" if tiled else "")]


_SPACE_NAMES = {(True, 1): "VMEM", (True, 5): "host memory", (False, 5): "host memory"}


def _unoptimized_warning(module: Module) -> list[str]:
    """[a warning] when the text looks like HLO before XLA's optimizations: its `HloModule` header lacks
    `is_scheduled=true` (which every compiled program's has, CPU and GPU) and its entry has no fusion; else []."""
    if not module.name or module.header_attrs.get("is_scheduled") == "true":
        return []
    if any(inst.opcode == "fusion" for inst in module.entry.instructions):
        return []
    return [f"module {module.name} looks like HLO before XLA's optimizations (its header has no "
            "is_scheduled=true and its entry no fusion), so every op counts as a kernel of its own; the compiled "
            "program's HLO is `jax.jit(f).lower(*args).compile().as_text()`"]


def _normalize_cost(cost: Any) -> dict[str, float] | None:
    """`compiled.cost_analysis()` is a dict (jax >= 0.4.30) or a list of one dict (older); keep the totals."""
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None
    keep = ("flops", "transcendentals", "bytes accessed", "bytes accessed output", "optimal_seconds")
    return {k: float(v) for k, v in cost.items() if k in keep}


def from_text(text: str, *, title: str = "", platform: str = "") -> Report:
    """Report of saved optimized HLO text (no JAX needed)."""
    with gc_paused():
        module = parse(text)
        return Report(module=module, kernels=list_kernels(module), title=title, platform=platform)


def inspect(fn: Callable, *args, compiler_options: dict[str, Any] | None = None, **kwargs) -> Report:
    """jit, lower, compile and parse `fn(*args, **kwargs)`; returns a Report with XLA's cost analysis beside.

    `fn` may already be jitted (anything with `.lower`). The args may be arrays or `jax.ShapeDtypeStruct`s.
    `compiler_options` are XLA debug options for this compile only (`{"xla_gpu_enable_triton_gemm": False}`).
    """
    import jax  # only here: parsing saved text needs no JAX

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    unfused = counterfactual(lowered.as_text(dialect="hlo"))
    text = compiled.as_text()
    try:
        cost = _normalize_cost(compiled.cost_analysis())
    except Exception:  # some backends do not implement it
        cost = None
    module = parse(text)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "__wrapped__", None), "__name__", "fn")
    return Report(module=module, kernels=list_kernels(module), xla_cost=cost, platform=jax.default_backend(),
                  title=f"{name} on {jax.devices()[0].device_kind}", unfused=unfused)
