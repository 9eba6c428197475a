"""RMSNorm fused into the following matmul on Hopper: three Mosaic-GPU GEMMs (``gemm.mosaic``) with hooks.

Notation: x (M, K) (h = x + residual with a residual), gamma (K,), w (K, N); r = rsqrt(mean_K(x²) + eps) per
row, float32; y = rmsnorm(x) · gamma @ w = diag(r) · x · (diag(gamma) w).

Forward, one kernel: A = the raw x tile, B = w_γ = diag(gamma) w (one XLA pass over w, rounded to w's dtype),
so both wgmma operands stay in shared memory as loaded; the epilogue scales the float32 accumulator rows by r.
r comes from one XLA row reduction over x (default), or, with ``stats_in_kernel``, from a prologue that sums the
squares of each x tile already in shared memory while the tensor cores work (the kernel then also stores r).
The normalized activations never exist.

Backward, two kernels (never the normalized activations; r from the forward; float32 statistics):
  dx kernel:  dx = r · (dy @ w_γᵀ) − r² · c · x (+ dh),  c = Σ_N(dy · y) / K per row.
              A = dy, B = w_γ read transposed (no copy); the epilogue reads the x tile prefetched by TMA at the
              start of each output tile and writes dx in place of it. c and dyr = (r / s) ⊙ dy (s = 1, or
              max r for float16) come from one XLA fusion over dy and y (default), or, with ``rowdot_in_kernel``,
              from the kernel: y streams with dy as a side input, the prologue sums dy · y over the N steps (this
              kernel's K loop, so c is complete at the epilogue) and the first column block stores dyr from the
              dy tiles it holds.
  dw kernel:  g = xᵀ @ dyr (A = x read transposed); dw = gamma · s ⊙ g and dgamma = s · Σ_N w ⊙ g, from the
              epilogue with the prefetched w tile (partial sums per column block, summed by XLA: (N / tile_n, K)).
The identity c = mean_K(gamma · (dy @ wᵀ) · n) = Σ_N(dy · y) / K (y = (n · gamma) @ w) replaces a reduction over K,
which no dx block holds whole, by one over N. Forward + backward = three GEMMs, a pass over w (shared by both
directions under one jit) and row-statistics passes of 2MK (forward) and 6MN (backward) bytes.

Numerics: x and w_γ are the only rounded operands (x is the input itself: fp16 x near 1e-6 keeps its own
precision, unlike rounding x·gamma); float32 accumulators, statistics and epilogues. dyr = (r/s) ⊙ dy is rounded
to the input dtype; for float16, s = max r keeps it within range (|dy| itself must fit). |gamma · w| must fit
the dtype (65504 for float16).

Contract (every backend module of ``norm_matmul``): ``rmsnorm_matmul(x2d, gamma, w, *, eps, residual, out_dtype,
config)``, ``default_config(M, K, N, dtype, *, residual)``, ``unsupported_reason(M, K, N, dtype, residual)``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm import pick_config
from pallas_kernels.gemm.mosaic import Fusion, MosaicGemmConfig, gemm
from pallas_kernels.gemm.mosaic import unsupported_reason as gemm_unsupported_reason

__all__ = ["MosaicRMSNormMatmulConfig", "default_config", "rmsnorm_matmul", "unsupported_reason"]

_F32 = jnp.float32
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MosaicRMSNormMatmulConfig:
    """The three GEMMs' configs and where the row statistics come from (one static argument, hashable).

    forward: y = r ⊙ (x @ w_γ), (M, K) @ (K, N).  dx: (M, N) @ (N, K), the x tile (and dh) prefetched for the
    epilogue.  dw: (K, M) @ (M, N) with the w tile prefetched for the epilogue.
    stats_in_kernel: r from the forward kernel's prologue (sums of x² over the x tiles in shared memory); False
      (default): from one XLA row reduction over x (2MK bytes read), the kernel only scaling rows in its epilogue.
    rowdot_in_kernel: c = Σ_N(dy · y) / K and dyr = (r / s) ⊙ dy from the dx kernel's prologue (y streamed beside
      dy, dyr stored by the first column block); False (default): one XLA fusion over dy and y (reads 4MN, writes
      dyr 2MN).
    Why the defaults are the XLA passes (H100, 32768x4096x4096, benchmarks/results/mosaic_gemm-h100.json): the
    prologues as written cost more than the passes they replace. The forward kernel with the statistics prologue
    took 1971 µs against 1645 µs for the same GEMM without it (+327 µs; the XLA row reduction moves 268 MB,
    >= 91 µs at 2.94 TB/s); the dx kernel with the row-dot prologue took 4585 µs against 2119 µs (+2466 µs; the
    XLA fusion moves 805 MB, >= 274 µs). The compute warpgroups load each operand tile from shared memory into
    registers beside a 128-register accumulator, between issuing and awaiting the step's wgmma.
    """

    forward: MosaicGemmConfig
    dx: MosaicGemmConfig
    dw: MosaicGemmConfig
    stats_in_kernel: bool = False
    rowdot_in_kernel: bool = False

    def __post_init__(self):
        for name in ("forward", "dx", "dw"):
            if not isinstance(getattr(self, name), MosaicGemmConfig):
                raise ValueError(f"MosaicRMSNormMatmulConfig.{name}: must be a MosaicGemmConfig, "
                                 f"got {getattr(self, name)!r}")
        for name in ("stats_in_kernel", "rowdot_in_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MosaicRMSNormMatmulConfig.{name}: must be a bool, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        out = {name: getattr(self, name).to_dict() for name in ("forward", "dx", "dw")}
        return dict(out, stats_in_kernel=self.stats_in_kernel, rowdot_in_kernel=self.rowdot_in_kernel)

    @classmethod
    def from_dict(cls, params: dict) -> "MosaicRMSNormMatmulConfig":
        return cls(**{name: MosaicGemmConfig(**v) if isinstance(v, dict) else v for name, v in params.items()})


_G = MosaicGemmConfig
# Built-in tiles (H100) per kernel, best first; each kernel takes the first whose tiles divide its shape. The
# dx kernel holds more in shared memory (the x tile, and dh with a residual, are prefetched whole; with the
# row-dot prologue y streams beside dy and dyr is staged, so that variant takes 32-wide K steps).
_FORWARD = (_G(tile_m=128, tile_n=128, tile_k=64, num_stages=4, wg_split="n"),
            _G(tile_m=64, tile_n=128, tile_k=64, num_stages=4, wg_split="m"),
            _G(tile_m=64, tile_n=64, tile_k=64, num_stages=4, wg_split="n"))
_DX = (_G(tile_m=128, tile_n=128, tile_k=32, num_stages=4, wg_split="n"),
       _G(tile_m=64, tile_n=128, tile_k=64, num_stages=3, wg_split="m"),
       _G(tile_m=64, tile_n=64, tile_k=32, num_stages=4, wg_split="n"))
_DX_RESIDUAL = (_G(tile_m=128, tile_n=64, tile_k=32, num_stages=4, wg_split="n"),
                _G(tile_m=64, tile_n=128, tile_k=32, num_stages=4, wg_split="m"),
                _G(tile_m=64, tile_n=64, tile_k=32, num_stages=4, wg_split="n"))
_DX_RESIDUAL_NO_ROWDOT = (_G(tile_m=128, tile_n=64, tile_k=64, num_stages=4, wg_split="n"),
                          _G(tile_m=64, tile_n=128, tile_k=64, num_stages=4, wg_split="m"),
                          _G(tile_m=64, tile_n=64, tile_k=64, num_stages=4, wg_split="n"))
_DX_NO_ROWDOT = (_G(tile_m=128, tile_n=128, tile_k=64, num_stages=3, wg_split="n"),
                 _G(tile_m=64, tile_n=128, tile_k=64, num_stages=4, wg_split="m"),
                 _G(tile_m=64, tile_n=64, tile_k=64, num_stages=4, wg_split="n"))
_DW = (_G(tile_m=128, tile_n=128, tile_k=64, num_stages=3, wg_split="n"),
       _G(tile_m=64, tile_n=128, tile_k=64, num_stages=4, wg_split="m"),
       _G(tile_m=64, tile_n=64, tile_k=64, num_stages=4, wg_split="n"))


def default_config(M: int, K: int, N: int, dtype=jnp.bfloat16, *, residual: bool = False,
                   stats_in_kernel: bool = False, rowdot_in_kernel: bool = False,
                   prologue_wg: str = "compute") -> MosaicRMSNormMatmulConfig:
    """The built-in tiles for this shape: per kernel the first candidate whose tiles divide its GEMM (forward
    (M, N, K), dx (M, K, N), dw (K, N, M)); ``unsupported_reason`` names what divides nothing.
    prologue_wg "dedicated": the kernels with an in-kernel prologue (stats_in_kernel: forward; rowdot_in_kernel: dx)
    run it in a fourth warpgroup beside the MMA warpgroups (``gemm.specialized``; tiles with wg_split "n" only)."""
    del dtype
    if not rowdot_in_kernel:
        dx = _DX_RESIDUAL_NO_ROWDOT if residual else _DX_NO_ROWDOT
    else:
        dx = _DX_RESIDUAL if residual else _DX
    forward, dx = pick_config(M, N, K, _FORWARD), pick_config(M, K, N, dx)
    if prologue_wg == "dedicated":
        own = dict(pipeline="own", prologue_wg="dedicated")
        forward = dataclasses.replace(forward, **own) if stats_in_kernel and forward.wg_split == "n" else forward
        dx = dataclasses.replace(dx, **own) if rowdot_in_kernel and dx.wg_split == "n" else dx
    elif prologue_wg != "compute":
        raise ValueError(f"prologue_wg: must be 'compute' or 'dedicated', got {prologue_wg!r}")
    return MosaicRMSNormMatmulConfig(forward=forward, dx=dx, dw=pick_config(K, N, M, _DW),
                                     stats_in_kernel=stats_in_kernel, rowdot_in_kernel=rowdot_in_kernel)


def unsupported_reason(M: int, K: int, N: int, dtype, residual: bool = False, *,
                       config: MosaicRMSNormMatmulConfig | None = None, out_dtype=None) -> str | None:
    """None when this backend runs these arguments; else one sentence naming the constraint (no partial tiles:
    M, K, N multiples of the kernels' tiles, so tiny M goes elsewhere; 16-bit inputs; y in x's dtype)."""
    dtype = jnp.dtype(dtype)
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not supported by the Mosaic backend (bfloat16 and float16 only)"
    if out_dtype is not None and jnp.dtype(out_dtype) != dtype:
        return f"out_dtype={jnp.dtype(out_dtype)} must equal x's dtype {dtype} on the Mosaic backend"
    config = config or default_config(M, K, N, dtype, residual=residual)
    for kernel, names, cfg in (("forward", "MNK", config.forward), ("dx", "MKN", config.dx),
                               ("dw", "KNM", config.dw)):
        sizes = dict(M=M, K=K, N=N)
        reason = gemm_unsupported_reason(*(sizes[n] for n in names), cfg, names=tuple(names))
        if reason:
            return f"{reason} ({kernel} kernel)"
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    config: MosaicRMSNormMatmulConfig
    eps: float
    out_dtype: jnp.dtype


def _rows_zero(tile_m: int) -> jax.Array:
    return mu.layout_cast(jnp.zeros((tile_m,), _F32), mu.ROWS)


def _bcast_rows(vec: jax.Array, shape) -> jax.Array:
    return lax.broadcast_in_dim(vec, shape, [0])


def _scaled_w(gamma, w):
    """w_γ = diag(gamma) w in w's dtype: one XLA pass over w."""
    return (gamma.astype(_F32)[:, None] * w.astype(_F32)).astype(w.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------
def _forward_fusion(M: int, K: int, eps: float, tile_m: int, stats_in_kernel: bool) -> Fusion:
    """Prologue: Σ x² over each x tile's columns (float32); epilogue: r, y = r ⊙ acc, and r stored (M,).
    Without stats_in_kernel: r comes in (M,) and the epilogue only scales the rows."""
    if not stats_in_kernel:
        return Fusion(inputs=("rstd",), prologue_init=lambda ctx: ctx.load_rows("rstd"),
                      epilogue=lambda ctx, acc, rstd: (acc * _bcast_rows(rstd, acc.shape), {}))

    def step(ctx, x_ref, side_refs, sum_sq):
        del ctx, side_refs
        x = mu.load(x_ref, layout=mu.TILE).astype(_F32)  # (tile_m, tile_k)
        return sum_sq + jnp.sum(x * x, axis=1)

    def epilogue(ctx, acc, sum_sq):
        del ctx
        rstd = lax.rsqrt(sum_sq * (1.0 / K) + eps)  # (tile_m,) float32
        return acc * _bcast_rows(rstd, acc.shape), {"rstd": rstd}

    return Fusion(outputs=(("rstd", jax.ShapeDtypeStruct((M,), _F32)),), handoff_rows=1,
                  prologue_init=lambda ctx: _rows_zero(tile_m), prologue_step=step, epilogue=epilogue)


def _forward(x, residual, gamma, w, static: _Static):
    """x, residual (M, K); gamma (K,); w (K, N) -> y (M, N), r (M,) float32, h (M, K) or None."""
    M, K = x.shape
    h = None
    if residual is not None:  # h = x + residual rounded to x's dtype: one XLA pass, written once
        h = (x.astype(_F32) + residual.astype(_F32)).astype(x.dtype)
        x = h
    cfg = static.config.forward
    fusion = _forward_fusion(M, K, static.eps, cfg.tile_m, static.config.stats_in_kernel)
    if static.config.stats_in_kernel:
        y, rstd = gemm(x, _scaled_w(gamma, w), config=cfg, out_dtype=static.out_dtype, fusion=fusion,
                       name="rmsnorm_matmul_fwd")
    else:  # one XLA row reduction over x
        x32 = x.astype(_F32)
        rstd = lax.rsqrt(jnp.sum(x32 * x32, axis=1) * (1.0 / K) + static.eps)
        (y,) = gemm(x, _scaled_w(gamma, w), config=cfg, out_dtype=static.out_dtype, fusion=fusion,
                    arrays=dict(rstd=rstd), name="rmsnorm_matmul_fwd")
    return y, rstd, h


# ---------------------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------------------
def _dx_fusion(M: int, K: int, N: int, dtype, cfg: MosaicGemmConfig, has_dh: bool, rowdot_in_kernel: bool
               ) -> Fusion:
    """dx = r ⊙ (dy @ w_γᵀ) − r²·c ⊙ x (+ dh), c = Σ_N(dy · y) / K from the prologue; first column block also
    stores dyr = (r / s) ⊙ dy. Without rowdot_in_kernel: Σ_N(dy · y) comes in (M,) ("row_dot")."""
    tile_m, tile_k = cfg.tile_m, cfg.tile_k
    tiles = ("x", "dh") if has_dh else ("x",)
    stage_rows = cfg.cta_m  # both warpgroups' rows (wg_split "m") or the shared rows ("n", warpgroup 0 stores)

    def init(ctx):
        return _rows_zero(tile_m), ctx.load_rows("rstd"), ctx.load_rows("rstd_scaled")

    def step(ctx, dy_ref, side_refs, carry):
        row_dot, rstd, rstd_scaled = carry
        dy = mu.load(dy_ref, layout=mu.TILE).astype(_F32)  # (tile_m, tile_k): dy[rows, step·tile_k + ...]
        y = mu.load(side_refs[0], layout=mu.TILE).astype(_F32)
        row_dot = row_dot + jnp.sum(dy * y, axis=1)

        @pl.when(ctx.col_block == 0)
        def _store_dyr():
            slot = lax.rem(ctx.step, 2)
            stage = ctx.refs["dyr_stage"].at[slot, pl.ds(ctx.block_row0, tile_m)]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's store of two steps ago has read it
            stage[...] = (dy * _bcast_rows(rstd_scaled, dy.shape)).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage, ctx.refs["dyr"].at[ctx.rows, pl.ds(ctx.step * tile_k, tile_k)])

        return row_dot, rstd, rstd_scaled

    def epilogue(ctx, acc, carry):
        row_dot, rstd, _ = carry
        coef = rstd * rstd * row_dot * (1.0 / K)  # r² · c
        dx = acc * _bcast_rows(rstd, acc.shape) - ctx.load_tile("x") * _bcast_rows(coef, acc.shape)
        if has_dh:
            dx = dx + ctx.load_tile("dh")
        return dx, {}

    if not rowdot_in_kernel:
        return Fusion(tile_inputs=tiles, inputs=("rstd", "row_dot"), store_in="x",
                      prologue_init=lambda ctx: (ctx.load_rows("row_dot"), ctx.load_rows("rstd"), None),
                      epilogue=epilogue)
    stage = plgpu.SMEM((2, stage_rows, tile_k), dtype, transforms=mu.smem_transforms(tile_k, dtype))
    return Fusion(side_inputs=("y",), tile_inputs=tiles, inputs=("rstd", "rstd_scaled"),
                  outputs=(("dyr", jax.ShapeDtypeStruct((M, N), dtype)),), scratch=(("dyr_stage", stage),),
                  store_in="x", handoff_rows=3, prologue_init=init, prologue_step=step, epilogue=epilogue)


def _dw_fusion(K: int, N: int, cfg: MosaicGemmConfig) -> Fusion:
    """g = xᵀ @ dyr; dw = (gamma · s) ⊙ g and per-column-block partial dgamma Σ w ⊙ g (s applied by the caller)."""

    def epilogue(ctx, acc, gamma_s):
        partial = jnp.sum(ctx.load_tile("w") * acc, axis=1)  # (tile_m,) over this block's tile_n columns
        return acc * _bcast_rows(gamma_s, acc.shape), {"dgamma_parts": partial}

    return Fusion(tile_inputs=("w",), inputs=("gamma_s",),
                  outputs=(("dgamma_parts", jax.ShapeDtypeStruct((N // cfg.tile_n, K), _F32)),), store_in="w",
                  prologue_init=lambda ctx: ctx.load_rows("gamma_s"), epilogue=epilogue)


def _backward(xn, gamma, w, rstd, y, dy, dh, static: _Static):
    """xn: the normalized input (h with a residual) (M, K). Returns dx (M, K) in xn.dtype (including dh), dgamma
    (K,) in gamma.dtype, dw (K, N) in w.dtype."""
    M, K = xn.shape
    N = w.shape[1]
    cfg = static.config
    dtype = xn.dtype
    # float16: dyr = (r / s) ⊙ dy with s = max r stays <= |dy|; bfloat16 has float32's range (s = 1).
    scale = jnp.max(rstd) if dtype == jnp.float16 else jnp.ones((), _F32)
    dy = dy.astype(dtype)
    fusion = _dx_fusion(M, K, N, dtype, cfg.dx, dh is not None, cfg.rowdot_in_kernel)
    arrays = dict(x=xn, rstd=rstd) | ({} if dh is None else dict(dh=dh.astype(dtype)))
    if cfg.rowdot_in_kernel:
        arrays.update(y=y.astype(dtype), rstd_scaled=rstd / scale)
        dx, dyr = gemm(dy, _scaled_w(gamma, w), transpose_b=True, config=cfg.dx, out_dtype=dtype, fusion=fusion,
                       arrays=arrays, name="rmsnorm_matmul_dx")
    else:  # one XLA fusion reads dy and y: Σ_N(dy · y) and dyr
        dy32 = dy.astype(_F32)
        arrays["row_dot"] = jnp.sum(dy32 * y.astype(_F32), axis=1)
        dyr = (dy32 * (rstd / scale)[:, None]).astype(dtype)
        (dx,) = gemm(dy, _scaled_w(gamma, w), transpose_b=True, config=cfg.dx, out_dtype=dtype, fusion=fusion,
                     arrays=arrays, name="rmsnorm_matmul_dx")
    dw, dgamma_parts = gemm(xn, dyr, transpose_a=True, config=cfg.dw, out_dtype=w.dtype,
                            fusion=_dw_fusion(K, N, cfg.dw), arrays=dict(w=w, gamma_s=gamma.astype(_F32) * scale),
                            name="rmsnorm_matmul_dw")
    dgamma = (jnp.sum(dgamma_parts, axis=0) * scale).astype(gamma.dtype)
    return dx, dgamma, dw


# ---------------------------------------------------------------------------------------------------------------
# custom VJP and entry point
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rmsnorm_matmul(x, residual, gamma, w, static: _Static):
    y, _, h = _forward(x, residual, gamma, w, static)
    return y if residual is None else (h, y)


def _rmsnorm_matmul_fwd(x, residual, gamma, w, static: _Static):
    y, rstd, h = _forward(x, residual, gamma, w, static)
    return (y if residual is None else (h, y)), (x if residual is None else h, gamma, w, rstd, y)


def _rmsnorm_matmul_bwd(static: _Static, saved, cotangent):
    xn, gamma, w, rstd, y = saved
    has_residual = isinstance(cotangent, tuple)  # (dh, dy) when the primal returned (h, y)
    dh, dy = cotangent if has_residual else (None, cotangent)
    dx, dgamma, dw = _backward(xn, gamma, w, rstd, y, dy, dh, static)
    return dx, (dx if has_residual else None), dgamma, dw


_rmsnorm_matmul.defvjp(_rmsnorm_matmul_fwd, _rmsnorm_matmul_bwd)


def rmsnorm_matmul(x2d: jax.Array, gamma: jax.Array, w: jax.Array, *, eps: float, residual: jax.Array | None = None,
                   out_dtype=None, config: MosaicRMSNormMatmulConfig | None = None):
    """rmsnorm(x2d) · gamma @ w on Hopper (Mosaic GPU); differentiable (custom VJP, three GEMMs in all).

    x2d (M, K) and w (K, N) of one 16-bit dtype, gamma (K,); residual (M, K) optional: h = x2d + residual
    (rounded to x2d's dtype) is normalized and returned. Returns y (M, N) in out_dtype (= x2d's dtype), or
    (h, y). ValueError when ``unsupported_reason`` names a constraint or eps < 0. Validation of ranks and
    dtypes beyond that is the public function's."""
    if not eps >= 0:  # also catches NaN
        raise ValueError(f"eps: must be >= 0, got {eps!r}")
    M, K = x2d.shape
    N = w.shape[1]
    out_dtype = jnp.dtype(x2d.dtype if out_dtype is None else out_dtype)
    config = config or default_config(M, K, N, x2d.dtype, residual=residual is not None)
    reason = unsupported_reason(M, K, N, x2d.dtype, residual is not None, config=config, out_dtype=out_dtype)
    if reason:
        raise ValueError(f"rmsnorm_matmul (mosaic): {reason}")
    return _rmsnorm_matmul(x2d, residual, gamma, w, _Static(config=config, eps=float(eps), out_dtype=out_dtype))
