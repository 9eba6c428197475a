"""The kernels with ``jax_enable_x64`` on, as many users keep it: Python ints then default to int64, which the
kernels' int32 index arithmetic refused (``lax.div`` of int32 by int64) until each kernel call traced with 32-bit
defaults (``backends.traced_with_32_bit_indices``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import backends, mosaic_utils, reference
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


@pytest.mark.skipif(not mosaic_utils.is_hopper(), reason="the compiled kernels with x64 on, on an sm90 GPU")
@pytest.mark.parametrize("op,backend", [("flash_attention", "triton"), ("flash_attention", "mosaic"),
                                        ("rmsnorm_matmul", "triton"), ("rmsnorm_matmul", "mosaic"),
                                        ("linear_cross_entropy", "triton"), ("gemm", "mosaic")])
def test_the_gpu_kernels_run_and_differentiate_with_x64_on(op, backend):
    """Compiled (not interpreted) on the GPU, as on jax 0.11: forward and first derivatives against the float32
    reference, bfloat16 inputs at the tiles' sizes."""
    keys = jax.random.split(jax.random.key(1), 4)
    bf16 = jnp.bfloat16
    with jax.enable_x64(True):
        if op == "flash_attention":
            q, k, v = (jax.random.normal(key, (2, 512, 2, 128), bf16) for key in keys[:3])
            fn = lambda q, k, v: pallas_kernels.flash_attention(q, k, v, causal=True, backend=backend)  # noqa: E731
            ref = lambda q, k, v: reference.attention(q, k, v, causal=True)  # noqa: E731
            args = (q, k, v)
        elif op == "rmsnorm_matmul":
            x = jax.random.normal(keys[0], (1024, 1024), bf16)
            g = (1 + 0.1 * jax.random.normal(keys[1], (1024,), jnp.float32)).astype(bf16)
            w = (jax.random.normal(keys[2], (1024, 1024), jnp.float32) / 32).astype(bf16)
            fn = lambda *a: pallas_kernels.rmsnorm_matmul(*a, backend=backend)  # noqa: E731
            ref, args = reference.rmsnorm_matmul, (x, g, w)
        elif op == "linear_cross_entropy":
            h = jax.random.normal(keys[0], (512, 256), bf16)
            wv = (jax.random.normal(keys[3], (256, 1000), jnp.float32) / 16).astype(bf16)
            labels = jnp.arange(512) % 1000  # int64 under x64
            fn = lambda h, w: pallas_kernels.linear_cross_entropy(h, w, labels, backend=backend)  # noqa: E731
            ref = lambda h, w: reference.linear_cross_entropy(h, w, labels)  # noqa: E731
            args = (h, wv)
        else:
            a, b = (jax.random.normal(key, (1024, 1024), bf16) for key in keys[:2])
            fn, ref, args = matmul, lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32), (a, b)
        up = [jnp.asarray(a, jnp.float32) for a in args]
        out, want = jax.jit(fn)(*args), ref(*up)
        assert np.isfinite(np.asarray(out, np.float32)).all() and _rel(out, want) < 2e-2
        loss = lambda f: lambda *a: (f(*a).astype(jnp.float32) ** 2).sum()  # noqa: E731
        grads = jax.jit(jax.grad(loss(fn), argnums=tuple(range(len(args)))))(*args)
        wants = jax.grad(loss(ref), argnums=tuple(range(len(args))))(*up)
        for got, expected in zip(grads, wants):
            assert np.isfinite(np.asarray(got, np.float32)).all() and _rel(got, expected) < 3e-2
