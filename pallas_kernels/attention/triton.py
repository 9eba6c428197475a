"""The Triton backend of flash attention: forward and backward Pallas kernels (``triton_fwd``, ``triton_bwd``) wired
into one custom VJP.

Reached through ``pallas_kernels.flash_attention(..., backend="triton")``, which validates the inputs and resolves
the config; the backend-module contract is in ``pallas_kernels.backends``. Any GPU the Triton lowering supports, and
interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import triton_utils
from pallas_kernels.attention import config as _config
from pallas_kernels.attention.triton_bwd import backward
from pallas_kernels.attention.triton_fwd import Static, forward

__all__ = ["Config", "FORWARD_FIELDS", "default_config", "flash_attention", "sweep_candidates",
           "unsupported_reason"]

Config = _config.FlashAttentionConfig
FORWARD_FIELDS = _config.FORWARD_FIELDS


def default_config(q, k, v, *, causal: bool, interpret: bool, **_) -> Config:
    """The tuned or built-in config for these shapes (``config.default_config``)."""
    return _config.default_config(q, k, causal=causal, on_gpu=not interpret)


def unsupported_reason(q, k, v, **_) -> str | None:
    """None: the Triton kernels take every input the public function accepts."""
    return None


def sweep_candidates(q, k, v, **_) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidates for these shapes (``config.sweep_candidates``)."""
    return _config.sweep_candidates(q.shape[-1], q.dtype, q.shape[1], k.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash_attention(q, k, v, q_seg, kv_seg, kv_lens, static: Static):
    return forward(q, k, v, q_seg, kv_seg, kv_lens, static=static)[0]


def _flash_attention_fwd(q, k, v, q_seg, kv_seg, kv_lens, static: Static):
    with triton_utils.quiet_triton_deprecation():
        o, lse, o_lo = forward(q, k, v, q_seg, kv_seg, kv_lens, static=static, residuals=True)
    return o, (q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse)


def _flash_attention_bwd(static: Static, residuals, do):
    q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse = residuals
    with triton_utils.quiet_triton_deprecation():  # an eager jax.grad compiles the backward here, after our call returned
        dq, dk, dv = backward(q, k, v, q_seg, kv_seg, kv_lens, o, o_lo, lse, do, static=static)
    return dq, dk, dv, None, None, None  # segment ids and lengths are integers: no cotangent


_flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


def flash_attention(q, k, v, *, causal: bool, scale: float, segment_ids, kv_seq_lengths, interpret: bool,
                    config: Config) -> jax.Array:
    """q (B, T, N, H), k/v (B, S, K, H) validated; segment_ids None or (q (B, T), kv (B, S)) int32; kv_seq_lengths
    None or (B,) int32 -> (B, T, N, H) in q.dtype."""
    B = q.shape[0]
    q_seg, kv_seg = (None, None) if segment_ids is None else segment_ids
    kv_lens = None if kv_seq_lengths is None else kv_seq_lengths.reshape(B, 1)
    static = Static(config=config, causal=causal, scale=scale, interpret=interpret)
    with triton_utils.quiet_triton_deprecation():
        return _flash_attention(q, k, v, q_seg, kv_seg, kv_lens, static)

