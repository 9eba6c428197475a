"""Block sizes per shape: a built-in table, a JSON cache of autotuned entries, and the GPU autotuner that fills it.

Lookup order for a kernel call (done by the kernel module, at trace time):
  1. ``block_sizes=`` passed by the caller (never overwritten);
  2. an entry in the JSON cache for this device kind, op and shape key (written by ``autotune``);
  3. the built-in table below (hand-picked for H100; a sane start on other GPUs), or small blocks on CPU.

The cache is a plain JSON file meant to be committed (``DEFAULT_CACHE_PATH`` ships with the package)::

  {"version": 1,
   "entries": {"NVIDIA H100 80GB HBM3": {"flash_attention": {"bf16[T=4096,S=4096,N=16,K=16,H=128]causal":
                                                           {"params": {...}, "time_us": 812.5}}}}}

Autotuning times real compiled kernels, so it only means something on a GPU; run it from a script, e.g.::

  from pallas_kernels import flash_attention
  flash_attention.autotune(q, k, v, causal=True)   # times the candidates, writes the cache

This module knows nothing about any particular kernel beyond the table of starting points; no import-time side
effects, no environment variables.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "DEFAULT_CACHE_PATH",
    "autotune",
    "device_kind",
    "flash_attention_table",
    "load_cache",
    "lookup",
    "store",
    "time_us",
]

DEFAULT_CACHE_PATH = Path(__file__).with_name("tuned_configs.json")
_CACHE_VERSION = 1


def device_kind() -> str:
    """The default device's kind, e.g. "NVIDIA H100 80GB HBM3", or "cpu"."""
    device = jax.devices()[0]
    return "cpu" if device.platform == "cpu" else device.device_kind


# ---------------------------------------------------------------------------------------------------------------
# Built-in table
# ---------------------------------------------------------------------------------------------------------------
# Flash attention on GPU, keyed by head dim. Forward: a (block_q, H) query tile stays in registers while (block_k, H)
# K/V tiles stream through shared memory. Backward: the dK/dV kernel holds a (block_k_dkv, H) K/V tile and streams
# query tiles of block_q_dkv rows; the dQ kernel holds a (block_q_dq, H) query tile and streams K/V tiles of
# block_k_dq rows. Larger head dims need smaller tiles to fit registers and shared memory (228 KiB per SM on H100).
# Each entry compiles for sm_90 with Triton 3.6 with no or few (<= 20) register spill stores in the unmasked paths
# (checked with ptxas -v on the TTIR the kernels lower to); speed is for the autotuner to settle on the GPU.
_FLASH_ATTENTION_GPU = {
    32: dict(block_q=128, block_k=64, num_warps=4, num_stages=3,
             block_q_dkv=32, block_k_dkv=64, block_q_dq=128, block_k_dq=64, num_warps_bwd=4, num_stages_bwd=3),
    # H=64 and H=128 forward tiles: the H100 sweep's winners at every suite shape, causal and not, once exp2 was
    # PTX ex2.approx.ftz (attention-sweep-ftz-h100.txt: at B4 T=S=4096 N16 H128, 128x64 tiles with 4 warps and 2
    # stages 1150 vs 1166 µs for 128x128 / 8 warps / 3 stages, causal 640 vs 673 µs; H64 64x64 / 4 / 3 1282 vs
    # 1366 µs for 128x64). Backward tiles: the earlier sweep (attention-sweep-h100.txt: fwd+bwd 4670 vs 5306 µs
    # with the 32/128/128/32 tiles). Spill counts of these forward tiles were not checked.
    64: dict(block_q=64, block_k=64, num_warps=4, num_stages=3,
             block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64, num_warps_bwd=8, num_stages_bwd=3),
    # H=128: two query chains of 64 rows (one warpgroup's wgmma height) beat one 128-row chain at the main shape,
    # 1123 vs 1138 µs, causal 629 vs 637 (attention-sweep-chains-h100.txt); at the other suite shapes the cache
    # holds one-chain entries from before (not swept with chains).
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
    table = _FLASH_ATTENTION_GPU_F32 if jax.numpy.dtype(dtype).itemsize == 4 else _FLASH_ATTENTION_GPU
    return dict(table[head_dim])


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
    """The whole cache ({"version", "entries"}); an empty one if the file does not exist."""
    path = os.fspath(path)
    try:
        mtime_ns = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return {"version": _CACHE_VERSION, "entries": {}}
    return _read_cache(path, mtime_ns)


def lookup(op: str, key: str, *, device: str | None = None,
           path: str | os.PathLike = DEFAULT_CACHE_PATH) -> dict[str, Any] | None:
    """Cached parameters for (device kind, op, shape key), or None."""
    device = device_kind() if device is None else device
    entry = load_cache(path)["entries"].get(device, {}).get(op, {}).get(key)
    return None if entry is None else dict(entry["params"])


def store(op: str, key: str, params: Mapping[str, Any], *, time_us: float | None = None, device: str | None = None,
          path: str | os.PathLike = DEFAULT_CACHE_PATH) -> None:
    """Adds or replaces one entry, rewriting the file atomically with sorted keys (stable diffs when committed)."""
    device = device_kind() if device is None else device
    path = os.fspath(path)
    data = json.loads(json.dumps(load_cache(path)))  # deep copy: the lru-cached dict stays untouched
    entry: dict[str, Any] = {"params": dict(params)}
    if time_us is not None:
        entry["time_us"] = round(float(time_us), 2)
    data["entries"].setdefault(device, {}).setdefault(op, {})[key] = entry
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tuning-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Autotuner
# ---------------------------------------------------------------------------------------------------------------
def time_us(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 10) -> float:
    """Median wall time of ``fn()`` in microseconds, blocking on its result (fn should be jitted and compiled)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def autotune(op: str, key: str, candidates: Iterable[Mapping[str, Any]],
             make_fn: Callable[[Mapping[str, Any]], Callable[[], Any]], *, device: str | None = None,
             path: str | os.PathLike | None = DEFAULT_CACHE_PATH, warmup: int = 2, iters: int = 10,
             ) -> tuple[dict[str, Any], dict[str, float]]:
    """Times every candidate and stores the fastest in the cache (when ``path`` is not None).

    Args:
      candidates: parameter dicts to try.
      make_fn: builds a zero-argument callable running the kernel(s) with one candidate's parameters. A candidate
        whose build or first run raises (e.g. it needs more shared memory than the GPU has) is skipped.

    Returns:
      (best parameters, {candidate as a compact string: time in µs}) — failed candidates map to inf.
    """
    timings: dict[str, float] = {}
    best, best_time = None, float("inf")
    for params in candidates:
        label = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
        try:
            elapsed = time_us(make_fn(params), warmup=warmup, iters=iters)
        except Exception:  # noqa: BLE001 -- a candidate that does not compile is simply not a winner
            timings[label] = float("inf")
            continue
        timings[label] = elapsed
        if elapsed < best_time:
            best, best_time = dict(params), elapsed
    if best is None:
        raise RuntimeError(f"autotune({op!r}, {key!r}): every candidate failed")
    if path is not None:
        store(op, key, best, time_us=best_time, device=device, path=path)
    return best, timings
