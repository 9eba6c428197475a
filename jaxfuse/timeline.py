"""Where one call's time goes on each GPU, from a profiler trace: compute kernels, collectives, their overlap, idle.

    per_device = device_timeline(step, args, calls=3)   # GPU: jax.profiler traces of 3 calls, medians per device
    print(timeline_table(per_device))

CUPTI's per-kernel times (``jaxfuse.measure``) add up every kernel of every device and cannot tell a collective
that runs beside compute from one the compute waits for. A profiler trace keeps each kernel's start and end on
its device, so per device and per call:

  span        first kernel start to last kernel end (µs)
  compute     the union of the non-collective kernels' intervals (kernels on several streams counted once)
  collective  the union of the collective kernels' intervals (NCCL's kernels)
  overlapped  the time both run at once; exposed = collective − overlapped is the communication the step waits for
  idle        span − union of all kernels: launch gaps and waits on the host

``summarize`` does the arithmetic on (name, start ns, end ns) triples, so it runs without a GPU.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable, Sequence

__all__ = ["DeviceTime", "device_timeline", "is_collective", "summarize", "timeline_table", "trace_kernels"]

_COLLECTIVE_MARKS = ("nccl", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                     "allreduce", "allgather", "reducescatter", "alltoall", "sendrecv")


def is_collective(name: str) -> bool:
    """Whether a device kernel named ``name`` is communication (NCCL's kernels, XLA's collective thunks)."""
    lowered = name.lower()
    return any(mark in lowered for mark in _COLLECTIVE_MARKS)


@dataclasses.dataclass(frozen=True)
class DeviceTime:
    """One device's call, in µs (see the module docstring); ``kernels``/``collectives``: how many launched."""

    device: str
    span_us: float
    compute_us: float
    collective_us: float
    overlapped_us: float
    idle_us: float
    kernels: int
    collectives: int

    @property
    def exposed_collective_us(self) -> float:
        """Collective time with no compute kernel beside it."""
        return self.collective_us - self.overlapped_us

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "exposed_collective_us": self.exposed_collective_us}


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint intervals covering ``intervals`` ((start, end) pairs)."""
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: Sequence[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def _intersection(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> int:
    """Total length where two sorted disjoint interval lists overlap."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(device: str, kernels: Sequence[tuple[str, int, int]]) -> DeviceTime:
    """One device's ``DeviceTime`` from its kernels, (name, start ns, end ns) each. ValueError when there are none or
    one ends before it starts."""
    if not kernels:
        raise ValueError(f"kernels: {device} ran no kernel in the traced call")
    for name, start, end in kernels:
        if end < start:
            raise ValueError(f"kernels: {name!r} on {device} ends ({end} ns) before it starts ({start} ns)")
    compute = _union((s, e) for name, s, e in kernels if not is_collective(name))
    collective = _union((s, e) for name, s, e in kernels if is_collective(name))
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    busy = _length(_union([*compute, *collective]))
    n_collective = sum(is_collective(name) for name, _, _ in kernels)
    return DeviceTime(device=device, span_us=span / 1e3, compute_us=_length(compute) / 1e3,
                      collective_us=_length(collective) / 1e3, overlapped_us=_intersection(compute, collective) / 1e3,
                      idle_us=(span - busy) / 1e3, kernels=len(kernels) - n_collective, collectives=n_collective)


def trace_kernels(profile) -> dict[str, list[tuple[str, int, int]]]:
    """Device kernels of a ``jax.profiler.ProfileData``: {"/device:GPU:0": [(name, start ns, end ns), ...]}. Only
    the device planes' stream lines count (not the host's, nor a device plane's summary lines)."""
    per_device: dict[str, list[tuple[str, int, int]]] = {}
    for plane in profile.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            per_device.setdefault(plane.name, []).extend(
                (event.name, int(event.start_ns), int(event.end_ns)) for event in line.events)
    return {device: kernels for device, kernels in sorted(per_device.items()) if kernels}


def device_timeline(fn: Callable, args: tuple, *, calls: int = 3, warmup: int = 2) -> list[DeviceTime]:
    """Per device, the medians over ``calls`` traced calls of ``fn(*args)`` (jitted unless it is). Each call is
    traced on its own, after ``warmup`` untraced ones. RuntimeError when the trace holds no device kernel (CPU)."""
    import jax
    from jax import profiler

    if calls < 1:
        raise ValueError(f"calls: expected a positive int, got {calls!r}")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(jitted(*args))
    per_call: list[dict[str, DeviceTime]] = []
    for _ in range(calls):
        with tempfile.TemporaryDirectory() as directory:
            with profiler.trace(directory):
                jax.block_until_ready(jitted(*args))
            files = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
            if not files:
                raise RuntimeError(f"jax.profiler wrote no trace under {directory}")
            kernels = trace_kernels(profiler.ProfileData.from_file(files[0]))
        if not kernels:
            raise RuntimeError("the profiler trace holds no device kernels: a device timeline needs a GPU")
        per_call.append({device: summarize(device, ks) for device, ks in kernels.items()})
    devices = sorted(set().union(*per_call))

    def median(device: str, field: str) -> float:
        return statistics.median(getattr(call[device], field) for call in per_call if device in call)

    fields = [f.name for f in dataclasses.fields(DeviceTime) if f.name != "device"]
    return [DeviceTime(device=d, **{f: median(d, f) for f in fields}) for d in devices]


def timeline_table(per_device: Sequence[DeviceTime]) -> str:
    """A markdown table, one row per device, times in µs."""
    head = ("| device | span µs | compute µs | collective µs | overlapped µs | exposed collective µs | idle µs "
            "| kernels | collectives |")
    rows = [head, "|" + "---|" * 9]
    for t in per_device:
        rows.append(f"| {t.device} | {t.span_us:.1f} | {t.compute_us:.1f} | {t.collective_us:.1f} | "
                    f"{t.overlapped_us:.1f} | {t.exposed_collective_us:.1f} | {t.idle_us:.1f} | {t.kernels:.0f} | "
                    f"{t.collectives:.0f} |")
    return "\n".join(rows)
