"""The unfused counterfactual: one kernel per op of the pre-optimization HLO."""

import jax
import jax.numpy as jnp
import pytest

import hlo_inspect
from hlo_inspect.unfused import counterfactual, seed_model_us

PRE_OPT = """HloModule jit_f

region_0.1 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main.3 {
  x.1 = f32[64,128]{1,0} parameter(0)
  mul.5 = f32[64,128]{1,0} multiply(x.1, x.1)
  constant.5 = f32[] constant(0)
  reduce_sum.14 = f32[64]{0} reduce(mul.5, constant.5), dimensions={1}, to_apply=region_0.1
  r = f32[64,1]{1,0} reshape(reduce_sum.14)
  constant.4 = f32[] constant(128)
  div.2 = f32[64,1]{1,0} broadcast(constant.4), dimensions={}
  div.3 = f32[64,1]{1,0} divide(r, div.2)
  rsqrt.1 = f32[64,1]{1,0} rsqrt(div.3)
  mul.7 = f32[64]{0} reshape(rsqrt.1)
  mul.8 = f32[64,128]{1,0} broadcast(mul.7), dimensions={0}
  ROOT mul.9 = f32[64,128]{1,0} multiply(x.1, mul.8)
}
"""


def test_counterfactual_hand_counted():
    u = counterfactual(PRE_OPT)
    # kernels: multiply, reduce, divide (scalar broadcast folded in), rsqrt, broadcast (a real tensor), multiply
    assert u.kernels == 6
    xb, rb = 64 * 128 * 4, 64 * 4
    expected = [
        xb + xb,            # x*x: x read once, product written
        xb + 4 + rb,        # reduce: product + init scalar in, row sums out
        rb + 4 + rb,        # divide by the broadcast scalar 128
        rb + rb,            # rsqrt
        rb + xb,            # broadcast rows to (64, 128)
        xb + xb + xb,       # x * broadcast
    ]
    assert u.bytes_total == sum(expected)
    assert u.flops == 64 * 128 + 64 * 127 + 64 + 64 * 128  # mul, reduce (n-1 adds), divide, mul
    assert u.transcendentals == 64


def test_inspect_fills_the_counterfactual_and_fusion_saves():
    def f(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    rep = hlo_inspect.inspect(f, jax.random.normal(jax.random.key(0), (256, 512)))
    assert rep.unfused is not None and rep.unfused.kernels > rep.totals.kernels
    saving = rep.fusion_saving(hbm_bytes_per_s=2.94e12, flops_per_s=805e12, launch_us=2.0)
    assert saving["kernels"] == [rep.unfused.kernels, rep.totals.kernels] and not saving["loop_bodies_once"]
    assert saving["bytes"][0] > saving["bytes"][1]
    assert saving["speedup"] > 1
    assert rep.to_dict()["unfused"]["kernels"] == rep.unfused.kernels


def _looped(x):
    """A while loop of 50 trips around a fused elementwise chain: x (256, 512) float32."""
    return jax.lax.fori_loop(0, 50, lambda i, y: jnp.tanh(y * 1.5 + 0.5), x)


def test_fusion_saving_counts_loop_bodies_once_on_both_sides():
    """The unfused program (HLO before optimization) has no trip counts and counts a loop body once; the fused
    side does the same, and the text says so, with the kernel count the HTML card shows."""
    rep = hlo_inspect.inspect(_looped, jax.random.normal(jax.random.key(0), (256, 512)))
    assert rep.totals.launches > rep.totals.kernels  # the loop body runs 50 times
    saving = rep.fusion_saving(hbm_bytes_per_s=1e11, flops_per_s=1e12, launch_us=1.0)
    assert saving["loop_bodies_once"]
    assert saving["kernels"] == [rep.unfused.kernels, rep.totals.kernels]
    assert saving["bytes"][1] == sum(k.bytes_total for k in rep.kernels) < rep.totals.bytes_total
    text = rep.fusion_saving_text("cpu", 1e11, 1e12, 1.0)
    assert f": {rep.unfused.kernels:,} -> {rep.totals.kernels:,} kernels, " in text
    assert text.endswith("; while-loop bodies counted once on both sides (the unfused program has no trip counts)")


def test_seed_model():
    unfused, fused = seed_model_us(2**30, n_ops=3, hbm_bytes_per_s=2**40, launch_us=5.0)
    assert fused == pytest.approx(2 * 2**30 / 2**40 * 1e6 + 5.0)
    assert unfused == pytest.approx(3 * fused)
