"""``pallas_kernels.norm_matmul.dx_finish``: the Pallas-Triton kernel that finishes the K side's dx and sums dgamma's
column parts, against a float32 jnp reference: in interpret mode on the CPU (small shapes), compiled on a GPU (the
suite's sizes). The whole backward with it is tested in ``test_norm_matmul_mosaic.py`` ("_dgu" cases)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norm_matmul.dx_finish import block_sizes, finish_dx

on_gpu = jax.default_backend() == "gpu"


def _inputs(M, K, dtype, dh_dtype, magnitude, seed):
    keys = jax.random.split(jax.random.key(seed), 5)
    u = (jax.random.normal(keys[0], (M, K), jnp.float32) * magnitude).astype(dtype)
    x = (jax.random.normal(keys[1], (M, K), jnp.float32) * magnitude).astype(dtype)
    coef = jax.random.normal(keys[2], (M,), jnp.float32)
    gamma = jax.random.normal(keys[3], (K,), jnp.float32)
    dh = None if dh_dtype is None else jax.random.normal(keys[4], (M, K), jnp.float32).astype(dh_dtype)
    return u, x, coef, gamma, dh


def _reference(u, x, coef, gamma, dh):
    u32, x32 = u.astype(jnp.float32), x.astype(jnp.float32)
    dx = gamma * u32 - coef[:, None] * x32 + (0.0 if dh is None else dh.astype(jnp.float32))
    return dx, jnp.sum(u32 * x32, axis=0)


def _check(M, K, dtype, dh_dtype, magnitude, blocks=None, seed=0):
    u, x, coef, gamma, dh = _inputs(M, K, dtype, dh_dtype, magnitude, seed)
    dx, parts = finish_dx(u, x, coef, gamma, dh, blocks=blocks, interpret=not on_gpu)
    ref_dx, ref_dgamma = _reference(u, x, coef, gamma, dh)
    block_m = (blocks or block_sizes(M, K))[0]
    assert dx.dtype == x.dtype and dx.shape == (M, K) and parts.shape == (M // block_m, K)
    dx32, dgamma = np.asarray(dx, np.float32), np.asarray(parts.sum(axis=0))
    assert np.isfinite(dx32).all() and np.isfinite(dgamma).all()
    scale = float(jnp.abs(ref_dx).max())
    np.testing.assert_allclose(dx32, ref_dx, atol=1e-2 * scale, rtol=0)  # one rounding to 16 bits
    # float32 sums of the same products, in another order: relative to the sum of |u ⊙ x| per column
    bound = np.asarray(jnp.sum(jnp.abs(u.astype(jnp.float32) * x.astype(jnp.float32)), axis=0))
    assert (np.abs(dgamma - np.asarray(ref_dgamma)) <= 1e-5 * bound + 1e-30).all()


@pytest.mark.parametrize("M, K, dtype, dh_dtype, blocks", [
    (64, 192, jnp.bfloat16, None, None),  # K = 192: 64-wide column blocks
    (48, 128, jnp.float16, jnp.float32, None),  # 48 rows: 16-row blocks; dh in float32
    (40, 128, jnp.bfloat16, None, None),  # 40 rows: 8-row blocks (a row count the Mosaic kernels take)
    (64, 256, jnp.bfloat16, jnp.bfloat16, (32, 256)),
] + ([(4096, 4096, jnp.bfloat16, None, None), (8192, 4096, jnp.bfloat16, jnp.bfloat16, None),
      (4096, 2048, jnp.float16, None, (16, 512))] if on_gpu else []))
def test_dx_and_dgamma_parts_match_the_float32_reference(M, K, dtype, dh_dtype, blocks):
    _check(M, K, dtype, dh_dtype, 1.0, blocks)


@pytest.mark.parametrize("magnitude", [1e-3, 1e2])
def test_extreme_magnitudes(magnitude):
    _check(64, 128, jnp.bfloat16, jnp.bfloat16, magnitude, seed=1)


def test_a_nan_in_u_reaches_dx_and_dgamma():
    u, x, coef, gamma, _ = _inputs(32, 128, jnp.bfloat16, None, 1.0, 2)
    dx, parts = finish_dx(u.at[3, 5].set(jnp.nan), x, coef, gamma, interpret=not on_gpu)
    assert np.isnan(np.asarray(dx, np.float32)[3, 5]) and np.isnan(np.asarray(parts.sum(axis=0))[5])


def test_bad_shapes_name_the_argument():
    u, x, coef, gamma, _ = _inputs(32, 128, jnp.bfloat16, None, 1.0, 3)
    with pytest.raises(ValueError, match=r"finish_dx: coef_s must have shape \(32,\) .* got \(16,\)"):
        finish_dx(u, x, coef[:16], gamma, interpret=True)
    with pytest.raises(ValueError, match=r"finish_dx: blocks=\(64, 128\) must divide \(M, K\) = \(32, 128\)"):
        finish_dx(u, x, coef, gamma, blocks=(64, 128), interpret=True)
    with pytest.raises(ValueError, match=r"M=36 must be a multiple of 8"):
        block_sizes(36, 128)
