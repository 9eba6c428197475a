"""The row pass over one token chunk's logits: per-row statistics (log-sum-exp, label logit) and dlogits, in one
Pallas-Triton kernel (``row_pass``; ``row_pass="xla"`` in the config runs the same math as jnp).

Shape notation: R rows of the chunk (Bc), V vocabulary. The kernel reads an (R, V) logits chunk that a GEMM wrote
(``triton.py``) and, when the gradient is wanted, writes dlogits over it (the output aliases the logits input when
their dtypes match). A program owns ``rows_per_program`` rows and walks the vocabulary in ``block_v`` tiles:

  pass 1 (statistics): online max / sum-exp in float32 and the label logit; lse = max + log(sum)
  pass 2 (dlogits):    g · (softmax · (1 + 2·z_loss·lse) − onehot) · dz/dx, walking the tiles backwards so its
                       first tiles are pass 1's last, the likeliest still in L2

Soft-capping (z = cap·tanh(x / cap)) is applied to every tile as it is read. Bytes per chunk: R·V·s read once for
evaluation; read twice and written once (3·R·V·s) for the gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels.cross_entropy.config import LinearCrossEntropyConfig

__all__ = ["RowOptions", "row_pass", "soft_cap"]

_M_INIT = -1e30  # running max before any column: finite, so exp(m_old - m_new) never sees inf - inf


@dataclasses.dataclass(frozen=True)
class RowOptions:
    """What the row pass needs to know, static: the config (its row-kernel fields and ``row_pass``), the loss
    options and interpret mode."""

    config: LinearCrossEntropyConfig
    z_loss: float
    logit_soft_cap: float | None
    interpret: bool


def soft_cap(x, cap):
    """(z, dz/dx) for z = cap·tanh(x / cap); (x, None) without a cap."""
    if cap is None:
        return x, None
    t = jnp.tanh(x * (1.0 / cap))
    return cap * t, 1.0 - t * t


def _and(a, b):
    return b if a is None else (a if b is None else jnp.logical_and(a, b))


def _row_kernel(*refs, R: int, V: int, opt: RowOptions, stats: bool, grad: bool):
    """Program i: rows [i·r, (i+1)·r) of an (R, V) logits chunk. Refs, in order: x (R, V), labels (R,), [g (R,) if
    grad], [lse (R,) if grad and not stats]; outputs [dl (R, V) if grad], [lse, zy (R,) if stats]."""
    it = iter(refs)
    x_ref, labels_ref = next(it), next(it)
    g_ref = next(it) if grad else None
    lse_in_ref = next(it) if grad and not stats else None
    dl_ref = next(it) if grad else None
    lse_ref, zy_ref = (next(it), next(it)) if stats else (None, None)
    br, bv = opt.config.rows_per_program, opt.config.block_v
    n_tiles = pl.cdiv(V, bv)
    r0 = pl.program_id(0) * br
    rows = r0 + jnp.arange(br, dtype=jnp.int32)
    row_ok = None if R % br == 0 else rows < R
    labels = tu.load(labels_ref, (pl.ds(r0, br),), mask=row_ok, other=-1)  # (br,)

    def tile(j):
        cols = j * bv + jnp.arange(bv, dtype=jnp.int32)
        col_ok = None if V % bv == 0 else cols < V
        mask = _and(None if row_ok is None else row_ok[:, None], None if col_ok is None else col_ok[None, :])
        x = tu.load(x_ref, (pl.ds(r0, br), pl.ds(j * bv, bv)), mask=mask).astype(jnp.float32)
        z, dz_dx = soft_cap(x, opt.logit_soft_cap)
        return cols, col_ok, mask, z, dz_dx

    if stats:
        def pass1(j, carry):
            m, s, zy = carry
            cols, col_ok, _, z, _ = tile(j)
            if col_ok is not None:
                z = jnp.where(col_ok[None, :], z, -jnp.inf)  # columns past V: exp(-inf) = 0
            m_new = jnp.maximum(m, jnp.max(z, axis=1))
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
            zy = zy + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
            return m_new, s, zy

        zeros = jnp.zeros((br,), jnp.float32)
        m, s, zy = lax.fori_loop(0, n_tiles, pass1, (jnp.full((br,), _M_INIT, jnp.float32), zeros, zeros))
        lse = m + jnp.log(s)
        tu.store(lse_ref, (pl.ds(r0, br),), lse, mask=row_ok)
        tu.store(zy_ref, (pl.ds(r0, br),), zy, mask=row_ok)
    if grad:
        if not stats:
            lse = tu.load(lse_in_ref, (pl.ds(r0, br),), mask=row_ok)
        g = tu.load(g_ref, (pl.ds(r0, br),), mask=row_ok)  # rows past R: 0, not stored
        lse_scale = (1.0 + 2.0 * opt.z_loss * lse)[:, None] if opt.z_loss else None

        def pass2(j, carry):
            j = n_tiles - 1 - j  # backwards: pass 1's last tiles first (L2)
            cols, _, mask, z, dz_dx = tile(j)
            p = jnp.exp(z - lse[:, None])
            if lse_scale is not None:
                p = p * lse_scale  # d(z_loss·lse²)/dz = 2·z_loss·lse·softmax
            dz = p - (cols[None, :] == labels[:, None]).astype(jnp.float32)
            if dz_dx is not None:
                dz = dz * dz_dx
            tu.store(dl_ref, (pl.ds(r0, br), pl.ds(j * bv, bv)), (dz * g[:, None]).astype(dl_ref.dtype), mask=mask)
            return carry

        lax.fori_loop(0, n_tiles, pass2, 0)


def _row_pass_pallas(x, labels, g, lse, opt: RowOptions, *, dl_dtype):
    R, V = x.shape
    stats, grad = lse is None, g is not None
    cfg = opt.config
    f32 = jax.ShapeDtypeStruct((R,), jnp.float32)
    out_shape = ([jax.ShapeDtypeStruct((R, V), dl_dtype)] if grad else []) + ([f32, f32] if stats else [])
    inputs = [x, labels] + ([g] if grad else []) + ([lse] if grad and not stats else [])
    outs = tu.pallas_call(
        functools.partial(_row_kernel, R=R, V=V, opt=opt, stats=stats, grad=grad),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=opt.interpret,
        grid=(pl.cdiv(R, cfg.rows_per_program),), out_shape=out_shape,
        input_output_aliases={0: 0} if grad and x.dtype == dl_dtype else {},  # dlogits over the logits
        name="linear_cross_entropy_rows",
    )(*inputs)
    dl = outs[0] if grad else None
    return (dl, outs[-2], outs[-1]) if stats else (dl, lse, None)


def _row_pass_xla(x, labels, g, lse, opt: RowOptions, *, dl_dtype):
    V = x.shape[1]
    z, dz_dx = soft_cap(x.astype(jnp.float32), opt.logit_soft_cap)
    zy = None
    if lse is None:
        lse = jax.nn.logsumexp(z, axis=1)
        zy = jnp.take_along_axis(z, jnp.clip(labels, 0, V - 1)[:, None], axis=1)[:, 0]
    if g is None:
        return None, lse, zy
    p = jnp.exp(z - lse[:, None])
    if opt.z_loss:
        p = p * (1.0 + 2.0 * opt.z_loss * lse)[:, None]
    dz = p - (labels[:, None] == lax.broadcasted_iota(jnp.int32, z.shape, 1)).astype(jnp.float32)
    if dz_dx is not None:
        dz = dz * dz_dx
    return (dz * g[:, None]).astype(dl_dtype), lse, zy


def row_pass(x, labels, g, lse, opt: RowOptions, *, dl_dtype):
    """(dl or None, lse, zy or None) of one chunk.

    Args:
      x: (R, V) logits (input dtype or float32); labels: (R,) int32 (a row whose label lies outside [0, V) gets
        label logit 0: the caller marks it); g: (R,) float32 row weights (upstream scale, 0 for rows that do not
        count), or None for statistics only; lse: (R,) float32 when known (then only dlogits are computed), or
        None; dl_dtype: the dtype dlogits are written in.
    Returns dl (R, V) in dl_dtype (over x when the dtypes match), lse (R,) and the label logit zy (R,) float32
    (None when lse was given)."""
    fn = _row_pass_pallas if opt.config.row_pass == "pallas" else _row_pass_xla
    return fn(x, labels, g, lse, opt, dl_dtype=dl_dtype)
