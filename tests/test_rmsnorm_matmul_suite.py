"""jaxfuse.suites.rmsnorm_matmul on CPU at the "cpu" smoke shape (interpret mode): every implementation and mode
is recorded with sane fields, and the algebraic baseline computes the same function as the reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import bench, suites
from jaxfuse.suites import rmsnorm_matmul as suite
from pallas_kernels import reference


@pytest.fixture(scope="module")
def records():
    return suite.run(["cpu"], iterations=1)


def test_registered():
    assert suites.get("rmsnorm_matmul") is suite
    assert set(suite.DEFAULT_SHAPES) <= set(suite.SHAPES)


def test_one_record_per_impl_and_mode(records):
    keys = {(r.implementation, r.mode) for r in records}
    assert keys == {(i, m) for i in suite._IMPLS for m in ("fwd", "fwd+bwd")}
    for r in records:
        assert math.isfinite(r.time_us) and r.time_us > 0, (r.implementation, r.mode, r.extra.get("error"))
        assert r.floor_us > 0 and r.flops > 0


def test_pallas_rows_carry_small_errors_and_ratios(records):
    for r in records:
        if r.implementation != "pallas":
            continue
        errors = r.extra["rel_err"]
        assert set(errors) == ({"y"} if r.mode == "fwd" else {"y", "dx", "dgamma", "dw"})
        assert all(0 <= e < 2e-2 for e in errors.values()), errors
        assert set(r.speedup_vs) == {"xla", "xla_matmul_alone"}


def test_summary_and_markdown(records):
    lines = suite.summary_table(records).splitlines()
    assert len(lines) == 4  # header, rule, fwd, fwd+bwd
    times = {(r.mode, r.implementation): r.time_us for r in records}
    for line, mode in zip(lines[2:], ("fwd", "fwd+bwd")):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [records[0].shape, mode]  # keyed by the MxKxN label, not the shape's name
        p, x, a = (times[(mode, impl)] for impl in ("pallas", "xla", "xla_matmul_alone"))
        assert cells[2:5] == [f"{p:.1f}", f"{x:.1f}", f"{a:.1f}"]
        assert float(cells[5]) == pytest.approx(p / a, abs=1e-3) and float(cells[6]) == pytest.approx(x / p, abs=1e-3)
    assert "xla_rowscale" in bench.markdown_table(records)


def test_rowscale_baseline_matches_the_reference():
    """r ⊙ (x @ (γ ∘ w)) is the same function as rmsnorm(x) · γ @ w: forward and all gradients, bf16 tolerance."""
    x, gamma, w, dy = suite.make_inputs(37, 64, 48, seed=3)

    def fwd_bwd(fn, *args):
        y, vjp = jax.vjp(fn, *args)
        return (y, *vjp(dy.astype(y.dtype)))

    got = fwd_bwd(suite.rowscale_rmsnorm_matmul, x, gamma, w)
    want = fwd_bwd(reference.rmsnorm_matmul, *(a.astype(jnp.float32) for a in (x, gamma, w)))
    for name, g, r in zip(("y", "dx", "dgamma", "dw"), got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert np.all(np.isfinite(g)) and err < 2e-2, (name, err)
