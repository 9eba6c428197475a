"""Every implementation registered for a model site computes the same training step as "xla" (those that cannot run
here, such as cuDNN on a CPU or a Pallas backend an op does not implement yet, are skipped with the reason)."""

import jax
import jax.numpy as jnp
import pytest

from conftest import seed
from jaxfuse import kernels, programs
from jaxfuse.kernels import REGISTRIES, KernelSet
from pallas_kernels import OPS

_SMALL = dict(batch=1, seq=16, dim=64, heads=2, kv_heads=1, dtype="float32")


def _case(site: str, name: str):
    """pallas_<backend> for the backend "pallas" (auto) resolves to here is the same program: slow."""
    auto = OPS[kernels.SITE_OPS[site]].BACKENDS.names[0]
    return pytest.param(site, name, marks=[pytest.mark.slow] if name == f"pallas_{auto}" else [])


_CASES = [_case(site, name) for site, registry in REGISTRIES.items() for name in registry if name != "xla"]


@pytest.mark.parametrize("site, name", _CASES)
@pytest.mark.parametrize("model", ["block", "lm"])
def test_site_matches_xla(site, name, model):
    if model == "block" and site == "loss":
        pytest.skip("the block has no loss site")
    reason = kernels.unavailable_reason(site, name)
    if reason:
        pytest.skip(reason)
    case_seed = seed()  # fresh parameters per case, reproducible (from the test's id)
    ref = programs.build_program(model, train_step=True, seed=case_seed, **_SMALL)
    alt = programs.build_program(model, train_step=True, seed=case_seed, kernels=KernelSet(**{site: name}), **_SMALL)
    loss_ref, grads_ref = jax.jit(ref.fn)(*ref.args)
    loss_alt, grads_alt = jax.jit(alt.fn)(*alt.args)
    assert jnp.isfinite(loss_alt)
    assert float(loss_alt) == pytest.approx(float(loss_ref), rel=1e-5)
    for g_ref, g_alt in zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads_alt)):
        assert not jnp.any(jnp.isnan(g_alt))
        scale = float(jnp.max(jnp.abs(g_ref))) or 1.0
        assert float(jnp.max(jnp.abs(g_alt - g_ref))) <= 1e-4 * scale
