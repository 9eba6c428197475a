"""The Mosaic backend's one-row forward (decode, M = 1): y = r · (x ⊙ gamma) @ w as one GEMM kernel run transposed.

At one row the forward is a GEMV: its time is w's 2KN bytes read once. The GEMM core (``pallas_kernels.gemm``)
runs it transposed, yᵀ (N, 16) = wᵀ (N, K) @ B (K, 16), gamma in one of two places (``config``'s
``one_row_gamma_in_registers``):
  A  = w read transposed by TMA (the N axis in tiles of tile_m rows: wgmma's M side); with gamma "a" each MMA
       warpgroup loads its rows of the block into registers (through the transposed layout), multiplies them by
       gamma's step slice and wgmma reads them there (``Fusion.a_operand``);
  B  = with gamma "a", x itself: TMA fills the 15 rows past its one with zeros (16: the core's smallest wgmma N), so
       without a residual the forward is this kernel alone. With "x", xg = x ⊙ gamma rounded to x's dtype and
       padded with 15 rows of zeros by one XLA fusion. With a residual an XLA fusion writes h = x + residual
       (with "x", the same fusion writes xg), which then stands for x;
  epilogue: the accumulator's row sums are y's tile_m values (the padded columns hold zeros), scaled by
       r = rsqrt(mean(x²) + eps). r comes from x itself, viewed (64, K / 64) and loaded into registers at each
       tile's start (the load's round trip runs under the K loop), squared and summed in the epilogue: no XLA
       reduction, no normalized tensor. y (N,) is stored from registers; the (N, 16) tile is never stored
       (``Fusion.store_tile``).
So the forward is one kernel (gamma "a") or two, where XLA's own is three: its r reduction, the normalized x and its
GEMV.

bfloat16 only: x ⊙ gamma (or w ⊙ gamma) is rounded once before the product, and float16 would round small x into
subnormals (bfloat16 has float32's exponent range). K a multiple of 512 (the (64, K / 64) view in the accumulator
layout takes 8-column groups) and of tile_k; N a multiple of tile_m (``config.one_row_reason``).

Gamma "a" (the default where the tiles make one round: ``config.ONE_ROW_GAMMA_MAX_TILES``): at 1x4096x14336 the forward
took 30.66-31.62 µs in 12 runs against XLA's 31.30-31.81 (faster in 11; with "x" 30.75-32.35, faster in 4). Measured
with "x" on the H200 (jax 0.11.2, CUPTI, XLA's norm + matmul in the same run; NOTES.md, fortieth session): at
1x4096x14336 three suite calls took 30.9, 33.4 and 32.2 µs forward against XLA's 32.0, 32.2 and 32.0 (1.04x, 0.96x,
0.99x: rmsnorm_matmul-one_row-h200-f3e2adb.md, -issue15_all-h200-0615a1f.md, -one_row-h200-9e8a08c.md), forward +
backward 1.37-1.38x. A tie: the kernel alone took 29.6-32.0 µs in 19 runs of its two tilings, against 29.2-30.2 for
XLA's GEMV (w's 117 MB at 3.7-4.0 TB/s against 3.9-4.0; the floor, 4.3 TB/s, is 27.3 µs), and the XLA fusion writing x ⊙
gamma adds 1.3-1.4 µs where XLA's forward adds its two norm kernels' 2.6. The kernel's time depends on where w lies in
memory (``config.ONE_ROW_FORWARD``). The epilogue's r costs 0.1-0.6 µs over row sums alone; storing the unused (N, 16)
tile cost 0.4-0.8 more (one_row_gemv_epilogue_probe-h200-9363d22.json).
Other shapes and tiles: ``config.ONE_ROW_FORWARD``. With the forward config's ``k_parts`` P (a sweep candidate, not
measured yet) each tile's K loop runs in P ranges as tiles of their own, each storing its r-scaled row sums into a
(P, N) float32 output that one XLA fusion sums (``gemm.gemv_config`` says what parts did for the plain GEMV: at
1x4096x4096, 12.6 → 11.0 µs).

The backward at one row is the Triton backend's (``triton_bwd``: with ``dw_in_dx`` its dx kernel streams w in and dw
out, the fastest form measured at decode sizes), with that backend's tuned or built-in config for the shape; it
takes r from one XLA reduction over x, made for it alone (XLA drops it from a forward-only program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm.mosaic import Fusion, MosaicGemmConfig, gemm
from pallas_kernels.norm_matmul.config import ONE_ROW_PADDED, ONE_ROW_STAT_ROWS

__all__ = ["forward"]

_F32 = jnp.float32


def _fusion(K: int, N: int, eps: float, out_dtype, gamma_in_registers: bool = False, parts: int = 1) -> Fusion:
    """y (N,) = r · (row sums of the (tile_m, 16) accumulator), r from x's (64, K / 64) view ("x_rows"), loaded at
    each tile's start and reduced in its epilogue (within each warp, then across the warpgroup's four).
    ``gamma_in_registers``: each MMA warpgroup multiplies its rows of the wᵀ block by gamma's step slice ("gamma",
    (K,) in w's dtype) in registers, and wgmma reads A from there (``Fusion.a_operand``); B is then x itself.
    ``parts`` (the config's k_parts): y is (parts, N) float32, each K range's r-scaled row sums, for the caller to
    sum."""
    def load_x(ctx):
        return mu.load(ctx.refs["x_rows"], layout=mu.TILE, optimized=False)

    def epilogue(ctx, acc, x_rows):
        del ctx
        x_rows = x_rows.astype(_F32)
        rstd = lax.rsqrt(jnp.sum(jnp.sum(x_rows * x_rows, axis=1)) * (1.0 / K) + eps)
        return acc, {"y": jnp.sum(acc, axis=1) * rstd}

    def times_gamma(ctx, w_t, vectors, x_rows):  # w_t (tile_m, tile_k): gamma over its columns, rounded once
        del ctx
        return w_t * lax.broadcast_in_dim(vectors["gamma"], w_t.shape, [1]), x_rows

    hooks = dict(step_inputs=("gamma",), a_operand=times_gamma, partial_columns=True) if gamma_in_registers else {}
    y = jax.ShapeDtypeStruct((N,), out_dtype) if parts == 1 else jax.ShapeDtypeStruct((parts, N), _F32)
    return Fusion(inputs=("x_rows",), outputs=(("y", y),), store_tile=False,
                  prologue_init=load_x, epilogue=epilogue, reduction_scratch_bytes=2048, **hooks)


def forward(x, residual, gamma, w, *, config: MosaicGemmConfig, eps: float, out_dtype,
            gamma_in_registers: bool = False):
    """x, residual (1, K); gamma (K,); w (K, N) -> y (1, N) in out_dtype, r (1,) float32, h (1, K) or None.
    ``config``: the transposed GEMV's tiles (``config.one_row_reason`` checked by the caller).
    ``gamma_in_registers``: gamma multiplies w's blocks in the kernel's registers and B is x itself (TMA fills the
    15 rows past it with zeros): no XLA fusion without a residual. Else one XLA fusion writes x ⊙ gamma padded."""
    K, N = w.shape
    h = None
    if residual is not None:  # h = x + residual rounded to x's dtype (with gamma "x" in the fusion writing xg)
        h = (x.astype(_F32) + residual.astype(_F32)).astype(x.dtype)
        x = h
    x_rows = x.reshape(ONE_ROW_STAT_ROWS, K // ONE_ROW_STAT_ROWS)
    arrays = dict(x_rows=x_rows)
    if gamma_in_registers:
        b = x
        arrays["gamma"] = gamma.astype(w.dtype)
    else:
        b = jnp.pad((x.astype(_F32) * gamma.astype(_F32)).astype(x.dtype), ((0, ONE_ROW_PADDED - 1), (0, 0)))
    _, y = gemm(w, b, transpose_a=True, transpose_b=True, config=config, out_dtype=x.dtype,
                fusion=_fusion(K, N, eps, out_dtype, gamma_in_registers, config.k_parts), arrays=arrays,
                name="rmsnorm_matmul_fwd_gemv")
    if config.k_parts > 1:  # the K ranges' r-scaled row sums (MosaicGemmConfig.k_parts)
        y = jnp.sum(y, axis=0).astype(out_dtype)
    x32 = x.astype(_F32)
    rstd = lax.rsqrt(jnp.mean(x32 * x32, axis=1) + eps)  # for the backward only
    return y.reshape(1, N), rstd, h
