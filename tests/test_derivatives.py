"""The kernels' derivatives: first order through each op's custom VJP; a derivative of a derivative refused by name
(``backends.first_derivatives_only``), where Pallas itself failed with a bare AssertionError (attention,
rmsnorm_matmul) or "JVP with aliasing not supported" (the loss)."""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from pallas_kernels import reference

_KEYS = jax.random.split(jax.random.key(0), 3)
_X, _W = jax.random.normal(_KEYS[0], (32, 64)), jax.random.normal(_KEYS[1], (64, 32)) / 8
_Q = jax.random.normal(_KEYS[2], (1, 64, 2, 32))
_WV, _LABELS = jax.random.normal(_KEYS[1], (64, 100)) / 8, jnp.arange(32) % 100

# op -> (a scalar function of one array, that array): each in interpret mode on the CPU
_OPS = {
    "rmsnorm_matmul": (lambda x: (pallas_kernels.rmsnorm_matmul(x, jnp.ones(64), _W) ** 2).sum(), _X),
    "flash_attention": (lambda q: (pallas_kernels.flash_attention(q, q, q, causal=True) ** 2).sum(), _Q),
    "linear_cross_entropy": (lambda h: pallas_kernels.linear_cross_entropy(h, _WV, _LABELS), _X),
}
_REFERENCES = {
    "rmsnorm_matmul": lambda x: (reference.rmsnorm_matmul(x, jnp.ones(64), _W) ** 2).sum(),
    "flash_attention": lambda q: (reference.attention(q, q, q, causal=True) ** 2).sum(),
    "linear_cross_entropy": lambda h: reference.linear_cross_entropy(h, _WV, _LABELS),
}


@pytest.mark.parametrize("op", sorted(_OPS))
def test_a_second_derivative_is_a_clear_error_and_the_first_still_runs(op):
    fn, arg = _OPS[op]
    grad = jax.grad(fn)(arg)
    want = jax.grad(_REFERENCES[op])(arg)
    assert float(jnp.abs(grad - want).max()) <= 1e-4 * float(jnp.abs(want).max())
    with pytest.raises(ValueError, match=r"first derivatives only .*\(jax\.hessian, jax\.grad of jax\.grad"):
        jax.grad(lambda a: jax.grad(fn)(a).sum())(arg)


def test_hessian_is_refused_by_name():
    fn, arg = _OPS["rmsnorm_matmul"]
    with pytest.raises(ValueError, match=r"the Pallas kernels have first derivatives only"):
        jax.hessian(fn)(arg[:4])


def test_a_second_derivative_of_a_mosaic_kernel_is_refused_while_tracing():
    """The Mosaic kernels' calls (``mosaic_utils.kernel``), traced for CUDA on any machine."""
    from pallas_kernels import backends

    x, g, w = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1024, 1024), (1024,), (1024, 1024)))
    loss = lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic").astype(jnp.float32).sum()  # noqa: E731
    with backends.lowering_for_gpu(), pytest.raises(ValueError, match=r"first derivatives only"):
        jax.jit(jax.grad(lambda x, g, w: jax.grad(loss)(x, g, w).astype(jnp.float32).sum())).trace(x, g, w)


@pytest.mark.parametrize("op", sorted(_OPS))
def test_forward_mode_is_refused_by_jax_at_once(op):
    """Each op defines reverse mode only (a custom VJP): ``jax.jvp`` (so ``jax.jacfwd``, ``jax.linearize``) stops
    with JAX's TypeError naming forward mode, before any kernel runs; the README says so."""
    fn, arg = _OPS[op]
    with pytest.raises(TypeError, match=r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"):
        jax.jvp(fn, (arg,), (jnp.ones_like(arg),))
