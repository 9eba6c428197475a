"""One runner for every op spec: each implementation × shape × variant × mode compiled, checked against the float32
reference, timed, and recorded.

    from jaxfuse import suites
    records = suites.run("attention", ["main"], iterations=20)     # or run(suites.get("attention"), ...)
    print(suites.summary_table(records))

Per (shape, variant) the runner draws ``input_sets`` random input sets, computes the reference outputs once (the
spec's ``reference_impl`` in float32, on the first ``check_rows`` rows when set), then per implementation and mode
compiles one jitted program, reads its memory analysis, compares its outputs with the reference and times it
(``bench.time_kernels``: CUPTI device time on GPU, wall time on CPU). Every record's ``extra`` carries
``shape_name``, the variant, ``note``, ``input_sets``, ``temp_bytes`` / ``temp_mib`` / ``peak_bytes``, ``rel_error``
(the largest over the outputs, NaN when any is) and ``rel_errors`` (per output), ``tolerance`` (the spec's rule here),
``per_kernel_us`` (the 8 costliest kernels, µs), ``spread``, ``tokens_per_s`` for a spec that counts tokens, and
for Pallas implementations the ``config`` that ran and its ``config_source``. ``speedup_vs`` holds baseline time / this time for the spec's baselines. A failing or
skipped implementation is a record with NaN time, ``method="failed"`` and ``extra["error"]``; the others still run.
"""

from __future__ import annotations

import functools
import gc
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from jaxfuse import bench, costmodel
from jaxfuse.suites.spec import OpSpec

__all__ = ["check_shape_names", "first_rows", "input_sets", "pallas_config", "reference_outputs", "run",
           "summary_table"]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def unknown_impls_message(spec: OpSpec, unknown: Sequence[str]) -> str:
    """The error for implementation names ``spec`` does not have, naming those it has; "pallas" (the kernel sets'
    alias for the backend "auto" picks) gets the backends to name instead, since a record names the one that ran."""
    from jaxfuse import kernels

    known = list(spec.implementations())
    hint = ""
    if "pallas" in unknown:
        named = [name for name in known if name in kernels.PALLAS_BACKENDS]
        hint = f" ('pallas' is the kernel sets' automatic choice; a run times each backend by name: {named})"
    return f"impls: unknown {list(unknown)}; {spec.name} has {known}{hint}"


def check_shape_names(spec: OpSpec, names: Sequence[str] | None) -> list[str]:
    """The shapes to run (default: the spec's GPU shapes on a GPU, its CPU shapes elsewhere): named ones or custom
    ones (``OpSpec.shape``). ValueError for a name that is neither, and, off the GPU, for a shape the CPU cannot run
    in interpret mode in reasonable time (a named GPU shape, or a custom one larger than its CPU shapes)."""
    import jax

    on_gpu = jax.default_backend() == "gpu"
    names = list((spec.default_shapes if on_gpu else spec.cpu_shapes) if not names else names)
    for name in names:
        spec.shape(name)  # (ValueError for a name that is neither a shape of the spec nor a custom one)
    cpu_sized = {k: max(spec.shapes[n][k] for n in spec.cpu_shapes) for k in spec.custom_dims()}
    too_big = [n for n in names if not on_gpu and n not in spec.cpu_shapes
               and (n in spec.shapes or any(spec.shape(n)[k] > v for k, v in cpu_sized.items()))]
    if too_big:
        custom = f", or custom ones up to {'x'.join(map(str, cpu_sized.values()))}" if cpu_sized else ""
        raise ValueError(f"shapes: {too_big} are GPU-sized; on {jax.default_backend()} (interpret mode) {spec.name} "
                         f"runs {list(spec.cpu_shapes)}{custom}")
    return names


def _float32(x):
    import jax.numpy as jnp

    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def first_rows(tree, rows: int | None):
    """The first ``rows`` rows (axis 0) of every array leaf, or the tree as it is."""
    import jax

    return tree if rows is None else jax.tree.map(lambda x: x[:rows] if getattr(x, "ndim", 0) else x, tree)


def reference_outputs(spec: OpSpec, inputs: tuple, mode: str, shape, variant) -> list:
    """The float32 reference's outputs (flattened) for one input set, on the spec's ``check_rows``."""
    import jax

    fn = spec.implementations()[spec.reference_impl]
    program = jax.jit(spec.program(fn, mode, shape, variant))
    inputs = first_rows(tuple(map(_float32, inputs)), spec.check_rows)
    return jax.tree.leaves(jax.block_until_ready(program(*inputs)))


def _rel_error(got, want) -> float:
    import jax.numpy as jnp

    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def _delete(tree) -> None:
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "delete"):
            try:
                leaf.delete()
            except Exception:  # noqa: BLE001 -- already deleted or donated
                pass


def pallas_config(spec: OpSpec, impl: str, inputs: tuple, variant, cache_path=None) -> tuple[dict, dict]:
    """(keyword options to call a Pallas implementation with, record fields): with ``cache_path``, the tuned entry
    for this device, backend and shape there (passed as block_sizes); else the kernel's own default. Empty for an
    implementation that is not a Pallas backend."""
    import pallas_kernels
    from jaxfuse import kernels
    from pallas_kernels import tuning

    backend = kernels.PALLAS_BACKENDS.get(impl)
    if spec.op is None or backend is None:
        return {}, {}
    package = pallas_kernels.OPS[spec.op]
    args = inputs[:spec.num_args]
    options, source = {}, "default"
    if cache_path is not None:
        params = tuning.lookup(spec.op, package.tuning_key(*args, **variant), backend=backend, path=cache_path)
        if params is not None:
            options, source = {"block_sizes": params}, f"tuned ({cache_path})"
    plan = package.plan(*args, backend=backend, **variant, **options)
    return options, {"backend": plan.backend, "config": plan.config.to_dict(), "config_source": source}


def _measure(spec: OpSpec, fn: Callable, mode: str, sets: list, ref: list | None, shape, variant,
             iterations: int) -> dict:
    """Compiles, checks and times one implementation in one mode; the pieces of its record. Raises on failure."""
    import jax

    from pallas_kernels import triton_utils

    program = jax.jit(spec.program(fn, mode, shape, variant))
    arg_sets = [s[:spec.num_args] for s in sets] if mode == "fwd" else list(sets)
    out: dict = {}
    with triton_utils.quiet_triton_deprecation():
        compiled = program.lower(*arg_sets[0]).compile()
        try:
            memory = compiled.memory_analysis()
            temp = int(memory.temp_size_in_bytes)
            peak = int(memory.argument_size_in_bytes + memory.output_size_in_bytes + temp
                       - memory.alias_size_in_bytes)
            out.update(temp_bytes=temp, temp_mib=round(temp / 2**20, 1), peak_bytes=peak)
        except Exception as e:  # noqa: BLE001 -- some backends have no memory analysis: not a failure
            out["memory_error"] = f"{type(e).__name__}: {e}"[:300]
        del compiled
        if ref is not None or spec.summarize is not None:
            result = jax.block_until_ready(program(*arg_sets[0]))  # same executable: jit caches the compilation
            if spec.summarize is not None:
                out.update(spec.summarize(result))
            if ref is not None:
                got = jax.tree.leaves(first_rows(result, spec.check_rows))
                errors = {name: _rel_error(g, w) for name, g, w in zip(spec.output_names[mode], got, ref)}
                out.update(rel_errors=errors, rel_error=bench.worst(errors.values()))  # (NaN when any is)
            _delete(result)
        timing = bench.time_kernels(program, arg_sets, iterations=iterations, wall=spec.wall_time)
    out.update(timing=timing)
    return out


def _failed(spec, label, impl, mode, cost, extra, error) -> bench.Record:
    flops, bytes_moved, floor_us = cost
    return bench.Record(op=spec.name, shape=label, dtype=spec.dtype, implementation=impl, mode=mode,
                        time_us=math.nan, method="failed", flops=flops, bytes_moved=bytes_moved, floor_us=floor_us,
                        extra=dict(extra, error=str(error)[:2000])).finish()


def _costs(spec, shape, variant, dev) -> dict:
    """mode -> (FLOPs, bytes, floor µs); the floor None without a device spec (``costmodel.detect``)."""
    out = {}
    for mode in spec.modes:
        flops, bytes_moved = spec.cost(shape, variant, mode)
        out[mode] = (flops, bytes_moved, None if dev is None else dev.roofline_us(bytes_moved, flops, launches=0))
    return out


def input_sets(spec: OpSpec, shape, dev) -> list[tuple]:
    """The input sets rotated while timing one shape (seeds 0, 1, ...): ``spec.input_sets`` of them, else 3 when
    one set fits in the device's L2 (so no timed call finds its inputs left there by the call before) or the
    device has no spec (``costmodel.detect``: its L2 unknown), else 1."""
    first = spec.make_inputs(shape, 0)
    count = spec.input_sets
    if count is None:
        nbytes = sum(getattr(x, "nbytes", 0) for x in first)
        count = 3 if dev is None or (dev.l2_bytes and nbytes < dev.l2_bytes) else 1
    return [first] + [spec.make_inputs(shape, seed) for seed in range(1, count)]


def _run_case(spec: OpSpec, name: str, variant, impls: list[str], *, iterations: int, dev, cache_path, check: bool,
              progress) -> list[bench.Record]:
    """All implementations × modes at one shape and variant."""
    import jax

    from jaxfuse import kernels

    shape = spec.shape(name)
    label = spec.label(shape, variant)
    costs = _costs(spec, shape, variant, dev)
    sets = input_sets(spec, shape, dev)
    base = {"shape_name": name, **variant, "note": shape.get("note", ""), "input_sets": len(sets),
            "tolerance": spec.tolerance(shape)}
    refs: dict = {}
    if not check:
        base["rel_error_missing"] = "not checked (check=False)"
    elif spec.reference_impl is not None:
        for mode in spec.modes:
            try:
                refs[mode] = reference_outputs(spec, sets[0], mode, shape, variant)
            except Exception as e:  # noqa: BLE001 -- timings still run; rel_error is then missing, with the reason
                base["rel_error_missing"] = f"float32 reference failed: {type(e).__name__}: {e}"[:500]
                progress(f"  [{label}] {base['rel_error_missing']}")
    fns = spec.implementations()
    records: list[bench.Record] = []
    for impl in impls:
        extra = dict(base)
        skip = spec.skip_reason(impl, shape) or (kernels.unavailable_reason(spec.site, impl) if spec.site else None)
        fn = fns[impl]
        if skip is None:
            try:
                options, fields = pallas_config(spec, impl, sets[0], variant, cache_path)
                extra.update(fields)
                fn = functools.partial(fn, **options) if options else fn
            except Exception as e:  # noqa: BLE001
                skip = f"{type(e).__name__}: {e}"
        for mode in spec.modes:
            if skip is not None:
                progress(f"  [{label}] {impl:18s} {mode:8s} skipped: {skip}")
                records.append(_failed(spec, label, impl, mode, costs[mode], extra, skip))
                continue
            try:
                m = _measure(spec, fn, mode, sets, refs.get(mode), shape, variant, iterations)
            except Exception as e:  # noqa: BLE001 -- one failing implementation must not stop the others
                error = f"{type(e).__name__}: {e}"
                progress(f"  [{label}] {impl:18s} {mode:8s} FAILED: {error[:300]}\n{traceback.format_exc(limit=2)}")
                records.append(_failed(spec, label, impl, mode, costs[mode], extra, error))
                gc.collect()
                continue
            timing = m.pop("timing")
            flops, bytes_moved, floor_us = costs[mode]
            r = bench.Record(
                op=spec.name, shape=label, dtype=spec.dtype, implementation=impl, mode=mode, time_us=timing.median_us,
                method=timing.method, flops=flops, bytes_moved=bytes_moved, floor_us=floor_us,
                extra=dict(extra, **m, spread=round(timing.spread, 3), per_kernel_us={
                    k: round(v, 2) for k, v in sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])[:8]}),
            ).finish()
            if spec.tokens is not None:
                r.extra["tokens_per_s"] = spec.tokens(shape) / (r.time_us * 1e-6)
            records.append(r)
            err = f"{m['rel_error']:.1e}" if "rel_error" in m else "n/a"
            temp = f"{m['temp_mib']:.1f} MiB" if "temp_mib" in m else "?"
            progress(f"  [{label}] {impl:18s} {mode:8s} {r.time_us:10.1f} µs {r.tflops_per_s or 0:7.1f} TFLOP/s  "
                     f"×floor {r.ratio_to_floor or 0:5.2f}  rel_err {err}  temp {temp}")
    for mode in spec.modes:  # baseline time / this time (< 1: slower than the baseline), measured in this run
        base_times = {r.implementation: r.time_us for r in records if r.mode == mode and r.method != "failed"}
        for r in records:
            if r.mode == mode and r.method != "failed":
                r.speedup_vs.update({b: base_times[b] / r.time_us for b in spec.baselines
                                     if b in base_times and b != r.implementation})
    _delete((sets, refs))
    jax.clear_caches()
    gc.collect()
    return records


def run(spec: OpSpec | str, shape_names: Sequence[str] | None = None, *, impls: Sequence[str] | None = None,
        iterations: int = 20, cache_path=None, deadline: float | None = None, check: bool = True,
        progress: Callable[[str], None] = _log) -> list[bench.Record]:
    """Times every implementation of ``spec`` at each named shape and variant, in every mode; one record each.

    Args:
      spec: an OpSpec, or its name (``jaxfuse.suites.get``).
      shape_names: names in ``spec.shapes`` (default: its GPU shapes on a GPU, its CPU shapes elsewhere; GPU-sized
        shapes off the GPU are a ValueError).
      impls: implementation names (default ``spec.default_implementations()``; opt-in ones such as "xla_f32" too).
      iterations: timed iterations per measurement (after 2 warm-up calls per input set).
      cache_path: a tuning cache (``pallas_kernels.tuning`` format) whose entries for this device replace the
        Pallas kernels' defaults (``extra["config_source"]`` says which ran).
      deadline: a ``time.time()`` value; (shape, variant) pairs not started by then are recorded as skipped.
      check: compare every output with the spec's float32 reference; False skips the reference (records then
        have no ``rel_error``, and ``rel_error_missing`` says so): its float32 GEMMs take 20-40 s to autotune per
        LM-head shape on an H100, more than the timings themselves.
    """
    import jax

    from jaxfuse import suites

    spec = suites.get(spec) if isinstance(spec, str) else spec
    names = check_shape_names(spec, shape_names)
    known = spec.implementations()
    impls = list(spec.default_implementations() if impls is None else impls)
    unknown = [i for i in impls if i not in known]
    if unknown:
        raise ValueError(unknown_impls_message(spec, unknown))
    dev = costmodel.detect()
    records: list[bench.Record] = []
    for name in names:
        for variant in spec.variants:
            label = spec.label(spec.shape(name), variant)
            if deadline is not None and time.time() > deadline:
                progress(f"{spec.name} {name} [{label}]: skipped, past the time budget")
                costs = _costs(spec, spec.shape(name), variant, dev)
                records += [_failed(spec, label, impl, mode, costs[mode], {"shape_name": name, **variant},
                                    "skipped: past the time budget") for impl in impls for mode in spec.modes]
                continue
            progress(f"{spec.name} {name} [{label}] ({spec.shape(name).get('note', '')})")
            start = time.time()
            try:
                records += _run_case(spec, name, variant, impls, iterations=iterations, dev=dev,
                                     cache_path=cache_path, check=check, progress=progress)
            except Exception as e:  # noqa: BLE001 -- e.g. out of memory making inputs; the next shape still runs
                error = f"{type(e).__name__}: {e}"
                progress(f"{spec.name} {name} [{label}] FAILED: {error[:500]}\n{traceback.format_exc(limit=3)}")
                costs = _costs(spec, spec.shape(name), variant, dev)
                records += [_failed(spec, label, impl, mode, costs[mode], {"shape_name": name, **variant}, error)
                            for impl in impls for mode in spec.modes]
                jax.clear_caches()
                gc.collect()
            progress(f"{spec.name} {name} [{label}] took {time.time() - start:.1f} s")
    return records


def _temp_percent(record, baseline) -> float | None:
    """100 · temporary bytes of ``record`` / those of ``baseline`` (None when either is missing, or the baseline
    holds under 1 MiB: cuDNN's forward holds 512 bytes, and 1 MiB of ours would print as 204850 %)."""
    ours = record.extra.get("temp_bytes") if record else None
    theirs = baseline.extra.get("temp_bytes") if baseline else None
    return None if ours is None or not theirs or theirs < 2**20 else 100.0 * ours / theirs


def summary_table(records: Sequence[bench.Record]) -> str:
    """One row per (shape, mode): µs of each implementation, each Pallas backend's speedups over the baselines
    measured in the same run, its largest relative error, its temporary memory and that memory as a percentage of
    each baseline's."""
    impls = list(dict.fromkeys(r.implementation for r in records))
    pallas = [i for i in impls if i.startswith("pallas_")]
    baselines = sorted({b for r in records for b in r.speedup_vs})
    header = ["shape", "mode"] + [f"{i} µs" for i in impls]
    for p in pallas:
        header += [f"{p} vs {b}" for b in baselines if b != p] + [f"{p} rel err", f"{p} temp MiB"]
        header += [f"{p} temp % {b}" for b in baselines if b != p]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    fmt = lambda v, spec=".1f": "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)  # noqa: E731
    by_key: dict = {}
    for r in records:
        by_key.setdefault((r.shape, r.mode), {})[r.implementation] = r
    for (shape, mode), got in by_key.items():
        cells = [shape, mode] + [fmt(got[i].time_us) if i in got else "" for i in impls]
        for p in pallas:
            r = got.get(p)
            cells += [fmt(r.speedup_vs.get(b) if r else None, ".2f") for b in baselines if b != p]
            cells += [fmt(r.extra.get("rel_error") if r else None, ".1e"), fmt(r.extra.get("temp_mib") if r else None)]
            cells += [fmt(_temp_percent(r, got.get(b)), ".2f") for b in baselines if b != p]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
