"""On the H100: what bounds the flash-attention forward in the Triton lowering, measured part by part.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_attention_forward_floor.py --out $OUT

Issue 4 asks for a forward >= 0.8x cuDNN at B=4, T=S=4096, N=16, H=128 (bf16, non-causal). Tile, warp and stage
sweeps, a lazy rescale and an early q·kᵀ did not get there (benchmarks/results/attention-sweep-*.txt). This script
times variants of the forward's loop, built here as a minimal kernel (full tiles, no masks: the main shape needs
none) with the production tiling (128x128, 8 warps, 3 stages unless --tiles says otherwise):

  softmax         the production loop's math with jnp.exp2 (libdevice __nv_exp2f: the library kernel before it
                  took ftz; checks that the minimal kernel times as flash_attention did)
  ftz             softmax with exp2 as inline PTX ex2.approx.ftz.f32 (``triton_utils.exp2``: the library kernel now)
  dots_only       the two tile dots alone, p = bf16(q·kᵀ): what the tensor cores and loads cost in this lowering
  no_exp          the online softmax with both exp2 replaced by a subtraction: what the exp2s (MUFU) cost
  split_mufu      the key tile as two halves, each with its own pair of dots, both exp2 on the MUFU
  split_poly      as split_mufu, but the second half's exp2 is a degree-3 polynomial on the FMA pipe (the FA4
                  trick: the H100 has 16 MUFU lanes per SM and clock against 128 FMA lanes)
  ftz_split_poly  split_poly with the first half's exp2 as ex2.approx.ftz.f32
  two_chains      ftz, with the query tile as two independent 64-row chains sharing each K/V tile, both chains'
                  q·kᵀ issued before either softmax (two_chains_mufu: the same with libdevice exp2)
  poly_all        every score's exp2 as the polynomial
  bf16x2          exp2 of two scores per MUFU instruction: x rounded to bf16, ex2.approx.ftz.bf16x2, p returned in
                  bf16 (the PV dot's operand, no further rounding; the row sums add the same bf16 values)
  f16x2           x rounded to f16, ex2.approx.f16x2, p widened back to float32 (two_chains_bf16x2 /
                  two_chains_f16x2: the same on two query chains)

It also times ``pallas_kernels.flash_attention`` and cuDNN in the same run and checks every variant that computes
attention against the float32 reference (bf16, relative error, NaN). Writes
$OUT/attention-forward-floor-<device tag>.json and prints a table. (An attempt to count wgmma in the PTX was
dropped: jax 0.11.2's ``--xla_dump_to`` wrote no .ptx file for these programs.)

Results (H100, 2026-11-23): benchmarks/results/attention-forward-floor-h100.json (128x128 tiles, 8 warps, 3 stages)
and attention-forward-floor-128x64-h100.json (128x64, 4 warps, 2 stages; softmax, ftz and dots_only only);
attention-forward-floor-chains-packed-h100.json (two_chains and the packed exp2 variants at several tilings: at
128x64 / 4 warps / 2 stages two_chains 1088-1090 vs ftz 1117-1121 µs, bf16x2 1126, f16x2 1162; with 8 warps
two_chains is no better, at 128x128 / 8 warps it doubles the time).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

START = time.time()
LOG2E = math.log2(math.e)
# 2**f on [-0.5, 0.5], minimax relative error 7.5e-5 (fitted in float64, checked in float32): far below bf16's 3.9e-3.
POLY = (0.9999281, 0.69326097, 0.24261054, 0.05517132)
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + ROUND_MAGIC holds round(x) in its low mantissa bits
# variant -> (key-tile parts, how each part's exp2 is computed; None: no softmax at all)
VARIANTS = {
    "softmax": (1, ("mufu",)),
    "dots_only": (1, None),
    "no_exp": (1, ("none",)),
    "ftz": (1, ("ftz",)),
    "split_mufu": (2, ("mufu", "mufu")),
    "split_poly": (2, ("mufu", "poly")),
    "ftz_split_poly": (2, ("ftz", "poly")),
    "poly_all": (1, ("poly",)),
    "two_chains": (1, ("ftz",)),
    "two_chains_mufu": (1, ("mufu",)),
    "bf16x2": (1, ("bf16x2",)),
    "f16x2": (1, ("f16x2",)),
    "two_chains_bf16x2": (1, ("bf16x2",)),
    "two_chains_f16x2": (1, ("f16x2",)),
}
# Variants whose query tile is two independent halves (block_q / 2 rows each, their own acc, max and sum) that share
# each K/V tile: both halves' q·kᵀ are issued before either softmax, so the tensor cores have the second half's
# product to compute while the first half's exp2s run (FA3's intra-warpgroup overlap, if Triton's async wgmma waits
# allow it).
QUERY_CHAINS = {"two_chains": 2, "two_chains_mufu": 2, "two_chains_bf16x2": 2, "two_chains_f16x2": 2}
# Packed exp2: one MUFU instruction for two elements. bf16x2 rounds x to bf16 and returns p in bf16 (the PV dot's
# operand as is); f16x2 rounds x to f16 (11-bit mantissa) and returns float32.
PACKED_EXP2_ASM = {
    "bf16x2": ("cvt.rn.bf16x2.f32 $0, $2, $1; ex2.approx.ftz.bf16x2 $0, $0;", "=r,r,r", "bfloat16"),
    "f16x2": ("{ .reg .b32 t; .reg .b16 lo, hi; cvt.rn.f16x2.f32 t, $3, $2; ex2.approx.f16x2 t, t; "
              "mov.b32 {lo, hi}, t; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }", "=r,=r,r,r", "float32"),
}


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def exp2_poly(x, *, interpret: bool = False):
    """2**x for x <= 0 without the MUFU: x = j + f with j = round(x), 2**f by POLY, j added to the exponent bits.
    x is clamped at -125 (2**-125 stands in for 0). XLA (interpret mode) folds (x + M) - M to x, so there the
    rounded sum goes through an optimization barrier; the Triton lowering keeps it as written."""
    import jax.numpy as jnp
    from jax import lax

    x = jnp.maximum(x, -125.0)
    shifted = x + ROUND_MAGIC
    if interpret:
        shifted = lax.optimization_barrier(shifted)
    f = x - (shifted - ROUND_MAGIC)
    p = POLY[0] + f * (POLY[1] + f * (POLY[2] + f * POLY[3]))
    bits = lax.bitcast_convert_type(p, jnp.int32) + lax.shift_left(lax.bitcast_convert_type(shifted, jnp.int32), 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def make_forward(variant: str, *, block_q: int, block_k: int, num_warps: int, num_stages: int,
                 interpret: bool = False):
    """A jitted (q, k, v) -> o forward, q/k/v (B, T, N, H) with T and S multiples of the tiles, no masks."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    from pallas_kernels import triton_utils as tu

    num_parts, exp_kinds = VARIANTS[variant]
    half = block_k // num_parts

    def exp2(x, kind):
        if kind == "poly":
            return exp2_poly(x, interpret=interpret)
        if kind in PACKED_EXP2_ASM:
            asm, constraints, out_dtype = PACKED_EXP2_ASM[kind]
            if interpret:  # the same roundings, in XLA
                narrow = jnp.bfloat16 if kind == "bf16x2" else jnp.float16
                return jnp.exp2(x.astype(narrow).astype(jnp.float32)).astype(narrow).astype(out_dtype)
            return plgpu.elementwise_inline_asm(asm, args=[x], constraints=constraints, pack=2,
                                                result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, out_dtype)])[0]
        if kind == "ftz" and not interpret:
            return plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
                                                result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]
        return jnp.exp2(x)

    chains = QUERY_CHAINS.get(variant, 1)
    rows = block_q // chains

    def update(carry, scores, values, exp_scale):
        """One query chain's online-softmax step over one key tile: scores (rows, half) per part."""
        acc, m, l = carry
        if exp_kinds is None:
            for s, vp in zip(scores, values):
                acc = acc + tu.dot(s.astype(vp.dtype), vp)
            return acc, m, l
        row_max = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores])
        m_new = jnp.maximum(m, row_max * exp_scale)
        if exp_kinds[0] == "none":
            alpha = m - m_new + 1.0
        else:  # the per-row rescale factors: libdevice beside libdevice or polynomial parts, else ftz
            alpha = exp2(m - m_new, "mufu" if exp_kinds[0] in ("mufu", "poly") else "ftz")
        acc = acc * alpha[:, None]
        l = l * alpha
        for h, (s, vp) in enumerate(zip(scores, values)):
            x = s * exp_scale - m_new[:, None]
            p = x if exp_kinds[h] == "none" else exp2(x, exp_kinds[h])
            l = l + jnp.sum(p.astype(jnp.float32), axis=1)
            acc = acc + tu.dot(p.astype(vp.dtype), vp)
        return acc, m_new, l

    def kernel(q_ref, k_ref, v_ref, o_ref, *, S: int, scale: float):
        t0 = pl.program_id(0) * block_q
        qs = [q_ref[pl.ds(t0 + c * rows, rows), :] for c in range(chains)]
        exp_scale = scale * LOG2E

        def body(j, carry):
            s0 = j * block_k
            parts = [(k_ref[pl.ds(s0 + h * half, half), :], v_ref[pl.ds(s0 + h * half, half), :])
                     for h in range(block_k // half)]
            scores = [[tu.dot(q, kp, trans_b=True) for kp, _ in parts] for q in qs]  # every chain's, first
            return tuple(update(carry[c], scores[c], [vp for _, vp in parts], exp_scale) for c in range(chains))

        H = qs[0].shape[-1]
        init = (jnp.zeros((rows, H), jnp.float32), jnp.full((rows,), -1e30, jnp.float32),
                jnp.zeros((rows,), jnp.float32))
        carry = lax.fori_loop(0, S // block_k, body, (init,) * chains)
        for c, (acc, m, l) in enumerate(carry):
            if variant in ("dots_only", "no_exp"):
                l = jnp.ones_like(l)  # timing only: these variants compute no attention
            o_ref[pl.ds(t0 + c * rows, rows), :] = (acc / l[:, None]).astype(o_ref.dtype)

    @jax.jit
    def forward(q, k, v):
        B, T, N, H = q.shape
        S, K = k.shape[1], k.shape[2]
        G = N // K
        if T % block_q or S % block_k:
            raise ValueError(f"T={T}, S={S}: must be multiples of block_q={block_q}, block_k={block_k}")
        b_of = lambda r: lax.div(r, N)
        n_of = lambda r: lax.rem(r, N)
        q_spec = pl.BlockSpec((None, T, None, H), lambda i, r: (b_of(r), 0, n_of(r), 0))
        kv_spec = pl.BlockSpec((None, S, None, H), lambda i, r: (b_of(r), 0, lax.div(n_of(r), G), 0))
        return tu.pallas_call(
            functools.partial(kernel, S=S, scale=1.0 / math.sqrt(H)),
            num_warps=num_warps, num_stages=num_stages, interpret=interpret,
            grid=(T // block_q, B * N), in_specs=[q_spec, kv_spec, kv_spec], out_specs=q_spec,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), name=f"fwd_{variant}",
        )(q, k, v)

    return forward


def rel_err(out, ref) -> float:
    import jax.numpy as jnp

    out = jnp.asarray(out, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(out))):
        return float("nan")
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="4,4096,16,128", help="B,T,N,H (K = N, S = T)")
    ap.add_argument("--tiles", default="128,128,8,3", help="block_q,block_k,num_warps,num_stages")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax
    import jax.numpy as jnp

    from jaxfuse import bench
    from pallas_kernels import flash_attention, reference
    from pallas_kernels import triton_utils as tu

    on_gpu = jax.default_backend() == "gpu"
    B, T, N, H = (int(x) for x in args.shape.split(","))
    bq, bk, nw, ns = (int(x) for x in args.tiles.split(","))
    flops = 4 * B * N * T * T * H
    exps = B * N * T * T
    log(f"backend {jax.default_backend()}, shape B={B} T=S={T} N=K={N} H={H}, tiles {args.tiles}")

    def inputs(seed, b, t, n):
        ks = jax.random.split(jax.random.key(seed), 3)
        return tuple(jax.random.normal(x, (b, t, n, H), jnp.bfloat16) for x in ks)

    arg_sets = [inputs(1, B, T, N), inputs(2, B, T, N)]
    check_b, check_t, check_n = (1, 1024, 2) if on_gpu else (1, 2 * bk, 1)
    check = inputs(3, check_b, check_t, check_n)
    ref = reference.attention(*(x.astype(jnp.float32) for x in check))
    rows = []

    def record(name, fn, *, computes_attention=True):
        row = {"variant": name}
        try:
            if computes_attention:
                row["rel_err"] = rel_err(fn(*check), ref)
            if on_gpu:
                with tu.quiet_triton_deprecation():
                    t = bench.time_kernels(fn, arg_sets, iterations=args.iterations)
                row.update(time_us=t.median_us, spread=t.spread, tflops=flops / t.median_us / 1e6,
                           kernels={k: round(v, 1) for k, v in t.per_kernel_us.items()})
        except Exception as e:  # noqa: BLE001 - record and go on
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        log(json.dumps({k: v for k, v in row.items() if k != "kernels"}))
        rows.append(row)

    interpret = not on_gpu
    config = {"block_q": bq, "block_k": bk, "num_warps": nw, "num_stages": ns}
    with tu.quiet_triton_deprecation():
        record("flash_attention", lambda q, k, v: flash_attention(q, k, v, block_sizes=config,
                                                                  interpret=interpret))
        if on_gpu:
            record("cudnn", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
        for variant in args.variants:
            fwd = make_forward(variant, block_q=bq, block_k=bk, num_warps=nw, num_stages=ns, interpret=interpret)
            record(variant, fwd, computes_attention=variant not in ("dots_only", "no_exp"))

    env = bench.environment()
    result = {"env": env, "shape": {"B": B, "T": T, "S": T, "N": N, "K": N, "H": H, "dtype": "bfloat16"},
              "tiles": config, "flops": flops, "exp2_count": exps, "rows": rows}
    path = os.path.join(args.out, f"attention-forward-floor-{bench.device_tag(env['device'])}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print("\n| variant | time µs | TFLOP/s | rel err | error |\n|---|---|---|---|---|")
    for r in rows:
        t, tflops = r.get("time_us"), r.get("tflops")
        t_text = "" if t is None else f"{t:.1f}"
        tflops_text = "" if tflops is None else f"{tflops:.1f}"
        print(f"| {r['variant']} | {t_text} | {tflops_text} | {r.get('rel_err', '')} | {r.get('error', '')[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
