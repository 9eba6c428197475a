"""Linear cross-entropy benchmark: the fused Pallas kernel against plain XLA (materialized logits), side by side.

    from jaxfuse.suites import cross_entropy
    records = cross_entropy.run(["8k_128k"], iterations=10)     # or `jaxfuse bench --op cross_entropy`

For each shape (B×H×V, bf16, mean loss over all rows) and implementation, two modes are timed (device-kernel time
on GPU, wall time on CPU): "fwd" (the loss) and "fwd+bwd" (loss and the gradients for h and w). Every record
carries in ``extra``: ``temp_bytes`` (``compiled.memory_analysis().temp_size_in_bytes`` of that jitted program),
``rel_error`` (max |x − ref| / max |ref| over loss, dh and dw against the float32 reference, so a fast wrong
kernel cannot pass) and the per-kernel times. The floor is GEMM FLOPs at the device's measured bf16 rate:
2·B·H·V for fwd, 3× that for fwd+bwd (what XLA with materialized logits needs; a design that never stores the
(B, V) logits needs 4×, since dlogits needs the full-vocabulary lse before it can exist).

Implementations: "xla" (jnp: logits = h @ w, float32 log-sum-exp, take the label logit; XLA fuses what it can),
"pallas" (``pallas_kernels.linear_cross_entropy``), and "tokamax_chunked_xla" when tokamax is installed.

DEFAULT_SHAPES are the issue's H100 shapes; on CPU use ``--shapes cpu``.
"""

from __future__ import annotations

import sys
import traceback

from jaxfuse import bench, costmodel

__all__ = ["DEFAULT_SHAPES", "SHAPES", "implementations", "run"]

OP = "cross_entropy"
SHAPES = {
    "cpu": dict(B=64, H=64, V=1000),
    "8k_128k": dict(B=8192, H=4096, V=128256),
    "4k_256k": dict(B=4096, H=2048, V=256000),
    "16k_32k": dict(B=16384, H=4096, V=32000),
}
DEFAULT_SHAPES = ("8k_128k", "4k_256k", "16k_32k")


def _xla_loss(h, w, labels):
    """The model's "xla" loss site, ``jaxfuse.kernels.plain_cross_entropy``: materialized (B, V) logits from one
    bf16 GEMM, float32 log-sum-exp, mean over non-ignored rows."""
    from jaxfuse import kernels

    return kernels.plain_cross_entropy(h, w, labels)


def _pallas_loss(h, w, labels, block_sizes=None):
    from pallas_kernels.cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, labels, block_sizes=block_sizes)


def _tokamax_loss():
    try:
        import tokamax
    except ImportError:
        return None
    return lambda h, w, labels: tokamax.linear_softmax_cross_entropy_loss(
        h, labels, w, reduction="mean", implementation="chunked_xla")


def implementations() -> dict:
    """name -> loss(h, w, labels) for every implementation available here; "xla" first (the baseline)."""
    impls = {"xla": _xla_loss, "pallas": _pallas_loss}
    tokamax_loss = _tokamax_loss()
    if tokamax_loss is not None:
        impls["tokamax_chunked_xla"] = tokamax_loss
    return impls


def make_inputs(B: int, H: int, V: int, *, seed: int = 0, dtype=None):
    """h ~ N(0, 1), w ~ N(0, 1/H) (logits ~ N(0, 1), as at initialization), labels uniform in [0, V)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if dtype is None else dtype
    k_h, k_w, k_y = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k_h, (B, H), dtype)
    w = (jax.random.normal(k_w, (H, V), dtype) * (H**-0.5)).astype(dtype)
    labels = jax.random.randint(k_y, (B,), 0, V, jnp.int32)
    return h, w, labels


def _programs(loss):
    import jax

    fwd = jax.jit(loss)
    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _compile(fn, args):
    from pallas_kernels import triton_utils

    with triton_utils.quiet_triton_deprecation():
        return fn.lower(*args).compile()


def _reference(h, w, labels):
    """float32 reference loss, dh, dw (materializes float32 logits: fine on an 80 GB GPU at the issue's shapes)."""
    import jax

    from pallas_kernels import reference

    fn = jax.jit(jax.value_and_grad(lambda h, w: reference.linear_cross_entropy(h, w, labels), argnums=(0, 1)))
    loss, (dh, dw) = fn(h, w)
    return jax.block_until_ready((loss, dh, dw))


def _rel_error(got, want) -> float:
    import jax.numpy as jnp

    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def _delete(tree):
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "delete"):
            leaf.delete()


def measure(name: str, loss, args, ref, *, shape: str, dev, iterations: int) -> list[bench.Record]:
    """Records ("fwd" and "fwd+bwd") of one implementation at one shape; speedup_vs is filled by run()."""
    import jax

    h, w, _ = args
    B, H = h.shape
    V = w.shape[1]
    gemm_flops = 2.0 * B * H * V
    io_bytes = h.nbytes + w.nbytes + args[2].nbytes
    records = []
    for mode, fn in _programs(loss).items():
        compiled = _compile(fn, args)
        temp = compiled.memory_analysis().temp_size_in_bytes
        out = jax.block_until_ready(fn(*args))  # same executable (jax caches the compilation)
        if mode == "fwd":
            errors = {"loss": _rel_error(out, ref[0])}
        else:
            value, (dh, dw) = out
            errors = {"loss": _rel_error(value, ref[0]), "dh": _rel_error(dh, ref[1]), "dw": _rel_error(dw, ref[2])}
        _delete(out)
        del compiled
        timing = bench.time_kernels(fn, [args], iterations=iterations)
        flops = gemm_flops * (1 if mode == "fwd" else 3)
        moved = io_bytes * (1 if mode == "fwd" else 2)  # inputs read; fwd+bwd also writes dh, dw
        top = dict(sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])[:8])
        records.append(bench.Record(
            op=OP, shape=shape, dtype=str(h.dtype), implementation=name, mode=mode, time_us=timing.median_us,
            method=timing.method, flops=flops, bytes_moved=moved,
            floor_us=dev.roofline_us(moved, flops, launches=0),
            extra={"temp_bytes": int(temp), "temp_mib": round(temp / 2**20, 1), "rel_error": max(errors.values()),
                   "rel_errors": errors, "spread": round(timing.spread, 3), "per_kernel_us": top},
        ).finish())
    return records


def _failed(name: str, shape: str, dtype: str, mode: str, error: BaseException) -> bench.Record:
    return bench.Record(op=OP, shape=shape, dtype=dtype, implementation=name, mode=mode, time_us=float("nan"),
                        method="failed", extra={"error": f"{type(error).__name__}: {error}"[:2000]})


def run(shape_names=None, *, iterations: int = 20, impls: dict | None = None,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[bench.Record]:
    """Measures every implementation at each named shape; one failing implementation or shape is recorded as a
    ``method="failed"`` record (time NaN, the error in extra) and does not stop the others."""
    import jax

    names = list(DEFAULT_SHAPES if shape_names is None else shape_names)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise ValueError(f"shape_names: unknown {unknown}; one of {list(SHAPES)}")
    impls = implementations() if impls is None else impls
    dev = costmodel.detect()
    records: list[bench.Record] = []
    for shape_name in names:
        s = SHAPES[shape_name]
        label = f"{s['B']}x{s['H']}x{s['V']}"
        try:
            args = make_inputs(s["B"], s["H"], s["V"])
            progress(f"[{label}] float32 reference ...")
            ref = _reference(*args)
        except Exception as e:  # noqa: BLE001 -- recorded, the next shape still runs
            progress(f"[{label}] inputs/reference FAILED: {e}")
            records += [_failed(n, label, "bfloat16", m, e) for n in impls for m in ("fwd", "fwd+bwd")]
            continue
        shape_records = []
        for name, loss in impls.items():
            progress(f"[{label}] {name} ...")
            try:
                shape_records += measure(name, loss, args, ref, shape=label, dev=dev, iterations=iterations)
            except Exception as e:  # noqa: BLE001
                progress(f"[{label}] {name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
                shape_records += [_failed(name, label, str(args[0].dtype), m, e) for m in ("fwd", "fwd+bwd")]
        baseline = {r.mode: r.time_us for r in shape_records if r.implementation == "xla" and r.method != "failed"}
        for r in shape_records:
            if r.mode in baseline and r.method != "failed":
                r.speedup_vs["xla"] = baseline[r.mode] / r.time_us
        records += shape_records
        _delete((args, ref))
        jax.clear_caches()
    return records
