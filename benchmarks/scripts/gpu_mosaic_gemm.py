"""On one H100: the Mosaic-GPU GEMM against cuBLAS, and the Mosaic rmsnorm_matmul against XLA and Triton.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_mosaic_gemm.py --out $OUT --budget-s 300
    PYTHONPATH=$PWD python benchmarks/scripts/gpu_mosaic_gemm.py --out $OUT --budget-s 240 \
        --sections probe,plain,place,winner          # decides the K loop and the statistics placement

In one run, time-boxed (a section past the deadline is skipped, said so), writing mosaic_gemm-<device>.json (+ .md;
jaxfuse.bench records: device, jax, commit, date) after every section (``--sections``, in priority order):
  probe     the Mosaic-GPU API this jax has (signatures the kernels rely on) -> probe.txt
  plain     (a) the plain GEMM: cuBLAS, jax's shipped Hopper example (imported), our K loops (pallas / pallas_steady /
            own) under lane and warpgroup semantics, at 32768x4096x4096, 8192x4096x6144, 16384x1024x5504
  place     (b) rmsnorm_matmul fwd, fwd+bwd: row statistics from XLA passes / the MMA warpgroups' prologue / a
            dedicated warpgroup, vs XLA norm+matmul and XLA matmul alone, at the four suite shapes
  winner    (c) tile order and tile sweep of our fastest plain K loop from section plain
  norm      rmsnorm_matmul fwd and fwd+bwd (``jax.vjp``, random cotangent, y returned) at the big shapes: the Mosaic
            backend (``norm_matmul.mosaic``) vs XLA norm+matmul and XLA matmul alone, per-kernel times recorded
  gemm      ``pallas_kernels.gemm.matmul`` vs XLA's ``jnp.dot`` (cuBLAS); transposed reads at one shape
  parts     plain GEMMs with the fused kernels' tiles and the XLA pass over w (what each hook costs)
  triton / norm_train / decode: today's Triton kernel; the training shape; decode shapes (Mosaic unsupported)
  pytest    the GPU tests the timing does not cover (the earlier "sweep" and "alternatives" sections are now
            winner and place)
Every Mosaic result is checked against the float32 reference on the timing inputs first (relative error
max |got - want| / max |want| <= 2e-2 and finite, else REJECTED and not timed). Timing: CUPTI device time of all
kernels of one call (jaxfuse.bench.time_kernels), median of --iterations.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import sys
import time
import traceback

T0 = time.time()
MAX_REL_ERR = 2e-2
GEMM_SHAPES = [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144), (16384, 1024, 5504)]  # (M, K, N)
NORM_SHAPES = GEMM_SHAPES
DECODE_SHAPES = [(16, 4096, 4096), (1, 4096, 14336)]


def log(message: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {message}", flush=True)


def probe(out_dir: str) -> None:
    """The Mosaic-GPU API of this jax, as the kernels use it (one call, so a surprise shows at once)."""
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    lines = [f"jax {jax.__version__}", f"devices {jax.devices()}"]
    for name in ("kernel", "load", "emit_pipeline_warp_specialized", "copy_smem_to_gmem", "copy_gmem_to_smem",
                 "wgmma", "nd_loop", "planar_snake", "layout_cast", "wait_smem_to_gmem"):
        obj = getattr(plgpu, name, None)
        lines.append(f"plgpu.{name}{inspect.signature(obj) if obj else ': MISSING'}")
    lines.append(f"CompilerParams fields {list(plgpu.CompilerParams.__dataclass_fields__)}")
    lines.append(f"InterpretGPUParams {'present' if hasattr(plgpu, 'InterpretGPUParams') else 'absent'}")
    with open(os.path.join(out_dir, "probe.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


class Run:
    """Records of this run, written after every section."""

    def __init__(self, out_dir: str, iterations: int, deadline: float):
        from jaxfuse import bench

        self.bench, self.out_dir, self.iterations, self.deadline = bench, out_dir, iterations, deadline
        self.records, self.env = [], bench.environment()
        self.path = os.path.join(out_dir, f"mosaic_gemm-{bench.device_tag(self.env['device'])}.json")

    def left(self) -> float:
        return self.deadline - time.time()

    def time(self, fn, args, **kw):
        from pallas_kernels import triton_utils

        with triton_utils.quiet_triton_deprecation():
            return self.bench.time_kernels(fn, [args], iterations=self.iterations, warmup=2, **kw)

    def add(self, op, shape, mode, impl, timing, flops, **extra):
        rec = self.bench.Record(op=op, shape=shape, dtype="bfloat16", implementation=impl, mode=mode,
                                time_us=timing.median_us, method=timing.method, flops=flops,
                                extra=dict(extra, per_kernel_us=timing.per_kernel_us, spread=timing.spread))
        self.records.append(rec.finish())
        log(f"  {op} {shape} {mode:7s} {impl:18s} {timing.median_us:9.1f} µs  {rec.tflops_per_s:6.1f} TFLOP/s")
        return rec

    def write(self) -> None:
        by_key = {}
        for r in self.records:
            by_key.setdefault((r.op, r.shape, r.mode), {})[r.implementation] = r.time_us
        for r in self.records:  # speedup of every row against every other implementation at its shape and mode
            r.speedup_vs = {k: v / r.time_us for k, v in by_key[(r.op, r.shape, r.mode)].items()
                            if k != r.implementation}
        self.bench.write_results(self.records, self.path, env=self.env)


def rel_err(got, want) -> float:
    import jax.numpy as jnp

    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def gemm_section(run: Run) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemm import default_config, matmul

    log("section 1: matmul vs cuBLAS")
    for M, K, N in GEMM_SHAPES:
        if run.left() < 15:
            log("  out of time"); return
        shape = f"{M}x{K}x{N}"
        ka, kb = jax.random.split(jax.random.key(M + N))
        a = jax.random.normal(ka, (M, K), jnp.bfloat16)
        b = (jax.random.normal(kb, (K, N), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
        mosaic = jax.jit(lambda a, b: matmul(a, b))
        err = rel_err(mosaic(a, b), jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
        cfg = default_config(M, N, K).to_dict()
        if not err <= MAX_REL_ERR:
            log(f"  {shape} mosaic REJECTED: relative error {err:.2e}"); continue
        run.add("matmul", shape, "fwd", "pallas_mosaic", run.time(mosaic, (a, b)), 2.0 * M * N * K, rel_err=err,
                config=cfg)
        run.add("matmul", shape, "fwd", "xla", run.time(jax.jit(jnp.dot), (a, b)), 2.0 * M * N * K)
        if (M, K, N) == (8192, 4096, 6144):  # the backward's GEMMs: operands read transposed as stored
            at, bt = a.T.copy(), b.T.copy()
            for name, fn, args in (("pallas_mosaic_at", lambda a, b: matmul(a, b, transpose_a=True), (at, b)),
                                   ("pallas_mosaic_bt", lambda a, b: matmul(a, b, transpose_b=True), (a, bt))):
                fn = jax.jit(fn)
                err = rel_err(fn(*args), jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
                if err <= MAX_REL_ERR:
                    run.add("matmul", shape, "fwd", name, run.time(fn, args), 2.0 * M * N * K, rel_err=err)
                else:
                    log(f"  {shape} {name} REJECTED: relative error {err:.2e}")
        run.write()


def norm_fns(nm, triton_fn, xla_fns, config=None):
    """impl -> (fwd(x, g, w), fwd_bwd(x, g, w, dy) -> (y, grads))."""
    import jax
    import jax.numpy as jnp

    fwds = {
        "pallas_mosaic": lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=1e-6, config=config),
        "xla": xla_fns["xla"],
        "xla_matmul_alone": lambda x, g, w: jnp.dot(x, w),
        "pallas_triton": lambda x, g, w: triton_fn(x, g, w),
    }
    out = {}
    for name, fwd in fwds.items():
        if name == "xla_matmul_alone":
            def fb(x, g, w, dy, fwd=fwd):
                y, vjp = jax.vjp(lambda x, w: fwd(x, g, w), x, w)
                return y, vjp(dy)
        else:
            def fb(x, g, w, dy, fwd=fwd):
                y, vjp = jax.vjp(fwd, x, g, w)
                return y, vjp(dy)
        out[name] = (jax.jit(fwd), jax.jit(fb))
    return out


def norm_section(run: Run, shapes, impls=("pallas_mosaic", "xla", "xla_matmul_alone", "pallas_triton")) -> None:
    import jax
    import jax.numpy as jnp

    from jaxfuse import kernels
    from jaxfuse.suites import rmsnorm_matmul as suite
    from pallas_kernels import reference
    from pallas_kernels import rmsnorm_matmul as triton_fn
    from pallas_kernels.gemm.mosaic import gemm

    nm = importlib.import_module("pallas_kernels.norm_matmul.mosaic")
    log(f"section 2: rmsnorm_matmul at {shapes}")
    fns = norm_fns(nm, triton_fn, kernels.NORM_MATMUL)
    ref = jax.jit(lambda x, g, w, dy: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(reference.rmsnorm_matmul, x, g, w)))
    for M, K, N in shapes:
        if run.left() < 30:
            log("  out of time"); return
        shape = f"{M}x{K}x{N}"
        x, g, w, dy = suite.make_inputs(M, K, N, seed=0)
        reason = nm.unsupported_reason(M, K, N, jnp.bfloat16, False)
        mosaic_extra = None
        if "pallas_mosaic" in impls and reason:
            log(f"  {shape} mosaic unsupported: {reason}")
        elif "pallas_mosaic" in impls:  # checked once, on the timing inputs, before any timing
            try:
                y_ref, grads_ref = ref(x, g, w, dy)
                got = fns["pallas_mosaic"][1](x, g, w, dy)
                errs = dict(zip(("y", "dx", "dgamma", "dw"), map(rel_err, (got[0], *got[1]), (y_ref, *grads_ref))))
                del y_ref, grads_ref, got
                if all(e <= MAX_REL_ERR for e in errs.values()):
                    mosaic_extra = dict(rel_err=errs, config=nm.default_config(M, K, N).to_dict())
                else:
                    log(f"  {shape} mosaic REJECTED: {errs}")
            except Exception as e:  # noqa: BLE001
                log(f"  {shape} mosaic FAILED: {type(e).__name__}: {str(e)[:300]}")
        for mode, flops in (("fwd", 2.0 * M * K * N), ("fwd+bwd", 6.0 * M * K * N)):
            for impl in impls:
                if run.left() < 10 or (impl == "pallas_mosaic" and mosaic_extra is None):
                    continue
                try:
                    fwd, fb = fns[impl]
                    args = (x, g, w) if mode == "fwd" else (x, g, w, dy)
                    run.add("rmsnorm_matmul", shape, mode, impl, run.time(fwd if mode == "fwd" else fb, args),
                            flops, **(mosaic_extra if impl == "pallas_mosaic" else {}))
                except Exception as e:  # noqa: BLE001 - one failing implementation must not end the run
                    log(f"  {shape} {mode} {impl} FAILED: {type(e).__name__}: {str(e)[:300]}")
        run.write()


def parts_section(run: Run, shapes) -> None:
    """The plain GEMMs with the fused kernels' tiles and operand layouts: fused kernel − plain = the hooks' cost."""
    import jax
    import jax.numpy as jnp

    from jaxfuse.suites import rmsnorm_matmul as suite
    from pallas_kernels.gemm.mosaic import gemm

    nm = importlib.import_module("pallas_kernels.norm_matmul.mosaic")
    log(f"section: plain GEMMs with the fused kernels' tiles at {shapes}")
    for M, K, N in shapes:
        if run.left() < 15:
            log("  out of time"); return
        shape = f"{M}x{K}x{N}"
        x, g, w, dy = suite.make_inputs(M, K, N, seed=0)
        cfg = nm.default_config(M, K, N)
        ws = (g.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)
        plain = {"plain_fwd_gemm": (lambda a, b: gemm(a, b, config=cfg.forward, out_dtype=a.dtype)[0], (x, ws)),
                 "plain_dx_gemm": (lambda a, b: gemm(a, b, config=cfg.dx, out_dtype=a.dtype, transpose_b=True)[0],
                                   (dy, ws)),
                 "plain_dw_gemm": (lambda a, b: gemm(a, b, config=cfg.dw, out_dtype=a.dtype, transpose_a=True)[0],
                                   (x, dy)),
                 "xla_scale_w": (lambda g, w: (g.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(
                     w.dtype), (g, w))}
        for name, (fn, args) in plain.items():
            try:
                run.add("rmsnorm_matmul", shape, "parts", name, run.time(jax.jit(fn), args), 2.0 * M * K * N)
            except Exception as e:  # noqa: BLE001
                log(f"  {shape} {name} FAILED: {type(e).__name__}: {str(e)[:300]}")
        run.write()


def pytest_section(run: Run, out_dir: str, selection: str) -> None:
    """The GPU tests the timing does not cover (fp16 at 1e-6, extreme magnitudes, NaN), within the time left."""
    import subprocess

    timeout = run.left() - 5
    if timeout < 20:
        log("pytest: out of time"); return
    log(f"section: pytest {selection} (timeout {timeout:.0f} s)")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection.split()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
        status, text = f"exit {proc.returncode}", proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status, text = f"TIMED OUT after {timeout:.0f} s", (e.stdout or b"").decode(errors="replace")
    with open(os.path.join(out_dir, "pytest.txt"), "w") as f:
        f.write(f"{status}\n{text}")
    log(f"pytest {status}:\n" + "\n".join(text.strip().splitlines()[-12:]))


def checked_time(run: Run, op, shape, mode, impl, fn, args, got_want, flops, **extra) -> float | None:
    """fn checked against the float32 reference (``got_want(out) -> [(got, want), ...]``), then timed; returns µs.
    The log names each variant before it runs.
    A rejection or a failure is logged and returns None: one variant never ends the section."""
    try:
        log(f"  {shape} {mode} {impl}: compiling, checking")
        out = fn(*args)
        errs = [rel_err(g, w) for g, w in got_want(out)]
        del out
        if not all(e <= MAX_REL_ERR for e in errs):  # NaN fails
            log(f"  {shape} {mode} {impl} REJECTED: relative errors {errs}"); return None
        log(f"  {shape} {mode} {impl}: checked ({max(errs):.1e}), timing")  # a hang shows which variant
        time_us = run.add(op, shape, mode, impl, run.time(fn, args), flops, rel_err=max(errs), **extra).time_us
        run.write()  # after every variant: a kernel that hangs loses nothing measured before it
        return time_us
    except Exception as e:  # noqa: BLE001
        log(f"  {shape} {mode} {impl} FAILED: {type(e).__name__}: {str(e)[:300]}"); return None


def plain_variants(M: int, K: int, N: int) -> dict:
    """impl -> (a, b) -> a @ b: cuBLAS, jax's shipped Hopper example (imported, as a baseline) and our K loops."""
    import dataclasses

    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as example

    from pallas_kernels.gemm import default_config, matmul

    base = default_config(M, N, K)
    dim = example.MatmulDimension
    tuning = example.TuningConfig(tile_m=base.tile_m, tile_n=base.tile_n, tile_k=base.tile_k,
                                  max_concurrent_steps=base.num_stages,
                                  wg_dimension=dim.N if base.wg_split == "n" else dim.M)
    out = {"xla": jnp.dot, "jax_example": lambda a, b: example.matmul(a, b, None, tuning)}
    if M % (2 * base.cta_m) == 0:  # two CTAs of a cluster share the B tile (TMA multicast)
        clustered = dataclasses.replace(tuning, cluster_dimension=dim.M)
        out["jax_example[cluster m]"] = lambda a, b: example.matmul(a, b, None, clustered)
    for name, fields in PLAIN_OURS:
        cfg = dataclasses.replace(base, **fields)
        out[f"pallas_mosaic[{name}]"] = lambda a, b, cfg=cfg: matmul(a, b, config=cfg)
    return out


# Our plain GEMM's K loops, old first (what the last H100 run measured); the shapes' default tiles.
PLAIN_OURS = [("pallas,lane", {}), ("pallas,warpgroup", dict(semantics="warpgroup")),
              ("pallas_steady,lane", dict(pipeline="pallas_steady")),
              ("pallas_steady,warpgroup", dict(pipeline="pallas_steady", semantics="warpgroup")),
              ("own,lane", dict(pipeline="own")), ("own,warpgroup", dict(pipeline="own", semantics="warpgroup")),
              ("own,lane,delay1", dict(pipeline="own", delay_release=1))]
PLAIN_SHAPES = [(32768, 4096, 4096), (8192, 4096, 6144), (16384, 1024, 5504)]  # (M, K, N)


def plain_section(run: Run, shapes=PLAIN_SHAPES) -> None:
    """(a) The plain GEMM: cuBLAS, jax's example, our K loops and semantics, each checked, then timed."""
    import jax
    import jax.numpy as jnp

    log(f"section plain: GEMM K loops at {shapes}")
    for M, K, N in shapes:
        if run.left() < 20:
            log("  out of time"); return
        ka, kb = jax.random.split(jax.random.key(M + N))
        a = jax.random.normal(ka, (M, K), jnp.bfloat16)
        b = (jax.random.normal(kb, (K, N), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
        want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
        for impl, fn in plain_variants(M, K, N).items():
            if run.left() < 8:
                break
            checked_time(run, "matmul_plain", f"{M}x{K}x{N}", "fwd", impl, jax.jit(fn), (a, b),
                         lambda out: [(out, want)], 2.0 * M * N * K)
        del want
        run.write()


def place_variants(nm, M: int, K: int, N: int) -> dict:
    """impl -> MosaicRMSNormMatmulConfig: where the row statistics come from (XLA passes / the MMA warpgroups'
    prologue / a dedicated fourth warpgroup), on jax's K loop (pallas) or ours (own)."""
    import dataclasses

    def own(c, kernels=("forward", "dx", "dw")):
        return dataclasses.replace(c, **{k: dataclasses.replace(getattr(c, k), pipeline="own") for k in kernels})

    xla = nm.default_config(M, K, N)
    in_kernel = dict(stats_in_kernel=True, rowdot_in_kernel=True)
    return {"pallas_mosaic[stats=xla]": xla, "pallas_mosaic[stats=xla,own]": own(xla),
            "pallas_mosaic[stats=compute]": nm.default_config(M, K, N, **in_kernel),
            "pallas_mosaic[stats=dedicated]": own(nm.default_config(M, K, N, prologue_wg="dedicated", **in_kernel)),
            "pallas_mosaic[stats=dedicated fwd,xla dx]": own(nm.default_config(
                M, K, N, prologue_wg="dedicated", stats_in_kernel=True))}


def place_section(run: Run, shapes) -> None:
    """(b) rmsnorm_matmul fwd and fwd+bwd with each statistics placement vs XLA norm+matmul and matmul alone."""
    import jax

    from jaxfuse import kernels
    from jaxfuse.suites import rmsnorm_matmul as suite
    from pallas_kernels import reference

    nm = importlib.import_module("pallas_kernels.norm_matmul.mosaic")
    log(f"section place: statistics placements at {shapes}")
    ref = jax.jit(lambda x, g, w, dy: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(reference.rmsnorm_matmul, x, g, w)))
    for M, K, N in shapes:
        if run.left() < 30:
            log("  out of time"); return
        shape, (x, g, w, dy) = f"{M}x{K}x{N}", suite.make_inputs(M, K, N, seed=0)
        y_ref, grads_ref = ref(x, g, w, dy)
        fns = {**norm_fns(nm, None, kernels.NORM_MATMUL, None)}
        fns.pop("pallas_triton"), fns.pop("pallas_mosaic")
        for impl, config in place_variants(nm, M, K, N).items():
            fns[impl] = norm_fns(nm, None, kernels.NORM_MATMUL, config)["pallas_mosaic"]
        for mode, flops in (("fwd", 2.0 * M * K * N), ("fwd+bwd", 6.0 * M * K * N)):
            for impl, (fwd, fb) in fns.items():
                if run.left() < 8:
                    break
                if mode == "fwd":
                    checked_time(run, "rmsnorm_matmul_place", shape, mode, impl, fwd, (x, g, w),
                                 lambda out: [(out, y_ref)], flops)
                else:
                    checked_time(run, "rmsnorm_matmul_place", shape, mode, impl, fb, (x, g, w, dy),
                                 lambda out: list(zip((out[0], *out[1]), (y_ref, *grads_ref))), flops)
        del y_ref, grads_ref
        run.write()


def winner_section(run: Run, M: int = 32768, K: int = 4096, N: int = 4096) -> None:
    """(c) A small tile / order sweep of the fastest of our plain K loops from section plain at (M, K, N)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from pallas_kernels.gemm import default_config, matmul

    shape = f"{M}x{K}x{N}"
    ours = [r for r in run.records if r.op == "matmul_plain" and r.shape == shape and r.implementation in
            {f"pallas_mosaic[{n}]" for n, _ in PLAIN_OURS}]
    if not ours:
        log("section winner: no plain record of ours at this shape"); return
    best = min(ours, key=lambda r: r.time_us).implementation
    fields = dict(PLAIN_OURS)[best[len("pallas_mosaic["):-1]]
    base = dataclasses.replace(default_config(M, N, K), **fields)
    log(f"section winner: sweep of {best} at {shape}")
    ka, kb = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, (M, K), jnp.bfloat16)
    b = (jax.random.normal(kb, (K, N), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    sweep = [dict(grid_tile_width=8), dict(grid_minor="m", grid_tile_width=8), dict(grid_tile_width=16),
             dict(grid_minor="m", grid_tile_width=4), dict(num_stages=3), dict(tile_k=128, num_stages=2),
             dict(tile_m=64, tile_n=256, wg_split="m"), dict(epi_tile_n=128, num_stages=3)]
    for change in sweep:
        if run.left() < 8:
            log("  out of time"); break
        try:
            cfg = dataclasses.replace(base, **change)
        except ValueError as e:
            log(f"  skipped {change}: {e}"); continue
        checked_time(run, "matmul_winner", shape, "fwd", f"{best}+{change}",
                     jax.jit(lambda a, b, cfg=cfg: matmul(a, b, config=cfg)), (a, b), lambda out: [(out, want)],
                     2.0 * M * N * K, config=cfg.to_dict())
    run.write()


def table(run: Run) -> str:
    """shape, mode, mosaic, XLA norm+matmul, XLA matmul, Triton (µs) and the ratios."""
    rows = {}
    for r in run.records:
        if r.op in ("rmsnorm_matmul", "matmul"):
            rows.setdefault((r.op, r.shape, r.mode), {})[r.implementation] = r.time_us
    lines = [f"{'op':15s} {'shape':17s} {'mode':8s} {'mosaic':>8s} {'xla':>8s} {'xla_mm':>8s} {'triton':>8s} "
             f"{'xla/mos':>8s} {'mm/mos':>7s} {'tri/mos':>7s}"]
    for (op, shape, mode), t in rows.items():
        mos = t.get("pallas_mosaic")
        def f(v):
            return f"{v:8.1f}" if v else f"{'-':>8s}"
        def q(v):
            return f"{v / mos:7.3f}" if v and mos else f"{'-':>7s}"
        lines.append(f"{op:15s} {shape:17s} {mode:8s} {f(mos)} {f(t.get('xla'))} {f(t.get('xla_matmul_alone'))} "
                     f"{f(t.get('pallas_triton'))} {q(t.get('xla')):>8s} {q(t.get('xla_matmul_alone'))} "
                     f"{q(t.get('pallas_triton'))}")
        for k, v in t.items():
            if k.startswith("plain_") or k.startswith("pallas_mosaic_"):
                lines.append(f"{'':15s} {shape:17s} {k:26s} {v:8.1f}")
    for r in run.records:
        if r.op.endswith("_sweep"):
            lines.append(f"{r.op:20s} {r.shape:17s} {r.mode:8s} {r.time_us:8.1f}  {r.implementation}")
    groups = {}
    for r in run.records:  # sections plain / place / winner: every variant with its speed vs XLA in the same run
        if r.op in ("matmul_plain", "rmsnorm_matmul_place", "matmul_winner"):
            groups.setdefault((r.op, r.shape, r.mode), []).append(r)
    for (op, shape, mode), recs in groups.items():
        xla = {r.implementation: r.time_us for r in run.records
               if r.shape == shape and r.mode == mode and r.implementation == "xla"
               and r.op in (op, "matmul_plain" if op == "matmul_winner" else op)}.get("xla")
        lines.append(f"{op} {shape} {mode}")
        for r in sorted(recs, key=lambda r: r.time_us):
            ratio = f"{xla / r.time_us:6.3f}x xla" if xla else ""
            lines.append(f"    {r.time_us:9.1f} µs  {ratio:12s} {r.implementation}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--sections",
                        default="probe,plain,place,winner,norm,gemm,parts,triton,norm_train,pytest,decode")
    parser.add_argument("--pytest", default="tests/test_norm_matmul_mosaic.py -k extreme_magnitudes_on_the_gpu")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sections = args.sections.split(",")
    if "probe" in sections:
        probe(args.out)
    run = Run(args.out, args.iterations, T0 + args.budget_s)
    big, train = NORM_SHAPES[:3], NORM_SHAPES[3:]
    steps = {"gemm": lambda: gemm_section(run),
             "norm": lambda: norm_section(run, big, impls=("pallas_mosaic", "xla", "xla_matmul_alone")),
             "parts": lambda: parts_section(run, big[:2]),
             "norm_train": lambda: norm_section(run, train, impls=("pallas_mosaic", "xla", "xla_matmul_alone")),
             "triton": lambda: norm_section(run, NORM_SHAPES, impls=("pallas_triton",)),  # big 3 first
             "pytest": lambda: pytest_section(run, args.out, args.pytest),
             "decode": lambda: norm_section(run, DECODE_SHAPES, impls=("pallas_mosaic", "xla", "pallas_triton")),
             "plain": lambda: plain_section(run),
             "place": lambda: place_section(run, [NORM_SHAPES[0], NORM_SHAPES[2], NORM_SHAPES[1], NORM_SHAPES[3]]),
             "winner": lambda: winner_section(run)}
    for name in sections:
        if name in steps:
            try:
                steps[name]()
            except Exception:  # noqa: BLE001 - report and go on with the next section
                log(f"section {name} FAILED:\n{traceback.format_exc()[-2000:]}")
            if run.records:
                run.write()
    print(table(run), flush=True)
    log(f"wrote {run.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
