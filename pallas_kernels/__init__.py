"""Hand-fused Pallas (Triton lowering) kernels, each with a float32 jnp reference in ``pallas_kernels.reference``.

  from pallas_kernels import flash_attention
  o = flash_attention(q, k, v, causal=True)   # q (B,T,N,H), k/v (B,S,K,H); the (T, S) scores never reach HBM

The kernel modules share their function's name, so they are reached through ``sys.modules`` (e.g.
``importlib.import_module("pallas_kernels.flash_attention")``); what a user needs is exported here.
"""

from pallas_kernels import reference, tuning
from pallas_kernels.flash_attention import FlashAttentionConfig
from pallas_kernels.flash_attention import autotune as autotune_flash_attention
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.cross_entropy import LinearCrossEntropyConfig, linear_cross_entropy
from pallas_kernels.rmsnorm_matmul import RMSNormMatmulConfig, rmsnorm_matmul

__all__ = ["FlashAttentionConfig", "LinearCrossEntropyConfig", "linear_cross_entropy", "RMSNormMatmulConfig", "rmsnorm_matmul", "autotune_flash_attention", "flash_attention", "reference", "tuning"]
