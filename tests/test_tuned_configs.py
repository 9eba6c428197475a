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
