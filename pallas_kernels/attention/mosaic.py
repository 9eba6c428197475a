"""Flash attention on Hopper (sm90) in Pallas Mosaic GPU: config, backend contract and custom VJP.

``flash_attention(q, k, v, ...)`` computes softmax(q kᵀ · scale) v with a warp-specialized kernel (``mosaic_fwd``:
a TMA producer warpgroup and two compute warpgroups on wgmma, FA3 ping-pong between them) that keeps the (T, S)
scores as register tiles; the backward is ``mosaic_bwd``. Semantics are those of the Triton backend
(``pallas_kernels.reference.attention`` is the float32 reference): q (B, T, N, H), k and v (B, S, K, H), N % K == 0
(query head n reads kv head n // (N // K)); causal masks top-left aligned (key s visible to query t iff s <= t,
also when T != S); segment ids and ``kv_seq_lengths`` mask keys; any T and S; a row with no visible key returns
zeros and log-sum-exp +inf. V rows at positions >= kv_seq_lengths are zeroed before the kernel (one fused XLA pass
over V, only when lengths are given), so NaN or inf stored in padding never reaches the output (0·NaN in p·v would).

Residuals for the backward (what ``_attention_fwd`` saves beyond q, k, v and o): the (B, N, T) float32 log-sum-exp
in the log2 domain (log2 Σ_s exp2(score·scale·log2 e)) and ``o_lo`` = o_f32 − o, the output's rounding error, in
q.dtype (B, T, N, H). o + o_lo carries ~16 mantissa bits, so the backward's delta = rowsum(o·do) does not lose
near one-hot rows to cancellation (the saturated-softmax case of issue 16): one more q.dtype tensor of o's size
(half of a float32 copy of o), +2-4% forward time at the main shape (benchmarks/results/attention_mosaic_fwd-h100).

float32 inputs stay on the Triton backend (``unsupported_reason`` says so): wgmma has no float32 path worth having.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import mosaic_fwd

__all__ = ["MosaicAttentionConfig", "attention_forward", "default_config", "flash_attention", "shared_memory_bytes",
           "unsupported_reason"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_SMEM_BYTES = 227 * 1024  # sm90's opt-in limit per block, the figure Mosaic checks when lowering without a GPU


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Tiling and schedule of the forward kernel (one static argument, hashable).

    Attributes:
      block_q: query rows per compute warpgroup (a CTA holds 2·block_q); a multiple of 64 (wgmma's row count).
      block_kv: key/value rows per pipeline step; a multiple of 64.
      num_stages: depth of the K/V shared-memory ring (tiles in flight ahead of the compute warpgroups), 2 to 6.
      ping_pong: alternate the two compute warpgroups through a barrier (FA3 schedule) instead of free-running.
      persistent: one CTA per SM walking the work items, loads of the next item overlapping this one's output;
        needs a separate output tile in shared memory.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    ping_pong: bool = True
    persistent: bool = False

    def __post_init__(self):
        for name, multiple in (("block_q", 64), ("block_kv", 64)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % multiple:
                raise ValueError(f"MosaicAttentionConfig.{name}: must be a positive multiple of {multiple}, "
                                 f"got {value!r}")
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or not 2 <= self.num_stages <= 6:
            raise ValueError(f"MosaicAttentionConfig.num_stages: must be an int in [2, 6], got {self.num_stages!r}")
        for name in ("ping_pong", "persistent"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MosaicAttentionConfig.{name}: must be a bool, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_config(q, k, *, causal: bool = False) -> MosaicAttentionConfig:
    """64-row query tiles per warpgroup; 128-row K/V tiles two deep where they fit shared memory (H <= 128), 64-row
    tiles for H = 256; persistent for short non-causal sequences at H = 128.

    Measured on the H100 (benchmarks/results/attention_mosaic_fwd-h100.json, -persistent-h100.json): 64-row K/V
    tiles are 15% slower at the main shape, a third stage or no ping-pong no faster; persistent is 1.4% slower at
    T = S = 4096 and 16% slower causal (a static round-robin over unequal causal items), but 4.4% faster at
    T = S = 1024 (240 vs 251 µs; cuDNN 222), where each CTA's start and end weigh most."""
    H, S = q.shape[-1], k.shape[1]
    return MosaicAttentionConfig(block_kv=128 if H <= 128 else 64, persistent=not causal and H == 128 and S <= 1024)


def shared_memory_bytes(head_dim: int, dtype, config: MosaicAttentionConfig) -> int:
    """Shared memory the kernel allocates: the two warpgroups' q tiles (and o tiles when persistent), the K and V
    rings, the lse rows and the barriers, each buffer rounded up to 1 KiB (the 128-byte swizzle's alignment); no
    cross-warp reduction scratch (row reductions of wgmma tiles stay inside a warp). Equal to Mosaic's own count
    (tests check it)."""
    item = jnp.dtype(dtype).itemsize
    kib = lambda n: -(-n // 1024) * 1024  # noqa: E731
    wgs = mosaic_fwd.COMPUTE_WGS
    tiles = ((2 if config.persistent else 1) * kib(wgs * config.block_q * head_dim * item)
             + 2 * kib(config.num_stages * config.block_kv * head_dim * item) + kib(wgs * config.block_q * 4))
    return tiles + 8 * (4 * config.num_stages + 2 * wgs + 1)


def unsupported_reason(q, k, v, *, causal: bool = False, scale=None, q_segment_ids=None, kv_segment_ids=None,
                       kv_seq_lengths=None, config: MosaicAttentionConfig | None = None) -> str | None:
    """None when this backend runs these (already validated) arguments, else one sentence naming the constraint."""
    del scale, q_segment_ids, kv_segment_ids, kv_seq_lengths, v  # every mask kind is supported
    dtype = jnp.dtype(q.dtype)
    if dtype not in _DTYPES:
        return (f"the Mosaic backend takes bfloat16 or float16 inputs, got {dtype} (float32 runs on the Triton "
                f"backend)")
    H = q.shape[-1]
    if H not in SUPPORTED_HEAD_DIMS:
        return f"the Mosaic backend takes head dims {SUPPORTED_HEAD_DIMS} (whole 128-byte swizzled tiles), got H={H}"
    config = default_config(q, k, causal=causal) if config is None else config
    need = shared_memory_bytes(H, dtype, config)
    if need > _MAX_SMEM_BYTES:
        return (f"the Mosaic backend's tiles for H={H} ({config}) need {need} bytes of shared memory, over the "
                f"{_MAX_SMEM_BYTES} an sm90 block can have: use smaller block_q, block_kv or num_stages")
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable)."""

    config: MosaicAttentionConfig
    causal: bool
    scale: float
    residuals: bool  # also return lse and o_lo
    bwd_config: object = None  # the backward's MosaicAttentionBwdConfig; None: mosaic_bwd.default_config_bwd


def _kernel_call(q, k, v, q_seg, kv_seg, kv_lens, *, static: _Static):
    return mosaic_fwd.kernel_call(q, k, v, q_seg, kv_seg, kv_lens, cfg=static.config, causal=static.causal,
                                  scale=static.scale, residuals=static.residuals)


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
        config = mosaic_bwd.default_config_bwd(q, k, causal=static.causal)
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
