"""RMSNorm→matmul in Pallas (Triton lowering), backward: the dx and dw kernels and their pallas_calls. The
algorithm is described in ``pallas_kernels.norm_matmul.triton``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels.norm_matmul.config import RMSNormMatmulConfig
from pallas_kernels.norm_matmul.triton_fwd import F32, Static, col, program_tile, row_mask

__all__ = ["backward"]


# ---------------------------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------------------------
def _dx_kernel(*refs, M: int, K: int, N: int, cfg: RMSNormMatmulConfig, has_dh: bool):
    """dx tile (block_m_dx, block_k_dx) = r·γ·(dy @ wᵀ) − r²·c·x (+ dh); also dgamma partial sums per row block.
    With split_n_dx > 1 only dy @ wᵀ over this program's N range, stored as a float32 partial at dx[split].
    With dw_in_dx (all M rows in the one row block), each step also writes the dw tile whose w tile it read:
    dw[k0:k0+bk, cols] = γ ⊙ ((x·r)ᵀ @ dy), from the dy tile the step loaded."""
    it = iter(refs)
    dy_ref, w_ref = next(it), next(it)
    split = cfg.split_n_dx > 1
    x_ref, gamma_ref, rstd_ref = (next(it) for _ in range(3)) if (cfg.dw_in_dx or not split) else (None,) * 3
    rowdot_ref = None if split else next(it)
    dh_ref = next(it) if has_dh and not split else None
    dx_ref = next(it)
    dgamma_ref = None if split else next(it)
    dw_ref = next(it) if cfg.dw_in_dx else None

    bm, bk, bn = cfg.block_m_dx, cfg.block_k_dx, cfg.block_n_dx
    pid_m, pid_k = program_tile(pl.program_id(0), pl.cdiv(M, bm), K // bk, cfg.group)
    m0, k0 = pid_m * bm, pid_k * bk
    rows = pl.ds(m0, bm)
    valid = row_mask(m0, bm, M)
    steps = N // bn // cfg.split_n_dx  # N slices per program
    first_step = pl.program_id(1) * steps

    if dw_ref is not None:  # n = x·r in the MMA dtype (masked rows: 0) and γ of this K range, for every dw tile
        r_rows = tu.load(rstd_ref, (rows,), mask=valid)
        x_rows = tu.load(x_ref, (rows, pl.ds(k0, bk)), mask=col(valid)).astype(F32)
        n = (x_rows * r_rows[:, None]).astype(dy_ref.dtype)
        gamma_k = gamma_ref[pl.ds(k0, bk)].astype(F32)

    def body(j, carry):
        acc, row_dot = carry
        cols = pl.ds((first_step + j) * bn, bn)
        dy = tu.load(dy_ref, (rows, cols), mask=col(valid))  # (bm, bn)
        acc = acc + tu.dot(dy, w_ref[pl.ds(k0, bk), cols], trans_b=True)  # (bm, bk)
        if dw_ref is not None:
            dw_tile = gamma_k[:, None] * tu.dot(n, dy, trans_a=True)  # (bk, bn)
            dw_ref[pl.ds(k0, bk), cols] = dw_tile.astype(dw_ref.dtype)
        if cfg.rowdot_in_dx:
            y = tu.load(rowdot_ref, (rows, cols), mask=col(valid))
            row_dot = row_dot + jnp.sum(dy.astype(F32) * y.astype(F32), axis=1)
        return acc, row_dot

    acc, row_dot = lax.fori_loop(0, steps, body, (jnp.zeros((bm, bk), F32), jnp.zeros((bm,), F32)))
    if cfg.split_n_dx > 1:  # a float32 partial of dy @ wᵀ; _backward applies the epilogue
        tu.store(dx_ref, (pl.program_id(1), rows, pl.ds(k0, bk)), acc, mask=col(valid))
        return
    # c = Σ_N(dy · y) / K; the XLA fusion passes the row dot unscaled (a scalar multiply after a reduction
    # became a kernel of its own)
    c = (row_dot if cfg.rowdot_in_dx else tu.load(rowdot_ref, (rows,), mask=valid)) * (1.0 / K)
    r = tu.load(rstd_ref, (rows,), mask=valid)  # masked rows: r = 0, so they add nothing to dgamma
    x = tu.load(x_ref, (rows, pl.ds(k0, bk)), mask=col(valid)).astype(F32)
    gamma = gamma_ref[pl.ds(k0, bk)].astype(F32)
    dx = (r[:, None] * gamma[None, :]) * acc - (r * r * c)[:, None] * x
    if dh_ref is not None:
        dx = dx + tu.load(dh_ref, (rows, pl.ds(k0, bk)), mask=col(valid)).astype(F32)
    tu.store(dx_ref, (rows, pl.ds(k0, bk)), dx.astype(dx_ref.dtype), mask=col(valid))
    dgamma_ref[pl.ds(pid_m * K + k0, bk)] = jnp.sum(acc * x * r[:, None], axis=0).astype(dgamma_ref.dtype)


def _dw_kernel(x_ref, dy_ref, rstd_ref, gamma_ref, dw_ref, *, M: int, K: int, N: int, cfg: RMSNormMatmulConfig):
    """dw tile (block_k_dw, block_n_dw) = γ ⊙ Σ_M (x·r)ᵀ @ dy; the M tail is one masked step after the loop."""
    bk, bn, bm = cfg.block_k_dw, cfg.block_n_dw, cfg.block_m_dw
    pid_k, pid_n = program_tile(pl.program_id(0), K // bk, N // bn, cfg.group)
    k0, n0 = pid_k * bk, pid_n * bn

    def step(i, acc, *, masked: bool):
        m0 = i * bm
        rows = pl.ds(m0, bm)
        valid = row_mask(m0, bm, M) if masked else None
        x = tu.load(x_ref, (rows, pl.ds(k0, bk)), mask=col(valid))  # (bm, bk)
        dy = tu.load(dy_ref, (rows, pl.ds(n0, bn)), mask=col(valid))  # (bm, bn)
        r = tu.load(rstd_ref, (rows,), mask=valid)[:, None]
        if cfg.rstd_on_dy:
            dy = (dy.astype(F32) * r).astype(dy.dtype)
        else:
            x = (x.astype(F32) * r).astype(x.dtype)  # n = x·r in the MMA dtype
        return acc + tu.dot(x, dy, trans_a=True)  # (bk, bn)

    acc = jnp.zeros((bk, bn), F32)
    acc = lax.fori_loop(0, M // bm, functools.partial(step, masked=False), acc) if M >= bm else acc
    if M % bm:  # a one-trip loop: its traced index keeps the (partly out-of-bounds) window dynamic
        acc = lax.fori_loop(M // bm, M // bm + 1, functools.partial(step, masked=True), acc)
    gamma = gamma_ref[pl.ds(k0, bk)].astype(F32)
    dw_ref[pl.ds(k0, bk), pl.ds(n0, bn)] = (gamma[:, None] * acc).astype(dw_ref.dtype)


@functools.partial(jax.jit, static_argnames="static")
def backward(x, gamma, w, rstd, y, dy, dh, static: Static):
    """x: the normalized input (h with a residual) (M, K). Returns dx (M, K) in x.dtype (including dh), dgamma
    (K,) in gamma.dtype, dw (K, N) in w.dtype."""
    M, K = x.shape
    N = w.shape[1]
    cfg = static.config
    gamma32 = gamma.astype(F32)
    if cfg.rowdot_in_dx:
        row_dot_input = y
    else:  # Σ_N(dy · y) (c = that / K): one XLA reduction fusion reading dy and y once
        row_dot_input = jnp.sum(dy.astype(F32) * y.astype(F32), axis=1)
    dy = dy.astype(w.dtype)  # the MMA operand dtype

    num_row_blocks = pl.cdiv(M, cfg.block_m_dx)
    kernel = functools.partial(_dx_kernel, M=M, K=K, N=N, cfg=cfg, has_dh=dh is not None)
    launch = dict(num_warps=cfg.num_warps_dx, num_stages=cfg.num_stages_dx, interpret=static.interpret,
                  grid=(num_row_blocks * (K // cfg.block_k_dx), cfg.split_n_dx), name="rmsnorm_matmul_dx")
    dw_shape = [jax.ShapeDtypeStruct((K, N), w.dtype)] if cfg.dw_in_dx else []
    if cfg.split_n_dx > 1:  # partials of g = dy @ wᵀ; one XLA fusion sums them and applies the dx epilogue
        rows_in = [x, gamma, rstd] if cfg.dw_in_dx else []
        parts_shape = jax.ShapeDtypeStruct((cfg.split_n_dx, M, K), F32)
        parts, *dw = tu.pallas_call(kernel, out_shape=[parts_shape] + dw_shape, **launch)(dy, w, *rows_in)
        g = jnp.sum(parts, axis=0)  # (M, K) float32
        x32 = x.astype(F32)
        dx = (rstd[:, None] * gamma32[None, :]) * g - (rstd * rstd * row_dot_input * (1.0 / K))[:, None] * x32
        if dh is not None:
            dx = dx + dh.astype(F32)
        dx = dx.astype(x.dtype)
        dgamma = jnp.sum(g * x32 * rstd[:, None], axis=0).astype(gamma.dtype)
    else:
        # One row block (decode): the kernel writes dgamma itself in gamma's dtype; else float32 partial sums
        # per row block, summed by XLA.
        parts_dtype = gamma.dtype if num_row_blocks == 1 else F32
        dx, dgamma_parts, *dw = tu.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((M, K), x.dtype),
                       jax.ShapeDtypeStruct((num_row_blocks * K,), parts_dtype)] + dw_shape,
            **launch,
        )(dy, w, x, gamma, rstd, row_dot_input, *([dh] if dh is not None else []))
        dgamma = dgamma_parts if num_row_blocks == 1 else (
            dgamma_parts.reshape(num_row_blocks, K).sum(axis=0).astype(gamma.dtype))

    if cfg.dw_in_dx:
        return dx, dgamma, dw[0]
    if cfg.dw_in_xla:  # n = x·r rounded to the MMA dtype, as the Pallas dw kernel rounds its tile
        n = (x.astype(F32) * rstd[:, None]).astype(x.dtype)
        precision = lax.Precision.HIGHEST if x.dtype == F32 else None
        dw = lax.dot_general(n, dy, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=F32)
        return dx, dgamma, (gamma32[:, None] * dw).astype(w.dtype)
    dw = tu.pallas_call(
        functools.partial(_dw_kernel, M=M, K=K, N=N, cfg=cfg),
        num_warps=cfg.num_warps_dw, num_stages=cfg.num_stages_dw, interpret=static.interpret,
        grid=((K // cfg.block_k_dw) * (N // cfg.block_n_dw),),
        out_shape=jax.ShapeDtypeStruct((K, N), w.dtype),
        name="rmsnorm_matmul_dw",
    )(x, dy, rstd, gamma)
    return dx, dgamma, dw
