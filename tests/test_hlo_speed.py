"""hlo_inspect's time grows linearly with the size of the module: parse, kernels, ledger and JSON of a module 4x
as large take about 4x as long (best of 3 each, CPU time of this process: a ratio, not seconds, so that a loaded
2-core CI machine cannot make it flaky). benchmarks/scripts/hlo_inspect_speed.py measures MB/s."""

import gc
import os
import time

import hlo_inspect
from hlo_inspect.synthetic import replicate

DATA = os.path.join(os.path.dirname(__file__), "data")


def _best_cpu_seconds(fn, repeats: int = 3) -> float:
    """The least CPU time of ``repeats`` calls of fn, each after a full collection and with the collector paused: a
    collection between the report's stages scans the whole test process's heap, not the module's (in a full run it
    once made the large module 7.2x the small one)."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            start = time.process_time()
            fn()
            best = min(best, time.process_time() - start)
        finally:
            if enabled:
                gc.enable()
    return best


def _end_to_end(text: str) -> None:
    report = hlo_inspect.from_text(text)
    report.ledger
    report.to_json()


def test_time_grows_linearly_with_module_size():
    with open(os.path.join(DATA, "h100_block_fwd.hlo.txt"), encoding="utf-8") as f:
        base = f.read()
    small, large = replicate(base, 6), replicate(base, 24)  # about 0.45 MB and 1.8 MB
    assert 3.9 < len(large) / len(small) < 4.1
    n_small = len(hlo_inspect.from_text(small).kernels)
    assert len(hlo_inspect.from_text(large).kernels) == 4 * n_small
    t_small, t_large = _best_cpu_seconds(lambda: _end_to_end(small)), _best_cpu_seconds(lambda: _end_to_end(large))
    # linear: 4x; quadratic would be 16x. 7x leaves room for caches and the collector on a busy machine.
    assert t_large < 7 * t_small, f"{len(small):,} B: {t_small:.3f} s, {len(large):,} B: {t_large:.3f} s"


def test_replicate_keeps_the_program_and_repeats_it():
    with open(os.path.join(DATA, "cpu_while_loop.hlo.txt"), encoding="utf-8") as f:
        base = f.read()
    one, three = hlo_inspect.from_text(base), hlo_inspect.from_text(replicate(base, 3))
    assert len(three.kernels) == 3 * len(one.kernels)
    assert three.totals.flops == 3 * one.totals.flops and three.totals.bytes_total == 3 * one.totals.bytes_total
    assert len(three.module.entry.parameters) == len(one.module.entry.parameters)
    assert hlo_inspect.parse(replicate(base, 1)).entry.name == one.module.entry.name


def test_no_garbage_collection_while_building_the_report(monkeypatch):
    """Half of parse()'s time on a 4 MB module went to the cyclic collector rescanning the module being built
    (it finds no garbage there): parse, kernels, ledger and JSON run with the collector paused, and restore it.
    Between the stages (from_text, .ledger, .to_json()) one young-generation collection may run; d8e9cf0 ran 15
    during this 180 KB module, more the larger the module."""
    import gc

    with open(os.path.join(DATA, "h100_block_grad.hlo.txt"), encoding="utf-8") as f:
        text = f.read()
    collections = []
    callback = lambda phase, info: collections.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.collect()
    gc.callbacks.append(callback)
    try:
        _end_to_end(text)
    finally:
        gc.callbacks.remove(callback)
    assert len(collections) <= 2 and gc.isenabled(), collections


def test_json_is_written_by_the_c_encoder(monkeypatch):
    """json.dumps(indent=1) runs json's pure-Python encoder (seconds for a 4 MB program's report); to_json()
    lays the report out itself and leaves the encoding to the C encoder."""
    import json.encoder

    def python_encoder(*args, **kwargs):
        raise AssertionError("json's pure-Python encoder was used")

    monkeypatch.setattr(json.encoder, "_make_iterencode", python_encoder)
    with open(os.path.join(DATA, "h100_mlp_grad.hlo.txt"), encoding="utf-8") as f:
        report = hlo_inspect.from_text(f.read())
    data = report.to_json()
    assert data.count("\n") > len(report.kernels)  # still one kernel per line, readable
    assert json.loads(data)["kernels"][0]["name"] == report.kernels[0].name


def _chain(n: int, tiled: bool) -> str:
    """n negates, each a kernel; tiled: TPU layouts, every other value in VMEM (S(1))."""
    tile = ":T(8,128)(2,1)" if tiled else ""
    lines = [f"  %v0 = bf16[256,1024]{{1,0{tile}}} parameter(0)"]
    lines += [f"  {'ROOT ' if i == n else ''}%v{i} = bf16[256,1024]{{1,0{tile}{'S(1)' if tiled and i % 2 else ''}}} "
              f"negate(%v{i - 1})" for i in range(1, n + 1)]
    return ("HloModule m, is_scheduled=true\n\nENTRY %main (v0: bf16[256,1024]) -> bf16[256,1024] {\n"
            + "\n".join(lines) + "\n}\n")


def test_tiled_layouts_cost_no_more_than_plain_ones():
    """Each shape's tiles, memory space and size are worked out once: a TPU program reads about as fast as the
    same program untiled (1.7x slower when each use parsed the layout again)."""
    plain, tiled = _chain(4000, tiled=False), _chain(4000, tiled=True)
    assert hlo_inspect.from_text(tiled).totals.bytes_total < hlo_inspect.from_text(plain).totals.bytes_total
    t_plain, t_tiled = _best_cpu_seconds(lambda: _end_to_end(plain)), _best_cpu_seconds(lambda: _end_to_end(tiled))
    assert t_tiled < 1.35 * t_plain, f"plain {t_plain:.3f} s, tiled {t_tiled:.3f} s"
