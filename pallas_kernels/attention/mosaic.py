"""The Mosaic-GPU (sm90) backend of flash attention: the forward kernel (``mosaic_fwd``) and the backward
(``mosaic_bwd``) wired into one custom VJP, and the backend-module contract of ``pallas_kernels.backends``.

Reached through ``pallas_kernels.flash_attention(..., backend="mosaic")`` (or "auto" on an sm90 GPU), which
validates the inputs and resolves the config (``config.MosaicAttentionConfig``). Semantics are the Triton
backend's: masks of every kind, GQA/MQA, any T and S, rows with no visible key give zeros and zero gradients.

The forward (``mosaic_fwd``): a TMA producer warpgroup and two compute warpgroups on wgmma (FA3 ping-pong), the
(T, S) scores only as register tiles. V rows at positions >= kv_seq_lengths are zeroed before it (one fused XLA
pass over V, only when lengths are given), so NaN or inf stored in padding never reaches p·v.
Residuals for the backward beyond q, k, v and o: the (B, N, T) float32 log-sum-exp (log2 domain) and o_lo =
o_f32 − o in q.dtype (B, T, N, H), the output's rounding error, so that delta = rowsum((o + o_lo)·do) keeps the
near one-hot rows of a saturated softmax (one more q.dtype tensor of o's size: 2 bytes per element of o; the
forward with residuals measured +2.2% at the main shape, causal +4.1%: benchmarks/results/attention_residual_cost-h100.json).

What it takes (``unsupported_reason``): bfloat16 / float16 (float32 stays on Triton: wgmma has no float32 path
worth having), head dims 64 and 128 (the forward kernel also runs 256, the backward cannot: its dK/dV float32
accumulators exceed the registers, so "auto" leaves H=256 to Triton), configs that fit shared memory, and no
interpret mode (Mosaic GPU kernels run on an sm90 GPU and lower for CUDA anywhere inside
``backends.lowering_for_gpu()``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.attention import config as _config
from pallas_kernels.attention import mosaic_bwd, mosaic_fwd

__all__ = ["Config", "FORWARD_FIELDS", "SUPPORTED_HEAD_DIMS", "check_config", "config_reason", "default_config",
           "flash_attention", "sweep_candidates", "unsupported_reason"]

Config = _config.MosaicAttentionConfig
FORWARD_FIELDS = _config.MOSAIC_FORWARD_FIELDS
SUPPORTED_HEAD_DIMS = mosaic_bwd.SUPPORTED_HEAD_DIMS
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def default_config(q, k, v, *, causal: bool, **_) -> Config:
    """The tuned or built-in config for these shapes (``config.mosaic_default_config``)."""
    return _config.mosaic_default_config(q, k, causal=causal)


def config_reason(q, config: Config, *, segments: bool) -> str | None:
    """None when ``config``'s three kernels fit an sm90 block's shared memory at q's head dim and dtype; else why
    not, with the bytes each needs."""
    H, dtype = q.shape[-1], jnp.dtype(q.dtype)
    needs = {"forward": mosaic_fwd.shared_memory_bytes(H, dtype, config)}
    if config.fused_bwd:
        needs["fused backward"] = mosaic_bwd.fused.shared_memory_bytes(config, H, dtype.itemsize, segments=segments)
    else:
        needs["dQ"], needs["dK/dV"] = mosaic_bwd.shared_memory_bytes(config, H, dtype.itemsize, segments=segments)
    over = {name: need for name, need in needs.items() if need > mu.H100_SMEM_BYTES}
    if not over:
        return None
    return ("the Mosaic backend's " + ", ".join(f"{name} kernel needs {need} bytes" for name, need in over.items())
            + f" of shared memory with {config}, over the {mu.H100_SMEM_BYTES} an sm90 block can have: use smaller "
            f"tiles or fewer stages")


def unsupported_reason(q, k, v, *, causal: bool, segment_ids, interpret: bool, config=None, **_) -> str | None:
    """None when this backend runs these (validated) arguments; else one sentence naming the constraint. Given the
    call's own ``config``, only the inputs: its tiles and shared memory are ``check_config``'s."""
    if interpret:
        return ("the Mosaic backend has no interpret mode: its kernels run on an sm90 GPU (and lower for CUDA "
                "anywhere inside backends.lowering_for_gpu())")
    dtype = jnp.dtype(q.dtype)
    if dtype not in _DTYPES:
        return f"the Mosaic backend takes bfloat16 or float16 inputs, got {dtype} (float32 runs on the Triton backend)"
    H = q.shape[-1]
    if H not in SUPPORTED_HEAD_DIMS:
        why = (" (its backward's dK and dV float32 accumulators of a 64-row key tile alone take 256 registers per "
               "thread, over the 255 limit)" if H == 256 else "")
        return f"the Mosaic backend takes head dims {SUPPORTED_HEAD_DIMS}, got H={H}{why}"
    if config is not None:
        return None
    return config_reason(q, default_config(q, k, v, causal=causal), segments=segment_ids is not None)


def sweep_candidates(q, k, v, *, causal: bool, segment_ids=None, **_) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidates for these shapes (``config.mosaic_sweep_candidates``), those that fit
    shared memory."""
    forward, backward = _config.mosaic_sweep_candidates(q.shape[-1], causal=causal, kv_len=k.shape[1],
                                                        groups=q.shape[2] // k.shape[2])
    fits = lambda c: config_reason(q, Config(**c), segments=segment_ids is not None) is None  # noqa: E731
    return [c for c in forward if fits(c)], [c for c in backward if fits(c)]


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call: the single non-differentiable argument of the custom VJP."""

    config: Config
    causal: bool
    scale: float


def _fold_vmap(fn):
    """``fn`` (arrays with a leading batch axis, or None) under a custom vmap rule: the mapped axis folds into the
    batch axis (one launch of the same kernels, no new grid axis) and unfolds from every output."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return fn(*args)

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


@functools.lru_cache(maxsize=None)
def _forward(static: _Static, residuals: bool):
    """(q, k, v, q_seg, kv_seg, kv_lens) -> (o, lse, o_lo) of ``mosaic_fwd.kernel_call`` (None without residuals),
    batched by folding."""
    return _fold_vmap(functools.partial(mosaic_fwd.kernel_call, cfg=static.config, causal=static.causal,
                                        scale=static.scale, residuals=residuals))


@functools.lru_cache(maxsize=None)
def _backward(static: _Static):
    """(q, k, v, o, o_lo, lse, do, q_seg, kv_seg, kv_lens) -> (dq, dk, dv), batched by folding."""
    return _fold_vmap(functools.partial(mosaic_bwd.backward, causal=static.causal, scale=static.scale,
                                        config=static.config))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_seg, kv_seg, kv_lens, static: _Static):
    return _forward(static, False)(q, k, v, q_seg, kv_seg, kv_lens)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, kv_lens, static: _Static):
    o, lse, o_lo = _forward(static, True)(q, k, v, q_seg, kv_seg, kv_lens)
    return o, (q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse)


def _attention_bwd(static: _Static, residuals, do):
    q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse = residuals
    dq, dk, dv = _backward(static)(q, k, v, o, o_lo, lse, do, q_seg, kv_seg, kv_lens)
    return dq, dk, dv, None, None, None  # segment ids and lengths are integers: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def check_config(config: Config, q, k, v, *, segment_ids=None, **_) -> None:
    """ValueError for a config these inputs cannot take (``config_reason``: shared memory, tiles)."""
    reason = config_reason(q, config, segments=segment_ids is not None)
    if reason is not None:
        raise ValueError(f"block_sizes: {reason}")


def flash_attention(q, k, v, *, causal: bool, scale: float, segment_ids, kv_seq_lengths, interpret: bool,
                    config: Config) -> jax.Array:
    """q (B, T, N, H), k/v (B, S, K, H) validated, bf16/fp16; segment_ids None or (q (B, T), kv (B, S)) int32;
    kv_seq_lengths None or (B,) int32 -> (B, T, N, H) in q.dtype. ValueError for a config over shared memory."""
    del interpret  # unsupported_reason refused interpret mode
    check_config(config, q, k, v, segment_ids=segment_ids)
    q_seg, kv_seg = (None, None) if segment_ids is None else segment_ids
    return _attention(q, k, v, q_seg, kv_seg, kv_seq_lengths, _Static(config=config, causal=causal, scale=scale))
