"""pallas_kernels.reference against independent, straightforward computations.

attention -> jax.nn.dot_product_attention (float32, highest matmul precision) with an explicit boolean mask;
rmsnorm / rmsnorm_matmul -> numpy float64; linear_cross_entropy -> optax.softmax_cross_entropy_with_integer_labels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import key, normal
from pallas_kernels import reference


def _fwd_and_vjp(fn, args):
    """(out, grads) of fn at args for a fresh random cotangent, under one jit (eager vjp is slow on CPU)."""
    out_shape = jax.eval_shape(fn, *args)
    do = normal(out_shape.shape)

    @jax.jit
    def run(args, do):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(do)

    return run(args, do)


def _jax_attention(q, k, v, *, causal=False, scale=None, mask=None, kv_seq_lengths=None):
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=causal, key_value_seq_lengths=kv_seq_lengths,
            implementation="xla")


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("T,S,N,K,causal", [
    pytest.param(T, S, N, K, causal,
                 marks=[] if (T, S, causal) in ((7, 7, False), (11, 5, True)) else [pytest.mark.slow])
    for T, S, N, K in [(7, 7, 4, 4), (5, 11, 4, 2), (11, 5, 4, 1), (16, 16, 2, 1)] for causal in (False, True)])
def test_attention_matches_jax_nn(T, S, N, K, causal):
    B, H = 2, 8
    q, k, v = normal((B, T, N, H)), normal((B, S, K, H)), normal((B, S, K, H))
    # With causal and T > S the top-left aligned mask still gives every row key 0, so no row is empty.
    do = normal((B, T, N, H))
    fwd_bwd = lambda fn: jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)))(*jax.vjp(fn, q, k, v)))
    want, grads_want = fwd_bwd(lambda *a: _jax_attention(*a, causal=causal))(q, k, v, do)
    got, grads_got = fwd_bwd(lambda *a: reference.attention(*a, causal=causal))(q, k, v, do)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads_got, grads_want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_attention_scale_and_dtype():
    q, k, v = normal((1, 6, 2, 8), jnp.bfloat16), normal((1, 9, 2, 8), jnp.bfloat16), normal((1, 9, 2, 8),
                                                                                               jnp.bfloat16)
    got = reference.attention(q, k, v, scale=0.3)
    assert got.dtype == jnp.bfloat16
    f32 = lambda x: x.astype(jnp.float32)
    want = _jax_attention(f32(q), f32(k), f32(v), scale=0.3)
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
def test_attention_kv_seq_lengths():
    B, T, S, N, H = 3, 6, 10, 2, 8
    q, k, v = normal((B, T, N, H)), normal((B, S, N, H)), normal((B, S, N, H))
    lengths = jnp.array([10, 4, 1], jnp.int32)
    want = _jax_attention(q, k, v, kv_seq_lengths=lengths)
    got = reference.attention(q, k, v, kv_seq_lengths=lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Keys past the length do not matter at all.
    k2 = k.at[1, 4:].set(100.0)
    np.testing.assert_allclose(reference.attention(q, k2, v, kv_seq_lengths=lengths), got, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_attention_segment_ids_single_and_pair():
    B, T, N, H = 2, 9, 2, 8
    q, k, v = normal((B, T, N, H)), normal((B, T, N, H)), normal((B, T, N, H))
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7, 7]], jnp.int32)
    mask = (seg[:, :, None] == seg[:, None, :])[:, None]  # (B, 1, T, S)
    want = _jax_attention(q, k, v, causal=True, mask=mask)
    np.testing.assert_allclose(reference.attention(q, k, v, causal=True, segment_ids=seg), want, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(reference.attention(q, k, v, causal=True, segment_ids=(seg, seg)), want, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.slow
def test_attention_segment_pair_cross_lengths():
    B, T, S, N, H = 1, 4, 6, 1, 8
    q, k, v = normal((B, T, N, H)), normal((B, S, N, H)), normal((B, S, N, H))
    q_seg = jnp.array([[1, 1, 2, 2]])
    kv_seg = jnp.array([[1, 2, 2, 1, 2, 1]])
    mask = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
    want = _jax_attention(q, k, v, mask=mask)
    got = reference.attention(q, k, v, segment_ids=(q_seg, kv_seg))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_fully_masked_rows_are_zero_without_nan():
    B, T, S, N, H = 2, 5, 5, 2, 8
    q, k, v = normal((B, T, N, H)), normal((B, S, N, H)), normal((B, S, N, H))
    lengths = jnp.array([0, 3])  # batch 0: no visible key anywhere
    q_seg = jnp.array([[1, 1, 9, 1, 1], [1, 1, 1, 1, 9]])  # segment 9 has no keys
    kv_seg = jnp.ones((B, S), jnp.int32)
    fn = lambda q, k, v: reference.attention(q, k, v, segment_ids=(q_seg, kv_seg), kv_seq_lengths=lengths)
    out, grads = _fwd_and_vjp(fn, (q, k, v))
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[1, 4], 0.0)
    assert np.all(np.abs(np.asarray(out[1, :4])) > 0)
    # Rows that do see keys agree with jax.nn (which returns mean(V) for empty rows instead of zeros).
    mask = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
    want = _jax_attention(q, k, v, mask=mask, kv_seq_lengths=lengths)
    np.testing.assert_allclose(out[1, :4], want[1, :4], rtol=1e-5, atol=1e-5)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(grads[0][0], 0.0)  # dq of empty rows
    np.testing.assert_array_equal(grads[1][0], 0.0)  # no key of batch 0 is seen by anyone
    np.testing.assert_array_equal(grads[2][1, 3:], 0.0)  # dv of keys past the length


@pytest.mark.parametrize("bad", [jnp.zeros((2, 7), jnp.int32), (jnp.zeros((2, 5), jnp.int32),),
                                 (jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 6), jnp.int32)),
                                 (jnp.zeros((2, 5)), jnp.zeros((2, 7)))])
def test_attention_bad_segment_ids(bad):
    q, k = normal((2, 5, 1, 8)), normal((2, 7, 1, 8))
    with pytest.raises(ValueError, match="segment_ids"):
        reference.attention(q, k, k, segment_ids=bad)


# ------------------------------------------------------------------------------------------------ rmsnorm
def _np_rmsnorm(x, gamma, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_rmsnorm(dtype, tol):
    x, gamma = normal((3, 5, 24), dtype), normal((24,), dtype)
    got = reference.rmsnorm(x, gamma, eps=1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_allclose(np.asarray(got, np.float64), _np_rmsnorm(x.astype(jnp.float32),
                                                                        gamma.astype(jnp.float32), 1e-5),
                               rtol=tol, atol=tol)


def test_rmsnorm_matmul_plain_and_residual():
    x, r, gamma, w = normal((2, 3, 16)), normal((2, 3, 16)), normal((16,)), normal((16, 12))
    y = reference.rmsnorm_matmul(x, gamma, w, eps=1e-6)
    assert y.shape == (2, 3, 12) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, _np_rmsnorm(x, gamma, 1e-6) @ np.asarray(w, np.float64), rtol=1e-5, atol=1e-5)

    h, y = reference.rmsnorm_matmul(x, gamma, w, residual=r, out_dtype=jnp.bfloat16)
    hx = np.asarray(x, np.float64) + np.asarray(r, np.float64)
    np.testing.assert_allclose(h, hx, rtol=1e-6, atol=1e-6)
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    np.testing.assert_allclose(y.astype(jnp.float32), _np_rmsnorm(hx, gamma, 1e-6) @ np.asarray(w, np.float64),
                               rtol=1e-2, atol=2e-2)


def test_rmsnorm_matmul_bf16_keeps_h_in_input_dtype():
    x, r = normal((4, 16), jnp.bfloat16), normal((4, 16), jnp.bfloat16)
    h, y = reference.rmsnorm_matmul(x, normal((16,)), normal((16, 8)), residual=r)
    assert h.dtype == jnp.bfloat16 and y.dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------------ cross-entropy
def _optax_loss(h, w, labels, ignore_index=-100):
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    valid = np.asarray(labels) != ignore_index
    per_row = optax.softmax_cross_entropy_with_integer_labels(
        jnp.asarray(logits, jnp.float32), jnp.where(valid, labels, 0))
    return np.where(valid, np.asarray(per_row), 0.0), valid


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_matches_optax(reduction):
    B, H, V = 13, 16, 37
    h, w = normal((B, H)), normal((H, V))
    labels = jax.random.randint(key(), (B,), 0, V).at[jnp.array([2, 7])].set(-100)
    per_row, valid = _optax_loss(h, w, labels)
    want = {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / valid.sum()}[reduction]
    got = reference.linear_cross_entropy(h, w, labels, reduction=reduction)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_linear_cross_entropy_z_loss_and_soft_cap():
    B, H, V, cap, z = 6, 8, 19, 3.0, 1e-3
    h, w = normal((B, H)) * 3, normal((H, V))
    labels = jax.random.randint(key(), (B,), 0, V)
    logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    capped = cap * np.tanh(logits / cap)
    lse = np.log(np.sum(np.exp(capped), axis=-1))
    per_row = lse - capped[np.arange(B), np.asarray(labels)] + z * lse**2
    got = reference.linear_cross_entropy(h, w, labels, z_loss=z, logit_soft_cap=cap)
    np.testing.assert_allclose(got, per_row.mean(), rtol=1e-5)
    # Capping actually changes the answer at this logit scale.
    assert abs(float(reference.linear_cross_entropy(h, w, labels, z_loss=z)) - per_row.mean()) > 1e-3


def test_linear_cross_entropy_all_ignored_is_zero_with_finite_grads():
    h, w = normal((4, 8), jnp.bfloat16), normal((8, 11), jnp.bfloat16)
    labels = jnp.full((4,), -1)
    loss, grads = jax.value_and_grad(
        lambda h, w: reference.linear_cross_entropy(h, w, labels, ignore_index=-1), argnums=(0, 1))(h, w)
    assert float(loss) == 0.0
    for g in grads:
        assert np.all(np.asarray(g, np.float32) == 0.0)


def test_linear_cross_entropy_bad_reduction():
    with pytest.raises(ValueError, match="reduction"):
        reference.linear_cross_entropy(normal((2, 4)), normal((4, 5)), jnp.zeros((2,), jnp.int32),
                                       reduction="avg")
