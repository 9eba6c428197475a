"""The kernels with ``jax_enable_x64`` on, as many users keep it: Python ints then default to int64, which the
kernels' int32 index arithmetic refused (``lax.div`` of int32 by int64) until each kernel call traced with 32-bit
defaults (``backends.traced_with_32_bit_indices``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import backends, reference
from pallas_kernels.gemm import matmul

cpu_only = pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpret mode and CUDA lowering on a CPU")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@cpu_only
def test_the_triton_kernels_run_and_differentiate_with_x64_on():
    keys = jax.random.split(jax.random.key(0), 4)
    with jax.enable_x64(True):
        q, k = (jax.random.normal(key, (1, 64, 2, 32), jnp.float32) for key in keys[:2])
        v = jax.random.normal(keys[2], (1, 64, 2, 32), jnp.float32)
        grads = jax.grad(lambda q, k, v: pallas_kernels.flash_attention(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(lambda q, k, v: reference.attention(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
        assert max(_rel(g, r) for g, r in zip(grads, want)) < 1e-4

        x = jax.random.normal(keys[0], (64, 64), jnp.float32)
        g = 1 + 0.1 * jax.random.normal(keys[1], (64,), jnp.float32)
        w = jax.random.normal(keys[2], (64, 32), jnp.float32) / 8
        grads = jax.grad(lambda *a: (pallas_kernels.rmsnorm_matmul(*a) ** 2).sum(), argnums=(0, 1, 2))(x, g, w)
        want = jax.grad(lambda *a: (reference.rmsnorm_matmul(*a) ** 2).sum(), argnums=(0, 1, 2))(x, g, w)
        assert max(_rel(a, b) for a, b in zip(grads, want)) < 1e-4

        h, wv = jax.random.normal(keys[0], (64, 32), jnp.float32), jax.random.normal(keys[3], (32, 100), jnp.float32)
        labels = jnp.arange(64) % 100  # int64 under x64
        loss, grads = jax.value_and_grad(pallas_kernels.linear_cross_entropy, argnums=(0, 1))(h, wv, labels)
        want_loss, want = jax.value_and_grad(reference.linear_cross_entropy, argnums=(0, 1))(h, wv, labels)
        assert labels.dtype == jnp.int64 and abs(float(loss) - float(want_loss)) < 1e-4 * abs(float(want_loss))
        assert max(_rel(a, b) for a, b in zip(grads, want)) < 1e-4


@cpu_only
@pytest.mark.parametrize("op", ["gemm", "rmsnorm_matmul", "flash_attention"])
def test_the_mosaic_kernels_lower_with_x64_on(op):
    S = jax.ShapeDtypeStruct
    fn, args = {
        "gemm": (matmul, (S((1024, 1024), jnp.bfloat16), S((1024, 1024), jnp.bfloat16))),
        "rmsnorm_matmul": (lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic"),
                           (S((1024, 1024), jnp.bfloat16), S((1024,), jnp.bfloat16), S((1024, 1024), jnp.bfloat16))),
        "flash_attention": (lambda q, k, v: pallas_kernels.flash_attention(q, k, v, backend="mosaic"),
                            (S((1, 1024, 2, 128), jnp.bfloat16),) * 3),
    }[op]
    loss = lambda *a: fn(*a).astype(jnp.float32).sum()  # noqa: E731
    with jax.enable_x64(True), backends.lowering_for_gpu():
        text = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
