"""Attention spec: the Pallas flash-attention kernels against cuDNN's fused attention and plain-jnp XLA.

    from jaxfuse import suites
    records = suites.run("attention", ["main"], iterations=20)     # GPU; ["cpu"] on CPU (interpret mode)

Per shape (q (B, T, N, H), k/v (B, S, K, H), bf16), causal setting and mode, the implementations of the model's
attention site (``jaxfuse.kernels.ATTENTION``):
  pallas_<backend>  ``pallas_kernels.flash_attention`` on each backend it implements: pallas_mosaic (sm90 only;
                    elsewhere, and at H=32, recorded as failed with the backend's reason) and pallas_triton. Scores
                    live only as tiles; the residuals are o, a (B, N, T) float32 lse and o_lo (o's rounding error)
  cudnn             ``jax.nn.dot_product_attention(implementation="cudnn")``; recorded as failed off GPU
  xla               plain jnp as a user writes it (``jaxfuse.kernels.plain_attention``): bf16 einsums, a float32
                    softmax over the materialized (B, N, T, S) scores, bf16 probabilities; skipped (recorded) where
                    the float32 scores would exceed ``XLA_MAX_SCORES_BYTES``
  xla_f32           (opt-in) ``pallas_kernels.reference.attention``: float32, HIGHEST precision; the reference

FLOPs are 4·B·N·T·S·H (the two GEMMs), halved when causal, and 3.5× that for fwd+bwd (the convention of
shared/anchors.md); bytes: each input read and output written once. Errors are taken against the float32
reference on batch element 0 (``check_rows``). ``speedup_vs`` holds baseline time / this time for "cudnn" and
"xla" (< 1: slower).
"""

from __future__ import annotations

from jaxfuse.suites.spec import OpSpec

__all__ = ["SPEC", "SHAPES", "XLA_MAX_SCORES_BYTES", "make_inputs"]

# name -> shape: q (B, T, N, H), k/v (B, S, K, H). The tokens B·T stay at the main shape's 16384 throughout; h64
# also keeps N·H (so its GEMM FLOPs equal main's); gqa is anchors.md's 32 query / 8 kv heads of 128 (twice main's
# FLOPs).
SHAPES = {
    "main": dict(B=4, T=4096, S=4096, N=16, K=16, H=128, note="the issue's main shape (anchors.md)"),
    "1k": dict(B=16, T=1024, S=1024, N=16, K=16, H=128, note="short sequences, same tokens"),
    "8k": dict(B=2, T=8192, S=8192, N=16, K=16, H=128, note="long sequences, same tokens"),
    "gqa": dict(B=4, T=4096, S=4096, N=32, K=8, H=128, note="grouped-query attention, 32 q / 8 kv heads"),
    "h64": dict(B=4, T=4096, S=4096, N=32, K=32, H=64, note="head dim 64, N·H as the main shape"),
    "small_lm": dict(B=8, T=1024, S=1024, N=8, K=2, H=64, note="the small train-step preset's attention"),
    "cpu": dict(B=2, T=40, S=40, N=4, K=2, H=32, note="smoke shape for CPU (interpret mode; odd T, GQA)"),
}
XLA_MAX_SCORES_BYTES = 20e9  # plain-jnp XLA is skipped where the (B, N, T, S) float32 scores exceed this


def make_inputs(B: int, T: int, S: int, N: int, K: int, H: int, *, seed: int = 0, dtype=None):
    """(q (B, T, N, H), k (B, S, K, H), v (B, S, K, H), do (B, T, N, H)), N(0, 1) in bf16, a fresh key each."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if dtype is None else dtype
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, T, N, H), jnp.float32).astype(dtype)
    return q, k, v, do


def _scores_f32_bytes(s) -> float:
    return 4.0 * s["B"] * s["N"] * s["T"] * s["S"]


def _cost(s, variant, mode) -> tuple[float, float]:
    """FLOPs as anchors.md counts them; bytes: each input read and output written once (fwd: q, k, v, o; fwd+bwd
    adds reading q, k, v, o, do and writing dq, dk, dv), bf16."""
    B, T, S, N, K, H = (s[x] for x in "BTSNKH")
    flops = 4.0 * B * N * T * S * H * (0.5 if variant.get("causal") else 1.0)
    q_bytes, kv_bytes = 2.0 * B * T * N * H, 2.0 * B * S * K * H
    fwd_bytes = 2 * q_bytes + 2 * kv_bytes
    if mode == "fwd":
        return flops, fwd_bytes
    return 3.5 * flops, fwd_bytes + 4 * q_bytes + 4 * kv_bytes


def _skip_reason(impl: str, s) -> str | None:
    scores = _scores_f32_bytes(s)
    if impl in ("xla", "xla_f32") and scores > XLA_MAX_SCORES_BYTES:
        return (f"{impl}: skipped, the (B, N, T, S) float32 scores would take {scores / 1e9:.1f} GB "
                f"(limit {XLA_MAX_SCORES_BYTES / 1e9:.0f} GB)")
    return None


def _label(s, variant) -> str:
    return f"{s['B']}x{s['T']}x{s['S']} N{s['N']}/K{s['K']} H{s['H']}" + (" causal" if variant.get("causal") else "")


SPEC = OpSpec(
    name="attention", site="attention", op="flash_attention", shapes=SHAPES,
    default_shapes=("main", "1k", "8k", "gqa", "h64"), cpu_shapes=("cpu",), tune_shapes=("main",),
    make_inputs=lambda s, seed: make_inputs(s["B"], s["T"], s["S"], s["N"], s["K"], s["H"], seed=seed),
    num_args=3, grad_argnums=(0, 1, 2), output_names={"fwd": ("o",), "fwd+bwd": ("o", "dq", "dk", "dv")},
    cost=_cost, reduction_length=lambda s: max(s["T"], s["S"]), label=_label,
    variants=({"causal": False}, {"causal": True}), baselines=("cudnn", "xla"), skip_reason=_skip_reason,
    shape_reason=lambda s: None if s["N"] % s["K"] == 0 else "the kv heads K must divide the query heads N",
    check_rows=1, input_sets=2)
