"""Flash attention in Pallas (Triton lowering), backward: the dK/dV and dQ kernels and their pallas_calls.

The probability tiles are recomputed from the forward's (B, N, T) log-sum-exp in two kernels with no atomics: dK/dV
iterates over query tiles for each key tile (and over the G query heads of a kv head, so the GQA head sum happens
in registers), dQ iterates over key tiles for each query tile. The only other intermediate is delta =
rowsum((o + o_lo) · do), (B, N, T) float32, which XLA computes in one fused reduction from the forward's unrounded
output. Keys at or past kv_seq_lengths are read as zeros, so NaN or inf stored there reaches no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels.attention.triton_fwd import (LOG2E, Static, load, load_kv_tile, loop, num_keys, optional_specs,
                                                 pallas_call, query_tile_start, store, visible_mask)
from pallas_kernels.index_math import cdiv, div, i32, minimum

__all__ = ["backward"]


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, len_ref, dk_ref, dv_ref,
                 *, static: Static, T: int, S: int, G: int):
    """One program per (key tile, batch * kv head): loops over the G query heads sharing the kv head, and for each
    over query tiles, accumulating dK and dV in float32 registers (the GQA head sum happens here, not in HBM)."""
    cfg = static.config
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    nq = pl.cdiv(T, bq)
    j = pl.program_id(0)
    s0 = j * bk
    kv_len = num_keys(len_ref, S)
    # Keys >= the length (and past S) read 0: NaN or inf stored in padding never reaches dS or dK/dV.
    kv_pos, k, v = load_kv_tile(k_ref, v_ref, s0, bk, kv_len if (len_ref is not None or S % bk) else None)
    kv_rows = None if S % bk == 0 else kv_pos  # the dK/dV stores skip keys >= S
    kv_seg = None if kv_seg_ref is None else load(kv_seg_ref, (pl.ds(s0, bk),), kv_pos, S, other=-2)
    # Keys past S need no mask here: their rows of dK/dV are never stored, and they cannot leak into other rows.
    kv_limit = kv_len if len_ref is not None else None

    # Query tiles [lo, num_masked) need the mask, [num_masked, nq) are entirely visible.
    lo = div(s0, bq) if static.causal else 0
    if q_seg_ref is not None:
        num_masked = nq
    else:
        num_masked = minimum(cdiv(s0 + bk - 1, bq), nq) if static.causal else lo
        if len_ref is not None:  # a tile reaching past the length is masked for every query
            num_masked = jnp.where(s0 + bk > kv_len, i32(nq), i32(num_masked))
    if len_ref is not None:  # a tile entirely past the length sees nothing: its gradients are 0
        lo = jnp.where(s0 >= kv_len, i32(nq), i32(lo))
        num_masked = jnp.maximum(num_masked, lo)
    q_scale = static.scale * LOG2E
    exp2 = functools.partial(tu.exp2, interpret=static.interpret)

    def body(i, carry, *, g, masked: bool):
        dk, dv = carry
        t0 = i * bq
        q_pos = t0 + jnp.arange(bq, dtype=jnp.int32)
        q_rows = None if T % bq == 0 else q_pos
        q = load(q_ref, (pl.ds(t0, bq), g, slice(None)), q_rows, T)
        do = load(do_ref, (pl.ds(t0, bq), g, slice(None)), q_rows, T)
        lse = load(lse_ref, (g, pl.ds(t0, bq)), q_rows, T, other=jnp.inf)  # rows past T: p = 0
        delta = load(delta_ref, (g, pl.ds(t0, bq)), q_rows, T)
        s_t = tu.dot(k, q, trans_b=True) * q_scale - lse[None, :]  # (bk, bq) log2 probabilities, transposed
        if masked:
            q_seg = None if q_seg_ref is None else load(q_seg_ref, (pl.ds(t0, bq),), q_pos, T, other=-1)
            visible = visible_mask(q_pos, kv_pos, causal=static.causal, kv_limit=kv_limit, q_seg=q_seg, kv_seg=kv_seg)
            if visible is not None:
                s_t = jnp.where(visible.T, s_t, -jnp.inf)
        p_t = exp2(s_t)  # (bk, bq) probabilities, transposed
        dv = dv + tu.dot(p_t.astype(do.dtype), do)
        dp_t = tu.dot(v, do, trans_b=True)  # (bk, bq)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dk + tu.dot(ds_t.astype(q.dtype), q)
        return dk, dv

    def head(g, carry):
        carry = loop(lo, num_masked, functools.partial(body, g=g, masked=True), carry)
        return loop(num_masked, nq, functools.partial(body, g=g, masked=False), carry)

    H = k.shape[-1]
    zeros = jnp.zeros((bk, H), jnp.float32)
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    store(dk_ref, (pl.ds(s0, bk), slice(None)), (dk * static.scale).astype(dk_ref.dtype), kv_rows, S)
    store(dv_ref, (pl.ds(s0, bk), slice(None)), dv.astype(dv_ref.dtype), kv_rows, S)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, len_ref, dq_ref, *,
               static: Static, T: int, S: int):
    """One program per (query tile, batch * head); loops over key/value tiles like the forward."""
    cfg = static.config
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    t0 = query_tile_start(bq, T, causal=static.causal)
    q_pos = t0 + jnp.arange(bq, dtype=jnp.int32)
    q_rows = None if T % bq == 0 else q_pos
    q = load(q_ref, (pl.ds(t0, bq), slice(None)), q_rows, T)
    do = load(do_ref, (pl.ds(t0, bq), slice(None)), q_rows, T)
    lse = load(lse_ref, (pl.ds(t0, bq),), q_rows, T, other=jnp.inf)
    delta = load(delta_ref, (pl.ds(t0, bq),), q_rows, T)
    q_seg = None if q_seg_ref is None else load(q_seg_ref, (pl.ds(t0, bq),), q_pos, T, other=-1)

    kv_len = num_keys(len_ref, S)
    end = kv_len if not static.causal else minimum(kv_len, t0 + bq)
    num_tiles = cdiv(end, bk)
    if q_seg_ref is not None or S < bk:  # as in the forward: no full tile
        num_full = 0
    else:
        num_full = minimum(div(kv_len if not static.causal else minimum(kv_len, t0 + 1), bk), num_tiles)
    kv_limit = kv_len if (S % bk or len_ref is not None) else None
    q_scale = static.scale * LOG2E
    exp2 = functools.partial(tu.exp2, interpret=static.interpret)

    def body(j, dq, *, masked: bool):
        s0 = j * bk
        kv_pos, k, v = load_kv_tile(k_ref, v_ref, s0, bk, kv_limit if masked else None)
        s = tu.dot(q, k, trans_b=True) * q_scale - lse[:, None]  # (bq, bk) log2 probabilities
        if masked:
            kv_seg = None if kv_seg_ref is None else load(kv_seg_ref, (pl.ds(s0, bk),), kv_pos, S, other=-2)
            visible = visible_mask(q_pos, kv_pos, causal=static.causal, kv_limit=kv_limit, q_seg=q_seg, kv_seg=kv_seg)
            if visible is not None:
                s = jnp.where(visible, s, -jnp.inf)
        p = exp2(s)
        ds = p * (tu.dot(do, v, trans_b=True) - delta[:, None])
        return dq + tu.dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = loop(0, num_full, functools.partial(body, masked=False), dq)
    dq = loop(num_full, num_tiles, functools.partial(body, masked=True), dq)
    store(dq_ref, (pl.ds(t0, bq), slice(None)), (dq * static.scale).astype(dq_ref.dtype), q_rows, T)


@functools.partial(jax.jit, static_argnames="static")
def backward(q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse, do, static: Static):
    """(dq, dk, dv) for the cotangent do; o the forward's output in q.dtype and o_lo its rounding error (or None:
    o is exact), lse (B, N, T) float32 log2 domain."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    cfg = static.config
    # delta = rowsum(o_f32 · do): one fused XLA reduction reading o, o_lo and do once; (B, N, T) float32. From the
    # unrounded output o + o_lo: with a near one-hot softmax row, dP − delta cancels to ~(1 − p), which a delta from
    # o rounded to bf16/fp16 would lose entirely.
    o_f32 = o.astype(jnp.float32) if o_lo is None else o.astype(jnp.float32) + o_lo.astype(jnp.float32)
    delta = jnp.einsum("btnh,btnh->bnt", o_f32, do.astype(jnp.float32))
    do = do.astype(q.dtype)

    # dK, dV: grid (key tiles, batch * kv heads); each program reads the G query heads of its kv head.
    b_of = lambda r: lax.div(r, K)
    h_of = lambda r: lax.rem(r, K)
    group_spec = pl.BlockSpec((None, T, G, H), lambda j, r: (b_of(r), 0, h_of(r), 0))  # (T, G, H)
    row_spec = pl.BlockSpec((None, G, T), lambda j, r: (b_of(r), h_of(r), 0))  # (G, T)
    kv_spec = pl.BlockSpec((None, S, None, H), lambda j, r: (b_of(r), 0, h_of(r), 0))
    dk, dv = pallas_call(
        functools.partial(_dkdv_kernel, static=static, T=T, S=S, G=G),
        static=static, num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd,
        grid=(pl.cdiv(S, cfg.block_k_dkv), B * K),
        in_specs=[group_spec, kv_spec, kv_spec, group_spec, row_spec, row_spec,
                  *optional_specs(q_seg, kv_seg, kv_lens, T, S, b_of)],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_attention_dkdv",
    )(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens)

    # dQ: grid (query tiles, batch * heads), like the forward.
    b_of = lambda r: lax.div(r, N)
    n_of = lambda r: lax.rem(r, N)
    q_spec = pl.BlockSpec((None, T, None, H), lambda i, r: (b_of(r), 0, n_of(r), 0))
    kv_spec = pl.BlockSpec((None, S, None, H), lambda i, r: (b_of(r), 0, lax.div(n_of(r), G), 0))
    row_spec = pl.BlockSpec((None, None, T), lambda i, r: (b_of(r), n_of(r), 0))
    dq = pallas_call(
        functools.partial(_dq_kernel, static=static, T=T, S=S),
        static=static, num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd,
        grid=(pl.cdiv(T, cfg.block_q_dq), B * N),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                  *optional_specs(q_seg, kv_seg, kv_lens, T, S, b_of)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens)
    return dq, dk, dv
