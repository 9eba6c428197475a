"""Linear cross-entropy configs: the Triton kernels' LinearCrossEntropyConfig, the tuning-cache key, the default
config of a call, the fill-in of its shape-dependent fields and the block-size sweep's candidates.

  config = for_shape(default_config(h, w), B, V)        # tuned entry or defaults, None fields resolved
  forward, backward = sweep_candidates(h, w)            # for `jaxfuse bench --tune`
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels import tuning
from pallas_kernels.index_math import is_int

__all__ = ["FORWARD_FIELDS", "LinearCrossEntropyConfig", "default_config", "for_shape", "shape_key",
           "sweep_candidates"]

OP = "linear_cross_entropy"  # the op's name in the tuning cache
# Config fields of the forward kernel: forward sweep candidates vary these, backward candidates the others.
FORWARD_FIELDS = ("block_b", "block_v", "block_h", "num_splits", "num_warps", "num_stages")
_NUM_SMS = 132  # H100 SXM; only used to pick how many V splits give the forward enough programs
_CHUNK_ELEMENTS = 2**25  # auto chunk_v: B · chunk_v ≈ 32 Mi dlogits elements (64 MiB in bf16)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyConfig:
    """Tile sizes and launch parameters (one static argument, hashable).

    Attributes:
      block_b, block_v, block_h: forward tile: block_b rows per program, (block_b, block_v) logits tiles
        accumulated over H in block_h chunks.
      num_splits: forward grid axis over the vocabulary (each split walks ceil(V / block_v / num_splits) tiles);
        None picks enough splits for ~4 programs per SM.
      block_b_bwd, block_v_bwd, block_h_bwd: the backward dlogits kernel's tile, one (block_b_bwd, block_v_bwd)
        tile per program.
      group_b: backward program order: consecutive programs cover group_b row blocks × all column blocks of a
        chunk, so a wave of programs shares its h rows and w columns in L2.
      chunk_v: vocabulary columns per backward step (dlogits (B, chunk_v) is the largest backward temporary);
        None picks B · chunk_v ≈ 32 Mi elements.
      num_warps, num_stages / num_warps_bwd, num_stages_bwd: Triton launch parameters of the two kernels.
    Block sizes are powers of two >= 16 (Triton tile shapes and tl.dot minimum); they need not divide B, H or V.
    """

    # Defaults: the best of the H100 sweep at 8192x4096x128256 (benchmarks/results/NOTES.md).
    block_b: int = 128
    block_v: int = 256
    block_h: int = 64
    num_splits: int | None = None
    block_b_bwd: int = 128
    block_v_bwd: int = 256
    block_h_bwd: int = 64
    group_b: int = 8
    chunk_v: int | None = None
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 4

    def __post_init__(self):
        tu.check_launch_fields(self)  # block_*, num_warps*, num_stages*
        for name in ("num_splits", "chunk_v"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"LinearCrossEntropyConfig.{name}: must be None or a positive int, got {value!r}")
        if not is_int(self.group_b) or self.group_b < 1:
            raise ValueError(f"LinearCrossEntropyConfig.group_b: must be a positive int, got {self.group_b!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def shape_key(h, w) -> str:
    """Tuning-cache key: dtype, B, H, V."""
    return f"{jnp.dtype(h.dtype).name}[B={h.shape[0]},H={h.shape[1]},V={w.shape[1]}]"


def default_config(h, w, *, on_gpu: bool | None = None) -> LinearCrossEntropyConfig:
    """The config a call uses without ``block_sizes``: the tuning cache entry for this device and shape if there is
    one, else the built-in table (GPU defaults, or small tiles on CPU). None fields are resolved at call time
    (``for_shape``)."""
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    params = tuning.lookup(OP, shape_key(h, w)) if on_gpu else None
    if params is None:
        params = tuning.linear_cross_entropy_table(h.dtype, on_gpu=on_gpu)
    return LinearCrossEntropyConfig(**params)


def for_shape(config: LinearCrossEntropyConfig, B: int, V: int) -> LinearCrossEntropyConfig:
    """Fills num_splits and chunk_v when None; makes every split non-empty."""
    n_vt = pl.cdiv(V, config.block_v)
    splits = config.num_splits
    if splits is None:
        splits = min(16, max(1, pl.cdiv(4 * _NUM_SMS, pl.cdiv(B, config.block_b))))
    splits = pl.cdiv(n_vt, pl.cdiv(n_vt, min(splits, n_vt)))  # no empty split
    chunk = config.chunk_v if config.chunk_v is not None else _auto_chunk(B, V, config.block_v_bwd)
    return dataclasses.replace(config, num_splits=splits, chunk_v=min(chunk, V))


def _auto_chunk(B: int, V: int, block_v: int) -> int:
    """Backward chunk width: a multiple of block_v (so the dlogits kernel needs no column masks) near
    _CHUNK_ELEMENTS / B columns, with as few columns as possible recomputed by the clamped last chunk (see
    ``triton._backward``): the number of chunks is searched in [n0, 2·n0] for the least overshoot of V."""
    blocks = pl.cdiv(V, block_v)
    target_blocks = max(1, (1 << max(0, (_CHUNK_ELEMENTS // max(B, 1)).bit_length() - 1)) // block_v)
    n0 = pl.cdiv(blocks, target_blocks)
    overshoot = lambda n: pl.cdiv(blocks, n) * n - blocks
    best = min(range(n0, 2 * n0 + 1), key=lambda n: (overshoot(n), n))
    return block_v * pl.cdiv(blocks, best)


# Sweep candidates: overrides of the default config, the H100 sweep's space at 8192x4096x128256.
_FORWARD_OVERRIDES = [{}, {"block_v": 128}, {"num_stages": 4}, {"num_splits": 8}, {"num_splits": 16},
                      {"block_b": 64, "num_warps": 4}, {"block_h": 32, "num_stages": 4}]
_BACKWARD_OVERRIDES = [{}, {"chunk_v": 8192}, {"chunk_v": 16384}, {"block_v_bwd": 128}, {"num_stages_bwd": 3},
                       {"group_b": 16}]


def sweep_candidates(h, w) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidate parameter dicts at h (B, H), w (H, V): the GPU default first, forward ones
    varying only FORWARD_FIELDS, backward ones the backward kernel's fields and chunk_v."""
    base = default_config(h, w, on_gpu=True).to_dict()
    return ([LinearCrossEntropyConfig(**dict(base, **o)).to_dict() for o in _FORWARD_OVERRIDES],
            [LinearCrossEntropyConfig(**dict(base, **o)).to_dict() for o in _BACKWARD_OVERRIDES])
