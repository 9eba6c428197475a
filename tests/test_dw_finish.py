"""``pallas_kernels.norm_matmul.dw_finish``: the Pallas-Triton kernel that turns the dw GEMM's float32 product g into
dw and dgamma where XLA runs that GEMM, against a float32 jnp reference: in interpret mode on the CPU (small shapes),
compiled on a GPU (the model's sizes). The whole backward with it is tested in ``test_norm_matmul_mosaic.py`` (the
cases with dw_in_xla)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backends
from pallas_kernels.norm_matmul.dw_finish import block_sizes, finish_dw

on_gpu = jax.default_backend() == "gpu"


def _inputs(K, N, dtype, magnitude, scale, seed, parts=None):
    keys = jax.random.split(jax.random.key(seed), 3)
    g = jax.random.normal(keys[0], (K, N) if parts is None else (parts, K, N), jnp.float32) * magnitude
    w = jax.random.normal(keys[1], (K, N), jnp.float32).astype(dtype)
    gamma = jax.random.normal(keys[2], (K,), jnp.float32).astype(dtype)
    return g, w, gamma, jnp.full((1,), scale, jnp.float32)


def _check(K, N, dtype, parts=None, magnitude=1.0, scale=1.0, block_k=None, seed=0):
    g, w, gamma, s = _inputs(K, N, dtype, magnitude, scale, seed, parts)
    dw, dgamma = finish_dw(g, w, gamma, s, block_k=block_k, interpret=not on_gpu)
    assert (dw.dtype, dw.shape, dgamma.dtype, dgamma.shape) == (w.dtype, (K, N), gamma.dtype, (K,))
    gamma32, w32 = gamma.astype(jnp.float32), w.astype(jnp.float32)
    g = g if parts is None else jnp.sum(g, axis=0)  # (the reference sums the parts first, in float32)
    ref_dw = np.asarray(g * (gamma32 * scale)[:, None])
    ref_dgamma = np.asarray(jnp.sum(g * w32, axis=1) * scale)
    dw32, dgamma32 = np.asarray(dw, np.float32), np.asarray(dgamma, np.float32)
    assert np.isfinite(dw32).all() and np.isfinite(dgamma32).all()
    ulp = 2.0 ** -8 if dtype == jnp.bfloat16 else 2.0 ** -11  # one rounding to the 16-bit dtype (relative)
    tiny = 0.0 if dtype == jnp.bfloat16 else 2.0 ** -25  # half of float16's subnormal spacing (absolute)
    np.testing.assert_allclose(dw32, ref_dw, rtol=ulp, atol=tiny)
    # float32 sums of the same products in another order, then one rounding: relative to the sum of |g ⊙ w|
    bound = np.asarray(jnp.sum(jnp.abs(g * w32), axis=1)) * scale
    assert (np.abs(dgamma32 - ref_dgamma) <= ulp * np.abs(ref_dgamma) + 1e-5 * bound + tiny).all()


@pytest.mark.parametrize("K, N, dtype, parts, scale, block_k", [
    (16, 768, jnp.bfloat16, 2, 1.0, None),  # two parts (the split M); rows padded 768 -> 1024 and masked
    (6, 320, jnp.float16, None, 0.25, None),  # K = 6: 2 rows a program; a (K, N) g; s != 1
    (8, 256, jnp.bfloat16, 3, 1.0, 8),  # N a power of two: no mask; one program
] + ([(512, 2816, jnp.bfloat16, 2, 1.0, None), (512, 768, jnp.bfloat16, 2, 1.0, None),
      (1024, 1536, jnp.float16, None, 0.5, 1), (64, 16384, jnp.bfloat16, 2, 1.0, None)] if on_gpu else []))
def test_dw_and_dgamma_match_the_float32_reference(K, N, dtype, parts, scale, block_k):
    _check(K, N, dtype, parts=parts, scale=scale, block_k=block_k)


@pytest.mark.parametrize("magnitude", [1e-3, 1e3])
def test_extreme_magnitudes(magnitude):
    _check(8, 320, jnp.bfloat16, parts=2, magnitude=magnitude, seed=1)


def test_a_nan_in_g_reaches_dw_and_dgamma():
    g, w, gamma, s = _inputs(8, 256, jnp.bfloat16, 1.0, 1.0, 2, parts=2)
    dw, dgamma = finish_dw(g.at[1, 3, 200].set(jnp.nan), w, gamma, s, interpret=not on_gpu)
    dw32, dgamma32 = np.asarray(dw, np.float32), np.asarray(dgamma, np.float32)
    assert np.isnan(dw32[3, 200]) and np.isnan(dgamma32[3])
    assert np.isfinite(np.delete(dw32, 3, axis=0)).all() and np.isfinite(np.delete(dgamma32, 3)).all()


def test_bad_arguments_name_themselves():
    g, w, gamma, s = _inputs(8, 256, jnp.bfloat16, 1.0, 1.0, 3)
    with pytest.raises(ValueError, match=r"finish_dw: gamma must have shape \(8,\) \(w is \(8, 256\)\), got \(4,\)"):
        finish_dw(g, w, gamma[:4], s, interpret=True)
    with pytest.raises(ValueError, match=r"finish_dw: g must be float32 .*, got bfloat16"):
        finish_dw(g.astype(jnp.bfloat16), w, gamma, s, interpret=True)
    with pytest.raises(ValueError, match=r"finish_dw: g must have shape \(P, K, N\) or \(K, N\) \(w is \(8, 256\)\), "
                                         r"got \(2, 8, 128\)"):
        finish_dw(jnp.zeros((2, 8, 128)), w, gamma, s, interpret=True)
    with pytest.raises(ValueError, match=r"finish_dw: block_k=3 must be a power of two dividing K=8"):
        finish_dw(g, w, gamma, s, block_k=3, interpret=True)
    with pytest.raises(ValueError, match=r"N=16385 must be in \[1, 16384\]"):
        block_sizes(8, 16385)
    assert block_sizes(512, 2816) == (1, 4096) and block_sizes(512, 768) == (4, 1024) and block_sizes(6, 320) == (
        2, 512)


def test_lowers_for_cuda_as_one_triton_kernel():
    """The kernel lowers for CUDA on any machine (the GPU run's structure): one Triton call, no XLA op on g."""
    g, w, gamma, s = _inputs(512, 2816, jnp.bfloat16, 1.0, 1.0, 4, parts=2)
    with backends.lowering_for_gpu():
        program = jax.jit(finish_dw).trace(g, w, gamma, s).lower(lowering_platforms=("cuda",)).as_text()
    assert program.count("rmsnorm_matmul_dw_finish") >= 1 and "stablehlo.reduce" not in program
