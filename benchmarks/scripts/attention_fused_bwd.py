"""The Mosaic attention backward, fused (one kernel, dQ by TMA reduce-add) against split (dQ kernel + dK/dV kernel),
and cuDNN, on the H100: correctness first, then forward+backward time per suite shape.

    PYTHONPATH=$PWD python benchmarks/scripts/attention_fused_bwd.py --out $OUT [--shapes main,h64] [--fused-only]

Correctness: dq, dk, dv of both backward variants against the float32 reference (``pallas_kernels.reference``) on
fresh random bf16 inputs at small odd shapes (causal, GQA, segment ids, kv_seq_lengths with NaN past the length),
max error relative to the reference's largest entry; any NaN fails. Timing: ``bench.time_kernels`` (CUPTI,
median, three input sets rotated past the L2) of jax.vjp's forward and backward with a random cotangent (the
output kept alive), each variant's per-kernel times, cuDNN's in the same run. Writes
``attention_fused_bwd-<device>.json`` under --out and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxfuse import bench
from jaxfuse.suites.attention import SHAPES, make_inputs
from pallas_kernels import reference
from pallas_kernels.attention import mosaic

CASES = [  # (B, T, S, N, K, H, causal, segments, lengths)
    (2, 256, 256, 4, 4, 128, False, False, False),
    (2, 256, 256, 4, 4, 128, True, False, False),
    (1, 200, 330, 4, 2, 128, False, False, False),
    (1, 333, 333, 4, 1, 128, True, False, False),
    (2, 256, 256, 4, 2, 64, False, False, False),
    (1, 300, 300, 4, 4, 64, True, False, False),
    (2, 256, 256, 4, 2, 128, False, True, False),
    (2, 384, 384, 4, 4, 128, False, False, True),
    (2, 384, 384, 8, 2, 64, True, False, True),
]


def fused_config(cfg):
    """``cfg`` with the fused backward, its dK/dV pipeline cut to what fits shared memory."""
    return dataclasses.replace(cfg, fused_bwd=True, num_stages_dkv=min(cfg.num_stages_dkv, 2))


def vjp_fn(cfg, causal, segments=None, lengths=None):
    def run(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: pallas_kernels.flash_attention(
            q, k, v, causal=causal, segment_ids=segments, kv_seq_lengths=lengths, backend="mosaic",
            block_sizes=cfg), q, k, v)
        return (o, *vjp(do))
    return jax.jit(run)


def check(case, variants=None) -> dict:
    """Max relative errors of dq, dk, dv per variant (name -> config transform; default split and fused)."""
    variants = variants or {"split": lambda c: c, "fused": fused_config}
    B, T, S, N, K, H, causal, segments, lengths = case
    q, k, v, do = make_inputs(B, T, S, N, K, H, seed=sum(case[:6]))
    seg = lens = None
    if segments:
        seg = (jnp.repeat(jnp.arange(4), T // 4)[None].repeat(B, 0).astype(jnp.int32),
               jnp.repeat(jnp.arange(4), S // 4)[None].repeat(B, 0).astype(jnp.int32))
    if lengths:
        lens = jnp.array([S // 3 + 5, S - 17][:B], jnp.int32)
        pad = jnp.arange(S)[None, :, None, None] >= lens[:, None, None, None]
        v = jnp.where(pad, jnp.nan, v)  # NaN past the length must not reach a gradient
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = jax.jit(lambda q, k, v, do: jax.vjp(lambda q, k, v: reference.attention(
        q, k, jnp.where(jnp.isnan(v), 0, v), causal=causal, segment_ids=seg, kv_seq_lengths=lens), q, k, v)[1](do))
    want = ref(f32(q), f32(k), f32(v), f32(do))
    out = {}
    base = mosaic.default_config(q, k, v, causal=causal)
    for name, transform in variants.items():
        cfg = transform(base)
        got = vjp_fn(cfg, causal, seg, lens)(q, k, v, do)[1:]
        errs = {}
        for g_name, g, w in zip(("dq", "dk", "dv"), got, want):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            errs[g_name] = float("nan") if np.isnan(g).any() else float(np.abs(g - w).max() / np.abs(w).max())
        out[name] = errs
    tol = 1e-2 * math.sqrt(max(T, S) / 256)
    out["ok"] = all(e == e and e <= tol for name in variants for e in out[name].values())
    out["tol"] = tol
    return out


_REDUCE = """            plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_ref.at[b, pl.ds(t0, bq), h * G + g, pl.ds(col0, dq_cols)],
                                    reduction_op="add")
"""


_WAIT = """            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduce-add has read dq_smem
"""
_SHIFT = "shift = lax.axis_index(\"kv_tiles\") * max(1, num_q_tiles // cdiv(S, tile))"
PRICED = {  # variant -> (source, replacement) in mosaic_bwd_fused; the first three give a wrong dQ: they price a part
    "fused_without_reduce": (_REDUCE, ""),
    # every program of a head walks the query tiles in the same order: its reduce-adds hit the same dQ rows together
    # (L2-resident) instead of spreading over the head's rows
    "fused_no_shift": (_SHIFT, "shift = 0"),
    "fused_without_reduce_wait": (_WAIT, ""),
    "fused_plain_store": (_REDUCE, _REDUCE.replace(',\n                                    reduction_op="add")', ")")),
}


def priced_without_reduce(shape: str, causal: bool, iterations: int, variant: str = "fused_without_reduce") -> dict:
    """The fused kernel with a part removed or changed (PRICED), patched in memory."""
    import importlib.util
    import inspect
    from pallas_kernels.attention import mosaic_bwd, mosaic_bwd_fused

    source = inspect.getsource(mosaic_bwd_fused)
    old, replacement = PRICED[variant]
    if source.count(old) != 1:
        return dict(shape=shape, causal=causal, impl=variant, error="mosaic_bwd_fused changed")
    spec = importlib.util.spec_from_loader("mosaic_bwd_fused_no_reduce", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source.replace(old, replacement), mosaic_bwd_fused.__file__, "exec"), module.__dict__)
    s = SHAPES[shape]
    sets = [make_inputs(s["B"], s["T"], s["S"], s["N"], s["K"], s["H"], seed=i) for i in range(3)]
    cfg = fused_config(mosaic.default_config(*sets[0][:3], causal=causal))
    try:
        mosaic_bwd.fused = module
        mosaic._backward.cache_clear()
        jax.clear_caches()  # mosaic_bwd.backward is a jit: retrace it with the patched module
        t = bench.time_kernels(vjp_fn(cfg, causal), sets, iterations=iterations)
    finally:
        mosaic_bwd.fused = mosaic_bwd_fused
        mosaic._backward.cache_clear()
        jax.clear_caches()
    return dict(shape=shape, causal=causal, impl=variant, us=t.median_us, spread=t.spread,
                per_kernel_us=t.per_kernel_us, config=str(cfg))


def timing(shape: str, causal: bool, iterations: int, fused_only: bool) -> list[dict]:
    s = SHAPES[shape]
    sets = [make_inputs(s["B"], s["T"], s["S"], s["N"], s["K"], s["H"], seed=i) for i in range(3)]
    base = mosaic.default_config(*sets[0][:3], causal=causal)
    variants = [("pallas_mosaic_fused", fused_config(base))]
    if not fused_only:
        variants.insert(0, ("pallas_mosaic_split", base))
    rows = []
    for name, cfg in variants:
        t = bench.time_kernels(vjp_fn(cfg, causal), sets, iterations=iterations)
        rows.append(dict(shape=shape, causal=causal, impl=name, us=t.median_us, spread=t.spread,
                         per_kernel_us=t.per_kernel_us, config=str(cfg)))
    if shape == "main":
        rows += [priced_without_reduce(shape, causal, iterations, v) for v in PRICED]
    if not fused_only:
        def cudnn(q, k, v, do):
            o, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                          implementation="cudnn"), q, k, v)
            return (o, *vjp(do))
        t = bench.time_kernels(jax.jit(cudnn), sets, iterations=iterations)
        rows.append(dict(shape=shape, causal=causal, impl="cudnn", us=t.median_us, spread=t.spread,
                         per_kernel_us=t.per_kernel_us))
    return rows


@contextlib.contextmanager
def recorded_row(result: dict, save, row: dict):
    """A block that fills ``row`` (one shape's measurements): an exception inside is recorded as ``row["error"]``
    and printed (the other shapes still run); the row is then appended to result["timings"] and saved."""
    try:
        yield row
    except Exception as e:  # noqa: BLE001 - the other shapes still run
        row["error"] = f"{type(e).__name__}: {e}"[:1500]
        print(row.get("shape", ""), "error", row["error"], flush=True)
    result["timings"].append(row)
    save()


def results_file(out: str, name: str):
    """(result dict with the environment, save() writing it to ``<out>/<name>-<device>.json``, that path); makes
    ``out`` if it does not exist."""
    result = {"environment": bench.environment(), "checks": [], "timings": []}
    os.makedirs(out, exist_ok=True)  # (a folder that does not exist yet: the first save would fail after a run)
    path = os.path.join(out, f"{name}-{bench.device_tag(jax.devices()[0].device_kind)}.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    return result, save, path


def run_checks(result: dict, save, check_case) -> None:
    """``check_case(case)`` for every case of CASES into result["checks"], an exception recorded as a failed
    check (the timings after it still matter), saved after each."""
    for case in CASES:
        try:
            r = check_case(case)
        except Exception as e:  # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {e}"[:800], "ok": False}
        result["checks"].append(dict(case=case, **r))
        print("check", case, r, flush=True)
        save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="main,h64,1k,gqa,8k")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--fused-only", action="store_true")
    parser.add_argument("--skip-checks", action="store_true")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "attention_fused_bwd")
    if not args.skip_checks:
        run_checks(result, save, check)
    for shape in args.shapes.split(","):
        for causal in (False, True):
            try:
                rows = timing(shape, causal, args.iterations, args.fused_only)
            except Exception as e:  # noqa: BLE001
                rows = [dict(shape=shape, causal=causal, error=f"{type(e).__name__}: {e}"[:800])]
            result["timings"] += rows
            cudnn = next((r["us"] for r in rows if r.get("impl") == "cudnn"), None)
            for r in rows:
                ratio = f"{cudnn / r['us']:.3f}x cuDNN" if cudnn and "us" in r else ""
                print(f"{shape:5s} causal={causal!s:5s} {r.get('impl', '?'):22s} {r.get('us', float('nan')):9.1f} µs "
                      f"{ratio} {r.get('per_kernel_us', r.get('error', ''))}", flush=True)
            save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
