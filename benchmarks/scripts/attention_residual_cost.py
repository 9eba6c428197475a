"""What the Mosaic attention forward pays for the backward's residuals, part by part (H100 experiment).

    git worktree add /tmp/b80fca7 b80fca7 && cd /tmp/b80fca7    # the kernel it measured (see below)
    PYTHONPATH=$PWD python benchmarks/scripts/attention_residual_cost.py --out $OUT

It patches ``mosaic_fwd`` as of commit b80fca7. Its result (benchmarks/results/attention_residual_cost-h100.json)
removed the rounded sum from the kernel in the next commit, so on later commits the patches no longer match and the
script says so.

The suite (benchmarks/results/attention-h100.json, commit 11fae37) times the forward kernel at 854 µs alone and at
1090 µs inside forward+backward at B4 T=S=4096 N16 H128 (+27%; causal 463 → 605), against the +2-4% measured when
the residuals were added. With residuals the kernel (``mosaic_fwd._kernel``) does three things more: l sums the
probabilities as p·v rounds them (a bf16 → float32 conversion per score), and it stores lse and o_lo. This script
times variants of the kernel that drop one of them each, and a cheaper candidate for the rounded sum (an exact
row max), source patched in memory (the package is not changed), at the suite's main shape, causal and not, with
the default config, in one run; for each residual variant it also measures dq, dk, dv against float64 on saturated
inputs (the test's q, k × 30), and writes ``attention_residual_cost-<tag>.json``. The variants without o_lo are not
correct backward inputs: they exist to price each part.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import types

import jax
import jax.numpy as jnp

from jaxfuse import bench
from pallas_kernels.attention import mosaic, mosaic_fwd

# (name, residuals, source replacements applied to mosaic_fwd)
_SUM_ROUNDED = "p_sum = p16.astype(jnp.float32) if residuals else p"
_STORE_LO = """            o_lo = (o - o_out.astype(jnp.float32)).astype(dtype)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the o tile has left out_tile
            out_tile[...] = o_lo
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_tile, lo_ref.at[b, pl.ds(q_base, bq), n])
"""
_MAX_AND_EXP = """            m_new = jnp.maximum(m, s.max(axis=1) * exp_c)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * exp_c - bcast_row(m_new, s.shape))  # masked scores: exp2(-inf) = 0
"""
# The cheaper exactness candidate: scores scaled once (t = s·c, rounded), the max taken of t, p = exp2(t − max t),
# so the row's largest p is exactly 1 (with one FMA s·c − m, it is 2^e for the product's rounding error e, and a
# one-hot row's o_f32 = v / (1 + e·ln 2): what the rounded sum fixes). With the barrier, t is materialized so that
# ptxas cannot contract t − m back into that FMA.
_EXACT_MAX = """            t = s * exp_c
            m_new = jnp.maximum(m, t.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(t - bcast_row(m_new, s.shape))  # masked scores: exp2(-inf) = 0
"""
_EXACT_MAX_BARRIER = _EXACT_MAX.replace("t = s * exp_c", "t = lax.optimization_barrier(s * exp_c)")
VARIANTS = [
    ("no residuals (inference)", False, ()),
    ("residuals (as shipped)", True, ()),
    ("residuals, l sums unrounded p", True, ((_SUM_ROUNDED, "p_sum = p"),)),
    ("residuals, no o_lo store", True, ((_STORE_LO, ""),)),
    ("residuals, lse only (both dropped)", True, ((_SUM_ROUNDED, "p_sum = p"), (_STORE_LO, ""))),
    ("residuals, exact max, unrounded sum", True, ((_SUM_ROUNDED, "p_sum = p"), (_MAX_AND_EXP, _EXACT_MAX))),
    ("residuals, exact max (barrier), unrounded sum", True,
     ((_SUM_ROUNDED, "p_sum = p"), (_MAX_AND_EXP, _EXACT_MAX_BARRIER))),
]


def saturated_errors(module, H: int) -> dict:
    """dq, dk, dv relative errors against float64 with q and k scaled by 30 (base_attention's saturated-softmax
    test at B1 T=S=1024 N4), the forward's residuals coming from ``module``."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from base_attention import float64_grads, fwd_bwd  # noqa: E402  (the tests' own reference)
    import numpy as np
    import pallas_kernels

    mosaic.mosaic_fwd = module
    mosaic._forward.cache_clear()
    try:
        k = jax.random.split(jax.random.key(1), 4)
        shape = (1, 1024, 4, H)
        q, kk = ((30.0 * jax.random.normal(k[i], shape, jnp.float32)).astype(jnp.bfloat16) for i in (0, 1))
        v, do = (jax.random.normal(k[i], shape, jnp.bfloat16) for i in (2, 3))
        got = fwd_bwd(lambda a, b, c: pallas_kernels.flash_attention(a, b, c, backend="mosaic"), q, kk, v, do)[1:]
        want = float64_grads(q, kk, v, do, H ** -0.5)
        err = lambda g, w: float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))  # noqa: E731
        return {name: err(g, w) for name, g, w in zip(("dq", "dk", "dv"), got, want)}
    finally:
        mosaic.mosaic_fwd = mosaic_fwd
        mosaic._forward.cache_clear()


def patched_module(replacements) -> types.ModuleType:
    """A copy of mosaic_fwd with ``replacements`` applied to its source (each must match once)."""
    source = inspect.getsource(mosaic_fwd)
    for old, new in replacements:
        if source.count(old) != 1:
            raise SystemExit(f"mosaic_fwd changed: {old.strip()[:60]!r} found {source.count(old)} times")
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(f"mosaic_fwd_variant_{abs(hash(replacements))}", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, mosaic_fwd.__file__, "exec"), module.__dict__)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    B, T, N, H = 4, 4096, 16, 128
    keys = jax.random.split(jax.random.key(0), 9)
    # three input sets of 3 x 64 MiB each, rotated past the 50 MiB L2
    sets = [tuple(jax.random.normal(keys[3 * i + j], (B, T, N, H), jnp.bfloat16) for j in range(3)) for i in range(3)]
    rows = []
    for causal in (False, True):
        cfg = mosaic.default_config(*sets[0], causal=causal)
        for name, residuals, replacements in VARIANTS:
            module = patched_module(replacements) if replacements else mosaic_fwd
            fn = jax.jit(lambda q, k, v, m=module, r=residuals: m.kernel_call(
                q, k, v, None, None, None, cfg=cfg, causal=causal, scale=H ** -0.5, residuals=r))
            t = bench.time_kernels(fn, sets, iterations=args.iterations)
            row = {"causal": causal, "variant": name, "median_us": t.median_us, "spread": t.spread,
                   "per_kernel_us": t.per_kernel_us, "config": str(cfg)}
            if residuals and not causal and "o_lo" not in name and "lse only" not in name:
                try:
                    row["saturated_rel_err"] = {H_: saturated_errors(module, H_) for H_ in (64, 128)}
                except Exception as e:  # noqa: BLE001  (keep the timings; name what failed)
                    row["saturated_rel_err"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
            print(f"causal={causal!s:5} {name:46s} {t.median_us:8.1f} µs  spread {t.spread:.3f}  "
                  f"{row.get('saturated_rel_err', '')}", flush=True)
    tag = bench.device_tag(jax.devices()[0].device_kind)
    path = os.path.join(args.out, f"attention_residual_cost-{tag}.json")
    with open(path, "w") as f:
        json.dump({"environment": bench.environment(), "shape": [B, T, N, H], "rows": rows}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
