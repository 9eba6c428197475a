"""The two Pallas Mosaic-GPU kernels of the flash-attention backward on Hopper (sm90): dQ, and dK/dV.

Both are warp-specialized (``plgpu.emit_pipeline_warp_specialized``): ``compute_wgs`` compute warpgroups and one
TMA warpgroup that streams tiles through a ``num_stages``-deep shared-memory pipeline. Every product is a wgmma
accumulating in float32 registers; operands sit in 128-byte-swizzled shared memory, except the probability /
score-gradient tiles, which are fed from registers as the A operand right after the softmax arithmetic makes them.

``dq_call``: one program per (query tile of compute_wgs · block_q rows, query head, batch). Each compute warpgroup
  owns block_q query rows (its Q and dO tiles in shared memory, lse and delta in registers) and streams K/V tiles
  of block_kv rows: S = Q Kᵀ, dP = dO Vᵀ, P = exp2(S·scale·log2 e − lse), dS = P ∘ (dP − delta), dQ += dS K.
``dkv_call``: one program per (key tile of compute_wgs · block_kv rows, kv head, batch). Each compute warpgroup owns
  block_kv key rows (K and V in shared memory) and streams Q/dO tiles of block_q rows for each of the G query heads
  of its kv head: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q (the GQA head sum stays in registers).

``persistent`` (either kernel, where its step count is static: no causal mask, no kv_seq_lengths, a multiple of
num_stages): one CTA per SM walks the programs (``_walk_items``), one warp-specialized pipeline per program, chained
(``plgpu.PipelinePipeline``): the TMA warpgroup streams the next program's first tiles while the compute warpgroups
finish this one, so the launch, barrier setup and pipeline fill (measured 4.3 µs per dQ program and 7.4 µs per
dK/dV program, against 2.8 and 1.6 µs per step) are paid once per CTA.

Masks are applied only on tiles that need them (a ``lax.cond`` per tile: causal diagonal, the kv length, the key
tail past S; every tile with segment ids); tiles no row can see are never visited. Masked entries are selected
away (``where``), never multiplied by zero, so NaN or inf in K or V at padded keys cannot reach a gradient — except
through dQ += dS K, which reads whole K rows: the caller zeroes K past ``kv_seq_lengths`` for the dQ kernel.

Inputs (the caller pads them, see ``mosaic_bwd``): q, do (B, T, N, H) and k, v (B, S, K, H) in bf16/fp16; lse
(B, N, T_pad) float32 log2-domain log-sum-exp, +inf on padding and on rows with no visible key; delta (B, N, T_pad)
float32 rowsum(o · do), 0 on padding; q_seg (B, T_pad) / kv_seg (B, S_pad) int32 segment ids or None;
kv_lens (B,) int32 or None. Rows past T and keys past S are read as zeros by TMA and never stored.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.index_math import cdiv, i32

__all__ = ["Problem", "dkv_call", "dq_call", "shared_memory_bytes"]

_LOG2E = math.log2(math.e)
_MEMORY_REGISTERS = 40  # registers per thread left to the TMA warpgroup


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static description of one backward call (everything the kernels specialize on)."""

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    T_pad: int  # length of the padded lse / delta / q_seg rows
    S_pad: int  # length of the padded kv_seg rows
    causal: bool
    scale: float
    has_segments: bool
    has_lengths: bool

    @property
    def G(self) -> int:
        return self.N // self.K


# ---------------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------------
_SMEM_RESERVE_BYTES = 4 * 1024  # barriers and Mosaic's own scratch (its reduction scratch is 2 KiB)


def shared_memory_bytes(config, head_dim: int, itemsize: int = 2, *, segments: bool = False) -> tuple[int, int]:
    """(dQ kernel, dK/dV kernel) shared memory in bytes for a ``MosaicAttentionConfig``, with a 4 KiB reserve for
    barriers and Mosaic's own scratch (tests check that what fits this count lowers, and what does not, does not)."""
    c, H = config, head_dim
    dq = (2 * c.compute_wgs_dq * c.block_q_dq * H * itemsize  # Q, dO per warpgroup
          + c.num_stages_dq * (2 * c.block_kv_dq * H * itemsize + (4 * c.block_kv_dq if segments else 0)))
    dkv = (2 * c.compute_wgs_dkv * c.block_kv_dkv * H * itemsize  # K, V per warpgroup
           + c.num_stages_dkv * (2 * c.block_q_dkv * H * itemsize + 4 * c.block_q_dkv * (3 if segments else 2)))
    return dq + _SMEM_RESERVE_BYTES, dkv + _SMEM_RESERVE_BYTES


def _load(ref, layout):
    """The whole (small, unswizzled) ref as an array in ``layout``, from shared or global memory."""
    return mu.load(ref, layout=layout, optimized=False)


def _kv_len(len_ref, b, S: int):
    """Valid keys of batch row b: kv_seq_lengths[b] clipped to [0, S], or the Python int S."""
    return S if len_ref is None else jnp.clip(len_ref[b], 0, S)


def _any(*conds):
    """Logical or of traced scalar bools, skipping Nones; None if all are None."""
    out = None
    for c in conds:
        if c is not None:
            out = c if out is None else jnp.logical_or(out, c)
    return out


def _softmax_grads(s, dp, lse, delta, *, lse_axis: int, c: float, visible):
    """(P, dS) for one tile: P = exp2(s·c − lse), dS = P ∘ (dP − delta); lse and delta broadcast along the rows
    (lse_axis 0: a row per query) or columns (lse_axis 1: transposed tiles, a column per query). ``visible`` (a
    bool tile or None): masked entries of P and dS are selected to 0, so NaN/inf in dP there never leaks."""
    bcast = lambda x: lax.broadcast_in_dim(x, s.shape, [lse_axis])  # noqa: E731
    logits = s * c - bcast(lse)
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)
    p = jnp.exp2(logits)
    ds = p * (dp - bcast(delta))
    if visible is not None:
        ds = jnp.where(visible, ds, 0.0)
    return p, ds


def _masked_or_plain(needs_mask, always: bool, make_visible, grads):
    """grads(visible) with the mask on tiles that need one: ``always`` (segment ids), a traced ``needs_mask``
    (lax.cond between the masked and the plain tile), or never (needs_mask None)."""
    if always:
        return grads(make_visible())
    if needs_mask is None:
        return grads(None)
    return lax.cond(needs_mask, lambda: grads(make_visible()), lambda: grads(None))


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=mu.TILE)


def persistent_ctas(items: int, steps, num_stages: int) -> int:
    """CTAs of a kernel's persistent schedule (one per SM, each taking at least two of the ``items`` programs, so
    that its chain of pipelines starts and stops in different items), or 0 where it cannot run one: a pipeline of
    pipelines needs a static step count (``steps`` a Python int: no causal mask, no kv lengths) that is a multiple
    of ``num_stages``."""
    if not isinstance(steps, int) or steps % num_stages or items < 2:
        return 0
    return min(mu.num_sms(), items // 2)


def _walk_items(program, *, ctas: int, items: int, decompose):
    """The persistent schedule: CTA ``sm`` runs ``program(*decompose(item), state=, allocations=)`` for items sm,
    sm + ctas, ... One warp-specialized pipeline per item, chained (``plgpu.PipelinePipeline``): the TMA
    warpgroup streams the next item's first tiles while the compute warpgroups finish this one, and the CTA's
    launch, barrier setup and pipeline fill are paid once. ``program(..., allocations_only=True)`` returns the
    pipeline's ``get_allocations`` (shared by every item)."""
    allocations = program(*decompose(jnp.int32(0)), allocations_only=True)
    sm = lax.axis_index("sm")
    count = lax.div(i32(items) - sm + i32(ctas - 1), i32(ctas))
    start, steady, stop = (int(s) for s in (plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STEADY,
                                            plgpu.PipelinePipeline.STOP))

    def scope(allocs):
        @pl.loop(0, count)
        def _(i):
            state = jnp.where(i == count - 1, i32(stop), jnp.where(i == 0, i32(start), i32(steady)))
            program(*decompose(sm + i * ctas), state=state, allocations=allocs)

    pl.run_scoped(scope, allocations, collective_axes="wg")


def _schedule(program, *, ctas: int, grid: tuple, names: tuple):
    """(kernel body, launch kwargs of ``mu.kernel``): ``program(refs, *indices)`` once per CTA on ``grid`` (axes
    ``names``), or, with ``ctas`` > 0, the persistent schedule (``_walk_items``) over the same programs."""
    def body(*refs):
        if ctas:
            _walk_items(functools.partial(program, refs), ctas=ctas, items=math.prod(grid),
                        decompose=lambda item: _unravel(item, grid))
        else:
            program(refs, *(lax.axis_index(name) for name in names))

    return body, (dict(grid=(ctas,), grid_names=("sm",)) if ctas else dict(grid=grid, grid_names=names))


def _run_pipeline(pipeline, gmem, allocations, allocations_only: bool):
    """The pipeline's ``get_allocations`` (``allocations_only``), else the pipeline run over ``gmem``."""
    if allocations_only:
        return pipeline.get_allocations(*gmem)
    return pipeline(*gmem, allocations=allocations)


def _unravel(item, sizes):
    """Indices of ``item`` in a grid of ``sizes``, the first varying fastest (a launch grid's order)."""
    out = []
    for size in sizes[:-1]:
        out.append(lax.rem(item, i32(size)))
        item = lax.div(item, i32(size))
    return (*out, item)


# ---------------------------------------------------------------------------------------------------------------
# dQ kernel
# ---------------------------------------------------------------------------------------------------------------
def dq_call(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens, *, p: Problem, block_q: int, block_kv: int,
            compute_wgs: int, num_stages: int, persistent: bool = False):
    """dQ (B, T, N, H) in q.dtype; see the module docstring for the inputs. ``persistent``: one CTA per SM walking
    the programs (``_walk_items``) where ``persistent_ctas`` allows, else one CTA per program."""
    T, S, H, G = p.T, p.S, p.H, p.G
    bq, bk, wgs = block_q, block_kv, compute_wgs
    tile = wgs * bq
    num_q_tiles = cdiv(T, tile)
    c = p.scale * _LOG2E
    key_tail = p.has_lengths or S % bk != 0  # some tile may reach past the valid keys
    dtype = q.dtype
    items = num_q_tiles * p.N * p.B
    static_steps = None if (p.causal or p.has_lengths) else cdiv(S, bk)
    ctas = persistent_ctas(items, static_steps, num_stages) if persistent else 0

    def program(refs, qi, n, b, state=None, allocations=None, allocations_only=False):
        """Query tile qi of head n, batch b (``_walk_items`` for the other arguments)."""
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, len_ref, dq_ref, q_smem, do_smem,
         barrier) = refs
        if p.causal:
            qi = (num_q_tiles - 1) - qi  # the longest rows first: better tail balance
        wg = lax.axis_index("wg")
        t_cta = qi * tile
        t_wg = t_cta + wg * bq  # this warpgroup's first query row (meaningful in compute warpgroups only)
        h = lax.div(n, i32(G))
        kv_len = _kv_len(len_ref, b, S)
        end = jnp.minimum(kv_len, t_cta + tile) if p.causal else kv_len  # keys any row of the program sees
        num_steps = cdiv(end, bk)

        def body(idx, k_tile, v_tile, kv_seg_tile, k_consumed, v_consumed, kv_seg_consumed, carry):
            (j,) = idx
            dq_acc, lse_rows, delta_rows, q_seg_rows = carry
            s0 = j * bk

            def products(s_acc, dp_acc):
                plgpu.wgmma(s_acc, q_smem.at[wg], k_tile.T)
                plgpu.wgmma(dp_acc, do_smem.at[wg], v_tile.T)
                return plgpu.wgmma_accumulator_load(s_acc, wait_n=1), plgpu.wgmma_accumulator_load(dp_acc)

            s, dp = pl.run_scoped(products, plgpu.ACC((bq, bk), jnp.float32), plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(v_consumed)
            kv_seg_cols = None
            if kv_seg_tile is not None:
                kv_seg_cols = _load(kv_seg_tile, mu.COLS)
                plgpu.barrier_arrive(kv_seg_consumed)

            def make_visible():
                rows, cols = t_wg + _iota((bq, bk), 0), s0 + _iota((bq, bk), 1)
                vis = cols < kv_len if key_tail else None
                if p.causal:
                    vis = _and(vis, cols <= rows)
                if p.has_segments:
                    same = (lax.broadcast_in_dim(q_seg_rows, (bq, bk), [0])
                            == lax.broadcast_in_dim(kv_seg_cols, (bq, bk), [1]))
                    vis = _and(vis, same)
                return vis

            needs_mask = _any(s0 + bk > kv_len if key_tail else None,
                              s0 + (bk - 1) > t_wg if p.causal else None)
            _, ds = _masked_or_plain(needs_mask, p.has_segments, make_visible,
                                     lambda vis: _softmax_grads(s, dp, lse_rows, delta_rows, lse_axis=0, c=c,
                                                                visible=vis))
            plgpu.wgmma(dq_acc, ds.astype(dtype), k_tile)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(k_consumed)
            return carry

        def compute_thread(pipeline):
            rows = pl.ds(t_wg, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n], q_smem.at[wg], barrier.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[b, rows, n], do_smem.at[wg], barrier.at[wg])
            lse_rows = _load(lse_ref.at[b, n, rows], mu.ROWS)
            delta_rows = _load(delta_ref.at[b, n, rows], mu.ROWS)
            q_seg_rows = None if q_seg_ref is None else _load(q_seg_ref.at[b, rows], mu.ROWS)
            plgpu.barrier_wait(barrier.at[wg])

            def run(dq_acc):
                pipeline((dq_acc, lse_rows, delta_rows, q_seg_rows))
                return dq_acc[...]

            dq = pl.run_scoped(run, plgpu.ACC((bq, H), jnp.float32))
            q_smem.at[wg][...] = (dq * p.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[b, rows, n])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        kv_spec = plgpu.BlockSpec((bk, H), lambda j: (j, 0), transforms=mu.smem_transforms(H, dtype))
        seg_spec = None if kv_seg_ref is None else plgpu.BlockSpec((bk,), lambda j: (j,))
        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(num_steps,), memory_registers=_MEMORY_REGISTERS, in_specs=[kv_spec, kv_spec, seg_spec],
            max_concurrent_steps=num_stages, wg_axis="wg", num_compute_wgs=wgs, manual_consumed_barriers=True,
            compute_context=compute_thread, pipeline_state=state)
        gmem = (k_ref.at[b, :, h, :], v_ref.at[b, :, h, :], None if kv_seg_ref is None else kv_seg_ref.at[b])
        return _run_pipeline(pipeline, gmem, allocations, allocations_only)

    mosaic_attention_dq, grid = _schedule(program, ctas=ctas, grid=(num_q_tiles, p.N, p.B),
                                          names=("q_tiles", "heads", "batch"))
    q_tile = plgpu.SMEM((wgs, bq, H), dtype, transforms=mu.smem_transforms(H, dtype))
    return mu.kernel(
        mosaic_attention_dq, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=[q_tile, q_tile, plgpu.Barrier(num_arrivals=2, num_barriers=wgs)], **grid, num_threads=wgs + 1,
        thread_name="wg", name="mosaic_attention_dq", approx_math=True,  # exp2 as ex2.approx
    )(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens)


def _and(a, b):
    return b if a is None else jnp.logical_and(a, b)


# ---------------------------------------------------------------------------------------------------------------
# dK / dV kernel
# ---------------------------------------------------------------------------------------------------------------
def dkv_call(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens, *, p: Problem, block_q: int, block_kv: int,
             compute_wgs: int, num_stages: int, persistent: bool = False):
    """(dK, dV), each (B, S, K, H) in k.dtype; see the module docstring for the inputs. ``persistent``: as
    ``dq_call``'s."""
    T, S, H, G = p.T, p.S, p.H, p.G
    bq, bk, wgs = block_q, block_kv, compute_wgs
    tile = wgs * bk
    num_q_tiles = cdiv(T, bq)
    c = p.scale * _LOG2E
    dtype = k.dtype
    num_kv_tiles = cdiv(S, tile)
    items = num_kv_tiles * p.K * p.B
    static_steps = None if (p.causal or p.has_lengths) else num_q_tiles * G
    ctas = persistent_ctas(items, static_steps, num_stages) if persistent else 0

    def program(refs, kv_tile, h, b, state=None, allocations=None, allocations_only=False):
        """Key tile kv_tile of kv head h, batch b (``_walk_items`` for the other arguments)."""
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, len_ref, dk_ref, dv_ref, k_smem,
         v_smem, barrier) = refs
        s_cta = kv_tile * tile
        wg = lax.axis_index("wg")
        s_wg = s_cta + wg * bk  # this warpgroup's first key (meaningful in compute warpgroups only)
        kv_len = _kv_len(len_ref, b, S)
        # Query tiles [lo, num_q_tiles) can see some key of this program: under causal, queries t >= s_cta; none
        # when the program starts past the kv length (its gradients are then zeros).
        lo = jnp.minimum(lax.div(s_cta, i32(bq)), i32(num_q_tiles)) if p.causal else 0
        if p.has_lengths:
            lo = jnp.where(s_cta >= kv_len, i32(num_q_tiles), i32(lo))
        num_steps = num_q_tiles - lo  # a Python int without causal mask and lengths: a static pipeline

        def body(idx, q_tile, do_tile, lse_tile, delta_tile, q_seg_tile, q_consumed, do_consumed, lse_consumed,
                 delta_consumed, q_seg_consumed, carry):
            i, _ = idx
            dk_acc, dv_acc, kv_seg_rows = carry
            t0 = (lo + i) * bq

            def products(s_acc, dp_acc):
                plgpu.wgmma(s_acc, k_smem.at[wg], q_tile.T)
                plgpu.wgmma(dp_acc, v_smem.at[wg], do_tile.T)
                return plgpu.wgmma_accumulator_load(s_acc, wait_n=1), plgpu.wgmma_accumulator_load(dp_acc)

            s_t, dp_t = pl.run_scoped(products, plgpu.ACC((bk, bq), jnp.float32),
                                      plgpu.ACC((bk, bq), jnp.float32))
            lse_cols, delta_cols = _load(lse_tile, mu.COLS), _load(delta_tile, mu.COLS)
            plgpu.barrier_arrive(lse_consumed)
            plgpu.barrier_arrive(delta_consumed)
            q_seg_cols = None
            if q_seg_tile is not None:
                q_seg_cols = _load(q_seg_tile, mu.COLS)
                plgpu.barrier_arrive(q_seg_consumed)

            def make_visible():
                keys, queries = s_wg + _iota((bk, bq), 0), t0 + _iota((bk, bq), 1)
                vis = keys < kv_len if p.has_lengths else None
                if p.causal:
                    vis = _and(vis, keys <= queries)
                if p.has_segments:
                    same = (lax.broadcast_in_dim(kv_seg_rows, (bk, bq), [0])
                            == lax.broadcast_in_dim(q_seg_cols, (bk, bq), [1]))
                    vis = _and(vis, same)
                return vis

            needs_mask = _any(s_wg + bk > kv_len if p.has_lengths else None,
                              s_wg + (bk - 1) > t0 if p.causal else None)
            p_t, ds_t = _masked_or_plain(needs_mask, p.has_segments, make_visible,
                                         lambda vis: _softmax_grads(s_t, dp_t, lse_cols, delta_cols, lse_axis=1,
                                                                    c=c, visible=vis))
            plgpu.wgmma(dv_acc, p_t.astype(dtype), do_tile)
            plgpu.wgmma(dk_acc, ds_t.astype(dtype), q_tile)
            plgpu.wgmma_wait(1)  # dV's product is done: dO may be overwritten
            plgpu.barrier_arrive(do_consumed)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(q_consumed)
            return carry

        def compute_thread(pipeline):
            keys = pl.ds(s_wg, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[wg], barrier.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[wg], barrier.at[wg])
            kv_seg_rows = None if kv_seg_ref is None else _load(kv_seg_ref.at[b, keys], mu.ROWS)
            plgpu.barrier_wait(barrier.at[wg])

            def run(dk_acc, dv_acc):
                pipeline((dk_acc, dv_acc, kv_seg_rows))
                return dk_acc[...], dv_acc[...]

            acc = plgpu.ACC((bk, H), jnp.float32)
            dk, dv = pl.run_scoped(run, acc, acc)
            k_smem.at[wg][...] = (dk * p.scale).astype(dtype)
            v_smem.at[wg][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[b, keys, h], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[b, keys, h], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        head = lambda g: h * G + g  # noqa: E731  query head of step (i, g)
        qo_spec = plgpu.BlockSpec((bq, None, H), lambda i, g: (lo + i, head(g), 0),
                                  transforms=mu.smem_transforms(H, dtype))
        row_spec = plgpu.BlockSpec((None, bq), lambda i, g: (head(g), lo + i))
        seg_spec = None if q_seg_ref is None else plgpu.BlockSpec((bq,), lambda i, g: (lo + i,))
        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(num_steps, G), memory_registers=_MEMORY_REGISTERS,
            in_specs=[qo_spec, qo_spec, row_spec, row_spec, seg_spec], max_concurrent_steps=num_stages,
            wg_axis="wg", num_compute_wgs=wgs, manual_consumed_barriers=True, compute_context=compute_thread,
            pipeline_state=state)
        gmem = (q_ref.at[b], do_ref.at[b], lse_ref.at[b], delta_ref.at[b],
                None if q_seg_ref is None else q_seg_ref.at[b])
        return _run_pipeline(pipeline, gmem, allocations, allocations_only)

    mosaic_attention_dkv, grid = _schedule(program, ctas=ctas, grid=(num_kv_tiles, p.K, p.B),
                                           names=("kv_tiles", "heads", "batch"))
    kv_smem = plgpu.SMEM((wgs, bk, H), dtype, transforms=mu.smem_transforms(H, dtype))
    out = jax.ShapeDtypeStruct(k.shape, dtype)
    return mu.kernel(
        mosaic_attention_dkv, out_type=(out, out),
        scratch_types=[kv_smem, kv_smem, plgpu.Barrier(num_arrivals=2, num_barriers=wgs)], **grid,
        num_threads=wgs + 1,
        thread_name="wg", name="mosaic_attention_dkv", approx_math=True,
    )(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens)
