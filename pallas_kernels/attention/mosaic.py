"""Flash attention forward on Hopper (sm90) in Pallas Mosaic GPU: TMA, wgmma, warp specialization.

One CTA per (query head, 2·block_q query rows, batch row) runs three warpgroups: a producer that streams K and V
tiles (block_kv, H) into a num_stages-deep shared-memory ring with TMA, and two compute warpgroups, each owning
block_q query rows, that run q·kᵀ and p·v on the tensor cores (wgmma, operands in shared memory except p, which
stays in registers) with an online softmax in between. With ``ping_pong`` the two compute warpgroups alternate
through a shared barrier (the FA3 schedule): one warpgroup's exp2s run while the other's matrix products occupy the
tensor cores. The (T, S) scores exist only as (block_q, block_kv) register tiles.

Semantics are those of the Triton backend (``pallas_kernels.reference.attention`` is the float32 reference): q (B,
T, N, H), k and v (B, S, K, H), N % K == 0 (query head n reads kv head n // (N // K)); causal masks top-left aligned
(key s visible to query t iff s <= t, also when T != S); segment ids and ``kv_seq_lengths`` mask keys; a row with no
visible key returns zeros and log-sum-exp +inf. Key tiles that no row of a CTA can see (past the diagonal, past the
length) are never loaded. Tails of T and S need no padding: TMA zero-fills reads past the end of an array and drops
writes there, and a bounds mask keeps zero-filled keys out of the softmax. V rows at positions >= kv_seq_lengths are
zeroed before the kernel (one fused XLA pass over V, only when lengths are given), so NaN or inf stored in padding
never reaches the output (0·NaN in p·v would).

Residuals for the backward: the (B, N, T) float32 log-sum-exp in the log2 domain (log2 Σ_s exp2(score·scale·log2 e))
and ``o_lo`` = o_f32 − o, the output's rounding error, in q.dtype (B, T, N, H): o + o_lo carries ~16 mantissa bits,
so the backward's delta = rowsum(o·do) does not lose near one-hot rows to cancellation (the saturated-softmax case of
issue 16). It costs one more q.dtype write of the output's size, half of what a float32 copy of o would.

float32 inputs stay on the Triton backend (``unsupported_reason`` says so): wgmma has no float32 path worth having.
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

from pallas_kernels.attention import mosaic_compat

__all__ = ["MosaicAttentionConfig", "attention_forward", "default_config", "flash_attention", "shared_memory_bytes",
           "unsupported_reason"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_COMPUTE_WGS = 2
_MAX_SMEM_BYTES = 227 * 1024  # sm90's opt-in limit per block, the figure Mosaic checks when lowering without a GPU
_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # running max before any visible key: finite, so exp2(m_old - m_new) never sees inf - inf
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per query row of a wgmma tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per key column


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Tiling of the forward kernel (one static argument, hashable).

    Attributes:
      block_q: query rows per compute warpgroup (a CTA holds 2·block_q); a multiple of 64 (wgmma's row count).
      block_kv: key/value rows per pipeline step; a multiple of 64.
      num_stages: depth of the K/V shared-memory ring (tiles in flight ahead of the compute warpgroups), >= 2.
      ping_pong: alternate the two compute warpgroups through a barrier (FA3 schedule) instead of free-running.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    ping_pong: bool = True

    def __post_init__(self):
        for name, multiple in (("block_q", 64), ("block_kv", 64)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % multiple:
                raise ValueError(f"MosaicAttentionConfig.{name}: must be a positive multiple of {multiple}, "
                                 f"got {value!r}")
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or not 2 <= self.num_stages <= 6:
            raise ValueError(f"MosaicAttentionConfig.num_stages: must be an int in [2, 6], got {self.num_stages!r}")
        if not isinstance(self.ping_pong, bool):
            raise ValueError(f"MosaicAttentionConfig.ping_pong: must be a bool, got {self.ping_pong!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_config(q, k, *, causal: bool = False) -> MosaicAttentionConfig:
    """64-row query tiles per warpgroup; 128-row K/V tiles two deep where they fit shared memory (H <= 128),
    64-row tiles for H = 256."""
    del k, causal  # one table for now: the suite shapes all take the same tiles
    H = q.shape[-1]
    return MosaicAttentionConfig(block_kv=128 if H <= 128 else 64)


def shared_memory_bytes(head_dim: int, dtype, config: MosaicAttentionConfig) -> int:
    """Shared memory the kernel allocates: the two warpgroups' q/o tiles, the K and V rings, the lse rows and the
    barriers, each buffer rounded up to 1 KiB (the 128-byte swizzle's alignment); no cross-warp reduction scratch
    (row reductions of wgmma tiles stay inside a warp). Equal to Mosaic's own count (tests check it)."""
    item = jnp.dtype(dtype).itemsize
    kib = lambda n: -(-n // 1024) * 1024
    tiles = (kib(_COMPUTE_WGS * config.block_q * head_dim * item)
             + 2 * kib(config.num_stages * config.block_kv * head_dim * item)
             + kib(_COMPUTE_WGS * config.block_q * 4))
    return tiles + 8 * (4 * config.num_stages + _COMPUTE_WGS + 1)


def unsupported_reason(q, k, v, *, causal: bool = False, scale=None, q_segment_ids=None, kv_segment_ids=None,
                       kv_seq_lengths=None, config: MosaicAttentionConfig | None = None) -> str | None:
    """None when this backend runs these (already validated) arguments, else one sentence naming the constraint."""
    del causal, scale, q_segment_ids, kv_segment_ids, kv_seq_lengths, v  # every mask kind is supported
    dtype = jnp.dtype(q.dtype)
    if dtype not in _DTYPES:
        return (f"the Mosaic backend takes bfloat16 or float16 inputs, got {dtype} (float32 runs on the Triton "
                f"backend)")
    H = q.shape[-1]
    if H not in SUPPORTED_HEAD_DIMS:
        return f"the Mosaic backend takes head dims {SUPPORTED_HEAD_DIMS} (whole 128-byte swizzled tiles), got H={H}"
    config = default_config(q, k) if config is None else config
    need = shared_memory_bytes(H, dtype, config)
    if need > _MAX_SMEM_BYTES:
        return (f"the Mosaic backend's tiles for H={H} ({config}) need {need} bytes of shared memory, over the "
                f"{_MAX_SMEM_BYTES} an sm90 block can have: use smaller block_q, block_kv or num_stages")
    return None


# Scalar index arithmetic: Python ints stay Python ints, traced int32 scalars use lax ops (operands are >= 0).
def _cdiv(a, d: int):
    return -(-a // d) if isinstance(a, int) else lax.div(a + (d - 1), d)


def _div(a, d: int):
    return a // d if isinstance(a, int) else lax.div(a, d)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable)."""

    config: MosaicAttentionConfig
    causal: bool
    scale: float
    residuals: bool  # also return lse and o_lo
    bwd_config: object = None  # the backward's config; None: mosaic_bwd.default_config


def _kernel(*refs, static: _Static, has_seg: bool, has_lens: bool, T: int, S: int, G: int):
    """One CTA: query rows [(2·qi + w)·bq, +bq) for compute warpgroup w of head n, batch b; see the module doc."""
    cfg = static.config
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    it = iter(refs)  # inputs, outputs, scratch, in _kernel_call's order
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    q_seg_ref, kv_seg_ref = (next(it), next(it)) if has_seg else (None, None)
    len_ref = next(it) if has_lens else None
    o_ref = next(it)
    lse_ref, lo_ref = (next(it), next(it)) if static.residuals else (None, None)
    qo_smem, k_smem, v_smem, lse_smem, k_ready, v_ready, q_ready, k_free, v_free, turn = it

    n, b = lax.axis_index("heads"), lax.axis_index("batch")
    qi = lax.axis_index("q_tiles")
    if static.causal:  # the longest rows first: better balance of the last wave
        qi = pl.cdiv(T, 2 * bq) - 1 - qi
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    H = q_ref.shape[-1]

    kv_end = S if len_ref is None else len_ref[b]  # keys >= kv_end are masked (lengths already clipped to [0, S])
    bounded = len_ref is not None or S % bk != 0  # a tile may reach past kv_end
    # Key tiles any row < row_end can see (top-left causal: row t sees keys <= t).
    num_tiles = lambda row_end: _cdiv(_min(kv_end, row_end) if static.causal else kv_end, bk)
    q0 = qi * (2 * bq)
    block_tiles = num_tiles(q0 + 2 * bq)  # what the producer loads: the later warpgroup's count

    def schedule():
        if cfg.ping_pong:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    @pl.when(wg < _COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_base = q0 + wg * bq
        q_smem = qo_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, bq), n], q_smem, q_ready.at[wg])
        q_seg = None
        if has_seg:
            q_seg = mosaic_compat.load(q_seg_ref.at[b, pl.ds(q_base, bq)], layout=_ROW, optimized=False)
        tiles = num_tiles(q_base + bq)
        # Tiles [0, full) are visible to every row of this warpgroup: no mask.
        if has_seg:
            full = 0
        elif static.causal:
            full = _min(lax.div(q_base + 1, bk), _div(kv_end, bk))
        else:
            full = _div(kv_end, bk)
        plgpu.barrier_wait(q_ready.at[wg])

        c = static.scale * _LOG2E  # scores·c are log2-domain logits: exp(x·scale) == exp2(x·c)
        exp_c, pre_c = (c, None) if c > 0 else (1.0, c)  # max(s)·c == max(s·c) only for c > 0
        bcast_row = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])

        def step(j, carry, *, masked: bool):
            acc, m, l = carry
            slot = lax.rem(j, stages)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                schedule()  # the other warpgroup's softmax ends: its p·v may start
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if pre_c is not None:
                s = s * pre_c
            if masked:
                rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA) + q_base
                cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA) + j * bk
                if static.causal:
                    s = jnp.where(rows >= cols, s, -jnp.inf)
                if bounded:
                    s = jnp.where(cols < kv_end, s, -jnp.inf)
                if has_seg:
                    kv_seg = mosaic_compat.load(kv_seg_ref.at[b, pl.ds(j * bk, bk)], layout=_COL, optimized=False)
                    same = bcast_row(q_seg, (bq, bk)) == lax.broadcast_in_dim(kv_seg, (bq, bk), [1])
                    s = jnp.where(same, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * exp_c)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * exp_c - bcast_row(m_new, s.shape))  # masked scores: exp2(-inf) = 0
            acc = acc * bcast_row(alpha, acc.shape)
            l = l * alpha
            p16 = p.astype(dtype)
            if H <= 128:  # jax's attention_mgpu found this order faster for H <= 128; kept, measured below
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
                    plgpu.barrier_wait(k_ready.at[lax.rem(j + 1, stages)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def drain(j, _):
            # A tile only the other warpgroup needs (causal): take it and release it at once, so the ring and the
            # turns keep going. Waiting for it first keeps this warpgroup from arriving twice on one free barrier
            # phase (a slot freed while the other warpgroup still reads it) when the turns do not pace it.
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            schedule()
            schedule()

        m = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), _ROW)
        l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), _ROW)
        acc = plgpu.layout_cast(jnp.zeros((bq, H), jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(tiles > 0)
        def _():
            plgpu.barrier_wait(k_ready.at[0])

        pl.when(wg == 1)(schedule)
        carry = (acc, m, l)
        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
        if has_seg or static.causal or bounded:
            carry = lax.fori_loop(full, tiles, functools.partial(step, masked=True), carry)
        if static.causal:
            lax.fori_loop(tiles, block_tiles, drain, None)
        pl.when(wg == 0)(schedule)
        acc, m, l = carry

        empty = l == 0.0  # no visible key: o = 0, lse = +inf
        safe_l = jnp.where(empty, 1.0, l)
        o = acc * bcast_row(1.0 / safe_l, acc.shape)
        o_out = o.astype(dtype)
        q_smem[...] = o_out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(q_base, bq), n])
        if static.residuals:
            lse_smem[wg] = jnp.where(empty, jnp.inf, m + jnp.log(safe_l) * (1.0 / math.log(2.0)))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, pl.ds(q_base, bq)])
            o_lo = (o - o_out.astype(jnp.float32)).astype(dtype)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the o tile has left q_smem
            q_smem[...] = o_lo
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, lo_ref.at[b, pl.ds(q_base, bq), n])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _COMPUTE_WGS)
    def _produce():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(n, G)

        def load(j, slot):
            rows = (b, pl.ds(j * bk, bk), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        for i in range(min(stages, pl.cdiv(S, bk))):  # static starts past S would not even trace
            pl.when(i < block_tiles)(functools.partial(load, i, i))

        @pl.loop(stages, block_tiles)
        def _(j):
            slot = lax.rem(j, stages)
            rows = (b, pl.ds(j * bk, bk), kv_head)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])


def _swizzled_smem(shape, dtype):
    """A shared-memory buffer in wgmma's operand layout: (8, 128 bytes) tiles, 128-byte swizzle."""
    elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128)))


def _kernel_call(q, k, v, q_seg, kv_seg, kv_lens, *, static: _Static):
    """(o (B, T, N, H) q.dtype, lse (B, N, T) float32 log2 domain or None, o_lo (B, T, N, H) q.dtype or None)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg = static.config
    bq, bk, stages = cfg.block_q, cfg.block_kv, cfg.num_stages
    nq = pl.cdiv(T, 2 * bq)
    T_pad = nq * 2 * bq  # lse rows as whole tiles: TMA needs 16-byte row strides, so any T works
    inputs = [q, k, v]
    if q_seg is not None:  # padded to whole tiles: the kernel reads them with plain (unchecked) loads
        inputs.append(jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, T_pad - T)), constant_values=-1))
        inputs.append(jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, pl.cdiv(S, bk) * bk - S)),
                              constant_values=-2))
    if kv_lens is not None:
        kv_lens = jnp.clip(kv_lens.astype(jnp.int32), 0, S)
        # Padding never reaches p·v: V rows >= length are zeroed here (one fused pass over V).
        inputs[2] = jnp.where(jnp.arange(S)[None, :, None, None] < kv_lens[:, None, None, None], v,
                              jnp.zeros((), v.dtype))
        inputs.append(kv_lens)
    # TMA copies into (8, 64)-tiled shared memory need sequence lengths that are multiples of 8: odd lengths are
    # padded (one XLA copy of the operand; the padded keys are masked, the padded query rows sliced off).
    T8, S8 = -(-T // 8) * 8, -(-S // 8) * 8
    pad_rows = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))
    if T8 != T:
        inputs[0] = pad_rows(q, T8)
    if S8 != S:
        inputs[1], inputs[2] = pad_rows(inputs[1], S8), pad_rows(inputs[2], S8)
    out_type = [jax.ShapeDtypeStruct((B, T8, N, H), q.dtype)]
    if static.residuals:
        out_type += [jax.ShapeDtypeStruct((B, N, T_pad), jnp.float32), jax.ShapeDtypeStruct((B, T8, N, H), q.dtype)]
    scratch = (
        _swizzled_smem((_COMPUTE_WGS, bq, H), q.dtype),  # q tiles, then o / o_lo tiles on the way out
        _swizzled_smem((stages, bk, H), k.dtype),
        _swizzled_smem((stages, bk, H), v.dtype),
        plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),  # lse rows on the way out
        plgpu.Barrier(num_barriers=stages),  # K tile landed
        plgpu.Barrier(num_barriers=stages),  # V tile landed
        plgpu.Barrier(num_barriers=_COMPUTE_WGS),  # q tile landed
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),  # K slot free again
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),  # V slot free again
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),  # ping-pong turns
    )
    kernel = functools.partial(_kernel, static=static, has_seg=q_seg is not None, has_lens=kv_lens is not None,
                               T=T, S=S, G=N // K)
    outs = plgpu.kernel(
        kernel, out_type=tuple(out_type), scratch_types=scratch, grid=(N, nq, B),
        grid_names=("heads", "q_tiles", "batch"), num_threads=_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=mosaic_compat.compiler_params(approx_math=True, reduction_scratch_bytes=0),
        kernel_name="jaxfuse_attention_fwd",
    )(*inputs)
    if not static.residuals:
        return outs[0][:, :T], None, None
    o, lse, o_lo = outs
    return o[:, :T], lse[..., :T], o_lo[:, :T]


@functools.lru_cache(maxsize=None)
def _batched_call(static: _Static):
    """_kernel_call under vmap: the mapped axis folds into the batch axis (one launch, no new grid axis)."""

    @jax.custom_batching.custom_vmap
    def call(q, k, v, q_seg, kv_seg, kv_lens):
        return _kernel_call(q, k, v, q_seg, kv_seg, kv_lens, static=static)

    @call.def_vmap
    def _rule(axis_size, in_batched, *args):
        def fold(x, batched):
            if x is None:
                return None
            x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        outs = call(*(fold(x, batched) for x, batched in zip(args, in_batched)))
        outs = jax.tree.map(lambda y: y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return call


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_seg, kv_seg, kv_lens, static: _Static):
    return _batched_call(dataclasses.replace(static, residuals=False))(q, k, v, q_seg, kv_seg, kv_lens)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, kv_lens, static: _Static):
    o, lse, o_lo = _batched_call(dataclasses.replace(static, residuals=True))(q, k, v, q_seg, kv_seg, kv_lens)
    return o, (q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse)


def _attention_bwd(static: _Static, residuals, do):
    from pallas_kernels.attention import mosaic_bwd  # the backward kernels; imported here, where they are needed

    q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse = residuals
    o_f32 = o.astype(jnp.float32) + o_lo.astype(jnp.float32)  # the unrounded output (to ~2^-16): exact delta
    config = static.bwd_config
    if config is None:
        config = mosaic_bwd.default_config(q, k, causal=static.causal)
    dq, dk, dv = mosaic_bwd.attention_backward(
        q, k, v, o_f32, lse, do, causal=static.causal, scale=static.scale, q_segment_ids=q_seg,
        kv_segment_ids=kv_seg, kv_seq_lengths=kv_lens, config=config)
    return dq, dk, dv, None, None, None  # segment ids and lengths are integers: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def _static(q, k, causal, scale, config, residuals=False, bwd_config=None) -> _Static:
    config = default_config(q, k, causal=causal) if config is None else config
    if not isinstance(config, MosaicAttentionConfig):
        raise TypeError(f"config: expected a MosaicAttentionConfig, got {type(config).__name__}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _Static(config=config, causal=bool(causal), scale=scale, residuals=residuals, bwd_config=bwd_config)


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None, q_segment_ids=None,
                    kv_segment_ids=None, kv_seq_lengths=None, config: MosaicAttentionConfig | None = None,
                    bwd_config=None) -> jax.Array:
    """softmax(q kᵀ · scale) v on sm90, differentiable (custom VJP; the backward is ``mosaic_bwd``).

    Inputs as validated by ``pallas_kernels.attention.flash_attention``: q (B, T, N, H), k and v (B, S, K, H) in
    bfloat16 or float16, N % K == 0; q_segment_ids (B, T) and kv_segment_ids (B, S) int or both None;
    kv_seq_lengths (B,) int or None (clipped to [0, S]). scale defaults to 1/sqrt(H). Returns (B, T, N, H) in
    q.dtype. Works under jit, vmap (folded into the batch axis) and checkpoint.
    """
    static = _static(q, k, causal, scale, config, bwd_config=bwd_config)
    return _attention(q, k, v, q_segment_ids, kv_segment_ids, kv_seq_lengths, static)


def attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None, q_segment_ids=None,
                      kv_segment_ids=None, kv_seq_lengths=None, config: MosaicAttentionConfig | None = None):
    """The forward with its residual: (o (B, T, N, H) q.dtype, lse (B, N, T) float32, log2 domain, +inf for rows
    with no visible key). Not differentiable; for tests, benchmarks and the backward's callers."""
    static = _static(q, k, causal, scale, config, residuals=True)
    o, lse, _ = _batched_call(static)(q, k, v, q_segment_ids, kv_segment_ids, kv_seq_lengths)
    return o, lse
