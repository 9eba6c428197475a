"""Linear cross-entropy over token chunks, gradients computed in the forward: 3 GEMMs, no (B, V) buffer.

Shape notation: B tokens, H hidden size, V vocabulary, Bc tokens per chunk (``config.chunk_rows``). A backend of
``pallas_kernels.cross_entropy`` (inputs validated by the public function; ``unsupported_reason`` is None for all
of them). Liger-Kernel's design, with XLA's GEMMs (cuBLAS on GPU) and one Pallas-Triton kernel per chunk for the
vocabulary-wide row work:

  per chunk c of Bc rows:  logits_c = h_c @ w                       (Bc, V) compute dtype, GEMM 1
                           lse, label logit; dlogits_c in place      one Pallas kernel (``_row_kernel``)
                           dh[c] = dlogits_c @ wᵀ                    (Bc, H), GEMM 2, written once
                           dw += h_cᵀ @ dlogits_c                    (H, V), GEMM 3, accumulated over chunks

Paths. ``reduction="mean"|"sum"`` is a scalar ``custom_vjp``: its primal (evaluation, no gradient) runs GEMM 1 and
the kernel's statistics pass only (1 GEMM, like XLA's forward); its forward rule runs all three GEMMs with
dlogits_c already scaled by the row weight (1/count or 1, 0 for ignored rows) and keeps dh (B, H) and dw (H, V)
as residuals; the backward rule multiplies them by the scalar cotangent (a constant 1 under ``value_and_grad``,
which XLA folds away). ``reduction="none"`` needs the per-row cotangent inside the GEMMs: its forward rule is the
1-GEMM path keeping lse (B,), its backward recomputes logits_c (4 GEMMs in all, as today's Triton design).

Cost model (F = 2·B·H·V FLOPs, one GEMM of the problem; bytes at itemsize s, n = B / Bc chunks):
  evaluation: 1 F. HBM: w read n times (L2 absorbs little), logits written once and read once (2·B·V·s).
  value and gradient: 3 F. The row kernel reads each chunk's logits twice (statistics, then dlogits; the second
  pass walks the tiles backwards so its first tiles are the likeliest still in L2) and writes dlogits over them:
  3·B·V·s bytes. The dw GEMM reads and writes dw (H·V·s each) at every chunk but the first (XLA folds the add into
  the cuBLAS call as beta = 1): 2·(n − 1)·H·V·s bytes, overlapped with its 2·Bc·H·V FLOPs when Bc·H / (2·H + Bc)
  exceeds the machine's FLOP/byte ratio (about 270 on an H100), i.e. Bc >~ 600 at H = 4096.
Stored (temporaries): one chunk's logits Bc·V·s (dlogits overwrite them), the chunk's (Bc, H) slices of h and dh,
per-row statistics, XLA's 32 MiB GEMM workspace; dh and dw are the outputs themselves (updated in place). dw accumulates in w's dtype by default: each chunk's GEMM
adds in float32 and rounds once, so a bf16 dw carries about sqrt(n) bf16 roundings (``dw_dtype="float32"`` keeps
an H·V·4 accumulator instead: better dw, far more memory). ``chunk_rows=None`` picks the largest Bc (a multiple
of 128, dividing B where it can) whose temporaries stay under 5% of what the plain XLA loss holds (B·V·(s + 4)
bytes: compute-dtype logits plus their float32 copy), so Bc ≈ 0.15·B·V / (V + 2·H) in bf16, less the workspace.

Measured (H100, bf16, CUPTI, XLA in the same run; benchmarks/results/cross_entropy_chunked-*-h100.json): fwd+bwd
1.02-1.08x XLA at 8192x4096x128256 (two runs), 1.046x at 16384x4096x32000, 0.93x at 4096x2048x256000;
evaluation 0.97-1.01x; temporaries 3.7-5.0% of XLA's. At 8192x4096x128256 the GEMMs take 34.4 ms (XLA's three: 33.2-34.7),
the dw GEMMs 12.8 of them (XLA's one: 10.7; K = Bc = 1024 plus the beta read), the row kernel 2.6 ms (2.5 TB/s).
At 4096x2048x256000 the 5% bound leaves Bc = 512 and the dw GEMMs take 9.0 ms against XLA's 5.4: that is the loss.

Chunks: the last chunk starts at B − Bc and runs first, outside the loop (its dw GEMM initializes dw: no memset,
no read); rows it shares with the chunk before get weight 0 there and are written again by that chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu

__all__ = ["ChunkedCrossEntropyConfig", "Config", "default_config", "linear_cross_entropy", "unsupported_reason"]

_M_INIT = -1e30  # running max before any column: finite, so exp(m_old - m_new) never sees inf - inf
_TEMP_FRACTION = 0.05  # temporaries at most this fraction of the plain XLA loss's (the bound)
_FIXED_TEMP_BYTES = 32 * 2**20  # XLA's cuBLAS workspace (s8[33554432] in the H100 programs)
_CHOICES = {"dw_dtype": ("param", "float32"), "logits_dtype": ("compute", "float32"), "row_pass": ("pallas", "xla")}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ChunkedCrossEntropyConfig:
    """Chunking, the row kernel's tiles, and the precision choices (one static, hashable argument).

    Attributes:
      chunk_rows: Bc, tokens per chunk (the (Bc, V) logits are the largest temporary); None: from the memory rule
        in the module docstring, resolved at call time.
      rows_per_program, block_v: the row kernel's tile: each program owns rows_per_program rows (a power of two)
        and walks the vocabulary in (rows_per_program, block_v) tiles.
      num_warps, num_stages: Triton launch parameters of the row kernel.
      dw_dtype: "param" accumulates dw across chunks in w's dtype; "float32" in an (H, V) float32 buffer.
      logits_dtype: "compute": GEMM 1 writes logits in the input dtype (as XLA's plain loss does); "float32":
        float32 logits (twice the bytes; dlogits then go to a separate buffer in the input dtype).
      row_pass: "pallas" (the row kernel) or "xla" (the same math as jnp; XLA fuses it as it can).
    """

    # Row-kernel defaults: the fastest of four tilings timed alone on the H100 at the shapes
    # (benchmarks/results/cross_entropy_chunked-rows-h100.json): one row per program gives a chunk of 512-1024 rows
    # enough programs to keep loads in flight (4 rows × 2048: 345 µs per 1024×128256 chunk; 1 × 4096: 314 µs).
    chunk_rows: int | None = None
    rows_per_program: int = 1
    block_v: int = 4096
    num_warps: int = 4
    num_stages: int = 1
    dw_dtype: str = "param"
    logits_dtype: str = "compute"
    row_pass: str = "pallas"

    def __post_init__(self):
        tu.check_launch_fields(self)  # block_v, num_warps, num_stages
        cls = type(self).__name__
        if self.chunk_rows is not None and (not _is_int(self.chunk_rows) or self.chunk_rows < 1):
            raise ValueError(f"{cls}.chunk_rows: must be None or a positive int, got {self.chunk_rows!r}")
        r = self.rows_per_program
        if not _is_int(r) or r < 1 or r & (r - 1):
            raise ValueError(f"{cls}.rows_per_program: must be a power of two >= 1, got {r!r}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{cls}.{name}: must be one of {allowed}, got {getattr(self, name)!r}")


Config = ChunkedCrossEntropyConfig

# CPU runs the row kernel in interpret mode: small tiles and chunks, so tiny test shapes cover several chunks,
# row blocks and vocabulary tiles.
_CPU_CONFIG = ChunkedCrossEntropyConfig(chunk_rows=16, rows_per_program=4, block_v=32, num_warps=4)


def chunk_rows_for(B: int, H: int, V: int, dtype) -> int:
    """Bc from the memory rule: one chunk's logits, its (Bc, H) slices of h and dh and XLA's 32 MiB GEMM workspace
    within 5% of the plain XLA loss's B·V·(s + 4) bytes, Bc a multiple of 128 (at least 128); among those the
    largest dividing B down to half the limit (no row computed twice), else B split evenly; B when it fits."""
    s = jnp.dtype(dtype).itemsize
    budget = _TEMP_FRACTION * B * V * (s + 4) - _FIXED_TEMP_BYTES
    limit = max(128, int(budget // ((V + 2 * H) * s)) // 128 * 128)
    if B <= limit:
        return B
    for rows in range(limit, limit // 2 - 1, -128):
        if B % rows == 0:
            return rows
    return min(limit, pl.cdiv(pl.cdiv(B, pl.cdiv(B, limit)), 128) * 128)


def default_config(B: int, H: int, V: int, dtype, *, on_gpu: bool | None = None) -> ChunkedCrossEntropyConfig:
    """The config for a (B, H) × (H, V) problem in ``dtype``, chunk_rows resolved: the GPU defaults (H100: row
    kernel tiles 1 × 4096, 4 warps) with Bc from ``chunk_rows_for``, or the small interpret-mode config on CPU."""
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    if not on_gpu:
        return dataclasses.replace(_CPU_CONFIG, chunk_rows=min(B, _CPU_CONFIG.chunk_rows))
    return ChunkedCrossEntropyConfig(chunk_rows=chunk_rows_for(B, H, V, dtype))


def unsupported_reason(h, w, labels, **options) -> str | None:
    """None: this backend runs every input the public function accepts (all dtypes, reductions and options)."""
    del h, w, labels, options
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call; config.chunk_rows is resolved (<= B)."""

    config: ChunkedCrossEntropyConfig
    reduction: str
    ignore_index: int
    z_loss: float
    logit_soft_cap: float | None
    interpret: bool


# ---------------------------------------------------------------------------------------------------------------
# The row pass over one chunk's logits: statistics (lse, label logit) and/or dlogits
# ---------------------------------------------------------------------------------------------------------------
def _soft_cap(x, cap):
    """(z, dz/dx) for z = cap·tanh(x / cap); (x, None) without a cap."""
    if cap is None:
        return x, None
    t = jnp.tanh(x * (1.0 / cap))
    return cap * t, 1.0 - t * t


def _and(a, b):
    return b if a is None else (a if b is None else jnp.logical_and(a, b))


def _row_kernel(*refs, R: int, V: int, st: _Static, stats: bool, grad: bool):
    """Program i: rows [i·r, (i+1)·r) of an (R, V) logits chunk. Pass 1 (stats): online max / sum-exp and the label
    logit over the vocabulary tiles, writes lse and the label logit (R,) float32. Pass 2 (grad): dlogits = g·(softmax
    ·(1 + 2·z_loss·lse) − onehot)·dz/dx, stored over the logits when aliased. Refs, in order: x (R, V), labels (R,),
    [g (R,) if grad], [lse (R,) if grad and not stats]; outputs [dl (R, V) if grad], [lse, zy (R,) if stats]."""
    it = iter(refs)
    x_ref, labels_ref = next(it), next(it)
    g_ref = next(it) if grad else None
    lse_in_ref = next(it) if grad and not stats else None
    dl_ref = next(it) if grad else None
    lse_ref, zy_ref = (next(it), next(it)) if stats else (None, None)
    cfg = st.config
    br, bv = cfg.rows_per_program, cfg.block_v
    n_tiles = pl.cdiv(V, bv)
    r0 = pl.program_id(0) * br
    rows = r0 + jnp.arange(br, dtype=jnp.int32)
    row_ok = None if R % br == 0 else rows < R
    labels = tu.load(labels_ref, (pl.ds(r0, br),), mask=row_ok, other=-1)  # (br,)

    def tile(j):
        cols = j * bv + jnp.arange(bv, dtype=jnp.int32)
        col_ok = None if V % bv == 0 else cols < V
        mask = _and(None if row_ok is None else row_ok[:, None], None if col_ok is None else col_ok[None, :])
        x = tu.load(x_ref, (pl.ds(r0, br), pl.ds(j * bv, bv)), mask=mask).astype(jnp.float32)
        z, dz_dx = _soft_cap(x, st.logit_soft_cap)
        return cols, col_ok, mask, z, dz_dx

    if stats:
        def pass1(j, carry):
            m, s, zy = carry
            cols, col_ok, _, z, _ = tile(j)
            if col_ok is not None:
                z = jnp.where(col_ok[None, :], z, -jnp.inf)  # columns past V: exp(-inf) = 0
            m_new = jnp.maximum(m, jnp.max(z, axis=1))
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
            zy = zy + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
            return m_new, s, zy

        zeros = jnp.zeros((br,), jnp.float32)
        m, s, zy = lax.fori_loop(0, n_tiles, pass1, (jnp.full((br,), _M_INIT, jnp.float32), zeros, zeros))
        lse = m + jnp.log(s)
        tu.store(lse_ref, (pl.ds(r0, br),), lse, mask=row_ok)
        tu.store(zy_ref, (pl.ds(r0, br),), zy, mask=row_ok)
    if grad:
        if not stats:
            lse = tu.load(lse_in_ref, (pl.ds(r0, br),), mask=row_ok)
        g = tu.load(g_ref, (pl.ds(r0, br),), mask=row_ok)  # rows past R: 0, not stored
        lse_scale = (1.0 + 2.0 * st.z_loss * lse)[:, None] if st.z_loss else None

        def pass2(j, carry):
            cols, _, mask, z, dz_dx = tile(n_tiles - 1 - j)  # backwards: pass 1's last tiles first (L2)
            p = jnp.exp(z - lse[:, None])
            if lse_scale is not None:
                p = p * lse_scale  # d(z_loss·lse²)/dz = 2·z_loss·lse·softmax
            dz = p - (cols[None, :] == labels[:, None]).astype(jnp.float32)
            if dz_dx is not None:
                dz = dz * dz_dx
            tu.store(dl_ref, (pl.ds(r0, br), pl.ds((n_tiles - 1 - j) * bv, bv)),
                     (dz * g[:, None]).astype(dl_ref.dtype), mask=mask)
            return carry

        lax.fori_loop(0, n_tiles, pass2, 0)


def _row_pass_pallas(x, labels, g, lse, st: _Static, *, dl_dtype):
    """(dl or None, lse, zy or None) of one chunk: x (R, V) logits, labels (R,) int32, g (R,) float32 row weights
    (None: statistics only), lse (R,) float32 (None: computed here)."""
    R, V = x.shape
    stats, grad = lse is None, g is not None
    cfg = st.config
    f32 = jax.ShapeDtypeStruct((R,), jnp.float32)
    out_shape = ([jax.ShapeDtypeStruct((R, V), dl_dtype)] if grad else []) + ([f32, f32] if stats else [])
    inputs = [x, labels] + ([g] if grad else []) + ([lse] if grad and not stats else [])
    outs = tu.pallas_call(
        functools.partial(_row_kernel, R=R, V=V, st=st, stats=stats, grad=grad),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=st.interpret,
        grid=(pl.cdiv(R, cfg.rows_per_program),), out_shape=out_shape,
        input_output_aliases={0: 0} if grad and x.dtype == dl_dtype else {},  # dlogits over the logits
        name="chunked_cross_entropy_rows",
    )(*inputs)
    dl = outs[0] if grad else None
    return (dl, outs[-2], outs[-1]) if stats else (dl, lse, None)


def _row_pass_xla(x, labels, g, lse, st: _Static, *, dl_dtype):
    """The same as ``_row_pass_pallas`` in jnp (XLA fuses what it can)."""
    V = x.shape[1]
    z, dz_dx = _soft_cap(x.astype(jnp.float32), st.logit_soft_cap)
    zy = None
    if lse is None:
        lse = jax.nn.logsumexp(z, axis=1)
        zy = jnp.take_along_axis(z, jnp.clip(labels, 0, V - 1)[:, None], axis=1)[:, 0]
    if g is None:
        return None, lse, zy
    p = jnp.exp(z - lse[:, None])
    if st.z_loss:
        p = p * (1.0 + 2.0 * st.z_loss * lse)[:, None]
    dz = p - (labels[:, None] == lax.broadcasted_iota(jnp.int32, z.shape, 1)).astype(jnp.float32)
    if dz_dx is not None:
        dz = dz * dz_dx
    return (dz * g[:, None]).astype(dl_dtype), lse, zy


def _row_pass(x, labels, g, lse, st: _Static, *, dl_dtype):
    fn = _row_pass_pallas if st.config.row_pass == "pallas" else _row_pass_xla
    return fn(x, labels, g, lse, st, dl_dtype=dl_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Chunk loops
# ---------------------------------------------------------------------------------------------------------------
def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _logits(h_c, w, st: _Static):
    """GEMM 1: (Bc, H) @ (H, V) -> (Bc, V) in the compute dtype (or float32), float32 accumulation."""
    dtype = jnp.float32 if st.config.logits_dtype == "float32" else h_c.dtype
    return lax.dot_general(h_c, w, (((1,), (0,)), ((), ())), precision=_precision(h_c.dtype),
                           preferred_element_type=dtype)


def _label_status(labels, V: int, ignore_index: int):
    """(valid, bad) (B,) bool: rows that count, and counted rows whose label lies outside [0, V)."""
    valid = labels != ignore_index
    return valid, valid & ((labels < 0) | (labels >= V))


def _row_losses_forward(h, w, labels, st: _Static):
    """Per-row losses (B,) float32 (0 for ignored rows, NaN for bad labels) and lse (B,): GEMM 1 and the statistics
    pass per chunk. The first step (the last chunk) writes rows a later step writes again with the same values."""
    B, V = h.shape[0], w.shape[1]
    Bc = st.config.chunk_rows

    def step(i, carry):
        row_loss, lses = carry
        start = jnp.where(i == 0, B - Bc, (i - 1) * Bc)
        y_c = lax.dynamic_slice_in_dim(labels, start, Bc)
        _, lse, zy = _row_pass(_logits(lax.dynamic_slice_in_dim(h, start, Bc), w, st), y_c, None, None, st,
                               dl_dtype=h.dtype)
        per_row = lse - zy + st.z_loss * lse * lse if st.z_loss else lse - zy
        return (lax.dynamic_update_slice_in_dim(row_loss, per_row, start, 0),
                lax.dynamic_update_slice_in_dim(lses, lse, start, 0))

    zeros = jnp.zeros((B,), jnp.float32)
    row_loss, lse = lax.fori_loop(0, pl.cdiv(B, Bc), step, (zeros, zeros))
    valid, bad = _label_status(labels, V, st.ignore_index)
    return jnp.where(bad, jnp.nan, jnp.where(valid, row_loss, 0.0)), lse


def _chunk_gradients(h, w, labels, g, lse, st: _Static):
    """(total, dh, dw): total = Σ g·row loss (float32; 0 when lse is given), dh (B, H) in h's dtype, dw (H, V) in
    w's dtype, for row weights g (B,) float32. lse None: the forward rule (statistics and dlogits from one kernel
    per chunk); lse (B,) given: the "none" backward (the kernel's dlogits pass only). 3 GEMMs per chunk."""
    B, V = h.shape[0], w.shape[1]
    Bc = st.config.chunk_rows
    n = pl.cdiv(B, Bc)
    shared = n * Bc - B  # leading rows of the last chunk that the chunk before it also covers
    dw_dtype = jnp.float32 if st.config.dw_dtype == "float32" else w.dtype
    prec = _precision(h.dtype)

    def step(start, carry, first: bool):
        h_c = lax.dynamic_slice_in_dim(h, start, Bc)  # (Bc, H)
        y_c, g_c = (lax.dynamic_slice_in_dim(a, start, Bc) for a in (labels, g))
        if first and shared:
            g_c = jnp.where(jnp.arange(Bc) >= shared, g_c, 0.0)  # counted by the next step
        lse_c = None if lse is None else lax.dynamic_slice_in_dim(lse, start, Bc)
        dl, lse_c, zy = _row_pass(_logits(h_c, w, st), y_c, g_c, lse_c, st, dl_dtype=h.dtype)  # dl (Bc, V)
        dh_c = lax.dot_general(dl, w, (((1,), (1,)), ((), ())), precision=prec,
                               preferred_element_type=h.dtype)  # (Bc, H) = dl wᵀ
        dw_c = lax.dot_general(h_c, dl, (((0,), (0,)), ((), ())), precision=prec,
                               preferred_element_type=dw_dtype)  # (H, V) = h_cᵀ dl
        total = jnp.float32(0.0)  # the "none" backward has no loss to add up
        if zy is not None:
            total = jnp.sum(g_c * (lse_c - zy + st.z_loss * lse_c * lse_c if st.z_loss else lse_c - zy))
        if first:
            return total, lax.dynamic_update_slice_in_dim(jnp.zeros_like(h), dh_c, start, 0), dw_c
        old_total, dh, dw = carry
        return old_total + total, lax.dynamic_update_slice_in_dim(dh, dh_c, start, 0), dw + dw_c

    carry = step(B - Bc, None, first=True)
    total, dh, dw = lax.fori_loop(1, n, lambda i, c: step((i - 1) * Bc, c, first=False), carry)
    return total, dh, dw.astype(w.dtype)


# ---------------------------------------------------------------------------------------------------------------
# custom VJPs
# ---------------------------------------------------------------------------------------------------------------
def _row_weights(labels, V: int, st: _Static, scale):
    """g (B,) float32: scale for counted rows, 0 for ignored ones, NaN for bad labels (never a plausible value)."""
    valid, bad = _label_status(labels, V, st.ignore_index)
    return jnp.where(bad, jnp.nan, jnp.where(valid, scale, 0.0)).astype(jnp.float32)


def _reduction_scale(labels, st: _Static):
    if st.reduction == "sum":
        return jnp.float32(1.0)
    count = jnp.sum(labels != st.ignore_index)
    return 1.0 / jnp.maximum(count, 1).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _reduced_loss(h, w, labels, st: _Static):
    """Scalar mean/sum loss; evaluation costs 1 GEMM (the primal), gradients 3 (the forward rule)."""
    row_loss, _ = _row_losses_forward(h, w, labels, st)
    return jnp.sum(row_loss) * _reduction_scale(labels, st)


def _reduced_loss_fwd(h, w, labels, st: _Static):
    g = _row_weights(labels, w.shape[1], st, _reduction_scale(labels, st))
    total, dh, dw = _chunk_gradients(h, w, labels, g, None, st)
    return total, (dh, dw)


def _reduced_loss_bwd(st: _Static, residuals, ct):
    dh, dw = residuals
    ct = ct.astype(jnp.float32)  # a constant 1 under value_and_grad: XLA removes both products
    return (dh * ct).astype(dh.dtype), (dw * ct).astype(dw.dtype), None


_reduced_loss.defvjp(_reduced_loss_fwd, _reduced_loss_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _row_losses(h, w, labels, st: _Static):
    """(B,) per-row losses; gradients recompute the logits chunk by chunk with the per-row cotangent (4 GEMMs)."""
    return _row_losses_forward(h, w, labels, st)[0]


def _row_losses_fwd(h, w, labels, st: _Static):
    row_loss, lse = _row_losses_forward(h, w, labels, st)
    return row_loss, (h, w, labels, lse)


def _row_losses_bwd(st: _Static, residuals, ct):
    h, w, labels, lse = residuals
    g = _row_weights(labels, w.shape[1], st, ct.astype(jnp.float32))
    _, dh, dw = _chunk_gradients(h, w, labels, g, lse, st)
    return dh, dw, None


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


def linear_cross_entropy(h, w, labels, *, reduction: str, ignore_index: int, z_loss: float,
                         logit_soft_cap: float | None, config: ChunkedCrossEntropyConfig,
                         interpret: bool | None = None) -> jax.Array:
    """Cross-entropy of softmax(h @ w) against labels, chunk by chunk (inputs validated by the public function).

    h (B, H), w (H, V) of one dtype; labels (B,) int in [0, V) or ignore_index (traced bad labels give NaN loss and
    gradients). Returns float32: a scalar (mean over counted rows, 0 if none; or sum) or (B,) for "none".
    ``config.chunk_rows`` None is resolved by ``chunk_rows_for``; interpret None: True exactly on CPU."""
    B, V = h.shape[0], w.shape[1]
    if config.chunk_rows is None:
        config = dataclasses.replace(config, chunk_rows=chunk_rows_for(B, h.shape[1], V, h.dtype))
    config = dataclasses.replace(config, chunk_rows=min(config.chunk_rows, B))
    st = _Static(config=config, reduction=reduction, ignore_index=int(ignore_index), z_loss=float(z_loss),
                 logit_soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
                 interpret=tu.resolve_interpret(interpret))
    labels = jnp.asarray(labels).astype(jnp.int32)
    with tu.quiet_triton_deprecation():
        if reduction == "none":
            return _row_losses(h, w, labels, st)
        return _reduced_loss(h, w, labels, st)
