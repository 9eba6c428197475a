"""pallas_kernels.linear_cross_entropy against the float32 reference (pallas_kernels.reference), forward and both
gradients, on odd shapes; plus error handling and a structural check that no (B, V) value exists.

On CPU the kernels run in interpret mode with tiny shapes and the CPU config (small tiles, several splits and
backward chunks); on a GPU the same tests run the Triton kernels on larger shapes, including LM-sized vocabularies.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_kernels import reference
from pallas_kernels import cross_entropy as ce_module
from pallas_kernels.cross_entropy import LinearCrossEntropyConfig, linear_cross_entropy

ON_GPU = jax.default_backend() == "gpu"
_KEYS = itertools.count(1000)
_TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 1e-2}

# (B, H, V): odd B and V, H a multiple of the tile or not.
if ON_GPU:
    SHAPES = [(1, 256, 1000), (300, 512, 50257), (257, 1024, 32000)]
    SMALL = (300, 256, 5003)
else:
    SHAPES = [(1, 16, 100), (37, 64, 257)]
    SMALL = (37, 16, 257)


def _key():
    """A fresh key per input."""
    return jax.random.key(next(_KEYS))


def _inputs(B, H, V, dtype, *, ignored_rows=(3,)):
    h = jax.random.normal(_key(), (B, H), jnp.float32).astype(dtype)
    w = (jax.random.normal(_key(), (H, V), jnp.float32) * H**-0.5 * 2.0).astype(dtype)  # logits ~ N(0, 4)
    labels = jax.random.randint(_key(), (B,), 0, V)
    for r in ignored_rows:
        if r < B:
            labels = labels.at[r].set(-100)
    return h, w, labels


def _fwd_and_vjp(fn, h, w, ct):
    """(out, (dh, dw)) of fn at (h, w) for cotangent ct, under one jit."""

    @jax.jit
    def run(h, w, ct):
        out, vjp = jax.vjp(fn, h, w)
        return out, vjp(ct)

    return run(h, w, ct)


def _assert_close(got, want, tol, what):
    """max |got - want| <= tol · max |want| (relative to the tensor's scale), and no NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    scale = max(float(np.max(np.abs(want))), 1e-6)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _check_against_reference(B, H, V, dtype, *, reduction="mean", block_sizes=None, **kwargs):
    h, w, labels = _inputs(B, H, V, dtype)
    ct = jax.random.normal(_key(), (B,) if reduction == "none" else (), jnp.float32)
    ours = lambda h, w: linear_cross_entropy(h, w, labels, reduction=reduction, block_sizes=block_sizes, **kwargs)
    ref = lambda h, w: reference.linear_cross_entropy(h, w, labels, reduction=reduction, **kwargs)
    loss, (dh, dw) = _fwd_and_vjp(ours, h, w, ct)
    loss_ref, (dh_ref, dw_ref) = _fwd_and_vjp(ref, h, w, ct)
    tol = _TOL[jnp.dtype(dtype)]
    assert loss.dtype == jnp.float32 and dh.dtype == h.dtype and dw.dtype == w.dtype
    _assert_close(loss, loss_ref, tol, "loss")
    _assert_close(dh, dh_ref, tol, "dh")
    _assert_close(dw, dw_ref, tol, "dw")


# ------------------------------------------------------------------------------------------------ correctness
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("B,H,V", SHAPES)
def test_matches_reference(B, H, V, reduction, dtype):
    _check_against_reference(B, H, V, dtype, reduction=reduction)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_z_loss_and_soft_cap(dtype):
    _check_against_reference(*SMALL, dtype, z_loss=1e-3, logit_soft_cap=3.0)


def test_sum_reduction_and_hidden_size_not_a_tile_multiple():
    B, _, V = SMALL
    _check_against_reference(B, 24 if not ON_GPU else 200, V, jnp.float32, reduction="sum", z_loss=1e-2)


def test_several_backward_chunks_and_splits():
    """Explicit small chunk_v / num_splits (the defaults on GPU give one chunk at test sizes)."""
    B, H, V = SMALL
    sizes = {"chunk_v": 64, "num_splits": 3} if not ON_GPU else {"chunk_v": 1024, "num_splits": 5}
    _check_against_reference(B, H, V, jnp.bfloat16, block_sizes=sizes, logit_soft_cap=3.0)


@pytest.mark.parametrize("V,chunk_v", [(256, 64), (257, 64), (200, 256)],
                         ids=["steps_divide_V", "last_step_shares_columns", "one_step"])
def test_backward_counts_each_vocabulary_column_once(V, chunk_v):
    """The backward's steps and its peeled last step: V a multiple of the chunk (nothing shared), a last step that
    starts at V - chunk_v and shares columns with the step before (they must enter dh once), a single step."""
    _check_against_reference(37, 16, V, jnp.float32, block_sizes={"chunk_v": chunk_v})


def test_matches_optax():
    """The issue's reference, independent of pallas_kernels.reference: optax on materialized float32 logits."""
    B, H, V = SMALL
    h, w, labels = _inputs(B, H, V, jnp.float32, ignored_rows=())
    got = jax.jit(lambda h, w: linear_cross_entropy(h, w, labels, reduction="none"))(h, w)
    logits = jnp.dot(h, w, precision=jax.lax.Precision.HIGHEST)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    _assert_close(got, want, 1e-4, "per-row loss")


def test_all_rows_ignored_gives_zero_not_nan():
    B, H, V = SMALL
    h, w, _ = _inputs(B, H, V, jnp.float32)
    labels = jnp.full((B,), -1, jnp.int32)
    loss, (dh, dw) = jax.jit(jax.value_and_grad(
        lambda h, w: linear_cross_entropy(h, w, labels, ignore_index=-1, z_loss=1e-3), argnums=(0, 1)))(h, w)
    assert float(loss) == 0.0
    assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


# ------------------------------------------------------------------------------------------------ bad labels
def test_out_of_range_labels_raise_when_concrete():
    B, H, V = 5, 16, 40
    h, w, labels = _inputs(B, H, V, jnp.float32, ignored_rows=())
    for bad in (V, -1, 10**6):
        with pytest.raises(ValueError, match=r"labels.*\[0, V=40\)"):
            linear_cross_entropy(h, w, labels.at[2].set(bad))


def test_out_of_range_labels_under_jit_give_nan():
    """Documented behaviour with traced labels: that row's loss is NaN (so is the mean), gradients are NaN."""
    B, H, V = SMALL
    h, w, labels = _inputs(B, H, V, jnp.float32, ignored_rows=(0,))
    labels = labels.at[2].set(V + 5)
    rows = jax.jit(lambda h, w, y: linear_cross_entropy(h, w, y, reduction="none"))(h, w, labels)
    rows = np.asarray(rows)
    assert np.isnan(rows[2]) and rows[0] == 0.0
    assert np.isfinite(np.delete(rows, 2)).all()
    loss, (dh, dw) = jax.jit(jax.value_and_grad(lambda h, w, y: linear_cross_entropy(h, w, y),
                                                argnums=(0, 1)))(h, w, labels)
    assert np.isnan(float(loss))
    assert np.isnan(np.asarray(dh)[2]).all() and np.isnan(np.asarray(dw)).any()


# ------------------------------------------------------------------------------------------------ errors
def _err(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(*args, **kwargs)


def test_input_errors_name_the_argument():
    h, w, labels = _inputs(4, 16, 40, jnp.float32, ignored_rows=())
    _err("reduction", h, w, labels, reduction="avg")
    _err("h: expected rank 2", h[None], w, labels)
    _err("w: expected rank 2", h, w[None], labels)
    _err("h, w: dtypes must match", h, w.astype(jnp.bfloat16), labels)
    _err("h: dtype int32", h.astype(jnp.int32), w.astype(jnp.int32), labels)
    _err("w: first dim 8", h, w[:8], labels)
    _err(r"labels: expected shape \(B,\)", h, w, labels[:3])
    _err("labels: must be integers", h, w, labels.astype(jnp.float32))
    _err("z_loss", h, w, labels, z_loss=-1.0)
    _err("logit_soft_cap", h, w, labels, logit_soft_cap=0.0)
    _err("block_sizes: unknown fields", h, w, labels, block_sizes={"block_q": 16})


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_v"):
        LinearCrossEntropyConfig(block_v=96)
    with pytest.raises(ValueError, match="block_h"):
        LinearCrossEntropyConfig(block_h=8)
    with pytest.raises(ValueError, match="chunk_v"):
        LinearCrossEntropyConfig(chunk_v=0)
    with pytest.raises(ValueError, match="num_warps"):
        LinearCrossEntropyConfig(num_warps=3)


# ------------------------------------------------------------------------------------------------ structure
def _avals(jaxpr):
    """Every value's aval in a jaxpr, recursively through sub-jaxprs (loops, custom VJPs, pallas_call bodies)."""
    for var in list(jaxpr.invars) + list(jaxpr.constvars):
        yield var.aval
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


def test_no_batch_by_vocab_value_in_forward_or_backward():
    B, H, V = (37, 16, 257) if not ON_GPU else (300, 256, 50257)
    h, w, labels = _inputs(B, H, V, jnp.bfloat16)
    sizes = {"chunk_v": 64} if not ON_GPU else {"chunk_v": 4096}
    loss = lambda h, w: linear_cross_entropy(h, w, labels, block_sizes=sizes)
    grad = jax.grad(loss, argnums=(0, 1))
    shapes = {tuple(getattr(a, "shape", ())) for a in _avals(jax.make_jaxpr(grad)(h, w).jaxpr)}
    assert (H, V) in shapes  # the walk does see the weights (and their gradient)
    assert (B, V) not in shapes and (V, B) not in shapes
    if not ON_GPU:  # interpret mode lowers the kernels to plain HLO: no (B, V) tensor there either
        text = jax.jit(grad).lower(h, w).as_text()
        assert f"tensor<{B}x{V}x" not in text and f"tensor<{V}x{B}x" not in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gpu_defaults_fit_shared_memory(dtype):
    """The GPU default tiles' software pipeline fits the H100's 227 KiB of shared memory per block: Triton asks
    for (block_b·block_h + block_h·block_v)·itemsize·stages (on the H100 the float32 inputs at block_v 256 asked
    for exactly (128·64 + 64·256)·4·3 = 294912 bytes and failed)."""
    h, w = jnp.zeros((300, 256), dtype), jnp.zeros((256, 5003), dtype)
    cfg = ce_module.default_config(h, w, on_gpu=True)
    item = jnp.dtype(dtype).itemsize
    fwd = (cfg.block_b * cfg.block_h + cfg.block_h * cfg.block_v) * item * cfg.num_stages
    bwd = (cfg.block_b_bwd * cfg.block_h_bwd + cfg.block_h_bwd * cfg.block_v_bwd) * item * cfg.num_stages_bwd
    assert max(fwd, bwd) <= 232448, (fwd, bwd)
