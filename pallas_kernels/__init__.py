"""Hand-fused Pallas kernels, each with a float32 jnp reference in ``pallas_kernels.reference``.

  from pallas_kernels import flash_attention
  o = flash_attention(q, k, v, causal=True)   # q (B,T,N,H), k/v (B,S,K,H); the (T, S) scores never reach HBM
  o = flash_attention(q, k, v, backend="triton")              # "auto" (default) | "triton" | "mosaic"
  c = matmul(a, b)                                            # the Mosaic-GPU GEMM core (sm90): pallas_kernels.gemm

One package per op (``attention``, ``norm_matmul``, ``cross_entropy``): the public function in its ``__init__``
(validation, config, backend dispatch), one module per GPU backend beside it (``triton.py``), the configs in
``config.py``. ``OPS`` maps each op's name to its package, ``BACKENDS`` to its backend registry
(``pallas_kernels.backends``).
"""

from pallas_kernels import backends, reference, tuning
from pallas_kernels.attention import FlashAttentionConfig, flash_attention
from pallas_kernels.cross_entropy import LinearCrossEntropyConfig, linear_cross_entropy
from pallas_kernels.gemm import MosaicGemmConfig, matmul
from pallas_kernels.norm_matmul import MosaicRMSNormMatmulConfig, RMSNormMatmulConfig, rmsnorm_matmul
from pallas_kernels import attention as _attention, cross_entropy as _cross_entropy, norm_matmul as _norm_matmul

# op name (as in the tuning cache) -> its package (public function, plan, tuning_key, sweep_candidates, BACKENDS)
OPS = {package.BACKENDS.op: package for package in (_attention, _norm_matmul, _cross_entropy)}
# op name -> its backend registry: BACKENDS["flash_attention"].names == ("mosaic", "triton")
BACKENDS = {op: package.BACKENDS for op, package in OPS.items()}

__all__ = ["BACKENDS", "OPS", "FlashAttentionConfig", "LinearCrossEntropyConfig", "MosaicGemmConfig",
           "MosaicRMSNormMatmulConfig", "RMSNormMatmulConfig", "backends", "flash_attention", "linear_cross_entropy",
           "matmul", "reference", "rmsnorm_matmul", "tuning"]
