"""Kernel configs per device, backend and shape: built-in tables and a JSON cache of tuned entries.

Lookup order for a kernel call (done by the backend module's ``default_config``, at trace time):
  1. ``block_sizes=`` passed by the caller (never overwritten);
  2. an entry in the JSON cache for this device kind, backend, op and shape key (written by ``jaxfuse bench
     --op NAME --tune``, which checks every candidate against the float32 reference before timing it);
  3. the same entry of the device kind this one shares its processor with (``SAME_CHIP``: an H200 takes the H100's);
  4. the built-in tables below (hand-picked for the H100; a sane start on other GPUs), or small tiles on CPU. An op
     may put a rule of its own before them: rmsnorm_matmul's Mosaic backend gives a shape no entry covers, on an
     H200, that device's entry at 8192x4096x6144 where its tiles fit (``norm_matmul.config.UNTUNED_FROM``).

The cache is a plain JSON file meant to be committed (``DEFAULT_CACHE_PATH`` ships with the package)::

  {"version": 2,
   "entries": {"NVIDIA H100 80GB HBM3": {"triton": {"flash_attention": {
       "bfloat16[T=4096,S=4096,N=16,K=16,H=128]causal": {"params": {...}, "time_us": 812.5}}}}}}

To tune on a GPU: ``jaxfuse bench --op attention --tune --shapes main`` (``jaxfuse.suites.sweep.tune``). The
measured reasons behind the tables are in ``benchmarks/results/NOTES.md``. No import-time side effects.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "DEFAULT_CACHE_PATH",
    "SAME_CHIP",
    "device_kind",
    "flash_attention_mosaic_table",
    "flash_attention_table",
    "linear_cross_entropy_table",
    "load_cache",
    "lookup",
    "rmsnorm_matmul_table",
    "store",
    "tuned_time_us",
]

DEFAULT_CACHE_PATH = Path(__file__).with_name("tuned_configs.json")
_CACHE_VERSION = 2


def device_kind() -> str:
    """The default device's kind, e.g. "NVIDIA H100 80GB HBM3", or "cpu"."""
    device = jax.devices()[0]
    return "cpu" if device.platform == "cpu" else device.device_kind


# ---------------------------------------------------------------------------------------------------------------
# Built-in tables
# ---------------------------------------------------------------------------------------------------------------
# Flash attention on GPU, keyed by head dim. Forward: a (block_q, H) query tile stays in registers while (block_k, H)
# K/V tiles stream through shared memory. Backward: the dK/dV kernel holds a (block_k_dkv, H) K/V tile and streams
# query tiles of block_q_dkv rows; the dQ kernel holds a (block_q_dq, H) query tile and streams K/V tiles of
# block_k_dq rows. Larger head dims need smaller tiles to fit registers and shared memory (228 KiB per SM on H100).
# Each entry compiles for sm_90 with Triton 3.6 with no or few (<= 20) register spill stores in the unmasked paths
# (checked with ptxas -v on the TTIR the kernels lower to). The H=64 and H=128 tiles are the H100 sweeps' winners
# (benchmarks/results/NOTES.md, "Flash attention"); spill counts of those forward tiles were not checked.
_FLASH_ATTENTION_GPU = {
    32: dict(block_q=128, block_k=64, num_warps=4, num_stages=3,
             block_q_dkv=32, block_k_dkv=64, block_q_dq=128, block_k_dq=64, num_warps_bwd=4, num_stages_bwd=3),
    64: dict(block_q=64, block_k=64, num_warps=4, num_stages=3,
             block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64, num_warps_bwd=8, num_stages_bwd=3),
    # H=128: two query chains of 64 rows (one warpgroup's wgmma height) beat one 128-row chain at the main shape;
    # at the other suite shapes the cache holds one-chain entries from before (not swept with chains).
    128: dict(block_q=128, block_k=64, query_chains=2, num_warps=4, num_stages=2,
              block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64, num_warps_bwd=8, num_stages_bwd=3),
    256: dict(block_q=64, block_k=32, num_warps=8, num_stages=2,
              block_q_dkv=32, block_k_dkv=32, block_q_dq=64, block_k_dq=32, num_warps_bwd=8, num_stages_bwd=2),
}
# float32 inputs run IEEE float32 products on CUDA cores (FMA loops, no tensor cores): correctness first, small
# tiles and 8 warps from H=128 so the operands fit registers (checked with ptxas: no large spills). float32 is for
# checking, not for speed.
_FLASH_ATTENTION_GPU_F32 = {
    h: dict(block_q=32, block_k=32 if h <= 128 else 16, num_warps=4 if h <= 64 else 8, num_stages=2,
            block_q_dkv=16 if h == 256 else 32, block_k_dkv=32, block_q_dq=32, block_k_dq=16 if h == 256 else 32,
            num_warps_bwd=4 if h <= 64 else 8, num_stages_bwd=2)
    for h in (32, 64, 128, 256)
}
# CPU runs the kernels in interpret mode, where every grid step and loop iteration costs a dispatch: the blocks are
# small so that tiny test shapes still cover several blocks (the multi-block code paths), and warps are irrelevant.
_FLASH_ATTENTION_CPU = dict(block_q=16, block_k=16, num_warps=4, num_stages=1,
                            block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16, num_warps_bwd=4,
                            num_stages_bwd=1)


def flash_attention_table(head_dim: int, dtype, *, on_gpu: bool) -> dict[str, int]:
    """Built-in flash-attention parameters for a head dim and input dtype (a copy; keys are FlashAttentionConfig
    fields)."""
    if not on_gpu:
        return dict(_FLASH_ATTENTION_CPU)
    table = _FLASH_ATTENTION_GPU_F32 if jnp.dtype(dtype).itemsize == 4 else _FLASH_ATTENTION_GPU
    return dict(table[head_dim])


# Flash attention, Mosaic-GPU backend (sm90, bf16/fp16), keyed by head dim like the Triton table, then by causal:
# MosaicAttentionConfig fields that differ from its defaults (block_q 64, block_kv 128, num_stages 2, ping-pong;
# backward 64-row tiles, two compute warpgroups, two stages). From the H100 runs at B4 T=S=4096 N16 H128
# (benchmarks/results/attention_mosaic_fwd-h100.txt and attention_mosaic_bwd-h100.md; NOTES.md, "Flash attention
# (Mosaic backend)"): forward, 64-row K/V tiles 15% slower, a third stage or no ping-pong no faster; backward, the
# dQ kernel streams 128-row K/V tiles non-causal (1144 vs 1205 µs) and keeps 64-row tiles three stages deep causal,
# the dK/dV kernel four stages causal (888 vs 921 µs). H=64 (not measured) takes the non-causal backward choice;
# H=256 takes 64-row K/V tiles (128-row ones exceed shared memory), forward only: the backward refuses H=256.
# H=128 non-causal: FA3's intra-warpgroup overlap without ping-pong (benchmarks/results/attention_fwd_overlap-*-h100-
# c7f45b9.json, forward µs against the schedule before): 800 vs 862 at the main shape (cuDNN 816), 233 vs 248 at
# 1k (227), 1546 vs 1656 at 8k, 1561 vs 1673 GQA 32/8; with ping-pong 1-2% slower than without. Not causal (771 vs
# 466 µs, 546 without ping-pong) nor H=64 (1239 vs 1216): there the schedule before stays.
# H=64 backward (attention_bwd_h64_tiles-h100-66c32d0.json, fwd+bwd µs at B4 T=S=4096 N32): 128-row query tiles in
# both kernels non-causal, 4670 vs 5098 (cuDNN 4126); causal only in the dQ kernel (64-row K/V tiles), 2768 vs 2843
# (cuDNN 2421; 128-row query tiles in the dK/dV kernel made causal slower: 3097). At H=128 the same tiles spill.
# H=64 forward (attention_fwd_h64_tiles-h100-5f33c04.json): 128 query rows per warpgroup, 1161 vs 1206 µs (cuDNN
# 1122), causal 662 vs 681 (623); not causal with at most 1024 keys (41.0 vs 36.6 at the small train-step preset).
_FLASH_ATTENTION_MOSAIC_GPU = {
    64: {False: dict(block_q=128, block_q_dkv=128, block_q_dq=128), True: dict(block_q=128, block_q_dq=128)},
    128: {False: dict(block_kv_dq=128, overlap=True, ping_pong=False), True: dict(num_stages_dq=3, num_stages_dkv=4)},
    256: {False: dict(block_kv=64), True: dict(block_kv=64)},
}
# The persistent forward (one CTA per SM walking the work items) measured 4.4% faster at T = S = 1024 non-causal,
# H=128 (240 vs 251 µs), 1.4% slower at 4096 and 16% slower causal (attention_mosaic_fwd-persistent-h100.txt).
_MOSAIC_PERSISTENT_MAX_KV_LEN = 1024
# The persistent backward kernels (chained pipelines, non-causal only; attention_persistent_bwd-h100-5a39191.json,
# fwd+bwd µs, both kernels persistent against neither, cuDNN in the same run): 1k 1051 vs 1267 (1043; dQ 291 vs
# 440, dK/dV 449 vs 515), main 3531 vs 3707 (3280), 8k 6808 vs 7019 (6305), H64 4397 vs 4580 (4132); GQA 32/8
# 7063 vs 7061 (6607): its dQ kernel 2062 vs 2157, its dK/dV kernel (4 query heads per step) 3256 vs 3155: the
# persistent dK/dV kernel only without GQA. Each program's fixed cost (launch, prologue loads, pipeline fill,
# epilogue) was 4.3 µs in the dQ kernel and 7.4 µs in the dK/dV kernel against 2.8 and 1.6 µs per step
# (attention_program_cost-h100-943a141.json).


def flash_attention_mosaic_table(head_dim: int, *, causal: bool, kv_len: int, groups: int = 1) -> dict[str, Any]:
    """Built-in Mosaic flash-attention parameters for a head dim, causal setting, key count S and query heads per
    kv head: the fields of MosaicAttentionConfig that differ from its defaults (a copy)."""
    params = dict(_FLASH_ATTENTION_MOSAIC_GPU[head_dim][bool(causal)])
    if not causal and head_dim in (64, 128):
        params.update(persistent_dq=True, persistent_dkv=groups == 1)
    if head_dim == 64 and causal and kv_len <= _MOSAIC_PERSISTENT_MAX_KV_LEN:
        # The small train-step preset's attention (B8 T=S=1024 N8/K2, attention_small_lm_variants-h100-278cffa.json):
        # fwd+bwd 161.1 µs with 128-row K/V tiles in the dQ kernel against 163.3 with 128-row query tiles (cuDNN 156.3).
        # One compute warpgroup per dK/dV program (64 keys: 256 programs instead of 128 on 132 SMs, the long causal
        # ones no longer one wave's tail): 138.2 vs 159.3 µs (cuDNN 155.4); at H=128 causal it made 1k 1025 vs 877
        # and main 2325 vs 2084 (attention_causal_dkv_one_wg-h100-d0df6f7.json).
        params = dict(block_kv_dq=128, compute_wgs_dkv=1)  # and 64 query rows per forward warpgroup (table notes)
    if head_dim == 128 and not causal and kv_len <= _MOSAIC_PERSISTENT_MAX_KV_LEN:
        params["persistent"] = True
    return params


# RMSNorm→matmul, H100, bf16. Prefill/training: compute-bound GEMM tiles. Decode: one 16-row block and K split over
# 4 programs per 128-column tile, so that >= 128 programs stream w with enough bytes in flight (NOTES.md).
_RMSNORM_MATMUL_GPU = {
    "large": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, gamma_on_w=False,
                  block_m_dx=128, block_k_dx=128, block_n_dx=64, num_warps_dx=8, num_stages_dx=3,
                  rowdot_in_dx=False, block_k_dw=128, block_n_dw=128, block_m_dw=64, num_warps_dw=8,
                  num_stages_dw=3, rstd_on_dy=False, dw_in_xla=True, group=8),
    "decode": dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, gamma_on_w=False, split_k=4,
                   block_m_dx=16, block_k_dx=32, block_n_dx=256, num_warps_dx=4, num_stages_dx=4,
                   rowdot_in_dx=False, block_k_dw=64, block_n_dw=128, block_m_dw=16, num_warps_dw=4,
                   num_stages_dw=3, rstd_on_dy=False, group=1),
}
# CPU (interpret mode): small tiles so that tiny test shapes still cover several blocks and the grouped order.
_RMSNORM_MATMUL_CPU = dict(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1, gamma_on_w=False,
                           block_m_dx=16, block_k_dx=16, block_n_dx=16, num_warps_dx=4, num_stages_dx=1,
                           rowdot_in_dx=False, block_k_dw=16, block_n_dw=16, block_m_dw=16, num_warps_dw=4,
                           num_stages_dw=1, rstd_on_dy=False, group=2)
DECODE_ROWS = 64  # rows at or below which an rmsnorm_matmul call counts as decode (memory-bound)


def rmsnorm_matmul_table(M: int, dtype, *, on_gpu: bool) -> dict[str, Any]:
    """Built-in rmsnorm_matmul parameters for M rows of a dtype, before fitting to K and N (a copy; keys are
    RMSNormMatmulConfig fields)."""
    if not on_gpu:
        return dict(_RMSNORM_MATMUL_CPU)
    params = dict(_RMSNORM_MATMUL_GPU["decode" if M <= DECODE_ROWS else "large"])
    if M <= DECODE_ROWS and M <= params["block_m_dx"]:
        # Decode, every row in one dx row block: the dx kernel writes dw too (32x128 tiles, N split 4 ways). On the H200 at
        # five decode shapes with no entry, fwd+bwd µs against the table's separate dw kernel: 1x2048x8192 39.8 /
        # 50.6, 4x1024x3072 15.2 / 18.3, 8x4096x12288 104.9 / 109.5, 16x2048x5632 35.1 / 41.3, 16x8192x8192
        # 125.5 / 127.1 (decode_dw_in_dx_table-h200-82f65c8.json). Not measured on another GPU.
        params.update(dw_in_dx=True, block_k_dx=32, block_n_dx=128, split_n_dx=4)
    if jnp.dtype(dtype).itemsize == 4:  # twice the bytes per tile: keep the pipelines in shared memory
        params.update(block_k=min(params["block_k"], 128 if M <= DECODE_ROWS else 32), num_stages=2,
                      num_stages_dx=2, num_stages_dw=2)
    return params


# Linear cross-entropy (token chunks, gradients in the forward). GPU: the config's defaults for every dtype (the row
# kernel has no dot: its tiles live in registers, not in a shared-memory pipeline), chunk_rows from the memory rule.
# CPU (interpret mode): 16-row chunks and small row tiles, so tiny test shapes still cover several chunks (the last
# sharing rows with the one before), row blocks and vocabulary tiles.
_LINEAR_CROSS_ENTROPY_CPU = dict(chunk_rows=16, rows_per_program=4, block_v=32, num_warps=4)


def linear_cross_entropy_table(dtype, *, on_gpu: bool) -> dict[str, Any]:
    """Built-in linear_cross_entropy parameters overriding LinearCrossEntropyConfig's defaults (a copy)."""
    del dtype  # the same tiles for every dtype
    return {} if on_gpu else dict(_LINEAR_CROSS_ENTROPY_CPU)


# ---------------------------------------------------------------------------------------------------------------
# JSON cache
# ---------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _read_cache(path: str, mtime_ns: int) -> dict:
    del mtime_ns  # Part of the lru key only: a rewritten file is read again.
    with open(path) as f:
        data = json.load(f)
    if data.get("version") != _CACHE_VERSION:
        raise ValueError(f"{path}: tuning cache version {data.get('version')!r}, expected {_CACHE_VERSION}")
    return data


def load_cache(path: str | os.PathLike = DEFAULT_CACHE_PATH) -> dict:
    """The whole cache ({"version", "entries": {device: {backend: {op: {key: entry}}}}}); empty if no file."""
    path = os.fspath(path)
    try:
        mtime_ns = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return {"version": _CACHE_VERSION, "entries": {}}
    return _read_cache(path, mtime_ns)


# Device kinds that are the same processor as another (same SMs, shared memory and tensor cores; other memory): with
# no entry of their own, they take that kind's entries. The H200 is the H100's Hopper die with HBM3e (4.8 against
# 3.35 TB/s), so tiles tuned on one suit the other. A tuned time read through this is the other chip's time, and
# backend="auto" compares it as it is with the device's own entries (an H200 time is the lower for memory-bound work).
SAME_CHIP = {"NVIDIA H200": "NVIDIA H100 80GB HBM3"}


def _entry(op: str, key: str, backend: str, device: str | None, path) -> dict | None:
    device = device_kind() if device is None else device
    entries = load_cache(path)["entries"]
    for kind in (device, SAME_CHIP.get(device)):
        entry = entries.get(kind, {}).get(backend, {}).get(op, {}).get(key)
        if entry is not None:
            return entry
    return None


def lookup(op: str, key: str, *, backend: str = "triton", device: str | None = None,
           path: str | os.PathLike = DEFAULT_CACHE_PATH) -> dict[str, Any] | None:
    """Cached parameters for (device kind, backend, op, shape key), or None."""
    entry = _entry(op, key, backend, device, path)
    return None if entry is None else dict(entry["params"])


def tuned_time_us(op: str, key: str, *, backend: str = "triton", device: str | None = None,
                  path: str | os.PathLike = DEFAULT_CACHE_PATH) -> float | None:
    """The time the tuner measured for the cached entry (what ``backend="auto"`` compares), or None."""
    entry = _entry(op, key, backend, device, path)
    return None if entry is None else entry.get("time_us")


def store(op: str, key: str, params: Mapping[str, Any], *, backend: str = "triton", time_us: float | None = None,
          device: str | None = None, path: str | os.PathLike = DEFAULT_CACHE_PATH) -> None:
    """Adds or replaces one entry, rewriting the file atomically with sorted keys (stable diffs when committed)."""
    device = device_kind() if device is None else device
    path = os.fspath(path)
    data = json.loads(json.dumps(load_cache(path)))  # deep copy: the lru-cached dict stays untouched
    entry: dict[str, Any] = {"params": dict(params)}
    if time_us is not None:
        entry["time_us"] = round(float(time_us), 2)
    data["entries"].setdefault(device, {}).setdefault(backend, {}).setdefault(op, {})[key] = entry
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tuning-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
