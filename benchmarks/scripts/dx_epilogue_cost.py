"""Where the rmsnorm_matmul dx kernel's time beyond cuBLAS goes: the same product dy @ wᵀ, one piece of the fusion
added at a time, timed interleaved (CUPTI medians) on the GPU.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=$PWD python benchmarks/scripts/dx_epilogue_cost.py \
        --out $OUT [--shape 32768x4096x4096]

At one shape (M×K×N: dy (M, N), w (K, N), the dx product (M, K) bf16), with the dx kernel's config of that shape
(``norm_matmul.config.mosaic_default_config(...).dx``: on the GPU, its tuned entry), whole tiles or stream-K as the
config says, and each variant again with ``stream_k=0`` ("_whole"):
  xla        XLA's dot (cuBLAS with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false; else its autotuner's pick)
  xla_transpose_w  wᵀ materialized by XLA (what the "_nn" forms would add)
  core       the Mosaic core, no fusion, the output stored at the tile's end ("end")
  core_next  the same, each output tile stored under the next tile's first wgmma ("next_tile")
  core_4stages  "core" with a fourth stage (the room the tile input's buffer takes)
  tile_in    an (M, K) tile input prefetched per tile, added to the product and stored from its buffer (store_in):
             the dx epilogue's data movement without its arithmetic
  dx         the dx kernel's fusion with its row dot coming in (``norm_matmul.mosaic._dx_fusion``)
  dx_dyr     the same, also writing dyr = (r / s) ⊙ dy from the dy blocks (``Fusion.a_copy``): the suite entry's form
  *_nn       B = wᵀ materialized (N, K), read as stored instead of w read transposed
Outputs are checked against float32 (the products against dy @ wᵀ; dx against its formula). Writes
``dx_epilogue_cost-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from attention_fused_bwd import results_file
from jaxfuse import bench
from pallas_kernels.gemm import Fusion, gemm
from pallas_kernels.norm_matmul import config as nm_config
from pallas_kernels.norm_matmul import mosaic as nm

_F32 = jnp.float32


def _variants(M: int, K: int, N: int, dx_cfg) -> dict:
    """name -> (fn(dy, w, wt, x, rstd, row_dot, gamma) -> output arrays, config); wt = wᵀ (N, K) materialized, for
    the "_nn" forms, whose B is read as stored."""
    tile_in = Fusion(tile_inputs=("x",), store_in="x", epilogue=lambda ctx, acc, carry: (acc + ctx.load_tile("x"), {}))
    dyr = jax.ShapeDtypeStruct((M, N), jnp.bfloat16)

    def operand_b(w, wt, nn):
        return (wt, False) if nn else (w, True)

    def core(nn=False):
        def fn(config):
            config = dataclasses.replace(config, tile_input_in="buffer")  # (no tile input to put in the ring)

            def run(dy, w, wt, x, rstd, row_dot, gamma):
                b, transpose_b = operand_b(w, wt, nn)
                return gemm(dy, b, transpose_b=transpose_b, config=config, out_dtype=jnp.bfloat16, name="dx_core")
            return run
        return fn

    def fused(fusion, arrays, nn=False):
        def fn(config):
            def run(dy, w, wt, x, rstd, row_dot, gamma):
                named = dict(x=x, rstd=rstd, row_dot=row_dot, gamma=gamma, dyr_scale=rstd)
                b, transpose_b = operand_b(w, wt, nn)
                return gemm(dy, b, transpose_b=transpose_b, config=config, out_dtype=jnp.bfloat16, fusion=fusion,
                            arrays={n: named[n] for n in arrays}, name="dx_fused")
            return run
        return fn

    dx_dyr = nm._dx_fusion(M, K, False, True, dyr), ("x", "rstd", "row_dot", "gamma", "dyr_scale")
    builders = {
        "core": (core(), {}),
        "core_next": (core(), dict(epilogue_store="next_tile")),
        "core_4stages": (core(), dict(num_stages=4)),
        "tile_in": (fused(tile_in, ("x",)), {}),
        "dx": (fused(nm._dx_fusion(M, K, False, True), ("x", "rstd", "row_dot", "gamma")), {}),
        "dx_dyr": (fused(*dx_dyr), {}),
        "core_nn": (core(nn=True), {}),
        "core_nn_4stages": (core(nn=True), dict(num_stages=4)),
        "dx_dyr_nn": (fused(*dx_dyr, nn=True), {}),
    }
    out = {}
    for name, (build, changes) in builders.items():
        config = dataclasses.replace(dx_cfg, **changes)
        out[name] = (build(config), config)
        if config.stream_k:
            whole = dataclasses.replace(config, stream_k=0)
            out[f"{name}_whole"] = (build(whole), whole)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", type=bench.shape_arg("MxKxN"), default="32768x4096x4096")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    M, K, N = args.shape
    os.makedirs(args.out, exist_ok=True)
    result, save, path = results_file(args.out, "dx_epilogue_cost")
    keys = jax.random.split(jax.random.key(0), 6)
    dy = jax.random.normal(keys[0], (M, N), _F32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (K, N), _F32) / np.sqrt(N)).astype(jnp.bfloat16)
    x = jax.random.normal(keys[2], (M, K), _F32).astype(jnp.bfloat16)
    rstd = jax.random.uniform(keys[3], (M,), _F32, 0.5, 2.0)
    row_dot = jax.random.normal(keys[4], (M,), _F32)
    gamma = 1.0 + 0.1 * jax.random.normal(keys[5], (K,), _F32)
    wt = jnp.asarray(w.T)
    operands = (dy, w, wt, x, rstd, row_dot, gamma)
    dx_cfg = nm_config.mosaic_default_config(M, K, N, jnp.bfloat16).dx
    variants = _variants(M, K, N, dx_cfg)
    programs = {"xla": jax.jit(lambda dy, w, *_: jax.lax.dot_general(dy, w, (((1,), (1,)), ((), ())))),
                "xla_transpose_w": jax.jit(lambda dy, w, *_: jnp.transpose(w))}
    programs.update({name: jax.jit(fn) for name, (fn, _) in variants.items()})

    product = jnp.dot(dy.astype(_F32), w.astype(_F32).T)
    want_dx = (product * gamma[None, :] * rstd[:, None]
               - x.astype(_F32) * (rstd * rstd * row_dot / K)[:, None])
    errors = {}
    for name, program in programs.items():
        got = np.asarray(jax.tree.leaves(program(*operands))[0], np.float32)
        if name == "xla_transpose_w":
            errors[name] = float(np.max(np.abs(got - np.asarray(w, np.float32).T)))
            continue
        base = name.split("_whole")[0]
        want = {"tile_in": product + x.astype(_F32), "dx": want_dx, "dx_dyr": want_dx, "dx_dyr_nn": want_dx}.get(
            base, product)
        errors[name] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    timings = bench.time_interleaved([(p, operands) for p in programs.values()], iterations=args.iterations)
    row = dict(shape=f"{M}x{K}x{N}", dx_config=dx_cfg.to_dict(), rows={})
    for (name, _), t in zip(programs.items(), timings):
        row["rows"][name] = dict(us=t.median_us, max_rel_err=errors[name], method=t.method,
                                 config=variants[name][1].to_dict() if name in variants else None,
                                 top_kernels=sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:3])
        print(f"{name:16s} {t.median_us:9.1f} us  err {errors[name]:.2e}", flush=True)
    result.setdefault("timings", []).append(row)
    save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
