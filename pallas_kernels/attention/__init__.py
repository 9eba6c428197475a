"""Flash attention: softmax(q kᵀ · scale) v tile by tile with an online softmax, forward and backward, never
materializing the (T, S) scores.

  o = flash_attention(q, k, v, causal=True)          # Mosaic on an sm90 GPU, else Triton (interpret mode on CPU)
  o = flash_attention(q, k, v, block_sizes={"block_q": 64})  # override part of the tuned config
  plan(q, k, v, causal=True)                                 # Plan(backend='triton', config=...) on CPU

Layout and semantics follow ``jax.nn.dot_product_attention``: q (B, T, N, H), k and v (B, S, K, H), N % K == 0
(query head n reads kv head n // (N // K)), causal masks top-left aligned (key s visible to query t iff s <= t).
Unlike ``jax.nn.dot_product_attention``, a query row with no visible key returns zeros (not the mean of V), with zero
gradients. ``pallas_kernels.reference.attention`` is the float32 jnp equivalent.

Backends (``BACKENDS``): "mosaic" (``mosaic.py``: sm90 only; a TMA warpgroup feeding two wgmma warpgroups in
ping-pong; forward 0.89-1.05x cuDNN on the H100) and "triton" (``triton.py``: any GPU, interpret mode on CPU). Both
keep in HBM q, k, v, o and, for the backward, a (B, N, T) float32 log-sum-exp and o_lo, the output's rounding error
in q.dtype (16-bit inputs; delta = rowsum(o · do) must come from the unrounded output when softmax rows
saturate); each backward recomputes the probability tiles in a dK/dV and a dQ kernel. Tune on a GPU with
``jaxfuse bench --op attention --tune``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import backends, reference
from pallas_kernels.attention.config import FlashAttentionConfig, MosaicAttentionConfig, shape_key

__all__ = ["BACKENDS", "FlashAttentionConfig", "MosaicAttentionConfig", "SUPPORTED_HEAD_DIMS", "flash_attention",
           "plan", "sweep_candidates", "tuning_key"]

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def tuning_key(q, k, v=None, *, causal: bool = False, **_) -> str:
    """The tuning-cache key of a call: dtype, power-of-two buckets of T and S, heads, head dim, causal."""
    return shape_key(q, k, causal)


# backend name -> module (the contract is in pallas_kernels.backends), in order of preference when nothing is tuned:
# Mosaic where it runs (sm90, bf16/fp16, H 64 or 128: faster than Triton at every measured shape), else Triton.
BACKENDS = backends.Registry("flash_attention", {"mosaic": "pallas_kernels.attention.mosaic",
                                                 "triton": "pallas_kernels.attention.triton"}, key=tuning_key)


def _check_inputs(q, k, v, kv_seq_lengths):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            layout = "(B, T, N, H)" if name == "q" else "(B, S, K, H)"
            raise ValueError(f"{name}: expected rank 4 {layout}, got shape {tuple(jnp.shape(x))}")
        dtype = jnp.dtype(x.dtype)
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} not supported; allowed: bfloat16, float16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: dtypes must match, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, T, N, H = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k, v: shapes must match (B, S, K, H), got k {k.shape}, v {v.shape}")
    if k.shape[0] != B:
        raise ValueError(f"k: batch {k.shape[0]} (shape {k.shape}) differs from q's batch {B} (shape {q.shape})")
    if k.shape[3] != H:
        raise ValueError(f"k: head dim {k.shape[3]} (shape {k.shape}) differs from q's head dim {H} "
                         f"(shape {q.shape})")
    if H not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim H={H} (shape {q.shape}) not supported; allowed: {SUPPORTED_HEAD_DIMS}")
    K = k.shape[2]
    if K == 0 or N % K:
        raise ValueError(f"k: kv heads K={K} (shape {k.shape}) must divide q's heads N={N} (shape {q.shape})")
    if T == 0 or k.shape[1] == 0:
        raise ValueError(f"q, k: sequence lengths must be positive, got T={T}, S={k.shape[1]}")
    if B == 0 or N == 0:
        raise ValueError(f"q: batch B={B} and heads N={N} must be positive (shape {q.shape})")
    if kv_seq_lengths is not None:
        shape = tuple(jnp.shape(kv_seq_lengths))
        if shape != (B,):
            raise ValueError(f"kv_seq_lengths: expected shape (B,) = ({B},), got {shape}")
        if not jnp.issubdtype(jnp.result_type(kv_seq_lengths), jnp.integer):
            raise ValueError(f"kv_seq_lengths: must be integers, got dtype {jnp.result_type(kv_seq_lengths)}")
        if not isinstance(kv_seq_lengths, (jax.core.Tracer, jax.ShapeDtypeStruct)):  # traced values clip to [0, S]
            lengths = np.asarray(kv_seq_lengths)
            if np.any(lengths < 0):
                raise ValueError(f"kv_seq_lengths: must be >= 0 (lengths above S count as S), got {lengths.tolist()}")


def _prepare(q, k, v, causal, scale, segment_ids, kv_seq_lengths, block_sizes, interpret, backend):
    """Validates once; returns (backend module, Plan, options for the backend's flash_attention)."""
    _check_inputs(q, k, v, kv_seq_lengths)
    if scale is not None:
        try:
            scale = float(scale)
        except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
            raise ValueError(f"scale: must be None (1/sqrt(H)) or a number known when tracing, got {scale!r}") from None
    B, T, _, H = q.shape
    options = dict(
        causal=bool(causal), scale=float(H**-0.5 if scale is None else scale),
        segment_ids=reference.normalize_segment_ids(segment_ids, B, T, k.shape[1]),
        kv_seq_lengths=None if kv_seq_lengths is None else jnp.asarray(kv_seq_lengths, jnp.int32),
        interpret=backends.resolve_interpret(interpret))
    module, chosen = BACKENDS.plan(backend, block_sizes, q, k, v, **options)
    return module, chosen, options


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    segment_ids: jax.Array | Sequence[jax.Array] | None = None,
    kv_seq_lengths: jax.Array | None = None,
    block_sizes: FlashAttentionConfig | MosaicAttentionConfig | Mapping[str, int] | None = None,
    interpret: bool | None = None,
    backend: str = "auto",
) -> jax.Array:
    """softmax(q kᵀ · scale) v with an online softmax; the (T, S) scores are never written to HBM.

    Args:
      q: (B, T, N, H) queries; bfloat16, float16 or float32; H in ``SUPPORTED_HEAD_DIMS``.
      k, v: (B, S, K, H) keys and values, same dtype as q; N % K == 0 (grouped-query / multi-query attention:
        query head n reads kv head n // (N // K)). Any T and S (tails are masked).
      causal: key s visible to query t iff s <= t, top-left aligned as in ``jax.nn.dot_product_attention``.
      scale: logit scale, default 1/sqrt(H).
      segment_ids: packed sequences: one (B, T) int array when T == S, or a pair (q_segment_ids (B, T),
        kv_segment_ids (B, S)); a query sees only keys with its segment id.
      kv_seq_lengths: (B,) int >= 0 (a ValueError where the values are concrete; traced values are clipped to
        [0, S]); keys at positions >= kv_seq_lengths[b] are masked (padding): whatever they hold, NaN and inf
        included, reaches neither the output nor a gradient.
      block_sizes: the backend's config (``FlashAttentionConfig`` for Triton, ``MosaicAttentionConfig`` for
        Mosaic), or a mapping of some of its fields overriding the tuned config.
      interpret: run the kernels in Pallas interpret mode; default True exactly when the default backend is CPU.
      backend: "auto" (the fastest tuned backend that runs here; without tuned times for each, Mosaic where it
        runs, else Triton), "triton" or "mosaic"; a backend that cannot run these arguments here is a ValueError
        naming why and those that can. Mosaic runs bf16/fp16 with H 64 or 128 on an sm90 GPU; float32, H 32 and
        256, other GPUs and the CPU (interpret mode) run on Triton.

    Returns:
      (B, T, N, H) in q.dtype. Rows with no visible key are zeros (their gradients too). Differentiable in q, k, v
      through Pallas backward kernels; works under jit, grad and vmap. Accumulation is float32 throughout.
    """
    module, chosen, options = _prepare(q, k, v, causal, scale, segment_ids, kv_seq_lengths, block_sizes, interpret,
                                       backend)
    return module.flash_attention(q, k, v, **options, config=chosen.config)


def plan(q, k, v, *, causal=False, scale=None, segment_ids=None, kv_seq_lengths=None, block_sizes=None,
         interpret=None, backend="auto") -> backends.Plan:
    """The backend and config ``flash_attention`` would run with these arguments (same validation, no kernel)."""
    return _prepare(q, k, v, causal, scale, segment_ids, kv_seq_lengths, block_sizes, interpret, backend)[1]


def sweep_candidates(q, k, v, *, causal=False, scale=None, segment_ids=None, kv_seq_lengths=None,
                     backend="triton") -> tuple[list[dict], list[dict]]:
    """(forward, backward) config dicts ``jaxfuse bench --op attention --tune`` tries for these arguments on
    ``backend``, GPU tiles: forward ones vary only the backend module's FORWARD_FIELDS, backward ones the rest."""
    module, _, options = _prepare(q, k, v, causal, scale, segment_ids, kv_seq_lengths, None, False, backend)
    return module.sweep_candidates(q, k, v, **options)
