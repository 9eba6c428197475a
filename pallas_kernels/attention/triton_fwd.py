"""Flash attention in Pallas (Triton lowering), forward: the kernel, its pallas_call and the tile helpers the
backward kernels (``triton_bwd``) share.

One program per (query tile, batch * head) holds a (block_q, H) query tile in registers and loops over (block_k, H)
K/V tiles with an online softmax; the (T, S) scores exist only as (block_q, block_k) tiles. HBM sees q, k, v, the
output o and, for the backward, a (B, N, T) float32 log-sum-exp (log2 domain) and, for 16-bit inputs, o_lo =
o_f32 − o in q.dtype, the output's rounding error (delta = rowsum(o · do) must come from the unrounded output when
softmax rows saturate: ``triton_bwd``). o_lo costs one more q.dtype tensor of o's size in HBM (2 bytes per element
of o, kept from the forward to the backward) and one more write of it, only on the differentiated path.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels.index_math import cdiv, div, minimum
from pallas_kernels.attention.config import FlashAttentionConfig

__all__ = ["LOG2E", "Static", "forward", "load", "load_kv_tile", "loop", "num_keys", "optional_specs", "pallas_call",
           "query_tile_start", "store", "visible_mask"]

LOG2E = math.log2(math.e)
# Running max before any visible key: finite, so exp2(m_old - m_new) and exp2(-inf - m) never see inf - inf.
_M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call: the single non-differentiable argument of the custom VJP."""

    config: FlashAttentionConfig
    causal: bool
    scale: float
    interpret: bool


# ---------------------------------------------------------------------------------------------------------------
# Tile helpers (shared with the backward kernels)
# ---------------------------------------------------------------------------------------------------------------
def loop(lo, hi, body, carry):
    """lax.fori_loop, skipped when the bounds are static and empty."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


def query_tile_start(block_q: int, T: int, *, causal: bool):
    """First query row of this program's tile (grid axis 0 runs over query tiles); causal programs take the longest
    rows first: better tail balance across SMs."""
    i = pl.program_id(0)
    if causal:
        i = pl.cdiv(T, block_q) - 1 - i
    return i * block_q


def num_keys(len_ref, S: int):
    """Number of valid keys of this batch row: kv_seq_lengths clipped to [0, S], or S (a Python int)."""
    return S if len_ref is None else jnp.clip(len_ref[0], 0, S)


def _row_mask(rows, limit, ndim: int):
    """rows < limit shaped for a tile of ``ndim`` dims whose first axis the rows index; None when rows is None."""
    if rows is None:
        return None
    mask = rows < limit
    return mask[:, None] if ndim == 2 else mask


def load(ref, idx, rows, limit, *, other=0.0):
    """ref[idx], where ``rows`` are the positions along the first indexed (sequence) axis and rows >= limit read
    ``other``. With rows None the load is unmasked: only for tiles known to be in bounds (interpret mode would
    shift an out-of-bounds slice, and Triton would read past the array)."""
    return tu.load(ref, idx, mask=_row_mask(rows, limit, len(ref.at[idx].shape)), other=other)


def store(ref, idx, value, rows, limit):
    """ref[idx] = value, skipping rows >= limit when rows is not None."""
    tu.store(ref, idx, value, mask=_row_mask(rows, limit, value.ndim))


def load_kv_tile(k_ref, v_ref, s0, bk: int, limit):
    """(kv_pos, k, v): the key positions [s0, s0 + bk) and the (bk, H) K and V tiles there; keys >= limit read 0.
    limit None: an unmasked load, for a tile that lies within the valid keys. A tile that may reach past the
    kv length is masked by the length, not only by S, so that NaN or inf stored in padding never meets a product
    (p·v and dS·K would turn 0·NaN into NaN)."""
    kv_pos = s0 + jnp.arange(bk, dtype=jnp.int32)
    kv_rows = None if limit is None else kv_pos
    k = load(k_ref, (pl.ds(s0, bk), slice(None)), kv_rows, limit)
    v = load(v_ref, (pl.ds(s0, bk), slice(None)), kv_rows, limit)
    return kv_pos, k, v


def visible_mask(q_pos, kv_pos, *, causal, kv_limit, q_seg, kv_seg):
    """(len(q_pos), len(kv_pos)) bool tile of which query sees which key; None if everything is visible."""
    mask = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if kv_limit is not None:
        mask = both(mask, jnp.broadcast_to((kv_pos < kv_limit)[None, :], (q_pos.shape[0], kv_pos.shape[0])))
    if causal:
        mask = both(mask, q_pos[:, None] >= kv_pos[None, :])
    if q_seg is not None:
        mask = both(mask, q_seg[:, None] == kv_seg[None, :])
    return mask


# ---------------------------------------------------------------------------------------------------------------
# Forward kernel: one program per (query tile, batch * head); loop over key/value tiles.
# ---------------------------------------------------------------------------------------------------------------
def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, len_ref, o_ref, lse_ref, lo_ref=None, *,
                static: Static, T: int, S: int):
    cfg = static.config
    bq, bk = cfg.block_q, cfg.block_k
    t0 = query_tile_start(bq, T, causal=static.causal)
    rows = bq // cfg.query_chains  # query rows per chain
    # Per chain: query positions, bounds (None when T is a multiple of the tile), the q tile (stays in registers),
    # segment ids.
    chains = []
    for c in range(cfg.query_chains):
        q_pos = t0 + c * rows + jnp.arange(rows, dtype=jnp.int32)
        q_rows = None if T % bq == 0 else q_pos
        q = load(q_ref, (pl.ds(t0 + c * rows, rows), slice(None)), q_rows, T)
        q_seg = None if q_seg_ref is None else load(q_seg_ref, (pl.ds(t0 + c * rows, rows),), q_pos, T, other=-1)
        chains.append((q_pos, q_rows, q, q_seg))

    kv_len = num_keys(len_ref, S)  # keys >= kv_len are masked
    end = kv_len if not static.causal else minimum(kv_len, t0 + bq)  # keys any row of this tile can see
    num_tiles = cdiv(end, bk)
    # Tiles [0, num_full) are entirely visible to every row: no mask, no bounds check. With S < bk no tile is full
    # (and an unmasked bk-row load of an S-row array would not even trace in interpret mode).
    if q_seg_ref is not None or S < bk:
        num_full = 0
    else:
        num_full = minimum(div(kv_len if not static.causal else minimum(kv_len, t0 + 1), bk), num_tiles)

    qk_scale = static.scale * LOG2E  # exp(x * scale) == exp2(x * scale * log2(e))
    exp2 = functools.partial(tu.exp2, interpret=static.interpret)
    exp_scale, pre_scale = (qk_scale, None) if qk_scale > 0 else (1.0, qk_scale)
    kv_limit = kv_len if (S % bk or len_ref is not None) else None

    def update(carry, s, v, chain, kv_pos, kv_seg, *, masked: bool):
        """One chain's online-softmax step: s (rows, bk) raw scores of this key tile."""
        acc, m, l = carry
        q_pos, _, _, q_seg = chain
        if pre_scale is not None:
            s = s * pre_scale
        if masked:
            visible = visible_mask(q_pos, kv_pos, causal=static.causal, kv_limit=kv_limit, q_seg=q_seg, kv_seg=kv_seg)
            if visible is not None:
                s = jnp.where(visible, s, -jnp.inf)
        # With a positive scale, max(s) * scale == max(s * scale): the scale then folds into one FMA per score.
        m_new = jnp.maximum(m, jnp.max(s, axis=1) * exp_scale)
        alpha = exp2(m - m_new)
        p = exp2(s * exp_scale - m_new[:, None])  # masked entries: exp2(-inf) = 0
        p_mma = p.astype(v.dtype)  # what p·v multiplies
        # For the backward (lo_ref given), l sums the probabilities as p·v rounded them: o_f32 = acc / l is then an
        # exact convex combination of V rows. With the unrounded sum, a one-hot row whose maximum's p comes out as
        # 1 + r (the FMA in s·scale − m keeps the product's rounding error r, up to 2^-12 at scores ~5e3) would give
        # o_f32 = v / (1 + r), and delta = rowsum(o_f32 · do) would miss dP by r·dP: all of dS for that row.
        l = l * alpha + jnp.sum(p_mma.astype(jnp.float32) if lo_ref is not None else p, axis=1)
        acc = acc * alpha[:, None] + tu.dot(p_mma, v)
        return acc, m_new, l

    def body(j, carry, *, masked: bool):
        s0 = j * bk
        kv_pos, k, v = load_kv_tile(k_ref, v_ref, s0, bk, kv_limit if masked else None)
        kv_seg = None
        if masked and kv_seg_ref is not None:
            kv_seg = load(kv_seg_ref, (pl.ds(s0, bk),), kv_pos, S, other=-2)
        # Every chain's q·kᵀ is issued before any chain's softmax: with two chains the tensor cores have the second
        # product to compute while the first chain's exp2s run.
        scores = [tu.dot(q, k, trans_b=True) for _, _, q, _ in chains]
        return tuple(update(c_carry, s, v, chain, kv_pos, kv_seg, masked=masked)
                     for c_carry, s, chain in zip(carry, scores, chains))

    H = q_ref.shape[-1]
    init = (jnp.zeros((rows, H), jnp.float32), jnp.full((rows,), _M_INIT, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    carry = loop(0, num_full, functools.partial(body, masked=False), (init,) * cfg.query_chains)
    carry = loop(num_full, num_tiles, functools.partial(body, masked=True), carry)

    for c, ((acc, m, l), (_, q_rows, _, _)) in enumerate(zip(carry, chains)):
        empty = l == 0.0  # no visible key: output 0, lse +inf (so the backward's probabilities are exactly 0)
        inv_l = 1.0 / jnp.where(empty, 1.0, l)
        idx = pl.ds(t0 + c * rows, rows)
        o = acc * inv_l[:, None]
        o_out = o.astype(o_ref.dtype)
        store(o_ref, (idx, slice(None)), o_out, q_rows, T)
        if lo_ref is not None:  # the output's rounding error, for the backward's delta
            store(lo_ref, (idx, slice(None)), (o - o_out.astype(jnp.float32)).astype(lo_ref.dtype), q_rows, T)
        lse = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))  # log2-domain log-sum-exp
        store(lse_ref, (idx,), lse, q_rows, T)


# ---------------------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ---------------------------------------------------------------------------------------------------------------
def pallas_call(kernel, *, static: Static, num_warps: int, num_stages: int, **kwargs):
    return tu.pallas_call(kernel, num_warps=num_warps, num_stages=num_stages, interpret=static.interpret, **kwargs)


def optional_specs(q_seg, kv_seg, kv_lens, T, S, batch_of):
    """BlockSpecs for segment ids (whole rows) and kv lengths ((B, 1), one scalar per program)."""
    return [
        None if q_seg is None else pl.BlockSpec((None, T), lambda i, r: (batch_of(r), 0)),
        None if kv_seg is None else pl.BlockSpec((None, S), lambda i, r: (batch_of(r), 0)),
        None if kv_lens is None else pl.BlockSpec((None, 1), lambda i, r: (batch_of(r), 0)),
    ]


@functools.partial(jax.jit, static_argnames=("static", "residuals"))
def forward(q, k, v, q_seg, kv_seg, kv_lens, static: Static, residuals: bool = False):
    """Returns o (B, T, N, H) in q.dtype, lse (B, N, T) float32 in the log2 domain (+inf for empty rows) and o_lo:
    with ``residuals`` and 16-bit inputs, the output's rounding error o_f32 − o (B, T, N, H) in q.dtype (o + o_lo
    carries ~16 mantissa bits, what the backward's delta needs when a softmax row saturates); else None."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    cfg = static.config
    b_of = lambda r: lax.div(r, N)  # grid axis 1 runs over batch * heads
    n_of = lambda r: lax.rem(r, N)
    q_spec = pl.BlockSpec((None, T, None, H), lambda i, r: (b_of(r), 0, n_of(r), 0))
    kv_spec = pl.BlockSpec((None, S, None, H), lambda i, r: (b_of(r), 0, lax.div(n_of(r), G), 0))
    lse_spec = pl.BlockSpec((None, None, T), lambda i, r: (b_of(r), n_of(r), 0))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32)]
    with_lo = residuals and jnp.dtype(q.dtype).itemsize < 4  # float32: o is the unrounded output
    outs = pallas_call(
        functools.partial(_fwd_kernel, static=static, T=T, S=S),
        static=static, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        grid=(pl.cdiv(T, cfg.block_q), B * N),
        in_specs=[q_spec, kv_spec, kv_spec, *optional_specs(q_seg, kv_seg, kv_lens, T, S, b_of)],
        out_specs=[q_spec, lse_spec, q_spec][:3 if with_lo else 2],
        out_shape=(out_shape + [out_shape[0]])[:3 if with_lo else 2],
        name="flash_attention_fwd",
    )(q, k, v, q_seg, kv_seg, kv_lens)
    return outs[0], outs[1], outs[2] if with_lo else None
