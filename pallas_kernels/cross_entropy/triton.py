"""The Triton backend of linear_cross_entropy: the (B, V) logits are never written to HBM.

``linear_cross_entropy(h, w, labels, ...)`` gives the per-row cross-entropies of softmax(h @ w) against integer
labels, computed tile by tile (the public function reduces them). Shape notation: B tokens (rows), H hidden size,
V vocabulary.

Forward (one Pallas kernel): grid (V splits, B / block_b). A program holds block_b rows and walks the vocabulary
tiles of its split: each (block_b, block_v) logits tile is accumulated in float32 registers over H in block_h
chunks (the (block_b, H) rows are re-read from L2 for every tile), soft-capped, folded into a float32 running max
and sum (online log-sum-exp) and searched for the label logit. HBM sees h, w once per wave of programs and three
(V splits, B) float32 partials (max, sum, label logit) that a few jnp ops combine into lse (B,). Splitting V over a
grid axis gives small B enough programs for 132 SMs (B=4096 in 128-row blocks is only 32 row blocks).

Backward (custom VJP; residuals h, w, labels and lse (B,) float32): dlogits = g · (softmax · (1 + 2·z_loss·lse)
− onehot) · (1 − tanh²) needs the full-vocabulary lse, so the logits are recomputed. H is large (2048-8192), so
neither dh = dlogits @ wᵀ ((block_b, H) accumulator) nor dw = hᵀ @ dlogits ((H, block_v) accumulator) fits a
Triton program's registers, and Pallas-Triton has no shared-memory scratch. The backward therefore walks the
vocabulary in chunks of ``chunk_v`` columns: a Pallas kernel recomputes the chunk's logits tiles and writes its
dlogits (B, chunk_v) in the input dtype, then two float32-accumulating GEMMs (XLA: cuBLAS on GPU) give
dw[:, chunk] = hᵀ @ dlogits (written once) and dh += dlogits @ w[:, chunk]ᵀ (a (B, H) float32 accumulator).

Cost (F = 2·B·H·V FLOPs, one GEMM of the problem): forward 1 F; backward 3 F (recompute + dh + dw); total 4 F
against XLA's 3 F with materialized logits. HBM: forward ≈ h + w + (splits·B·12) bytes; backward adds the dlogits
chunks (B·V·itemsize written, read twice), the w chunks sliced for the dh GEMM (H·V·itemsize), and the dh
accumulator (B·H·4 bytes read and written per chunk). Temporary memory: B·H·4 (dh) + B·chunk_v·itemsize
(dlogits) + H·chunk_v·itemsize (w slice, dw chunk) — no (B, V) buffer anywhere. The float32 dh accumulator is
the floor of any design that accumulates in float32 without a (B, V) buffer: dh needs every vocabulary column and
dw every row, so one of the two must persist in float32 across the outer loop, and dh (B·H·4) is the smaller one
(128 MiB = 2.1% of plain XLA's temporary memory at 8192×4096×128256). What the backward's variants measured is in
benchmarks/results/NOTES.md.

Reached through ``pallas_kernels.linear_cross_entropy(..., backend="triton")``, which validates the inputs and
resolves the config; the backend-module contract is in ``pallas_kernels.backends``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels.cross_entropy import config as _config

__all__ = ["Config", "FORWARD_FIELDS", "default_config", "linear_cross_entropy", "sweep_candidates",
           "unsupported_reason"]

Config = _config.LinearCrossEntropyConfig
FORWARD_FIELDS = _config.FORWARD_FIELDS
_M_INIT = -1e30  # running max before any column: finite, so exp(m_old - m_new) never sees inf - inf


def default_config(h, w, labels, *, interpret: bool, **_) -> Config:
    """The tuned or built-in config for h (B, H) and w (H, V) (``config.default_config``)."""
    return _config.default_config(h, w, on_gpu=not interpret)


def unsupported_reason(h, w, labels, **_) -> str | None:
    """None: the Triton kernels take every input the public function accepts."""
    return None


def sweep_candidates(h, w, labels, **_) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidates at h (B, H), w (H, V) (``config.sweep_candidates``)."""
    return _config.sweep_candidates(h, w)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (the custom VJP's single non-differentiable argument); the config's
    None fields are resolved to concrete ints for this shape."""

    config: Config
    ignore_index: int
    z_loss: float
    logit_soft_cap: float | None
    interpret: bool



# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------
def _and(a, b):
    return b if a is None else (a if b is None else jnp.logical_and(a, b))


def _logits_tile(h_ref, w_ref, r0, v0, *, bm, bv, bk, H, row_ok, col_ok):
    """float32 (bm, bv) tile h[r0:r0+bm] @ w[:, v0:v0+bv], accumulated over H in bk chunks. Rows where row_ok is
    False and columns where col_ok is False read 0 (None: known in bounds)."""

    def body(kk, acc):
        k0 = kk * bk
        k_ok = None if H % bk == 0 else (k0 + jnp.arange(bk, dtype=jnp.int32)) < H
        h_mask = _and(None if row_ok is None else row_ok[:, None], None if k_ok is None else k_ok[None, :])
        w_mask = _and(None if k_ok is None else k_ok[:, None], None if col_ok is None else col_ok[None, :])
        h_tile = tu.load(h_ref, (pl.ds(r0, bm), pl.ds(k0, bk)), mask=h_mask)  # (bm, bk)
        w_tile = tu.load(w_ref, (pl.ds(k0, bk), pl.ds(v0, bv)), mask=w_mask)  # (bk, bv)
        return acc + tu.dot(h_tile, w_tile)

    return lax.fori_loop(0, pl.cdiv(H, bk), body, jnp.zeros((bm, bv), jnp.float32))


def _soft_cap(x, cap):
    """(z, dz/dx) for z = cap·tanh(x / cap); (x, None) without a cap."""
    if cap is None:
        return x, None
    t = jnp.tanh(x * (1.0 / cap))
    return cap * t, 1.0 - t * t


def _fwd_kernel(h_ref, w_ref, labels_ref, m_ref, s_ref, zy_ref, *, st: _Static, B: int, H: int, V: int):
    """Program (split, row block): online log-sum-exp over the split's vocabulary tiles and the label logit."""
    cfg = st.config
    bm, bv = cfg.block_b, cfg.block_v
    n_vt = pl.cdiv(V, bv)
    tiles_per_split = pl.cdiv(n_vt, cfg.num_splits)
    split, rb = pl.program_id(0), pl.program_id(1)
    r0 = rb * bm
    rows = r0 + jnp.arange(bm, dtype=jnp.int32)
    row_ok = None if B % bm == 0 else rows < B
    labels = tu.load(labels_ref, (pl.ds(r0, bm),), mask=row_ok, other=-1)  # (bm,)
    t0 = split * tiles_per_split
    num_tiles = jnp.minimum(tiles_per_split, n_vt - t0)  # >= 1: splits are never empty

    def body(j, carry):
        m, s, zy = carry
        v0 = (t0 + j) * bv
        cols = v0 + jnp.arange(bv, dtype=jnp.int32)
        col_ok = None if V % bv == 0 else cols < V
        x = _logits_tile(h_ref, w_ref, r0, v0, bm=bm, bv=bv, bk=cfg.block_h, H=H, row_ok=row_ok, col_ok=col_ok)
        z, _ = _soft_cap(x, st.logit_soft_cap)
        if col_ok is not None:
            z = jnp.where(col_ok[None, :], z, -jnp.inf)  # columns past V: exp(-inf) = 0
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        zy = zy + jnp.sum(jnp.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
        return m_new, s, zy

    init = (jnp.full((bm,), _M_INIT, jnp.float32), jnp.zeros((bm,), jnp.float32), jnp.zeros((bm,), jnp.float32))
    m, s, zy = lax.fori_loop(0, num_tiles, body, init)
    for ref, value in ((m_ref, m), (s_ref, s), (zy_ref, zy)):
        tu.store(ref, (split, pl.ds(r0, bm)), value, mask=row_ok)


def _dlogits_kernel(h_ref, w_ref, labels_ref, lse_ref, g_ref, dl_ref, *, st: _Static, B: int, H: int, Vc: int):
    """One (block_b_bwd, block_v_bwd) tile of dlogits for a vocabulary chunk of Vc columns (labels chunk-local)."""
    cfg = st.config
    bm, bv, group = cfg.block_b_bwd, cfg.block_v_bwd, cfg.group_b
    n_rb, n_cb = pl.cdiv(B, bm), pl.cdiv(Vc, bv)
    # Grouped order: programs [k·group·n_cb, (k+1)·group·n_cb) cover row blocks [k·group, (k+1)·group).
    pid = pl.program_id(0)
    per_group = group * n_cb
    first = lax.div(pid, per_group) * group
    size = jnp.minimum(n_rb - first, group)
    within = lax.rem(pid, per_group)
    rb, cb = first + lax.rem(within, size), lax.div(within, size)

    r0, v0 = rb * bm, cb * bv
    rows = r0 + jnp.arange(bm, dtype=jnp.int32)
    cols = v0 + jnp.arange(bv, dtype=jnp.int32)
    row_ok = None if B % bm == 0 else rows < B
    col_ok = None if Vc % bv == 0 else cols < Vc
    labels = tu.load(labels_ref, (pl.ds(r0, bm),), mask=row_ok, other=-1)
    lse = tu.load(lse_ref, (pl.ds(r0, bm),), mask=row_ok)
    g = tu.load(g_ref, (pl.ds(r0, bm),), mask=row_ok)  # rows past B: g = 0 (and they are not stored)

    x = _logits_tile(h_ref, w_ref, r0, v0, bm=bm, bv=bv, bk=cfg.block_h_bwd, H=H, row_ok=row_ok, col_ok=col_ok)
    z, dz_dx = _soft_cap(x, st.logit_soft_cap)
    p = jnp.exp(z - lse[:, None])  # softmax
    if st.z_loss:
        p = p * (1.0 + 2.0 * st.z_loss * lse)[:, None]  # d(z_loss·lse²)/dz = 2·z_loss·lse·softmax
    dz = p - (cols[None, :] == labels[:, None]).astype(jnp.float32)
    if dz_dx is not None:
        dz = dz * dz_dx
    dl = (dz * g[:, None]).astype(dl_ref.dtype)
    mask = _and(None if row_ok is None else row_ok[:, None], None if col_ok is None else col_ok[None, :])
    tu.store(dl_ref, (pl.ds(r0, bm), pl.ds(v0, bv)), dl, mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# pallas_call wrappers and the custom VJP
# ---------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="st")
def _forward(h, w, labels, st: _Static):
    """Per-row losses (B,) float32 (0 for ignored rows, NaN for out-of-range labels) and lse (B,) float32."""
    B, H = h.shape
    V = w.shape[1]
    cfg = st.config
    partial = jax.ShapeDtypeStruct((cfg.num_splits, B), jnp.float32)
    m, s, zy = tu.pallas_call(
        functools.partial(_fwd_kernel, st=st, B=B, H=H, V=V),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=st.interpret,
        grid=(cfg.num_splits, pl.cdiv(B, cfg.block_b)),  # splits vary fastest: a wave shares its h rows in L2
        out_shape=[partial, partial, partial],
        name="linear_cross_entropy_fwd",
    )(h, w, labels)
    m_max = jnp.max(m, axis=0)  # (B,)
    lse = m_max + jnp.log(jnp.sum(s * jnp.exp(m - m_max), axis=0))
    loss = lse - jnp.sum(zy, axis=0)
    if st.z_loss:
        loss = loss + st.z_loss * lse * lse
    valid, out_of_range = _label_status(labels, V, st.ignore_index)
    loss = jnp.where(valid, loss, 0.0)
    return jnp.where(out_of_range, jnp.nan, loss), lse


def _label_status(labels, V: int, ignore_index: int):
    valid = labels != ignore_index
    return valid, valid & ((labels < 0) | (labels >= V))


def _dlogits(h, w_chunk, labels_local, lse, g, st: _Static):
    """dlogits (B, Vc) in h.dtype of one vocabulary chunk, from recomputed logits tiles."""
    B, H = h.shape
    Vc = w_chunk.shape[1]
    cfg = st.config
    return tu.pallas_call(
        functools.partial(_dlogits_kernel, st=st, B=B, H=H, Vc=Vc),
        num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd, interpret=st.interpret,
        grid=(pl.cdiv(B, cfg.block_b_bwd) * pl.cdiv(Vc, cfg.block_v_bwd),),
        out_shape=jax.ShapeDtypeStruct((B, Vc), h.dtype),
        name="linear_cross_entropy_dlogits",
    )(h, w_chunk, labels_local, lse, g)


@functools.partial(jax.jit, static_argnames="st")
def _backward(h, w, labels, lse, g, st: _Static):
    """(dh, dw) for row weights g (B,) float32 (upstream cotangent, 0 for ignored rows).

    ceil(V / chunk_v) steps of chunk_v columns: a Pallas kernel writes dlogits (B, chunk), then two XLA GEMMs
    (cuBLAS on GPU) write dw[:, chunk] = hᵀ dl directly in w's dtype (float32 accumulation inside the GEMM) and add
    dl w_chunkᵀ to the float32 dh accumulator. The last chunk starts at V − chunk_v, so every step has one shape; it
    runs first, outside the loop: its GEMM initializes dh (with the columns it shares with the full steps zeroed in
    its copy of w), and the loop's full steps then add to dh in place with no mask.

    dw in w's dtype straight from the GEMM and the clamped step first are what the H100 measured fastest
    (benchmarks/results/NOTES.md, "Linear cross-entropy")."""
    B, H = h.shape
    V = w.shape[1]
    chunk = st.config.chunk_v
    num_steps = pl.cdiv(V, chunk)
    precision = lax.Precision.HIGHEST if h.dtype == jnp.float32 else lax.Precision.DEFAULT

    def step(i, carry, *, clamped: bool):
        dh, dw = carry
        v0 = V - chunk if clamped else i * chunk
        w_chunk = lax.dynamic_slice_in_dim(w, v0, chunk, axis=1)  # (H, chunk)
        dl = _dlogits(h, w_chunk, labels - v0, lse, g, st)  # (B, chunk)
        dw_chunk = lax.dot_general(h, dl, (((0,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=w.dtype)  # (H, chunk) = hᵀ dl
        shared = (num_steps - 1) * chunk - (V - chunk)  # leading columns of the clamped step a full step covers
        if clamped and shared:
            new_cols = jnp.arange(chunk, dtype=jnp.int32) >= shared
            w_chunk = jnp.where(new_cols[None, :], w_chunk, jnp.zeros((), w.dtype))
        dh_chunk = lax.dot_general(dl, w_chunk, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)  # (B, H) = dl w_chunkᵀ
        dh = dh_chunk if dh is None else dh + dh_chunk
        return dh, lax.dynamic_update_slice_in_dim(dw, dw_chunk, v0, axis=1)

    carry = step(num_steps - 1, (None, jnp.zeros((H, V), w.dtype)), clamped=True)
    dh, dw = lax.fori_loop(0, num_steps - 1, functools.partial(step, clamped=False), carry)
    return dh.astype(h.dtype), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _row_losses(h, w, labels, st: _Static):
    return _forward(h, w, labels, st=st)[0]


def _row_losses_fwd(h, w, labels, st: _Static):
    loss, lse = _forward(h, w, labels, st=st)
    return loss, (h, w, labels, lse)


def _row_losses_bwd(st: _Static, residuals, ct):
    h, w, labels, lse = residuals
    valid, out_of_range = _label_status(labels, w.shape[1], st.ignore_index)
    g = jnp.where(valid, ct.astype(jnp.float32), 0.0)
    g = jnp.where(out_of_range, jnp.nan, g)  # a row with a bad label poisons the gradients, never silently
    dh, dw = _backward(h, w, labels, lse, g, st=st)
    return dh, dw, None  # labels are integers: no cotangent


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


def linear_cross_entropy(h, w, labels, *, ignore_index: int, z_loss: float, logit_soft_cap: float | None,
                         interpret: bool, config: Config) -> jax.Array:
    """h (B, H), w (H, V), labels (B,) int32, validated -> per-row losses (B,) float32: 0 for ignored rows, NaN for
    labels outside [0, V) (and NaN gradients)."""
    st = _Static(config=_config.for_shape(config, h.shape[0], w.shape[1]), ignore_index=ignore_index, z_loss=z_loss,
                 logit_soft_cap=logit_soft_cap, interpret=interpret)
    with tu.quiet_triton_deprecation():
        return _row_losses(h, w, labels, st)
