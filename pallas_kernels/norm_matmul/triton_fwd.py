"""RMSNorm→matmul in Pallas (Triton lowering), forward: the kernel, its pallas_call and the tile helpers the
backward kernels (``triton_bwd``) share. The algorithm is described in ``pallas_kernels.norm_matmul.triton``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels.norm_matmul.config import RMSNormMatmulConfig

__all__ = ["F32", "Static", "col", "forward", "mask_and", "pow2_row_scale", "program_tile", "rescales_rows", "row_mask",
           "rstd_precomputed"]

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call: the single non-differentiable argument of the custom VJP."""

    config: RMSNormMatmulConfig
    eps: float
    out_dtype: jnp.dtype
    interpret: bool


# ---------------------------------------------------------------------------------------------------------------
# Kernel helpers
# ---------------------------------------------------------------------------------------------------------------
def program_tile(pid, num_rows: int, num_cols: int, group: int):
    """(row block, column block) of program ``pid`` in grouped order: programs run through `group` row blocks
    column by column, so one column tile of the B operand serves `group` row tiles while it is in L2."""
    group = max(1, min(group, num_rows))
    width = group * num_cols
    group_id = lax.div(pid, width)
    first_row = group_id * group
    rows_in_group = jnp.minimum(num_rows - first_row, group)
    row = first_row + lax.rem(pid, rows_in_group)
    col = lax.div(lax.rem(pid, width), rows_in_group)
    return row, col


def rstd_precomputed(cfg: RMSNormMatmulConfig, has_residual: bool) -> bool:
    """Whether the forward takes r from an XLA row reduction instead of summing x² in the kernel: exactly for
    gamma_on_w without a residual, where the A operand of the dot is the raw x tile (see ``forward``). With a
    residual the A tile is h = x + residual, computed in registers, so the in-kernel statistic is safe."""
    return cfg.gamma_on_w and not has_residual


def row_mask(start, block: int, limit: int):
    """(block,) bool of rows < limit, or None when every block is full (no masking needed anywhere)."""
    if limit % block == 0:
        return None
    return start + jnp.arange(block, dtype=jnp.int32) < limit


def mask_and(mask, cond):
    """mask & cond for a possibly-None (block,) mask and a scalar bool."""
    return cond if mask is None else jnp.logical_and(mask, cond)


def col(mask):
    return None if mask is None else mask[:, None]


def rescales_rows(cfg: RMSNormMatmulConfig, dtype) -> bool:
    """Whether the forward scales each row of its A tile x·γ by a power of two (float16 with gamma in registers):
    float16's normal range ends at 6.1e-5, so x·γ of fp16 x near 1e-6 would keep a few bits when rounded, where
    the normalized value x·r·γ the unfused computation rounds is a normal float16. bfloat16 and float32 have
    float32's exponent range; with gamma_on_w the A operand is x (or h) itself, never rounded again."""
    return not cfg.gamma_on_w and jnp.dtype(dtype) == jnp.float16


def pow2_row_scale(sum_sq):
    """(bm,) the power of two c <= 1 / sqrt(sum_sq) per row (up to one factor of 2 from log2's rounding), so that
    |x|·c <= 2 for every x summed into sum_sq; 2**50 for a row of zeros."""
    return jnp.exp2(jnp.floor(-0.5 * jnp.log2(sum_sq + 2.0**-100)))


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel: grid (row blocks × column blocks,), K streamed.
# ---------------------------------------------------------------------------------------------------------------
def _fwd_kernel(*refs, M: int, K: int, N: int, cfg: RMSNormMatmulConfig, eps: float, has_residual: bool):
    """y tile (block_m, block_n) = r ⊙ ((x·γ) @ w), K streamed; r from the sum of squares of the same x slices.

    With ``gamma_on_w`` and no residual the A operand is the x tile exactly as loaded and r comes in precomputed
    (``rstd_in``). The kernel must not use a loaded tile both as a dot operand and as the input of other
    arithmetic (see ``forward``).

    With float16 and gamma in registers (``rescales_rows``), each row of the A tile is x·γ·c, c a power of two
    from the row's sum of squares so far (``pow2_row_scale``: |x·c| <= 2 whatever x's magnitude, so x·γ·c is a
    normal float16 unless tiny against the row's RMS); when a step lowers c, the float32 accumulator's row is
    scaled by the same exact power of two, and the epilogue applies r / c.

    With ``split_k`` > 1, program (tile, s) streams the s-th of split_k K ranges and stores its float32 partial
    product (unscaled) at y[s] and its partial sum of squares at r[s]; ``forward`` combines them."""
    it = iter(refs)
    x_ref = next(it)
    res_ref = next(it) if has_residual else None
    gamma_ref = None if cfg.gamma_on_w else next(it)
    w_ref = next(it)
    split = cfg.split_k > 1
    precomputed = rstd_precomputed(cfg, has_residual)
    rstd_in_ref = next(it) if precomputed and not split else None
    y_ref = next(it)
    rstd_ref = None if precomputed else next(it)  # r, or the partial sums of squares when split
    h_ref = next(it) if has_residual else None

    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    pid_m, pid_n = program_tile(pl.program_id(0), pl.cdiv(M, bm), N // bn, cfg.group)
    steps = K // bk // cfg.split_k  # K slices per program
    first_step = pl.program_id(1) * steps
    m0, n0 = pid_m * bm, pid_n * bn
    valid = row_mask(m0, bm, M)
    first_col = pid_n == 0  # the programs that also store h and r (one per row block and K range)
    h_mask = None if h_ref is None else jnp.broadcast_to(mask_and(valid, first_col)[..., None], (bm, 1))
    rescale = rescales_rows(cfg, x_ref.dtype)

    def body(i, carry):
        acc, sum_sq, scale = carry
        cols = pl.ds((first_step + i) * bk, bk)
        a = tu.load(x_ref, (pl.ds(m0, bm), cols), mask=col(valid))  # (bm, bk); masked rows read 0
        if res_ref is not None:
            r_tile = tu.load(res_ref, (pl.ds(m0, bm), cols), mask=col(valid))
            a = (a.astype(F32) + r_tile.astype(F32)).astype(x_ref.dtype)  # h, rounded as it is stored
            tu.store(h_ref, (pl.ds(m0, bm), cols), a, mask=h_mask)
        if precomputed:  # the raw x tile goes to the dot and nowhere else
            return acc + tu.dot(a, w_ref[cols, pl.ds(n0, bn)]), sum_sq, scale
        a32 = a.astype(F32)
        sum_sq = sum_sq + jnp.sum(a32 * a32, axis=1)
        if rescale:  # powers of two: exact in float32
            new_scale = pow2_row_scale(sum_sq)
            acc = acc * (new_scale / scale)[:, None]
            scale = new_scale
            a32 = a32 * scale[:, None]
        if gamma_ref is not None:
            a = (a32 * gamma_ref[cols].astype(F32)[None, :]).astype(w_ref.dtype)  # x·γ(·c) in the MMA dtype
        acc = acc + tu.dot(a, w_ref[cols, pl.ds(n0, bn)])
        return acc, sum_sq, scale

    acc, sum_sq, scale = lax.fori_loop(0, steps, body, (jnp.zeros((bm, bn), F32), jnp.zeros((bm,), F32),
                                                        jnp.ones((bm,), F32)))
    unscale = 1.0 / scale if rescale else None  # (bm,): the accumulator holds (x·γ·c) @ w
    stat_mask = jnp.broadcast_to(mask_and(valid, first_col), (bm,))
    if split:
        s = pl.program_id(1)
        part = acc if unscale is None else acc * unscale[:, None]
        tu.store(y_ref, (s, pl.ds(m0, bm), pl.ds(n0, bn)), part, mask=col(valid))
        if rstd_ref is not None:
            tu.store(rstd_ref, (s, pl.ds(m0, bm)), sum_sq, mask=stat_mask)
        return
    if rstd_in_ref is not None:
        rstd = tu.load(rstd_in_ref, (pl.ds(m0, bm),), mask=valid)  # (bm,) float32
    else:
        rstd = lax.rsqrt(sum_sq * (1.0 / K) + eps)  # (bm,) float32
    row_scale = rstd if unscale is None else rstd * unscale
    tu.store(y_ref, (pl.ds(m0, bm), pl.ds(n0, bn)), (acc * row_scale[:, None]).astype(y_ref.dtype),
             mask=col(valid))
    if rstd_ref is not None:
        tu.store(rstd_ref, (pl.ds(m0, bm),), rstd, mask=stat_mask)


# ---------------------------------------------------------------------------------------------------------------
# pallas_call wrapper
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="static")
def forward(x, residual, gamma, w, static: Static):
    """x, residual (M, K); gamma (K,); w (K, N) -> y (M, N) in out_dtype, r (M,) float32, h (M, K) or None."""
    M, K = x.shape
    N = w.shape[1]
    cfg = static.config
    split = cfg.split_k
    gamma32 = gamma.astype(F32)
    inputs = [x] + ([] if residual is None else [residual])
    if cfg.gamma_on_w:  # one XLA pass over w: diag(gamma) @ w in w's dtype
        inputs.append((gamma32[:, None] * w.astype(F32)).astype(w.dtype))
    else:
        # Split-K programs take gamma in its own dtype and widen it per slice (one convert kernel fewer); the
        # one-pass kernel takes it widened by XLA, since widening in its pipelined K loop was slower (NOTES.md).
        inputs += [gamma if cfg.split_k > 1 else gamma32, w]
    rstd = None
    if rstd_precomputed(cfg, residual is not None):
        # gamma_on_w without a residual: the A operand is the x tile exactly as loaded. Summing its squares in
        # the same loop would make one loaded tile both a dot operand and a reduction input, which Triton's
        # software pipeliner (num_stages > 1, Hopper wgmma with the operand left in shared memory) miscompiles:
        # on an H100 this variant gave 0.5 relative error in y, and through r and y in every gradient. So r
        # comes from one XLA row reduction over x (2MK more bytes read) and the kernel is a plain GEMM. Loading
        # the slice a second time for the squares does not avoid it (0.18-0.66 relative error; NOTES.md).
        x32 = x.astype(F32)
        rstd = lax.rsqrt(jnp.sum(x32 * x32, axis=1) * (1.0 / K) + static.eps)
        if split == 1:
            inputs.append(rstd)
    if split == 1:
        out_shape = [jax.ShapeDtypeStruct((M, N), static.out_dtype)]
        stat_shape = jax.ShapeDtypeStruct((M,), F32)
    else:
        out_shape = [jax.ShapeDtypeStruct((split, M, N), F32)]
        stat_shape = jax.ShapeDtypeStruct((split, M), F32)
    if rstd is None:
        out_shape.append(stat_shape)
    if residual is not None:
        out_shape.append(jax.ShapeDtypeStruct((M, K), x.dtype))
    outs = tu.pallas_call(
        functools.partial(_fwd_kernel, M=M, K=K, N=N, cfg=cfg, eps=static.eps, has_residual=residual is not None),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=static.interpret,
        grid=(pl.cdiv(M, cfg.block_m) * (N // cfg.block_n), split),
        out_shape=out_shape,
        name="rmsnorm_matmul_fwd",
    )(*inputs)
    outs = list(outs)
    y = outs.pop(0)
    if rstd is None:
        stat = outs.pop(0)
        rstd = stat if split == 1 else lax.rsqrt(jnp.sum(stat, axis=0) * (1.0 / K) + static.eps)
    if split > 1:  # one small fusion: sum the split partials, scale the rows by r, cast
        y = (jnp.sum(y, axis=0) * rstd[:, None]).astype(static.out_dtype)
    return y, rstd, (outs.pop(0) if residual is not None else None)
