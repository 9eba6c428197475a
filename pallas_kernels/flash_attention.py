"""Flash attention in Pallas (Triton lowering): forward and backward kernels that never materialize the scores.

``flash_attention(q, k, v)`` computes softmax(q kᵀ · scale) v tile by tile with an online softmax. The (T, S) score
and probability matrices live only as (block_q, block_k) tiles in registers; HBM sees q, k, v, the output and a
(B, N, T) float32 log-sum-exp residual. The backward pass recomputes the probability tiles from that residual in two
kernels (dK/dV iterating over query tiles, dQ iterating over key tiles) with no atomics; the only other backward
intermediate is delta = rowsum(o · do), (B, N, T) float32, which XLA computes in one fused reduction.

Layout and semantics follow ``jax.nn.dot_product_attention``: q (B, T, N, H), k and v (B, S, K, H), N % K == 0
(query head n reads kv head n // (N // K)), causal masks top-left aligned (key s visible to query t iff s <= t).
Unlike ``jax.nn.dot_product_attention``, a query row with no visible key returns zeros (not the mean of V), with zero
gradients. ``pallas_kernels.reference.attention`` is the float32 jnp equivalent.

Measured and dropped (H100, benchmarks/results/attention-sweep-lazy-rescale-h100.txt): rescaling the accumulator
only when a row's maximum rises by more than 8 (log2 units), behind a lax.cond per key tile, made the forward 7-9%
slower (probably because the branch breaks up the software-pipelined loop body). Issuing the next key tile's
q·kᵀ before the current tile's softmax (so the tensor cores could run under the exp2s) was 6% faster than the plain
loop at 128x64 tiles but needs a second score tile and more shared memory: 128x128 tiles no longer fit (262 KiB
requested) and the plain 128x128 loop stayed the fastest (1209 vs 1228 µs non-causal, 689 vs 699 µs causal;
attention-sweep-overlap-qk-h100.txt).

Where the forward's time goes (H100, B4 T=S=4096 N16 H128, 128x128 tiles; attention-forward-floor-h100.json, from
benchmarks/scripts/gpu_attention_forward_floor.py): the loop's two tile dots alone take 823 µs, cuDNN's whole
forward 821 µs; the online softmax adds 128 µs without its exp2s and 232 µs more with them (libdevice exp2; 208
with ``ex2.approx.ftz``, now used: ``triton_utils.exp2``). Nothing overlaps the softmax with the tensor cores here:
that takes warp specialization or ping-pong scheduling, which the Triton lowering does not expose. Computing half
or all of the exp2s as a polynomial on the FMA pipe (FA4's trick) was 18-22% slower; two scores per MUFU instruction
(``ex2.approx.bf16x2`` / ``f16x2``) no faster (attention-forward-floor-chains-packed-h100.json). What overlap program
order can buy: ``query_chains=2`` splits the query tile into two chains and issues both chains' q·kᵀ before either
softmax, so Triton's asynchronous wgmma can run one chain's product under the other's exp2s: 1087 vs 1117 µs in the
minimal kernel at 128x64 tiles / 4 warps, 1123 vs 1138 µs in this kernel (attention-sweep-chains-h100.txt); with 8
warps (two warpgroups of 32-row chains) it doubled the time.

Example::

  o = flash_attention(q, k, v, causal=True)                        # interpret mode on CPU, Triton on GPU
  o = flash_attention(q, k, v, block_sizes={"block_q": 64})        # override part of the tuned config
  autotune_flash_attention(q, k, v, causal=True)                   # GPU: time candidates, write the JSON cache
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import reference, triton_utils, tuning

__all__ = ["FlashAttentionConfig", "SUPPORTED_HEAD_DIMS", "autotune", "default_config", "flash_attention"]

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_LOG2E = math.log2(math.e)
# Running max before any visible key: finite, so exp2(m_old - m_new) and exp2(-inf - m) never see inf - inf.
_M_INIT = -1e30
_OP = "flash_attention"


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Tile sizes and launch parameters of the three kernels (one static argument, hashable).

    Attributes:
      block_q, block_k: forward tile: block_q query rows per program, key/value tiles of block_k rows.
      block_q_dkv, block_k_dkv: dK/dV kernel: block_k_dkv key rows per program, query tiles of block_q_dkv rows.
      block_q_dq, block_k_dq: dQ kernel: block_q_dq query rows per program, key/value tiles of block_k_dq rows.
      query_chains: the forward's query tile as this many independent chains of block_q / query_chains rows (1 or
        2) sharing each key/value tile; each chain's q·kᵀ is issued before any chain's softmax, so one chain's
        exp2s can run under the other's tensor-core work.
      num_warps, num_stages: Triton launch parameters of the forward kernel.
      num_warps_bwd, num_stages_bwd: the same for both backward kernels.
    All block sizes are powers of two >= 16 (Triton tensor shapes and tl.dot minimum); they need not divide T or S.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 32
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 32
    query_chains: int = 1
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 3

    def __post_init__(self):
        triton_utils.check_launch_fields(self)  # the block sizes, warp counts and stage counts
        if self.query_chains not in (1, 2) or isinstance(self.query_chains, bool):
            raise ValueError(f"FlashAttentionConfig.query_chains: must be 1 or 2, got {self.query_chains!r}")
        if self.block_q // self.query_chains < 16:
            raise ValueError(f"FlashAttentionConfig.query_chains: block_q / query_chains must be >= 16 (tl.dot's "
                             f"minimum), got block_q={self.block_q}, query_chains={self.query_chains}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call: the single non-differentiable argument of the custom VJP."""

    config: FlashAttentionConfig
    causal: bool
    scale: float
    interpret: bool


def _shape_key(q, k, causal: bool) -> str:
    """Tuning-cache key: dtype, power-of-two buckets of T and S, heads, head dim, causal."""
    _, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bucket = lambda n: max(16, pl.next_power_of_2(n))
    return f"{jnp.dtype(q.dtype).name}[T={bucket(T)},S={bucket(S)},N={N},K={K},H={H}]" + ("causal" if causal else "")


def _fit_to_shape(params: Mapping[str, int], T: int, S: int) -> dict[str, int]:
    """Shrinks table/cache tiles that exceed the (power-of-two rounded) sequence lengths; never applied to a
    caller's explicit block_sizes."""
    fit = lambda n, cap: min(n, max(16, pl.next_power_of_2(cap)))
    out = dict(params)
    for name in ("block_q", "block_q_dkv", "block_q_dq"):
        out[name] = fit(out[name], T)
    for name in ("block_k", "block_k_dkv", "block_k_dq"):
        out[name] = fit(out[name], S)
    if out["block_q"] // out.get("query_chains", 1) < 16:  # a shrunk tile too short to split
        out["query_chains"] = 1
    return out


def default_config(q, k, *, causal: bool = False, on_gpu: bool | None = None, device: str | None = None,
                   cache_path=tuning.DEFAULT_CACHE_PATH) -> FlashAttentionConfig:
    """The config a call would use without ``block_sizes``: on GPU, the tuning-cache entry for this device kind and
    shape if there is one, else the built-in table; on CPU, the interpret-mode table. Tiles are then shrunk to
    short sequences."""
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    params = tuning.lookup(_OP, _shape_key(q, k, causal), device=device, path=cache_path) if on_gpu else None
    if params is None:
        params = tuning.flash_attention_table(q.shape[-1], q.dtype, on_gpu=on_gpu)
    return FlashAttentionConfig(**_fit_to_shape(params, q.shape[1], k.shape[1]))


# ---------------------------------------------------------------------------------------------------------------
# Kernel helpers
# ---------------------------------------------------------------------------------------------------------------
def _dot(a, b, *, trans_b: bool = False, f32_precision=lax.Precision.HIGHEST):
    """a @ b (or a @ bᵀ) on 2-D tiles, accumulated in float32.

    16-bit inputs: tensor cores with float32 accumulation. float32 inputs: ``f32_precision``. The Triton lowering
    maps DEFAULT to plain TF32 (10-bit mantissa: too coarse for a float32 kernel), HIGHEST to IEEE FMA loops, and
    TF32_TF32_F32_X3 to three TF32 tensor-core products (error near float32's)."""
    dims = (((1,), (1,) if trans_b else (0,)), ((), ()))
    precision = f32_precision if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


# Scalar index arithmetic inside kernels: Python ints stay Python ints (a kernel may not close over array
# constants), traced int32 scalars use lax ops (all operands are non-negative, so truncation == floor).
def _cdiv(a, b: int):
    return -(-a // b) if isinstance(a, int) else lax.div(a + (b - 1), b)


def _div(a, b: int):
    return a // b if isinstance(a, int) else lax.div(a, b)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _i32(x):
    """A Python int as a strongly typed int32 scalar. jnp.where of two weakly typed Python ints makes the Triton
    lowering (jax 0.10.2) give the constants the predicate's i1 type, so select operands are made strong."""
    return jnp.asarray(x, jnp.int32) if isinstance(x, int) else x


def _loop(lo, hi, body, carry):
    """lax.fori_loop, skipped when the bounds are static and empty."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


def _kv_len(len_ref, S: int):
    """Number of valid keys of this batch row: kv_seq_lengths clipped to [0, S], or S (a Python int)."""
    return S if len_ref is None else jnp.clip(len_ref[0], 0, S)


def _load(ref, idx, rows, limit, *, other=0.0):
    """ref[idx], where ``rows`` are the positions along the first indexed (sequence) axis and rows >= limit read
    ``other``. With rows None the load is unmasked: only for tiles known to be in bounds (interpret mode would
    shift an out-of-bounds slice, and Triton would read past the array)."""
    if rows is None:
        return ref[idx]
    view = ref.at[idx]
    mask = rows < limit
    if len(view.shape) == 2:
        mask = jnp.broadcast_to(mask[:, None], view.shape)
    return plgpu.load(view, mask=mask, other=other)


def _store(ref, idx, value, rows, limit):
    """ref[idx] = value, skipping rows >= limit when rows is not None."""
    if rows is None:
        ref[idx] = value
        return
    mask = rows < limit
    if value.ndim == 2:
        mask = jnp.broadcast_to(mask[:, None], value.shape)
    plgpu.store(ref.at[idx], value, mask=mask)


def _load_kv_tile(k_ref, v_ref, s0, bk: int, S: int, *, bounds_checked: bool):
    """(kv_pos, k, v): the key positions [s0, s0 + bk) and the (bk, H) K and V tiles there; with bounds_checked,
    keys >= S read 0 (for a tile that may cross the end of the sequence)."""
    kv_pos = s0 + jnp.arange(bk, dtype=jnp.int32)
    kv_rows = kv_pos if bounds_checked else None
    k = _load(k_ref, (pl.ds(s0, bk), slice(None)), kv_rows, S)
    v = _load(v_ref, (pl.ds(s0, bk), slice(None)), kv_rows, S)
    return kv_pos, k, v


def _visible(q_pos, kv_pos, *, causal, kv_limit, q_seg, kv_seg):
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
def _fwd_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, len_ref, o_ref, lse_ref, *,
                static: _Static, T: int, S: int):
    cfg = static.config
    bq, bk = cfg.block_q, cfg.block_k
    nq = pl.cdiv(T, bq)
    i = pl.program_id(0)
    if static.causal:
        i = nq - 1 - i  # the longest rows first: better tail balance across SMs
    t0 = i * bq
    rows = bq // cfg.query_chains  # query rows per chain
    # Per chain: query positions, bounds (None when T is a multiple of the tile), the q tile (stays in registers),
    # segment ids.
    chains = []
    for c in range(cfg.query_chains):
        q_pos = t0 + c * rows + jnp.arange(rows, dtype=jnp.int32)
        q_rows = None if T % bq == 0 else q_pos
        q = _load(q_ref, (pl.ds(t0 + c * rows, rows), slice(None)), q_rows, T)
        q_seg = None if q_seg_ref is None else _load(q_seg_ref, (pl.ds(t0 + c * rows, rows),), q_pos, T, other=-1)
        chains.append((q_pos, q_rows, q, q_seg))

    kv_len = _kv_len(len_ref, S)  # keys >= kv_len are masked
    end = kv_len if not static.causal else _min(kv_len, t0 + bq)  # keys any row of this tile can see
    num_tiles = _cdiv(end, bk)
    # Tiles [0, num_full) are entirely visible to every row: no mask, no bounds check. With S < bk no tile is full
    # (and an unmasked bk-row load of an S-row array would not even trace in interpret mode).
    if q_seg_ref is not None or S < bk:
        num_full = 0
    else:
        num_full = _min(_div(kv_len if not static.causal else _min(kv_len, t0 + 1), bk), num_tiles)

    qk_scale = static.scale * _LOG2E  # exp(x * scale) == exp2(x * scale * log2(e))
    exp2 = functools.partial(triton_utils.exp2, interpret=static.interpret)
    exp_scale, pre_scale = (qk_scale, None) if qk_scale > 0 else (1.0, qk_scale)
    kv_limit = kv_len if (S % bk or len_ref is not None) else None

    def update(carry, s, v, chain, kv_pos, kv_seg, *, masked: bool):
        """One chain's online-softmax step: s (rows, bk) raw scores of this key tile."""
        acc, m, l = carry
        q_pos, _, _, q_seg = chain
        if pre_scale is not None:
            s = s * pre_scale
        if masked:
            visible = _visible(q_pos, kv_pos, causal=static.causal, kv_limit=kv_limit, q_seg=q_seg, kv_seg=kv_seg)
            if visible is not None:
                s = jnp.where(visible, s, -jnp.inf)
        # With a positive scale, max(s) * scale == max(s * scale): the scale then folds into one FMA per score.
        m_new = jnp.maximum(m, jnp.max(s, axis=1) * exp_scale)
        alpha = exp2(m - m_new)
        p = exp2(s * exp_scale - m_new[:, None])  # masked entries: exp2(-inf) = 0
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    def body(j, carry, *, masked: bool):
        s0 = j * bk
        kv_pos, k, v = _load_kv_tile(k_ref, v_ref, s0, bk, S, bounds_checked=masked and S % bk != 0)
        kv_seg = None
        if masked and kv_seg_ref is not None:
            kv_seg = _load(kv_seg_ref, (pl.ds(s0, bk),), kv_pos, S, other=-2)
        # Every chain's q·kᵀ is issued before any chain's softmax: with two chains the tensor cores have the second
        # product to compute while the first chain's exp2s run.
        scores = [_dot(q, k, trans_b=True) for _, _, q, _ in chains]
        return tuple(update(c_carry, s, v, chain, kv_pos, kv_seg, masked=masked)
                     for c_carry, s, chain in zip(carry, scores, chains))

    H = q_ref.shape[-1]
    init = (jnp.zeros((rows, H), jnp.float32), jnp.full((rows,), _M_INIT, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    carry = _loop(0, num_full, functools.partial(body, masked=False), (init,) * cfg.query_chains)
    carry = _loop(num_full, num_tiles, functools.partial(body, masked=True), carry)

    for c, ((acc, m, l), (_, q_rows, _, _)) in enumerate(zip(carry, chains)):
        empty = l == 0.0  # no visible key: output 0, lse +inf (so the backward's probabilities are exactly 0)
        inv_l = 1.0 / jnp.where(empty, 1.0, l)
        idx = pl.ds(t0 + c * rows, rows)
        _store(o_ref, (idx, slice(None)), (acc * inv_l[:, None]).astype(o_ref.dtype), q_rows, T)
        lse = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))  # log2-domain log-sum-exp
        _store(lse_ref, (idx,), lse, q_rows, T)


# ---------------------------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------------------------
def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, len_ref, dk_ref, dv_ref,
                 *, static: _Static, T: int, S: int, G: int):
    """One program per (key tile, batch * kv head): loops over the G query heads sharing the kv head, and for each
    over query tiles, accumulating dK and dV in float32 registers (the GQA head sum happens here, not in HBM)."""
    cfg = static.config
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    nq = pl.cdiv(T, bq)
    j = pl.program_id(0)
    s0 = j * bk
    kv_pos, k, v = _load_kv_tile(k_ref, v_ref, s0, bk, S, bounds_checked=S % bk != 0)
    kv_rows = None if S % bk == 0 else kv_pos  # the dK/dV stores skip keys >= S
    kv_seg = None if kv_seg_ref is None else _load(kv_seg_ref, (pl.ds(s0, bk),), kv_pos, S, other=-2)
    kv_len = _kv_len(len_ref, S)
    # Keys past S need no mask here: their rows of dK/dV are never stored, and they cannot leak into other rows.
    kv_limit = kv_len if len_ref is not None else None

    # Query tiles [lo, num_masked) need the mask, [num_masked, nq) are entirely visible.
    lo = _div(s0, bq) if static.causal else 0
    if q_seg_ref is not None:
        num_masked = nq
    else:
        num_masked = _min(_cdiv(s0 + bk - 1, bq), nq) if static.causal else lo
        if len_ref is not None:  # a tile reaching past the length is masked for every query
            num_masked = jnp.where(s0 + bk > kv_len, _i32(nq), _i32(num_masked))
    if len_ref is not None:  # a tile entirely past the length sees nothing: its gradients are 0
        lo = jnp.where(s0 >= kv_len, _i32(nq), _i32(lo))
        num_masked = jnp.maximum(num_masked, lo)
    q_scale = static.scale * _LOG2E
    exp2 = functools.partial(triton_utils.exp2, interpret=static.interpret)

    def body(i, carry, *, g, masked: bool):
        dk, dv = carry
        t0 = i * bq
        q_pos = t0 + jnp.arange(bq, dtype=jnp.int32)
        q_rows = None if T % bq == 0 else q_pos
        q = _load(q_ref, (pl.ds(t0, bq), g, slice(None)), q_rows, T)
        do = _load(do_ref, (pl.ds(t0, bq), g, slice(None)), q_rows, T)
        lse = _load(lse_ref, (g, pl.ds(t0, bq)), q_rows, T, other=jnp.inf)  # rows past T: p = 0
        delta = _load(delta_ref, (g, pl.ds(t0, bq)), q_rows, T)
        s_t = _dot(k, q, trans_b=True) * q_scale - lse[None, :]  # (bk, bq) log2 probabilities, transposed
        if masked:
            q_seg = None if q_seg_ref is None else _load(q_seg_ref, (pl.ds(t0, bq),), q_pos, T, other=-1)
            visible = _visible(q_pos, kv_pos, causal=static.causal, kv_limit=kv_limit, q_seg=q_seg, kv_seg=kv_seg)
            if visible is not None:
                s_t = jnp.where(visible.T, s_t, -jnp.inf)
        p_t = exp2(s_t)  # (bk, bq) probabilities, transposed
        dv = dv + _dot(p_t.astype(do.dtype), do)
        dp_t = _dot(v, do, trans_b=True)  # (bk, bq)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dk + _dot(ds_t.astype(q.dtype), q)
        return dk, dv

    def head(g, carry):
        carry = _loop(lo, num_masked, functools.partial(body, g=g, masked=True), carry)
        return _loop(num_masked, nq, functools.partial(body, g=g, masked=False), carry)

    H = k.shape[-1]
    zeros = jnp.zeros((bk, H), jnp.float32)
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    _store(dk_ref, (pl.ds(s0, bk), slice(None)), (dk * static.scale).astype(dk_ref.dtype), kv_rows, S)
    _store(dv_ref, (pl.ds(s0, bk), slice(None)), dv.astype(dv_ref.dtype), kv_rows, S)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, len_ref, dq_ref, *,
               static: _Static, T: int, S: int):
    """One program per (query tile, batch * head); loops over key/value tiles like the forward."""
    cfg = static.config
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    nq = pl.cdiv(T, bq)
    i = pl.program_id(0)
    if static.causal:
        i = nq - 1 - i
    t0 = i * bq
    q_pos = t0 + jnp.arange(bq, dtype=jnp.int32)
    q_rows = None if T % bq == 0 else q_pos
    q = _load(q_ref, (pl.ds(t0, bq), slice(None)), q_rows, T)
    do = _load(do_ref, (pl.ds(t0, bq), slice(None)), q_rows, T)
    lse = _load(lse_ref, (pl.ds(t0, bq),), q_rows, T, other=jnp.inf)
    delta = _load(delta_ref, (pl.ds(t0, bq),), q_rows, T)
    q_seg = None if q_seg_ref is None else _load(q_seg_ref, (pl.ds(t0, bq),), q_pos, T, other=-1)

    kv_len = _kv_len(len_ref, S)
    end = kv_len if not static.causal else _min(kv_len, t0 + bq)
    num_tiles = _cdiv(end, bk)
    if q_seg_ref is not None or S < bk:  # as in the forward: no full tile
        num_full = 0
    else:
        num_full = _min(_div(kv_len if not static.causal else _min(kv_len, t0 + 1), bk), num_tiles)
    kv_limit = kv_len if (S % bk or len_ref is not None) else None
    q_scale = static.scale * _LOG2E
    exp2 = functools.partial(triton_utils.exp2, interpret=static.interpret)

    def body(j, dq, *, masked: bool):
        s0 = j * bk
        kv_pos, k, v = _load_kv_tile(k_ref, v_ref, s0, bk, S, bounds_checked=masked and S % bk != 0)
        s = _dot(q, k, trans_b=True) * q_scale - lse[:, None]  # (bq, bk) log2 probabilities
        if masked:
            kv_seg = None if kv_seg_ref is None else _load(kv_seg_ref, (pl.ds(s0, bk),), kv_pos, S, other=-2)
            visible = _visible(q_pos, kv_pos, causal=static.causal, kv_limit=kv_limit, q_seg=q_seg, kv_seg=kv_seg)
            if visible is not None:
                s = jnp.where(visible, s, -jnp.inf)
        p = exp2(s)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = _loop(0, num_full, functools.partial(body, masked=False), dq)
    dq = _loop(num_full, num_tiles, functools.partial(body, masked=True), dq)
    _store(dq_ref, (pl.ds(t0, bq), slice(None)), (dq * static.scale).astype(dq_ref.dtype), q_rows, T)


# ---------------------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ---------------------------------------------------------------------------------------------------------------
def _pallas_call(kernel, *, static: _Static, num_warps: int, num_stages: int, **kwargs):
    return triton_utils.pallas_call(kernel, num_warps=num_warps, num_stages=num_stages,
                                    interpret=static.interpret, **kwargs)


def _optional_specs(q_seg, kv_seg, kv_lens, T, S, batch_of):
    """BlockSpecs for segment ids (whole rows) and kv lengths ((B, 1), one scalar per program)."""
    return [
        None if q_seg is None else pl.BlockSpec((None, T), lambda i, r: (batch_of(r), 0)),
        None if kv_seg is None else pl.BlockSpec((None, S), lambda i, r: (batch_of(r), 0)),
        None if kv_lens is None else pl.BlockSpec((None, 1), lambda i, r: (batch_of(r), 0)),
    ]


@functools.partial(jax.jit, static_argnames="static")
def _forward(q, k, v, q_seg, kv_seg, kv_lens, static: _Static):
    """Returns o (B, T, N, H) in q.dtype and lse (B, N, T) float32 in the log2 domain (+inf for empty rows)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    cfg = static.config
    b_of = lambda r: lax.div(r, N)  # grid axis 1 runs over batch * heads
    n_of = lambda r: lax.rem(r, N)
    q_spec = pl.BlockSpec((None, T, None, H), lambda i, r: (b_of(r), 0, n_of(r), 0))
    kv_spec = pl.BlockSpec((None, S, None, H), lambda i, r: (b_of(r), 0, lax.div(n_of(r), G), 0))
    return _pallas_call(
        functools.partial(_fwd_kernel, static=static, T=T, S=S),
        static=static, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        grid=(pl.cdiv(T, cfg.block_q), B * N),
        in_specs=[q_spec, kv_spec, kv_spec, *_optional_specs(q_seg, kv_seg, kv_lens, T, S, b_of)],
        out_specs=[q_spec, pl.BlockSpec((None, None, T), lambda i, r: (b_of(r), n_of(r), 0))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32)],
        name="flash_attention_fwd",
    )(q, k, v, q_seg, kv_seg, kv_lens)


@functools.partial(jax.jit, static_argnames="static")
def _backward(q, k, v, q_seg, kv_seg, kv_lens, o, lse, do, static: _Static):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    cfg = static.config
    # delta = rowsum(o * do): one fused XLA reduction reading o and do once; (B, N, T) float32.
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    do = do.astype(q.dtype)

    # dK, dV: grid (key tiles, batch * kv heads); each program reads the G query heads of its kv head.
    b_of = lambda r: lax.div(r, K)
    h_of = lambda r: lax.rem(r, K)
    group_spec = pl.BlockSpec((None, T, G, H), lambda j, r: (b_of(r), 0, h_of(r), 0))  # (T, G, H)
    row_spec = pl.BlockSpec((None, G, T), lambda j, r: (b_of(r), h_of(r), 0))  # (G, T)
    kv_spec = pl.BlockSpec((None, S, None, H), lambda j, r: (b_of(r), 0, h_of(r), 0))
    dk, dv = _pallas_call(
        functools.partial(_dkdv_kernel, static=static, T=T, S=S, G=G),
        static=static, num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd,
        grid=(pl.cdiv(S, cfg.block_k_dkv), B * K),
        in_specs=[group_spec, kv_spec, kv_spec, group_spec, row_spec, row_spec,
                  *_optional_specs(q_seg, kv_seg, kv_lens, T, S, b_of)],
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
    dq = _pallas_call(
        functools.partial(_dq_kernel, static=static, T=T, S=S),
        static=static, num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd,
        grid=(pl.cdiv(T, cfg.block_q_dq), B * N),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                  *_optional_specs(q_seg, kv_seg, kv_lens, T, S, b_of)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, q_seg, kv_seg, kv_lens)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash_attention(q, k, v, q_seg, kv_seg, kv_lens, static: _Static):
    return _forward(q, k, v, q_seg, kv_seg, kv_lens, static=static)[0]


def _flash_attention_fwd(q, k, v, q_seg, kv_seg, kv_lens, static: _Static):
    with triton_utils.quiet_triton_deprecation():
        o, lse = _forward(q, k, v, q_seg, kv_seg, kv_lens, static=static)
    return o, (q, k, v, q_seg, kv_seg, kv_lens, o, lse)


def _flash_attention_bwd(static: _Static, residuals, do):
    q, k, v, q_seg, kv_seg, kv_lens, o, lse = residuals
    with triton_utils.quiet_triton_deprecation():  # an eager jax.grad compiles the backward here, after our call returned
        dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, kv_lens, o, lse, do, static=static)
    return dq, dk, dv, None, None, None  # segment ids and lengths are integers: no cotangent


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


# ---------------------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------------------
def _check_inputs(q, k, v, kv_seq_lengths):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            layout = "(B, T, N, H)" if name == "q" else "(B, S, K, H)"
            raise ValueError(f"{name}: expected rank 4 {layout}, got shape {tuple(jnp.shape(x))}")
        dtype = jnp.dtype(x.dtype)
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype {dtype} not supported; allowed: bfloat16, float16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: dtypes must match, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, T, N, H = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k, v: shapes must match (B, S, K, H), got k {k.shape}, v {v.shape}")
    if k.shape[0] != B:
        raise ValueError(f"k: batch {k.shape[0]} (shape {k.shape}) differs from q's batch {B} (shape {q.shape})")
    if k.shape[3] != H:
        raise ValueError(f"k: head dim {k.shape[3]} (shape {k.shape}) differs from q's head dim {H} "
                         f"(shape {q.shape})")
    if H not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim H={H} (shape {q.shape}) not supported; allowed: {SUPPORTED_HEAD_DIMS}")
    K = k.shape[2]
    if K == 0 or N % K:
        raise ValueError(f"k: kv heads K={K} (shape {k.shape}) must divide q's heads N={N} (shape {q.shape})")
    if T == 0 or k.shape[1] == 0:
        raise ValueError(f"q, k: sequence lengths must be positive, got T={T}, S={k.shape[1]}")
    if kv_seq_lengths is not None:
        shape = tuple(jnp.shape(kv_seq_lengths))
        if shape != (B,):
            raise ValueError(f"kv_seq_lengths: expected shape (B,) = ({B},), got {shape}")
        if not jnp.issubdtype(jnp.result_type(kv_seq_lengths), jnp.integer):
            raise ValueError(f"kv_seq_lengths: must be integers, got dtype {jnp.result_type(kv_seq_lengths)}")


def _resolve_config(q, k, causal, block_sizes, on_gpu) -> FlashAttentionConfig:
    if isinstance(block_sizes, FlashAttentionConfig):
        return block_sizes
    config = default_config(q, k, causal=causal, on_gpu=on_gpu)
    if block_sizes is None:
        return config
    if not isinstance(block_sizes, Mapping):
        raise ValueError(f"block_sizes: expected a FlashAttentionConfig or a mapping of its fields, "
                         f"got {type(block_sizes).__name__}")
    unknown = set(block_sizes) - {f.name for f in dataclasses.fields(FlashAttentionConfig)}
    if unknown:
        raise ValueError(f"block_sizes: unknown fields {sorted(unknown)}; allowed: "
                         f"{[f.name for f in dataclasses.fields(FlashAttentionConfig)]}")
    return dataclasses.replace(config, **block_sizes)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    segment_ids: jax.Array | Sequence[jax.Array] | None = None,
    kv_seq_lengths: jax.Array | None = None,
    block_sizes: FlashAttentionConfig | Mapping[str, int] | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """softmax(q kᵀ · scale) v with an online softmax; the (T, S) scores are never written to HBM.

    Args:
      q: (B, T, N, H) queries; bfloat16, float16 or float32; H in ``SUPPORTED_HEAD_DIMS``.
      k, v: (B, S, K, H) keys and values, same dtype as q; N % K == 0 (grouped-query / multi-query attention:
        query head n reads kv head n // (N // K)). Any T and S (tails are masked).
      causal: key s visible to query t iff s <= t, top-left aligned as in ``jax.nn.dot_product_attention``.
      scale: logit scale, default 1/sqrt(H).
      segment_ids: packed sequences: one (B, T) int array when T == S, or a pair (q_segment_ids (B, T),
        kv_segment_ids (B, S)); a query sees only keys with its segment id.
      kv_seq_lengths: (B,) int; keys at positions >= kv_seq_lengths[b] are masked (padding).
      block_sizes: a ``FlashAttentionConfig``, or a mapping of some of its fields overriding the tuned config.
      interpret: run the kernels in Pallas interpret mode; default True exactly when the default backend is CPU.

    Returns:
      (B, T, N, H) in q.dtype. Rows with no visible key are zeros (their gradients too). Differentiable in q, k, v
      through Pallas backward kernels; works under jit, grad and vmap. Accumulation is float32 throughout.
    """
    _check_inputs(q, k, v, kv_seq_lengths)
    B, T, N, H = q.shape
    S = k.shape[1]
    seg = reference.normalize_segment_ids(segment_ids, B, T, S)
    q_seg, kv_seg = (None, None) if seg is None else seg
    kv_lens = None if kv_seq_lengths is None else jnp.asarray(kv_seq_lengths, jnp.int32).reshape(B, 1)
    interpret = triton_utils.resolve_interpret(interpret)
    config = _resolve_config(q, k, causal, block_sizes, on_gpu=not interpret)
    static = _Static(config=config, causal=bool(causal), scale=float(H**-0.5 if scale is None else scale),
                     interpret=bool(interpret))
    with triton_utils.quiet_triton_deprecation():
        return _flash_attention(q, k, v, q_seg, kv_seg, kv_lens, static)


# ---------------------------------------------------------------------------------------------------------------
# Autotuning (GPU)
# ---------------------------------------------------------------------------------------------------------------
def _candidates(head_dim: int, dtype, T: int, S: int) -> list[dict[str, int]]:
    """A small search space around the table entry: forward tiles × warps × stages (128-row query tiles with 4 warps
    also as two query chains), and backward tile pairs."""
    base = FlashAttentionConfig(**tuning.flash_attention_table(head_dim, dtype, on_gpu=True)).to_dict()
    fwd_tiles = [(128, 64), (128, 128), (64, 64), (64, 32)] if head_dim <= 128 else [(64, 32), (64, 64), (32, 32)]
    bwd_tiles = ([(32, 128, 128, 32), (64, 64, 64, 64), (64, 128, 128, 64), (32, 64, 64, 32)] if head_dim <= 128
                 else [(32, 64, 64, 32), (16, 64, 64, 16), (32, 32, 32, 32)])
    out = []
    for (bq, bk), warps, stages in itertools.product(fwd_tiles, (4, 8), (2, 3, 4)):
        out.append(dict(base, block_q=bq, block_k=bk, query_chains=1, num_warps=warps, num_stages=stages))
        if bq == 128 and warps == 4:  # two chains of 64 rows: one warpgroup's wgmma height
            out.append(dict(base, block_q=bq, block_k=bk, query_chains=2, num_warps=warps, num_stages=stages))
    for (q1, k1, q2, k2), warps, stages in itertools.product(bwd_tiles, (4, 8), (2, 3)):
        out.append(dict(base, block_q_dkv=q1, block_k_dkv=k1, block_q_dq=q2, block_k_dq=k2,
                        num_warps_bwd=warps, num_stages_bwd=stages))
    unique = {tuple(sorted(_fit_to_shape(c, T, S).items())): _fit_to_shape(c, T, S) for c in out}
    return list(unique.values())


def autotune(q, k, v, *, causal: bool = False, cache_path=tuning.DEFAULT_CACHE_PATH, iters: int = 10,
             candidates: Sequence[Mapping[str, int]] | None = None):
    """Times forward + backward for each candidate config on these shapes (GPU only) and writes the fastest to the
    tuning cache under this device kind and shape key. Returns (best FlashAttentionConfig, timings in µs).

    The search is a coordinate pass: forward candidates are timed on the forward alone, backward candidates on
    forward + backward with the table's forward, and the best of each are combined. ``candidates`` (full parameter
    dicts) replaces the built-in search space.
    """
    if jax.default_backend() != "gpu":
        raise RuntimeError("autotune: needs a GPU (interpret-mode timings mean nothing)")
    _check_inputs(q, k, v, None)
    T, S = q.shape[1], k.shape[1]
    key = _shape_key(q, k, causal)
    fwd_fields = ("block_q", "block_k", "query_chains", "num_warps", "num_stages")
    candidates = _candidates(q.shape[-1], q.dtype, T, S) if candidates is None else candidates
    candidates = [FlashAttentionConfig(**c).to_dict() for c in candidates]  # every field, defaults filled in
    base = FlashAttentionConfig(**_fit_to_shape(tuning.flash_attention_table(q.shape[-1], q.dtype, on_gpu=True), T,
                                                S)).to_dict()
    fwd_cands = [c for c in candidates if all(c[f] == base[f] for f in c if f not in fwd_fields)]
    bwd_cands = [c for c in candidates if all(c[f] == base[f] for f in fwd_fields)]

    def make_fwd(params):
        cfg = FlashAttentionConfig(**params)
        fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal, block_sizes=cfg))
        with triton_utils.quiet_triton_deprecation():
            fn.lower(q, k, v).compile()
        return lambda: fn(q, k, v)

    def make_fwd_bwd(params):
        cfg = FlashAttentionConfig(**params)
        loss = lambda q, k, v: flash_attention(q, k, v, causal=causal, block_sizes=cfg).astype(jnp.float32).sum()
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        with triton_utils.quiet_triton_deprecation():
            fn.lower(q, k, v).compile()
        return lambda: fn(q, k, v)

    best_fwd, t_fwd = tuning.autotune(_OP, key, fwd_cands, make_fwd, path=None, iters=iters)
    best_bwd, t_bwd = tuning.autotune(_OP, key, bwd_cands, make_fwd_bwd, path=None, iters=iters)
    best = dict(best_bwd, **{f: best_fwd[f] for f in fwd_fields})
    total = tuning.time_us(make_fwd_bwd(best), iters=iters)
    if cache_path is not None:
        tuning.store(_OP, key, best, time_us=total, path=cache_path)
    return FlashAttentionConfig(**best), {"forward": t_fwd, "forward+backward": t_bwd}
