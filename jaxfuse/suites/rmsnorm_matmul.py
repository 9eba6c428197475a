"""RMSNorm→matmul suite: the Pallas fused kernel against XLA's norm + matmul and XLA's matmul alone.

    from jaxfuse.suites import rmsnorm_matmul as suite
    records = suite.run(["16x4096x4096-decode"], iterations=20)     # GPU; ["cpu"] for a smoke run on CPU

Per shape (M×K×N, bf16) and mode (forward; forward + backward with a random cotangent, gradients for x, gamma
and w, for x and w with the matmul alone), three implementations are timed side by side in one run:
  pallas            ``pallas_kernels.rmsnorm_matmul`` (the normalized activations never reach HBM)
  xla               ``jaxfuse.kernels.NORM_MATMUL["xla"]``: XLA's norm fusion writes rmsnorm(x), a GEMM reads it
  xla_matmul_alone  ``x @ w``: no norm at all, the floor a fused kernel can reach
  xla_rowscale      plain jnp with the norm moved past the GEMM by algebra, y = r ⊙ (x @ (γ ∘ w)) (r is one
                    scalar per row): no normalized tensor exists at all. What a user gets from rewriting the
                    math instead of writing a kernel (on the H100 XLA runs the row scale as a pass of its own
                    over y instead of in its GEMM's epilogue, and rescales w on every call).
  xla_f32_out       the xla pair with ``preferred_element_type=float32`` on the dot, then a cast: a common way
                    to write "accumulate in float32" that JAX transposes into float32 backward GEMMs (TF32 on
                    the GPU) fed by convert kernels. Shown to measure that pitfall; not a baseline of the targets.
All XLA dots are plain bf16 ``jnp.dot`` (the GEMMs accumulate in float32 internally).
The floor column is the roofline of the matmul alone: max(FLOPs at the device's measured bf16 rate, bytes at its
measured HBM bandwidth), bytes = x + w + y forward, 3·(x + w + y) forward + backward (each of the three GEMMs
reads two of the operands and writes the third). Each pallas row also records its relative error against the
float32 reference (``extra["rel_err"]``), so a fast wrong kernel cannot pass unseen.
"""

from __future__ import annotations

import gc
import math
import sys
import traceback

import jax
import jax.numpy as jnp

from jaxfuse import bench, costmodel, kernels
from pallas_kernels import reference, triton_utils
from pallas_kernels.norm_matmul import rmsnorm_matmul as fused_rmsnorm_matmul
from pallas_kernels.norm_matmul.config import default_config

__all__ = ["DEFAULT_SHAPES", "SHAPES", "make_inputs", "run", "summary_table"]

OP = "rmsnorm_matmul"
# name -> shape; "note" says what the shape stands for. "cpu" is a smoke shape small enough for interpret mode.
SHAPES = {
    "32768x4096x4096": dict(M=32768, K=4096, N=4096, note="training step, square projection"),
    "4096x4096x14336": dict(M=4096, K=4096, N=14336, note="MLP up projection"),
    "8192x4096x6144-qkv": dict(M=8192, K=4096, N=6144, note="fused QKV projection (GQA 32q/8kv heads of 128)"),
    "16x4096x4096-decode": dict(M=16, K=4096, N=4096, note="decode, 16 sequences"),
    "1x4096x14336-decode": dict(M=1, K=4096, N=14336, note="decode, one sequence"),
    "cpu": dict(M=37, K=64, N=32, note="smoke shape for CPU (interpret mode)"),
}
DEFAULT_SHAPES = ["32768x4096x4096", "4096x4096x14336", "8192x4096x6144-qkv", "16x4096x4096-decode",
                  "1x4096x14336-decode"]
_DTYPE = jnp.bfloat16
_MAX_CPU_FLOPS = 1e9  # beyond this a shape is skipped on CPU: interpret mode would run for hours
_IMPLS = ("pallas", "xla", "xla_matmul_alone", "xla_rowscale", "xla_f32_out")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_inputs(M: int, K: int, N: int, seed: int):
    """(x (M, K), gamma (K,), w (K, N), dy (M, N)) in bf16 from one seed; w scaled by K^-1/2."""
    kx, kg, kw, kd = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(_DTYPE)
    gamma = (1.0 + 0.1 * jax.random.normal(kg, (K,), jnp.float32)).astype(_DTYPE)
    w = (jax.random.normal(kw, (K, N), jnp.float32) * K**-0.5).astype(_DTYPE)
    dy = jax.random.normal(kd, (M, N), jnp.float32).astype(_DTYPE)
    return x, gamma, w, dy


def rowscale_rmsnorm_matmul(x, gamma, w, *, eps: float = 1e-6):
    """rmsnorm(x) · γ @ w as r ⊙ (x @ (γ ∘ w)), r = rsqrt(mean(x², K) + eps) per row: x (M, K), w (K, N) bf16."""
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # (M, 1) float32
    w_scaled = (gamma.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)  # (K, N)
    return (jnp.dot(x, w_scaled).astype(jnp.float32) * r).astype(x.dtype)


def _forward_fns():
    """impl -> f(x, gamma, w) -> y."""
    return {
        "pallas": lambda x, g, w: fused_rmsnorm_matmul(x, g, w),
        "xla": lambda x, g, w: kernels.NORM_MATMUL["xla"](x, g, w),
        "xla_matmul_alone": lambda x, g, w: jnp.dot(x, w),
        "xla_rowscale": rowscale_rmsnorm_matmul,
        "xla_f32_out": lambda x, g, w: jnp.dot(reference.rmsnorm(x, g), w,
                                               preferred_element_type=jnp.float32).astype(x.dtype),
    }


def _fwd_bwd_fns():
    """impl -> f(x, gamma, w, dy) -> (y, grads): one forward and the backward for a given cotangent."""
    out = {}
    for name, fwd in _forward_fns().items():
        if name == "xla_matmul_alone":
            def fn(x, g, w, dy, fwd=fwd):
                y, vjp = jax.vjp(lambda x, w: fwd(x, g, w), x, w)
                return y, vjp(dy)
        else:
            def fn(x, g, w, dy, fwd=fwd):
                y, vjp = jax.vjp(fwd, x, g, w)
                return y, vjp(dy)
        out[name] = fn
    return out


def _rel_err(got, want) -> float:
    """max |got - want| / max |want| (computed on device, in float32)."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def _check_errors(x, gamma, w, dy) -> dict[str, float]:
    """Relative errors of the fused kernel against the float32 reference: forward y and the three gradients."""
    fused = jax.jit(_fwd_bwd_fns()["pallas"])
    ref = jax.jit(lambda x, g, w, dy: (lambda y, vjp: (y, vjp(dy)))(
        *jax.vjp(lambda x, g, w: reference.rmsnorm_matmul(x, g, w), x, g, w)))
    with triton_utils.quiet_triton_deprecation():
        y, grads = fused(x, gamma, w, dy)
    y_ref, grads_ref = ref(x, gamma, w, dy)
    errors = {"y": _rel_err(y, y_ref)}
    for name, g, r in zip(("dx", "dgamma", "dw"), grads, grads_ref):
        errors[name] = _rel_err(g, r)
    return errors


def _floor(M: int, K: int, N: int, mode: str, dev: costmodel.DeviceSpec) -> tuple[float, float, float]:
    """(FLOPs, bytes, floor µs) of the matmul alone in this mode."""
    item = jnp.dtype(_DTYPE).itemsize
    one_pass = item * (M * K + K * N + M * N)
    flops, bytes_moved = (2.0 * M * K * N, one_pass) if mode == "fwd" else (6.0 * M * K * N, 3.0 * one_pass)
    return flops, bytes_moved, max(dev.memory_us(bytes_moved), dev.compute_us(flops))


def _config_summary(M: int, K: int, N: int) -> dict:
    return default_config(M, K, N, _DTYPE).to_dict()


def _run_shape(name: str, shape: dict, iterations: int, dev: costmodel.DeviceSpec) -> list[bench.Record]:
    M, K, N = shape["M"], shape["K"], shape["N"]
    item = jnp.dtype(_DTYPE).itemsize
    set_bytes = item * (M * K + K * N + 2 * M * N)
    # Rotate several input sets when one set would sit in L2 between iterations.
    num_sets = 3 if dev.l2_bytes and set_bytes < dev.l2_bytes else 1
    arg_sets = [make_inputs(M, K, N, seed) for seed in range(num_sets)]
    label = f"{M}x{K}x{N}"
    records: list[bench.Record] = []

    errors: dict[str, float] = {}
    try:
        errors = _check_errors(*arg_sets[0])
        _log(f"  {name}: relative errors vs float32 reference {', '.join(f'{k} {v:.1e}' for k, v in errors.items())}")
    except Exception as e:  # noqa: BLE001 -- recorded, the timings still run
        errors = {"error": f"{type(e).__name__}: {e}"}
        _log(f"  {name}: correctness check failed: {errors['error']}\n{traceback.format_exc(limit=3)}")

    for mode, fns in (("fwd", _forward_fns()), ("fwd+bwd", _fwd_bwd_fns())):
        flops, bytes_moved, floor_us = _floor(M, K, N, mode, dev)
        times: dict[str, bench.Timing | None] = {}
        failures: dict[str, str] = {}
        for impl in _IMPLS:
            args = [a[:3] for a in arg_sets] if mode == "fwd" else arg_sets
            try:
                with triton_utils.quiet_triton_deprecation():
                    times[impl] = bench.time_kernels(jax.jit(fns[impl]), args, iterations=iterations)
                _log(f"  {name} {mode:8s} {impl:17s} {times[impl].median_us:10.1f} µs")
            except Exception as e:  # noqa: BLE001 -- one failing implementation must not stop the suite
                times[impl] = None
                failures[impl] = f"{type(e).__name__}: {str(e)[:500]}"
                _log(f"  {name} {mode} {impl} failed: {failures[impl]}")
        for impl in _IMPLS:
            timing = times[impl]
            t = timing.median_us if timing else math.nan
            speedup = {base: (times[base].median_us / t) for base in ("xla", "xla_matmul_alone")
                       if base != impl and times.get(base) and timing}
            extra: dict = {"shape_name": name, "note": shape.get("note", ""), "input_sets": num_sets}
            if timing:
                extra.update(per_kernel_us={k: round(v, 2) for k, v in timing.per_kernel_us.items()},
                             spread=round(timing.spread, 3))
            if impl in failures:
                extra["error"] = failures[impl]
            if impl == "pallas":
                extra["rel_err"] = errors if mode == "fwd+bwd" else {k: v for k, v in errors.items()
                                                                      if k in ("y", "error")}
                try:
                    extra["config"] = _config_summary(M, K, N)
                except Exception:  # noqa: BLE001
                    pass
            records.append(bench.Record(
                op=OP, shape=label, dtype=jnp.dtype(_DTYPE).name, implementation=impl, mode=mode, time_us=t,
                method=timing.method if timing else "failed", flops=flops, bytes_moved=bytes_moved,
                floor_us=floor_us, speedup_vs=speedup, extra=extra).finish())
    return records


def run(shape_names=None, *, iterations: int = 50) -> list[bench.Record]:
    """Times every implementation at each named shape (default DEFAULT_SHAPES) in forward and forward + backward.

    A shape or implementation that fails is recorded (NaN time, ``extra["error"]``) and the run goes on. On CPU,
    shapes too large for interpret mode are skipped with a message (use ["cpu"])."""
    names = list(DEFAULT_SHAPES if shape_names is None else shape_names)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"shape_names: unknown {unknown}; {OP} has {list(SHAPES)}")
    on_gpu = jax.default_backend() == "gpu"
    dev = costmodel.detect()
    records: list[bench.Record] = []
    for name in names:
        shape = SHAPES[name]
        if not on_gpu and 2.0 * shape["M"] * shape["K"] * shape["N"] > _MAX_CPU_FLOPS:
            _log(f"  {name}: skipped on {jax.default_backend()} (interpret mode would take hours); try 'cpu'")
            continue
        _log(f"{OP} {name} ({shape['M']}x{shape['K']}x{shape['N']}, {shape.get('note', '')})")
        try:
            records += _run_shape(name, shape, iterations, dev)
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory making inputs; the next shape still runs
            _log(f"  {name} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
            records.append(bench.Record(op=OP, shape=f"{shape['M']}x{shape['K']}x{shape['N']}",
                                        dtype=jnp.dtype(_DTYPE).name, implementation="pallas", mode="fwd",
                                        time_us=math.nan, method="failed",
                                        extra={"shape_name": name, "error": f"{type(e).__name__}: {e}"}))
        gc.collect()
    return records


def summary_table(records) -> str:
    """One line per shape: µs of each implementation in each mode and the ratios the issue's targets use."""
    rows = ["| shape | mode | pallas µs | xla µs | matmul alone µs | pallas/alone | xla/pallas | max rel err |",
            "|---|---|---|---|---|---|---|---|"]
    by_key: dict = {}
    for r in records:
        by_key.setdefault((r.shape, r.mode), {})[r.implementation] = r
    for (shape, mode), impls in by_key.items():
        get = lambda n: impls[n].time_us if n in impls else math.nan  # noqa: E731
        p, x, a = get("pallas"), get("xla"), get("xla_matmul_alone")
        errs = impls.get("pallas").extra.get("rel_err", {}) if "pallas" in impls else {}
        err = max([v for v in errs.values() if isinstance(v, float)] or [math.nan])
        rows.append(f"| {shape} | {mode} | {p:.1f} | {x:.1f} | {a:.1f} | {p / a:.3f} | {x / p:.3f} | {err:.1e} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m jaxfuse.suites.rmsnorm_matmul [shape ...]
    recs = run(sys.argv[1:] or None, iterations=20)
    print(bench.markdown_table(recs))
    print(summary_table(recs))
