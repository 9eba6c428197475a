"""The Mosaic attention forward with FA3's intra-warpgroup overlap (``MosaicAttentionConfig.overlap``) against the
shipped schedule and cuDNN on the H100: correctness, then forward and forward+backward time per suite shape.

    PYTHONPATH=$PWD python benchmarks/scripts/attention_fwd_overlap.py --out $OUT [--shapes main,1k,h64,gqa,8k]

Correctness: ``attention_fused_bwd.check`` (dq, dk, dv against the float32 reference on random bf16 inputs at odd
shapes with every mask, NaN past kv_seq_lengths) for both schedules, plus the forward output's error. Timing:
CUPTI medians (``bench.time_kernels``, three input sets past the L2), forward alone (o) and jax.vjp's forward and
backward, cuDNN in the same run. Writes ``attention_fwd_overlap-<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import numpy as np

import pallas_kernels
from attention_fused_bwd import check, results_file, run_checks, vjp_fn
from jaxfuse import bench
from jaxfuse.suites.attention import SHAPES, make_inputs
from pallas_kernels import reference
from pallas_kernels.attention import mosaic

VARIANTS = {"shipped": lambda c: c, "overlap": lambda c: dataclasses.replace(c, overlap=True)}


def forward_error(case) -> dict:
    B, T, S, N, K, H, causal = case[:7]
    q, k, v, _ = make_inputs(B, T, S, N, K, H, seed=7)
    want = np.asarray(reference.attention(q.astype("float32"), k.astype("float32"), v.astype("float32"),
                                          causal=causal), np.float64)
    base = mosaic.default_config(q, k, v, causal=causal)
    out = {}
    for name, transform in VARIANTS.items():
        got = np.asarray(pallas_kernels.flash_attention(q, k, v, causal=causal, backend="mosaic",
                                                        block_sizes=transform(base)), np.float64)
        out[name] = float("nan") if np.isnan(got).any() else float(np.abs(got - want).max() / np.abs(want).max())
    return out


def fwd_fn(cfg, causal):
    return jax.jit(lambda q, k, v: pallas_kernels.flash_attention(q, k, v, causal=causal, backend="mosaic",
                                                                  block_sizes=cfg))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="main,1k,h64,gqa,8k")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:FIELD=VALUE,... more configs to time (0/1 for bools), e.g. nopp:overlap=1,ping_pong=0")
    parser.add_argument("--variants-only", action="store_true",
                        help="time the shipped config and the --variant ones only (not the built-in overlap)")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--causal", default="0,1")
    args = parser.parse_args()
    if args.variants_only:
        del VARIANTS["overlap"]
    for spec in args.variant:
        name, _, fields = spec.partition(":")
        overrides = {k: int(v) for k, v in (f.split("=") for f in fields.split(","))}
        overrides = {k: bool(v) if isinstance(getattr(mosaic.Config(), k), bool) else v for k, v in overrides.items()}
        VARIANTS[name] = lambda c, o=overrides: dataclasses.replace(c, **o)
    result, save, path = results_file(args.out, "attention_fwd_overlap")
    if not args.skip_checks:
        run_checks(result, save, lambda case: dict(check(case, VARIANTS), forward=forward_error(case)))
    for shape in args.shapes.split(","):
        s = SHAPES[shape]
        sets = [make_inputs(s["B"], s["T"], s["S"], s["N"], s["K"], s["H"], seed=i) for i in range(3)]
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            base = mosaic.default_config(*sets[0][:3], causal=causal)
            for mode in args.modes.split(","):
                rows = []
                for name, transform in VARIANTS.items():
                    cfg = transform(base)
                    fn = fwd_fn(cfg, causal) if mode == "fwd" else vjp_fn(cfg, causal)
                    args_ = [x[:3] for x in sets] if mode == "fwd" else sets
                    try:
                        t = bench.time_kernels(fn, args_, iterations=args.iterations)
                        rows.append(dict(shape=shape, causal=causal, mode=mode, impl=f"pallas_mosaic_{name}",
                                         us=t.median_us, spread=t.spread, per_kernel_us=t.per_kernel_us,
                                         config=str(cfg)))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(shape=shape, causal=causal, mode=mode, impl=f"pallas_mosaic_{name}",
                                         error=f"{type(e).__name__}: {e}"[:800]))

                def cudnn(q, k, v, *do):
                    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,  # noqa: E731
                                                                     implementation="cudnn")
                    if not do:
                        return f(q, k, v)
                    o, vjp = jax.vjp(f, q, k, v)
                    return (o, *vjp(do[0]))
                t = bench.time_kernels(jax.jit(cudnn), [x[:3] for x in sets] if mode == "fwd" else sets,
                                       iterations=args.iterations)
                rows.append(dict(shape=shape, causal=causal, mode=mode, impl="cudnn", us=t.median_us,
                                 spread=t.spread, per_kernel_us=t.per_kernel_us))
                result["timings"] += rows
                for r in rows:
                    ratio = f"{t.median_us / r['us']:.3f}x cuDNN" if "us" in r else r.get("error", "")
                    print(f"{shape:5s} causal={causal!s:5s} {mode:8s} {r['impl']:24s} "
                          f"{r.get('us', float('nan')):9.1f} µs {ratio}", flush=True)
                save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
