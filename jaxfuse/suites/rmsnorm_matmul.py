"""RMSNorm→matmul spec: the Pallas fused kernels against XLA's norm + matmul and XLA's matmul alone.

    from jaxfuse import suites
    records = suites.run("rmsnorm_matmul", ["16x4096x4096-decode"])    # GPU; ["cpu"] on CPU

Per shape (M×K×N, bf16) and mode (forward; forward + backward with a random cotangent), the implementations of the
model's norm_matmul site (``jaxfuse.kernels.NORM_MATMUL``) and the suite's own:
  pallas_<backend>  ``pallas_kernels.rmsnorm_matmul`` on each backend it implements (pallas_triton, pallas_mosaic;
                    the normalized activations never reach HBM)
  xla               XLA's norm fusion writes rmsnorm(x), a GEMM reads it back
  xla_matmul_alone  ``x @ w`` (cuBLAS): no norm at all, the floor a fused kernel can reach
  pallas_mosaic_matmul_alone  ``pallas_kernels.matmul(x, w)``: the plain Mosaic-GPU GEMM core the Mosaic backend
                    builds on, against cuBLAS (its ``speedup_vs["xla_matmul_alone"]``; sm90 and shapes its tiles
                    divide only, else recorded as skipped with the reason)
  xla_rowscale      plain jnp with the norm moved past the GEMM by algebra, y = r ⊙ (x @ (γ ∘ w)) (r is one
                    scalar per row): no normalized tensor exists at all. What a user gets from rewriting the
                    math instead of writing a kernel (on the H100 XLA runs the row scale as a pass of its own
                    over y instead of in its GEMM's epilogue, and rescales w on every call).
  xla_f32_out       the xla pair with ``preferred_element_type=float32`` on the dot, then a cast: a common way
                    to write "accumulate in float32" that JAX transposes into float32 backward GEMMs (TF32 on
                    the GPU) fed by convert kernels. Shown to measure that pitfall; not a baseline of the targets.
All XLA dots are plain bf16 ``jnp.dot`` (the GEMMs accumulate in float32 internally). The two matmuls alone compute
another function: their ``rel_error`` (against the norm's reference) only says so. The floor is the roofline of
the matmul alone: bytes = x + w + y forward, 3·(x + w + y) forward + backward (each of the three GEMMs reads two of
the operands and writes the third).
"""

from __future__ import annotations

from jaxfuse.suites.spec import OpSpec

__all__ = ["SPEC", "SHAPES", "make_inputs", "rowscale_rmsnorm_matmul"]

# name -> shape; "note" says what the shape stands for. "cpu" is a smoke shape small enough for interpret mode.
SHAPES = {
    "32768x4096x4096": dict(M=32768, K=4096, N=4096, note="training step, square projection"),
    "4096x4096x14336": dict(M=4096, K=4096, N=14336, note="MLP up projection"),
    "8192x4096x6144-qkv": dict(M=8192, K=4096, N=6144, note="fused QKV projection (GQA 32q/8kv heads of 128)"),
    "8192x512x2816-small": dict(M=8192, K=512, N=2816, note="train_step 'small' preset: MLP gate+up projection"),
    "4096x2048x11008-1b": dict(M=4096, K=2048, N=11008, note="train_step '1b' preset: MLP gate+up projection"),
    "8192x512x768-small-qkv": dict(M=8192, K=512, N=768, note="train_step 'small' preset: QKV projection"),
    "4096x2048x3072-1b-qkv": dict(M=4096, K=2048, N=3072, note="train_step '1b' preset: QKV projection"),
    "16384x1024x5504-mlp": dict(M=16384, K=1024, N=5504, note="a D=1024 model's MLP gate+up projection (F=2752): "
                                "the training GEMM where the Triton kernel ran ~170 TFLOP/s (issue 15)"),
    "8192x512x32768-small-head": dict(M=8192, K=512, N=32768, note="train_step 'small' preset: final norm + LM head"),
    "4096x2048x128256-1b-head": dict(M=4096, K=2048, N=128256, note="train_step '1b' preset: final norm + LM head"),
    # shapes no tuned entry covers: what a user's model gets from the built-in configs (the H200's entries, NOTES.md)
    "8192x4096x11008-untuned": dict(M=8192, K=4096, N=11008, note="a 7B model's MLP gate or up projection (F=11008), "
                                    "untuned"),
    "8192x4096x12288-untuned": dict(M=8192, K=4096, N=12288, note="a 7B model's fused QKV projection (32 heads of "
                                    "128), untuned"),
    "8192x2048x5632-untuned": dict(M=8192, K=2048, N=5632, note="a 1.1B model's MLP gate or up projection (D=2048, "
                                   "F=5632), untuned"),
    "16384x3072x8192-untuned": dict(M=16384, K=3072, N=8192, note="a 3B model's MLP gate or up projection (D=3072, "
                                    "F=8192), untuned"),
    "8192x768x3072-untuned": dict(M=8192, K=768, N=3072, note="a D=768 model's MLP up projection (F=3072), untuned"),
    "2048x4096x4096-untuned": dict(M=2048, K=4096, N=4096, note="a square projection at 2048 tokens, untuned"),
    "4096x5120x13824-untuned": dict(M=4096, K=5120, N=13824, note="a 13B model's MLP gate or up projection (D=5120, "
                                    "F=13824), untuned"),
    "16x4096x4096-decode": dict(M=16, K=4096, N=4096, note="decode, 16 sequences"),
    "1x4096x14336-decode": dict(M=1, K=4096, N=14336, note="decode, one sequence"),
    "1x4096x4096-decode": dict(M=1, K=4096, N=4096, note="decode, one sequence, square projection (64 GEMV tiles)"),
    "cpu": dict(M=37, K=64, N=32, note="smoke shape for CPU (interpret mode)"),
}


def make_inputs(M: int, K: int, N: int, seed: int = 0, dtype=None):
    """(x (M, K), gamma (K,), w (K, N), dy (M, N)) in bf16 from one seed; w scaled by K^-1/2."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if dtype is None else dtype
    kx, kg, kw, kd = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(dtype)
    gamma = (1.0 + 0.1 * jax.random.normal(kg, (K,), jnp.float32)).astype(dtype)
    w = (jax.random.normal(kw, (K, N), jnp.float32) * K**-0.5).astype(dtype)
    dy = jax.random.normal(kd, (M, N), jnp.float32).astype(dtype)
    return x, gamma, w, dy


def rowscale_rmsnorm_matmul(x, gamma, w, *, eps: float = 1e-6):
    """rmsnorm(x) · γ @ w as r ⊙ (x @ (γ ∘ w)), r = rsqrt(mean(x², K) + eps) per row: x (M, K), w (K, N) bf16."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # (M, 1) float32
    w_scaled = (gamma.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)  # (K, N)
    return (jnp.dot(x, w_scaled).astype(jnp.float32) * r).astype(x.dtype)


def _extra_implementations() -> dict:
    import jax.numpy as jnp

    import pallas_kernels
    from pallas_kernels import reference

    return {
        "xla_matmul_alone": lambda x, g, w: jnp.dot(x, w),
        "pallas_mosaic_matmul_alone": lambda x, g, w: pallas_kernels.matmul(x, w),
        "xla_rowscale": rowscale_rmsnorm_matmul,
        "xla_f32_out": lambda x, g, w: jnp.dot(reference.rmsnorm(x, g), w,
                                               preferred_element_type=jnp.float32).astype(x.dtype),
    }


def _skip_reason(impl: str, s) -> str | None:
    """Why the plain Mosaic GEMM does not run at this shape here (no sm90 GPU, or tiles that do not divide it)."""
    if impl != "pallas_mosaic_matmul_alone":
        return None
    import jax
    import jax.numpy as jnp

    import pallas_kernels
    from pallas_kernels import backends

    reason = backends.unavailable_reason("mosaic")
    if reason is None:
        try:  # (traced: matmul's own checks of the shape, without running it)
            jax.eval_shape(pallas_kernels.matmul, jax.ShapeDtypeStruct((s["M"], s["K"]), jnp.bfloat16),
                           jax.ShapeDtypeStruct((s["K"], s["N"]), jnp.bfloat16))
        except ValueError as e:
            reason = str(e).split("\n")[0]  # (the sentence, without jax's note on its filtered traceback)
    return None if reason is None else f"{impl}: {reason}"


def _cost(s, variant, mode) -> tuple[float, float]:
    """(FLOPs, bytes) of the matmul alone in this mode (bf16)."""
    M, K, N = s["M"], s["K"], s["N"]
    one_pass = 2.0 * (M * K + K * N + M * N)
    return (2.0 * M * K * N, one_pass) if mode == "fwd" else (6.0 * M * K * N, 3.0 * one_pass)


SPEC = OpSpec(
    name="rmsnorm_matmul", site="norm_matmul", op="rmsnorm_matmul", shapes=SHAPES,
    default_shapes=("32768x4096x4096", "4096x4096x14336", "8192x4096x6144-qkv", "8192x512x2816-small",
                    "4096x2048x11008-1b", "16384x1024x5504-mlp", "16x4096x4096-decode", "1x4096x14336-decode"),
    cpu_shapes=("cpu",),
    tune_shapes=("32768x4096x4096", "16x4096x4096-decode", "4096x4096x14336", "1x4096x14336-decode",
                 "1x4096x4096-decode", "8192x4096x6144-qkv", "8192x512x2816-small", "4096x2048x11008-1b",
                 "8192x512x768-small-qkv", "4096x2048x3072-1b-qkv", "16384x1024x5504-mlp"),
    make_inputs=lambda s, seed: make_inputs(s["M"], s["K"], s["N"], seed=seed),
    num_args=3, grad_argnums=(0, 1, 2), output_names={"fwd": ("y",), "fwd+bwd": ("y", "dx", "dgamma", "dw")},
    cost=_cost, reduction_length=lambda s: max(s["M"], s["K"], s["N"]),
    label=lambda s, variant: f"{s['M']}x{s['K']}x{s['N']}",
    baselines=("xla", "xla_matmul_alone"), extra_implementations=_extra_implementations, skip_reason=_skip_reason)
