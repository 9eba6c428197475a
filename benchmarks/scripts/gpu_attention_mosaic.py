"""On one H100: the Mosaic-GPU attention forward against cuDNN and the Pallas-Triton kernel, in one run.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_attention_mosaic.py --out $OUT [--budget-s 170] [--smoke]

Per suite shape (``jaxfuse.suites.attention.SHAPES``: main, 1k, 8k, gqa, h64; bf16) and causal setting, the
forward of three implementations, each checked before it is timed (max |o − ref| / max |ref| on batch row 0
against ``pallas_kernels.reference.attention`` in float32; for Mosaic also the log2-domain lse):
  mosaic  ``pallas_kernels.attention.mosaic.flash_attention`` with its default config (the primal: o only);
          at the main shape also ``attention_forward`` with residuals (o, lse and o_lo: what training runs)
  cudnn   ``jax.nn.dot_product_attention(implementation="cudnn")``
  triton  ``pallas_kernels.flash_attention`` (today's Pallas-Triton kernel, its tuned config)
Times are CUPTI device-kernel time (``jax.experimental.mosaic.gpu.profiler.measure(f, aggregate=False,
iterations=n)``), median over --iterations runs on each of 2 rotated input sets. Then a small config sweep at the
main shape. Order: main (all three), the other shapes (Mosaic and cuDNN), the sweep, Triton at the other shapes;
nothing new starts after --budget-s (skipped items are recorded). JSON (device, jax version, commit, date, rows,
sweep) goes to $OUT/attention_mosaic_fwd.json after every item; a compact table is printed last.
--compare-persistent: the persistent config against the default one (and cuDNN) instead, non-causal at every
shape and causal at the main one.
--smoke: probes the Mosaic APIs the kernel relies on (signatures), checks two small shapes and exits (non-zero on
a wrong result): run it first under ``timeout`` so that a hang costs a minute, not the whole call.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import statistics
import time
import traceback

T0 = time.time()
SWEEP = [dict(block_kv=128, num_stages=2, ping_pong=False), dict(block_kv=64, num_stages=2),
         dict(block_kv=128, num_stages=3), dict(block_kv=64, num_stages=4)]


def log(message: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {message}", flush=True)


def probe() -> dict:
    """Signatures of the 0.11 Mosaic APIs the kernel uses, so a surprise shows up in the first run."""
    from jax.experimental.mosaic.gpu import profiler
    from jax.experimental.pallas import mosaic_gpu as plgpu

    out = {}
    for name in ("load", "copy_gmem_to_smem", "copy_smem_to_gmem", "wait_smem_to_gmem", "kernel", "wgmma",
                 "barrier_wait", "barrier_arrive", "set_max_registers", "layout_cast", "broadcasted_iota"):
        try:
            out[name] = str(inspect.signature(getattr(plgpu, name)))
        except Exception as e:  # noqa: BLE001 -- report whatever is missing
            out[name] = f"ERROR {type(e).__name__}: {e}"
    out["CompilerParams"] = str(inspect.signature(plgpu.CompilerParams))
    out["profiler.measure"] = str(inspect.signature(profiler.measure))
    return out


def reference_lse(q, k, *, causal, scale):
    """(B, N, T) float32 log2-domain log-sum-exp of the visible scores (causal or none)."""
    import jax
    import jax.numpy as jnp

    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    s = jnp.einsum("BTKGH,BSKH->BKGTS", up(q).reshape(B, T, K, N // K, H), up(k),
                   precision=jax.lax.Precision.HIGHEST).reshape(B, N, T, S) * scale
    if causal:
        s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(T)[:, None], s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1) / math.log(2.0)


def rel_err(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def time_us(fn, sets, iterations: int) -> tuple[float, dict]:
    """Median device time (µs) of fn over `iterations` runs on each input set, and per-kernel medians."""
    import jax
    from jax.experimental.mosaic.gpu import profiler

    for s in sets:
        jax.block_until_ready(fn(*s))
    totals, kernels = [], {}
    for s in sets:
        _, runs = profiler.measure(fn, aggregate=False, iterations=iterations)(*s)
        for run in runs:
            totals.append(sum(ms for _, ms in run) * 1e3)
            for name, ms in run:
                kernels.setdefault(name, []).append(ms * 1e3)
    return statistics.median(totals), {n: round(statistics.median(v), 1) for n, v in kernels.items()}


def implementations(causal: bool, config=None) -> dict:
    import jax

    import pallas_kernels
    from pallas_kernels.attention import mosaic

    return {
        "mosaic": jax.jit(lambda q, k, v: mosaic.flash_attention(q, k, v, causal=causal, config=config)),
        "cudnn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                      implementation="cudnn")),
        "triton": jax.jit(lambda q, k, v: pallas_kernels.flash_attention(q, k, v, causal=causal)),
        "mosaic+residuals": jax.jit(lambda q, k, v: mosaic.attention_forward(q, k, v, causal=causal,
                                                                             config=config)),
    }


def measure_shape(name: str, dims: dict, causal: bool, impls: list[str], iterations: int, config=None) -> dict:
    """One row: each implementation checked on batch row 0, then timed."""
    import jax
    import jax.numpy as jnp

    from jaxfuse.suites import attention as suite
    from pallas_kernels import reference

    B, T, S, N, K, H = (dims[x] for x in "BTSNKH")
    sets = [suite.make_inputs(B, T, S, N, K, H, seed=300 + i)[:3] for i in range(2)]
    q, k, v = sets[0]
    up = lambda x: x[:1].astype(jnp.float32)  # noqa: E731
    want = jax.jit(lambda q, k, v: reference.attention(up(q), up(k), up(v), causal=causal))(q, k, v)
    flops = 4 * B * N * T * S * H / (2 if causal else 1)
    row = {"shape": name, "dims": dims, "causal": causal, "flops": flops,
           "config": None if config is None else config.to_dict()}
    fns = implementations(causal, config)
    for impl in impls:
        try:
            out = fns[impl](q, k, v)
            o = out[0] if impl == "mosaic+residuals" else out
            row[f"{impl}_err"] = err = rel_err(o[:1], want)
            if impl == "mosaic+residuals":
                want_lse = jax.jit(functools.partial(reference_lse, causal=causal, scale=H**-0.5))(q[:1], k[:1])
                row["lse_err"] = rel_err(out[1][:1], want_lse)
            if not err <= 2e-2:
                raise AssertionError(f"relative error {err:.2e} against the float32 reference")
            t, kernels = time_us(fns[impl], sets, iterations)
            row[f"{impl}_us"], row[f"{impl}_kernels"] = t, kernels
            log(f"  {name:5s} causal={causal!s:5s} {impl:16s} {t:9.1f} µs  {flops / t / 1e6:6.1f} TFLOP/s  "
                f"err {err:.1e}")
        except Exception as e:  # noqa: BLE001 -- record and go on
            row[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"  {name:5s} causal={causal!s:5s} {impl:16s} FAILED {row[f'{impl}_error']}")
            traceback.print_exc(limit=3)
    return row


def table(rows: list[dict]) -> str:
    lines = ["shape  causal  mosaic_us  cudnn_us  triton_us  cudnn/mosaic  triton/mosaic  mosaic_TFLOP/s  config"]
    for r in rows:
        m, c, t = (r.get(f"{x}_us", math.nan) for x in ("mosaic", "cudnn", "triton"))
        cfg = "" if r["config"] is None else ",".join(f"{k}={v}" for k, v in r["config"].items())
        lines.append(f"{r['shape']:5s}  {r['causal']!s:6s} {m:9.1f} {c:9.1f} {t:10.1f}  {c / m:12.3f}  {t / m:13.3f}  "
                     f"{r['flops'] / m / 1e6:14.1f}  {cfg}")
    return "\n".join(lines)


def smoke() -> int:
    import jax
    import jax.numpy as jnp

    from pallas_kernels import reference
    from pallas_kernels.attention import mosaic

    log(f"device {jax.devices()[0].device_kind} cc={getattr(jax.devices()[0], 'compute_capability', '?')} "
        f"jax {jax.__version__}")
    for name, sig in probe().items():
        log(f"  probe {name}{sig}")
    bad = 0
    for causal, (B, T, S, N, K, H) in ((False, (2, 512, 512, 4, 2, 128)), (True, (1, 1000, 777, 4, 4, 64))):
        kq, kk, kv = jax.random.split(jax.random.key(T), 3)
        q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(jnp.bfloat16)
        o, lse = jax.block_until_ready(jax.jit(lambda q, k, v: mosaic.attention_forward(q, k, v, causal=causal))(
            q, k, v))
        up = lambda x: x.astype(jnp.float32)  # noqa: E731
        err = rel_err(o, reference.attention(up(q), up(k), up(v), causal=causal))
        lse_err = rel_err(lse, reference_lse(q, k, causal=causal, scale=H**-0.5))
        log(f"  smoke causal={causal} {(B, T, S, N, K, H)}: o err {err:.2e}, lse err {lse_err:.2e}")
        bad += not (err <= 2e-2 and lse_err <= 1e-3)
    return int(bad > 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=170.0)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--shapes", default="main,1k,8k,gqa,h64")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--compare-persistent", action="store_true",
                        help="instead of the default plan: the persistent config against the default one and cuDNN, "
                             "at every shape non-causal and at the main shape causal")
    args = parser.parse_args()
    if args.smoke:
        return smoke()

    from jaxfuse import bench
    from jaxfuse.suites import attention as suite
    from pallas_kernels.attention import mosaic

    deadline = T0 + args.budget_s
    result = {"env": bench.environment(), "probe": probe(), "iterations_per_set": args.iterations, "input_sets": 2,
              "rows": [], "sweep": [], "skipped": []}
    path = os.path.join(args.out, "attention_mosaic_fwd.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    # Order: the main shape, the other shapes against cuDNN, the sweep, then Triton at the other shapes.
    shapes = args.shapes.split(",")
    plan = [("row", shapes[0], c, ["mosaic", "cudnn", "triton", "mosaic+residuals"], None) for c in (False, True)]
    plan += [("row", s, c, ["mosaic", "cudnn"], None) for s in shapes[1:] for c in (False, True)]
    plan += [("sweep", shapes[0], c, ["mosaic"], mosaic.MosaicAttentionConfig(**p)) for p in SWEEP
             for c in (False, True)]
    plan += [("row", s, c, ["triton"], None) for s in shapes[1:] for c in (False, True)]
    if args.compare_persistent:
        persistent = mosaic.MosaicAttentionConfig(persistent=True)
        plan = [("row", shapes[0], c, impls, cfg) for c in (False, True)
                for impls, cfg in ((["mosaic", "cudnn"], None), (["mosaic"], persistent))]
        plan += [("row", s, False, ["mosaic", "cudnn"], persistent) for s in shapes[1:]]
        plan += [("row", s, False, ["mosaic"], None) for s in shapes[1:]]
    rows = {}
    for kind, name, causal, impls, config in plan:
        if time.time() > deadline:
            result["skipped"].append({"kind": kind, "shape": name, "causal": causal, "impls": impls,
                                      "config": None if config is None else config.to_dict()})
            continue
        row = measure_shape(name, suite.SHAPES[name], causal, impls, args.iterations, config)
        if kind == "sweep":
            result["sweep"].append(row)
        elif (name, causal, config) in rows:
            rows[(name, causal, config)].update({k: v for k, v in row.items() if k.startswith(tuple(impls))})
        else:
            rows[(name, causal, config)] = row
            result["rows"].append(row)
        save()
    save()
    log(f"wrote {path}; skipped {len(result['skipped'])} items")
    print(table(result["rows"]))
    if result["sweep"]:
        print("sweep at the main shape (mosaic µs, TFLOP/s):")
        for r in result["sweep"]:
            m = r.get("mosaic_us", math.nan)
            print(f"  causal={r['causal']!s:5s} {m:9.1f} {r['flops'] / m / 1e6:7.1f}  {r['config']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
