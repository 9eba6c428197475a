"""The block-size sweep behind ``jaxfuse bench --op NAME --tune``: every candidate is checked against the float32
reference before it is timed, and the fastest correct config per device, backend and shape goes into the tuning
cache.

    from jaxfuse import suites
    rows = suites.tune("attention", ["main"], cache_path="out/tuned_configs.json")   # on a GPU
    print(suites.sweep.sweep_table(rows))

Per (shape, variant, Pallas backend): the candidates come from the op package (``pallas_kernels.OPS[op]
.sweep_candidates``: forward ones vary only the backend's FORWARD_FIELDS, backward ones the rest). A coordinate
pass: forward candidates are timed on the forward alone, then backward candidates, with the best forward's fields,
on forward + backward. A candidate whose outputs differ from the reference's by more than ``tolerance_factor`` times
the spec's tolerance at that shape (or are not finite) is REJECTED: never timed, never stored. The time budget
(``deadline``) is shared between the (shape, variant, backend) triples; a pass stops starting candidates when its
share is spent.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Sequence

from jaxfuse import bench, costmodel
from jaxfuse.suites.runner import check_shape_names, first_rows, input_sets, reference_outputs
from jaxfuse.suites.spec import OpSpec

__all__ = ["TOLERANCE_FACTOR", "sweep_table", "tune"]

# Candidates are accepted within this multiple of the spec's tolerance (bf16: 2e-2, as the GPU sweeps always did):
# the tolerance is what a test asserts at test sizes; tuning shapes reduce over far more terms.
TOLERANCE_FACTOR = 2.0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _check(program, mode_sets: list, refs: list, names: Sequence[str], rows: int | None) -> tuple[float, str]:
    """The worst relative error of the program's outputs over the input sets, and the output it came from."""
    import jax
    import jax.numpy as jnp

    worst, worst_name = 0.0, names[0]
    for args, want in zip(mode_sets, refs):
        got = jax.tree.leaves(first_rows(program(*args), rows))
        for name, g, w in zip(names, got, want):
            g, w = jnp.asarray(g, jnp.float32), jnp.asarray(w, jnp.float32)
            err = float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))
            if not err <= worst:  # a NaN error sticks
                worst, worst_name = err, name
    return worst, worst_name


def tune(spec: OpSpec | str, shape_names: Sequence[str] | None = None, *, backends: Sequence[str] | None = None,
         iterations: int = 10, cache_path=None, deadline: float | None = None, limit: int | None = None,
         tolerance_factor: float = TOLERANCE_FACTOR, progress: Callable[[str], None] = _log) -> list[dict]:
    """Sweeps the op's Pallas kernels at each shape (default: ``spec.tune_shapes`` on a GPU, its CPU shapes
    elsewhere) and variant, stores the best correct config per backend in ``cache_path`` (default: the package's
    tuned_configs.json) and returns one row per candidate: shape, variant, backend, mode, params, status ("ok",
    "rejected", "failed"), time_us, rel_error, error; and one "skipped" row (mode "-") where a backend cannot run
    the shape. ``limit`` caps the candidates per pass (for smoke runs)."""
    import jax

    import pallas_kernels
    from jaxfuse import kernels, suites
    from pallas_kernels import triton_utils, tuning

    spec = suites.get(spec) if isinstance(spec, str) else spec
    if spec.op is None:
        raise ValueError(f"op: {spec.name} has no Pallas kernels to tune")
    on_gpu = jax.default_backend() == "gpu"
    names = check_shape_names(spec, shape_names or (spec.tune_shapes if on_gpu else spec.cpu_shapes))
    package = pallas_kernels.OPS[spec.op]
    backends = [b for b in (backends or package.BACKENDS.names)
                if kernels.unavailable_reason(spec.site, f"pallas_{b}") is None]
    cache_path = tuning.DEFAULT_CACHE_PATH if cache_path is None else cache_path
    triples = [(n, v, b) for n in names for v in spec.variants for b in backends]
    dev = costmodel.detect()
    rows: list[dict] = []
    for index, (name, variant, backend) in enumerate(triples):
        shape = spec.shape(name)
        remaining = (deadline - time.time()) if deadline is not None else math.inf
        if remaining < 10:
            progress(f"sweep {spec.name} {name} {variant} {backend}: out of time")
            continue
        share_end = time.time() + remaining / (len(triples) - index)
        forward_end = time.time() + 0.4 * remaining / (len(triples) - index)
        sets = input_sets(spec, shape, dev)  # rotated as the suite rotates them
        args = sets[0][:spec.num_args]
        label = f"{spec.name} {name} {dict(variant) or ''} {backend}"
        try:
            forward, backward = package.sweep_candidates(*args, backend=backend, **variant)
        except ValueError as e:  # the backend cannot run this shape (e.g. Mosaic at decode sizes): nothing to tune
            progress(f"sweep {label}: skipped: {e}")
            rows.append({"shape": name, "variant": dict(variant), "backend": backend, "mode": "-", "params": {},
                         "status": "skipped", "error": str(e)[:500]})
            continue
        refs = {mode: [reference_outputs(spec, s, mode, shape, variant) for s in sets] for mode in spec.modes}
        forward_fields = package.BACKENDS.module(backend).FORWARD_FIELDS
        impl = kernels.REGISTRIES[spec.site][f"pallas_{backend}"]
        limit_ = limit or max(len(forward), len(backward))
        tol = tolerance_factor * spec.tolerance(shape)
        progress(f"sweep {label}: {min(len(forward), limit_)} forward, {min(len(backward), limit_)} backward "
                 f"candidates, accepted within relative error {tol:.0e}")

        def evaluate(params: dict, mode: str) -> dict:
            row = {"shape": name, "variant": dict(variant), "backend": backend, "mode": mode, "params": params}
            mode_sets = [s[:spec.num_args] for s in sets] if mode == "fwd" else sets
            try:
                program = jax.jit(spec.program(functools.partial(impl, block_sizes=params), mode, shape, variant))
                with triton_utils.quiet_triton_deprecation():
                    err, err_name = _check(program, mode_sets, refs[mode], spec.output_names[mode], spec.check_rows)
                    row["rel_error"] = err
                    if not err <= tol:  # also rejects NaN
                        row.update(status="rejected", error=f"relative error {err:.2e} in {err_name} > {tol:.0e}")
                    else:
                        timing = bench.time_kernels(program, mode_sets, iterations=iterations, warmup=1)
                        row.update(status="ok", time_us=timing.median_us, method=timing.method)
            except Exception as e:  # noqa: BLE001 -- e.g. shared memory exhausted: not a winner
                row.update(status="failed", error=f"{type(e).__name__}: {e}"[:500])
            shown = f"{row['time_us']:10.1f} µs" if row["status"] == "ok" else f"{row['status'].upper():>13}"
            progress(f"  {mode:8s} {shown}  {row.get('error', '')} {params}")
            rows.append(row)
            return row

        def best(done: list[dict]) -> dict | None:
            ok = [r for r in done if r["status"] == "ok"]
            return min(ok, key=lambda r: r["time_us"]) if ok else None

        done_fwd = []
        for params in forward[:limit_]:
            if done_fwd and time.time() > forward_end:
                progress(f"  fwd: budget spent after {len(done_fwd)} candidates")
                break
            done_fwd.append(evaluate(params, spec.modes[0]))
        best_fwd = best(done_fwd)
        fixed = {} if best_fwd is None else {f: best_fwd["params"][f] for f in forward_fields}
        done_bwd = []
        for params in backward[:limit_]:
            if done_bwd and time.time() > share_end:
                progress(f"  fwd+bwd: budget spent after {len(done_bwd)} candidates")
                break
            done_bwd.append(evaluate(dict(params, **fixed), spec.modes[-1]))
        winner = best(done_bwd)
        if winner is None:
            progress(f"sweep {label}: no candidate passed the check; nothing stored")
            continue
        key = package.tuning_key(*args, **variant)
        tuning.store(spec.op, key, winner["params"], backend=backend, time_us=winner["time_us"], path=cache_path)
        winner["stored"] = key
        progress(f"sweep {label}: best fwd+bwd {winner['time_us']:.1f} µs -> {cache_path} [{key}]")
        jax.clear_caches()
    return rows


def sweep_table(rows: Sequence[dict]) -> str:
    """One line per candidate: shape, variant, backend, mode, time or status, relative error, parameters."""
    lines = []
    for r in rows:
        time_or_status = f"{r['time_us']:10.1f} µs" if r["status"] == "ok" else f"{r['status'].upper():>13}"
        err = f"{r['rel_error']:.1e}" if "rel_error" in r else "n/a"
        stored = f"  -> stored as {r['stored']}" if "stored" in r else ""
        stored += f"  ({r['error']})" if r["status"] == "skipped" else ""
        lines.append(f"{r['shape']:>20} {str(r['variant'] or ''):>16} {r['backend']:>7} {r['mode']:>8} "
                     f"{time_or_status}  err {err}  {r['params']}{stored}")
    return "\n".join(lines)
