"""The Mosaic-GPU (sm90) flash-attention forward kernel, its launch and its shared-memory size; ``mosaic.py`` wires
it into the backend (config in ``config.MosaicAttentionConfig``).

A work item is (query head n, 2·block_q query rows qi, batch row b). Its CTA runs three warpgroups: a producer
that TMA-loads each compute warpgroup's (block_q, H) q tile and streams the (block_kv, H) K and V tiles the item
needs through a num_stages-deep shared-memory ring, and two compute warpgroups that each own block_q query rows:
q·kᵀ (wgmma from shared memory), the online softmax in registers (exp2 of scores·scale·log2 e, one FMA per
score), p·v (wgmma, p from registers), then o (and lse, o_lo) out through shared memory by TMA. ``ping_pong``
alternates the two compute warpgroups through a barrier (FA3): one's softmax runs while the other's products own the
tensor cores. ``persistent`` launches one CTA per SM that walks items sm, sm + num_sms, ...: the K/V ring, and the
next item's q (prefetched by the producer as soon as a warpgroup's last q·kᵀ is done), run on across items, so
loads and the output stores overlap the neighbouring items' compute instead of sitting at each CTA's start and end.

Masks: causal tiles past the diagonal are never loaded (the row block's later warpgroup sets the count; the earlier
one takes and releases the tiles it does not need); tiles visible to every row skip the mask; the others mask the
causal diagonal, keys >= the length (or past S: TMA zero-fills reads out of bounds, drops writes there), and other
segments (segment ids of a key tile are read per step).

With residuals (the differentiated path) the kernel also stores lse and o_lo = o_f32 − o, the output's rounding
error, which the backward's delta needs. The softmax sum l adds the unrounded probabilities, as without residuals:
summing them as p·v rounds them to q.dtype (as ``triton_fwd`` does) made this forward 26% slower (1102 vs 876 µs at
B4 T=S=4096 N16 H128; causal 614 vs 480) for no measurable gain: dq, dk, dv against float64 on saturated inputs
(q, k × 30) came out within 2.8e-3 / 3.2e-3 / 2.9e-3 (H 64) and 3.8e-3 / 3.6e-3 / 3.4e-3 (H 128) either way
(benchmarks/results/attention_residual_cost-h100.json, benchmarks/scripts/attention_residual_cost.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.index_math import cdiv, div, minimum, round_up

__all__ = ["COMPUTE_WGS", "kernel_call", "shared_memory_bytes"]

COMPUTE_WGS = 2
_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # running max before any visible key: finite, so exp2(m_old - m_new) never sees inf - inf


def _kernel(*refs, cfg, causal: bool, scale: float, residuals: bool, has_seg: bool, has_lens: bool, dims: tuple,
            num_sms: int):
    B, T, S, N, G = dims
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    nq = cdiv(T, 2 * bq)
    it = iter(refs)  # inputs, outputs, scratch, in kernel_call's order
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    q_seg_ref, kv_seg_ref = (next(it), next(it)) if has_seg else (None, None)
    len_ref = next(it) if has_lens else None
    o_ref = next(it)
    lse_ref, lo_ref = (next(it), next(it)) if residuals else (None, None)
    q_smem, o_smem, k_smem, v_smem, lse_smem, k_ready, v_ready, q_ready, q_free, k_free, v_free, turn, turns = it
    o_smem = q_smem if o_smem is None else o_smem  # not persistent: o leaves through the q tile's buffer
    wg = lax.axis_index("wg")
    dtype, H = q_ref.dtype, q_ref.shape[-1]
    bounded = has_lens or S % bk != 0  # a key tile may reach past kv_end

    def for_each_item(body):
        """body(n, qi, b, first, done) for this CTA's items; done counts the ring's tiles before the item."""
        if not cfg.persistent:
            body(lax.axis_index("heads"), lax.axis_index("q_tiles"), lax.axis_index("batch"), True, 0)
            return
        sm = lax.axis_index("sm")

        def one(i, done):
            item = sm + i * num_sms  # heads vary fastest: items sharing a kv head run side by side (L2)
            rest = lax.div(item, N)
            return done + body(lax.rem(item, N), lax.rem(rest, nq), lax.div(rest, nq), i == 0, done)

        lax.fori_loop(0, lax.div(N * nq * B - sm + (num_sms - 1), num_sms), one, jnp.int32(0))

    def item_bounds(qi, b):
        if causal:  # the longest rows first: better balance of the last wave
            qi = nq - 1 - qi
        kv_end = S if len_ref is None else len_ref[b]  # keys >= kv_end are masked (lengths clipped to [0, S])
        # Key tiles any row < row_end can see (top-left causal: row t sees keys <= t).
        num_tiles = lambda row_end: cdiv(minimum(kv_end, row_end) if causal else kv_end, bk)  # noqa: E731
        q0 = qi * (2 * bq)
        return q0, kv_end, num_tiles, num_tiles(q0 + 2 * bq)  # the last: what the producer loads

    def schedule():
        if cfg.ping_pong:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    def compute(n, qi, b, first, done):
        q0, kv_end, num_tiles, block_tiles = item_bounds(qi, b)
        q_base = q0 + wg * bq
        q_tile = q_smem.at[wg]
        tiles = num_tiles(q_base + bq)
        # Tiles [0, full) are visible to every row of this warpgroup: no mask.
        if has_seg:
            full = 0
        elif causal:
            full = minimum(lax.div(q_base + 1, bk), div(kv_end, bk))
        else:
            full = div(kv_end, bk)
        q_seg = None
        if has_seg:
            q_seg = mu.load(q_seg_ref.at[b, pl.ds(q_base, bq)], layout=mu.ROWS, optimized=False)
        c = scale * _LOG2E  # scores·c are log2-domain logits: exp(x·scale) == exp2(x·c)
        exp_c, pre_c = (c, None) if c > 0 else (1.0, c)  # max(s)·c == max(s·c) only for c > 0
        bcast_row = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])  # noqa: E731
        plgpu.barrier_wait(q_ready.at[wg])

        def scores(s, j, masked: bool):
            """Tile j's scores (bq, bk) as the softmax takes them: times a negative scale, masked entries -inf."""
            if pre_c is not None:
                s = s * pre_c
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=mu.TILE) + q_base
                cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=mu.TILE) + j * bk
                if causal:
                    s = jnp.where(rows >= cols, s, -jnp.inf)
                if bounded:
                    s = jnp.where(cols < kv_end, s, -jnp.inf)
                if has_seg:
                    kv_seg = mu.load(kv_seg_ref.at[b, pl.ds(j * bk, bk)], layout=mu.COLS, optimized=False)
                    same = bcast_row(q_seg, (bq, bk)) == lax.broadcast_in_dim(kv_seg, (bq, bk), [1])
                    s = jnp.where(same, s, -jnp.inf)
            return s

        def step(j, carry, *, masked: bool):
            acc, m, l = carry
            slot = lax.rem(done + j, stages)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                schedule()  # the other warpgroup's softmax ends: its p·v may start
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = scores(s, j, masked)
            m_new = jnp.maximum(m, s.max(axis=1) * exp_c)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * exp_c - bcast_row(m_new, s.shape))  # masked scores: exp2(-inf) = 0
            acc = acc * bcast_row(alpha, acc.shape)
            l = l * alpha
            p16 = p.astype(dtype)
            if H <= 128:  # the order jax's attention_mgpu found faster for H <= 128
                l = l + p.sum(axis=1)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            if cfg.ping_pong:
                plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            if cfg.ping_pong:
                plgpu.barrier_wait(turn)  # the tensor cores are ours
            if H > 128:
                l = l + p.sum(axis=1)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                @pl.when(j + 1 < tiles)  # wait for the next K tile while p·v runs
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(done + j + 1, stages)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def drain(j, _):
            # A tile only the other warpgroup needs (causal): take it and release it at once, so the ring and the
            # turns keep going. Waiting for it first keeps this warpgroup from arriving twice on one free barrier
            # phase (a slot freed while the other warpgroup still reads it) when the turns do not pace it.
            slot = lax.rem(done + j, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            schedule()
            schedule()

        def my_turn():  # overlap with ping-pong: the warpgroups take turns issuing their batches of products
            if cfg.ping_pong:
                plgpu.barrier_wait(turns.at[wg])

        def your_turn():
            if cfg.ping_pong:
                plgpu.barrier_arrive(turns.at[1 - wg])

        def softmax(s, m, l):
            """(m_new, alpha, p16, l_new) of one tile's (masked) scores."""
            m_new = jnp.maximum(m, s.max(axis=1) * exp_c)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * exp_c - bcast_row(m_new, s.shape))  # masked scores: exp2(-inf) = 0
            return m_new, alpha, p.astype(dtype), l * alpha + p.sum(axis=1)

        def batch(j, carry, *, masked: bool, qk: bool = True, pv: bool = True):
            """One turn on the tensor cores: q·k_jᵀ and p_{j-1}·v_{j-1} issued together, tile j's softmax while
            p·v runs; acc is rescaled by tile j's alpha once p·v is done (FA3's intra-warpgroup overlap)."""
            acc, m, l, p_prev = carry
            slot, prev = lax.rem(done + j, stages), lax.rem(done + j - 1, stages)
            my_turn()
            if qk:
                plgpu.barrier_wait(k_ready.at[slot])
            if pv:
                plgpu.barrier_wait(v_ready.at[prev])

            def products(refs):
                o_acc, m_ref, l_ref, p_ref, alpha_ref = refs

                def issue(s_acc):
                    if qk:
                        plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].transpose((1, 0)))
                    if pv:
                        plgpu.wgmma(o_acc, p_ref[...], v_smem.at[prev])
                    your_turn()
                    return plgpu.wgmma_accumulator_load(s_acc, wait_n=1 if pv else 0) if qk else None

                s = pl.run_scoped(issue, plgpu.ACC((bq, bk), jnp.float32))
                if qk:
                    plgpu.barrier_arrive(k_free.at[slot])
                    m_ref[...], alpha_ref[...], p_ref[...], l_ref[...] = softmax(scores(s, j, masked), m_ref[...],
                                                                                  l_ref[...])

            alpha = plgpu.layout_cast(jnp.ones((bq,), jnp.float32), mu.ROWS)
            acc, m, l, p_prev, alpha = pl.run_state(products)((plgpu.ACC.init(acc), m, l, p_prev, alpha))
            if pv:
                plgpu.barrier_arrive(v_free.at[prev])
            return acc * bcast_row(alpha, acc.shape), m, l, p_prev

        def overlapped(acc, m, l):
            """The key loop with FA3's intra-warpgroup overlap: tiles + 1 turns (the first only q·k_0ᵀ, the last
            only p·v), then one turn per tile only the other warpgroup needs (causal), so both take block_tiles + 1
            turns per item. Returns (acc, m, l)."""
            p0 = plgpu.layout_cast(jnp.zeros((bq, bk), dtype), mu.TILE)
            carry = lax.fori_loop(0, minimum(tiles, 1), functools.partial(batch, masked=True, pv=False),
                                  (acc, m, l, p0))
            first_masked = jnp.maximum(minimum(full, tiles), 1)
            carry = lax.fori_loop(1, first_masked, functools.partial(batch, masked=False), carry)
            carry = lax.fori_loop(first_masked, tiles, functools.partial(batch, masked=True), carry)
            plgpu.barrier_arrive(q_free.at[wg])  # every q·kᵀ of this item is done: the producer may load the next q
            carry = lax.fori_loop(tiles, tiles + minimum(tiles, 1), functools.partial(batch, masked=False, qk=False),
                                  carry)
            if causal:

                def pass_turn(j, _):  # a tile only the other warpgroup needs: take and release it
                    slot = lax.rem(done + j, stages)
                    my_turn()
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    your_turn()

                lax.fori_loop(tiles, block_tiles, pass_turn, None)
            return carry[:3]

        m = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), mu.ROWS)
        l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), mu.ROWS)
        acc = plgpu.layout_cast(jnp.zeros((bq, H), jnp.float32), mu.TILE)

        @pl.when(jnp.logical_and(tiles > 0, not cfg.overlap))
        def _():
            plgpu.barrier_wait(k_ready.at[done % stages if isinstance(done, int) else lax.rem(done, stages)])

        if cfg.overlap:
            acc, m, l = overlapped(acc, m, l)
        else:
            pl.when(wg == 1)(schedule)
            carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (acc, m, l))
            if has_seg or causal or bounded:
                carry = lax.fori_loop(full, tiles, functools.partial(step, masked=True), carry)
            if causal:
                lax.fori_loop(tiles, block_tiles, drain, None)
            plgpu.barrier_arrive(q_free.at[wg])  # every q·kᵀ of this item is done: the producer may load the next q
            pl.when(wg == 0)(schedule)
            acc, m, l = carry

        empty = l == 0.0  # no visible key: o = 0, lse = +inf
        safe_l = jnp.where(empty, 1.0, l)
        o = acc * bcast_row(1.0 / safe_l, acc.shape)
        o_out = o.astype(dtype)
        out_tile = o_smem.at[wg]
        if cfg.persistent:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's tiles have left o_smem, lse_smem
        out_tile[...] = o_out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_tile, o_ref.at[b, pl.ds(q_base, bq), n])
        if residuals:
            lse_smem[wg] = jnp.where(empty, jnp.inf, m + jnp.log(safe_l) * (1.0 / math.log(2.0)))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, pl.ds(q_base, bq)])
            o_lo = (o - o_out.astype(jnp.float32)).astype(dtype)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the o tile has left out_tile
            out_tile[...] = o_lo
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_tile, lo_ref.at[b, pl.ds(q_base, bq), n])
        return block_tiles

    def produce(n, qi, b, first, done):
        q0, _, _, block_tiles = item_bounds(qi, b)
        kv_head = lax.div(n, G)

        def load_kv(j):
            g = done + j  # position in the ring since the kernel started
            slot, rows = lax.rem(g, stages), (b, pl.ds(j * bk, bk), kv_head)
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(k_free.at[slot]))
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(v_free.at[slot]))
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        def load_q():
            for w in range(COMPUTE_WGS):
                if cfg.persistent:  # the warpgroup's last q·kᵀ of the previous item is done
                    pl.when(jnp.logical_not(first))(functools.partial(plgpu.barrier_wait, q_free.at[w]))
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0 + w * bq, bq), n], q_smem.at[w], q_ready.at[w])

        if cfg.persistent:  # the ring runs on while the q tiles wait for the previous item
            pl.loop(0, minimum(stages, block_tiles))(load_kv)
            load_q()
        else:  # nothing to wait for: the q tiles first (the first q·kᵀ needs them), then the ring
            load_q()
            pl.loop(0, minimum(stages, block_tiles))(load_kv)
        pl.loop(stages, block_tiles)(load_kv)
        return block_tiles

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        if cfg.overlap and cfg.ping_pong:
            pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turns.at[0]))
        for_each_item(compute)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        for_each_item(produce)


def _swizzled_smem(shape, dtype):
    """A shared-memory buffer in wgmma's operand layout (rows of H elements: 128-byte swizzle for H >= 64)."""
    return plgpu.SMEM(shape, dtype, transforms=mu.smem_transforms(shape[-1], dtype))


def shared_memory_bytes(head_dim: int, dtype, config) -> int:
    """Shared memory the kernel allocates with this config: the two warpgroups' q tiles (and o tiles when
    persistent), the K and V rings, the lse rows and the barriers, each buffer rounded up to 1 KiB (the 128-byte
    swizzle's alignment); no cross-warp reduction scratch (row reductions of wgmma tiles stay inside a warp).
    Equal to Mosaic's own count (tests check it against the lowering)."""
    item = jnp.dtype(dtype).itemsize
    kib = lambda n: round_up(n, 1024)  # noqa: E731
    tiles = ((2 if config.persistent else 1) * kib(COMPUTE_WGS * config.block_q * head_dim * item)
             + 2 * kib(config.num_stages * config.block_kv * head_dim * item) + kib(COMPUTE_WGS * config.block_q * 4))
    return tiles + 8 * (4 * config.num_stages + 2 * COMPUTE_WGS + 1 + (COMPUTE_WGS if config.overlap else 0))


def kernel_call(q, k, v, q_seg, kv_seg, kv_lens, *, cfg, causal: bool, scale: float, residuals: bool):
    """(o (B, T, N, H) q.dtype, lse (B, N, T) float32 log2 domain or None, o_lo (B, T, N, H) q.dtype or None).

    q (B, T, N, H), k and v (B, S, K, H) bf16/fp16; q_seg (B, T) and kv_seg (B, S) int32 or both None; kv_lens (B,)
    int32 or None; cfg a ``MosaicAttentionConfig``. With ``residuals`` also lse and o_lo."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    nq = pl.cdiv(T, 2 * bq)
    T_pad = nq * 2 * bq  # lse rows as whole tiles: TMA needs 16-byte row strides, so any T works
    inputs = [q, k, v]
    if q_seg is not None:  # padded to whole tiles: the kernel reads them with plain (unchecked) loads
        inputs.append(jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, T_pad - T)), constant_values=-1))
        inputs.append(jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, round_up(S, bk) - S)), constant_values=-2))
    if kv_lens is not None:
        kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, S)
        # Padding never reaches p·v: V rows >= length are zeroed here (one fused pass over V).
        inputs[2] = jnp.where(jnp.arange(S)[None, :, None, None] < kv_lens[:, None, None, None], v,
                              jnp.zeros((), v.dtype))
        inputs.append(kv_lens)
    # TMA copies into (8, 64)-tiled shared memory need sequence lengths that are multiples of 8, and no box may lie
    # wholly outside its array: shorter or odd lengths are padded to that, at least one CTA's tile (one XLA copy;
    # padded keys are masked, padded query rows sliced off).
    T_rows, S_rows = max(round_up(T, 8), COMPUTE_WGS * bq), max(round_up(S, 8), bk)
    pad_rows = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))  # noqa: E731
    if T_rows != T:
        inputs[0] = pad_rows(q, T_rows)
    if S_rows != S:
        inputs[1], inputs[2] = pad_rows(inputs[1], S_rows), pad_rows(inputs[2], S_rows)
    out_type = [jax.ShapeDtypeStruct((B, T_rows, N, H), q.dtype)]
    if residuals:
        out_type += [jax.ShapeDtypeStruct((B, N, T_pad), jnp.float32), jax.ShapeDtypeStruct((B, T_rows, N, H), q.dtype)]
    scratch = (
        _swizzled_smem((COMPUTE_WGS, bq, H), q.dtype),  # q tiles (not persistent: then o / o_lo on the way out)
        _swizzled_smem((COMPUTE_WGS, bq, H), q.dtype) if cfg.persistent else None,  # o / o_lo tiles
        _swizzled_smem((stages, bk, H), k.dtype),
        _swizzled_smem((stages, bk, H), v.dtype),
        plgpu.SMEM((COMPUTE_WGS, bq), jnp.float32),  # lse rows on the way out
        plgpu.Barrier(num_barriers=stages),  # K tile landed
        plgpu.Barrier(num_barriers=stages),  # V tile landed
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q tile landed
        plgpu.Barrier(num_barriers=COMPUTE_WGS),  # q tile free again (persistent: the next item's may load)
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # K slot free again
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # V slot free again
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # ping-pong turns
        plgpu.Barrier(num_barriers=COMPUTE_WGS) if cfg.overlap else None,  # overlap's turns, one per warpgroup
    )
    sms = min(mu.num_sms(), N * nq * B)
    grid = dict(grid=(sms,), grid_names=("sm",)) if cfg.persistent else dict(
        grid=(N, nq, B), grid_names=("heads", "q_tiles", "batch"))
    kernel = functools.partial(_kernel, cfg=cfg, causal=causal, scale=scale, residuals=residuals,
                               has_seg=q_seg is not None, has_lens=kv_lens is not None, dims=(B, T, S, N, N // K),
                               num_sms=sms)
    outs = mu.kernel(kernel, out_type=tuple(out_type), scratch_types=scratch, **grid, num_threads=COMPUTE_WGS + 1,
                     thread_name="wg", name="mosaic_attention_fwd", approx_math=True, reduction_scratch_bytes=0,
                     )(*inputs)
    if not residuals:
        return outs[0][:, :T], None, None
    o, lse, o_lo = outs
    return o[:, :T], lse[..., :T], o_lo[:, :T]
