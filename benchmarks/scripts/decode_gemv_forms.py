"""The decode forward's GEMV at 1x4096x14336 (w: 117 MB bf16) in three forms, against XLA's GEMV in the same run:

  triton_fma   a Pallas-Triton kernel with no MMA: products and sums on the CUDA cores, K whole per program, r from
               the same x slices: one kernel for the whole forward (``--round 1`` and ``2``: the tiles tried)
  triton_entry the tuned rmsnorm_matmul Triton entry (split-K MMA tiles; two small XLA fusions combine the splits)
  mosaic_*     the Mosaic core (``pallas_kernels.matmul``) transposed, yᵀ (N, 16) = wᵀ (N, K) @ x16ᵀ (K, 16): TMA
               loads from its memory warpgroup, wgmma with N=16, x padded to 16 rows (``--round 3`` and ``4``)

    PYTHONPATH=$PWD python benchmarks/scripts/decode_gemv_forms.py --out $OUT --round 1

CUPTI medians per kernel over 40 calls, input sets rotated (``bench.time_kernels``). Round 1 also times the
fwd+bwd programs of 16x4096x4096 and 1x4096x14336 per kernel (ours and XLA's). Writes
``decode_gemv_forms-<round>.json``.
Measured on the H200 (NOTES.md, thirty-ninth session): the Triton forms read w at 3.4-3.6 TB/s at best, the Mosaic
core's best forms at 3.7-4.0 (29.5-31.8 µs from call to call), XLA's GEMV at 3.8-4.0 (29.4-30.8 µs).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import pallas_kernels
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from pallas_kernels import triton_utils as tu

F32 = jnp.float32
K, N = 4096, 14336

# (block_n, block_k, warps, stages, reduce each step)
TRITON_ROUNDS = {
    1: [(128, 64, 4, 1, 0), (128, 64, 4, 3, 0), (128, 32, 4, 3, 0), (128, 128, 8, 3, 0), (128, 64, 8, 3, 0),
        (64, 64, 4, 3, 0), (64, 128, 4, 3, 0), (64, 64, 4, 1, 0), (64, 64, 2, 3, 0), (32, 128, 4, 3, 0),
        (32, 128, 2, 3, 0), (32, 256, 4, 3, 0), (256, 32, 4, 3, 0), (256, 32, 8, 3, 0), (256, 64, 8, 2, 0),
        (128, 64, 4, 3, 1), (64, 128, 4, 4, 1), (128, 128, 4, 2, 0), (64, 256, 8, 2, 0), (16, 256, 2, 3, 0)],
    2: [(64, 256, 8, 1, 0), (64, 256, 8, 3, 0), (64, 256, 4, 2, 0), (64, 256, 16, 2, 0), (64, 512, 8, 2, 0),
        (64, 512, 16, 2, 0), (32, 256, 8, 2, 0), (32, 512, 8, 2, 0), (32, 512, 4, 2, 0), (128, 256, 8, 2, 0),
        (128, 256, 16, 2, 0), (128, 128, 8, 2, 0), (64, 128, 8, 2, 0), (64, 128, 4, 2, 0), (16, 512, 4, 2, 0),
        (64, 256, 8, 2, 0)],
}
_G = dict(tile_n=16, epi_tile_n=16)
_PP = dict(_G, schedule="pingpong", epilogue_store="end")
MOSAIC_ROUNDS = {
    3: {"pp_m64_k128_s8": dict(_PP, tile_m=64, tile_k=128, num_stages=8, delay_release=1),
        "pp_m64_k64_s12": dict(_PP, tile_m=64, tile_k=64, num_stages=12, delay_release=1),
        "pp_m128_k64_s8": dict(_PP, tile_m=128, tile_k=64, num_stages=8, delay_release=1),
        "pp_m128_k128_s5": dict(_PP, tile_m=128, tile_k=128, num_stages=5, delay_release=1),
        "co_m64_k128_s6": dict(_G, tile_m=64, tile_k=128, num_stages=6, wg_split="m"),
        "co_m64_k64_s10": dict(_G, tile_m=64, tile_k=64, num_stages=10, wg_split="m"),
        "pp_m64_k256_s4": dict(_PP, tile_m=64, tile_k=256, num_stages=4, delay_release=1),
        "co_m64_k128_s6_sk2": dict(_G, tile_m=64, tile_k=128, num_stages=6, wg_split="m", stream_k=2),
        "co_m64_k256_s3": dict(_G, tile_m=64, tile_k=256, num_stages=3, wg_split="m")},
    4: {"pp_m128_k128_s3": dict(_PP, tile_m=128, tile_k=128, num_stages=3, delay_release=1),
        "pp_m128_k128_s4_d2": dict(_PP, tile_m=128, tile_k=128, num_stages=4, delay_release=2),
        "pp_m128_k256_s3": dict(_PP, tile_m=128, tile_k=256, num_stages=3, delay_release=1),
        "co_m64_k64_s8_d1": dict(_G, tile_m=64, tile_k=64, num_stages=8, wg_split="m", delay_release=1),
        "co_m64_k128_s6_d1": dict(_G, tile_m=64, tile_k=128, num_stages=6, wg_split="m", delay_release=1)},
}


def _fma_kernel(x_ref, g_ref, w_ref, y_ref, r_ref, *, bn, bk, eps, reduce_each):
    """y[0, n0:n0+bn] = r · Σ_K (x·γ)[k] w[k, n]: (bk, 1) x and γ slices broadcast over the (bk, bn) w slice,
    accumulated elementwise in float32 (or summed over K each step), r from the same x slices."""
    n0 = pl.program_id(0) * bn

    def body(i, carry):
        acc, sq = carry
        rows = pl.ds(i * bk, bk)
        x = x_ref[rows, :].astype(F32)  # (bk, 1)
        prod = (x * g_ref[rows, :].astype(F32)) * w_ref[rows, pl.ds(n0, bn)].astype(F32)  # (bk, bn)
        acc = acc + (jnp.sum(prod, axis=0, keepdims=True) if reduce_each else prod)
        return acc, sq + x * x

    acc0 = jnp.zeros((1, bn) if reduce_each else (bk, bn), F32)
    acc, sq = lax.fori_loop(0, K // bk, body, (acc0, jnp.zeros((bk, 1), F32)))
    r = lax.rsqrt(jnp.sum(sq, axis=0, keepdims=True) * (1.0 / K) + eps)  # (1, 1)
    y_ref[:, pl.ds(n0, bn)] = (jnp.sum(acc, axis=0, keepdims=True) * r).astype(y_ref.dtype)

    @pl.when(pl.program_id(0) == 0)
    def _():
        r_ref[...] = r


@functools.partial(jax.jit, static_argnames=("bn", "bk", "warps", "stages", "reduce_each"))
def triton_fma(x, gamma, w, *, bn, bk, warps, stages, reduce_each, eps=1e-6):
    """x (1, K), gamma (K,), w (K, N) -> y (1, N) in x's dtype: the whole RMSNorm→matmul forward, one kernel."""
    y, _ = tu.pallas_call(
        functools.partial(_fma_kernel, bn=bn, bk=bk, eps=eps, reduce_each=reduce_each),
        num_warps=warps, num_stages=stages, interpret=False, grid=(N // bn,),
        out_shape=[jax.ShapeDtypeStruct((1, N), x.dtype), jax.ShapeDtypeStruct((1, 1), F32)],
        name="rmsnorm_gemv_fwd")(x.reshape(K, 1), gamma.reshape(K, 1), w)
    return y


def mosaic_gemv(config):
    """x (1, K), w (K, N) -> yᵀ (N, 16) = wᵀ @ x16ᵀ, x padded to 16 rows (the GEMV alone, no norm)."""
    return lambda x, g, w: pallas_kernels.matmul(w, jnp.pad(x, ((0, 15), (0, 0))), transpose_a=True,
                                                 transpose_b=True, config=config)


def _row(name, timing, **extra):
    kernels = sorted(((k, round(v, 2)) for k, v in timing.per_kernel_us.items()), key=lambda kv: -kv[1])
    return dict(impl=name, us=round(timing.median_us, 2), **extra, kernels=kernels[:6])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--round", type=int, choices=(1, 2, 3, 4), required=True)
    args = parser.parse_args()
    sets = [suite.make_inputs(1, K, N, seed=s)[:3] for s in range(3 if args.round <= 2 else 2)]
    x, g, w = sets[0]
    x32 = x.astype(F32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * g.astype(F32)
    calls = {"xla": suite.SPEC.implementations()["xla"]}
    if args.round <= 2:
        calls["triton_entry"] = lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="triton")
        for bn, bk, warps, stages, re in TRITON_ROUNDS[args.round]:
            calls[f"gemv_n{bn}_k{bk}_w{warps}_s{stages}" + ("_re" if re else "")] = functools.partial(
                triton_fma, bn=bn, bk=bk, warps=warps, stages=stages, reduce_each=bool(re))
        want = normed @ w.astype(F32)
    else:
        calls["xla_dot_M1"] = lambda x, g, w: jnp.dot(x, w)
        calls.update({name: mosaic_gemv(cfg) for name, cfg in MOSAIC_ROUNDS[args.round].items()})
        want = x32 @ w.astype(F32)  # the GEMV alone
    rows = []
    for name, fn in calls.items():
        fn = jax.jit(fn)
        try:
            got = fn(x, g, w)
            got = got if got.shape == want.shape else got.T[:1]
            err = None if (name == "xla" and args.round > 2) else float(
                jnp.max(jnp.abs(got.astype(F32) - want)) / jnp.max(jnp.abs(want)))
            timing = bench.time_kernels(fn, sets, iterations=40)
        except Exception as e:  # noqa: BLE001 -- a form that does not compile is reported, the others still run
            print(name, "ERR", str(e)[:400], flush=True)
            continue
        rows.append(_row(name, timing, shape=f"1x{K}x{N}", mode="fwd", err=err))
        print(json.dumps(rows[-1]), flush=True)
    if args.round == 1:  # where the decode fwd+bwd programs spend their time, per kernel
        impls = suite.SPEC.implementations()
        for M, K_, N_ in [(16, 4096, 4096), (1, 4096, 14336)]:
            mode_sets = [suite.make_inputs(M, K_, N_, seed=s) for s in range(4)]
            for name, fn in [("xla", impls["xla"]), ("xla_matmul_alone", lambda x, g, w: jnp.dot(x, w)),
                             ("triton_entry", lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w,
                                                                                            backend="triton"))]:
                program = jax.jit(suite.SPEC.program(fn, "fwd+bwd", dict(M=M, K=K_, N=N_), {}))
                rows.append(_row(name, bench.time_kernels(program, mode_sets, iterations=40),
                                 shape=f"{M}x{K_}x{N_}", mode="fwd+bwd"))
                print(json.dumps(rows[-1]), flush=True)
    path = os.path.join(args.out, f"decode_gemv_forms-{args.round}.json")
    with open(path, "w") as f:
        json.dump(dict(environment=bench.environment(), round=args.round, rows=rows), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
