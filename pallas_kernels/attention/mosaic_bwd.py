"""The Mosaic backend's backward: dQ, dK, dV from the forward's residuals, around the two kernels of
``mosaic_bwd_kernels``. Called by the custom VJP in ``mosaic.py``.

What runs, in this order:
1. delta = rowsum((o + o_lo) · do), (B, N, T) float32: one fused XLA reduction that reads o, o_lo and do once (a
   multiply-reduce over H, then a transpose of the small (B, T, N) result). o + o_lo is the forward's unrounded
   output: with saturated softmax rows (one probability near 1), a delta from o rounded to bf16 would lose the
   cancellation dP − delta to rounding. A kernel could not read fewer bytes; fusing delta into the dQ kernel would
   save one read of do (B·T·N·H·2 bytes, ~1.5% of the backward at the main shape) for a third input stream.
2. The (B, N, T) residuals padded to T_pad, a multiple of every query tile (the kernels read whole tiles of them,
   and TMA wants 16-byte row strides): lse with +inf (probability 0), delta with 0; segment ids with -1 (queries)
   and -2 (keys), which never match. q, do, k, v padded with zero rows to a multiple of 8 rows and at least one
   program's tile (TMA copies into (8, 64)-tiled shared memory; one XLA copy, only for such lengths). With
   kv_seq_lengths, K is zeroed past the length for the dQ kernel (one fused select over K; dQ += dS K reads whole
   K rows, and 0 · NaN is NaN).
3. The dQ kernel and the dK/dV kernel, independent of each other.
No (T, S) buffer; temporaries are delta and the padded lse ((B, N, T_pad) float32 each) and the zeroed K copy when
kv_seq_lengths is given. dK/dV for GQA sum the G query heads of each kv head inside the kernel: no atomics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import mosaic_bwd_fused as fused
from pallas_kernels.attention import mosaic_bwd_kernels as kernels
from pallas_kernels.attention.config import MosaicAttentionConfig
from pallas_kernels.index_math import round_up

__all__ = ["SUPPORTED_HEAD_DIMS", "backward", "shared_memory_bytes"]

SUPPORTED_HEAD_DIMS = (64, 128)  # H=256: the dK and dV float32 accumulators alone exceed the registers
shared_memory_bytes = kernels.shared_memory_bytes


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config"))
def backward(q, k, v, o, o_lo, lse, do, q_seg, kv_seg, kv_lens, *, causal: bool, scale: float,
             config: MosaicAttentionConfig):
    """(dq (B, T, N, H), dk, dv (B, S, K, H)) in the input dtype, accumulated in float32.

    q (B, T, N, H), k and v (B, S, K, H) bf16/fp16, N % K == 0; o and o_lo (B, T, N, H) in q.dtype (the forward's
    output and its rounding error); lse (B, N, T) float32, log2 Σ_s exp2(q·k_s · scale · log2 e) over visible keys,
    +inf for rows without one; do (B, T, N, H) the cotangent; q_seg (B, T) and kv_seg (B, S) int32 or both None;
    kv_lens (B,) int32 or None (clipped to [0, S] in the kernels)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    c = config
    T_pad = round_up(T, max(c.compute_wgs_dq * c.block_q_dq, c.block_q_dkv))
    S_pad = round_up(S, max(c.block_kv_dq, c.compute_wgs_dkv * c.block_kv_dkv))
    pad_t = ((0, 0), (0, 0), (0, T_pad - T))

    f32 = jnp.float32
    o_f32 = o.astype(f32) + o_lo.astype(f32)
    delta = jnp.einsum("btnh,btnh->bnt", o_f32, do.astype(f32))  # (B, N, T)
    delta = jnp.pad(delta, pad_t)
    lse = jnp.pad(lse, pad_t, constant_values=jnp.inf)
    do = do.astype(q.dtype)
    if q_seg is not None:
        q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, T_pad - T)), constant_values=-1)
        kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, S_pad - S)), constant_values=-2)
    # Rows padded with zeros to a multiple of 8 and at least one program's tile, so that no TMA box lies wholly
    # outside its array (the kernels mask by the true T and S).
    T_rows = max(round_up(T, 8), c.compute_wgs_dq * c.block_q_dq, c.block_q_dkv)
    S_rows = max(round_up(S, 8), c.block_kv_dq, c.compute_wgs_dkv * c.block_kv_dkv)
    pad_rows = lambda x, n: x if x.shape[1] == n else jnp.pad(  # noqa: E731
        x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))
    q_in, do = pad_rows(q, T_rows), pad_rows(do, T_rows)
    k_in, v_in = pad_rows(k, S_rows), pad_rows(v, S_rows)
    k_dq = k_in
    if kv_lens is not None:
        kv_lens = kv_lens.astype(jnp.int32).reshape(B)
        valid = jnp.arange(S_rows, dtype=jnp.int32)[None, :] < kv_lens[:, None]  # (B, S_rows)
        k_dq = jnp.where(valid[:, :, None, None], k_in, jnp.zeros((), k.dtype))

    problem = kernels.Problem(B=B, T=T, S=S, N=N, K=K, H=H, T_pad=T_pad, S_pad=S_pad, causal=causal, scale=scale,
                              has_segments=q_seg is not None, has_lengths=kv_lens is not None)
    if c.fused_bwd:
        dq, dk, dv = fused.fused_call(q_in, k_dq, v_in, do, lse, delta, q_seg, kv_seg, kv_lens, p=problem,
                                      block_q=c.block_q_dkv, block_kv=c.block_kv_dkv, compute_wgs=c.compute_wgs_dkv,
                                      num_stages=c.num_stages_dkv)
        return (dq[:, :T] * scale).astype(q.dtype), dk[:, :S], dv[:, :S]
    dq = kernels.dq_call(q_in, k_dq, v_in, do, lse, delta, q_seg, kv_seg, kv_lens, p=problem, block_q=c.block_q_dq,
                         block_kv=c.block_kv_dq, compute_wgs=c.compute_wgs_dq, num_stages=c.num_stages_dq,
                         persistent=c.persistent_dq)
    dk, dv = kernels.dkv_call(q_in, k_in, v_in, do, lse, delta, q_seg, kv_seg, kv_lens, p=problem,
                              block_q=c.block_q_dkv, block_kv=c.block_kv_dkv, compute_wgs=c.compute_wgs_dkv,
                              num_stages=c.num_stages_dkv, persistent=c.persistent_dkv)
    return dq[:, :T], dk[:, :S], dv[:, :S]
