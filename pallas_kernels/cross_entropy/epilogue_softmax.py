"""One token chunk's dlogits with no pass over the logits: the softmax's exp in the logits GEMM's epilogue.

    buf, row_scale, lse, zy, next_shift, fits = scaled_dlogits(h_c, w, labels_c, g_c, shift, z_loss=0.0)
    # dlogits_c = row_scale[:, None] · buf, buf (Bc, V) in h's dtype; row_scale, lse, zy (Bc,) float32

The row kernel (``triton_rows``) reads each chunk's logits back and writes dlogits over them: 2·Bc·V·s bytes per
chunk (1.6 ms of a 21 ms loss at 4096x2048x256000 on the H100). Its exp can happen in the logits GEMM instead, with
a shift c fixed before the GEMM runs (a scalar: the mean lse of the chunk before, 0 for the first):

  e_ij  = exp(z_ij − c)               the Mosaic GEMM's epilogue (``mosaic_logits.probabilities``), rounded to bf16
  Σ_i   = Σ_j e_ij                    its per-row sums of the rounded values: lse_i = c + log Σ_i
  zy_i  = c + log e_iy                the label logit, from the stored e
  f_i   = 1 + 2·z_loss·lse_i          the z-loss's factor on the softmax
  buf   = e, with buf[i, y_i] = e_iy − Σ_i / f_i        one element per row, in place
  dlogits_ij = g_i·(f_i·p_ij − [j = y_i]) = (g_i·f_i / Σ_i) · buf_ij       p = e / Σ

so GEMM 2 scales its output rows by row_scale = g·f / Σ and GEMM 3 its h_c rows. This holds while every counted
row has |lse_i − c| <= 40 nats (e, Σ and the row scales stay where bf16 and float32 keep their precision, GEMM 2's
float32 sums of e·w far from overflow), a label entry e_iy >= e^-80 (a row loss below about 80 nats) and a z-loss
factor >= 0.5. ``fits`` says whether every counted row of the chunk did (NaN does not); where some chunk did not,
the loss (``triton._chunk_gradients``) computes everything again the row kernel's way, once per call: a check per
chunk would be a host round trip per chunk (a data-dependent loop or cond on the GPU; and XLA copies a buffer a
``lax.cond`` branch writes). Rows of weight 0 (ignored) get the float32 maximum as their shift: e = 0, never inf.

bf16 only: float16 keeps 5 exponent bits, and an e 17 nats below the shift flushes to 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.cross_entropy import mosaic_logits

__all__ = ["MAX_SHIFT_GAP", "scaled_dlogits", "unsupported_reason"]

_F32 = jnp.float32
MAX_SHIFT_GAP = 40.0  # nats: the largest |lse_i − c| the fast path takes
_MIN_LOG_LABEL_E = -80.0  # log e_iy = zy_i − c below this: the label entry leaves bf16's normal range


def unsupported_reason(dtype) -> str | None:
    """None when chunks of this dtype can take the epilogue's softmax; else the sentence why not."""
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return (f"the epilogue's softmax stores exp(z − c) in bfloat16 only, got {jnp.dtype(dtype).name} "
                "(float16 flushes entries 17 nats below the shift to 0)")
    return None


def scaled_dlogits(h_c: jax.Array, w: jax.Array, labels_c: jax.Array, g_c: jax.Array, shift: jax.Array, *,
                   z_loss: float):
    """(buf (Bc, V) in h_c's dtype, row_scale, lse, zy (Bc,) float32, next_shift (), fits () bool): dlogits_c =
    row_scale[:, None]·buf and the row loss lse − zy (+ z_loss·lse²) (lse and zy are 0 on rows of weight 0), the
    shift for the next chunk (the mean lse of the counted rows; ``shift`` where none counts), and whether every
    counted row stayed in the range where these hold (module docstring): where not, they are garbage.

    h_c (Bc, H) and w (H, V) bf16; labels_c (Bc,) int32 (outside [0, V): an ignored or bad row, its weight 0 or
    NaN); g_c (Bc,) float32 row weights; shift () float32."""
    V = w.shape[1]
    rows = jnp.arange(labels_c.shape[0])
    counted = (g_c != 0) & (labels_c >= 0) & (labels_c < V)  # bad labels (weight NaN) are out of range
    column = jnp.clip(labels_c, 0, V - 1)
    buf, sumexp = mosaic_logits.probabilities(h_c, w, jnp.where(counted, shift, jnp.finfo(_F32).max))
    label_e = buf[rows, column].astype(_F32)
    log_sum = jnp.log(sumexp)
    lse = jnp.where(counted, shift + log_sum, 0.0)
    factor = 1.0 + 2.0 * z_loss * lse if z_loss else jnp.ones_like(lse)
    fits = (jnp.abs(log_sum) <= MAX_SHIFT_GAP) & (jnp.log(label_e) >= _MIN_LOG_LABEL_E) & (factor >= 0.5)
    fixed = jnp.where(counted, label_e - sumexp / factor, label_e).astype(buf.dtype)
    buf = buf.at[rows, column].set(fixed, unique_indices=True)
    row_scale = jnp.where(g_c == 0, 0.0, g_c * factor / jnp.where(counted, sumexp, 1.0))
    zy = jnp.where(counted, shift + jnp.log(label_e), 0.0)
    count = jnp.sum(counted)
    next_shift = jnp.where(count > 0, jnp.sum(jnp.where(counted, lse, 0.0)) / jnp.maximum(count, 1), shift)
    return buf, row_scale, lse, zy, next_shift, jnp.all(fits | ~counted)
