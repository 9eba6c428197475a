"""RMSNorm fused into the following matmul: ``rmsnorm(x) · gamma @ w`` without ever writing the normalized
activations to HBM, forward and backward.

  y = rmsnorm_matmul(x, gamma, w)                                  # interpret mode on CPU, Triton on GPU
  h, y = rmsnorm_matmul(x, gamma, w, residual=r)                   # pre-norm block: h = x + r, y = rmsnorm(h)·γ @ w
  y = rmsnorm_matmul(x, gamma, w, block_sizes={"block_n": 128})    # override part of the tuned config
  y = rmsnorm_matmul(x, gamma, w, backend="mosaic")                # Hopper: three Mosaic-GPU GEMMs with hooks
  plan(x, gamma, w)                                                # Plan(backend=..., config=...): what "auto" runs

Backends (``BACKENDS``, in order of preference when nothing is tuned): "mosaic" (``mosaic.py``, sm90 only: GEMMs of
``pallas_kernels.gemm`` with gamma folded into w and r applied in the epilogue; 16-bit inputs, M, K and N multiples
of its tiles; and one row, bfloat16: the forward a transposed GEMV with r from x in its epilogue, ``mosaic_gemv.py``,
the backward the Triton kernels) and "triton" (``triton.py``: one forward kernel that normalizes each x tile on
load, a dx and a dw kernel that recompute the normalized tiles; every GPU, and the decode sizes of 2 to 16 rows,
where Mosaic's tiles do not apply).
"auto" takes the backend with the lower tuned time for the shape on this device where both are tuned (the H100 and
H200 caches: Mosaic at every shape of 4096 rows and more both are tuned at), and otherwise the first that can run
it: Mosaic on Hopper, which was the faster at every prefill and training shape measured, untuned included (the
H200 at 16384x1024x5504 with no entry for either: Mosaic 939 µs forward + backward, Triton 1812;
rmsnorm_matmul-decode_mlp1024-h200-3667889.json; at one row, untuned, Mosaic's forward was faster than Triton's at 5
of 6 shapes, and both are tuned at the sixth, 1x4096x4096, where Triton's is: one_row_forward-h200-066ab73.json). Tune
on a GPU with ``jaxfuse bench --op rmsnorm_matmul --tune``. Untuned on an H200, a bfloat16 call without a residual
takes the 8192x4096x6144 entry's forms and tiles where they fit, its forward and dx tiles narrowed and the dw kernel's
last round split where that fills their rounds, and at 1024 rows and fewer r from XLA's pass, a deeper forward ring,
narrower or stream-K-split forward tiles where they would leave half the grid idle, and XLA's own backward where our
dx kernel's would or XLA runs the dw GEMM anyway, and at short K r from XLA's pass with ping-pong forward tiles
(K < 1024) or whole ones (K = 1024, few rounds) (``config.UNTUNED_FROM``: 0.955-1.08x XLA forward + backward at
seven shapes no entry covers, where the built-in tables ran 0.77-0.97x; at 128-1024 rows 0.83-1.14x, 0.95x or more
at 16 shapes of 19, forward alone 0.80-1.40x), else the built-in tables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from pallas_kernels import backends
from pallas_kernels.norm_matmul.config import MosaicRMSNormMatmulConfig, RMSNormMatmulConfig, shape_key

__all__ = ["BACKENDS", "MosaicRMSNormMatmulConfig", "RMSNormMatmulConfig", "plan", "rmsnorm_matmul",
           "sweep_candidates", "tuning_key"]

_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def tuning_key(x, gamma, w, *, residual=None, **_) -> str:
    """The tuning-cache key of a call: dtype, rows rounded up to a power of two, K, N, and whether a residual is
    added."""
    return shape_key(math.prod(x.shape[:-1]), x.shape[-1], w.shape[1], x.dtype, residual=residual is not None)


# backend name -> module (contract: pallas_kernels.backends), in order of preference when nothing is tuned
BACKENDS = backends.Registry("rmsnorm_matmul", {"mosaic": "pallas_kernels.norm_matmul.mosaic",
                                                "triton": "pallas_kernels.norm_matmul.triton"}, key=tuning_key)


def _check_eps(eps) -> float:
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise ValueError(f"eps: expected a number >= 0, got {eps!r}") from None
    if not value >= 0:  # also NaN
        raise ValueError(f"eps: must be >= 0 (it is added to mean(x²) under the rsqrt), got {eps!r}")
    return value


def _check_inputs(x, gamma, w, residual, out_dtype):
    for name, a in (("x", x), ("gamma", gamma), ("w", w)):
        dtype = jnp.dtype(a.dtype)
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} not supported; allowed: bfloat16, float16, float32")
    if jnp.ndim(x) < 1:
        raise ValueError("x: expected shape (..., K), got a scalar")
    K = x.shape[-1]
    if jnp.ndim(w) != 2:
        raise ValueError(f"w: expected rank 2 (K, N), got shape {tuple(jnp.shape(w))}")
    if w.shape[0] != K:
        raise ValueError(f"w: first dim {w.shape[0]} (shape {tuple(w.shape)}) must equal x's last dim K={K} "
                         f"(shape {tuple(x.shape)})")
    if tuple(jnp.shape(gamma)) != (K,):
        raise ValueError(f"gamma: expected shape (K,) = ({K},), got {tuple(jnp.shape(gamma))}")
    if K == 0 or K % 16:
        raise ValueError(f"x: K={K} (shape {tuple(x.shape)}) must be a positive multiple of 16")
    N = w.shape[1]
    if N == 0 or N % 16:
        raise ValueError(f"w: N={N} (shape {tuple(w.shape)}) must be a positive multiple of 16")
    if math.prod(x.shape[:-1]) == 0:
        raise ValueError(f"x: needs at least one row, got shape {tuple(x.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"w: dtype {w.dtype} must match x's dtype {x.dtype} (the MMA operand dtype)")
    if residual is not None:
        if tuple(jnp.shape(residual)) != tuple(x.shape):
            raise ValueError(f"residual: shape {tuple(jnp.shape(residual))} must equal x's shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual: dtype {residual.dtype} must match x's dtype {x.dtype}")
    if out_dtype is not None and jnp.dtype(out_dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype: {jnp.dtype(out_dtype)} not supported; allowed: bfloat16, float16, float32")


def _prepare(x, gamma, w, eps, residual, out_dtype, block_sizes, interpret, backend):
    """Validates once; returns (backend module, Plan, x and residual as (M, K), options for the backend)."""
    _check_inputs(x, gamma, w, residual, out_dtype)
    eps = _check_eps(eps)
    M, K = math.prod(x.shape[:-1]), x.shape[-1]
    x2 = backends.shaped(x, (M, K))
    options = dict(eps=eps, residual=None if residual is None else backends.shaped(residual, (M, K)),
                   out_dtype=jnp.dtype(x.dtype if out_dtype is None else out_dtype),
                   interpret=backends.resolve_interpret(interpret))
    module, chosen = BACKENDS.plan(backend, block_sizes, x2, gamma, w, **options)
    return module, chosen, x2, options


def rmsnorm_matmul(
    x: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    *,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    out_dtype=None,
    block_sizes: RMSNormMatmulConfig | Mapping | None = None,
    interpret: bool | None = None,
    backend: str = "auto",
):
    """rmsnorm(x) · gamma @ w in one kernel; the normalized activations never reach HBM.

    Args:
      x: (..., K) activations; bfloat16, float16 or float32. Any number of rows M = prod(...) (tails masked);
        K a multiple of 16.
      gamma: (K,) RMSNorm scale; any of those dtypes.
      w: (K, N) weight in x's dtype; N a multiple of 16. Concatenated weights work as they are: [Wq|Wk|Wv] for
        a fused QKV projection, [Wg|Wu] for the SwiGLU gate/up projection.
      eps: added to mean(x²) before the rsqrt; >= 0 (a negative or NaN eps is a ValueError).
      residual: optional (..., K) in x's dtype: h = x + residual (rounded to x.dtype) is formed on load, written
        once, and normalized: the pre-norm transformer pattern.
      out_dtype: dtype of y; default x.dtype.
      block_sizes: the backend's config (``RMSNormMatmulConfig`` for Triton, ``MosaicRMSNormMatmulConfig`` for
        Mosaic), or a mapping of some of its fields overriding the tuned config.
      interpret: Pallas interpret mode; default True exactly when the default backend is CPU.
      backend: "auto" (the fastest tuned backend that runs these arguments here; where not both are tuned, Mosaic
        if it runs them, else Triton), "triton" or "mosaic"; a backend that cannot run them here is a ValueError
        naming why and what can.

    Returns:
      y (..., N), or (h (..., K), y) when residual is given. Differentiable in x, gamma, w (and residual) through
      Pallas backward kernels (custom VJP) that recompute the normalized tiles; float32 statistics and
      accumulation throughout. Same semantics as ``pallas_kernels.reference.rmsnorm_matmul``.
    """
    module, chosen, x2, options = _prepare(x, gamma, w, eps, residual, out_dtype, block_sizes, interpret, backend)
    out = module.rmsnorm_matmul(x2, gamma, w, **options, config=chosen.config)
    lead, K, N = x.shape[:-1], x.shape[-1], w.shape[1]
    if residual is None:
        return out.reshape(*lead, N)
    h, y = out
    return h.reshape(*lead, K), y.reshape(*lead, N)


def plan(x, gamma, w, *, eps=1e-6, residual=None, out_dtype=None, block_sizes=None, interpret=None,
         backend="auto") -> backends.Plan:
    """The backend and config ``rmsnorm_matmul`` would run with these arguments (same validation, no kernel)."""
    return _prepare(x, gamma, w, eps, residual, out_dtype, block_sizes, interpret, backend)[1]


def sweep_candidates(x, gamma, w, *, eps=1e-6, residual=None, out_dtype=None,
                     backend="triton") -> tuple[list[dict], list[dict]]:
    """(forward, backward) config dicts ``jaxfuse bench --op rmsnorm_matmul --tune`` tries for these arguments on
    ``backend``, GPU tiles: forward ones vary only the backend module's FORWARD_FIELDS, backward ones the rest."""
    module, _, x2, options = _prepare(x, gamma, w, eps, residual, out_dtype, None, False, backend)
    return module.sweep_candidates(x2, gamma, w, **options)
