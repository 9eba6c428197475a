"""On the H100: the chunked linear cross-entropy (gradients in the forward, 3 GEMMs) against XLA's plain loss and
today's Triton kernel, with temporary memory, errors against the float32 reference and a small sweep.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_cross_entropy_chunked.py --out $OUT [--budget-s 170]
    PYTHONPATH=$PWD python benchmarks/scripts/gpu_cross_entropy_chunked.py --out /tmp/x --small   # CPU check

1. Correctness at 1000×512×32003 (GPU; --small: 70×32×300): mean with z_loss and soft cap (bf16), none with soft
   cap (bf16), sum with z_loss (float32), every 7th row ignored, in 256-row chunks (four, the last sharing 24 rows):
   loss (both paths), dh, dw against the reference under jax.vjp with a random cotangent.
2. At 8192×4096×128256, 4096×2048×256000 and 16384×4096×32000 (bf16, mean over all rows, the suite's inputs):
   "xla" (``jaxfuse.kernels.plain_cross_entropy``), "chunked" (this backend, default config) and "pallas_triton"
   (today's ``pallas_kernels.linear_cross_entropy``), modes "fwd" (``jit(loss)``) and "fwd+bwd"
   (``jit(value_and_grad(loss, argnums=(0, 1)))``: loss and both gradients), each checked against the float32
   reference before it is timed (CUPTI device-kernel time, median), temp memory from ``memory_analysis()``, and the
   time split into GEMMs, the row kernel and the rest. "pallas_triton" is skipped once half the budget is spent.
3. The optimized HLO of "chunked" fwd+bwd at 8192×4096×128256: its GEMMs (cuBLAS or Triton), where they run, and
   the dw GEMM's beta (1: XLA folded the accumulation into the GEMM).
4. While --budget-s lasts, a sweep at 8192×4096×128256 (fwd+bwd; fwd too for row-kernel tiles): float32 dw
   accumulation, chunk rows, the XLA row pass, float32 logits, row-kernel tiles.
Writes $OUT/cross_entropy_chunked-<device tag>.json (+ .md) after every shape; prints a compact table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import pathlib
import sys
import time
import traceback

START = time.time()
ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPES = {"8k_128k": (8192, 4096, 128256), "4k_256k": (4096, 2048, 256000), "16k_32k": (16384, 4096, 32000)}
SWEEP = [  # (label, config fields) at 8k_128k, most informative first
    ("dw float32", {"dw_dtype": "float32"}),
    ("chunk 512", {"chunk_rows": 512}),
    ("xla row pass", {"row_pass": "xla"}),
    ("logits float32", {"logits_dtype": "float32"}),
    ("chunk 2048", {"chunk_rows": 2048}),
    ("rows 1 x 4096, 4 warps", {"rows_per_program": 1, "block_v": 4096, "num_warps": 4}),
    ("rows 16 x 1024", {"rows_per_program": 16, "block_v": 1024}),
]


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def import_chunked():
    """The backend module (loaded from its file while ``pallas_kernels/cross_entropy.py`` is still a module)."""
    name = "pallas_kernels.cross_entropy.chunked"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(name, ROOT / "pallas_kernels" / "cross_entropy" / "chunked.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


def kernel_class(name: str) -> str:
    if "chunked_cross_entropy_rows" in name:
        return "row_kernel"
    if any(s in name for s in ("nvjet", "gemm", "xmma", "cutlass", "cublas")):
        return "gemm"
    return "other"


def split_us(per_kernel: dict) -> dict:
    out = {"gemm": 0.0, "row_kernel": 0.0, "other": 0.0}
    for name, us in per_kernel.items():
        out[kernel_class(name)] += us
    return {k: round(v, 1) for k, v in out.items()}


def chunked_loss(chunked, config=None, **options):
    opts = dict(reduction="mean", ignore_index=-100, z_loss=0.0, logit_soft_cap=None) | options

    def loss(h, w, labels):
        cfg = config or chunked.default_config(h.shape[0], h.shape[1], w.shape[1], h.dtype)
        return chunked.linear_cross_entropy(h, w, labels, config=cfg, **opts)

    return loss


def check_options(chunked, small: bool) -> list[dict]:
    """Step 1: (case, errors) for every reduction and option at a medium shape, bf16 and float32."""
    import jax
    import jax.numpy as jnp

    from jaxfuse.suites import cross_entropy as suite
    from pallas_kernels import reference

    B, H, V = (70, 32, 300) if small else (1000, 512, 32003)
    rows = []
    cases = [("mean", {"z_loss": 1e-3, "logit_soft_cap": 30.0}, jnp.bfloat16),
             ("none", {"logit_soft_cap": 30.0}, jnp.bfloat16), ("sum", {"z_loss": 1e-3}, jnp.float32)]
    for reduction, options, dtype in cases:
        h, w, labels = suite.make_inputs(B, H, V, seed=len(rows) + 1, dtype=dtype)
        labels = labels.at[::7].set(-100)  # ignored rows
        config = dataclasses.replace(chunked.default_config(B, H, V, dtype), chunk_rows=16 if small else 256)
        ct = jax.random.normal(jax.random.key(9), (B,) if reduction == "none" else (), jnp.float32)
        ours = chunked_loss(chunked, config, reduction=reduction, **options)
        ref = lambda h, w, y: reference.linear_cross_entropy(h, w, y, reduction=reduction, **options)  # noqa: E731

        def vjp(fn):
            out, pull = jax.vjp(lambda h, w: fn(h, w, labels), h, w)
            return out, *pull(ct)

        got = jax.jit(lambda: vjp(ours))()
        want = jax.jit(lambda: vjp(ref))()
        evaluated = jax.jit(ours)(h, w, labels)
        errors = {k: suite._rel_error(g, r) for k, g, r in zip(("loss", "dh", "dw"), got, want)}
        errors["loss_eval"] = suite._rel_error(evaluated, want[0])
        tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
        n_chunks = -(-B // config.chunk_rows)  # a bf16 dw takes one rounding per chunk (see the tests)
        ok = all(e <= (tol * n_chunks**0.5 if k == "dw" and dtype == jnp.bfloat16 else tol)
                 for k, e in errors.items())  # NaN compares False
        rows.append(dict(reduction=reduction, options=options, dtype=jnp.dtype(dtype).name, errors=errors, ok=ok))
        log(f"check {reduction} {options} {jnp.dtype(dtype).name}: {'ok' if ok else 'FAIL'} {errors}")
    return rows


def measure(name, loss, args, ref, *, shape, dev, iterations, keep_hlo=False, modes=("fwd", "fwd+bwd")):
    """Records for modes fwd and fwd+bwd of one implementation (errors checked before timing), and the optimized
    HLO text of fwd+bwd when keep_hlo."""
    import jax

    from jaxfuse import bench
    from jaxfuse.suites import cross_entropy as suite

    h, w, labels = args
    B, H = h.shape
    V = w.shape[1]
    records, hlo = [], None
    programs = {"fwd": jax.jit(loss), "fwd+bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))}
    for mode, fn in programs.items():
        if mode not in modes:
            continue
        compiled = suite._compile(fn, args)
        temp = compiled.memory_analysis().temp_size_in_bytes
        if keep_hlo and mode == "fwd+bwd":
            hlo = compiled.as_text()
        out = jax.block_until_ready(compiled(*args))
        if mode == "fwd":
            errors = {"loss": suite._rel_error(out, ref[0])}
        else:
            value, (dh, dw) = out
            errors = {"loss": suite._rel_error(value, ref[0]), "dh": suite._rel_error(dh, ref[1]),
                      "dw": suite._rel_error(dw, ref[2])}
        suite._delete(out)
        timing = bench.time_kernels(compiled, [args], iterations=iterations, jit=False)
        flops = 2.0 * B * H * V * (1 if mode == "fwd" else 3)
        moved = (h.nbytes + w.nbytes + labels.nbytes) * (1 if mode == "fwd" else 2)
        records.append(bench.Record(
            op="cross_entropy", shape=f"{B}x{H}x{V}", dtype=str(h.dtype), implementation=name, mode=mode,
            time_us=timing.median_us, method=timing.method, flops=flops, bytes_moved=moved,
            floor_us=dev.roofline_us(moved, flops, launches=0),
            extra={"shape_name": shape, "temp_bytes": int(temp), "temp_mib": round(temp / 2**20, 1),
                   "rel_error": max(errors.values()), "rel_errors": errors, "spread": round(timing.spread, 3),
                   "split_us": split_us(timing.per_kernel_us),
                   "per_kernel_us": dict(sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])[:10])},
        ).finish())
        log(f"  {name} {mode}: {timing.median_us:.0f} µs, temp {temp / 2**20:.1f} MiB, errors {errors}, "
            f"split {records[-1].extra['split_us']}")
        del compiled
    return records, hlo


def gemm_report(hlo_text: str) -> list[dict]:
    """The GEMMs of an optimized HLO module: kernel name, category, launches, in a loop, beta, output shape."""
    import hlo_inspect

    rows = []
    for k in hlo_inspect.from_text(hlo_text).kernels:
        if k.category not in ("cublas", "triton_gemm") and not k.ops.get("dot"):
            continue
        cfg = k.instruction.backend_config if isinstance(k.instruction.backend_config, dict) else {}
        beta = cfg.get("gemm_backend_config", {}).get("beta")
        rows.append(dict(name=k.name, category=k.category, launches=k.launches, in_loop=bool(k.loop), beta=beta,
                         shape=str(k.instruction.shape)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=170.0, help="no optional step starts after this")
    parser.add_argument("--small", action="store_true", help="CPU check: tiny shapes, interpret mode")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    import pallas_kernels
    from jaxfuse import bench, costmodel
    from jaxfuse.suites import cross_entropy as suite

    chunked = import_chunked()
    env = bench.environment()
    log(f"environment {env}")
    tag = bench.device_tag(env["device"])
    path = os.path.join(args.out, f"cross_entropy_chunked-{tag}.json")
    shapes = {"small": (300, 64, 1000)} if args.small else SHAPES
    dev = costmodel.detect()
    result = {"checks": check_options(chunked, args.small), "records": [], "gemms": [], "sweep": []}
    sweep_records = []

    def save():
        bench.write_results(result["records"], path, env=env)
        with open(path) as f:
            data = json.load(f)
        data.update(checks=result["checks"], gemms=result["gemms"], sweep=result["sweep"])
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    impls = {"xla": suite._xla_loss, "chunked": chunked_loss(chunked),
             "pallas_triton": lambda h, w, y: pallas_kernels.linear_cross_entropy(h, w, y)}

    def with_speedups(records, base):
        for r in records:
            if r.mode in base:
                r.speedup_vs["xla"] = base[r.mode].time_us / r.time_us
                r.extra["temp_pct_of_xla"] = round(100.0 * r.extra["temp_bytes"] / base[r.mode].extra["temp_bytes"], 2)
        return records

    kept = None  # the first shape's inputs, reference and XLA records, for the sweep
    for i, (shape, (B, H, V)) in enumerate(shapes.items()):
        inputs = suite.make_inputs(B, H, V)
        ref = suite._reference(*inputs)
        log(f"{shape}: reference ready; chunked config {chunked.default_config(B, H, V, inputs[0].dtype)}")
        shape_records = []
        for name, loss in impls.items():
            if name == "pallas_triton" and time.time() - START > 0.5 * args.budget_s:
                log(f"  {name}: skipped (budget)")
                continue
            try:
                recs, hlo = measure(name, loss, inputs, ref, shape=shape, dev=dev, iterations=args.iterations,
                                    keep_hlo=i == 0 and name == "chunked")
                shape_records += recs
                if hlo:
                    with open(os.path.join(args.out, "chunked_fwd_bwd_hlo.txt"), "w") as f:
                        f.write(hlo)
                    result["gemms"] = gemm_report(hlo)
                    for row in result["gemms"]:
                        log(f"  gemm {row}")
            except Exception:  # noqa: BLE001 -- recorded; the others still run
                log(f"  {name} FAILED\n{traceback.format_exc()[-2000:]}")
        base = {r.mode: r for r in shape_records if r.implementation == "xla"}
        result["records"] += with_speedups(shape_records, base)
        save()
        if i == 0:
            kept = (shape, inputs, ref, base, (B, H, V))
        else:
            suite._delete((inputs, ref))

    shape, inputs, ref, base, (B, H, V) = kept
    for label, fields in SWEEP:  # at the first shape, fwd+bwd (and fwd where the row kernel's tiles change)
        if time.time() - START > args.budget_s:
            log(f"sweep {label}: skipped (budget)")
            continue
        try:
            cfg = dataclasses.replace(chunked.default_config(B, H, V, inputs[0].dtype), **fields)
            modes = ("fwd", "fwd+bwd") if "rows_per_program" in fields else ("fwd+bwd",)
            recs, _ = measure(f"chunked[{label}]", chunked_loss(chunked, cfg), inputs, ref, shape=shape, dev=dev,
                              iterations=args.iterations, modes=modes)
            sweep_records.extend(with_speedups(recs, base))
            result["sweep"] += [dict(label=label, fields=fields, **dataclasses.asdict(r)) for r in recs]
        except Exception:  # noqa: BLE001
            log(f"sweep {label} FAILED\n{traceback.format_exc()[-2000:]}")
        save()

    log(f"wrote {path}")
    print("\nchecks:", "all ok" if all(c["ok"] for c in result["checks"]) else
          [c for c in result["checks"] if not c["ok"]])
    print(f"\n{'shape':>9} {'mode':>8} {'impl':>24} {'ms':>8} {'xla/this':>8} {'temp MiB':>9} {'% xla':>6} "
          f"{'err':>8}  split ms (gemm/row/other)")
    for r in result["records"] + sweep_records:
        e, sp = r.extra, r.extra.get("split_us", {})
        print(f"{e.get('shape_name', r.shape):>9} {r.mode:>8} {r.implementation[:24]:>24} {r.time_us / 1e3:8.2f} "
              f"{r.speedup_vs.get('xla', float('nan')):8.3f} {e['temp_mib']:9.1f} "
              f"{e.get('temp_pct_of_xla', float('nan')):6.2f} {e['rel_error']:8.1e}  "
              f"{sp.get('gemm', 0) / 1e3:.2f}/{sp.get('row_kernel', 0) / 1e3:.2f}/{sp.get('other', 0) / 1e3:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
