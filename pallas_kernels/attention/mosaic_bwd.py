"""Flash-attention backward on Hopper (sm90) as Pallas Mosaic-GPU kernels: dQ, dK, dV from the forward's residuals.

    config = default_config_bwd(q, k, causal=True)
    dq, dk, dv = attention_backward(q, k, v, o, lse, do, causal=True, scale=H**-0.5, q_segment_ids=None,
                                    kv_segment_ids=None, kv_seq_lengths=None, config=config)

The backward rule of the Mosaic forward (``attention/mosaic.py``) calls ``attention_backward``. Semantics are the
Triton backend's and ``reference.attention``'s: q (B, T, N, H), k and v (B, S, K, H), query head n reads kv head
n // (N // K); causal is top-left aligned (key s visible to query t iff s <= t, also when T != S); segment ids
restrict a query to keys of its segment; keys at positions >= kv_seq_lengths[b] are invisible (NaN or inf stored
there reaches no gradient); a query row with no visible key gets zero gradients and contributes nothing.

What runs, in this order:
1. delta = rowsum(o · do), (B, N, T) float32: one fused XLA reduction that reads o and do once (a multiply-reduce
   over H, then a transpose of the small (B, T, N) result). A kernel could not read fewer bytes; fusing it into the
   dQ kernel would save one read of do (B·T·N·H·2 bytes, ~1.5% of the backward at the main shape) at the price of
   a third kernel input stream. o should be the forward's unrounded float32 output: with saturated softmax rows
   (one probability near 1), delta from an o rounded to bf16 loses the cancellation dP − delta to rounding.
2. The (B, N, T) residuals padded to T_pad, a multiple of every query tile (the kernels read whole tiles of them,
   and TMA wants 16-byte row strides): lse with +inf (probability 0), delta with 0; segment ids with -1 (queries)
   and -2 (keys), which never match. With kv_seq_lengths, K is zeroed past the length for the dQ kernel (one fused
   select over K; dQ += dS K reads whole K rows, and 0 · NaN is NaN).
3. The dQ kernel and the dK/dV kernel (``mosaic_bwd_kernels``), independent of each other.
No (T, S) buffer; temporaries are delta and the padded lse ((B, N, T_pad) float32 each), the zeroed K copy when
kv_seq_lengths is given. dK/dV for GQA sum the G query heads of each kv head inside the kernel: no atomics.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference
from pallas_kernels.attention import mosaic_bwd_kernels as kernels

__all__ = ["MosaicAttentionBwdConfig", "attention_backward", "default_config_bwd", "float64_grads",
           "reference_residuals", "smem_bytes_bwd", "unsupported_reason_bwd"]

SUPPORTED_HEAD_DIMS_BWD = (64, 128)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SMEM_LIMIT_BYTES = 227 * 1024  # shared memory one H100 block may use
_SMEM_RESERVE_BYTES = 4 * 1024  # barriers and Mosaic's own scratch (its reduction scratch is 2 KiB)


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MosaicAttentionBwdConfig:
    """Tiles and pipeline depth of the two backward kernels (one static argument, hashable).

    Attributes:
      block_q_dq: query rows per compute warpgroup of the dQ kernel (a program holds compute_wgs_dq of them).
      block_kv_dq: key/value rows per pipeline step of the dQ kernel.
      compute_wgs_dq: compute warpgroups per dQ program (1 or 2), beside one TMA warpgroup.
      num_stages_dq: K/V tiles in flight (shared-memory pipeline depth) in the dQ kernel.
      block_q_dkv: query rows per pipeline step of the dK/dV kernel.
      block_kv_dkv: key rows per compute warpgroup of the dK/dV kernel.
      compute_wgs_dkv, num_stages_dkv: as for dQ, for the dK/dV kernel.
    Blocks are 64 or 128 (wgmma tiles 64 rows per warpgroup; 128-byte swizzled rows); tails past T and S are
    masked, so blocks need not divide them.
    """

    block_q_dq: int = 64
    block_kv_dq: int = 64
    compute_wgs_dq: int = 2
    num_stages_dq: int = 2
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    compute_wgs_dkv: int = 2
    num_stages_dkv: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            name, value = field.name, getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"MosaicAttentionBwdConfig.{name}: must be an int, got {value!r}")
            if name.startswith("block_") and value not in (64, 128):
                raise ValueError(f"MosaicAttentionBwdConfig.{name}: must be 64 or 128, got {value}")
            if name.startswith("compute_wgs") and value not in (1, 2):
                raise ValueError(f"MosaicAttentionBwdConfig.{name}: must be 1 or 2, got {value}")
            if name.startswith("num_stages") and not 1 <= value <= 4:
                raise ValueError(f"MosaicAttentionBwdConfig.{name}: must be in [1, 4], got {value}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def default_config_bwd(q, k, *, causal: bool) -> MosaicAttentionBwdConfig:
    """The built-in choice for these shapes (a tuned-table entry, when the lead adds one, takes precedence).

    From the sweep at B4 T=S=4096 N16 H128 on the H100 (benchmarks/results/attention_mosaic_bwd-h100.json), each
    kernel timed on its own: non-causal, the dQ kernel streams 128-row K/V tiles (1144 vs 1205 µs); causal, it
    keeps 64-row tiles three stages deep (641 µs) and the dK/dV kernel four (888 vs 921 µs). block_q_dkv=128
    doubled the dK/dV kernel's time (its dK, dV accumulators and two 64 x 128 score tiles exceed the 232 registers
    per thread: spills) and one compute warpgroup per program cost 1.35x. At H=64 (not measured) the dQ kernel
    streams 128-row tiles; the dK/dV kernel keeps the measured 64 x 64."""
    del k
    if causal and q.shape[-1] > 64:
        return MosaicAttentionBwdConfig(num_stages_dq=3, num_stages_dkv=4)
    return MosaicAttentionBwdConfig(block_kv_dq=128)


def smem_bytes_bwd(config: MosaicAttentionBwdConfig, head_dim: int, itemsize: int = 2, *,
                   segments: bool = False) -> tuple[int, int]:
    """(dQ kernel, dK/dV kernel) shared memory in bytes, without Mosaic's barriers and scratch."""
    c, H = config, head_dim
    dq = (2 * c.compute_wgs_dq * c.block_q_dq * H * itemsize  # Q, dO per warpgroup
          + c.num_stages_dq * (2 * c.block_kv_dq * H * itemsize + (4 * c.block_kv_dq if segments else 0)))
    dkv = (2 * c.compute_wgs_dkv * c.block_kv_dkv * H * itemsize  # K, V per warpgroup
           + c.num_stages_dkv * (2 * c.block_q_dkv * H * itemsize + 4 * c.block_q_dkv * (3 if segments else 2)))
    return dq, dkv


def unsupported_reason_bwd(q, k, v, *, causal: bool = False, config: MosaicAttentionBwdConfig | None = None,
                           segments: bool = False) -> str | None:
    """None when these kernels run these arguments; else one sentence naming the constraint (used for "auto"
    fallback to Triton and for the ValueError under backend="mosaic")."""
    dtype = jnp.dtype(q.dtype)
    if dtype == jnp.float32:
        return "mosaic backward: float32 inputs run on the Triton backend (wgmma here takes bf16/fp16 operands)"
    if dtype not in _DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"mosaic backward: q, k, v must all be bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}"
    H = q.shape[-1]
    if H not in SUPPORTED_HEAD_DIMS_BWD:
        why = (" (dK and dV float32 accumulators of a 64-row key tile alone take 256 registers per thread, over "
               "the 255 limit)" if H == 256 else "")
        return f"mosaic backward: head dim {H} not supported{why}; supported: {SUPPORTED_HEAD_DIMS_BWD}"
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return f"mosaic backward: kv heads K={k.shape[2]} must divide query heads N={q.shape[2]}"
    config = default_config_bwd(q, k, causal=causal) if config is None else config
    limit = _SMEM_LIMIT_BYTES - _SMEM_RESERVE_BYTES
    for name, used in zip(("dQ", "dK/dV"), smem_bytes_bwd(config, H, dtype.itemsize, segments=segments)):
        if used > limit:
            return (f"mosaic backward: the {name} kernel needs {used} bytes of shared memory with {config}, over "
                    f"{limit}")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _check(q, k, v, o, lse, do, q_seg, kv_seg, kv_lens, config):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if k.shape != (B, S, K, H) or v.shape != k.shape:
        raise ValueError(f"k, v: expected (B, S, K, H) with q's B={B}, H={H}, got k {k.shape}, v {v.shape}")
    for name, x in (("o", o), ("do", do)):
        if x.shape != q.shape:
            raise ValueError(f"{name}: expected q's shape {q.shape}, got {x.shape}")
    if jnp.dtype(o.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(q.dtype)):
        raise ValueError(f"o: dtype must be float32 or q's {q.dtype}, got {o.dtype}")
    if lse.shape != (B, N, T) or lse.dtype != jnp.float32:
        raise ValueError(f"lse: expected float32 (B, N, T) = {(B, N, T)}, got {lse.dtype} {lse.shape}")
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("q_segment_ids, kv_segment_ids: pass both or neither, got "
                         f"{'q_segment_ids' if kv_seg is None else 'kv_segment_ids'} alone")
    if q_seg is not None and (q_seg.shape != (B, T) or kv_seg.shape != (B, S)):
        raise ValueError(f"q_segment_ids, kv_segment_ids: expected (B, T) = {(B, T)} and (B, S) = {(B, S)}, got "
                         f"{q_seg.shape} and {kv_seg.shape}")
    if kv_lens is not None and tuple(jnp.shape(kv_lens)) != (B,):
        raise ValueError(f"kv_seq_lengths: expected shape (B,) = ({B},), got {tuple(jnp.shape(kv_lens))}")
    if not isinstance(config, MosaicAttentionBwdConfig):
        raise TypeError(f"config: expected a MosaicAttentionBwdConfig, got {type(config).__name__}")


def attention_backward(q, k, v, o, lse, do, *, causal: bool, scale: float, q_segment_ids, kv_segment_ids,
                       kv_seq_lengths, config: MosaicAttentionBwdConfig):
    """Gradients of softmax(q kᵀ · scale) v for the cotangent do.

    Args:
      q: (B, T, N, H) bf16/fp16. k, v: (B, S, K, H), same dtype, N % K == 0.
      o: (B, T, N, H) the forward's output, float32 (unrounded; preferred) or q.dtype.
      lse: (B, N, T) float32, log2 Σ_s exp2(q·k_s · scale · log2 e) over visible keys; +inf for rows without one.
      do: (B, T, N, H) cotangent of o (cast to q.dtype).
      causal, scale: as the forward. q_segment_ids (B, T), kv_segment_ids (B, S): int32, both or None.
      kv_seq_lengths: (B,) int32 or None; values are clipped to [0, S] in the kernels.
      config: a ``MosaicAttentionBwdConfig``.

    Returns:
      (dq (B, T, N, H), dk (B, S, K, H), dv (B, S, K, H)) in the input dtypes, accumulated in float32.
    """
    _check(q, k, v, o, lse, do, q_segment_ids, kv_segment_ids, kv_seq_lengths, config)
    reason = unsupported_reason_bwd(q, k, v, causal=causal, config=config, segments=q_segment_ids is not None)
    if reason is not None:
        raise ValueError(reason)
    return _backward(q, k, v, o, lse, do, q_segment_ids, kv_segment_ids, kv_seq_lengths, causal=bool(causal),
                     scale=float(scale), config=config)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config"))
def _backward(q, k, v, o, lse, do, q_seg, kv_seg, kv_lens, *, causal: bool, scale: float,
              config: MosaicAttentionBwdConfig):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    c = config
    T_pad = _round_up(T, max(c.compute_wgs_dq * c.block_q_dq, c.block_q_dkv))
    S_pad = _round_up(S, max(c.block_kv_dq, c.compute_wgs_dkv * c.block_kv_dkv))
    pad_t = ((0, 0), (0, 0), (0, T_pad - T))

    f32 = jnp.float32
    delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1).transpose(0, 2, 1)  # (B, N, T)
    delta = jnp.pad(delta, pad_t)
    lse = jnp.pad(lse, pad_t, constant_values=jnp.inf)
    do = do.astype(q.dtype)
    if q_seg is not None:
        q_seg = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, T_pad - T)), constant_values=-1)
        kv_seg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, S_pad - S)), constant_values=-2)
    # TMA copies of 8-row-tiled shared memory need the gmem row count to be a multiple of 8: odd lengths are
    # padded with zero rows by XLA copies (the kernels mask by the true T and S).
    pad_rows = lambda x, n: jnp.pad(x, ((0, 0), (0, _round_up(n, 8) - n), (0, 0), (0, 0))) if n % 8 else x  # noqa
    q_in, do = pad_rows(q, T), pad_rows(do, T)
    k_in, v_in = pad_rows(k, S), pad_rows(v, S)
    k_dq = k_in
    if kv_lens is not None:
        kv_lens = jnp.asarray(kv_lens, jnp.int32).reshape(B)
        valid = jnp.arange(k_in.shape[1], dtype=jnp.int32)[None, :] < kv_lens[:, None]  # (B, S rounded up to 8)
        k_dq = jnp.where(valid[:, :, None, None], k_in, jnp.zeros((), k.dtype))

    problem = kernels.Problem(B=B, T=T, S=S, N=N, K=K, H=H, T_pad=T_pad, S_pad=S_pad, causal=causal, scale=scale,
                              has_segments=q_seg is not None, has_lengths=kv_lens is not None)
    dq = kernels.dq_call(q_in, k_dq, v_in, do, lse, delta, q_seg, kv_seg, kv_lens, p=problem, block_q=c.block_q_dq,
                         block_kv=c.block_kv_dq, compute_wgs=c.compute_wgs_dq, num_stages=c.num_stages_dq)
    dk, dv = kernels.dkv_call(q_in, k_in, v_in, do, lse, delta, q_seg, kv_seg, kv_lens, p=problem,
                              block_q=c.block_q_dkv, block_kv=c.block_kv_dkv, compute_wgs=c.compute_wgs_dkv,
                              num_stages=c.num_stages_dkv)
    return dq[:, :T], dk[:, :S], dv[:, :S]


def reference_residuals(q, k, v, *, causal: bool, scale: float, segment_ids=None, kv_seq_lengths=None):
    """The residuals a forward hands this backward, in plain float32 jnp (for tests and benchmarks): o float32
    (B, T, N, H), unrounded, and lse float32 (B, N, T) in the log2 domain, +inf for rows with no visible key.
    Materializes the (B, N, T, S) scores like ``reference.attention``; non-finite V entries read as 0 (they sit
    at masked keys in the tests)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    mask = reference.attention_mask(B, T, S, causal=causal, segment_ids=segment_ids, kv_seq_lengths=kv_seq_lengths)
    qf = q.astype(jnp.float32).reshape(B, T, K, N // K, H)  # (B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(jnp.float32), precision="highest") * scale
    visible = mask[:, None, None]  # (B, 1, 1, T, S)
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    empty = l == 0.0
    v_clean = jnp.where(jnp.isfinite(v), v, 0).astype(jnp.float32)
    o = jnp.einsum("bkgts,bskh->btkgh", p / jnp.where(empty, 1.0, l), v_clean, precision="highest")
    lse = jnp.where(empty, jnp.inf, (m + jnp.log(jnp.where(empty, 1.0, l))) / math.log(2))[..., 0]  # (B, K, G, T)
    return o.reshape(B, T, N, H), lse.reshape(B, N, T)


def float64_grads(q, k, v, do, scale: float):
    """(dq, dk, dv) of non-causal, unmasked attention with N == K, in numpy float64 on the host: the reference for
    saturated softmax rows, where a float32 reference is itself off by more than a bf16 kernel."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("btnh,bsnh->bnts", do, v)
    ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
    return (np.einsum("bnts,bsnh->btnh", ds, k) * scale, np.einsum("bnts,btnh->bsnh", ds, q) * scale,
            np.einsum("bnts,btnh->bsnh", p, do))
