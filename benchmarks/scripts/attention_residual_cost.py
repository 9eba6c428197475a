"""What the Mosaic attention forward pays for the backward's residuals, part by part (H100 experiment).

    PYTHONPATH=$PWD python benchmarks/scripts/attention_residual_cost.py --out $OUT

The suite (benchmarks/results/attention-h100.json, commit 11fae37) times the forward kernel at 854 µs alone and at
1090 µs inside forward+backward at B4 T=S=4096 N16 H128 (+27%; causal 463 → 605), against the +2-4% measured when
the residuals were added. With residuals the kernel (``mosaic_fwd._kernel``) does three things more: l sums the
probabilities as p·v rounds them (a bf16 → float32 conversion per score), and it stores lse and o_lo. This script
times variants of the kernel that drop one of them each (source patched in memory; the package is not changed) at
the suite's main shape, causal and not, with the default config, in one run, and writes
``attention_residual_cost-<tag>.json``. The variants without the rounded sum or without o_lo are not correct
backward inputs: they exist to price each part.
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
VARIANTS = [
    ("no residuals (inference)", False, ()),
    ("residuals (as shipped)", True, ()),
    ("residuals, l sums unrounded p", True, ((_SUM_ROUNDED, "p_sum = p"),)),
    ("residuals, no o_lo store", True, ((_STORE_LO, ""),)),
    ("residuals, lse only (both dropped)", True, ((_SUM_ROUNDED, "p_sum = p"), (_STORE_LO, ""))),
]


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
            rows.append({"causal": causal, "variant": name, "median_us": t.median_us, "spread": t.spread,
                         "per_kernel_us": t.per_kernel_us, "config": str(cfg)})
            print(f"causal={causal!s:5} {name:38s} {t.median_us:8.1f} µs  spread {t.spread:.3f}", flush=True)
    tag = bench.device_tag(jax.devices()[0].device_kind)
    path = os.path.join(args.out, f"attention_residual_cost-{tag}.json")
    with open(path, "w") as f:
        json.dump({"environment": bench.environment(), "shape": [B, T, N, H], "rows": rows}, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
