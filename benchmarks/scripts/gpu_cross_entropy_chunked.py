"""On the H100: the chunked linear cross-entropy (gradients in the forward, 3 GEMMs) against XLA's plain loss and
today's Triton kernel, with temporary memory, errors against the float32 reference and a small sweep.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_cross_entropy_chunked.py --out $OUT [--budget-s 170]
    PYTHONPATH=$PWD python benchmarks/scripts/gpu_cross_entropy_chunked.py --out /tmp/x --small   # CPU check
    ... --steps rows,shapes --shapes 8k_128k,4k_256k --reference xla    # row tiles, then the best of them

Steps (--steps, default checks,shapes,sweep; each optional one starts only while --budget-s lasts):

checks. Correctness at 1000×512×32003 (GPU; --small: 70×32×300): mean with z_loss and soft cap (bf16), none with soft
   cap (bf16), sum with z_loss (float32), every 7th row ignored, in 256-row chunks (four, the last sharing 24 rows):
   loss (both paths), dh, dw against the reference under jax.vjp with a random cotangent.
shapes. At 8192×4096×128256, 4096×2048×256000 and 16384×4096×32000 (bf16, mean over all rows, the suite's inputs):
   "xla" (``jaxfuse.kernels.plain_cross_entropy``), "chunked" (this backend, default config) and "pallas_triton"
   (today's ``pallas_kernels.linear_cross_entropy``), modes "fwd" (``jit(loss)``) and "fwd+bwd"
   (``jit(value_and_grad(loss, argnums=(0, 1)))``: loss and both gradients), each checked against the float32
   reference before it is timed (CUPTI device-kernel time, median), temp memory from ``memory_analysis()``, and the
   time split into GEMMs, the row kernel and the rest. "pallas_triton" is skipped once half the budget is spent.
   The optimized HLO of "chunked" fwd+bwd at 8192×4096×128256: its GEMMs (cuBLAS or Triton), where they run, and
   the dw GEMM's beta (1: XLA folded the accumulation into the GEMM).
sweep. While --budget-s lasts, a sweep at the first shape (fwd+bwd; fwd too for row-kernel tiles): the XLA row
   pass, float32 dw accumulation, chunk rows, float32 logits, row-kernel tiles.
rows. The row kernel alone on random (Bc, V) logits of each shape's chunk, for a few tiles, each checked against
   the default tiles' outputs; the shapes step then runs "chunked" with the fastest tiles (its records name the
   config).
--reference xla measures errors against XLA's own loss, dh and dw instead of the float32 reference (whose
compilation, the autotuning of three float32 GEMMs, took 20-37 s per shape on the H100).
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
    ("xla row pass", {"row_pass": "xla"}),
    ("dw float32", {"dw_dtype": "float32"}),
    ("chunk 512", {"chunk_rows": 512}),
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

        def vjp(fn, h, w, labels, ct):  # arrays as arguments: as constants XLA would fold the reference
            out, pull = jax.vjp(lambda h, w: fn(h, w, labels), h, w)
            return out, *pull(ct)

        got = jax.jit(lambda *a: vjp(ours, *a))(h, w, labels, ct)
        want = jax.jit(lambda *a: vjp(ref, *a))(h, w, labels, ct)
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


def measure(name, loss, args, ref, *, shape, dev, iterations, keep_hlo=False, modes=("fwd", "fwd+bwd"),
            keep_outputs=False):
    """(records for modes fwd and fwd+bwd, with errors against ref (loss, dh, dw) checked before timing; the
    optimized HLO text of fwd+bwd when keep_hlo; its outputs when keep_outputs). ref None: no errors."""
    import jax

    from jaxfuse import bench
    from jaxfuse.suites import cross_entropy as suite

    h, w, labels = args
    B, H = h.shape
    V = w.shape[1]
    records, hlo, kept = [], None, None
    programs = {"fwd": jax.jit(loss), "fwd+bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))}
    for mode, fn in programs.items():
        if mode not in modes:
            continue
        compiled = suite._compile(fn, args)
        temp = compiled.memory_analysis().temp_size_in_bytes
        if keep_hlo and mode == "fwd+bwd":
            hlo = compiled.as_text()
        out = jax.block_until_ready(compiled(*args))
        got = (out,) if mode == "fwd" else (out[0], *out[1])
        errors = {} if ref is None else {k: suite._rel_error(g, r) for k, g, r in zip(("loss", "dh", "dw"), got, ref)}
        if keep_outputs and mode == "fwd+bwd":
            kept = got
        else:
            suite._delete(out)
        timing = bench.time_kernels(compiled, [args], iterations=iterations, jit=False)
        flops = 2.0 * B * H * V * (1 if mode == "fwd" else 3)
        moved = (h.nbytes + w.nbytes + labels.nbytes) * (1 if mode == "fwd" else 2)
        records.append(bench.Record(
            op="cross_entropy", shape=f"{B}x{H}x{V}", dtype=str(h.dtype), implementation=name, mode=mode,
            time_us=timing.median_us, method=timing.method, flops=flops, bytes_moved=moved,
            floor_us=dev.roofline_us(moved, flops, launches=0),
            extra={"shape_name": shape, "temp_bytes": int(temp), "temp_mib": round(temp / 2**20, 1),
                   "rel_error": max(errors.values(), default=float("nan")), "rel_errors": errors, "spread": round(timing.spread, 3),
                   "split_us": split_us(timing.per_kernel_us),
                   "per_kernel_us": dict(sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])[:10])},
        ).finish())
        log(f"  {name} {mode}: {timing.median_us:.0f} µs, temp {temp / 2**20:.1f} MiB, errors {errors}, "
            f"split {records[-1].extra['split_us']}")
        del compiled
    return records, hlo, kept


def gemm_report(hlo_text: str) -> list[dict]:
    """The cuBLAS calls and Triton GEMM fusions of an optimized HLO module (read as text: the parser of
    hlo_inspect does not know jax 0.11's async fusion-start yet): name, computation, output shape, operand count,
    beta (1: the call adds into its last operand, e.g. dw += h_cᵀ dl)."""
    import re

    rows, computation = [], ""
    for line in hlo_text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line.split(" ")[1] if line.startswith("ENTRY") else line.split(" ")[0]
        m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = (\(?[\w\[\],{}]+).*? (custom-call|fusion)\((.*?)\)", line)
        if not m or not ("__cublas" in line or "__triton_gemm" in line or "kCustom" in line and "gemm" in line):
            continue
        beta = re.search(r'"beta":([0-9.]+)', line)
        rows.append(dict(name=m.group(1), computation=computation.lstrip("%"), shape=m.group(2),
                         operands=len([o for o in m.group(4).split(",") if o.strip()]),
                         beta=float(beta.group(1)) if beta else None))
    return rows


def row_kernel_sweep(chunked, shapes: dict, iterations, budget_s) -> dict:
    """The row kernel alone on random (Bc, V) bf16 logits of each shape's default chunk: device time of its two
    uses (statistics only: evaluation; statistics and dlogits: fwd+bwd) for several tiles, each checked against
    the default tiles' outputs. Returns {shape: {"rows": [...], "best": config fields}}."""
    import jax
    import jax.numpy as jnp

    from jaxfuse import bench

    candidates = [dict(rows_per_program=4, block_v=2048, num_warps=8, num_stages=1),  # the default
                  dict(rows_per_program=1, block_v=4096, num_warps=4, num_stages=1),
                  dict(rows_per_program=1, block_v=8192, num_warps=8, num_stages=1),
                  dict(rows_per_program=2, block_v=4096, num_warps=8, num_stages=1)]
    out = {}
    from pallas_kernels import triton_utils

    interpret = triton_utils.resolve_interpret(None)
    for shape, (B, H, V) in shapes.items():
        base = chunked.default_config(B, H, V, jnp.bfloat16, on_gpu=True)
        R = base.chunk_rows
        kx, ky = jax.random.split(jax.random.key(3))
        x = jax.random.normal(kx, (R, V), jnp.float32).astype(jnp.bfloat16)
        labels = jax.random.randint(ky, (R,), 0, V).at[::9].set(-100)
        g = jnp.where(labels >= 0, 1.0 / R, 0.0).astype(jnp.float32)
        rows, want = [], None
        for fields in candidates:
            if time.time() - START > budget_s:
                log(f"rows {shape} {fields}: skipped (budget)")
                continue
            cfg = dataclasses.replace(base, **fields)
            st = chunked._Static(config=cfg, reduction="mean", ignore_index=-100, z_loss=0.0, logit_soft_cap=None,
                                 interpret=interpret)
            stats = jax.jit(lambda x, y: chunked._row_pass_pallas(x, y, None, None, st, dl_dtype=x.dtype)[1:])
            both = jax.jit(lambda x, y, g: chunked._row_pass_pallas(x, y, g, None, st, dl_dtype=x.dtype))
            try:
                got = jax.block_until_ready(both(x, labels, g))
                want = got if want is None else want
                diff = {k: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                        for k, a, b in zip(("dl", "lse", "zy"), got, want)}
                us = {}
                for mode, fn, args in (("stats", stats, (x, labels)), ("stats+dlogits", both, (x, labels, g))):
                    t = bench.time_kernels(fn, [args], iterations=iterations)
                    kernel_us = [v for k, v in t.per_kernel_us.items() if "chunked_cross_entropy_rows" in k]
                    us[mode] = round(sum(kernel_us) if kernel_us else t.median_us, 1)  # CPU: wall time
                rows.append(dict(fields=fields, us=us, max_abs_diff_vs_default=diff))
                log(f"rows {shape} R={R} {fields}: {us} diff {diff}")
            except Exception:  # noqa: BLE001
                log(f"rows {shape} {fields} FAILED\n{traceback.format_exc()[-1500:]}")
        ok = [r for r in rows if r["max_abs_diff_vs_default"]["dl"] < 1e-3 and r["max_abs_diff_vs_default"]["lse"] < 1e-4]
        best = min(ok, key=lambda r: r["us"]["stats"] + r["us"]["stats+dlogits"])["fields"] if ok else None
        out[shape] = {"chunk_rows": R, "V": V, "rows": rows, "best": best}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--budget-s", type=float, default=170.0, help="no optional step starts after this")
    parser.add_argument("--steps", default="checks,shapes,sweep", help="of checks, rows, shapes, sweep")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {list(SHAPES)}")
    parser.add_argument("--reference", choices=("float32", "xla"), default="float32",
                        help="errors against the float32 reference, or against XLA's own outputs (cheaper)")
    parser.add_argument("--impls", default="xla,chunked,pallas_triton", help="of xla, chunked, pallas_triton")
    parser.add_argument("--small", action="store_true", help="CPU check: tiny shapes, interpret mode")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    steps = set(args.steps.split(","))

    import jax

    import pallas_kernels
    from jaxfuse import bench, costmodel
    from jaxfuse.suites import cross_entropy as suite

    chunked = import_chunked()
    env = bench.environment()
    log(f"environment {env}")
    path = os.path.join(args.out, f"cross_entropy_chunked-{bench.device_tag(env['device'])}.json")
    shapes = {"small": (300, 64, 1000)} if args.small else {n: SHAPES[n] for n in args.shapes.split(",")}
    dev = costmodel.detect()
    result = {"reference": args.reference, "checks": [], "row_kernel": {}, "records": [], "gemms": [], "sweep": []}
    sweep_records = []

    def save():
        bench.write_results(result["records"], path, env=env)
        with open(path) as f:
            data = json.load(f)
        data.update({k: v for k, v in result.items() if k != "records"})
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    if "checks" in steps:
        result["checks"] = check_options(chunked, args.small)
    if "rows" in steps:
        result["row_kernel"] = row_kernel_sweep(chunked, shapes, args.iterations, 0.45 * args.budget_s)
        save()

    def with_speedups(records, base):
        for r in records:
            if r.mode in base:
                r.speedup_vs["xla"] = base[r.mode].time_us / r.time_us
                r.extra["temp_pct_of_xla"] = round(100.0 * r.extra["temp_bytes"] / base[r.mode].extra["temp_bytes"], 2)
        return records

    kept = None  # the first shape's inputs, reference and XLA records, for the sweep
    for i, (shape, (B, H, V)) in enumerate(shapes.items() if "shapes" in steps else ()):
        if i and time.time() - START > args.budget_s:
            log(f"{shape}: skipped (budget)")
            continue
        inputs = suite.make_inputs(B, H, V)
        ref = suite._reference(*inputs) if args.reference == "float32" else None
        default = chunked.default_config(B, H, V, inputs[0].dtype, on_gpu=not args.small)
        log(f"{shape}: inputs ready; chunked config {default}")
        best = result["row_kernel"].get(shape, {}).get("best")
        config = dataclasses.replace(default, **best) if best else default
        impls = {"xla": suite._xla_loss, "chunked": chunked_loss(chunked, config)}
        impls["pallas_triton"] = lambda h, w, y: pallas_kernels.linear_cross_entropy(h, w, y)
        impls = {name: fn for name, fn in impls.items() if name in args.impls.split(",")}
        shape_records = []
        for name, loss in impls.items():
            if name == "pallas_triton" and time.time() - START > 0.5 * args.budget_s:
                log(f"  {name}: skipped (budget)")
                continue
            try:
                recs, hlo, outs = measure(name, loss, inputs, ref, shape=shape, dev=dev, iterations=args.iterations,
                                          keep_hlo=i == 0 and name == "chunked",
                                          keep_outputs=name == "xla" and ref is None)
                for r in recs:
                    r.extra["config"] = dataclasses.asdict(config) if name == "chunked" else None
                shape_records += recs
                ref = outs if outs is not None else ref  # --reference xla: XLA's loss, dh, dw
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

    for label, fields in SWEEP if "sweep" in steps and kept else ():  # at the first shape
        shape, inputs, ref, base, (B, H, V) = kept
        if time.time() - START > args.budget_s:
            log(f"sweep {label}: skipped (budget)")
            continue
        try:
            cfg = dataclasses.replace(chunked.default_config(B, H, V, inputs[0].dtype, on_gpu=not args.small),
                                      **fields)
            modes = ("fwd", "fwd+bwd") if "rows_per_program" in fields else ("fwd+bwd",)
            recs, _, _ = measure(f"chunked[{label}]", chunked_loss(chunked, cfg), inputs, ref, shape=shape, dev=dev,
                                 iterations=args.iterations, modes=modes)
            sweep_records.extend(with_speedups(recs, base))
            result["sweep"] += [dict(label=label, fields=fields, **dataclasses.asdict(r)) for r in recs]
        except Exception:  # noqa: BLE001
            log(f"sweep {label} FAILED\n{traceback.format_exc()[-2000:]}")
        save()

    save()
    log(f"wrote {path}")
    print("\nchecks:", "all ok" if all(c["ok"] for c in result["checks"]) else
          [c for c in result["checks"] if not c["ok"]])
    for shape, sweep in result["row_kernel"].items():
        print(f"row kernel alone at {shape} (Bc={sweep['chunk_rows']}): best {sweep['best']}")
        for row in sweep["rows"]:
            print(f"   {row['fields']}: {row['us']}")
    print(f"\n{'shape':>9} {'mode':>8} {'impl':>24} {'ms':>8} {'xla/this':>8} {'temp MiB':>9} {'% xla':>6} "
          f"{'err':>8}  split ms (gemm/row/other); errors vs {args.reference}")
    for r in result["records"] + sweep_records:
        e, sp = r.extra, r.extra.get("split_us", {})
        print(f"{e.get('shape_name', r.shape):>9} {r.mode:>8} {r.implementation[:24]:>24} {r.time_us / 1e3:8.2f} "
              f"{r.speedup_vs.get('xla', float('nan')):8.3f} {e['temp_mib']:9.1f} "
              f"{e.get('temp_pct_of_xla', float('nan')):6.2f} {e['rel_error']:8.1e}  "
              f"{sp.get('gemm', 0) / 1e3:.2f}/{sp.get('row_kernel', 0) / 1e3:.2f}/{sp.get('other', 0) / 1e3:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
