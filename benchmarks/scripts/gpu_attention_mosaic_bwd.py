"""The Mosaic-GPU flash-attention backward on one H100: GPU tests, correctness, device time against cuDNN and the
Triton backend, a small config sweep, saturated-softmax errors, and jax's own Mosaic backward for comparison.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_attention_mosaic_bwd.py --out $OUT [--budget-s 200]

Times are device-kernel time (CUPTI through ``jaxfuse.bench.time_kernels``, the same CUPTI hooks as
``mosaic.gpu.profiler.measure(aggregate=False)``; median over iterations, 2 rotated sets of fresh N(0, 1) bf16
inputs). Steps, in order; each is recorded, a failure is recorded and the rest goes on, and no step starts after
--budget-s (those left are recorded as skipped):
 0. probe: device, jax version, the signatures of the Mosaic-GPU APIs the kernels use.
 1. main shape (B4 T=S=4096 N16 H128), non-causal and causal, each checked against the float32 reference on batch
    element 0 before timing: "mosaic" = delta + pads + dQ kernel + dK/dV kernel (per-kernel split kept); cuDNN
    forward and forward+backward (jax.vjp with a random cotangent, o returned): its backward as the difference and
    as the sum of the kernels the fwd+bwd program launches beyond the forward's; "triton" = today's
    pallas_kernels.flash_attention backward alone (delta + dK/dV + dQ kernels), with its own forward's residuals.
 2. sweep of MosaicAttentionBwdConfig at the main shape (each candidate checked): the best dQ and dK/dV kernel
    settings are picked from the per-kernel times, combined, and timed.
 3. saturated softmax (q, k x 30; B1 T=S=1024 N4 H128): dq/dk/dv errors against numpy float64 for the Mosaic
    backward with o in float32 and o rounded to the input dtype (the Triton backend's delta today), and for plain
    XLA attention in the same dtype.
 4. ``pytest -k "gradients or saturated" tests/test_attention_mosaic_bwd.py`` (the GPU numbers), capped.
 5. the other suite shapes (gqa, h64, 1k, 8k), causal and not: mosaic (default config) and cuDNN.
 6. jax's attention_mgpu (fp16, its own tests' three backward block settings) fwd+bwd, per kernel.
Writes $OUT/attention_mosaic_bwd.json after every step (device, jax version, commit from $JAXFUSE_COMMIT, date)
and prints a compact table last.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import os
import sys
import time
import traceback

T0 = time.time()
SWEEP = [  # overrides of the default config, tried at the main shape
    {},
    dict(block_kv_dq=128),
    dict(num_stages_dq=3, num_stages_dkv=3),
    dict(block_q_dkv=128),
    dict(compute_wgs_dq=1, compute_wgs_dkv=1),
    dict(num_stages_dkv=4, block_kv_dq=128),
]
OTHER_SHAPES = ("gqa", "h64", "1k", "8k")


def log(message: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {message}", flush=True)


class Run:
    """Results so far, written to JSON after every step."""

    def __init__(self, out_dir: str, budget_s: float, interpret: bool):
        self.out_dir, self.deadline, self.interpret = out_dir, T0 + budget_s, interpret
        self.data: dict = {"steps": {}}
        self.main_args: dict = {}  # causal -> (argument sets, batch-0 reference) of the main shape, for the sweep

    def step(self, name: str, fn, *args):
        if time.time() > self.deadline:
            self.data["steps"][name] = "skipped: budget spent"
            log(f"{name}: skipped, budget spent")
            return None
        log(f"step {name}")
        try:
            result = fn(self, *args)
            self.data["steps"][name] = "ok"
            return result
        except Exception as e:  # noqa: BLE001 -- recorded; the other steps still run
            self.data["steps"][name] = f"FAILED: {type(e).__name__}: {str(e)[:2000]}"
            log(f"{name} FAILED:\n{traceback.format_exc()[-3000:]}")
            return None
        finally:
            self.save()

    def save(self):
        with open(os.path.join(self.out_dir, "attention_mosaic_bwd.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)

    def kernels_context(self):
        """GPU interpret mode (jax >= 0.11, CPU smoke runs of this script only) or nothing."""
        if not self.interpret:
            return contextlib.nullcontext()
        from jax.experimental.pallas import mosaic_gpu as plgpu
        return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def _shape(name: str, small: bool) -> dict:
    from jaxfuse.suites import attention as suite

    s = dict(suite.SHAPES[name])
    if small:  # CPU smoke run: the script's plumbing, not a measurement
        s.update(B=1, T=128, S=128, N=2 if s["N"] == s["K"] else 4, K=2, H=s["H"])
    return s


def _time(run: Run, fn, arg_sets, iterations: int, *, mosaic: bool = True) -> dict:
    from jaxfuse import bench

    with run.kernels_context() if mosaic else contextlib.nullcontext():
        t = bench.time_kernels(fn, arg_sets, iterations=iterations, warmup=1)
    return {"us": t.median_us, "spread": t.spread, "per_kernel_us": t.per_kernel_us, "method": t.method}


def _kernel_us(timing: dict, needle: str) -> float:
    return sum(us for name, us in timing["per_kernel_us"].items() if needle in name)


def _residuals(q, k, v, causal: bool):
    """(o float32, lse) from the float32 jnp reference, one batch element at a time (the scores of one element)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import mosaic_bwd as mb

    f = jax.jit(lambda q, k, v: mb.reference_residuals(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5))
    parts = [f(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(q.shape[0])]
    return jnp.concatenate([p[0] for p in parts]), jnp.concatenate([p[1] for p in parts])


def _mosaic_fn(causal: bool, H: int, config):
    import jax

    from pallas_kernels.attention import mosaic_bwd as mb

    return jax.jit(lambda q, k, v, o, lse, do: mb.attention_backward(
        q, k, v, o, lse, do, causal=causal, scale=H**-0.5, q_segment_ids=None, kv_segment_ids=None,
        kv_seq_lengths=None, config=config))


def _errors(run: Run, grads, ref) -> dict:
    """Relative errors (max |x - ref| / max |ref|) of batch element 0 of (dq, dk, dv) against ref (o, dq, dk, dv)."""
    from jaxfuse.suites import attention as suite

    return {name: suite._rel_error(g[:1], r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref[1:])}


def _checked(errors: dict) -> bool:
    return all(math.isfinite(e) and e < 5e-2 for e in errors.values())


def _config(overrides: dict, q, k, causal):
    import dataclasses

    from pallas_kernels.attention import mosaic_bwd as mb

    return dataclasses.replace(mb.default_config_bwd(q, k, causal=causal), **overrides)


def _mosaic_row(run: Run, row: dict, sets, causal: bool, iterations: int):
    """Checks the Mosaic backward (default config) against the float32 reference on batch element 0, then times
    it; fills row and returns (argument sets, reference) for further candidates."""
    from jaxfuse.suites import attention as suite

    res = [_residuals(q, k, v, causal) for q, k, v, _ in sets]
    ref = suite._reference_slice(*sets[0], causal)
    q, k = sets[0][0], sets[0][1]
    config = _config({}, q, k, causal)
    fn = _mosaic_fn(causal, q.shape[-1], config)
    args = [(q, k, v, o, lse, do) for (q, k, v, do), (o, lse) in zip(sets, res)]
    with run.kernels_context():
        row["mosaic_errors"] = _errors(run, fn(*args[0]), ref)
    row["mosaic_config"] = config.to_dict()
    row["mosaic"] = _time(run, fn, args, iterations)
    log(f"{row['shape']} causal={causal}: mosaic {row['mosaic']['us']:.1f} µs errors {row['mosaic_errors']}")
    return args, ref


def _cudnn_row(run: Run, row: dict, sets, causal: bool, iterations: int):
    """cuDNN forward and forward+backward; its backward as the difference and as the kernels beyond the forward's."""
    import jax

    from jaxfuse.suites import attention as suite

    try:
        fwd = jax.jit(lambda q, k, v: suite._cudnn_attention(q, k, v, causal=causal))
        fwd_bwd = jax.jit(suite._fwd_bwd(suite._cudnn_attention, causal))
        row["cudnn_fwd"] = _time(run, fwd, [a[:3] for a in sets], iterations)
        row["cudnn_fwd_bwd"] = _time(run, fwd_bwd, sets, iterations)
        fwd_names = set(row["cudnn_fwd"]["per_kernel_us"])
        row["cudnn_bwd_kernels_us"] = sum(us for n, us in row["cudnn_fwd_bwd"]["per_kernel_us"].items()
                                          if n not in fwd_names)
        row["cudnn_bwd_diff_us"] = row["cudnn_fwd_bwd"]["us"] - row["cudnn_fwd"]["us"]
        log(f"  cudnn fwd {row['cudnn_fwd']['us']:.1f} fwd+bwd {row['cudnn_fwd_bwd']['us']:.1f} bwd kernels "
            f"{row['cudnn_bwd_kernels_us']:.1f}")
    except Exception as e:  # noqa: BLE001
        row["cudnn_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(f"  cudnn failed: {row['cudnn_error']}")


# ---------------------------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------------------------
def probe(run: Run):
    import jax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxfuse import bench

    run.data["env"] = bench.environment()
    sigs = {}
    for name in ("load", "kernel", "emit_pipeline_warp_specialized", "CompilerParams", "wgmma",
                 "wgmma_accumulator_load", "copy_gmem_to_smem", "copy_smem_to_gmem", "BlockSpec", "Barrier"):
        try:
            sigs[name] = str(inspect.signature(getattr(plgpu, name)))
        except Exception as e:  # noqa: BLE001
            sigs[name] = f"{type(e).__name__}: {e}"
    run.data["mosaic_api"] = sigs
    dev = jax.devices()[0]
    run.data["env"]["compute_capability"] = getattr(dev, "compute_capability", None)
    log(f"env {run.data['env']}")
    log("api " + json.dumps(sigs)[:1500])


def tests(run: Run, timeout_s: float):
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gradients or saturated",
           "tests/test_attention_mosaic_bwd.py"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        text, status = proc.stdout + proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"TIMED OUT after {timeout_s:.0f} s"
    with open(os.path.join(run.out_dir, "pytest.txt"), "w") as f:
        f.write(f"{status}\n{text}")
    tail = "\n".join(text.strip().splitlines()[-15:])
    run.data["pytest"] = {"status": status, "tail": tail}
    log(f"pytest {status}:\n{tail}")


def main_shape(run: Run, iterations: int):
    import jax

    from jaxfuse.suites import attention as suite
    from pallas_kernels import triton_utils

    s = _shape("main", run.interpret)
    B, T, S, N, K, H = (s[x] for x in "BTSNKH")
    sets = [suite.make_inputs(B, T, S, N, K, H, seed=300 + i) for i in range(2)]
    fa = importlib.import_module("pallas_kernels.flash_attention")
    run.data["main"] = {}
    for causal in (False, True):
        row: dict = {"shape": "main", "dims": dict(B=B, T=T, S=S, N=N, K=K, H=H), "causal": causal}
        run.data["main"][str(causal)] = row
        args, ref = _mosaic_row(run, row, sets, causal, iterations)
        _cudnn_row(run, row, sets, causal, iterations)
        q, k = sets[0][0], sets[0][1]
        try:
            cfg = fa.default_config(q, k, causal=causal, on_gpu=not run.interpret)
            static = fa._Static(config=cfg, causal=causal, scale=H**-0.5, interpret=run.interpret)
            with triton_utils.quiet_triton_deprecation():
                fres = [fa._forward(q, k, v, None, None, None, static=static) for q, k, v, _ in sets]
                bwd = jax.jit(lambda q, k, v, o, lse, do: fa._backward(q, k, v, None, None, None, o, lse, do,
                                                                       static=static))
                targs = [(q, k, v, o, lse, do) for (q, k, v, do), (o, lse) in zip(sets, fres)]
                bwd.lower(*targs[0]).compile()
                row["triton"] = _time(run, bwd, targs, iterations, mosaic=False)
                row["triton_config"] = cfg.to_dict()
            log(f"  triton bwd {row['triton']['us']:.1f}")
        except Exception as e:  # noqa: BLE001
            row["triton_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(f"  triton failed: {row['triton_error']}")
        run.main_args[causal] = (args, ref)


def sweep(run: Run, iterations: int):
    s = _shape("main", run.interpret)
    H = s["H"]
    run.data["sweep"] = {}
    for causal in (False, True):
        args, ref = run.main_args.pop(causal)
        q, k = args[0][0], args[0][1]
        results = []
        for overrides in SWEEP:
            if time.time() > run.deadline:
                log("  sweep: budget spent")
                break
            entry: dict = {"overrides": overrides}
            try:
                config = _config(overrides, q, k, causal)
                fn = _mosaic_fn(causal, H, config)
                with run.kernels_context():
                    entry["errors"] = _errors(run, fn(*args[0]), ref)
                entry["timing"] = _time(run, fn, args, iterations)
                entry["dq_us"] = _kernel_us(entry["timing"], "mosaic_attention_dq")
                entry["dkv_us"] = _kernel_us(entry["timing"], "mosaic_attention_dkv")
                entry["config"] = config.to_dict()
                log(f"  causal={causal} {overrides}: {entry['timing']['us']:.1f} µs (dq {entry['dq_us']:.1f}, dkv "
                    f"{entry['dkv_us']:.1f}) errors {entry['errors']}")
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                log(f"  causal={causal} {overrides}: FAILED {entry['error'][:300]}")
            results.append(entry)
        good = [e for e in results if "timing" in e and _checked(e["errors"])]
        out: dict = {"candidates": results}
        if good:
            split = all(e["dq_us"] > 0 and e["dkv_us"] > 0 for e in good)  # else: the kernels' names did not match
            by_total = lambda e: e["timing"]["us"]  # noqa: E731
            best_dq = min(good, key=(lambda e: e["dq_us"]) if split else by_total)["config"]
            best_dkv = min(good, key=(lambda e: e["dkv_us"]) if split else by_total)["config"]
            best = {f: (best_dq if f.endswith("_dq") else best_dkv)[f] for f in best_dq}
            config = _config(best, q, k, causal)
            fn = _mosaic_fn(causal, H, config)
            with run.kernels_context():
                out["best_errors"] = _errors(run, fn(*args[0]), ref)
            out["best"] = best
            out["best_timing"] = _time(run, fn, args, iterations)
            log(f"  causal={causal} best {best}: {out['best_timing']['us']:.1f} µs")
        run.data["sweep"][str(causal)] = out


def saturated(run: Run):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention import mosaic_bwd as mb

    B, T, N, H = (1, 128, 2, 64) if run.interpret else (1, 1024, 4, 128)
    scale = H**-0.5
    out = []
    for dtype in (jnp.bfloat16, jnp.float16):
        for seed in (0, 1):
            keys = jax.random.split(jax.random.key(500 + seed), 4)
            q, k = (jax.random.normal(kk, (B, T, N, H)) * 30.0 for kk in keys[:2])
            v, do = (jax.random.normal(kk, (B, T, N, H)) for kk in keys[2:])
            q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
            want = mb.float64_grads(q, k, v, do, scale)
            rel = lambda g, w: float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))  # noqa
            entry = {"dtype": jnp.dtype(dtype).name, "seed": seed, "shape": [B, T, N, H]}
            o, lse = jax.jit(lambda q, k, v: mb.reference_residuals(q, k, v, causal=False, scale=scale))(q, k, v)
            config = mb.default_config_bwd(q, k, causal=False)
            fn = _mosaic_fn(False, H, config)
            with run.kernels_context():
                for label, o_in in (("mosaic_o_f32", o), ("mosaic_o_rounded", o.astype(dtype))):
                    entry[label] = {n: rel(g, w) for n, g, w in zip(("dq", "dk", "dv"), fn(q, k, v, o_in, lse, do),
                                                                     want)}
            try:  # plain XLA attention in the same dtype: what a non-flash implementation gets
                xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")  # noqa: E731
                _, vjp = jax.vjp(xla, q, k, v)
                entry["xla"] = {n: rel(g, w) for n, g, w in zip(("dq", "dk", "dv"), vjp(do), want)}
            except Exception as e:  # noqa: BLE001
                entry["xla"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  saturated {entry}")
            out.append(entry)
    run.data["saturated"] = out


def other_shapes(run: Run, iterations: int):
    from jaxfuse.suites import attention as suite

    run.data["other"] = []
    for name in OTHER_SHAPES:
        s = _shape(name, run.interpret)
        B, T, S, N, K, H = (s[x] for x in "BTSNKH")
        sets = [suite.make_inputs(B, T, S, N, K, H, seed=400 + i) for i in range(2)]
        for causal in (False, True):
            if time.time() > run.deadline:
                log("  other shapes: budget spent")
                return
            row: dict = {"shape": name, "dims": dict(B=B, T=T, S=S, N=N, K=K, H=H), "causal": causal}
            run.data["other"].append(row)
            try:
                _mosaic_row(run, row, sets, causal, iterations)
                _cudnn_row(run, row, sets, causal, iterations)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                log(f"  {name} causal={causal}: FAILED {row['error'][:300]}")


def jax_mgpu(run: Run, iterations: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    from jaxfuse.suites import attention as suite

    s = _shape("main", run.interpret)
    B, T, S, N, K, H = (s[x] for x in "BTSNKH")
    sets = [tuple(x.astype(jnp.float16) for x in suite.make_inputs(B, T, S, N, K, H, seed=600 + i))
            for i in range(2)]
    out = []
    for blocks in ((64, 64, 64, 64), (64, 128, 128, 64), (128, 128, 128, 128)):
        if time.time() > run.deadline:
            break
        q_dq, kv_dq, q_dkv, kv_dkv = blocks
        entry: dict = {"bwd_blocks (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv)": blocks}
        try:
            cfg = am.TuningConfig(block_q=q_dq, block_kv=kv_dq, max_concurrent_steps=2, compute_wgs_bwd=2,
                                  block_q_dq=q_dq, block_kv_dq=kv_dq, block_q_dkv=q_dkv, block_kv_dkv=kv_dkv)
            attn = lambda q, k, v, causal: am.attention(q, k, v, cfg)  # noqa: E731
            entry["fwd_bwd"] = _time(run, jax.jit(suite._fwd_bwd(attn, False)), sets, iterations)
            log(f"  jax attention_mgpu {blocks}: fwd+bwd {entry['fwd_bwd']['us']:.1f} µs, kernels "
                f"{ {n[:40]: round(u, 1) for n, u in entry['fwd_bwd']['per_kernel_us'].items()} }")
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(f"  jax attention_mgpu {blocks}: FAILED {entry['error'][:300]}")
        out.append(entry)
    run.data["jax_attention_mgpu"] = out


# ---------------------------------------------------------------------------------------------------------------
# table
# ---------------------------------------------------------------------------------------------------------------
def table(run: Run) -> str:
    lines = ["| shape | causal | mosaic bwd µs (dq + dkv) | cuDNN bwd µs (fwd+bwd − fwd; its bwd kernels) | "
             "Triton bwd µs | cuDNN/mosaic | Triton/mosaic | max rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = [run.data.get("main", {}).get(str(c)) for c in (False, True)] + run.data.get("other", [])
    for r in rows:
        if not r or "mosaic" not in r:
            continue
        m = r["mosaic"]
        split = f"{_kernel_us(m, 'mosaic_attention_dq'):.0f} + {_kernel_us(m, 'mosaic_attention_dkv'):.0f}"
        cd = r.get("cudnn_bwd_diff_us", float("nan"))
        ck = r.get("cudnn_bwd_kernels_us", float("nan"))
        tr = r.get("triton", {}).get("us", float("nan"))
        err = max(r.get("mosaic_errors", {"?": float("nan")}).values())
        lines.append(f"| {r['shape']} | {r['causal']} | {m['us']:.0f} ({split}) | {cd:.0f}; {ck:.0f} | {tr:.0f} | "
                     f"{cd / m['us']:.3f} | {tr / m['us']:.3f} | {err:.1e} |")
    for causal, sw in run.data.get("sweep", {}).items():
        if "best_timing" in sw:
            lines.append(f"sweep causal={causal}: best {sw['best']} -> {sw['best_timing']['us']:.0f} µs")
    for e in run.data.get("saturated", []):
        f = lambda d: "/".join(f"{v:.1e}" for v in d.values()) if isinstance(d, dict) else str(d)[:30]  # noqa
        lines.append(f"saturated {e['dtype']} seed {e['seed']} dq/dk/dv: mosaic o f32 {f(e['mosaic_o_f32'])}, "
                     f"o rounded {f(e['mosaic_o_rounded'])}, xla {f(e.get('xla'))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--test-timeout-s", type=float, default=150.0)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run (jax >= 0.11 GPU interpret mode)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run = Run(args.out, args.budget_s, args.interpret)
    run.step("probe", probe)
    run.step("main", main_shape, args.iterations)
    run.step("sweep", sweep, args.iterations)
    run.step("saturated", saturated)
    if not args.skip_tests:
        run.step("tests", tests, args.test_timeout_s)
    run.step("other_shapes", other_shapes, args.iterations)
    if not args.interpret:
        run.step("jax_attention_mgpu", jax_mgpu, args.iterations)
    run.save()
    text = table(run)
    with open(os.path.join(args.out, "attention_mosaic_bwd.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
