"""RMSNorm fused into the following matmul (read-side fusion), forward and backward, in Pallas (Triton lowering).

``rmsnorm_matmul(x, gamma, w)`` computes ``rmsnorm(x) · gamma @ w`` without ever writing the normalized (M, K)
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
The identity c = mean_K(gamma · (dy @ wᵀ) · n) = Σ_N(dy · y) / K (because y = (n · gamma) @ w) replaces a
reduction over the M×K gradient, which no kernel holds whole, by a row dot over N of two tensors we have.

Bytes to HBM (2-byte dtypes, minimum traffic, L2 reuse of re-read tiles assumed):
  forward    2MK (x) + 2KN (w) + 2MN (y) + 4M (r)         [+ 2MK residual + 2MK h with residual]
  backward   dx kernel: 2MN (dy) + 2KN (w) + 2MK (x) + 2MK (dx); dw kernel: 2MK (x) + 2MN (dy) + 2KN (dw);
             c: 4MN (dy, y) in XLA, or 2MN (y) inside the dx kernel
XLA's unfused pair moves the normalized tensor (2MK) out and back in the forward, and in the backward writes and
reads the M×K gradient of the normalized tensor plus n again.

Numerics: statistics and all accumulators in float32; the A tile is x · gamma rounded to the MMA dtype (x.dtype),
the same single rounding the normalized tile would get. For float16 inputs |x · gamma| must stay below 65504.

Example::

  y = rmsnorm_matmul(x, gamma, w)                                  # interpret mode on CPU, Triton on GPU
  h, y = rmsnorm_matmul(x, gamma, w, residual=r)                   # pre-norm block: h = x + r, y = rmsnorm(h)·γ @ w
  y = rmsnorm_matmul(x, gamma, w, block_sizes={"block_n": 128})    # override part of the tuned config
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels import tuning

__all__ = ["RMSNormMatmulConfig", "default_config", "rmsnorm_matmul", "shape_key", "sweep_candidates"]

_OP = "rmsnorm_matmul"
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_F32 = jnp.float32
# Rows at or below which a call counts as decode (memory-bound: one narrow row block, many column programs).
_DECODE_ROWS = 64


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RMSNormMatmulConfig:
    """Tiles and launch parameters of the three kernels (one static argument, hashable).

    Attributes:
      block_m, block_n, block_k: forward: a (block_m, block_n) tile of y per program, K streamed in block_k slices.
      num_warps, num_stages: Triton launch parameters of the forward kernel.
      gamma_on_w: forward variant: fold gamma into a scaled copy of w (one XLA pass over w, 4KN bytes) so the A
        operand is x itself; otherwise the A tile is scaled by gamma in registers. Without a residual this
        variant also takes r from one XLA row reduction over x (2MK bytes): a raw loaded tile must not feed both
        the dot and the sum of squares (Triton's pipeliner miscompiles that; see ``_forward``).
      split_k: forward programs per output tile, each streaming K / split_k of K (decode: few rows give too few
        output tiles to keep enough loads of w in flight). The split partials (split_k, M, N) float32 and their
        sums of squares are combined by one small XLA fusion. (K / split_k) must be a multiple of block_k.
      block_m_dx, block_k_dx, block_n_dx: dx kernel: a (block_m_dx, block_k_dx) tile of dx, N streamed.
      num_warps_dx, num_stages_dx: its launch parameters.
      split_n_dx: dx programs per (block_m_dx, block_k_dx) tile, each streaming N / split_n_dx of N; the float32
        partials (split_n_dx, M, K) are combined, and the dx epilogue and dgamma applied, by one XLA fusion
        (decode: few rows give too few dx tiles to keep enough loads of w in flight). Needs rowdot_in_dx=False.
      rowdot_in_dx: compute c = Σ_N(dy · y) / K inside the dx kernel (every column program of a row block redoes
        it: cheap for few rows) instead of in a separate XLA fusion.
      block_k_dw, block_n_dw, block_m_dw: dw kernel: a (block_k_dw, block_n_dw) tile of dw, M streamed.
      num_warps_dw, num_stages_dw: its launch parameters.
      rstd_on_dy: dw variant: scale the dy tile by r in registers instead of the x tile.
      dw_in_xla: compute dw = γ ⊙ ((x·r)ᵀ @ dy) with XLA (its GEMM recomputes x·r as an operand, fused or as
        one elementwise pass) instead of the Pallas dw kernel: a plain GEMM of this size is XLA's strength.
      group: program order in all kernels: groups of `group` row blocks sweep the column blocks together, so the
        tiles they share stay in L2.
    Block sizes are powers of two >= 16; the K and N blocks must divide K and N (checked per call).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    gamma_on_w: bool = False
    split_k: int = 1
    block_m_dx: int = 128
    block_k_dx: int = 128
    block_n_dx: int = 64
    num_warps_dx: int = 8
    num_stages_dx: int = 3
    split_n_dx: int = 1
    rowdot_in_dx: bool = False
    block_k_dw: int = 128
    block_n_dw: int = 128
    block_m_dw: int = 64
    num_warps_dw: int = 8
    num_stages_dw: int = 3
    rstd_on_dy: bool = False
    dw_in_xla: bool = False
    group: int = 8

    def __post_init__(self):
        tu.check_launch_fields(self)  # block_*, num_warps*, num_stages*
        for name in ("group", "split_k", "split_n_dx"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RMSNormMatmulConfig.{name}: must be an int >= 1, got {value!r}")
        for name in ("gamma_on_w", "rowdot_in_dx", "rstd_on_dy", "dw_in_xla"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RMSNormMatmulConfig.{name}: must be a bool, got {getattr(self, name)!r}")

        if self.split_n_dx > 1 and self.rowdot_in_dx:
            raise ValueError("RMSNormMatmulConfig: split_n_dx > 1 needs rowdot_in_dx=False (c comes from XLA)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_shape(self, K: int, N: int) -> None:
        """ValueError naming the field if a K or N block does not divide K or N."""
        for name in ("block_k", "block_k_dx", "block_k_dw"):
            if K % getattr(self, name):
                raise ValueError(f"block_sizes: {name}={getattr(self, name)} must divide K={K}")
        if K % (self.split_k * self.block_k):
            raise ValueError(f"block_sizes: split_k={self.split_k} times block_k={self.block_k} must divide K={K}")
        if N % (self.split_n_dx * self.block_n_dx):
            raise ValueError(f"block_sizes: split_n_dx={self.split_n_dx} times block_n_dx={self.block_n_dx} must "
                             f"divide N={N}")
        for name in ("block_n", "block_n_dx", "block_n_dw"):
            if N % getattr(self, name):
                raise ValueError(f"block_sizes: {name}={getattr(self, name)} must divide N={N}")


# Built-in starting points (H100, bf16); the JSON tuning cache overrides them per shape.
# Prefill/training: compute-bound GEMM tiles. Decode: one 16-row block and K split over 4 programs per 128-column
# tile, so that >= 128 programs stream w with enough bytes in flight (H100 sweeps of 2026-11-22: 17.8 µs vs 32.5
# for narrow 32-column tiles at 16x4096x4096, 52 vs 60 µs for 64-column ones at 1x4096x14336).
_GPU_TABLE = {
    "large": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, gamma_on_w=False,
                  block_m_dx=128, block_k_dx=128, block_n_dx=64, num_warps_dx=8, num_stages_dx=3,
                  rowdot_in_dx=False, block_k_dw=128, block_n_dw=128, block_m_dw=64, num_warps_dw=8,
                  num_stages_dw=3, rstd_on_dy=False, dw_in_xla=True, group=8),
    "decode": dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, gamma_on_w=False, split_k=4,
                   block_m_dx=16, block_k_dx=32, block_n_dx=256, num_warps_dx=4, num_stages_dx=4,
                   rowdot_in_dx=False, block_k_dw=64, block_n_dw=128, block_m_dw=16, num_warps_dw=4,
                   num_stages_dw=3, rstd_on_dy=False, group=1),
}
# CPU (interpret mode): small tiles so that tiny test shapes still cover several blocks and the grouped order.
_CPU_TABLE = dict(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1, gamma_on_w=False,
                  block_m_dx=16, block_k_dx=16, block_n_dx=16, num_warps_dx=4, num_stages_dx=1, rowdot_in_dx=False,
                  block_k_dw=16, block_n_dw=16, block_m_dw=16, num_warps_dw=4, num_stages_dw=1, rstd_on_dy=False,
                  group=2)


def shape_key(M: int, K: int, N: int, dtype, *, residual: bool = False) -> str:
    """Tuning-cache key: dtype, M rounded up to a power of two, K, N, and whether a residual is added."""
    return f"{jnp.dtype(dtype).name}[M={max(16, pl.next_power_of_2(M))},K={K},N={N}]" + ("+res" if residual else "")


def _fit_to_shape(params: Mapping, M: int, K: int, N: int) -> dict:
    """Shrinks table/cache tiles to the shape: K and N blocks to divisors (the largest power of two dividing K or
    N is >= 16 since both are multiples of 16), M blocks to M rounded up. Never applied to explicit block_sizes."""
    out = dict(params)
    k_div, n_div, m_cap = K & -K, N & -N, max(16, pl.next_power_of_2(M))
    for name in ("block_k", "block_k_dx", "block_k_dw"):
        out[name] = min(out[name], k_div)
    for name in ("block_n", "block_n_dx", "block_n_dw"):
        out[name] = min(out[name], n_div)
    for name in ("block_m", "block_m_dx", "block_m_dw"):
        out[name] = min(out[name], m_cap)
    split = out.get("split_k", 1)
    while split > 1 and K % (split * out["block_k"]):
        split //= 2
    out["split_k"] = split
    split = out.get("split_n_dx", 1)
    while split > 1 and N % (split * out["block_n_dx"]):
        split //= 2
    out["split_n_dx"] = split
    return out


def default_config(M: int, K: int, N: int, dtype=jnp.bfloat16, *, residual: bool = False,
                   on_gpu: bool | None = None) -> RMSNormMatmulConfig:
    """The config a call would use without ``block_sizes``: the tuning-cache entry for this device and shape if
    there is one, else the built-in table, fitted to the shape."""
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    params = None
    if on_gpu:
        params = tuning.lookup(_OP, shape_key(M, K, N, dtype, residual=residual))
        if params is None:
            params = _GPU_TABLE["decode" if M <= _DECODE_ROWS else "large"]
            if jnp.dtype(dtype).itemsize == 4:  # twice the bytes per tile: keep the pipelines in shared memory
                params = dict(params, block_k=min(params["block_k"], 128 if M <= _DECODE_ROWS else 32),
                              num_stages=2, num_stages_dx=2, num_stages_dw=2)
    if params is None:
        params = _CPU_TABLE
    return RMSNormMatmulConfig(**_fit_to_shape(params, M, K, N))


def sweep_candidates(M: int, K: int, N: int) -> tuple[list[dict], list[dict]]:
    """(forward candidates, backward candidates) around the table entry for a GPU sweep: forward candidates vary
    only forward fields, backward ones only dx/dw fields (each fitted to the shape, duplicates removed)."""
    decode = M <= _DECODE_ROWS
    base = dict(default_config(M, K, N, on_gpu=True).to_dict())
    fwd, bwd = [], []
    if decode:
        # (block_n, block_k, warps, stages, split_k): narrow column tiles, or wide ones with K split over programs.
        for bn, bk, warps, stages, split in [(128, 128, 4, 4, 4), (256, 128, 4, 3, 8), (128, 64, 4, 4, 4),
                                             (128, 128, 4, 3, 4), (64, 128, 4, 4, 8), (64, 64, 4, 4, 16),
                                             (256, 64, 4, 4, 8), (128, 256, 4, 3, 4), (32, 256, 4, 4, 1)]:
            fwd.append(dict(base, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split))
        # dx: (block_k_dx, block_n_dx, split_n_dx, rowdot_in_dx)
        for bk, bn, split, rowdot in [(32, 256, 1, False), (64, 256, 4, False), (128, 256, 8, False),
                                      (64, 128, 8, False), (128, 128, 16, False), (32, 256, 4, False),
                                      (32, 256, 1, True)]:
            bwd.append(dict(base, block_k_dx=bk, block_n_dx=bn, split_n_dx=split, rowdot_in_dx=rowdot))
        for bk, bn in [(32, 128), (128, 128), (64, 256)]:
            bwd.append(dict(base, block_k_dw=bk, block_n_dw=bn))
    else:
        # gamma folded into w (a plain GEMM plus the XLA statistic), and one tile with gamma applied in registers
        # (2x slower on the H100 in every sweep).
        for bm, bn, bk, warps, stages in [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 4),
                                          (128, 128, 64, 4, 4), (128, 128, 64, 8, 4)]:
            fwd.append(dict(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                            gamma_on_w=True))
        fwd.append(dict(base, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, gamma_on_w=False))
        for bm, bk, bn, warps, stages in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
                                          (64, 128, 64, 4, 4)]:
            bwd.append(dict(base, block_m_dx=bm, block_k_dx=bk, block_n_dx=bn, num_warps_dx=warps,
                            num_stages_dx=stages))
        bwd.append(dict(base, rowdot_in_dx=True))
        for bk, stages in [(128, 3), (256, 3)]:  # dw by XLA, dx by the Pallas kernel
            bwd.append(dict(base, block_k_dx=bk, num_stages_dx=stages, dw_in_xla=True))
        for bk, bn, bm, warps, stages, on_dy in [(128, 128, 64, 8, 3, False), (128, 128, 64, 8, 3, True),
                                                 (128, 256, 64, 8, 3, False), (128, 128, 32, 4, 4, False)]:
            bwd.append(dict(base, block_k_dw=bk, block_n_dw=bn, block_m_dw=bm, num_warps_dw=warps,
                            num_stages_dw=stages, rstd_on_dy=on_dy))

    def unique(cands):
        fitted = [_fit_to_shape(c, M, K, N) for c in cands]
        return list({tuple(sorted(c.items())): c for c in fitted}.values())

    return unique(fwd), unique(bwd)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call: the single non-differentiable argument of the custom VJP."""

    config: RMSNormMatmulConfig
    eps: float
    out_dtype: jnp.dtype
    interpret: bool


# ---------------------------------------------------------------------------------------------------------------
# Kernel helpers
# ---------------------------------------------------------------------------------------------------------------
def _program_tile(pid, num_rows: int, num_cols: int, group: int):
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


def _rstd_precomputed(cfg: RMSNormMatmulConfig, has_residual: bool) -> bool:
    """Whether the forward takes r from an XLA row reduction instead of summing x² in the kernel: exactly for
    gamma_on_w without a residual, where the A operand of the dot is the raw x tile (see ``_forward``). With a
    residual the A tile is h = x + residual, computed in registers, so the in-kernel statistic is safe."""
    return cfg.gamma_on_w and not has_residual


def _row_mask(start, block: int, limit: int):
    """(block,) bool of rows < limit, or None when every block is full (no masking needed anywhere)."""
    if limit % block == 0:
        return None
    return start + jnp.arange(block, dtype=jnp.int32) < limit


def _and(mask, cond):
    """mask & cond for a possibly-None (block,) mask and a scalar bool."""
    return cond if mask is None else jnp.logical_and(mask, cond)


def _col(mask):
    return None if mask is None else mask[:, None]


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel: grid (row blocks × column blocks,), K streamed.
# ---------------------------------------------------------------------------------------------------------------
def _fwd_kernel(*refs, M: int, K: int, N: int, cfg: RMSNormMatmulConfig, eps: float, has_residual: bool):
    """y tile (block_m, block_n) = r ⊙ ((x·γ) @ w), K streamed; r from the sum of squares of the same x slices.

    With ``gamma_on_w`` and no residual the A operand is the x tile exactly as loaded and r comes in precomputed
    (``rstd_in``). The kernel must not use a loaded tile both as a dot operand and as the input of other
    arithmetic (see ``_forward``).

    With ``split_k`` > 1, program (tile, s) streams the s-th of split_k K ranges and stores its float32 partial
    product (unscaled) at y[s] and its partial sum of squares at r[s]; ``_forward`` combines them."""
    it = iter(refs)
    x_ref = next(it)
    res_ref = next(it) if has_residual else None
    gamma_ref = None if cfg.gamma_on_w else next(it)
    w_ref = next(it)
    split = cfg.split_k > 1
    precomputed = _rstd_precomputed(cfg, has_residual)
    rstd_in_ref = next(it) if precomputed and not split else None
    y_ref = next(it)
    rstd_ref = None if precomputed else next(it)  # r, or the partial sums of squares when split
    h_ref = next(it) if has_residual else None

    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    pid_m, pid_n = _program_tile(pl.program_id(0), pl.cdiv(M, bm), N // bn, cfg.group)
    steps = K // bk // cfg.split_k  # K slices per program
    first_step = pl.program_id(1) * steps
    m0, n0 = pid_m * bm, pid_n * bn
    valid = _row_mask(m0, bm, M)
    first_col = pid_n == 0  # the programs that also store h and r (one per row block and K range)
    h_mask = None if h_ref is None else jnp.broadcast_to(_and(valid, first_col)[..., None], (bm, 1))

    def body(i, carry):
        acc, sum_sq = carry
        cols = pl.ds((first_step + i) * bk, bk)
        a = tu.load(x_ref, (pl.ds(m0, bm), cols), mask=_col(valid))  # (bm, bk); masked rows read 0
        if res_ref is not None:
            r_tile = tu.load(res_ref, (pl.ds(m0, bm), cols), mask=_col(valid))
            a = (a.astype(_F32) + r_tile.astype(_F32)).astype(x_ref.dtype)  # h, rounded as it is stored
            tu.store(h_ref, (pl.ds(m0, bm), cols), a, mask=h_mask)
        if precomputed:  # the raw x tile goes to the dot and nowhere else
            return acc + tu.dot(a, w_ref[cols, pl.ds(n0, bn)]), sum_sq
        a32 = a.astype(_F32)
        sum_sq = sum_sq + jnp.sum(a32 * a32, axis=1)
        if gamma_ref is not None:
            a = (a32 * gamma_ref[cols].astype(_F32)[None, :]).astype(w_ref.dtype)  # x·γ in the MMA dtype
        acc = acc + tu.dot(a, w_ref[cols, pl.ds(n0, bn)])
        return acc, sum_sq

    acc, sum_sq = lax.fori_loop(0, steps, body, (jnp.zeros((bm, bn), _F32), jnp.zeros((bm,), _F32)))
    stat_mask = jnp.broadcast_to(_and(valid, first_col), (bm,))
    if split:
        s = pl.program_id(1)
        tu.store(y_ref, (s, pl.ds(m0, bm), pl.ds(n0, bn)), acc, mask=_col(valid))
        if rstd_ref is not None:
            tu.store(rstd_ref, (s, pl.ds(m0, bm)), sum_sq, mask=stat_mask)
        return
    if rstd_in_ref is not None:
        rstd = tu.load(rstd_in_ref, (pl.ds(m0, bm),), mask=valid)  # (bm,) float32
    else:
        rstd = lax.rsqrt(sum_sq * (1.0 / K) + eps)  # (bm,) float32
    tu.store(y_ref, (pl.ds(m0, bm), pl.ds(n0, bn)), (acc * rstd[:, None]).astype(y_ref.dtype), mask=_col(valid))
    if rstd_ref is not None:
        tu.store(rstd_ref, (pl.ds(m0, bm),), rstd, mask=stat_mask)


# ---------------------------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------------------------
def _dx_kernel(*refs, M: int, K: int, N: int, cfg: RMSNormMatmulConfig, has_dh: bool):
    """dx tile (block_m_dx, block_k_dx) = r·γ·(dy @ wᵀ) − r²·c·x (+ dh); also dgamma partial sums per row block.
    With split_n_dx > 1 only dy @ wᵀ over this program's N range, stored as a float32 partial at dx[split]."""
    it = iter(refs)
    dy_ref, w_ref = next(it), next(it)
    split = cfg.split_n_dx > 1
    x_ref, gamma_ref, rstd_ref, rowdot_ref = (None,) * 4 if split else (next(it) for _ in range(4))
    dh_ref = next(it) if has_dh and not split else None
    dx_ref = next(it)
    dgamma_ref = None if split else next(it)

    bm, bk, bn = cfg.block_m_dx, cfg.block_k_dx, cfg.block_n_dx
    pid_m, pid_k = _program_tile(pl.program_id(0), pl.cdiv(M, bm), K // bk, cfg.group)
    m0, k0 = pid_m * bm, pid_k * bk
    rows = pl.ds(m0, bm)
    valid = _row_mask(m0, bm, M)
    steps = N // bn // cfg.split_n_dx  # N slices per program
    first_step = pl.program_id(1) * steps

    def body(j, carry):
        acc, row_dot = carry
        cols = pl.ds((first_step + j) * bn, bn)
        dy = tu.load(dy_ref, (rows, cols), mask=_col(valid))  # (bm, bn)
        acc = acc + tu.dot(dy, w_ref[pl.ds(k0, bk), cols], trans_b=True)  # (bm, bk)
        if cfg.rowdot_in_dx:
            y = tu.load(rowdot_ref, (rows, cols), mask=_col(valid))
            row_dot = row_dot + jnp.sum(dy.astype(_F32) * y.astype(_F32), axis=1)
        return acc, row_dot

    acc, row_dot = lax.fori_loop(0, steps, body, (jnp.zeros((bm, bk), _F32), jnp.zeros((bm,), _F32)))
    if cfg.split_n_dx > 1:  # a float32 partial of dy @ wᵀ; _backward applies the epilogue
        tu.store(dx_ref, (pl.program_id(1), rows, pl.ds(k0, bk)), acc, mask=_col(valid))
        return
    # c = Σ_N(dy · y) / K; the XLA fusion passes the row dot unscaled (a scalar multiply after a reduction
    # became a kernel of its own)
    c = (row_dot if cfg.rowdot_in_dx else tu.load(rowdot_ref, (rows,), mask=valid)) * (1.0 / K)
    r = tu.load(rstd_ref, (rows,), mask=valid)  # masked rows: r = 0, so they add nothing to dgamma
    x = tu.load(x_ref, (rows, pl.ds(k0, bk)), mask=_col(valid)).astype(_F32)
    gamma = gamma_ref[pl.ds(k0, bk)].astype(_F32)
    dx = (r[:, None] * gamma[None, :]) * acc - (r * r * c)[:, None] * x
    if dh_ref is not None:
        dx = dx + tu.load(dh_ref, (rows, pl.ds(k0, bk)), mask=_col(valid)).astype(_F32)
    tu.store(dx_ref, (rows, pl.ds(k0, bk)), dx.astype(dx_ref.dtype), mask=_col(valid))
    dgamma_ref[pl.ds(pid_m * K + k0, bk)] = jnp.sum(acc * x * r[:, None], axis=0).astype(dgamma_ref.dtype)


def _dw_kernel(x_ref, dy_ref, rstd_ref, gamma_ref, dw_ref, *, M: int, K: int, N: int, cfg: RMSNormMatmulConfig):
    """dw tile (block_k_dw, block_n_dw) = γ ⊙ Σ_M (x·r)ᵀ @ dy; the M tail is one masked step after the loop."""
    bk, bn, bm = cfg.block_k_dw, cfg.block_n_dw, cfg.block_m_dw
    pid_k, pid_n = _program_tile(pl.program_id(0), K // bk, N // bn, cfg.group)
    k0, n0 = pid_k * bk, pid_n * bn

    def step(i, acc, *, masked: bool):
        m0 = i * bm
        rows = pl.ds(m0, bm)
        valid = _row_mask(m0, bm, M) if masked else None
        x = tu.load(x_ref, (rows, pl.ds(k0, bk)), mask=_col(valid))  # (bm, bk)
        dy = tu.load(dy_ref, (rows, pl.ds(n0, bn)), mask=_col(valid))  # (bm, bn)
        r = tu.load(rstd_ref, (rows,), mask=valid)[:, None]
        if cfg.rstd_on_dy:
            dy = (dy.astype(_F32) * r).astype(dy.dtype)
        else:
            x = (x.astype(_F32) * r).astype(x.dtype)  # n = x·r in the MMA dtype
        return acc + tu.dot(x, dy, trans_a=True)  # (bk, bn)

    acc = jnp.zeros((bk, bn), _F32)
    acc = lax.fori_loop(0, M // bm, functools.partial(step, masked=False), acc) if M >= bm else acc
    if M % bm:  # a one-trip loop: its traced index keeps the (partly out-of-bounds) window dynamic
        acc = lax.fori_loop(M // bm, M // bm + 1, functools.partial(step, masked=True), acc)
    gamma = gamma_ref[pl.ds(k0, bk)].astype(_F32)
    dw_ref[pl.ds(k0, bk), pl.ds(n0, bn)] = (gamma[:, None] * acc).astype(dw_ref.dtype)


# ---------------------------------------------------------------------------------------------------------------
# pallas_call wrappers and the custom VJP
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="static")
def _forward(x, residual, gamma, w, static: _Static):
    """x, residual (M, K); gamma (K,); w (K, N) -> y (M, N) in out_dtype, r (M,) float32, h (M, K) or None."""
    M, K = x.shape
    N = w.shape[1]
    cfg = static.config
    split = cfg.split_k
    gamma32 = gamma.astype(_F32)
    inputs = [x] + ([] if residual is None else [residual])
    if cfg.gamma_on_w:  # one XLA pass over w: diag(gamma) @ w in w's dtype
        inputs.append((gamma32[:, None] * w.astype(_F32)).astype(w.dtype))
    else:
        # Split-K programs take gamma in its own dtype and widen it per slice (one convert kernel fewer: 15.5 vs
        # 16.8 µs at 16x4096x4096 on the H100); the one-pass kernel takes it widened by XLA, since widening in
        # its pipelined K loop measured 56.5 vs 41.4 µs at 1x4096x14336 (2026-11-22).
        inputs += [gamma if cfg.split_k > 1 else gamma32, w]
    rstd = None
    if _rstd_precomputed(cfg, residual is not None):
        # gamma_on_w without a residual: the A operand is the x tile exactly as loaded. Summing its squares in
        # the same loop would make one loaded tile both a dot operand and a reduction input, which Triton's
        # software pipeliner (num_stages > 1, Hopper wgmma with the operand left in shared memory) miscompiles:
        # on an H100 this variant gave 0.5 relative error in y, and through r and y in every gradient. So r
        # comes from one XLA row reduction over x (2MK more bytes read) and the kernel is a plain GEMM. Loading
        # the slice a second time for the squares does not avoid it: that variant gave 0.18-0.66 relative
        # error on the H100 (sweep of 2026-11-22).
        x32 = x.astype(_F32)
        rstd = lax.rsqrt(jnp.sum(x32 * x32, axis=1) * (1.0 / K) + static.eps)
        if split == 1:
            inputs.append(rstd)
    if split == 1:
        out_shape = [jax.ShapeDtypeStruct((M, N), static.out_dtype)]
        stat_shape = jax.ShapeDtypeStruct((M,), _F32)
    else:
        out_shape = [jax.ShapeDtypeStruct((split, M, N), _F32)]
        stat_shape = jax.ShapeDtypeStruct((split, M), _F32)
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


@functools.partial(jax.jit, static_argnames="static")
def _backward(x, gamma, w, rstd, y, dy, dh, static: _Static):
    """x: the normalized input (h with a residual) (M, K). Returns dx (M, K) in x.dtype (including dh), dgamma
    (K,) in gamma.dtype, dw (K, N) in w.dtype."""
    M, K = x.shape
    N = w.shape[1]
    cfg = static.config
    gamma32 = gamma.astype(_F32)
    if cfg.rowdot_in_dx:
        row_dot_input = y
    else:  # Σ_N(dy · y) (c = that / K): one XLA reduction fusion reading dy and y once
        row_dot_input = jnp.sum(dy.astype(_F32) * y.astype(_F32), axis=1)
    dy = dy.astype(w.dtype)  # the MMA operand dtype

    num_row_blocks = pl.cdiv(M, cfg.block_m_dx)
    kernel = functools.partial(_dx_kernel, M=M, K=K, N=N, cfg=cfg, has_dh=dh is not None)
    launch = dict(num_warps=cfg.num_warps_dx, num_stages=cfg.num_stages_dx, interpret=static.interpret,
                  grid=(num_row_blocks * (K // cfg.block_k_dx), cfg.split_n_dx), name="rmsnorm_matmul_dx")
    if cfg.split_n_dx > 1:  # partials of g = dy @ wᵀ; one XLA fusion sums them and applies the dx epilogue
        parts = tu.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((cfg.split_n_dx, M, K), _F32),
                               **launch)(dy, w)
        g = jnp.sum(parts, axis=0)  # (M, K) float32
        x32 = x.astype(_F32)
        dx = (rstd[:, None] * gamma32[None, :]) * g - (rstd * rstd * row_dot_input * (1.0 / K))[:, None] * x32
        if dh is not None:
            dx = dx + dh.astype(_F32)
        dx = dx.astype(x.dtype)
        dgamma = jnp.sum(g * x32 * rstd[:, None], axis=0).astype(gamma.dtype)
    else:
        # One row block (decode): the kernel writes dgamma itself in gamma's dtype; else float32 partial sums
        # per row block, summed by XLA.
        parts_dtype = gamma.dtype if num_row_blocks == 1 else _F32
        dx, dgamma_parts = tu.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((M, K), x.dtype),
                       jax.ShapeDtypeStruct((num_row_blocks * K,), parts_dtype)],
            **launch,
        )(dy, w, x, gamma, rstd, row_dot_input, *([dh] if dh is not None else []))
        dgamma = dgamma_parts if num_row_blocks == 1 else (
            dgamma_parts.reshape(num_row_blocks, K).sum(axis=0).astype(gamma.dtype))

    if cfg.dw_in_xla:  # n = x·r rounded to the MMA dtype, as the Pallas dw kernel rounds its tile
        n = (x.astype(_F32) * rstd[:, None]).astype(x.dtype)
        precision = lax.Precision.HIGHEST if x.dtype == _F32 else None
        dw = lax.dot_general(n, dy, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=_F32)
        return dx, dgamma, (gamma32[:, None] * dw).astype(w.dtype)
    dw = tu.pallas_call(
        functools.partial(_dw_kernel, M=M, K=K, N=N, cfg=cfg),
        num_warps=cfg.num_warps_dw, num_stages=cfg.num_stages_dw, interpret=static.interpret,
        grid=((K // cfg.block_k_dw) * (N // cfg.block_n_dw),),
        out_shape=jax.ShapeDtypeStruct((K, N), w.dtype),
        name="rmsnorm_matmul_dw",
    )(x, dy, rstd, gamma)
    return dx, dgamma, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rmsnorm_matmul(x, residual, gamma, w, static: _Static):
    y, _, h = _forward(x, residual, gamma, w, static=static)
    return y if residual is None else (h, y)


def _rmsnorm_matmul_fwd(x, residual, gamma, w, static: _Static):
    y, rstd, h = _forward(x, residual, gamma, w, static=static)
    normed_input = x if residual is None else h
    return (y if residual is None else (h, y)), (normed_input, gamma, w, rstd, y)


def _rmsnorm_matmul_bwd(static: _Static, saved, cotangent):
    normed_input, gamma, w, rstd, y = saved
    has_residual = isinstance(cotangent, tuple)  # (dh, dy) when the primal returned (h, y)
    dh, dy = cotangent if has_residual else (None, cotangent)
    dx, dgamma, dw = _backward(normed_input, gamma, w, rstd, y, dy, dh, static=static)
    return dx, (dx if has_residual else None), dgamma, dw


_rmsnorm_matmul.defvjp(_rmsnorm_matmul_fwd, _rmsnorm_matmul_bwd)


# ---------------------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------------------
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


def _resolve_config(M, K, N, dtype, residual, block_sizes, on_gpu) -> RMSNormMatmulConfig:
    if isinstance(block_sizes, RMSNormMatmulConfig):
        config = block_sizes
    else:
        config = default_config(M, K, N, dtype, residual=residual, on_gpu=on_gpu)
        if block_sizes is not None:
            if not isinstance(block_sizes, Mapping):
                raise ValueError(f"block_sizes: expected a RMSNormMatmulConfig or a mapping of its fields, "
                                 f"got {type(block_sizes).__name__}")
            fields = [f.name for f in dataclasses.fields(RMSNormMatmulConfig)]
            unknown = set(block_sizes) - set(fields)
            if unknown:
                raise ValueError(f"block_sizes: unknown fields {sorted(unknown)}; allowed: {fields}")
            config = dataclasses.replace(config, **block_sizes)
    config.check_shape(K, N)
    return config


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
):
    """rmsnorm(x) · gamma @ w in one kernel; the normalized activations never reach HBM.

    Args:
      x: (..., K) activations; bfloat16, float16 or float32. Any number of rows M = prod(...) (tails masked);
        K a multiple of 16.
      gamma: (K,) RMSNorm scale; any of those dtypes.
      w: (K, N) weight in x's dtype; N a multiple of 16. Concatenated weights work as they are: [Wq|Wk|Wv] for
        a fused QKV projection, [Wg|Wu] for the SwiGLU gate/up projection.
      eps: added to mean(x²) before the rsqrt.
      residual: optional (..., K) in x's dtype: h = x + residual (rounded to x.dtype) is formed on load, written
        once, and normalized: the pre-norm transformer pattern.
      out_dtype: dtype of y; default x.dtype.
      block_sizes: a ``RMSNormMatmulConfig``, or a mapping of some of its fields overriding the tuned config.
      interpret: Pallas interpret mode; default True exactly when the default backend is CPU.

    Returns:
      y (..., N), or (h (..., K), y) when residual is given. Differentiable in x, gamma, w (and residual) through
      Pallas backward kernels (custom VJP) that recompute the normalized tiles; float32 statistics and
      accumulation throughout. Same semantics as ``pallas_kernels.reference.rmsnorm_matmul``.
    """
    _check_inputs(x, gamma, w, residual, out_dtype)
    lead, K, N = x.shape[:-1], x.shape[-1], w.shape[1]
    M = math.prod(lead)
    interpret = tu.resolve_interpret(interpret)
    config = _resolve_config(M, K, N, x.dtype, residual is not None, block_sizes, on_gpu=not interpret)
    static = _Static(config=config, eps=float(eps),
                     out_dtype=jnp.dtype(x.dtype if out_dtype is None else out_dtype), interpret=interpret)
    x2 = x.reshape(M, K)
    res2 = None if residual is None else residual.reshape(M, K)
    with tu.quiet_triton_deprecation():
        out = _rmsnorm_matmul(x2, res2, gamma, w, static)
    if residual is None:
        return out.reshape(*lead, N)
    h, y = out
    return h.reshape(*lead, K), y.reshape(*lead, N)
