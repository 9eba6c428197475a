"""One token chunk's dlogits with no pass over the logits: the softmax's exp in the logits GEMM's epilogue.

    buf, row_scale, lse, zy = scaled_dlogits(h_c, w, labels_c, g_c, z_loss=0.0, fallback=rows_path)
    # dlogits_c = row_scale[:, None] · buf, buf (Bc, V) in h's dtype, the others (Bc,) float32

The row kernel (``triton_rows``) reads each chunk's logits back and writes dlogits over them: 2·Bc·V·s bytes per
chunk (1.4 ms of a 21 ms loss at 4096x2048x256000 on the H100). Its exp can happen in the logits GEMM instead, if
every row's shift is known before the GEMM runs. The shift here is the row's label logit zy = h_i · w[:, y_i] (a
Bc·H gather of w's label columns, no GEMM):

  e_ij  = exp(z_ij − zy_i)            the Mosaic GEMM's epilogue (``mosaic_logits.probabilities``), rounded to bf16
  Σ_i   = Σ_j e_ij                    its per-row sums of the rounded values; Σ_i = exp(lse_i − zy_i) >= e_iy = 1
  f_i   = 1 + 2·z_loss·lse_i          the z-loss's factor on the softmax
  buf   = e, with buf[i, y_i] = e_iy − Σ_i / f_i        one element per row, in place
  dlogits_ij = g_i·(f_i·p_ij − [j = y_i]) = (g_i·f_i / Σ_i) · buf_ij       p = e / Σ

so GEMM 2 scales its output rows by row_scale = g·f / Σ and GEMM 3 its h_c rows. Σ_i = exp(loss_i) (without the
z-loss term) never underflows (the label's own term is 1) and overflows only where a row's loss is huge: where some
counted row has Σ_i outside [0.5, e^40] (a loss above 40 nats; also NaN, or a z-loss factor below 0.5), e and the
row scales leave the range where bf16 and float32 keep their precision, and the chunk takes ``fallback``, the
row-kernel path (logits written over buf, then dlogits over them), in the same buffer, under a ``lax.cond``. Rows
with weight 0 (ignored) get the float32 maximum as their shift: e = 0, never inf.

bf16 only: float16 keeps 5 exponent bits, and the e of a vocabulary entry 17 nats below the label's flushes to 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.cross_entropy import mosaic_logits

__all__ = ["MAX_LOG_SUMEXP", "label_logits", "scaled_dlogits", "unsupported_reason"]

_F32 = jnp.float32
# The fast path's bound on log Σ_i = lse_i − zy_i (a row's loss without z-loss), nats: e and Σ stay below e^40
# (GEMM 2's float32 sums of e·w far from overflow) and the row scale g·f / Σ above e^-40 · g (float32 and bf16 keep
# it normal for any weight g >= 1e-17).
MAX_LOG_SUMEXP = 40.0


def unsupported_reason(dtype) -> str | None:
    """None when chunks of this dtype can take the epilogue's softmax; else the sentence why not."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return (f"the epilogue's softmax stores exp(z − zy) in bfloat16 only, got {jnp.dtype(dtype).name} "
                "(float16 flushes entries 17 nats below the label's to 0)")
    return None


def label_logits(h_c: jax.Array, w: jax.Array, column: jax.Array) -> jax.Array:
    """(Bc,) float32: h_c[i] · w[:, column[i]], float32 products of w's gathered label columns."""
    return jnp.einsum("bh,hb->b", h_c.astype(_F32), jnp.take(w, column, axis=1).astype(_F32),
                      precision=lax.Precision.HIGHEST)


def scaled_dlogits(h_c: jax.Array, w: jax.Array, labels_c: jax.Array, g_c: jax.Array, *, z_loss: float,
                   fallback: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]]):
    """(buf (Bc, V) in h_c's dtype, row_scale (Bc,), lse (Bc,), zy (Bc,)), float32 vectors, with dlogits_c =
    row_scale[:, None]·buf and the row loss lse − zy (+ z_loss·lse²); lse is 0 on rows of weight 0.

    h_c (Bc, H) and w (H, V) bf16; labels_c (Bc,) int32 (outside [0, V): an ignored or bad row, its weight 0 or
    NaN); g_c (Bc,) float32 row weights. ``fallback(buf) -> (dlogits, lse, zy)`` writes the chunk's dlogits over
    buf the row-kernel way (row scale 1); it runs only where some counted row leaves the fast path's range."""
    V = w.shape[1]
    rows = jnp.arange(labels_c.shape[0])
    in_range = (labels_c >= 0) & (labels_c < V)
    counted = (g_c != 0) & in_range  # a NaN weight counts (bad labels are out of range: NaN scales them below)
    column = jnp.clip(labels_c, 0, V - 1)
    zy = jnp.where(in_range, label_logits(h_c, w, column), 0.0)
    offset = jnp.where(counted, zy, jnp.finfo(_F32).max)
    e, sumexp = mosaic_logits.probabilities(h_c, w, offset)
    lse = jnp.where(counted, offset + jnp.log(sumexp), 0.0)
    factor = 1.0 + 2.0 * z_loss * lse if z_loss else jnp.ones_like(lse)
    fits = (sumexp >= 0.5) & (sumexp <= math.exp(MAX_LOG_SUMEXP)) & (factor >= 0.5)
    fast = jnp.all(fits | ~counted)

    def fast_path(buf):
        label_e = buf[rows, column].astype(_F32)
        fixed = jnp.where(counted, label_e - sumexp / factor, label_e).astype(buf.dtype)
        buf = buf.at[rows, column].set(fixed, unique_indices=True)
        row_scale = jnp.where(g_c == 0, 0.0, g_c * factor / jnp.where(counted, sumexp, 1.0))
        return buf, row_scale, lse, zy

    def fallback_path(buf):
        dl, lse_rows, zy_rows = fallback(buf)
        return dl, jnp.ones_like(lse), lse_rows, zy_rows

    return lax.cond(fast, fast_path, fallback_path, e)
