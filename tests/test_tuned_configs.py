"""The committed tuning cache (pallas_kernels/tuned_configs.json): every entry is a valid config of its op's backend,
so a renamed or removed config field cannot silently break the GPU defaults that CPU tests never load."""

import re

import pytest

from pallas_kernels import BACKENDS, tuning

_ENTRIES = [(device, backend, op, key, entry)
            for device, backends in tuning.load_cache()["entries"].items()
            for backend, ops in backends.items()
            for op, entries in ops.items()
            for key, entry in entries.items()]


def test_cache_has_entries_for_every_kernel():
    assert {op for _, _, op, _, _ in _ENTRIES} == set(BACKENDS)


@pytest.mark.parametrize("device,backend,op,key,entry", _ENTRIES,
                         ids=[f"{backend}:{op}:{key}" for _, backend, op, key, _ in _ENTRIES])
def test_entry_is_a_valid_config(device, backend, op, key, entry):
    assert op in BACKENDS, f"{device}: unknown op {op!r}"
    assert backend in BACKENDS[op].names, f"{device}: {op} has no backend {backend!r}"
    BACKENDS[op].module(backend).Config(**entry["params"])  # TypeError on unknown fields, ValueError on bad values
    assert entry.get("time_us", 1.0) > 0


def _gemm_configs(params):
    """Every Mosaic GEMM config (a dict with tile_k and tile_n) inside an entry's params."""
    if isinstance(params, dict):
        if "tile_k" in params and "tile_n" in params:
            yield params
            return
        for value in params.values():
            yield from _gemm_configs(value)


_GEMMS = [(f"{backend}:{op}:{key}:{i}", fields) for _, backend, op, key, entry in _ENTRIES
          for i, fields in enumerate(_gemm_configs(entry["params"]))]


def test_the_cache_holds_mosaic_gemm_configs():
    assert len(_GEMMS) >= 30  # the Mosaic entries' forward, dx and dw GEMMs, the loss's and attention's


@pytest.mark.parametrize("fields", [f for _, f in _GEMMS], ids=[name for name, _ in _GEMMS])
def test_tuned_gemms_keep_the_swizzle_of_their_tile_k(fields):
    """The stage tiles' swizzle comes from tile_k and tile_n together since the core took partial columns
    (``gemm.config.operand_swizzle_elems``); every tuned GEMM must keep the one tile_k alone gave it (128 bytes of
    bf16 for tile_k 64), whichever way B is read (B as stored only where tile_n's rows can hold that swizzle: the
    one-row GEMV's 16-wide tiles, ``norm_matmul.mosaic_gemv``, read B transposed)."""
    import jax.numpy as jnp

    from pallas_kernels.gemm import MosaicGemmConfig
    from pallas_kernels.gemm.config import operand_swizzle_elems

    config = MosaicGemmConfig(**fields)
    before = min(64, config.tile_k & -config.tile_k)  # the largest swizzle (<= 128 bytes) tile_k's rows fill
    for transpose_b in (False, True) if config.tile_n >= before else (True,):
        assert operand_swizzle_elems(config, jnp.bfloat16, transpose_b) == before


_A_OPERAND_STORED_LATER = [
    (f"{device}:{key}", key, entry) for device, backend, op, key, entry in _ENTRIES
    if (backend, op) == ("mosaic", "rmsnorm_matmul") and entry["params"].get("gamma_on") == "a"
    and entry["params"]["forward"].get("epilogue_store", "end") != "end"]


def test_the_h200_suite_entries_store_later_beside_gammas_registers():
    assert sum(name.startswith("NVIDIA H200:") for name, _, _ in _A_OPERAND_STORED_LATER) >= 3


@pytest.mark.parametrize("name,key,entry", _A_OPERAND_STORED_LATER, ids=[n for n, _, _ in _A_OPERAND_STORED_LATER])
def test_a_forward_storing_later_beside_gammas_registers_has_a_stream_k_phase(name, key, entry):
    """ptxas serializes the wgmma of a forward that keeps gamma in the registers (the a_operand) and stores its
    output, or its right half, under the next tile's first wgmma, unless the kernel has a stream-K phase (15-16%
    slower; NOTES.md, thirty-seventh session): every tuned entry of that form must plan one at its shape (132 SMs,
    the H100's and the H200's)."""
    import re

    from pallas_kernels.gemm import MosaicGemmConfig, stream_k

    M, K, N = map(int, re.fullmatch(r"\w+\[M=(\d+),K=(\d+),N=(\d+)\]", key).groups())
    forward = MosaicGemmConfig(**entry["params"]["forward"])
    assert forward.stream_k, f"{name}: stream_k=0"
    tiles = M // forward.cta_m * (N // forward.cta_n)
    assert stream_k.plan_for(tiles, 132, K // forward.tile_k, forward.stream_k) is not None, (
        f"{name}: {tiles} tiles on 132 blocks leave no stream-K phase with stream_k={forward.stream_k}")


_DEVICES = sorted(tuning.load_cache()["entries"])


@pytest.mark.parametrize("device", _DEVICES)
def test_every_op_plans_any_size_on_a_tuned_device(monkeypatch, device):
    """A device with entries changes the configs ``plan()`` resolves (rules around the entries, per-device tables),
    which CPU tests otherwise reach only where they mock it: on each such device, every op's plan for CUDA at sizes
    from one row up is a plan or a ValueError naming the argument, never another exception from inside the rules
    (2-127 rows raised the stream-K planner's ValueError on the H200 for every backend until 1338ab9)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import attention, backends, cross_entropy, norm_matmul

    monkeypatch.setattr(tuning, "device_kind", lambda: device)
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    calls = []
    for M in (1, 2, 16, 100, 128, 1000, 4096):
        for K, N in [(64, 64), (96, 200), (1024, 4096), (4096, 14336)]:
            calls.append((norm_matmul.plan, (S((M, K), bf16), S((K,), jnp.float32), S((K, N), bf16)), {}))
        for H, V in [(64, 100), (1024, 32000), (4096, 128256)]:
            calls.append((cross_entropy.plan, (S((M, H), bf16), S((H, V), bf16), S((M,), jnp.int32)), {}))
    for T, S_ in [(1, 1), (7, 64), (128, 128), (1000, 4096), (4096, 4096)]:
        q, kv = S((2, T, 4, 128), bf16), S((2, S_, 4, 128), bf16)
        calls.append((attention.plan, (q, kv, kv), dict(causal=T == S_)))
    with backends.lowering_for_gpu():
        for plan, args, kwargs in calls:
            for backend in ("auto", "triton", "mosaic"):
                try:
                    assert plan(*args, backend=backend, **kwargs).backend in ("triton", "mosaic")
                except ValueError as e:  # a refusal names what it refuses: the call's argument or its backend
                    assert re.match(r"(x|w|h|q, k): |backend='\w+' ", str(e)), (plan.__module__, args, backend, str(e))
