"""Flash attention configs: the Triton kernels' FlashAttentionConfig and the Mosaic kernels' MosaicAttentionConfig,
the tuning-cache key, the default config of a call and the block-size sweep's candidates, per backend.

  config = default_config(q, k, causal=True)            # Triton: tuned entry for this device and shape, else the table
  forward, backward = sweep_candidates(128, jnp.bfloat16, T=4096, S=4096)   # for `jaxfuse bench --tune`
  config = mosaic_default_config(q, k, causal=True)     # Mosaic: the same lookup in its own tables
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils, tuning
from pallas_kernels.index_math import is_int

__all__ = ["FORWARD_FIELDS", "FlashAttentionConfig", "MOSAIC_FORWARD_FIELDS", "MosaicAttentionConfig", "default_config",
           "fit_to_shape", "mosaic_default_config", "mosaic_sweep_candidates", "shape_key", "sweep_candidates"]

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


# ---------------------------------------------------------------------------------------------------------------
# Mosaic-GPU backend (sm90)
# ---------------------------------------------------------------------------------------------------------------
# Config fields of the forward kernel: forward sweep candidates vary these, backward candidates the others.
MOSAIC_FORWARD_FIELDS = ("block_q", "block_kv", "num_stages", "ping_pong", "persistent", "overlap")


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Tiles and schedules of the Mosaic backend's three kernels (one static argument, hashable).

    Forward (``mosaic_fwd``: one TMA warpgroup, two compute warpgroups):
      block_q: query rows per compute warpgroup (a CTA holds 2·block_q): a positive multiple of 64 (wgmma's rows).
      block_kv: key/value rows per pipeline step: a positive multiple of 64.
      num_stages: K/V tiles in flight in the shared-memory ring, 2 to 6.
      ping_pong: the compute warpgroups take turns on the tensor cores (FA3's schedule) instead of free-running.
      persistent: one CTA per SM walking the work items, the K/V ring and the next item's q carried across items
        (a separate output tile in shared memory).
      overlap: FA3's intra-warpgroup overlap: each warpgroup issues tile j's q·kᵀ with tile j−1's p·v and runs tile
        j's softmax while p·v is on the tensor cores (with ping_pong, the warpgroups take turns per such batch).
    Backward (``mosaic_bwd_kernels``: warp-specialized pipelines, one TMA warpgroup each):
      block_q_dq, block_kv_dq: the dQ kernel's query rows per compute warpgroup, key/value rows per step.
      compute_wgs_dq: compute warpgroups per dQ program (1 or 2); num_stages_dq: its pipeline depth (1 to 4).
      block_q_dkv, block_kv_dkv, compute_wgs_dkv, num_stages_dkv: the same for the dK/dV kernel (query rows per
        step, key rows per compute warpgroup).
      persistent_dq, persistent_dkv: that backward kernel launches one CTA per SM that walks its programs, one
        chained pipeline per program (the next program's first tiles stream in while this one finishes), where its
        step count is static and a multiple of its num_stages (no causal mask, no kv_seq_lengths); elsewhere, and
        in the fused backward, one CTA per program.
    Backward blocks are 64 or 128. No block needs to divide T or S (tails are masked). Whether a config fits
    shared memory at a head dim is the backend's ``unsupported_reason`` / a ValueError at the call.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    ping_pong: bool = True
    persistent: bool = False
    overlap: bool = False
    block_q_dq: int = 64
    block_kv_dq: int = 64
    compute_wgs_dq: int = 2
    num_stages_dq: int = 2
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    compute_wgs_dkv: int = 2
    num_stages_dkv: int = 2
    persistent_dq: bool = False
    persistent_dkv: bool = False
    fused_bwd: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            name, value = field.name, getattr(self, field.name)
            if name in ("ping_pong", "persistent", "overlap", "persistent_dq", "persistent_dkv", "fused_bwd"):
                ok, allowed = isinstance(value, bool), "a bool"
            elif name in ("block_q", "block_kv"):
                ok, allowed = is_int(value) and value > 0 and value % 64 == 0, "a positive multiple of 64"
            elif name.startswith("block_"):
                ok, allowed = is_int(value) and value in (64, 128), "64 or 128"
            elif name.startswith("compute_wgs"):
                ok, allowed = is_int(value) and value in (1, 2), "1 or 2"
            elif name == "num_stages":
                ok, allowed = is_int(value) and 2 <= value <= 6, "an int in [2, 6]"
            else:  # num_stages_dq, num_stages_dkv
                ok, allowed = is_int(value) and 1 <= value <= 4, "an int in [1, 4]"
            if not ok:
                raise ValueError(f"MosaicAttentionConfig.{name}: must be {allowed}, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def mosaic_default_config(q, k, *, causal: bool = False, device: str | None = None,
                          cache_path=tuning.DEFAULT_CACHE_PATH) -> MosaicAttentionConfig:
    """The Mosaic config a call would use without ``block_sizes``: the tuning-cache entry for this device kind and
    shape (backend "mosaic") if there is one, else the built-in table (``tuning.flash_attention_mosaic_table``)."""
    params = tuning.lookup(OP, shape_key(q, k, causal), backend="mosaic", device=device, path=cache_path)
    if params is None:
        params = tuning.flash_attention_mosaic_table(q.shape[-1], causal=causal, kv_len=k.shape[1],
                                                     groups=q.shape[2] // k.shape[2])
    return MosaicAttentionConfig(**params)


# Sweep candidates, overrides of the table entry, most promising first (the H100 runs of NOTES.md): forward
# (block_kv, num_stages, ping_pong, persistent); backward (block_kv_dq, num_stages_dq, num_stages_dkv). Left out
# as measured losers at the main shape: block_q_dkv 128 (2x the dK/dV kernel: register spills) and one compute
# warpgroup per backward program (1.35x).
# (block_kv, num_stages, ping_pong, persistent, overlap)
_MOSAIC_FORWARD_CANDIDATES = [(128, 2, True, False, False), (128, 3, True, False, False), (128, 2, False, False, False),
                              (128, 2, True, True, False), (64, 2, True, False, False), (64, 3, True, False, False),
                              (64, 4, True, False, False), (128, 2, False, False, True), (128, 2, True, False, True),
                              (128, 2, False, True, True)]
_MOSAIC_BACKWARD_FIELDS = ("block_kv_dq", "num_stages_dq", "num_stages_dkv")
_MOSAIC_BACKWARD_CANDIDATES = [(128, 2, 2), (64, 2, 2), (64, 3, 4), (64, 3, 3), (128, 2, 4), (128, 3, 3)]
# and schedules, each on top of the table entry: the persistent backward kernels on or off (they run only where
# the step count is static), one compute warpgroup per dK/dV program (more, shorter programs: short causal GQA)
_MOSAIC_BACKWARD_SCHEDULES = [dict(persistent_dq=True, persistent_dkv=True), dict(persistent_dq=False,
                              persistent_dkv=False), dict(compute_wgs_dkv=1)]


def mosaic_sweep_candidates(head_dim: int, *, causal: bool, kv_len: int,
                            groups: int = 1) -> tuple[list[dict], list[dict]]:
    """(forward, backward) MosaicAttentionConfig dicts for a sweep: the table entry first, then forward candidates
    varying only MOSAIC_FORWARD_FIELDS and backward ones varying only the backward fields, duplicates removed.
    Shared-memory fit at a head dim is not checked here (the backend module filters)."""
    base = MosaicAttentionConfig(**tuning.flash_attention_mosaic_table(head_dim, causal=causal, kv_len=kv_len,
                                                                       groups=groups)).to_dict()
    forward_fields = ("block_kv", "num_stages", "ping_pong", "persistent", "overlap")

    def unique(overrides):
        out = {}
        for override in [{}] + list(overrides):
            config = MosaicAttentionConfig(**dict(base, **override)).to_dict()
            out.setdefault(tuple(sorted(config.items())), config)
        return list(out.values())

    return (unique(dict(zip(forward_fields, values)) for values in _MOSAIC_FORWARD_CANDIDATES),
            unique([dict(zip(_MOSAIC_BACKWARD_FIELDS, values)) for values in _MOSAIC_BACKWARD_CANDIDATES]
                   + _MOSAIC_BACKWARD_SCHEDULES))
