"""The committed tuning cache (pallas_kernels/tuned_configs.json): every entry is a valid config of its kernel,
so a renamed or removed config field cannot silently break the GPU defaults that CPU tests never load."""

import pytest

from pallas_kernels import tuning
from pallas_kernels.cross_entropy import LinearCrossEntropyConfig
from pallas_kernels.flash_attention import FlashAttentionConfig
from pallas_kernels.rmsnorm_matmul import RMSNormMatmulConfig

_CONFIG_OF_OP = {
    "flash_attention": FlashAttentionConfig,
    "rmsnorm_matmul": RMSNormMatmulConfig,
    "linear_cross_entropy": LinearCrossEntropyConfig,
}
_ENTRIES = [(device, op, key, entry)
            for device, ops in tuning.load_cache()["entries"].items()
            for op, entries in ops.items()
            for key, entry in entries.items()]


def test_cache_has_entries_for_every_kernel():
    assert {op for _, op, _, _ in _ENTRIES} == set(_CONFIG_OF_OP)


@pytest.mark.parametrize("device,op,key,entry", _ENTRIES, ids=[f"{op}:{key}" for _, op, key, _ in _ENTRIES])
def test_entry_is_a_valid_config(device, op, key, entry):
    assert op in _CONFIG_OF_OP, f"{device}: unknown op {op!r}"
    _CONFIG_OF_OP[op](**entry["params"])  # TypeError on unknown fields, ValueError on bad values
    assert entry.get("time_us", 1.0) > 0
