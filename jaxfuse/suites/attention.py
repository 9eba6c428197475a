"""Attention suite: the Pallas flash-attention kernel against cuDNN's fused attention and plain-jnp XLA, side by side.

    from jaxfuse.suites import attention as suite
    records = suite.run(["main"], iterations=20)      # GPU; ["cpu"] for a smoke run on CPU (interpret mode)

Per shape (q (B, T, N, H), k/v (B, S, K, H), bf16), causal setting (non-causal and causal) and mode ("fwd": the
output; "fwd+bwd": ``jax.vjp`` with a random cotangent, one jitted program returning o and all three gradients),
three implementations are timed in one run (device-kernel time on GPU, 2 rotated sets of fresh N(0, 1) inputs):
  pallas  ``pallas_kernels.flash_attention`` (scores live only as tiles; residuals are o and a (B, N, T) lse)
  cudnn   ``jax.nn.dot_product_attention(implementation="cudnn")``; recorded as failed off GPU or if it raises
  xla     plain jnp as a user writes it: bf16 einsums, a float32 softmax over the materialized (B, N, T, S)
          scores, bf16 probabilities (the "XLA, plain jnp" row of shared/anchors.md; the model's "xla" site,
          ``jaxfuse.kernels.plain_attention``).
          Skipped (recorded) where the float32 scores would exceed ``XLA_MAX_SCORES_BYTES``.
  xla_f32 (opt-in, ``impls=``) ``pallas_kernels.reference.attention``: float32, HIGHEST precision; the reference.

FLOPs are 4·B·N·T·S·H (the two GEMMs), halved when causal, and 3.5× that for fwd+bwd (the convention of
shared/anchors.md); the floor is those FLOPs at the device's measured bf16 rate (``costmodel.detect()``: 805
TFLOP/s on the H100). ``speedup_vs`` holds baseline time / this time for "cudnn" and "xla" (< 1: slower).

Every record's ``extra`` carries: ``rel_error`` (max |x − ref| / max |ref| against the float32 reference on batch
element 0, over o for fwd and o, dq, dk, dv for fwd+bwd; the per-output values in ``rel_errors``), ``top_kernels``
(per-kernel µs, largest first), ``temp_bytes`` (``compiled.memory_analysis().temp_size_in_bytes`` of the timed
program: for pallas fwd+bwd the evidence of O(B·N·T) residuals, to set beside ``scores_f32_bytes``), and for
pallas the ``config`` used and where it came from. A failing implementation is a record with NaN time,
``method="failed"`` and ``extra["error"]``; the others still run.
"""

from __future__ import annotations

import gc
import math
import sys
import time
import traceback
from typing import Callable

from jaxfuse import bench, costmodel

__all__ = ["DEFAULT_SHAPES", "IMPLEMENTATIONS", "SHAPES", "XLA_MAX_SCORES_BYTES", "make_inputs", "run",
           "summary_table"]

OP = "attention"
# name -> shape: q (B, T, N, H), k/v (B, S, K, H). Every shape runs non-causal and causal. The tokens B·T stay at
# the main shape's 16384 throughout; h64 also keeps N·H (so its GEMM FLOPs equal main's); gqa is anchors.md's
# 32 query / 8 kv heads of 128 (twice main's FLOPs).
SHAPES = {
    "main": dict(B=4, T=4096, S=4096, N=16, K=16, H=128, note="the issue's main shape (anchors.md)"),
    "1k": dict(B=16, T=1024, S=1024, N=16, K=16, H=128, note="short sequences, same tokens"),
    "8k": dict(B=2, T=8192, S=8192, N=16, K=16, H=128, note="long sequences, same tokens"),
    "gqa": dict(B=4, T=4096, S=4096, N=32, K=8, H=128, note="grouped-query attention, 32 q / 8 kv heads"),
    "h64": dict(B=4, T=4096, S=4096, N=32, K=32, H=64, note="head dim 64, N·H as the main shape"),
    "cpu": dict(B=2, T=40, S=40, N=4, K=2, H=32, note="smoke shape for CPU (interpret mode; odd T, GQA)"),
}
DEFAULT_SHAPES = ("main", "1k", "8k", "gqa", "h64")
IMPLEMENTATIONS = ("pallas", "cudnn", "xla")  # the default set; "xla_f32" is opt-in
MODES = ("fwd", "fwd+bwd")
XLA_MAX_SCORES_BYTES = 20e9  # plain-jnp XLA is skipped where the (B, N, T, S) float32 scores exceed this
_NUM_INPUT_SETS = 2
_MAX_CPU_FLOPS = 1e9  # beyond this a shape is skipped on CPU: interpret mode would run for hours
_FWD_BWD_FACTOR = 3.5


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Implementations: f(q, k, v, *, causal) -> o (B, T, N, H) in q.dtype
# ---------------------------------------------------------------------------------------------------------------
def _xla_attention(q, k, v, *, causal: bool):
    """The model's "xla" attention site, ``jaxfuse.kernels.plain_attention``: bf16 einsums, a float32 softmax over
    the materialized scores, bf16 probabilities (every GEMM of forward and backward bf16 x bf16)."""
    from jaxfuse import kernels

    return kernels.plain_attention(q, k, v, causal=causal)


def _cudnn_attention(q, k, v, *, causal: bool):
    import jax

    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _reference_attention(q, k, v, *, causal: bool):
    from pallas_kernels import reference

    return reference.attention(q, k, v, causal=causal)


def _pallas_attention(block_sizes=None) -> Callable:
    from pallas_kernels import flash_attention

    def fn(q, k, v, *, causal: bool):
        return flash_attention(q, k, v, causal=causal, block_sizes=block_sizes)

    return fn


def _skip_reason(impl: str, shape: dict, *, on_gpu: bool, backend: str, xla_max_scores_bytes: float) -> str | None:
    """Why `impl` cannot run here (recorded as the error), or None."""
    if impl == "cudnn" and not on_gpu:
        return f"cudnn: needs an NVIDIA GPU with cuDNN; the default JAX backend is {backend!r}"
    if impl in ("xla", "xla_f32"):
        scores = _scores_f32_bytes(shape)
        if scores > xla_max_scores_bytes:
            return (f"{impl}: skipped, the (B, N, T, S) float32 scores would take {scores / 1e9:.1f} GB "
                    f"(limit {xla_max_scores_bytes / 1e9:.0f} GB)")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Inputs, reference, cost
# ---------------------------------------------------------------------------------------------------------------
def make_inputs(B: int, T: int, S: int, N: int, K: int, H: int, *, seed: int, dtype=None):
    """(q (B, T, N, H), k (B, S, K, H), v (B, S, K, H), do (B, T, N, H)), N(0, 1) in bf16, a fresh key each."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if dtype is None else dtype
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, T, N, H), jnp.float32).astype(dtype)
    return q, k, v, do


def _fwd_bwd(attn: Callable, causal: bool) -> Callable:
    """(q, k, v, do) -> (o, dq, dk, dv): the forward and the backward for the cotangent do, one program.

    o is returned as a training step uses it: with the gradients alone, XLA's autodiff would drop the forward's
    P·V GEMM as dead code (its backward needs only P), an advantage no real step gives it."""
    import jax

    def fn(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, causal=causal), q, k, v)
        return (o, *vjp(do))

    return fn


def _reference_slice(q, k, v, do, causal: bool):
    """float32 (o, dq, dk, dv) of batch element 0 (reference.attention, HIGHEST precision)."""
    import jax
    import jax.numpy as jnp

    up = lambda x: x[:1].astype(jnp.float32)  # noqa: E731

    @jax.jit
    def ref(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: _reference_attention(q, k, v, causal=causal), q, k, v)
        return (o, *vjp(do))

    return jax.block_until_ready(ref(up(q), up(k), up(v), up(do)))


def _rel_error(got, want) -> float:
    import jax.numpy as jnp

    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def _scores_f32_bytes(s: dict) -> float:
    return 4.0 * s["B"] * s["N"] * s["T"] * s["S"]


def _cost(s: dict, causal: bool, mode: str, dev: costmodel.DeviceSpec) -> tuple[float, float, float]:
    """(FLOPs, bytes, floor µs). FLOPs as anchors.md counts them; bytes: each input read and output written once
    (fwd: q, k, v, o; fwd+bwd adds reading q, k, v, o, do and writing dq, dk, dv). The floor is the roofline without
    a launch cost; at every issue shape it is the compute time."""
    B, T, S, N, K, H = (s[x] for x in "BTSNKH")
    flops = 4.0 * B * N * T * S * H * (0.5 if causal else 1.0)
    q_bytes, kv_bytes = 2.0 * B * T * N * H, 2.0 * B * S * K * H  # bf16
    fwd_bytes = 2 * q_bytes + 2 * kv_bytes
    if mode == "fwd":
        return flops, fwd_bytes, dev.roofline_us(fwd_bytes, flops, launches=0)
    flops *= _FWD_BWD_FACTOR
    bytes_moved = fwd_bytes + 4 * q_bytes + 4 * kv_bytes
    return flops, bytes_moved, dev.roofline_us(bytes_moved, flops, launches=0)


def _label(s: dict, causal: bool) -> str:
    return f"{s['B']}x{s['T']}x{s['S']} N{s['N']}/K{s['K']} H{s['H']}" + (" causal" if causal else "")


def _pallas_config(q, k, causal: bool, cache_path) -> tuple[object | None, dict, str]:
    """(block_sizes to pass, the config as a dict, where it came from). With `cache_path`, an entry there for this
    device and shape wins; otherwise the kernel's own default (the committed cache, then the built-in table)."""
    from pallas_kernels import attention, tuning

    if cache_path is not None:
        params = tuning.lookup("flash_attention", attention.tuning_key(q, k, causal=causal), path=cache_path)
        if params is not None:
            config = attention.FlashAttentionConfig(**params)
            return config, config.to_dict(), f"tuned ({cache_path})"
    return None, attention.plan(q, k, k, causal=causal).config.to_dict(), "default"


def _delete(tree) -> None:
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "delete"):
            try:
                leaf.delete()
            except Exception:  # noqa: BLE001 -- already deleted or donated
                pass


# ---------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------
def _measure(impl: str, attn: Callable, mode: str, sets, ref, causal: bool, iterations: int) -> dict:
    """Compiles, checks against the reference slice and times one implementation in one mode; returns the pieces
    of its record. Raises on failure (the caller records it)."""
    import jax

    from pallas_kernels import triton_utils

    program = jax.jit((lambda q, k, v: attn(q, k, v, causal=causal)) if mode == "fwd" else _fwd_bwd(attn, causal))
    arg_sets = [s[:3] for s in sets] if mode == "fwd" else list(sets)
    with triton_utils.quiet_triton_deprecation():
        compiled = program.lower(*arg_sets[0]).compile()
        out = {}
        try:
            temp = int(compiled.memory_analysis().temp_size_in_bytes)
            out.update(temp_bytes=temp, temp_mib=round(temp / 2**20, 1))
        except Exception as e:  # noqa: BLE001 -- some backends have no memory analysis: not a failure
            out["temp_bytes_error"] = f"{type(e).__name__}: {e}"[:300]
        del compiled
        if ref is not None:
            result = jax.block_until_ready(program(*arg_sets[0]))  # same executable: jit caches the compilation
            names = ("o",) if mode == "fwd" else ("o", "dq", "dk", "dv")
            got = (result,) if mode == "fwd" else tuple(result)
            errors = {n: _rel_error(g[:1], w) for n, g, w in zip(names, got, ref)}
            _delete(result)
            out.update(rel_errors=errors, rel_error=max(errors.values()))
        timing = bench.time_kernels(program, arg_sets, iterations=iterations)
    out["timing"] = timing
    return out


def _failed(label: str, impl: str, mode: str, flops, bytes_moved, floor_us, extra: dict, error: str) -> bench.Record:
    return bench.Record(op=OP, shape=label, dtype="bfloat16", implementation=impl, mode=mode, time_us=math.nan,
                        method="failed", flops=flops, bytes_moved=bytes_moved, floor_us=floor_us,
                        extra=dict(extra, error=error[:2000])).finish()


def _run_one(name: str, s: dict, causal: bool, *, iterations: int, impls, dev, cache_path, on_gpu: bool,
             backend: str, xla_max_scores_bytes: float, progress) -> list[bench.Record]:
    """All implementations × modes at one shape and causal setting."""
    import jax

    label = _label(s, causal)
    base_extra = {"shape_name": name, "causal": causal, "note": s.get("note", ""), "input_sets": _NUM_INPUT_SETS,
                  "scores_f32_bytes": int(_scores_f32_bytes(s))}
    sets = [make_inputs(s["B"], s["T"], s["S"], s["N"], s["K"], s["H"], seed=seed)
            for seed in range(_NUM_INPUT_SETS)]
    ref, ref_error = None, None
    try:
        ref = _reference_slice(*sets[0], causal)
    except Exception as e:  # noqa: BLE001 -- timings still run; rel_error is then missing, with the reason
        ref_error = f"float32 reference failed: {type(e).__name__}: {e}"[:500]
        progress(f"  [{label}] {ref_error}")

    records: list[bench.Record] = []
    for impl in impls:
        extra_impl = dict(base_extra)
        attn = None
        skip = _skip_reason(impl, s, on_gpu=on_gpu, backend=backend, xla_max_scores_bytes=xla_max_scores_bytes)
        if skip is None:
            try:
                if impl == "pallas":
                    block_sizes, config, source = _pallas_config(sets[0][0], sets[0][1], causal, cache_path)
                    extra_impl.update(config=config, config_source=source)
                    attn = _pallas_attention(block_sizes)
                else:
                    attn = {"cudnn": _cudnn_attention, "xla": _xla_attention, "xla_f32": _reference_attention}[impl]
            except Exception as e:  # noqa: BLE001
                skip = f"{type(e).__name__}: {e}"
        for mode in MODES:
            flops, bytes_moved, floor_us = _cost(s, causal, mode, dev)
            if skip is not None:
                progress(f"  [{label}] {impl:7s} {mode:8s} skipped: {skip}")
                records.append(_failed(label, impl, mode, flops, bytes_moved, floor_us, extra_impl, skip))
                continue
            try:
                m = _measure(impl, attn, mode, sets, ref, causal, iterations)
            except Exception as e:  # noqa: BLE001 -- one failing implementation must not stop the others
                error = f"{type(e).__name__}: {e}"
                progress(f"  [{label}] {impl:7s} {mode:8s} FAILED: {error[:300]}\n{traceback.format_exc(limit=2)}")
                records.append(_failed(label, impl, mode, flops, bytes_moved, floor_us, extra_impl, error))
                gc.collect()
                continue
            timing = m.pop("timing")
            if "temp_bytes" in m:  # << 1 for a kernel that never stores the scores (pallas, cudnn)
                m["temp_over_scores_f32"] = round(m["temp_bytes"] / _scores_f32_bytes(s), 4)
            extra = dict(extra_impl, **m, spread=round(timing.spread, 3), top_kernels={
                k: round(v, 2) for k, v in sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])[:8]})
            if ref_error:
                extra["rel_error_missing"] = ref_error
            r = bench.Record(op=OP, shape=label, dtype="bfloat16", implementation=impl, mode=mode,
                             time_us=timing.median_us, method=timing.method, flops=flops, bytes_moved=bytes_moved,
                             floor_us=floor_us, extra=extra).finish()
            records.append(r)
            err = f"{m['rel_error']:.1e}" if "rel_error" in m else "n/a"
            temp = f"{m['temp_mib']:.1f} MiB" if "temp_mib" in m else "?"
            progress(f"  [{label}] {impl:7s} {mode:8s} {r.time_us:10.1f} µs {r.tflops_per_s or 0:7.1f} TFLOP/s  "
                     f"×floor {r.ratio_to_floor or 0:5.2f}  rel_err {err}  temp {temp}")
    # Ratios to the baselines measured in this run: baseline time / this time (< 1: slower than the baseline).
    for mode in MODES:
        base = {r.implementation: r.time_us for r in records if r.mode == mode and r.method != "failed"}
        for r in records:
            if r.mode == mode and r.method != "failed":
                r.speedup_vs.update({b: base[b] / r.time_us for b in ("cudnn", "xla")
                                     if b in base and b != r.implementation})
    _delete((sets, ref))
    jax.clear_caches()
    gc.collect()
    return records


def run(shape_names=None, *, iterations: int = 20, causal=(False, True), impls=IMPLEMENTATIONS,
        cache_path=None, deadline: float | None = None, xla_max_scores_bytes: float = XLA_MAX_SCORES_BYTES,
        progress: Callable[[str], None] = _progress) -> list[bench.Record]:
    """Times every implementation at each named shape (default DEFAULT_SHAPES), each causal setting, fwd and
    fwd+bwd; returns one record per (shape, causal, implementation, mode).

    Args:
      shape_names: names in SHAPES; "cpu" is the smoke shape (other shapes are skipped on CPU with a message).
      iterations: timed iterations per measurement (after 2 warm-up calls per input set).
      causal: the causal settings to run, e.g. (True,) for causal only.
      impls: implementation names, from "pallas", "cudnn", "xla", "xla_f32".
      cache_path: a tuning cache (pallas_kernels.tuning format); its flash_attention entry for this device and
        shape, when present, replaces the kernel's default config (``extra["config_source"]`` says which ran).
      deadline: a ``time.time()`` value; shapes not started by then are recorded as skipped.
    A failing implementation, mode or shape is a record with NaN time and ``extra["error"]``; the rest goes on.
    """
    import jax

    names = list(DEFAULT_SHAPES if shape_names is None else shape_names)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"shape_names: unknown {unknown}; {OP} has {list(SHAPES)}")
    bad = [i for i in impls if i not in ("pallas", "cudnn", "xla", "xla_f32")]
    if bad:
        raise ValueError(f"impls: unknown {bad}; one of ['pallas', 'cudnn', 'xla', 'xla_f32']")
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    dev = costmodel.detect()
    records: list[bench.Record] = []
    for name in names:
        s = SHAPES[name]
        if not on_gpu and 4.0 * s["B"] * s["N"] * s["T"] * s["S"] * s["H"] > _MAX_CPU_FLOPS:
            progress(f"{OP} {name}: skipped on {backend} (interpret mode would take hours); try 'cpu'")
            continue
        for c in causal:
            label = _label(s, c)
            if deadline is not None and time.time() > deadline:
                progress(f"{OP} {name} [{label}]: skipped, past the time budget")
                for impl in impls:
                    for mode in MODES:
                        records.append(_failed(label, impl, mode, *_cost(s, c, mode, dev),
                                               {"shape_name": name, "causal": c}, "skipped: past the time budget"))
                continue
            progress(f"{OP} {name} [{label}] ({s.get('note', '')})")
            start = time.time()
            try:
                records += _run_one(name, s, c, iterations=iterations, impls=impls, dev=dev, cache_path=cache_path,
                                    on_gpu=on_gpu, backend=backend, xla_max_scores_bytes=xla_max_scores_bytes,
                                    progress=progress)
            except Exception as e:  # noqa: BLE001 -- e.g. out of memory making inputs; the next shape still runs
                error = f"{type(e).__name__}: {e}"
                progress(f"{OP} {name} [{label}] FAILED: {error[:500]}\n{traceback.format_exc(limit=3)}")
                for impl in impls:
                    for mode in MODES:
                        records.append(_failed(label, impl, mode, *_cost(s, c, mode, dev),
                                               {"shape_name": name, "causal": c}, error))
                jax.clear_caches()
                gc.collect()
            progress(f"{OP} {name} [{label}] took {time.time() - start:.1f} s")
    return records


def summary_table(records) -> str:
    """One line per (shape, mode): TFLOP/s of each implementation, pallas vs cuDNN and XLA, errors, temp memory."""
    rows = ["| shape | mode | pallas TFLOP/s | cudnn TFLOP/s | xla TFLOP/s | pallas vs cudnn | pallas vs xla "
            "| pallas rel err | cudnn rel err | pallas temp MiB | xla temp MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key: dict = {}
    for r in records:
        by_key.setdefault((r.shape, r.mode), {})[r.implementation] = r
    f = lambda v, p=1: "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{p}f}"  # noqa: E731
    e = lambda v: "" if v is None else f"{v:.1e}"  # noqa: E731
    for (shape, mode), impls in by_key.items():
        tf = {n: (impls[n].tflops_per_s if n in impls else None) for n in ("pallas", "cudnn", "xla")}
        p = impls.get("pallas")
        c = impls.get("cudnn")
        x = impls.get("xla")
        rows.append(" | ".join([
            f"| {shape}", mode, f(tf["pallas"]), f(tf["cudnn"]), f(tf["xla"]),
            f(p.speedup_vs.get("cudnn") if p else None, 2), f(p.speedup_vs.get("xla") if p else None, 2),
            e(p.extra.get("rel_error") if p else None), e(c.extra.get("rel_error") if c else None),
            f(p.extra.get("temp_mib") if p else None), f(x.extra.get("temp_mib") if x else None) + " |"]))
    return "\n".join(rows)


if __name__ == "__main__":  # python -m jaxfuse.suites.attention [shape ...]
    recs = run(sys.argv[1:] or None, iterations=20)
    print(bench.markdown_table(recs))
    print(summary_table(recs))
