"""Flash attention configs: the Triton kernels' FlashAttentionConfig, the tuning-cache key, the default config of
a call and the block-size sweep's candidates.

  config = default_config(q, k, causal=True)            # tuned entry for this device and shape, else the table
  forward, backward = sweep_candidates(128, jnp.bfloat16, T=4096, S=4096)   # for `jaxfuse bench --tune`
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils, tuning

__all__ = ["FORWARD_FIELDS", "FlashAttentionConfig", "default_config", "fit_to_shape", "shape_key",
           "sweep_candidates"]

OP = "flash_attention"  # the op's name in the tuning cache
# Config fields of the forward kernel: forward sweep candidates vary these, backward candidates the others.
FORWARD_FIELDS = ("block_q", "block_k", "query_chains", "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Tile sizes and launch parameters of the three kernels (one static argument, hashable).

    Attributes:
      block_q, block_k: forward tile: block_q query rows per program, key/value tiles of block_k rows.
      block_q_dkv, block_k_dkv: dK/dV kernel: block_k_dkv key rows per program, query tiles of block_q_dkv rows.
      block_q_dq, block_k_dq: dQ kernel: block_q_dq query rows per program, key/value tiles of block_k_dq rows.
      query_chains: the forward's query tile as this many independent chains of block_q / query_chains rows (1 or
        2) sharing each key/value tile; each chain's q·kᵀ is issued before any chain's softmax, so one chain's
        exp2s can run under the other's tensor-core work.
      num_warps, num_stages: Triton launch parameters of the forward kernel.
      num_warps_bwd, num_stages_bwd: the same for both backward kernels.
    All block sizes are powers of two >= 16 (Triton tensor shapes and tl.dot minimum); they need not divide T or S.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 32
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 32
    query_chains: int = 1
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 3

    def __post_init__(self):
        triton_utils.check_launch_fields(self)  # the block sizes, warp counts and stage counts
        if self.query_chains not in (1, 2) or isinstance(self.query_chains, bool):
            raise ValueError(f"FlashAttentionConfig.query_chains: must be 1 or 2, got {self.query_chains!r}")
        if self.block_q // self.query_chains < 16:
            raise ValueError(f"FlashAttentionConfig.query_chains: block_q / query_chains must be >= 16 (tl.dot's "
                             f"minimum), got block_q={self.block_q}, query_chains={self.query_chains}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)



def shape_key(q, k, causal: bool) -> str:
    """Tuning-cache key: dtype, power-of-two buckets of T and S, heads, head dim, causal."""
    _, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bucket = lambda n: max(16, pl.next_power_of_2(n))
    return f"{jnp.dtype(q.dtype).name}[T={bucket(T)},S={bucket(S)},N={N},K={K},H={H}]" + ("causal" if causal else "")


def fit_to_shape(params: Mapping[str, int], T: int, S: int) -> dict[str, int]:
    """Shrinks table/cache tiles that exceed the (power-of-two rounded) sequence lengths; never applied to a
    caller's explicit block_sizes."""
    fit = lambda n, cap: min(n, max(16, pl.next_power_of_2(cap)))
    out = dict(params)
    for name in ("block_q", "block_q_dkv", "block_q_dq"):
        out[name] = fit(out[name], T)
    for name in ("block_k", "block_k_dkv", "block_k_dq"):
        out[name] = fit(out[name], S)
    if out["block_q"] // out.get("query_chains", 1) < 16:  # a shrunk tile too short to split
        out["query_chains"] = 1
    return out


def default_config(q, k, *, causal: bool = False, on_gpu: bool | None = None, device: str | None = None,
                   cache_path=tuning.DEFAULT_CACHE_PATH) -> FlashAttentionConfig:
    """The config a call would use without ``block_sizes``: on GPU, the tuning-cache entry for this device kind and
    shape if there is one, else the built-in table; on CPU, the interpret-mode table. Tiles are then shrunk to
    short sequences."""
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    params = tuning.lookup(OP, shape_key(q, k, causal), device=device, path=cache_path) if on_gpu else None
    if params is None:
        params = tuning.flash_attention_table(q.shape[-1], q.dtype, on_gpu=on_gpu)
    return FlashAttentionConfig(**fit_to_shape(params, q.shape[1], k.shape[1]))


# Sweep candidates for head dim <= 128, most promising first (a time budget may cut the tail; the H100 sweeps of
# benchmarks/results/NOTES.md). Forward: (block_q, block_k, query_chains, num_warps, num_stages); 128x128 tiles
# with 4 stages exceed the H100's shared memory at H=128. Two query chains are tried with 4 warps only: with 8 they
# lost. Backward: (block_q_dkv, block_k_dkv, block_q_dq, block_k_dq, num_warps_bwd, num_stages_bwd).
_FORWARD_CANDIDATES = [(128, 64, 2, 4, 2), (128, 64, 1, 4, 2), (128, 64, 2, 4, 3), (128, 128, 1, 8, 3),
                       (64, 64, 1, 4, 3), (128, 32, 2, 4, 3), (128, 64, 1, 8, 4), (128, 64, 1, 4, 3),
                       (128, 128, 1, 8, 2), (128, 32, 1, 4, 4), (64, 128, 1, 4, 3), (128, 64, 1, 8, 2),
                       (64, 64, 1, 4, 4), (64, 32, 1, 4, 3)]
_BACKWARD_FIELDS = ("block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq", "num_warps_bwd", "num_stages_bwd")
_BACKWARD_CANDIDATES = [(64, 128, 128, 64, 8, 3), (32, 128, 128, 32, 8, 2), (64, 64, 64, 64, 4, 3),
                        (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 3),
                        (64, 64, 64, 64, 8, 3), (16, 128, 128, 16, 8, 3), (64, 128, 128, 32, 8, 3),
                        (32, 128, 64, 32, 8, 3)]


def _large_head_candidates() -> tuple[list[tuple], list[tuple]]:
    """Head dim 256: forward tiles x warps x stages, backward tile pairs x warps x stages."""
    forward = [(bq, bk, 1, warps, stages) for (bq, bk), warps, stages
               in itertools.product([(64, 32), (64, 64), (32, 32)], (4, 8), (2, 3, 4))]
    backward = [(*tiles, warps, stages) for tiles, warps, stages
                in itertools.product([(32, 64, 64, 32), (16, 64, 64, 16), (32, 32, 32, 32)], (4, 8), (2, 3))]
    return forward, backward


def sweep_candidates(head_dim: int, dtype, T: int, S: int) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidate parameter dicts for a sweep at this head dim, dtype and sequence lengths: the
    table entry first, then forward candidates varying only FORWARD_FIELDS and backward candidates varying only
    the backward kernels' fields, each a valid FlashAttentionConfig fitted to T and S, duplicates removed."""
    base = FlashAttentionConfig(**tuning.flash_attention_table(head_dim, dtype, on_gpu=True)).to_dict()
    forward, backward = ((_FORWARD_CANDIDATES, _BACKWARD_CANDIDATES) if head_dim <= 128
                         else _large_head_candidates())

    def unique(overrides, fields):
        out = {}
        for values in [()] + list(overrides):
            params = fit_to_shape(dict(base, **dict(zip(fields, values))), T, S)
            out.setdefault(tuple(sorted(params.items())), FlashAttentionConfig(**params).to_dict())
        return list(out.values())

    return unique(forward, FORWARD_FIELDS), unique(backward, _BACKWARD_FIELDS)
