"""The Mosaic backend of rmsnorm_matmul (Hopper): three Mosaic-GPU GEMMs (``pallas_kernels.gemm``) with hooks.

Notation: x (M, K) (h = x + residual with a residual), gamma (K,), w (K, N); r = rsqrt(mean_K(x²) + eps) per
row, float32; y = rmsnorm(x) · gamma @ w = diag(r) · x · (diag(gamma) w).

Forward, one kernel: A = the raw x tile, B = w_γ = diag(gamma) w (one XLA pass over w, rounded to w's dtype), so both
wgmma operands stay in shared memory as loaded; the epilogue scales the float32 accumulator rows by r. r comes from one
XLA row reduction over x (default), or, with ``stats_in_kernel``, from the kernel, which then also stores r: True, a
fourth warpgroup that sums the squares of each x tile in shared memory beside the MMA warpgroups (or the memory
warpgroup between its loads, with the forward config's ``prologue_in="memory"``: slower, ``gemm.specialized``); "mma",
the MMA warpgroups themselves, each loading its rows of the x block into registers right after issuing the step's wgmma
(``Fusion.a_observe``) and adding their squares elementwise, reduced across the row once per tile in the epilogue (one
wgmma group in flight hides it: the 32768x4096x4096 default); "mma_rows" reduces each step's squares per row at once
instead (an option: slower on the H100); "mma_shared" has only each row block's first tile sum them and pass r to the
row block's other tiles through HBM and a global semaphore (``Fusion.share_rows``). The normalized activations never
exist. With ``gamma_on="x"`` (bfloat16, r from
XLA) gamma goes to the A side instead: the XLA fusion computing r (which reads x anyway) also writes x ⊙ gamma, MK more
bytes where w_γ costs 2KN (fewer where M < 2N, and so the default there: ``config.gamma_side``); B = w, and dx applies
gamma on its columns; still no normalized tensor (r stays in the epilogue). With ``gamma_on="a"`` (bfloat16) no tensor
is made for gamma at all: the MMA warpgroups load their rows of each x block into registers, multiply them by gamma's
step slice (loaded with the stage) and wgmma reads A from those registers (``Fusion.a_operand``: the K loop gives each
step in flight registers of its own); B = w, dx as with "x". The tuned entries of 4096x4096x14336 and 8192x4096x6144
take it (NOTES.md, 2026-11-28).

Backward, two kernels (never the normalized activations; r from the forward; float32 statistics):
  dx kernel:  dx = r · (dy @ w_γᵀ) − r² · c · x (+ dh),  c = Σ_N(dy · y) / K per row.
              A = dy, B = w_γ read transposed (no copy); the epilogue reads the x tile prefetched by TMA at the
              start of each output tile and writes dx in place of it. c and dyr = (r / s) ⊙ dy (s = 1, or
              max r for float16) come from one XLA fusion over dy and y (with ``dyr_in_dx``, dyr from the dx
              kernel instead: its MMA warpgroups scale and store their rows of the dy blocks, ``Fusion.a_copy``;
              with ``row_dot_in_dx``, c from the dx kernel's first tile of each row block, which sums dy · y with
              y's blocks loaded from HBM (or by TMA beside dy's, "tma": ``Fusion.a_beside``, the H200's entry at
              8192x4096x6144) and shares it, ``Fusion.share_rows``: no XLA pass left).
  dw kernel:  g = xᵀ @ dyr (A = x read transposed; or xrᵀ @ dy, ``xr_in_dx`` below); dw = gamma · s ⊙ g and
              dgamma = s · Σ_N w ⊙ g, from the epilogue with the prefetched w tile (partial sums per column block,
              summed by XLA: (N / tile_n, K)); with the dw config's ``tile_input_in="ring"`` the w tile arrives
              through its B stages instead, which leaves room for a fourth stage (the H200's entries at the suite
              shapes).
              Where its (K, N) output has few tiles (``dw_in_xla``), cuBLAS computes g and XLA fusions the rest,
              or (``dw_finish_kernel``) cuBLAS two halves of g and one Pallas-Triton kernel the rest (``dw_finish``);
              with dgamma from u (below; bfloat16) cuBLAS computes dw = (x ⊙ gamma)ᵀ @ dyr (or (xr ⊙ gamma)ᵀ @ dy)
              in w's dtype at once.
The identity c = mean_K(gamma · (dy @ wᵀ) · n) = Σ_N(dy · y) / K (y = (n · gamma) @ w) replaces a reduction
over K, which no dx block holds whole, by one over N (``row_dot="n"``). Forward + backward = three GEMMs, a pass
over w (shared by both directions under one jit) and row-statistics passes of 2MK (forward) and 6MN (backward; 4MN
with dyr from the dx kernel) bytes. By default (``row_dot="k"``; ``config.ROW_DOT_DEFAULT`` has the measurements)
the reduction stays on the K side instead:
  dx kernel:  u = dyr @ w_γᵀ = (r / s) ⊙ (dy @ w_γᵀ) (A = dyr; gamma on the columns with gamma_on "x"), written in
              x's dtype into the prefetched x tile's buffer, and per column block the float32 partial row dots
              Σ u ⊙ x over its columns; one XLA fusion gives dx = s · (u − (r² / K) · Σ_K(u ⊙ x) · x) (+ dh).
              With ``dx_in_kernel`` the dx kernel sums the parts over each row's tiles itself (``Fusion.sum_rows``)
              and writes dx from u in its registers: no u, no XLA pass.
              With ``xr_in_dx`` A is dy, u's rows are scaled by r / s in the epilogue, and the epilogue also writes
              xr = (r / s) ⊙ x from the x tile (``Fusion.tile_copy``) for the dw kernel, g = xrᵀ @ dy: no dyr.
dy is then read once, to form dyr (4MN bytes; a product XLA can fuse into the fusion that produces dy), y is not
kept, and the row statistics cost 10MK bytes (x read by the kernel, u written and read, x read, dx written). With
``dgamma_from="u"`` (gamma on x's side) the dx kernel writes u before gamma and one Pallas-Triton kernel
(``dx_finish``) finishes dx and sums dgamma = s · Σ_M(u ⊙ x) from the same reads of u and x, so the dw kernel's
epilogue only scales rows and loads no w tile (the H200's entry at 4096x4096x14336).
With ``backward_in_xla`` (few rows: the untuned rule where the dx kernel's tiles would fill at most half the grid) the
backward is XLA's own from the forward's r, x̂ = r ⊙ x recomputed in its fusions (``_backward_by_xla``: two cuBLAS
GEMMs, no Mosaic kernel), and only the forward is fused.

Numerics: x and w_γ are the only rounded operands of the forward, and x is the input itself: fp16 x near 1e-6
(or 1e-7) is multiplied as it is, never rounded again after a scaling, so y is as accurate as the unfused fp16
computation (measured in GPU interpret mode on the CPU: ``tests/test_norm_matmul_mosaic.py``). Float32
accumulators, statistics and epilogues. dyr = (r/s) ⊙ dy is rounded to the input dtype; for float16, s = max r
keeps it within range (|dy| itself must fit). |gamma · w| must fit the dtype (65504 for float16).

One row (M = 1, decode; bfloat16): the forward is a GEMV, which this module runs as the GEMM core transposed with r
from x in its epilogue (``mosaic_gemv``), and the backward is the Triton backend's (``triton_bwd``: at decode sizes
its dx kernel also writes dw), with that backend's tuned or built-in config for the shape.

Configs, tiles and the measurements behind them: ``norm_matmul.config`` (``MosaicRMSNormMatmulConfig``) and
``gemm.config``. Reached through ``pallas_kernels.rmsnorm_matmul(..., backend="mosaic")``, which validates the
inputs (eps included), flattens the leading axes and resolves the config; the backend-module contract is in
``pallas_kernels.backends``. Runs on an sm90 GPU; lowers for CUDA anywhere inside ``backends.lowering_for_gpu()``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm.mosaic import COL_DTYPES, Fusion, MosaicGemmConfig, gemm
from pallas_kernels.norm_matmul import config as _config
from pallas_kernels.norm_matmul import dw_finish, mosaic_gemv, triton_bwd, triton_fwd
from pallas_kernels.norm_matmul.config import MMA_STATS
from pallas_kernels.norm_matmul.dx_finish import finish_dx

__all__ = ["Config", "FORWARD_FIELDS", "check_config", "default_config", "rmsnorm_matmul", "sweep_candidates",
           "unsupported_reason"]

Config = _config.MosaicRMSNormMatmulConfig
FORWARD_FIELDS = _config.MOSAIC_FORWARD_FIELDS

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def default_config(x, gamma, w, *, residual, **_) -> Config:
    """The tuned or built-in config for x (M, K) and w (K, N) (``config.mosaic_default_config``)."""
    (M, K), N = x.shape, w.shape[1]
    return _config.mosaic_default_config(M, K, N, x.dtype, residual=residual is not None)


def _input_reason(x, out_dtype, interpret: bool) -> str | None:
    if interpret:
        return ("the Mosaic kernels have no interpret mode (interpret=True); they run on an sm90 GPU, or lower for "
                "CUDA inside backends.lowering_for_gpu()")
    dtype = jnp.dtype(x.dtype)
    if dtype not in _DTYPES:
        return f"x: dtype {dtype} is not supported by the Mosaic backend (bfloat16 and float16 only)"
    if x.shape[0] == 1 and dtype != jnp.dtype(jnp.bfloat16):
        return (f"x: dtype {dtype} at one row (M=1): the one-row forward rounds x ⊙ gamma or w ⊙ gamma before its "
                f"product, bfloat16 only (in float16 small x would round into subnormals, large gamma · w overflow)")
    if out_dtype is not None and jnp.dtype(out_dtype) != dtype:
        return f"out_dtype={jnp.dtype(out_dtype)} must equal x's dtype {dtype} on the Mosaic backend"
    return None


def unsupported_reason(x, gamma, w, *, residual=None, out_dtype=None, interpret: bool = False, config=None,
                       **_) -> str | None:
    """None when this backend runs these arguments; else one sentence naming the constraint: no interpret mode,
    16-bit inputs, y in x's dtype, K and N multiples of the default config's tiles, and M one row or at least
    ``config.FEWEST_ROWS`` (a last row of tiles past M: ``gemm``'s partial_rows; the backward's rows padded to a
    multiple of 8, ``config.kernel_rows``), so tiny M goes elsewhere. Given the call's own ``config``, only the
    inputs: its tiles are ``check_config``'s."""
    reason = _input_reason(x, out_dtype, interpret)
    if reason or config is not None:
        return reason
    return default_config(x, gamma, w, residual=residual).unsupported_reason(x.shape[0], x.shape[1], w.shape[1])


def sweep_candidates(x, gamma, w, *, residual=None, **_) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidates for x (M, K) and w (K, N) (``config.mosaic_sweep_candidates``)."""
    (M, K), N = x.shape, w.shape[1]
    return _config.mosaic_sweep_candidates(M, K, N, x.dtype, residual=residual is not None)


@dataclasses.dataclass(frozen=True)
class _Static:
    config: Config
    eps: float
    out_dtype: jnp.dtype
    one_row_backward: _config.RMSNormMatmulConfig | None = None  # at M = 1: the Triton backward's config
    backward_rows: int | None = None  # where the forward ran rows not a multiple of 8: the rows the backward pads to


def _rows_zero(tile_m: int) -> jax.Array:
    return mu.layout_cast(jnp.zeros((tile_m,), _F32), mu.ROWS)


def _bcast_rows(vec: jax.Array, shape) -> jax.Array:
    return lax.broadcast_in_dim(vec, shape, [0])


def _dyr_copy(leaf: int, sums: tuple[int, float] | None = None):
    """The ``Fusion.a_copy`` function writing dyr's (rows, tile_k) block: dy's block times the rows' r / s, the
    fusion's carry leaf ``leaf``; with ``sums`` (K, eps) that leaf holds x's sums of squares and r is formed from
    them here (s = 1)."""
    def scaled_dy(ctx, dy, carry):
        del ctx
        rows = carry[leaf] if sums is None else _rstd_from_squares(carry[leaf], *sums)
        return dy.astype(_F32) * _bcast_rows(rows, dy.shape)

    return scaled_dy


def _vector_input(v, tile_n: int | None = None):
    """A (K,) vector for a kernel's rows or columns: as it is in float32, bfloat16 or float16 (the kernel converts
    it as it loads it), else in float32. A bfloat16 gamma converted by XLA instead took a kernel of its own (0.8-1.2
    µs): forward + backward 124.4 → 123.0 µs at 8192x512x2816, 53.2 → 51.7 at 8192x512x768, 762.3 → 760.1 at
    16384x1024x5504, outputs bit for bit the same (toggle_ab_gamma_as_given-h200-422c1d7.json). ``tile_n``: the
    length of the column slices a kernel copies (``gemm.Fusion.col_inputs``); where they are not whole 128-byte
    lines in v's dtype (a 160-wide dx tile of a 16-bit gamma), float32."""
    as_given = jnp.dtype(v.dtype) in COL_DTYPES and (tile_n is None or tile_n * v.dtype.itemsize % 128 == 0)
    return v if as_given else v.astype(_F32)


def _scaled_w(gamma, w):
    """w_γ = diag(gamma) w in w's dtype: one XLA pass over w."""
    return (gamma.astype(_F32)[:, None] * w.astype(_F32)).astype(w.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------
def _forward_fusion(M: int, K: int, eps: float, cfg: MosaicGemmConfig, stats_in_kernel,
                    gamma_in_registers: bool = False, squares_from: str = "observe") -> Fusion:
    """Epilogue y = r ⊙ acc, r formed there from the rows' sums of squares coming in (M,) float32, loaded at the
    tile's start ("sum_sq": XLA's reduction over x, whose rsqrt would otherwise be an XLA kernel of its own, about
    1 µs).
    With stats_in_kernel True: the prologue (a fourth
    warpgroup, or the memory warpgroup) sums x² over each x block (float32); "mma": each MMA warpgroup, after
    issuing a step's wgmma, loads its rows of the x block into registers and adds their squares elementwise
    (reduced across the row once, in the epilogue); then the epilogue forms r from the sums and also stores it
    (M,); with stream-K the MMA warpgroups' partial sums are added like the accumulators (``Fusion.carry_shapes``).
    ``gamma_in_registers`` (gamma_on "a"): each MMA warpgroup loads its rows of the x block into registers before
    the step's wgmma, multiplies them by gamma's step slice ("gamma", (K,) in x's dtype) and wgmma reads them from
    there (``Fusion.a_operand``); with "mma" the squares come from the a_observe above, which loads the x block
    again after the wgmma's issue, or (``squares_from="operand"``) from the a_operand's registers."""
    if gamma_in_registers:
        return _gamma_in_registers_fusion(M, K, eps, cfg, stats_in_kernel, squares_from)
    if not stats_in_kernel:
        return Fusion(inputs=("sum_sq",), prologue_init=_sum_sq_in, epilogue=_scale_by_rstd_in(K, eps))

    outputs = (("rstd", jax.ShapeDtypeStruct((M,), _F32)),)
    if stats_in_kernel in MMA_STATS:
        return Fusion(outputs=outputs, **_mma_stats(M, K, eps, cfg, stats_in_kernel))

    def step(ctx, x_ref, sum_sq):
        del ctx
        x = mu.load(x_ref, layout=mu.TILE).astype(_F32)  # (tile_m, tile_k)
        return sum_sq + jnp.sum(x * x, axis=1)

    return Fusion(outputs=outputs, handoff_rows=1, prologue_init=lambda ctx: _rows_zero(cfg.cta_m),
                  prologue_step=step, epilogue=_scale_by_rstd(K, eps))


def _add_squares(ctx, x, sum_sq) -> jax.Array:
    """The MMA warpgroups' a_observe: x's squares added elementwise (no cross-lane reduction per step; the
    epilogue reduces each row once per tile)."""
    del ctx
    x = x.astype(_F32)
    return sum_sq + x * x


def _squares_zero(ctx) -> jax.Array:
    """The MMA warpgroups' elementwise sums of squares at a tile's start: (wg_rows, tile_k) float32 zeros."""
    return mu.layout_cast(jnp.zeros((ctx.config.wg_rows, ctx.config.tile_k), _F32), mu.TILE)


def _add_row_squares(ctx, x, sum_sq) -> jax.Array:
    """The MMA warpgroups' a_observe with stats_in_kernel "mma_rows": each row's squares summed at once into a
    (rows,) float32 carry (a reduction within each warp per step, two registers of carry per thread)."""
    del ctx
    x = x.astype(_F32)
    return sum_sq + jnp.sum(x * x, axis=1)


def _mma_stats(M: int, K: int, eps: float, cfg: MosaicGemmConfig, stats_in_kernel) -> dict:
    """The Fusion hooks by which the MMA warpgroups sum x's squares, elementwise ("mma", "mma_shared") or per row
    ("mma_rows"), and the epilogue y = r ⊙ acc. "mma_shared": only each row block's first tile sums them, and its r
    reaches the row block's other tiles through the "rstd" output (``Fusion.share_rows``)."""
    if stats_in_kernel == "mma_rows":
        hooks = dict(prologue_init=lambda ctx: _rows_zero(ctx.config.wg_rows), a_observe=_add_row_squares,
                     carry_shapes=((cfg.wg_rows,),))
    else:
        hooks = dict(prologue_init=_squares_zero, a_observe=_add_squares, carry_shapes=((cfg.wg_rows, cfg.tile_k),))
    if stats_in_kernel == "mma_shared":
        return dict(hooks, share_rows=("rstd", lambda ctx, sum_sq: _rstd_from_squares(sum_sq, K, eps)),
                    epilogue=lambda ctx, acc, shared: (acc * _bcast_rows(shared[0], acc.shape), {}))
    return dict(hooks, epilogue=_scale_by_rstd(K, eps))


def _rstd_from_squares(sum_sq, K: int, eps: float) -> jax.Array:
    """r = rsqrt(mean(x²) + eps) (tile_m,) float32 from the sums of squares: (rows,), or (rows, tile_k) elementwise
    (the MMA warpgroups'), reduced across each row here."""
    if sum_sq.ndim == 2:
        sum_sq = jnp.sum(sum_sq, axis=1)
    return lax.rsqrt(sum_sq * (1.0 / K) + eps)


def _sum_sq_in(ctx) -> jax.Array:
    """The prologue_init that loads this accumulator's rows of the (M,) input "sum_sq" at the tile's start. Nothing
    uses them before the epilogue (``_scale_by_rstd_in``), so the load's round trip runs under the K loop; r formed
    here, its rsqrt would wait for the load before the tile's first wgmma."""
    return ctx.load_rows("sum_sq")


def _scale_by_rstd_in(K: int, eps: float):
    """The epilogue y = r ⊙ acc, r formed from the rows' sums of squares loaded at the tile's start. (Storing r as
    well, for the backward in place of XLA's 1 µs rsqrt kernel, cost the ping-pong forward 15 µs at 16384x1024x5504
    and saved nothing at 8192x512x2816: toggle_ab_rstd_from_forward-h200-7590466.json.)"""
    return lambda ctx, acc, sum_sq: (acc * _bcast_rows(_rstd_from_squares(sum_sq, K, eps), acc.shape), {})


def _scale_by_rstd(K: int, eps: float):
    """The forward's epilogue from the float32 sums of squares (rows, or (rows, tile_k) elementwise): y = r ⊙ acc,
    and r stored (M,)."""
    def epilogue(ctx, acc, sum_sq):
        del ctx
        rstd = _rstd_from_squares(sum_sq, K, eps)
        return acc * _bcast_rows(rstd, acc.shape), {"rstd": rstd}

    return epilogue


def _gamma_in_registers_fusion(M: int, K: int, eps: float, cfg: MosaicGemmConfig, stats_in_kernel,
                               squares_from: str = "observe") -> Fusion:
    """gamma_on "a": A = x ⊙ gamma formed in the MMA warpgroups' registers per step (``Fusion.a_operand``), gamma's
    slice loaded with each stage; r from XLA's sums of squares ("sum_sq" in), or with "mma" from x's squares:
    summed after the step's wgmma is issued (``Fusion.a_observe``, which loads the block again from shared memory),
    or with ``squares_from="operand"`` by the a_operand itself, from the registers it multiplies (before the issue,
    under the wgmma group in flight; with "mma_shared" only in each row block's first tile, whose K loop the kernel
    compiles apart: ``TileContext.first_column``)."""
    def times_gamma(x, vectors):  # in x's dtype: x ⊙ gamma rounded once (gamma itself rounded to x's dtype)
        return x * lax.broadcast_in_dim(vectors["gamma"], x.shape, [1])

    if not stats_in_kernel:
        return Fusion(inputs=("sum_sq",), step_inputs=("gamma",), prologue_init=_sum_sq_in,
                      a_operand=lambda ctx, x, vectors, sum_sq: (times_gamma(x, vectors), sum_sq),
                      epilogue=_scale_by_rstd_in(K, eps))

    hooks = _mma_stats(M, K, eps, cfg, stats_in_kernel)
    outputs = (("rstd", jax.ShapeDtypeStruct((M,), _F32)),)
    if squares_from == "operand":
        add = hooks.pop("a_observe")
        if stats_in_kernel == "mma_shared":
            hooks.pop("carry_shapes")  # (stream-K tiles take the shared r)

            def operand(ctx, x, vectors, sum_sq):  # the first tiles' K loop sums (every tile in interpret mode)
                takes = ctx.first_column is not False  # (static: ``Fusion.share_rows`` on the GPU)
                return times_gamma(x, vectors), add(ctx, x, sum_sq) if takes else sum_sq
        else:  # every tile its own sums; stream-K segments pass theirs on (carry_shapes)
            def operand(ctx, x, vectors, sum_sq):
                return times_gamma(x, vectors), add(ctx, x, sum_sq)
        return Fusion(outputs=outputs, step_inputs=("gamma",), a_operand=operand, **hooks)
    hooks.pop("carry_shapes")  # "mma", "mma_rows": whole tiles (stream-K beside the a_operand: "mma_shared" only)
    return Fusion(outputs=outputs, step_inputs=("gamma",),
                  a_operand=lambda ctx, x, vectors, sum_sq: (times_gamma(x, vectors), sum_sq), **hooks)


def _forward(x, residual, gamma, w, static: _Static):
    """x, residual (M, K); gamma (K,); w (K, N) -> y (M, N), r (M,) float32, h (M, K) or None, and the rows' sums
    of squares (M,) float32 where XLA formed them (else None: r came from the kernel)."""
    M, K = x.shape
    if M == 1:  # decode: the transposed GEMV
        return (*mosaic_gemv.forward(x, residual, gamma, w, config=static.config.forward, eps=static.eps,
                                     out_dtype=static.out_dtype,
                                     gamma_in_registers=static.config.one_row_gamma_in_registers(w.shape[1])), None)
    h = None
    if residual is not None:  # h = x + residual rounded to x's dtype: one XLA pass, written once
        h = (x.astype(_F32) + residual.astype(_F32)).astype(x.dtype)
        x = h
    cfg = static.config.forward
    side = static.config.gamma_side(M, w.shape[1], x.dtype)
    fusion = _forward_fusion(M, K, static.eps, cfg, static.config.stats_in_kernel, gamma_in_registers=side == "a",
                             squares_from=static.config.squares_from)
    b = _scaled_w(gamma, w) if side == "w" else w
    arrays = dict(gamma=gamma.astype(x.dtype)) if side == "a" else {}
    sum_sq = None
    if static.config.stats_in_kernel:
        y, rstd = gemm(x, b, config=cfg, out_dtype=static.out_dtype, fusion=fusion, arrays=arrays,
                       partial_rows=True, name="rmsnorm_matmul_fwd")
    else:  # one XLA row reduction over x (with gamma_on "x" the same fusion writes x ⊙ gamma); the kernel forms r
        x32 = x.astype(_F32)
        sum_sq = jnp.sum(x32 * x32, axis=1)
        rstd = _rstd_from_squares(sum_sq, K, static.eps)  # for the backward, where XLA fuses it into its users
        a = (x32 * gamma.astype(_F32)).astype(x.dtype) if side == "x" else x
        (y,) = gemm(a, b, config=cfg, out_dtype=static.out_dtype, fusion=fusion, arrays=dict(arrays, sum_sq=sum_sq),
                    partial_rows=True, name="rmsnorm_matmul_fwd")
    return y, rstd, h, sum_sq


# ---------------------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------------------
def _dx_fusion(M: int, K: int, has_dh: bool, gamma_cols: bool, dyr: jax.ShapeDtypeStruct | None = None,
               row_dot_in_kernel: bool | str = False) -> Fusion:
    """dx = r ⊙ (dy @ w_γᵀ) − r²·c ⊙ x (+ dh), c = Σ_N(dy · y) / K, Σ_N(dy · y) coming in (M,) ("row_dot"); dx
    is written into the prefetched x tile's buffer and stored from there. ``gamma_cols``: the GEMM reads w itself,
    dy @ w_γᵀ = (dy @ wᵀ) ⊙ gamma, gamma (K,) coming in ("gamma", ``_vector_input``) over the output's columns. ``dyr``
    (M, N): also write dyr = (r / s) ⊙ dy from the dy blocks (``Fusion.a_copy``), r / s coming in (M,)
    ("dyr_scale"). ``row_dot_in_kernel``: Σ_N(dy · y) summed by the first tile of each row block instead, from its
    dy blocks (A, after each wgmma's issue) and y's ("y" (M, N) coming in, each block loaded from HBM), and shared
    with the row block's other tiles (``Fusion.share_rows``; also an output, "row_dot" (M,) float32); "prefetch":
    each step loads the next step's y block into the carry (its load's latency under a step's wgmma); "tma": the
    memory warpgroup loads y's blocks by TMA into a stage buffer beside dy's (``Fusion.a_beside``), and the MMA
    warpgroups read both from shared memory."""

    def epilogue(ctx, acc, carry):
        if row_dot_in_kernel:  # (the shared row dot, the carry)
            row_dot, carry = carry
        else:
            row_dot = carry[0]
        rstd = carry[1]
        coef = rstd * rstd * row_dot * (1.0 / K)  # r² · c
        if gamma_cols:
            acc = acc * lax.broadcast_in_dim(ctx.load_cols("gamma"), acc.shape, [1])
        dx = acc * _bcast_rows(rstd, acc.shape) - ctx.load_tile("x") * _bcast_rows(coef, acc.shape)
        if has_dh:
            dx = dx + ctx.load_tile("dh")
        return dx, {}

    rows = ("row_dot", "rstd") + (("dyr_scale",) if dyr is not None else ())  # the carry
    outputs = (("dyr", dyr),) if dyr is not None else ()
    if not row_dot_in_kernel:
        return Fusion(tile_inputs=("x", "dh") if has_dh else ("x",), store_in="x",
                      inputs=("rstd", "row_dot", *(("gamma",) if gamma_cols else ()), *rows[2:]),
                      col_inputs=("gamma",) if gamma_cols else (),
                      outputs=outputs, a_copy=("dyr", _dyr_copy(2)) if dyr is not None else None,
                      prologue_init=lambda ctx: tuple(ctx.load_rows(n) for n in rows), epilogue=epilogue)

    prefetch = row_dot_in_kernel == "prefetch"
    by_tma = row_dot_in_kernel == "tma"

    def init(ctx):  # the row dot's sums (rows,) float32 in place of the row dot, then r and r / s (and y's next)
        cfg = ctx.config
        y_dtype = ctx.refs["y"].dtype
        ahead = (mu.layout_cast(jnp.zeros((cfg.tile_m, cfg.tile_k), y_dtype), mu.TILE),) if prefetch else ()
        return (_rows_zero(cfg.tile_m), *(ctx.load_rows(n) for n in rows[1:]), *ahead)

    def y_block(ctx, step):
        k = ctx.config.tile_k
        return mu.load(ctx.refs["y"].at[ctx.rows, pl.ds(step * k, k)], layout=mu.TILE, optimized=False)

    def add_row_dot(ctx, dy, carry, y_beside=None):  # this step's Σ dy · y per row
        if by_tma:  # y's block beside dy's in the stage
            y, rest = y_beside, carry[1:]
        elif prefetch:  # y's blocks loaded from HBM by the MMA warpgroups: the one loaded at the step before (at
            # the first step, now), and the next one's load
            y = lax.cond(ctx.step == 0, lambda: y_block(ctx, 0), lambda: carry[-1])
            last = ctx.refs["y"].shape[1] // ctx.config.tile_k - 1
            rest = (*carry[1:-1], y_block(ctx, jnp.minimum(ctx.step + 1, last)))
        else:  # loaded from HBM now
            y, rest = y_block(ctx, ctx.step), carry[1:]
        return (carry[0] + jnp.sum(dy.astype(_F32) * y.astype(_F32), axis=1), *rest)

    return Fusion(tile_inputs=("x", "dh") if has_dh else ("x",), store_in="x",
                  inputs=("rstd", *(() if by_tma else ("y",)), *(("gamma",) if gamma_cols else ()), *rows[2:]),
                  col_inputs=("gamma",) if gamma_cols else (),
                  outputs=(*outputs, ("row_dot", jax.ShapeDtypeStruct((M,), _F32))),
                  a_copy=("dyr", _dyr_copy(2)) if dyr is not None else None, prologue_init=init,
                  a_observe=add_row_dot, a_beside="y" if by_tma else None,
                  share_rows=("row_dot", lambda ctx, carry: carry[0]), epilogue=epilogue)


def _dx_partial_fusion(M: int, K: int, cfg: MosaicGemmConfig, gamma_cols: bool,
                       dyr: jax.ShapeDtypeStruct | None = None, gamma_in_u: bool = True,
                       in_kernel: bool = False, xr: jax.ShapeDtypeStruct | None = None,
                       unit_scale: bool = False, sums_eps: float | None = None) -> Fusion:
    """Row dot on the K side: u = acc (⊙ gamma over the columns, gamma (K,) coming in, with
    ``gamma_cols``), stored in x's dtype into the prefetched x tile's buffer, and per column block the partial row
    dot Σ u ⊙ x over its tile_n columns ("row_dot_parts", (K / tile_n, M) float32). ``gamma_in_u`` False (with
    ``gamma_cols``): u is stored before gamma (for dgamma = s · Σ_M(u ⊙ x)), the parts still sum u ⊙ gamma ⊙ x.
    ``dyr`` (M, N): A is dy itself; u = (r / s) ⊙ acc, r / s coming in (M,) ("dyr_scale"), and dyr = (r / s) ⊙ dy
    is written from the dy blocks (``Fusion.a_copy``) for the dw GEMM. ``in_kernel`` (``dx_in_kernel``): the parts
    are summed over each row's tiles in the kernel (``Fusion.sum_rows``) and the tile stored is dx = a · u − b ·
    Σ_K(u ⊙ x) · x, a = s and b = s · r² / K per row coming in ("dx_u_scale", "dx_x_coef", (M,) float32).
    ``xr`` (M, K), instead of ``dyr``: A is dy as with it, but the epilogue writes xr = (r / s) ⊙ x from the x tile
    (``Fusion.tile_copy``) for the dw GEMM (g = xrᵀ @ dy), M·K elements where dyr is M·N and no copy in the K loop;
    the finish then reads xr where x was (b = s² · r / K instead: x = xr · s / r, xr rounded once to x's dtype).
    ``unit_scale`` (s = 1, bfloat16): no "dx_u_scale" (a = 1), and where A is dy (``dyr`` or ``xr``) no
    "dx_x_coef" either: the finish forms b from the r it takes for u's rows (r / K with xr, r² / K with dyr), so
    no XLA kernel makes those (M,) vectors: forward + backward 125.8 → 125.2 µs at 8192x512x2816, 55.4 → 54.7 at
    8192x512x768, 760.0 → 758.6 at 16384x1024x5504 (toggle_ab_dx_unit_scale-h200-7590466.json: the broadcast
    kernel of a = 1 gone, XLA's r and b kernel now r alone, still about 1.1 µs). ``sums_eps`` (with ``xr`` or
    ``dyr``, and ``unit_scale``): the rows come in as x's sums of squares ("sum_sq", (M,) float32, the forward's
    XLA reduction) in place of r, and each use forms r = rsqrt(sum_sq / K + eps) itself (dyr's copy at each K
    step), so no XLA kernel makes r: forward + backward 124.3 → 123.6 µs at 8192x512x2816, 752.3 → 751.0 at
    16384x1024x5504 with xr, outputs bit for bit the same (toggle_ab_r_from_sums-h200-f55c295.json); 52.8 → 51.9
    at 8192x512x768 with dyr (toggle_ab_dyr_from_sums-h200-422c1d7.json)."""

    scaled = dyr is not None or xr is not None  # A is dy: u's rows times r / s, the carry's leaf ``scale_leaf``
    if sums_eps is not None and (not scaled or not unit_scale):
        raise ValueError("_dx_partial_fusion: sums_eps takes A = dy (xr or dyr) with unit_scale (r / s = r)")
    coef_from_r = in_kernel and unit_scale and scaled  # b = r / K (xr) or r² / K (dyr), r = the carry's r / s
    finish_rows = () if not in_kernel or coef_from_r else ("dx_x_coef",) if unit_scale else ("dx_u_scale",
                                                                                             "dx_x_coef")
    scale_leaf = len(finish_rows)

    def r_over_s(carry):  # the rows' r / s (tile rows,) float32: the carry's leaf, or formed from the sums there
        rows = carry[scale_leaf]
        return rows if sums_eps is None else _rstd_from_squares(rows, K, sums_eps)

    def epilogue(ctx, acc, carry):
        if scaled:
            acc = acc * _bcast_rows(r_over_s(carry), acc.shape)
        x = ctx.load_tile("x")
        if not gamma_cols:
            return acc, {"row_dot_parts": jnp.sum(acc * x, axis=1)}
        gamma = lax.broadcast_in_dim(ctx.load_cols("gamma"), acc.shape, [1])
        if gamma_in_u:
            acc = acc * gamma
            return acc, {"row_dot_parts": jnp.sum(acc * x, axis=1)}
        return acc, {"row_dot_parts": jnp.sum(acc * (gamma * x), axis=1)}

    parts = ("row_dot_parts", jax.ShapeDtypeStruct((K // cfg.tile_n, M), _F32))
    gamma = ("gamma",) if gamma_cols else ()
    rows = finish_rows + ((("dyr_scale",) if sums_eps is None else ("sum_sq",)) if scaled else ())
    hooks = {"col_inputs": gamma}  # gamma's slices by TMA at the tile's start: the dx kernel 1537.2 -> 1524.4 µs
    # at 32768x4096x4096 against loading them from GMEM in the epilogue (toggle_ab_gamma_cols_by_tma-h200-d3eb5e4.json)
    if rows:
        hooks["prologue_init"] = lambda ctx: tuple(ctx.load_rows(n) for n in rows)
    if in_kernel:
        def finish(ctx, u, row_dot, carry):  # dx from u and the row dot summed over the row's tiles
            if coef_from_r:
                r = r_over_s(carry)
                b = r * (1.0 / K) if xr is not None else r * r * (1.0 / K)
            else:
                b = carry[scale_leaf - 1]
            a_u = u if unit_scale else u * _bcast_rows(carry[0], u.shape)
            return a_u - ctx.load_tile("x") * _bcast_rows(b * row_dot, u.shape)

        hooks["sum_rows"] = ("row_dot_parts", finish)
    if xr is not None:
        def xr_tile(ctx, carry):  # (the whole tile, or a column slice of it: MosaicGemmConfig.epilogue_in)
            x = ctx.load_tile("x")
            return x * _bcast_rows(r_over_s(carry), x.shape)

        hooks["tile_copy"] = ("xr", xr_tile)
        return Fusion(tile_inputs=("x",), inputs=(*rows, *gamma), store_in="x", outputs=(("xr", xr), parts),
                      epilogue=epilogue, **hooks)
    if dyr is None:
        return Fusion(tile_inputs=("x",), inputs=(*rows, *gamma), store_in="x", outputs=(parts,), epilogue=epilogue,
                      **hooks)
    return Fusion(tile_inputs=("x",), inputs=(*rows, *gamma), store_in="x", outputs=(("dyr", dyr), parts),
                  a_copy=("dyr", _dyr_copy(len(rows) - 1, None if sums_eps is None else (K, sums_eps))),
                  epilogue=epilogue, **hooks)


def _row_coef(row_dot_parts, rstd, K: int) -> jax.Array:
    """r² · c / s per row (M,) float32, c = Σ_N(dy · y) / K, from the dx kernel's (K / tile_n, M) partial row dots."""
    return rstd * rstd * jnp.sum(row_dot_parts, axis=0) * (1.0 / K)


def _dx_from_parts(u, row_dot_parts, xn, rstd, scale, dh):
    """dx = s · (u − (r² / K) · Σ_K(u ⊙ x) · x) (+ dh), Σ_K(u ⊙ x) the sum of the column blocks' parts: one XLA
    fusion over (M, K) (and a small one over the parts)."""
    dx = (u.astype(_F32) - _row_coef(row_dot_parts, rstd, xn.shape[1])[:, None] * xn.astype(_F32)) * scale
    return (dx if dh is None else dx + dh.astype(_F32)).astype(xn.dtype)


def _dw_fusion(K: int, N: int, cfg: MosaicGemmConfig, dgamma: bool = True) -> Fusion:
    """g = xᵀ @ dyr (or xrᵀ @ dy); dw = (gamma · s) ⊙ g and, with ``dgamma``, per-column-block partial dgamma
    Σ w ⊙ g (s applied by the caller) from the prefetched w tile; without, no tile input at all."""

    def epilogue(ctx, acc, gamma_s):
        partial = jnp.sum(ctx.load_tile("w") * acc, axis=1)  # (tile_m,) over this block's tile_n columns
        return acc * _bcast_rows(gamma_s, acc.shape), {"dgamma_parts": partial}

    if not dgamma:
        return Fusion(inputs=("gamma_s",), prologue_init=lambda ctx: ctx.load_rows("gamma_s"),
                      epilogue=lambda ctx, acc, gamma_s: (acc * _bcast_rows(gamma_s, acc.shape), {}))
    return Fusion(tile_inputs=("w",), inputs=("gamma_s",),
                  outputs=(("dgamma_parts", jax.ShapeDtypeStruct((N // cfg.tile_n, K), _F32)),), store_in="w",
                  prologue_init=lambda ctx: ctx.load_rows("gamma_s"), epilogue=epilogue)


def _backward(xn, gamma, w, rstd, y, dy, dh, static: _Static, sum_sq=None):
    """xn: the norm's input, x (h with a residual) (M, K); rstd (M,) float32 = r; sum_sq (M,) float32: the
    forward's sums of squares where XLA formed them, else None. Returns dx (M, K) in xn.dtype (including dh), dgamma
    (K,) in gamma.dtype, dw (K, N) in w.dtype."""
    M, K = xn.shape
    N = w.shape[1]
    cfg = static.config
    dtype = xn.dtype
    # float16: dyr = (r / s) ⊙ dy with s = max r stays <= |dy|; bfloat16 has float32's range (s = 1).
    scale = jnp.max(rstd) if dtype == jnp.float16 else jnp.ones((), _F32)
    on_x = cfg.gamma_side(M, N, dtype) in ("x", "a")  # no w_γ: gamma on dx's columns in the epilogue
    b = w if on_x else _scaled_w(gamma, w)
    dgamma = None  # from the dw GEMM's epilogue, unless from u (``dgamma_from="u"``)
    if cfg.row_dot_side() == "k":  # u = (r / s) ⊙ (dy @ w_γᵀ) and its row dot's parts
        arrays = dict(x=xn, gamma=_vector_input(gamma, cfg.dx.tile_n)) if on_x else dict(x=xn)
        from_u = cfg.dgamma_source(M, N, dtype) == "u"  # u before gamma (on_x: the config checked it)
        in_kernel = cfg.dx_in_kernel and dh is None and not mu.interpreting()  # the dx kernel writes dx itself
        unit = dtype != jnp.float16  # s = 1: the finish takes fewer rows (``_dx_partial_fusion``'s unit_scale)
        a_is_dy = cfg.xr_in_dx or cfg.dyr_by_dx(dtype, dh is not None)
        if in_kernel:  # dx = s · u − (s · r² / K) · Σ_K(u ⊙ x) · x, with xr: − (s² · r / K) · Σ_K(u ⊙ x) · xr
            if not (unit and a_is_dy):
                arrays["dx_x_coef"] = rstd * (scale * scale / K) if cfg.xr_in_dx else rstd * rstd * (scale / K)
            if not unit:
                arrays["dx_u_scale"] = jnp.broadcast_to(scale, (M,))
        if cfg.xr_in_dx:  # A is dy; the dx kernel scales u's rows and writes xr from its x tile
            sums = unit and sum_sq is not None  # r formed in the kernel from the forward's sums (sums_eps)
            fusion = _dx_partial_fusion(M, K, cfg.dx, on_x, gamma_in_u=not from_u, in_kernel=in_kernel,
                                        xr=jax.ShapeDtypeStruct((M, K), dtype), unit_scale=unit,
                                        sums_eps=static.eps if sums else None)
            rows = dict(sum_sq=sum_sq) if sums else dict(dyr_scale=rstd / scale)
            u, xr, parts = gemm(dy.astype(dtype), b, transpose_b=True, config=cfg.dx, out_dtype=dtype,
                                fusion=fusion, arrays=dict(arrays, **rows), partial_rows=True, name="rmsnorm_matmul_dx")
            dw_a, dw_b = xr, dy.astype(dtype)  # g = xrᵀ @ dy
        elif cfg.dyr_by_dx(dtype, dh is not None):  # A is dy; the dx kernel scales u's rows and writes dyr
            sums = unit and sum_sq is not None  # r formed in the kernel from the forward's sums (sums_eps)
            fusion = _dx_partial_fusion(M, K, cfg.dx, on_x, jax.ShapeDtypeStruct((M, N), dtype), not from_u,
                                        in_kernel, unit_scale=unit, sums_eps=static.eps if sums else None)
            rows = dict(sum_sq=sum_sq) if sums else dict(dyr_scale=rstd / scale)
            u, dyr, parts = gemm(dy.astype(dtype), b, transpose_b=True, config=cfg.dx, out_dtype=dtype,
                                 fusion=fusion, arrays=dict(arrays, **rows), partial_rows=True,
                                 name="rmsnorm_matmul_dx")
        else:  # dy read once, for dyr; A is dyr
            dyr = (dy.astype(_F32) * (rstd / scale)[:, None]).astype(dtype)
            u, parts = gemm(dyr, b, transpose_b=True, config=cfg.dx, out_dtype=dtype,
                            fusion=_dx_partial_fusion(M, K, cfg.dx, on_x, gamma_in_u=not from_u, in_kernel=in_kernel,
                                                      unit_scale=unit),
                            arrays=arrays, partial_rows=True, name="rmsnorm_matmul_dx")
        if in_kernel:  # (u is dx already)
            dx = u
        elif from_u:  # u before gamma: one kernel finishes dx and sums dgamma from the same reads of u and x
            dx, dgamma_parts = finish_dx(u, xn, _row_coef(parts, rstd, K) * scale, gamma.astype(_F32) * scale, dh,
                                         interpret=mu.interpreting())
            dgamma = (jnp.sum(dgamma_parts, axis=0) * scale).astype(gamma.dtype)
        else:
            dx = _dx_from_parts(u, parts, xn, rstd, scale, dh)
    else:  # Σ_N(dy · y) from one XLA fusion over dy and y (which may write dyr too), or from the dx kernel's
        # first tile of each row block (``row_dot_in_dx``); the dx kernel's epilogue finishes dx
        dy32 = dy.astype(dtype).astype(_F32)
        in_kernel = cfg.row_dot_by_dx(dtype, dh is not None)
        dx_cfg = cfg.dx_config(dh is not None)
        arrays = dict(x=xn, rstd=rstd)
        if in_kernel:
            arrays["y"] = y.astype(dtype)
        else:
            arrays["row_dot"] = jnp.sum(dy32 * y.astype(_F32), axis=1)
        if dh is not None:
            arrays["dh"] = dh.astype(dtype)
        if on_x:
            arrays["gamma"] = _vector_input(gamma, dx_cfg.tile_n)
        if cfg.dyr_by_dx(dtype, dh is not None):  # the dx kernel writes dyr from its dy blocks
            arrays["dyr_scale"] = rstd / scale
            dx, dyr, *_ = gemm(dy.astype(dtype), b, transpose_b=True, config=dx_cfg, out_dtype=dtype,
                               fusion=_dx_fusion(M, K, dh is not None, on_x, jax.ShapeDtypeStruct((M, N), dtype),
                                                 row_dot_in_kernel=in_kernel),
                               arrays=arrays, partial_rows=True, name="rmsnorm_matmul_dx")
        else:
            dyr = (dy32 * (rstd / scale)[:, None]).astype(dtype)
            dx, *_ = gemm(dy.astype(dtype), b, transpose_b=True, config=dx_cfg, out_dtype=dtype,
                          fusion=_dx_fusion(M, K, dh is not None, on_x, row_dot_in_kernel=in_kernel), arrays=arrays,
                          partial_rows=True, name="rmsnorm_matmul_dx")
    if not cfg.xr_in_dx:  # (xr_in_dx: the K side, which set them)
        dw_a, dw_b = xn, dyr  # g = xᵀ @ dyr
    if cfg.dw_by_xla(K, N):  # few output tiles: cuBLAS splits the M reduction, the core would idle most SMs
        dw, dgamma = _dw_by_cublas(dw_a, dw_b, gamma, w, scale, dgamma,
                                   finish_kernel=cfg.dw_finish_kernel and N <= dw_finish.MAX_N)
        return dx, dgamma, dw
    gamma_s = gamma.astype(_F32) * scale if dtype == jnp.float16 else _vector_input(gamma)  # (else s = 1)
    if dgamma is not None:  # the dw kernel only scales rows: no w tile (nor a ring to carry one)
        dw_cfg = dataclasses.replace(cfg.dw, tile_input_in="buffer")
        dw, = gemm(dw_a, dw_b, transpose_a=True, config=dw_cfg, out_dtype=w.dtype,
                   fusion=_dw_fusion(K, N, dw_cfg, False), arrays=dict(gamma_s=gamma_s), partial_k=True,
                   name="rmsnorm_matmul_dw")
        return dx, dgamma, dw
    dw, dgamma_parts = gemm(dw_a, dw_b, transpose_a=True, config=cfg.dw, out_dtype=w.dtype,
                            fusion=_dw_fusion(K, N, cfg.dw), arrays=dict(w=w, gamma_s=gamma_s),
                            partial_k=True, name="rmsnorm_matmul_dw")
    dgamma = (jnp.sum(dgamma_parts, axis=0) * scale).astype(gamma.dtype)
    return dx, dgamma, dw


def _backward_padded(xn, gamma, w, rstd, y, dy, dh, static: _Static, sum_sq):
    """``_backward`` where the forward ran M rows, not a multiple of 8 (``config.forward_takes_any_rows``): the dx
    and dw kernels take whole 8-row tiles, so x, r and the sums of squares are padded with copies of their last row (r
    there a real row's: float16's s = max r unchanged) and y, dy and dh with zeros (so the padded rows add nothing
    to dw or dgamma), to ``static.backward_rows``; dx is sliced back to M rows."""
    M = xn.shape[0]

    def padded(v, mode):
        return None if v is None else jnp.pad(v, ((0, static.backward_rows - M),) + ((0, 0),) * (v.ndim - 1),
                                              mode=mode)

    dx, dgamma, dw = _backward(padded(xn, "edge"), gamma, w, padded(rstd, "edge"), padded(y, "constant"),
                               padded(dy, "constant"), padded(dh, "constant"), static, padded(sum_sq, "edge"))
    return dx[:M], dgamma, dw


def _backward_by_xla(xn, gamma, w, rstd, dy, dh):
    """The backward as XLA's own ops (``backward_in_xla``): xn (M, K) the norm's input, rstd (M,) float32 = r from the
    forward, dy (M, N), dh (M, K) or None. With x̂ = r ⊙ xn and G = dy @ wᵀ (cuBLAS, float32 out): dgamma = Σ_M G ⊙ x̂,
    dx = r ⊙ (G ⊙ gamma − x̂ · mean_K(G ⊙ gamma ⊙ x̂)) (+ dh), dw = (x̂ ⊙ gamma)ᵀ @ dy (cuBLAS writes w's dtype).
    Returns dx in xn.dtype, dgamma in gamma.dtype, dw in w.dtype."""
    dtype = xn.dtype
    xhat = xn.astype(_F32) * rstd[:, None]
    gamma32 = gamma.astype(_F32)
    dy = dy.astype(dtype)
    g = lax.dot_general(dy, w, (((1,), (1,)), ((), ())), preferred_element_type=_F32)  # (M, K)
    dgamma = jnp.sum(g * xhat, axis=0).astype(gamma.dtype)
    g = g * gamma32
    dx = rstd[:, None] * (g - xhat * jnp.mean(g * xhat, axis=1, keepdims=True))
    if dh is not None:
        dx = dx + dh.astype(_F32)
    a = (xhat * gamma32).astype(dtype)
    dw = lax.dot_general(a, dy, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)  # (K, N)
    return dx.astype(dtype), dgamma, dw


def _dw_by_cublas(dw_a, dw_b, gamma, w, scale, dgamma, *, finish_kernel: bool):
    """dw (K, N) in w's dtype and dgamma (K,) in gamma's (the one given, from u, or s · Σ_N w ⊙ g) from XLA's GEMM g =
    dw_aᵀ @ dw_b (dw_a (M, K), dw_b (M, N)) and dw = gamma · s ⊙ g. ``finish_kernel`` (dgamma not given): cuBLAS
    computes g in two row halves and one Pallas-Triton kernel sums them into dw and dgamma (``dw_finish``)."""
    M, K = dw_a.shape
    if dgamma is None and finish_kernel:  # one kernel: parts, dw, dgamma
        parts = 2 if M % 2 == 0 else 1  # (cuBLAS's two row blocks of the M reduction, summed by the kernel)
        g = lax.dot_general(dw_a.reshape(parts, M // parts, K), dw_b.reshape(parts, M // parts, -1),
                            (((1,), (1,)), ((0,), (0,))), preferred_element_type=_F32)  # (parts, K, N)
        return dw_finish.finish_dw(g, w, gamma, jnp.reshape(scale, (1,)), interpret=mu.interpreting())
    if dgamma is not None and dw_a.dtype == jnp.bfloat16:  # (s = 1) gamma on A's columns: cuBLAS writes dw in w's
        # dtype from its float32 accumulator, no (K, N) float32 g for XLA to scale. Forward + backward µs, g then
        # XLA's scaling → this (toggle_ab_dw_gamma_on_a-h200-e0b114f.json, switch DW_GAMMA_ON_A since removed):
        # 55.4 → 43.5 at 512x1024x4096, 45.8 → 35.4 at 256x1024x4096, 29.5 → 26.5 at 128x1024x1024
        a_gamma = (dw_a.astype(_F32) * gamma.astype(_F32)).astype(dw_a.dtype)
        return lax.dot_general(a_gamma, dw_b, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype), dgamma
    g = lax.dot_general(dw_a, dw_b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)  # (K, N)
    dw = (g * (gamma.astype(_F32) * scale)[:, None]).astype(w.dtype)
    if dgamma is None:
        dgamma = (jnp.sum(g * w.astype(_F32), axis=1) * scale).astype(gamma.dtype)
    return dw, dgamma


# ---------------------------------------------------------------------------------------------------------------
# custom VJP and entry point
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rmsnorm_matmul(x, residual, gamma, w, static: _Static):
    y, _, h, _ = _forward(x, residual, gamma, w, static)
    return y if residual is None else (h, y)


def _rmsnorm_matmul_fwd(x, residual, gamma, w, static: _Static):
    y, rstd, h, sum_sq = _forward(x, residual, gamma, w, static)
    one_row = static.one_row_backward is not None  # the Triton backward's row dot takes y
    by_n = static.config.row_dot_side() == "n" and not static.config.backward_in_xla
    kept_y = y if one_row or by_n else None  # the K side and XLA's backward need no y
    return (y if residual is None else (h, y)), (x if residual is None else h, gamma, w, rstd, kept_y, sum_sq)


def _rmsnorm_matmul_bwd(static: _Static, saved, cotangent):
    xn, gamma, w, rstd, y, sum_sq = saved
    has_residual = isinstance(cotangent, tuple)  # (dh, dy) when the primal returned (h, y)
    dh, dy = cotangent if has_residual else (None, cotangent)
    if static.one_row_backward is not None:  # one row: the Triton backend's decode kernels
        triton_static = triton_fwd.Static(config=static.one_row_backward, eps=static.eps, out_dtype=static.out_dtype,
                                          interpret=mu.interpreting())
        dx, dgamma, dw = triton_bwd.backward(xn, gamma, w, rstd, y, dy, dh, static=triton_static)
    elif static.config.backward_in_xla:
        dx, dgamma, dw = _backward_by_xla(xn, gamma, w, rstd, dy, dh)
    elif static.backward_rows is not None:
        dx, dgamma, dw = _backward_padded(xn, gamma, w, rstd, y, dy, dh, static, sum_sq)
    else:
        dx, dgamma, dw = _backward(xn, gamma, w, rstd, y, dy, dh, static, sum_sq)
    return dx, (dx if has_residual else None), dgamma, dw


_rmsnorm_matmul.defvjp(_rmsnorm_matmul_fwd, _rmsnorm_matmul_bwd)


def check_config(config: Config, x, gamma, w, *, residual=None, out_dtype=None, interpret: bool = False, **_) -> None:
    """ValueError naming the constraint when ``unsupported_reason`` would, with ``config``'s tiles, or when one of
    its forms cannot take these inputs (shared memory of the dyr copy, dgamma's, gamma's side in float16; the first
    two only where our backward kernels run, not ``backward_in_xla``)."""
    reason = _input_reason(x, out_dtype, interpret) or config.unsupported_reason(x.shape[0], x.shape[1], w.shape[1])
    if x.shape[0] == 1:  # the one-row forward takes none of the forms below; the backward is Triton's
        if reason:
            raise ValueError(f"rmsnorm_matmul (mosaic): {reason}")
        return
    ours = not config.backward_in_xla
    if not reason and ours and config.dyr_in_dx:
        reason = config.dyr_smem_reason(x.dtype, residual is not None)
    if not reason and ours:
        reason = config.dgamma_reason(x.shape[0], w.shape[1], x.dtype)
    if not reason and config.gamma_on in ("x", "a") and jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        reason = (f"gamma_on={config.gamma_on!r} rounds x ⊙ gamma to x's dtype, bfloat16 only (x is "
                  f"{jnp.dtype(x.dtype)}: small x would round into subnormals; gamma_on='w' takes it)")
    if reason:
        raise ValueError(f"rmsnorm_matmul (mosaic): {reason}")


def rmsnorm_matmul(x, gamma, w, *, eps: float, residual, out_dtype, interpret: bool, config: Config):
    """x (M, K), gamma (K,), w (K, N), residual (M, K) or None, validated by the public function -> y (M, N) in
    out_dtype (= x's dtype), or (h, y); differentiable (custom VJP, three GEMMs in all; at one row the GEMV forward
    and the Triton backward). ``check_config`` first."""
    check_config(config, x, gamma, w, residual=residual, out_dtype=out_dtype, interpret=interpret)
    (M, K), N = x.shape, w.shape[1]
    rows = _config.kernel_rows(M)
    backward_rows = None
    if rows != M and _config.forward_takes_any_rows(config, x.dtype, out_dtype):  # only the backward pads
        backward_rows = rows
    elif rows != M:  # whole 8-row tiles for TMA: x (and the residual) padded with copies of its last row, so r there is
        # a real row's (finite where that row's is; float16's s = max r unchanged); their dy is zero under autodiff of
        # the slice, so they add nothing to dw or dgamma
        pad = ((0, rows - M), (0, 0))
        out = rmsnorm_matmul(jnp.pad(x, pad, mode="edge"), gamma, w, eps=eps, out_dtype=out_dtype,
                             residual=None if residual is None else jnp.pad(residual, pad, mode="edge"),
                             interpret=interpret, config=config)
        return out[:M] if residual is None else tuple(o[:M] for o in out)
    one_row_backward = None
    if M == 1:  # the Triton backend's config for the shape (its tuned entry or its table)
        one_row_backward = _config.default_config(M, K, N, x.dtype, residual=residual is not None,
                                                  on_gpu=not mu.interpreting())
    return _rmsnorm_matmul(x, residual, gamma, w, _Static(config=config, eps=float(eps),
                                                          out_dtype=jnp.dtype(out_dtype),
                                                          one_row_backward=one_row_backward,
                                                          backward_rows=backward_rows))
