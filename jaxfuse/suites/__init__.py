"""Op specs (one per op: implementations, named shapes, inputs, floor, tolerance), one runner and one sweep.

    from jaxfuse import suites
    records = suites.run("attention", ["main"], iterations=20)    # GPU; suites.run("attention") on CPU: its "cpu" shape
    print(suites.summary_table(records))
    suites.tune("rmsnorm_matmul", ["16x4096x4096-decode"])         # GPU: check and time sweep candidates, store the best

``jaxfuse bench --op NAME [--tune]`` calls the same functions and writes ``NAME-<device>.json`` into its ``--out``
folder (``jaxfuse-results/`` in the current directory unless told);
``python -m jaxfuse.gpu_run`` runs tests, sweeps and suites on a GPU into one folder.
"""

from __future__ import annotations

import importlib
import json
import os

from jaxfuse.suites.runner import run, summary_table
from jaxfuse.suites.spec import OpSpec, tolerance
from jaxfuse.suites.sweep import tune

__all__ = ["OPS", "OpSpec", "benchmark", "get", "run", "summary_table", "tolerance", "tune"]

# op name (what `jaxfuse bench --op` takes) -> the module holding its SPEC
OPS = {
    "attention": "jaxfuse.suites.attention",
    "rmsnorm_matmul": "jaxfuse.suites.rmsnorm_matmul",
    "cross_entropy": "jaxfuse.suites.cross_entropy",
    "train_step": "jaxfuse.suites.train_step",
}


def get(op: str) -> OpSpec:
    """The spec of ``op``; ValueError naming the ops otherwise."""
    if op not in OPS:
        raise ValueError(f"op: unknown {op!r}; one of {list(OPS)}")
    return importlib.import_module(OPS[op]).SPEC


def benchmark(op: str, shapes=None, *, impls=None, iterations: int = 20, tune_first: bool = False,
              tuned_configs=None, out: str | None = None, deadline: float | None = None, check: bool = True,
              progress=None, mesh: str | None = None, fsdp: bool = False) -> dict:
    """``jaxfuse bench``: optionally the sweep (``tune``) at ``shapes`` into ``tuned_configs``, then the suite (``run``)
    with those configs (``check=False``: without comparing outputs to the float32 reference). With ``out``, writes
    ``<op>-<device tag>.json`` (+ .md) and, after a sweep, ``<op>-sweep-<device tag>.json`` there. ``mesh``
    ("data=2,model=2", with ``fsdp``): the train step on that mesh (``train_step.on_mesh``), written to
    ``train_step-<device tag>-<mesh tag>.json``. Returns {"environment", "records", "sweep", "written": [paths]}."""
    from jaxfuse import bench

    spec, suffix = get(op), ""
    if mesh is not None:
        from jaxfuse.sharding import Layout
        from jaxfuse.suites import train_step

        if op != "train_step" or tune_first:
            raise ValueError(f"mesh: only the train step runs on a mesh (--op train_step, without --tune), got "
                             f"op {op!r}{' with tune' if tune_first else ''}")
        layout = Layout.parse(mesh, fsdp=fsdp)
        spec = train_step.on_mesh(layout)
        suffix = f"-{layout.strategy}-data{layout.data}-model{layout.model}".replace("+", "-")
    elif fsdp:
        raise ValueError("fsdp: shards over a mesh's data axis; give a mesh too (--mesh data=N)")
    kwargs = {} if progress is None else {"progress": progress}
    sweep_rows = None
    if tune_first:
        sweep_rows = tune(spec, shapes, cache_path=tuned_configs, deadline=deadline, **kwargs)
    records = run(spec, shapes, impls=impls, iterations=iterations, deadline=deadline,
                  cache_path=tuned_configs if tune_first else None, check=check, **kwargs)
    env = bench.environment()
    written = []
    if out:
        tag = bench.device_tag(env["device"])
        if records:
            written.append(bench.write_results(records, os.path.join(out, f"{op}-{tag}{suffix}.json"), env=env))
        if sweep_rows is not None:
            path = os.path.join(out, f"{op}-sweep-{tag}.json")
            os.makedirs(out, exist_ok=True)
            with open(path, "w") as f:
                json.dump({"environment": env, "rows": sweep_rows}, f, indent=1, default=str)
            written.append(path)
    return {"environment": env, "records": records, "sweep": sweep_rows, "written": written}
