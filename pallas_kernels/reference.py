"""Plain float32-accumulating JAX references for every Pallas kernel in this package.

Each function upcasts its inputs with ``jnp.promote_types(x.dtype, jnp.float32)``, computes with
``Precision.HIGHEST`` matmuls (so float32 really is float32 on GPUs that would otherwise use TF32) and casts the
result back to the input dtype. They are what the tests and benchmarks compare against, and they are also the
``"xla"`` implementation of the model's sites: they materialize every intermediate ((T, S) scores, (B, V) logits,
the normalized activations) exactly where the Pallas kernels do not.

Shape notation: B batch, T query length, S key/value length, N query heads, K key/value heads, H head dim,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "attention",
    "attention_mask",
    "linear_cross_entropy",
    "normalize_segment_ids",
    "rmsnorm",
    "rmsnorm_matmul",
]

_HIGHEST = lax.Precision.HIGHEST


def _f32(x: jax.Array) -> jax.Array:
    """Upcast to at least float32 (float64 stays float64)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# ---------------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------------
def normalize_segment_ids(
    segment_ids: jax.Array | Sequence[jax.Array] | None, batch: int, q_len: int, kv_len: int
) -> tuple[jax.Array, jax.Array] | None:
    """Returns ``(q_segment_ids (B, T), kv_segment_ids (B, S))`` as int32, or None.

    ``segment_ids`` is either one (B, T) integer array, allowed only when T == S (self-attention over packed
    sequences: the same ids describe queries and keys), or a pair ``(q_segment_ids (B, T), kv_segment_ids (B, S))``.
    Raises ``ValueError`` naming ``segment_ids`` for any other shape.
    """
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids: expected one (B, T) array or a pair (q_segment_ids (B, T), kv_segment_ids (B, S)), "
                f"got a sequence of length {len(segment_ids)}"
            )
        q_seg, kv_seg = segment_ids
    else:
        q_seg = kv_seg = segment_ids
        if q_len != kv_len:
            raise ValueError(
                f"segment_ids: a single array is allowed only when T == S; got T={q_len}, S={kv_len}. "
                f"Pass a pair (q_segment_ids (B, {q_len}), kv_segment_ids (B, {kv_len}))"
            )
    for name, ids, length in (("q_segment_ids", q_seg, q_len), ("kv_segment_ids", kv_seg, kv_len)):
        shape = tuple(jnp.shape(ids))
        if shape != (batch, length):
            raise ValueError(f"segment_ids: {name} must have shape (B, {'T' if name[0] == 'q' else 'S'}) = "
                             f"{(batch, length)}, got {shape}")
        if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
            raise ValueError(f"segment_ids: {name} must be an integer array, got dtype {jnp.result_type(ids)}")
    return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def attention_mask(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    segment_ids=None,
    kv_seq_lengths: jax.Array | None = None,
) -> jax.Array:
    """The (B, T, S) boolean visibility mask: True where query t may attend to key s.

    causal: s <= t (top-left aligned, exactly as ``jax.nn.dot_product_attention(is_causal=True)`` builds it with
    ``tril(ones((T, S)))``, also when T != S). segment_ids: same segment. kv_seq_lengths (B,): s < length[b].
    """
    mask = jnp.ones((batch, q_len, kv_len), dtype=bool)
    t = jnp.arange(q_len)[:, None]
    s = jnp.arange(kv_len)[None, :]
    if causal:
        mask = mask & (s <= t)[None]
    seg = normalize_segment_ids(segment_ids, batch, q_len, kv_len)
    if seg is not None:
        q_seg, kv_seg = seg
        mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
    if kv_seq_lengths is not None:
        lengths = jnp.asarray(kv_seq_lengths).reshape(batch)
        mask = mask & (s[None] < lengths[:, None, None])
    return mask


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    segment_ids=None,
    kv_seq_lengths: jax.Array | None = None,
) -> jax.Array:
    """softmax(q kᵀ · scale) v in float32, materializing the (B, N, T, S) scores.

    Args:
      q: (B, T, N, H) queries.
      k, v: (B, S, K, H) keys and values; N % K == 0 (query head n reads kv head n // (N // K)).
      causal: key s visible to query t iff s <= t (top-left aligned, as ``jax.nn.dot_product_attention``).
      scale: logit scale; default 1/sqrt(H).
      segment_ids: one (B, T) int array when T == S, or a pair (q_segment_ids (B, T), kv_segment_ids (B, S));
        a query sees only keys of its own segment.
      kv_seq_lengths: (B,) int; keys at positions >= kv_seq_lengths[b] are masked.

    Returns:
      (B, T, N, H) in q.dtype. A query row with no visible key returns zeros (``jax.nn.dot_product_attention``
      instead returns the mean of V there), and its gradients are zero.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    scale = H**-0.5 if scale is None else scale
    mask = attention_mask(B, T, S, causal=causal, segment_ids=segment_ids, kv_seq_lengths=kv_seq_lengths)

    qf = _f32(q).reshape(B, T, K, G, H)  # (B, T, K, G, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qf, _f32(k), precision=_HIGHEST) * scale
    visible = mask[:, None, None]  # (B, 1, 1, T, S)
    scores = jnp.where(visible, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.where(visible, jnp.exp(scores - row_max), 0.0)  # unnormalized probabilities; 0 where masked
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)  # rows with no visible key stay all-zero
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, _f32(v), precision=_HIGHEST)
    return out.reshape(B, T, N, H).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm and RMSNorm -> matmul
# ---------------------------------------------------------------------------------------------------------------
def _rmsnorm_f32(x: jax.Array, gamma: jax.Array, eps: float) -> jax.Array:
    xf = _f32(x)
    inv_rms = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf * inv_rms * _f32(gamma)


def rmsnorm(x: jax.Array, gamma: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(mean(x², -1) + eps) * gamma. x (..., K), gamma (K,); returns (..., K) in x.dtype."""
    return _rmsnorm_f32(x, gamma, eps).astype(x.dtype)


def rmsnorm_matmul(
    x: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    *,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    out_dtype=None,
):
    """rmsnorm(x) @ w, with the normalized activations kept in float32 (they are never rounded).

    Args:
      x: (..., K). gamma: (K,). w: (K, N).
      residual: optional (..., K); then h = x + residual is formed first (rounded to x.dtype, as it would be
        stored for the next layer) and the norm is taken of h.
      out_dtype: dtype of y; default x.dtype.

    Returns:
      y (..., N) in out_dtype, or (h, y) when residual is given, h (..., K) in x.dtype.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    h = None
    if residual is not None:
        h = (_f32(x) + _f32(residual)).astype(x.dtype)
        x = h
    y = jnp.einsum("...k,kn->...n", _rmsnorm_f32(x, gamma, eps), _f32(w), precision=_HIGHEST).astype(out_dtype)
    return y if h is None else (h, y)


# ---------------------------------------------------------------------------------------------------------------
# Linear cross-entropy
# ---------------------------------------------------------------------------------------------------------------
def linear_cross_entropy(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    z_loss: float = 0.0,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """Cross-entropy of softmax(h @ w) against integer labels, materializing the (B, V) float32 logits.

    Args:
      h: (B, H) hidden states. w: (H, V) LM-head weight. labels: (B,) int in [0, V), or ignore_index.
      reduction: "mean" (over non-ignored rows), "sum", or "none" (per-row (B,) losses, 0 for ignored rows).
      z_loss: adds z_loss * lse² per row (lse = logsumexp of the row's logits).
      logit_soft_cap: if given, logits become cap * tanh(logits / cap) before the lse.

    Returns:
      float32 (at least) loss: a scalar, or (B,) for reduction="none". The loss is kept in float32 even for
      bf16 inputs (a rounded scalar loss helps nobody). Ignored rows add nothing and are not counted in the
      mean; if every row is ignored the mean is 0, not NaN.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
    logits = jnp.einsum("bh,hv->bv", _f32(h), _f32(w), precision=_HIGHEST)  # (B, V)
    if logit_soft_cap is not None:
        logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
    lse = jax.nn.logsumexp(logits, axis=-1)  # (B,)
    valid = labels != ignore_index
    safe_labels = jnp.where(valid, labels, 0).astype(jnp.int32)
    label_logit = jnp.take_along_axis(logits, safe_labels[:, None], axis=-1)[:, 0]
    per_row = lse - label_logit
    if z_loss:
        per_row = per_row + z_loss * lse * lse
    per_row = jnp.where(valid, per_row, 0.0)
    if reduction == "none":
        return per_row
    total = jnp.sum(per_row)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(valid), 1).astype(total.dtype)
