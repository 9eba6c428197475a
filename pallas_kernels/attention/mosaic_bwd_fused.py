"""The fused Pallas Mosaic-GPU backward of flash attention (sm90): dK, dV and dQ in one kernel, five matmuls per
(query tile, key tile) pair instead of the two-kernel backward's seven (``mosaic_bwd_kernels``: its dQ kernel
recomputes S = Q Kᵀ and dP = dO Vᵀ).

The dK/dV kernel's schedule (one program per key tile of compute_wgs · block_kv rows, kv head and batch; a TMA
warpgroup streaming Q/dO tiles of block_q rows for each of the G query heads), plus, per step:
  dQ_part = dS K  (block_q, H): this program's keys' share of the step's query rows,
added into a float32 (B, T_pad, N, H) buffer with a TMA reduce-add (``copy_smem_to_gmem(reduction_op="add")``),
zeroed by XLA before the kernel and scaled and rounded by XLA after it. dS is transposed in registers (dSᵀ, the
kernel's tiles are key-major), so it goes through shared memory, where wgmma reads it transposed as the A operand.

How the compute warpgroups share the dQ work (``dq_split``):
  "heads": both warpgroups' dSᵀ tiles go to shared memory, the warpgroups meet at an mbarrier, and each computes
    half of H's columns over all compute_wgs · block_kv keys (contraction over the whole program tile): one
    reduce-add of (block_q, H / 2) per warpgroup and step, so each query row receives T-independent
    S / (compute_wgs · block_kv) partial sums. Needs two compute warpgroups and H / 2 a multiple of 64 (a
    128-byte-swizzled K tile splits only at its 64-column tiles): H = 128.
  "own": each warpgroup multiplies its own dSᵀ by its own K rows (no meeting), one reduce-add of (block_q, H) per
    warpgroup and step: twice the partial sums. H = 64, or one compute warpgroup.
dSᵀ lives in a two-slot ring (step parity), so one warpgroup may write step i + 1's tile while the other still
reads step i's; each warpgroup's dQ tile in shared memory is reused once its previous reduce-add has been read.

Inputs as ``mosaic_bwd_kernels.dkv_call``'s; K must be zero past kv_seq_lengths (dQ += dS K reads whole K rows and
0 · NaN is NaN: the caller passes the zeroed copy). Masks, causal skipping and GQA head sums are the dK/dV
kernel's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.attention import mosaic_bwd_kernels as split
from pallas_kernels.index_math import cdiv, i32

__all__ = ["DQ_SPLITS", "dq_split_for", "fused_call", "shared_memory_bytes"]

DQ_SPLITS = ("heads", "own")
_F32 = jnp.float32


def dq_split_for(head_dim: int, compute_wgs: int) -> str:
    """How the compute warpgroups share dQ (module docstring): "heads" where H / 2 is a whole number of 64-column
    tiles and there are two warpgroups, else "own"."""
    return "heads" if compute_wgs == 2 and head_dim % 128 == 0 else "own"


def shared_memory_bytes(config, head_dim: int, itemsize: int = 2, *, segments: bool = False) -> int:
    """Shared memory of the fused kernel in bytes for a ``MosaicAttentionConfig`` (its dK/dV fields), with the split
    kernels' 4 KiB reserve: the dK/dV kernel's, plus the two-slot dSᵀ ring and the float32 dQ tiles."""
    c, H = config, head_dim
    wgs, bq, bk = c.compute_wgs_dkv, c.block_q_dkv, c.block_kv_dkv
    dq_cols = H // wgs if dq_split_for(H, wgs) == "heads" else H
    return (split.shared_memory_bytes(c, H, itemsize, segments=segments)[1]
            + 2 * wgs * bk * bq * itemsize + wgs * bq * dq_cols * 4)


def fused_call(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens, *, p: split.Problem, block_q: int, block_kv: int,
               compute_wgs: int, num_stages: int):
    """(dQ (B, T_pad, N, H) float32, unscaled: multiply by ``p.scale``; dK, dV (B, S_rows, K, H) in k.dtype)."""
    T, S, H, G = p.T, p.S, p.H, p.G
    bq, bk, wgs = block_q, block_kv, compute_wgs
    tile = wgs * bk
    num_q_tiles = cdiv(T, bq)
    c = p.scale * split._LOG2E
    dtype = k.dtype
    dq_split = dq_split_for(H, wgs)
    dq_cols = H // wgs if dq_split == "heads" else H

    def mosaic_attention_bwd_fused(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, len_ref,
                                   dq_ref, dk_ref, dv_ref, k_smem, v_smem, ds_smem, dq_smem, barrier, ds_ready):
        b, h = lax.axis_index("batch"), lax.axis_index("heads")
        s_cta = lax.axis_index("kv_tiles") * tile
        wg = lax.axis_index("wg")
        s_wg = s_cta + wg * bk  # this warpgroup's first key (meaningful in compute warpgroups only)
        kv_len = split._kv_len(len_ref, b, S)
        lo = jnp.minimum(lax.div(s_cta, i32(bq)), i32(num_q_tiles)) if p.causal else 0
        if p.has_lengths:
            lo = jnp.where(s_cta >= kv_len, i32(num_q_tiles), i32(lo))
        num_steps = num_q_tiles - lo
        # Programs of one head start at different query tiles (and wrap around), so that their reduce-adds into dQ
        # do not all hit the same rows at the same time.
        shift = lax.axis_index("kv_tiles") * max(1, num_q_tiles // cdiv(S, tile))
        q_tile_of = lambda i: lo + lax.rem(i + shift, jnp.maximum(num_steps, 1))  # noqa: E731
        col0 = wg * dq_cols if dq_split == "heads" else 0

        def body(idx, q_tile, do_tile, lse_tile, delta_tile, q_seg_tile, q_consumed, do_consumed, lse_consumed,
                 delta_consumed, q_seg_consumed, carry):
            i, g = idx
            dk_acc, dv_acc, kv_seg_rows = carry
            t0 = q_tile_of(i) * bq
            slot = lax.rem(i * G + g, 2)

            def products(s_acc, dp_acc):
                plgpu.wgmma(s_acc, k_smem.at[wg], q_tile.T)
                plgpu.wgmma(dp_acc, v_smem.at[wg], do_tile.T)
                return plgpu.wgmma_accumulator_load(s_acc, wait_n=1), plgpu.wgmma_accumulator_load(dp_acc)

            s_t, dp_t = pl.run_scoped(products, plgpu.ACC((bk, bq), _F32), plgpu.ACC((bk, bq), _F32))
            lse_cols, delta_cols = split._load(lse_tile, mu.COLS), split._load(delta_tile, mu.COLS)
            plgpu.barrier_arrive(lse_consumed)
            plgpu.barrier_arrive(delta_consumed)
            q_seg_cols = None
            if q_seg_tile is not None:
                q_seg_cols = split._load(q_seg_tile, mu.COLS)
                plgpu.barrier_arrive(q_seg_consumed)

            def make_visible():
                keys, queries = s_wg + split._iota((bk, bq), 0), t0 + split._iota((bk, bq), 1)
                vis = keys < kv_len if p.has_lengths else None
                if p.causal:
                    vis = split._and(vis, keys <= queries)
                if p.has_segments:
                    same = (lax.broadcast_in_dim(kv_seg_rows, (bk, bq), [0])
                            == lax.broadcast_in_dim(q_seg_cols, (bk, bq), [1]))
                    vis = split._and(vis, same)
                return vis

            needs_mask = split._any(s_wg + bk > kv_len if p.has_lengths else None,
                                    s_wg + (bk - 1) > t0 if p.causal else None)
            p_t, ds_t = split._masked_or_plain(
                needs_mask, p.has_segments, make_visible,
                lambda vis: split._softmax_grads(s_t, dp_t, lse_cols, delta_cols, lse_axis=1, c=c, visible=vis))
            ds_t = ds_t.astype(dtype)
            plgpu.wgmma(dv_acc, p_t.astype(dtype), do_tile)
            plgpu.wgmma(dk_acc, ds_t, q_tile)
            ds_smem.at[slot, wg][...] = ds_t
            plgpu.commit_smem()  # visible to wgmma (the async proxy), this warpgroup's and the other's
            if dq_split == "heads":
                plgpu.barrier_arrive(ds_ready.at[slot])
                plgpu.barrier_wait(ds_ready.at[slot])

            def dq_product(dq_acc):
                if dq_split == "heads":
                    for w in range(wgs):
                        plgpu.wgmma(dq_acc, ds_smem.at[slot, w].T, k_smem.at[w, :, pl.ds(col0, dq_cols)])
                else:
                    plgpu.wgmma(dq_acc, ds_smem.at[slot, wg].T, k_smem.at[wg])
                plgpu.wgmma_wait(0)  # dV, dK and dQ products done: the Q and dO tiles may be overwritten
                return dq_acc[...]

            dq_part = pl.run_scoped(dq_product, plgpu.ACC((bq, dq_cols), _F32))
            plgpu.barrier_arrive(do_consumed)
            plgpu.barrier_arrive(q_consumed)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous reduce-add has read dq_smem
            dq_smem.at[wg][...] = dq_part
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_ref.at[b, pl.ds(t0, bq), h * G + g, pl.ds(col0, dq_cols)],
                                    reduction_op="add")
            return carry

        def compute_thread(pipeline):
            keys = pl.ds(s_wg, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[wg], barrier.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[wg], barrier.at[wg])
            kv_seg_rows = None if kv_seg_ref is None else split._load(kv_seg_ref.at[b, keys], mu.ROWS)
            plgpu.barrier_wait(barrier.at[wg])

            def run(dk_acc, dv_acc):
                pipeline((dk_acc, dv_acc, kv_seg_rows))
                return dk_acc[...], dv_acc[...]

            acc = plgpu.ACC((bk, H), _F32)
            dk, dv = pl.run_scoped(run, acc, acc)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if dq_split == "heads":  # the other warpgroup's last dQ product may still read this K tile
                plgpu.barrier_arrive(ds_ready.at[2])
                plgpu.barrier_wait(ds_ready.at[2])
            k_smem.at[wg][...] = (dk * p.scale).astype(dtype)
            v_smem.at[wg][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[b, keys, h], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[b, keys, h], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        head = lambda g: h * G + g  # noqa: E731  query head of step (i, g)
        qo_spec = plgpu.BlockSpec((bq, None, H), lambda i, g: (q_tile_of(i), head(g), 0),
                                  transforms=mu.smem_transforms(H, dtype))
        row_spec = plgpu.BlockSpec((None, bq), lambda i, g: (head(g), q_tile_of(i)))
        seg_spec = None if q_seg_ref is None else plgpu.BlockSpec((bq,), lambda i, g: (q_tile_of(i),))
        plgpu.emit_pipeline_warp_specialized(
            body, grid=(num_steps, G), memory_registers=split._MEMORY_REGISTERS,
            in_specs=[qo_spec, qo_spec, row_spec, row_spec, seg_spec], max_concurrent_steps=num_stages,
            wg_axis="wg", num_compute_wgs=wgs, manual_consumed_barriers=True, compute_context=compute_thread,
        )(q_ref.at[b], do_ref.at[b], lse_ref.at[b], delta_ref.at[b], None if q_seg_ref is None else q_seg_ref.at[b])

    kv_tile = plgpu.SMEM((wgs, bk, H), dtype, transforms=mu.smem_transforms(H, dtype))
    ds_ring = plgpu.SMEM((2, wgs, bk, bq), dtype, transforms=mu.smem_transforms(bq, dtype))
    dq_tiles = plgpu.SMEM((wgs, bq, dq_cols), _F32, transforms=mu.smem_transforms(dq_cols, _F32))
    out = jax.ShapeDtypeStruct(k.shape, dtype)
    (dk, dv), dq = mu.kernel_accumulating(
        mosaic_attention_bwd_fused, accumulator=jax.ShapeDtypeStruct((p.B, p.T_pad, p.N, H), _F32),
        out_type=(out, out),
        scratch_types=[kv_tile, kv_tile, ds_ring, dq_tiles, plgpu.Barrier(num_arrivals=2, num_barriers=wgs),
                       plgpu.Barrier(num_arrivals=wgs, num_barriers=3)],
        grid=(cdiv(S, tile), p.K, p.B), grid_names=("kv_tiles", "heads", "batch"), num_threads=wgs + 1,
        thread_name="wg", name="mosaic_attention_bwd_fused", approx_math=True,
    )(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens)
    return dq, dk, dv
