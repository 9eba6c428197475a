"""The committed tuning cache (pallas_kernels/tuned_configs.json): every entry is a valid config of its op's backend,
so a renamed or removed config field cannot silently break the GPU defaults that CPU tests never load."""

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
    bf16 for tile_k 64), whichever way B is read."""
    import jax.numpy as jnp

    from pallas_kernels.gemm import MosaicGemmConfig
    from pallas_kernels.gemm.config import operand_swizzle_elems

    config = MosaicGemmConfig(**fields)
    before = min(64, config.tile_k & -config.tile_k)  # the largest swizzle (<= 128 bytes) tile_k's rows fill
    for transpose_b in (False, True):
        assert operand_swizzle_elems(config, jnp.bfloat16, transpose_b) == before
