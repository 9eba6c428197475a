"""Plain jnp attention written several ways, and what XLA makes of each (GPU, CUPTI).

    PYTHONPATH=$PWD python benchmarks/scripts/attention_einsum_order.py --out $OUT [--shapes small_lm,gqa]
        [--forms bkgts,bktgs] [--train-steps small,1b] [--hlo main]

Causal grouped-query attention, the same float32 softmax and bf16 casts in each form:
  bkgts           scores (B, K, G, T, S) from "BTKGH,BSKH->BKGTS", the causal mask a (T, S) array from
                  ``jnp.arange``: how ``jaxfuse.kernels.plain_attention`` wrote it until the fifty-ninth session
  bktgs           ``plain_attention`` now: scores (B, K, T, G, S) (the free dims in the order dot_general gives
                  them, T before G), the mask from iotas of the scores' shape
  bktgs_rows      (B, K, T, G, S) viewed as (B, K, T·G, S), a (T·G, S) mask from aranges on the trailing dims
  bktgs_bias, bktgs_softmax_where, bktgs_iota   (B, K, T, G, S) with the mask as an additive (T, 1, S) bias, through
                  ``jax.nn.softmax(where=)``, and from iotas (``bktgs_iota`` is ``plain_attention``'s mask)
  repeat_kv       k and v repeated to every query head, scores (B, N, T, S) (the MHA form)
  cudnn           cuDNN's fused attention
Forward, and forward + backward (dq, dk, dv of sum(o · do), which keeps the forward alive), at the attention
suite's shapes (``jaxfuse.suites.attention.SHAPES``). Reports each program's median µs, the µs of its kernels named
"*transpose*" and its largest kernels; outputs checked against the first form's. ``--train-steps`` also times the
train step's all-XLA kernel set with ``bkgts`` and with ``plain_attention``, and with cuDNN's attention
(``train_steps``). ``--hlo SHAPE`` writes each form's optimized forward HLO at that shape (``hlo_<form>.txt``).
Writes ``attention_einsum_order.json``. A measurement of how XLA treats ways of writing the same thing, not a kernel.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp

from jaxfuse import bench
from jaxfuse.kernels import plain_attention
from jaxfuse.suites import attention as suite


def _softmax_rows(scores, visible, dtype):
    """The float32 causal softmax over the last axis, rounded to ``dtype`` (as plain_attention does)."""
    scores = jnp.where(visible, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def bkgts(q, k, v, scale=None):
    """Scores (B, K, G, T, S): the query group before the query position (causal; scale defaults to 1/sqrt(H))."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k).astype(jnp.float32) * (H**-0.5 if scale is None else scale)
    p = _softmax_rows(scores, jnp.arange(T)[:, None] >= jnp.arange(S)[None, :], q.dtype)  # (T, S) mask
    return jnp.einsum("BKGTS,BSKH->BTKGH", p, v).reshape(B, T, N, H)


def bktgs_rows(q, k, v):
    """Scores (B, K, T, G, S) viewed as (B, K, T·G, S) for the mask and softmax: a (T·G, S) mask on trailing dims."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    qg = q.reshape(B, T, K, G, H)
    scores = jnp.einsum("BTKGH,BSKH->BKTGS", qg, k).astype(jnp.float32) * H**-0.5
    visible = jnp.repeat(jnp.arange(T)[:, None] >= jnp.arange(S)[None, :], G, axis=0)  # (T·G, S)
    p = _softmax_rows(scores.reshape(B, K, T * G, S), visible, q.dtype).reshape(B, K, T, G, S)
    return jnp.einsum("BKTGS,BSKH->BTKGH", p, v).reshape(B, T, N, H)


def bktgs_masked(q, k, v, mask):
    """(B, K, T, G, S) scores with the causal mask written another way. mask: "bias" (an additive (T, 1, S) bias of
    0 and -inf), "softmax_where" (``jax.nn.softmax(..., where=)``) or "iota" (iotas of the scores' own shape)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKTGS", qg, k).astype(jnp.float32) * H**-0.5
    visible = (jnp.arange(T)[:, None] >= jnp.arange(S)[None, :])[:, None, :]  # (T, 1, S)
    if mask == "bias":
        p = jax.nn.softmax(scores + jnp.where(visible, 0.0, -jnp.inf), axis=-1)
    elif mask == "softmax_where":
        p = jax.nn.softmax(scores, axis=-1, where=visible)
    else:
        rows = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 2)
        cols = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 4)
        p = jax.nn.softmax(jnp.where(rows >= cols, scores, -jnp.inf), axis=-1)
    return jnp.einsum("BKTGS,BSKH->BTKGH", p.astype(q.dtype), v).reshape(B, T, N, H)


def repeat_kv(q, k, v):
    """k and v repeated to every query head: scores (B, N, T, S)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32) * H**-0.5
    p = _softmax_rows(scores, jnp.arange(T)[:, None] >= jnp.arange(S)[None, :], q.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", p, v)


FORMS = {
    "bkgts": bkgts,
    "bktgs": lambda q, k, v: plain_attention(q, k, v, causal=True),
    "bktgs_rows": bktgs_rows,
    **{f"bktgs_{mask}": functools.partial(bktgs_masked, mask=mask) for mask in ("bias", "softmax_where", "iota")},
    "repeat_kv": repeat_kv,
    "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
}


def program(form, mode):
    """fwd: o; fwd+bwd: (o, dq, dk, dv) of sum(o · do) in float32."""
    if mode == "fwd":
        return lambda q, k, v, do: form(q, k, v)

    def fwd_bwd(q, k, v, do):
        o, vjp = jax.vjp(form, q, k, v)
        return (o, *vjp(do))

    return fwd_bwd


def train_steps(presets: list[str], iterations: int) -> list[dict]:
    """The train step (``jaxfuse bench --op train_step``) with every site XLA's, its attention written (B, K, G, T,
    S) (``bkgts``, causal as the model calls it) and as plain_attention is (``bktgs``), and with cuDNN's attention."""
    from jaxfuse import kernels, suites

    rows, plain = [], kernels.ATTENTION["xla"]
    for form in ("bkgts", "bktgs"):
        kernels.ATTENTION["xla"] = plain if form == "bktgs" else (lambda q, k, v, causal=False, scale=None:
                                                                   _bkgts_checked(q, k, v, causal, scale))
        try:
            impls = ["attention=xla,norm_matmul=xla,loss=xla"] + (["attention=cudnn,norm_matmul=xla,loss=xla"]
                                                                   if form == "bktgs" else [])
            result = suites.benchmark("train_step", presets, impls=impls, iterations=iterations, check=False)
        finally:
            kernels.ATTENTION["xla"] = plain
        for r in result["records"]:
            attention = "cudnn" if r.implementation.startswith("attention=cudnn") else form
            rows.append(dict(shape=r.shape, mode="train_step", form=attention, us=round(r.time_us, 1)))
            print(json.dumps(rows[-1]), flush=True)
        jax.clear_caches()
    return rows


def _bkgts_checked(q, k, v, causal, scale):
    if not causal:  # (the model's call)
        raise ValueError(f"bkgts here is causal; got causal={causal}")
    return bkgts(q, k, v, scale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="small_lm,gqa")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--train-steps", default="", help="train-step presets to time too (e.g. small,1b): all-XLA "
                                                          "with each layout, and cuDNN's attention")
    parser.add_argument("--hlo", default="", help="a suite shape: write each form's optimized forward HLO there")
    args = parser.parse_args()
    if args.hlo:
        s = suite.SHAPES[args.hlo]
        inputs = suite.make_inputs(s["B"], s["T"], s["S"], s["N"], s["K"], s["H"])
        for form in args.forms.split(","):
            with open(os.path.join(args.out, f"hlo_{form}.txt"), "w") as f:
                f.write(jax.jit(program(FORMS[form], "fwd")).lower(*inputs).compile().as_text())
    rows = train_steps(args.train_steps.split(","), args.iterations) if args.train_steps else []
    for name in args.shapes.split(","):
        s = suite.SHAPES[name]
        sets = [suite.make_inputs(s["B"], s["T"], s["S"], s["N"], s["K"], s["H"], seed=i) for i in range(3)]
        for mode in ("fwd", "fwd+bwd"):
            want = None
            for form in args.forms.split(","):
                fn = jax.jit(program(FORMS[form], mode))
                try:
                    got = jax.tree.leaves(fn(*sets[0]))
                    timing = bench.time_kernels(fn, sets, iterations=args.iterations)
                except Exception as e:  # noqa: BLE001 -- a form that does not run (e.g. cuDNN's) is reported
                    print(name, mode, form, "ERROR", str(e)[:200], flush=True)
                    continue
                want = got if want is None else want
                err = bench.max_difference(zip(got, want), relative=True)
                kernels = sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])
                transposes = sum(us for k, us in kernels if "transpose" in k)
                rows.append(dict(shape=name, mode=mode, form=form, us=round(timing.median_us, 1),
                                 transpose_us=round(transposes, 1), rel_diff_vs_bkgts=err,
                                 kernels=[(k, round(us, 1)) for k, us in kernels[:6]]))
                print(json.dumps(rows[-1]), flush=True)
            jax.clear_caches()
    path = os.path.join(args.out, "attention_einsum_order.json")
    with open(path, "w") as f:
        json.dump(dict(environment=bench.environment(), rows=rows), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
