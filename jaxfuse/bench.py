"""Timing harness: device-kernel time on GPU (CUPTI), wall time on CPU; benchmark records as data.

    timing = bench.time_kernels(jax.jit(f), [(x1, w1), (x2, w2)], iterations=50)
    timing.median_us, timing.per_kernel_us       # {kernel name: median µs}; names as the HLO names fusions

On GPU every kernel the call launches is timed by CUPTI and summed per iteration; the median over iterations is
reported. Host overhead (0.1-0.3 ms per call) is not in the numbers. Argument sets rotate from one iteration to
the next, so inputs that fit in L2 are not served from it (pass several sets when they would fit). On CPU the
timing is the wall clock of a blocked call, labelled `method="wall"`.

Each timed call is its own CUPTI window (subscribe, run, flush, unsubscribe). CUPTI stays attached to the process
between windows (jax's ``profiler.Cupti(finalize=False)``). Detaching it after every window, as this harness did
until 2026-11-30, cost about 10 ms of host time a window on the H200: one process made 9.5-11.4x fewer timed calls
in the same time, with medians 0.6-1.2% higher (``cupti_concurrency_detach_*-h200-047990e.json``).
``JAXFUSE_CUPTI_DETACH=each`` brings the old behaviour back, for benchmarks/scripts/cupti_concurrency.py to compare.
With ``JAXFUSE_CUPTI_LOCK`` naming a file, each window holds an exclusive lock on it (``fcntl.flock``), so processes
sharing one GPU time one call at a time: ``jaxfuse.gpu_run`` sets it for its pytest workers, where a worker now and
then aborted inside CUPTI's flush (``_cupti_get_timings``) and where timing tests measured each other's kernels.

`Record` is one measured row; `write_results` stores records as JSON with the device, jax version, git commit
and date, plus a Markdown table beside. `shape_arg("MxKxN")` / `shapes_arg(...)` are argparse types for the benchmark
scripts' sizes ("32768x4096x4096", comma-separated lists of them). `max_difference(pairs)` is the largest difference
between two programs' outputs and `worst(values)` the largest of several errors, each NaN when any is NaN.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

__all__ = ["Timing", "time_kernels", "time_interleaved", "Record", "device_tag", "environment", "write_results",
           "markdown_table", "max_difference", "shape_arg", "shapes_arg", "worst"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Median device time of one call (µs), per-kernel medians, and how it was measured."""

    median_us: float
    per_kernel_us: dict[str, float]
    samples_us: tuple[float, ...]
    method: str  # "cupti" (device kernels) or "wall"
    launches: tuple[tuple[str, float], ...] = ()  # (kernel name, median µs) in launch order of one call

    @property
    def spread(self) -> float:
        """(p90 - p10) / median of the samples: how noisy the measurement was."""
        s = sorted(self.samples_us)
        if len(s) < 3:
            return 0.0
        return (s[int(0.9 * (len(s) - 1))] - s[int(0.1 * (len(s) - 1))]) / self.median_us


def _cupti_ext():
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init, ext._cupti_get_timings  # noqa: B018 - both must exist
        return ext
    except (ImportError, AttributeError):
        return None


def _cupti_detach_each() -> bool:
    """Whether each CUPTI window detaches CUPTI from the process (``JAXFUSE_CUPTI_DETACH``: "never", the
    default, or "each"; module docstring)."""
    value = os.environ.get("JAXFUSE_CUPTI_DETACH", "never")
    if value not in ("never", "each"):
        raise ValueError(f"JAXFUSE_CUPTI_DETACH: expected 'never' or 'each', got {value!r}")
    return value == "each"


CUPTI_LOCK_ENV = "JAXFUSE_CUPTI_LOCK"


@contextlib.contextmanager
def _cupti_window_lock():
    """An exclusive lock on the file ``JAXFUSE_CUPTI_LOCK`` names, held for one CUPTI window (created if need be);
    without the variable, nothing."""
    path = os.environ.get(CUPTI_LOCK_ENV)
    if not path:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_counts(iterations: int, warmup: int) -> None:
    if iterations < 1 or warmup < 0:
        raise ValueError(f"iterations, warmup: need iterations >= 1 and warmup >= 0, got {iterations}, {warmup}")


def _is_jitted(fn) -> bool:
    """A jitted function, or one compiled ahead of time (``jax.jit(f).lower(...).compile()``): timed as it is."""
    import jax

    return hasattr(fn, "lower") or isinstance(fn, jax.stages.Compiled)


def time_kernels(fn: Callable, arg_sets: Sequence[tuple], *, iterations: int = 50, warmup: int = 2,
                 jit: bool = True, wall: bool = False) -> Timing:
    """Time `fn(*arg_sets[i % len(arg_sets)])` for `iterations` iterations; see the module docstring.

    fn is jitted unless it already is; ``jit=False`` calls it as it is, so plain jnp code runs eagerly, one
    dispatch (and on GPU about one kernel) per primitive: CUPTI then times all of those kernels. ``wall``: host wall
    time on a GPU too (a program on several devices: CUPTI would add up the kernels of every device, and those that
    overlap, such as collectives beside compute)."""
    import jax

    if not arg_sets:
        raise ValueError("arg_sets: need at least one tuple of arguments")
    _check_counts(iterations, warmup)
    cupti = not wall and jax.default_backend() == "gpu"
    if cupti:  # (checked before any call runs: a bad setting fails at once, not after the warmup's compiles)
        ext = _cupti_ext()
        if ext is None:
            raise RuntimeError("CUPTI timing needs jax's Mosaic GPU extension (jax[cuda12] or jax[cuda13])")
        detach = _cupti_detach_each()
    jitted = fn if (_is_jitted(fn) or not jit) else jax.jit(fn)
    for args in arg_sets:
        for _ in range(warmup):
            jax.block_until_ready(jitted(*args))
    if not cupti:
        samples = []
        for i in range(iterations):
            start = time.perf_counter()
            jax.block_until_ready(jitted(*arg_sets[i % len(arg_sets)]))
            samples.append((time.perf_counter() - start) * 1e6)
        return Timing(statistics.median(samples), {}, tuple(samples), "wall")

    per_iteration: list[list[tuple[str, float]]] = []
    for i in range(iterations):
        with _cupti_window_lock():
            ext._cupti_init()
            try:
                jax.block_until_ready(jitted(*arg_sets[i % len(arg_sets)]))
            finally:
                timings = ext._cupti_get_timings(detach)
        per_iteration.append([(name, ms * 1e3) for name, ms in (timings or [])])
    totals = [sum(us for _, us in it) for it in per_iteration]
    by_kernel: dict[str, list[float]] = {}
    for it in per_iteration:
        seen: dict[str, float] = {}
        for name, us in it:
            seen[name] = seen.get(name, 0.0) + us
        for name, us in seen.items():
            by_kernel.setdefault(name, []).append(us)
    per_kernel = {name: statistics.median(v) for name, v in by_kernel.items()}
    launches: tuple[tuple[str, float], ...] = ()
    first = [name for name, _ in per_iteration[0]]
    if all([name for name, _ in it] == first for it in per_iteration):
        launches = tuple((name, statistics.median(it[i][1] for it in per_iteration)) for i, name in enumerate(first))
    return Timing(statistics.median(totals), per_kernel, tuple(totals), "cupti", launches)


def time_interleaved(calls: Sequence[tuple[Callable, tuple | list[tuple]]], *, iterations: int = 30, warmup: int = 2,
                     budget_s: float | None = None, min_iterations: int = 5, wall: bool = False) -> list[Timing]:
    """One ``Timing`` per (jitted fn, args) of ``calls``, timed in turn: up to ``iterations`` rounds of one call each,
    so that a machine that slows down or speeds up while timing (other processes, clocks) shifts every fn alike and
    their medians stay comparable. A fn may be compiled ahead of time (``jax.jit(f).lower(...).compile()``: timed as
    it is). ``args``: one tuple of arguments, or a list of such tuples (input sets): the k-th timed call, counted
    over all calls and rounds, takes set k mod their number, so with n sets of inputs that fit in the L2 no call
    reads a set the n - 1 calls before it have not touched (calls sharing arrays: give them the same sets, in the
    same order). With ``budget_s``, no new round starts once that many seconds of rounds have passed and
    ``min_iterations`` rounds are done (slow calls: Pallas in interpret mode). Per-kernel times (GPU) are medians
    over the rounds. ``wall``: as ``time_kernels``'s."""
    import jax

    if not calls:
        raise ValueError("calls: need at least one (fn, args) pair")
    _check_counts(iterations, warmup)
    if not wall and jax.default_backend() == "gpu":
        _cupti_detach_each()  # a bad setting fails before the warmup, not at the first timed call
    calls = [(fn if _is_jitted(fn) else jax.jit(fn), args if isinstance(args, list) else [args]) for fn, args in calls]
    for i, (_, sets) in enumerate(calls):
        if not sets:
            raise ValueError(f"calls[{i}]: its list of input sets is empty; give one tuple of arguments or more")
    for fn, sets in calls:
        for args in sets:
            for _ in range(warmup):
                jax.block_until_ready(fn(*args))
    samples: list[list[float]] = [[] for _ in calls]
    per_kernel: list[dict[str, list[float]]] = [{} for _ in calls]
    methods = [""] * len(calls)
    start = time.perf_counter()
    turn = 0
    for round_ in range(iterations):
        if budget_s is not None and round_ >= min_iterations and time.perf_counter() - start > budget_s:
            break
        for i, (fn, sets) in enumerate(calls):
            t = time_kernels(fn, [sets[turn % len(sets)]], iterations=1, warmup=0, wall=wall)
            turn += 1
            samples[i].append(t.median_us)
            methods[i] = t.method
            for name, us in t.per_kernel_us.items():
                per_kernel[i].setdefault(name, []).append(us)
    return [Timing(statistics.median(s), {name: statistics.median(v) for name, v in k.items()}, tuple(s), m)
            for s, k, m in zip(samples, per_kernel, methods)]


@dataclasses.dataclass
class Record:
    """One measured benchmark row. Times in µs; ratios are this / other (lower is faster for time ratios)."""

    op: str
    shape: str
    dtype: str
    implementation: str
    mode: str  # "fwd" | "fwd+bwd" | ...
    time_us: float
    method: str
    flops: float | None = None
    bytes_moved: float | None = None
    floor_us: float | None = None
    tflops_per_s: float | None = None
    tbytes_per_s: float | None = None
    ratio_to_floor: float | None = None
    speedup_vs: dict[str, float] = dataclasses.field(default_factory=dict)  # baseline time / this time
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def finish(self) -> "Record":
        """Fill the derived rates and the ratio to the floor."""
        if self.flops:
            self.tflops_per_s = self.flops / (self.time_us * 1e-6) / 1e12
        if self.bytes_moved:
            self.tbytes_per_s = self.bytes_moved / (self.time_us * 1e-6) / 1e12
        if self.floor_us:
            self.ratio_to_floor = self.time_us / self.floor_us
        return self


def _git_commit() -> str:
    """Short HEAD commit, with "+dirty" when tracked files differ from it (so a result measured on uncommitted
    code, or on a copied tree whose .git lags behind, cannot pass for that commit); "unknown" without git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return "unknown"
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict[str, str]:
    """Device, jax version, commit and UTC date: what every result file records."""
    import jax

    env = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
           "commit": os.environ.get("JAXFUSE_COMMIT") or _git_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    try:
        import jaxlib
        env["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    return env


def device_tag(device: str) -> str:
    """The short name result files carry for a device kind: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA
    A100-SXM4-80GB' -> 'a100'; anything else lowercased with each run of other characters as '_' ('cpu')."""
    model = re.match(r"NVIDIA\s+([A-Z]+\d+)\b", device)
    if model:
        return model.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_") or "unknown"


def markdown_table(records: Sequence[Record]) -> str:
    """One row per record: op, shape, dtype, mode, implementation, µs, TFLOP/s, ×floor, speedups."""
    baselines = sorted({b for r in records for b in r.speedup_vs})
    header = ["op", "shape", "dtype", "mode", "implementation", "time µs", "TFLOP/s", "TB/s", "× floor"]
    header += [f"speedup vs {b}" for b in baselines]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    fmt = lambda v, p=1: "" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in records:
        cells = [r.op, r.shape, r.dtype, r.mode, r.implementation, fmt(r.time_us), fmt(r.tflops_per_s),
                 fmt(r.tbytes_per_s, 2), fmt(r.ratio_to_floor, 2)]
        cells += [fmt(r.speedup_vs.get(b), 2) for b in baselines]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_results(records: Sequence[Record], path: str, *, env: dict[str, str] | None = None) -> str:
    """Write `path` (JSON: environment + records) and `path` with .md (a table); returns the JSON path."""
    env = env or environment()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": env, "records": [dataclasses.asdict(r) for r in records]}, f, indent=1)
    md_path = os.path.splitext(path)[0] + ".md"
    methods = sorted({r.method for r in records if r.method != "failed"})  # (a skipped implementation: "failed")
    with open(md_path, "w") as f:
        f.write(f"Measured on {env['device']} with jax {env['jax']}, commit {env['commit']}, {env['date']} "
                f"({', '.join(methods) or 'no'} timing).\n\n")
        f.write(markdown_table(records) + "\n")
    return path


def worst(values, *, default: float = float("nan")) -> float:
    """The largest of ``values`` (floats: errors, differences), NaN when any is NaN, ``default`` when there are none.
    Python's ``max`` keeps a NaN only when it comes first (max(0.0, nan) is 0.0), so an output broken into NaN
    would otherwise read as the other outputs' error."""
    values = [float(v) for v in values]
    if any(v != v for v in values):
        return float("nan")
    return max(values, default=default)


def max_difference(pairs: Sequence[tuple[Any, Any]], *, relative: bool = False) -> float:
    """The largest |a − b| over (a, b) pairs of arrays of one shape each (in float32; ``relative``: each pair's over
    its max |b|, floored at 1e-30); NaN when any difference is NaN (``worst``), 0.0 for no pairs."""
    import numpy as np

    diffs = []
    for a, b in pairs:
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        diffs.append(diff / max(float(np.max(np.abs(b))), 1e-30) if relative and a.size else diff)
    return worst(diffs, default=0.0)


def shape_arg(names: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type`` for one size written like ``names`` ("MxKxN": three positive integers joined by "x"):
    the tuple of ints, or argparse's usage error naming what was seen and what is allowed."""
    count = len(names.split("x"))

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split("x")
        if len(parts) != count or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected {names} ({count} positive integers joined by 'x'), got "
                                             f"{text!r}")
        return tuple(int(p) for p in parts)

    return parse


def shapes_arg(names: str) -> Callable[[str], list[tuple[int, ...]]]:
    """``shape_arg`` for a comma-separated list of sizes ("32768x4096x4096,4096x4096x14336"), at least one."""
    one = shape_arg(names)

    def parse(text: str) -> list[tuple[int, ...]]:
        items = [t for t in text.split(",") if t]
        if not items:
            raise argparse.ArgumentTypeError(f"expected one or more {names} joined by ',', got {text!r}")
        return [one(t) for t in items]

    return parse
