"""The Triton backend of rmsnorm_matmul: RMSNorm fused into the following matmul (read-side fusion), forward
(``triton_fwd``) and backward (``triton_bwd``) Pallas kernels wired into one custom VJP.

``rmsnorm_matmul(x, gamma, w, ...)`` computes ``rmsnorm(x) · gamma @ w`` without ever writing the normalized (M, K)
activations to HBM. Notation: x (M, K) after flattening the leading axes, w (K, N), r = rsqrt(mean(x², K) + eps)
per row, n = x · r, y = (n · gamma) @ w.

Forward, one kernel. A program owns a (block_m, block_n) tile of y and streams K in block_k slices. Each x slice is
loaded once and used twice: its squares are summed into a float32 row accumulator (the RMS statistic, so no
separate statistics pass reads x), and, scaled by gamma in registers and cast to the MMA dtype, it is the A operand
of the dot (``gamma_on_w``: gamma is folded into a scaled copy of w instead, and without a residual r then comes
from one XLA row reduction over x, so that the raw x tile feeds only the dot). Because r is one scalar per row,
(x · r · gamma) @ w = r ⊙ ((x · gamma) @ w): r multiplies the float32 accumulator in the epilogue, where it is
finally known. With ``residual``, the A tile is h = x + residual (rounded
to x.dtype) and the programs of the first column block also store h. The kernel writes y, h and r (M float32).

Backward, two kernels plus two tiny XLA reductions, recomputing n tile by tile instead of storing it:
  c  = Σ_N(dy · y) / K  per row            (XLA fusion, or inside the dx kernel with ``rowdot_in_dx``)
  dx = r · gamma · (dy @ wᵀ) − r² · c · x   (+ the cotangent of h)   dx kernel: (block_m_dx, block_k_dx) tiles,
                                                                     N streamed; the epilogue also writes per-row-
                                                                     block partial sums of dgamma
  dgamma = Σ_M (dy @ wᵀ) · x · r            (XLA sums the (M / block_m_dx, K) float32 partials; with one
                                            row block the dx kernel writes dgamma itself)
  dw = gamma ⊙ ((x · r)ᵀ @ dy)              dw kernel: (block_k_dw, block_n_dw) tiles, M streamed; or, with
                                            ``dw_in_xla``, an XLA GEMM that recomputes x · r as its operand
With ``dw_in_dx`` (decode: every row in the dx kernel's one row block) there is no dw kernel: each dx step
writes the dw tile of the w tile it read, γ ⊙ ((x·r)ᵀ @ dy) from the dy tile it loaded, so one kernel streams w in
and dw out. 16x4096x4096 on the H200, one sweep: fwd+bwd 37.8 µs against 41.5 at best with the dw kernel; the
suite then ran 37.5 against XLA's 40.0 (rmsnorm_matmul-decode_dw_in_dx-h200-496308c.md).
The identity c = mean_K(gamma · (dy @ wᵀ) · n) = Σ_N(dy · y) / K (because y = (n · gamma) @ w) replaces a
reduction over the M×K gradient, which no kernel holds whole, by a row dot over N of two tensors we have.

Bytes to HBM (2-byte dtypes, minimum traffic, L2 reuse of re-read tiles assumed):
  forward    2MK (x) + 2KN (w) + 2MN (y) + 4M (r)         [+ 2MK residual + 2MK h with residual]
  backward   dx kernel: 2MN (dy) + 2KN (w) + 2MK (x) + 2MK (dx); dw kernel: 2MK (x) + 2MN (dy) + 2KN (dw);
             c: 4MN (dy, y) in XLA, or 2MN (y) inside the dx kernel
XLA's unfused pair moves the normalized tensor (2MK) out and back in the forward, and in the backward writes and
reads the M×K gradient of the normalized tensor plus n again.

Numerics: statistics and all accumulators in float32. The A tile is x · gamma rounded once to the MMA dtype
(x.dtype); in bfloat16, which has float32's exponent range, that rounding is as precise as the normalized tile's.
float16's normal range ends at 6.1e-5, so for float16 the A tile is x · gamma · c, c a power of two per row from
the row's sum of squares so far (|x · c| <= 2 whatever x's magnitude), the accumulator's row rescaled by the same
exact power of two when c drops and r / c applied in the epilogue: fp16 x near 1e-6 or 1e-7 gives y as accurate as
the unfused fp16 computation (interpret mode, 37x256x64: relative error 3.3e-4 at both, unfused 3.6e-4 / 3.7e-4;
rounding x · gamma unscaled gave 1.7e-2 / 1.1e-1). With ``gamma_on_w`` the A operand is x (or h) itself and
|gamma · w| must fit float16 (65504); otherwise |gamma| must stay below 32752.

Reached through ``pallas_kernels.rmsnorm_matmul(..., backend="triton")``, which validates the inputs, flattens the
leading axes and resolves the config; the backend-module contract is in ``pallas_kernels.backends``.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import triton_utils
from pallas_kernels.norm_matmul import config as _config
from pallas_kernels.norm_matmul.triton_bwd import backward
from pallas_kernels.norm_matmul.triton_fwd import Static, forward

__all__ = ["Config", "FORWARD_FIELDS", "check_config", "default_config", "rmsnorm_matmul", "sweep_candidates",
           "unsupported_reason"]

Config = _config.RMSNormMatmulConfig
FORWARD_FIELDS = _config.FORWARD_FIELDS


def default_config(x, gamma, w, *, residual, interpret: bool, **_) -> Config:
    """The tuned or built-in config for x (M, K) and w (K, N) (``config.default_config``)."""
    (M, K), N = x.shape, w.shape[1]
    return _config.default_config(M, K, N, x.dtype, residual=residual is not None, on_gpu=not interpret)


def unsupported_reason(x, gamma, w, **_) -> str | None:
    """None: the Triton kernels take every input the public function accepts."""
    return None


def sweep_candidates(x, gamma, w, **_) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidates for x (M, K) and w (K, N) (``config.sweep_candidates``)."""
    return _config.sweep_candidates(x.shape[0], x.shape[1], w.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rmsnorm_matmul(x, residual, gamma, w, static: Static):
    y, _, h = forward(x, residual, gamma, w, static=static)
    return y if residual is None else (h, y)


def _rmsnorm_matmul_fwd(x, residual, gamma, w, static: Static):
    y, rstd, h = forward(x, residual, gamma, w, static=static)
    normed_input = x if residual is None else h
    return (y if residual is None else (h, y)), (normed_input, gamma, w, rstd, y)


def _rmsnorm_matmul_bwd(static: Static, saved, cotangent):
    normed_input, gamma, w, rstd, y = saved
    has_residual = isinstance(cotangent, tuple)  # (dh, dy) when the primal returned (h, y)
    dh, dy = cotangent if has_residual else (None, cotangent)
    dx, dgamma, dw = backward(normed_input, gamma, w, rstd, y, dy, dh, static=static)
    return dx, (dx if has_residual else None), dgamma, dw


_rmsnorm_matmul.defvjp(_rmsnorm_matmul_fwd, _rmsnorm_matmul_bwd)


def check_config(config: Config, x, gamma, w, **_) -> None:
    """ValueError naming the block of ``config`` that does not divide K or N."""
    config.check_shape(x.shape[1], w.shape[1], x.shape[0])


def rmsnorm_matmul(x, gamma, w, *, eps: float, residual, out_dtype, interpret: bool, config: Config):
    """x (M, K), gamma (K,), w (K, N), residual (M, K) or None, validated -> y (M, N) in out_dtype, or (h, y)."""
    check_config(config, x, gamma, w)
    static = Static(config=config, eps=eps, out_dtype=out_dtype, interpret=interpret)
    with triton_utils.quiet_triton_deprecation():
        return _rmsnorm_matmul(x, residual, gamma, w, static)
