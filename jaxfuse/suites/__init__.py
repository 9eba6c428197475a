"""Benchmark suites, one module per op: named shape sets, the floor (bytes and FLOPs a kernel must move), and
`run(shape_names, iterations) -> list[bench.Record]` measuring every implementation side by side in one run.

    from jaxfuse import suites
    records = suites.get("attention").run(["main"], iterations=20)

`jaxfuse bench --op NAME` calls the same function and writes `benchmarks/results/NAME-<device>.json`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["OPS", "available", "get"]

# op name -> module in this package. Each module defines SHAPES (name -> shape dict), DEFAULT_SHAPES and run().
OPS = {
    "attention": "jaxfuse.suites.attention",
    "rmsnorm_matmul": "jaxfuse.suites.rmsnorm_matmul",
    "cross_entropy": "jaxfuse.suites.cross_entropy",
}


def available() -> list[str]:
    """The ops whose suite module is present."""
    import importlib.util

    return [op for op, module in OPS.items() if importlib.util.find_spec(module) is not None]


def get(op: str) -> ModuleType:
    """The suite module of `op`; ValueError naming the available ops otherwise."""
    if op not in available():
        raise ValueError(f"op: unknown {op!r}; one of {available()}")
    return importlib.import_module(OPS[op])
