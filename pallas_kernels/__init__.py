"""Hand-fused Pallas (Triton lowering) kernels, each with a float32 jnp reference in ``pallas_kernels.reference``."""

from pallas_kernels import reference

__all__ = ["reference"]
