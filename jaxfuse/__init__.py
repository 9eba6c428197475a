"""jaxfuse: see what XLA fuses in a Flax model, swap hand-fused kernels in at its sites, and measure the change.

    from flax import nnx
    from jaxfuse import KernelSet, models
    model = models.Transformer(models.Config.tiny(), kernels=KernelSet(attention="xla"), rngs=nnx.Rngs(0))
"""

from jaxfuse import models
from jaxfuse.kernels import KernelSet

__all__ = ["KernelSet", "models"]
