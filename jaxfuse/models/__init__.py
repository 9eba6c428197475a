"""Flax NNX models whose fusable sites dispatch through a ``jaxfuse.KernelSet``."""

from jaxfuse.models.transformer import MLP, Attention, Block, Config, Embedding, Linear, RMSNorm, Transformer, rope

__all__ = ["MLP", "Attention", "Block", "Config", "Embedding", "Linear", "RMSNorm", "Transformer", "rope"]
