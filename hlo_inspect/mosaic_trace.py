"""Where a Mosaic-GPU kernel's time goes, warpgroup by warpgroup: its on-device profiler trace read back.

    from pallas_kernels import mosaic_utils as mu
    with mu.profiling("traces/", ranges=48):          # kernels built here record their regions (mu.region;
                                                      # regions=("k_loop",): only those named)
        jax.block_until_ready(jax.jit(f)(*args))      # each call writes traces/<kernel>-<ns>-trace.json
    from hlo_inspect import mosaic_trace
    trace = mosaic_trace.load("traces/mosaic_matmul-...-trace.json")
    print(mosaic_trace.report(trace))                 # regions, spans, the tail, gaps: cycles
    python -m hlo_inspect.mosaic_trace TRACE.json [--clock-ghz 1.58] [--json out.json]

The trace is the Perfetto JSON that jax's Mosaic-GPU profiler writes (``CompilerParams(profile_space=...,
profile_dir=...)``): for every warpgroup of every block (a *trace*), lane 0's "B" and "E" events at the begin and
end of each ``jax.named_scope`` region of the kernel body that warpgroup ran (``mosaic_utils.region`` in ours).
``pid`` is 1 + the SM, ``tid`` 1 + the trace's index (block · warpgroups per block + warpgroup). An event's ``ts`` (µs) is the warpgroup's start
on the global timer (ns) plus the SM clock cycles since its first event, less the profiler's own cost per event:
the profiler mixes the two units. So within a trace, durations are SM cycles; across traces only the starts compare,
in ns. ``--clock-ghz`` (the clock the kernel ran at, e.g. Nsight Compute's "SM Frequency") turns cycles into µs.

What ``summarize`` reports, over the traces that ran a region of the kernel's own (every warpgroup runs the
profiler's "Init" region, the kernel's set-up; a warpgroup with no named region of its own, such as the GEMM's memory
warpgroup, is only counted, as ``without_regions``):
  regions   per region name: occurrences per trace, median and mean cycles per occurrence, the first occurrence's
            median against the later ones' (a pipeline's fill shows there), the share of all traces' spans it takes
  spans     per trace, its first begin to its last end (cycles): the min, median and max over traces
  tail      1 - mean span / max span: the share of the longest trace's span the average trace has ended before it
            (the traces started together; the start skew says how nearly): a part-empty last round shows here
  gaps      cycles inside a trace's span with no region open (between one region's end and the next's begin)
  skew      latest minus earliest trace start (ns)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import statistics
import sys

__all__ = ["INIT", "Region", "Trace", "load", "parse", "report", "summarize"]

INIT = "Init"  # the region the profiler itself opens around a kernel's set-up, in every warpgroup


@dataclasses.dataclass(frozen=True)
class Region:
    """One region a warpgroup ran: its name, begin and end (SM cycles since the trace's first event), depth (0: not
    inside another region of the same trace)."""

    name: str
    begin: int
    end: int
    depth: int = 0

    @property
    def cycles(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class Trace:
    """One warpgroup of one block: tid, SM, start (global timer, ns) and its regions in order of their begin."""

    tid: int
    sm: int
    start_ns: int
    regions: tuple[Region, ...]

    @property
    def span(self) -> int:
        """Cycles from the first region's begin to the last end."""
        return max(r.end for r in self.regions) - min(r.begin for r in self.regions) if self.regions else 0


def parse(document: dict) -> list[Trace]:
    """The traces of a profiler trace document (the parsed JSON), ordered by tid. ValueError names what is not a
    Mosaic-GPU profiler trace: no ``traceEvents`` list, an event without name / ph / ts / pid / tid, an "E" without
    its "B"."""
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list):
        raise ValueError("trace: expected a JSON object with a 'traceEvents' list (Mosaic-GPU profiler output), got "
                         f"{type(document).__name__}" + (f" with keys {sorted(document)[:5]}"
                                                         if isinstance(document, dict) else ""))
    by_tid: dict[int, list[dict]] = collections.defaultdict(list)
    for i, event in enumerate(events):
        missing = [key for key in ("name", "ph", "ts", "pid", "tid") if not isinstance(event, dict) or key not in event]
        if missing:
            raise ValueError(f"trace: event {i} lacks {', '.join(missing)} (got {event!r:.80})")
        if event["ph"] not in ("B", "E"):
            raise ValueError(f"trace: event {i} has ph={event['ph']!r}; the profiler writes only 'B' and 'E'")
        by_tid[int(event["tid"])].append(event)
    traces = []
    for tid in sorted(by_tid):
        stream = by_tid[tid]  # the profiler writes each trace's events in order
        start_ns = round(float(stream[0]["ts"]) * 1e3)  # the first event's cycle count is 0
        open_regions: list[tuple[str, int]] = []
        regions = []
        for event in stream:
            cycles = round(float(event["ts"]) * 1e3) - start_ns
            if event["ph"] == "B":
                open_regions.append((event["name"], cycles))
                continue
            if not open_regions or open_regions[-1][0] != event["name"]:
                raise ValueError(f"trace: tid {tid} ends region {event['name']!r} at cycle {cycles} without its "
                                 f"begin (open: {[name for name, _ in open_regions]})")
            name, begin = open_regions.pop()
            regions.append(Region(name, begin, cycles, depth=len(open_regions)))
        if open_regions:
            raise ValueError(f"trace: tid {tid} never ends {[name for name, _ in open_regions]}")
        regions.sort(key=lambda r: (r.begin, r.depth))
        traces.append(Trace(tid=tid, sm=int(stream[0]["pid"]) - 1, start_ns=start_ns, regions=tuple(regions)))
    return traces


def load(path: str) -> list[Trace]:
    """The traces of a profiler trace file (``parse``; gzip-compressed where the name ends in ".gz"); OSError /
    ValueError name the file."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        try:
            document = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace: {path!r} is not JSON ({e.msg} at line {e.lineno})") from None
    try:
        return parse(document)
    except ValueError as e:
        raise ValueError(f"{path!r}: {e}") from None


def _gaps(trace: Trace) -> int:
    """Cycles inside the trace's span that no top-level region covers."""
    top = [r for r in trace.regions if r.depth == 0]
    return sum(max(0, nxt.begin - cur.end) for cur, nxt in zip(top, top[1:]))


def summarize(traces: list[Trace], names: tuple[str, ...] | None = None) -> dict:
    """The summary of the module docstring over the traces that ran any region (of ``names``, where given: e.g.
    only the MMA warpgroups' regions), as a JSON-ready dict. ValueError where no trace ran one."""
    picked = []
    for t in traces:
        regions = tuple(r for r in t.regions if names is None or r.name in names)
        if any(r.name != INIT for r in regions):
            picked.append(dataclasses.replace(t, regions=regions))
    if not picked:
        raise ValueError(f"trace: no warpgroup ran a region{'' if names is None else f' named one of {names}'} "
                         f"besides the profiler's {INIT!r}")
    spans = [t.span for t in picked]
    total_span = sum(spans)
    regions = {}
    for name in dict.fromkeys(r.name for t in picked for r in t.regions):
        per_trace = [[r.cycles for r in t.regions if r.name == name] for t in picked]
        every = [c for cs in per_trace for c in cs]
        firsts = [cs[0] for cs in per_trace if cs]
        laters = [c for cs in per_trace for c in cs[1:]]
        regions[name] = dict(
            occurrences_per_trace=statistics.mean(len(cs) for cs in per_trace),
            median=statistics.median(every), mean=statistics.mean(every),
            first_median=statistics.median(firsts), later_median=statistics.median(laters) if laters else None,
            share_of_spans=sum(every) / total_span if total_span else 0.0)
    starts = [t.start_ns for t in picked]
    if max(starts) - min(starts) >= 1 << 31:  # the global timer's lower 32 bits wrapped between two starts
        starts = [t + (1 << 32) if t < 1 << 31 else t for t in starts]
    return dict(
        traces=len(picked), sms=len({t.sm for t in picked}), without_regions=len(traces) - len(picked),
        spans=dict(min=min(spans), median=statistics.median(spans), max=max(spans)),
        tail=1.0 - statistics.mean(spans) / max(spans) if max(spans) else 0.0,
        gaps=dict(median=statistics.median(_gaps(t) for t in picked), max=max(_gaps(t) for t in picked)),
        start_skew_ns=max(starts) - min(starts),
        regions=regions)


def report(traces: list[Trace], names: tuple[str, ...] | None = None, clock_ghz: float | None = None) -> str:
    """``summarize`` as text; cycles also in µs where ``clock_ghz`` is given."""
    s = summarize(traces, names)

    def cyc(c):
        if c is None:
            return "-"
        return f"{c:,.0f}" + (f" ({c / clock_ghz / 1e3:.2f} µs)" if clock_ghz else "")

    lines = [f"{s['traces']} traces on {s['sms']} SMs ({s['without_regions']} without regions); start skew "
             f"{s['start_skew_ns']} ns",
             f"spans (cycles): min {cyc(s['spans']['min'])}, median {cyc(s['spans']['median'])}, "
             f"max {cyc(s['spans']['max'])}; tail {s['tail']:.3f}",
             f"gaps between regions per trace: median {cyc(s['gaps']['median'])}, max {cyc(s['gaps']['max'])}",
             "region: per trace, median cycles (first / later), share of spans"]
    for name, r in s["regions"].items():
        lines.append(f"  {name}: {r['occurrences_per_trace']:.2f}, {cyc(r['median'])} "
                     f"({cyc(r['first_median'])} / {cyc(r['later_median'])}), {r['share_of_spans']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlo_inspect.mosaic_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", nargs="+", help="Mosaic-GPU profiler trace files (<kernel>-<ns>-trace.json, or "
                                                 "gzip-compressed: .json.gz)")
    parser.add_argument("--regions", default="", help="comma-separated region names to keep (default: all)")
    parser.add_argument("--clock-ghz", type=float, default=None, help="the SM clock the kernel ran at: cycles as µs")
    parser.add_argument("--json", help="also write each trace file's summary to this JSON file")
    args = parser.parse_args(argv)
    if args.clock_ghz is not None and not args.clock_ghz > 0:
        parser.error(f"--clock-ghz: must be positive, got {args.clock_ghz}")
    names = tuple(n for n in args.regions.split(",") if n) or None
    summaries = {}
    for path in args.trace:
        try:
            traces = load(path)
            print(f"{path}:\n{report(traces, names, args.clock_ghz)}")
            summaries[path] = summarize(traces, names)
        except OSError as e:
            print(f"trace: cannot read {path!r}: {e.strerror}", file=sys.stderr)
            return 2
        except ValueError as e:
            print(str(e), file=sys.stderr)
            return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(clock_ghz=args.clock_ghz, regions=names, summaries=summaries), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
