"""Fused linear cross-entropy: the cross-entropy of softmax(h @ w) against integer labels, forward and backward,
never writing the (B, V) logits to HBM.

  loss = linear_cross_entropy(h, w, labels)                          # mean over non-ignored rows, float32
  rows = linear_cross_entropy(h, w, labels, reduction="none")        # (B,)
  loss = linear_cross_entropy(h, w, labels, block_sizes={"chunk_rows": 512})   # override part of the config
  plan(h, w, labels)                                                 # Plan(backend='triton', config=...)

Backends (``BACKENDS``): "triton" (``triton.py``: token chunks, per chunk a cuBLAS logits GEMM and one Pallas-Triton
row kernel for the log-sum-exp and dlogits, the gradients computed in the forward when they are wanted). A backend
module's ``linear_cross_entropy`` takes ``reduction`` and returns the loss as this function does (the reduction
belongs inside its custom VJP: mean and sum fold 1/count into dlogits). Tune on a GPU with ``jaxfuse bench --op
cross_entropy --tune``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import backends
from pallas_kernels.cross_entropy.config import LinearCrossEntropyConfig, shape_key

__all__ = ["BACKENDS", "LinearCrossEntropyConfig", "linear_cross_entropy", "plan", "sweep_candidates",
           "tuning_key"]

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_REDUCTIONS = ("mean", "sum", "none")


def tuning_key(h, w, labels=None, **_) -> str:
    """The tuning-cache key of a call: dtype, B, H, V."""
    return shape_key(h, w)


# backend name -> module (contract: pallas_kernels.backends); add "mosaic": "pallas_kernels.cross_entropy.mosaic"
BACKENDS = backends.Registry("linear_cross_entropy", {"triton": "pallas_kernels.cross_entropy.triton"},
                             key=tuning_key)


def _check_inputs(h, w, labels, reduction, z_loss, logit_soft_cap):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    if jnp.ndim(h) != 2:
        raise ValueError(f"h: expected rank 2 (B, H), got shape {tuple(jnp.shape(h))}")
    if jnp.ndim(w) != 2:
        raise ValueError(f"w: expected rank 2 (H, V), got shape {tuple(jnp.shape(w))}")
    for name, x in (("h", h), ("w", w)):
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype {x.dtype} not supported; allowed: bfloat16, float16, float32")
    if h.dtype != w.dtype:
        raise ValueError(f"h, w: dtypes must match, got h {h.dtype}, w {w.dtype}")
    B, H = h.shape
    if w.shape[0] != H:
        raise ValueError(f"w: first dim {w.shape[0]} (shape {w.shape}) must equal h's hidden size H={H} "
                         f"(shape {h.shape})")
    if B == 0 or H == 0 or w.shape[1] == 0:
        raise ValueError(f"h, w: B, H and V must be positive, got h {h.shape}, w {w.shape}")
    if tuple(jnp.shape(labels)) != (B,):
        raise ValueError(f"labels: expected shape (B,) = ({B},), got {tuple(jnp.shape(labels))}")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise ValueError(f"labels: must be integers, got dtype {jnp.result_type(labels)}")
    if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not z_loss >= 0.0:
        raise ValueError(f"z_loss: must be a non-negative Python float, got {z_loss!r}")
    if logit_soft_cap is not None and (isinstance(logit_soft_cap, bool) or
                                       not isinstance(logit_soft_cap, (int, float)) or not logit_soft_cap > 0.0):
        raise ValueError(f"logit_soft_cap: must be None or a positive Python float, got {logit_soft_cap!r}")


def _check_label_range(labels, V: int, ignore_index: int):
    """ValueError for concrete labels outside [0, V) other than ignore_index; traced labels pass (their rows give
    NaN losses and gradients instead), and so do abstract ones (``plan`` with ShapeDtypeStructs)."""
    if isinstance(labels, jax.ShapeDtypeStruct):
        return
    try:
        values = np.asarray(labels)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    bad = (values != ignore_index) & ((values < 0) | (values >= V))
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(f"labels: must lie in [0, V={V}) or equal ignore_index={ignore_index}; "
                         f"{rows.size} rows do not, e.g. labels[{rows[0]}] = {values[rows[0]]}")


def _prepare(h, w, labels, reduction, ignore_index, z_loss, logit_soft_cap, block_sizes, interpret, backend):
    """Validates once; returns (backend module, Plan, labels as int32, options for the backend)."""
    _check_inputs(h, w, labels, reduction, z_loss, logit_soft_cap)
    try:
        ignore_index = operator.index(ignore_index)
    except TypeError:
        raise ValueError(f"ignore_index: must be an integer, got {ignore_index!r}") from None
    _check_label_range(labels, w.shape[1], ignore_index)
    labels = backends.shaped(labels, dtype=jnp.int32)
    options = dict(reduction=reduction, ignore_index=int(ignore_index), z_loss=float(z_loss),
                   logit_soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
                   interpret=backends.resolve_interpret(interpret))
    module, chosen = BACKENDS.plan(backend, block_sizes, h, w, labels, **options)
    return module, chosen, labels, options


def linear_cross_entropy(
    h: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    z_loss: float = 0.0,
    logit_soft_cap: float | None = None,
    block_sizes: LinearCrossEntropyConfig | Mapping[str, int] | None = None,
    interpret: bool | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Cross-entropy of softmax(h @ w) against integer labels; the (B, V) logits are never written to HBM.

    Args:
      h: (B, H) hidden states; bfloat16, float16 or float32. Any B.
      w: (H, V) LM-head weight, same dtype as h. Any V (tails are masked).
      labels: (B,) integers in [0, V), or ignore_index.
      reduction: "mean" (over non-ignored rows; 0 if every row is ignored), "sum", or "none" ((B,) per-row losses,
        0 for ignored rows).
      ignore_index: rows with this label add nothing to the loss or the gradients and are not counted in the mean.
      z_loss: adds z_loss · lse² per row (lse: log-sum-exp of the row's logits after soft-capping).
      logit_soft_cap: if given, logits become cap · tanh(logits / cap) before the softmax.
      block_sizes: the backend's config (``LinearCrossEntropyConfig`` for Triton), or a mapping of some of its
        fields overriding the default.
      interpret: run the kernels in Pallas interpret mode; default True exactly when the default backend is CPU.
      backend: "auto" (the fastest tuned backend that runs here; Triton when nothing is tuned), "triton" or
        "mosaic"; a backend that cannot run here is a ValueError naming those that can.

    Returns:
      float32 loss: a scalar, or (B,) for reduction="none". Differentiable in h and w (custom VJP; GEMMs
      accumulate in float32, and on the Triton backend a 16-bit dw accumulates across token chunks in its own
      dtype unless ``dw_dtype="float32"``). Under ``jax.grad`` of a mean or sum the gradients are computed with
      the loss, and an input that is not differentiated (a frozen w) costs no GEMM. Labels outside [0, V) other
      than ignore_index raise ValueError when the labels are concrete; under jit (traced labels) such a row's loss
      is NaN and so are the gradients (dh of that row and all of dw), so a bad label can never pass as a plausible
      loss.
    """
    module, chosen, labels, options = _prepare(h, w, labels, reduction, ignore_index, z_loss, logit_soft_cap,
                                               block_sizes, interpret, backend)
    return module.linear_cross_entropy(h, w, labels, **options, config=chosen.config)


def plan(h, w, labels, *, reduction="mean", ignore_index=-100, z_loss=0.0, logit_soft_cap=None, block_sizes=None,
         interpret=None, backend="auto") -> backends.Plan:
    """The backend and config ``linear_cross_entropy`` would run with these arguments (same validation, no
    kernel): a config asking for a Mosaic GEMM, the epilogue softmax or the fused chunk step where these arguments
    cannot run it raises the ValueError its differentiated call would."""
    return _prepare(h, w, labels, reduction, ignore_index, z_loss, logit_soft_cap, block_sizes, interpret,
                    backend)[1]


def sweep_candidates(h, w, labels, *, reduction="mean", ignore_index=-100, z_loss=0.0, logit_soft_cap=None,
                     backend="triton") -> tuple[list[dict], list[dict]]:
    """(forward, backward) config dicts ``jaxfuse bench --op cross_entropy --tune`` tries for these arguments on
    ``backend``, GPU tiles: forward ones vary only the backend module's FORWARD_FIELDS, backward ones the rest."""
    module, _, labels, options = _prepare(h, w, labels, reduction, ignore_index, z_loss, logit_soft_cap, None, False,
                                          backend)
    return module.sweep_candidates(h, w, labels, **options)
