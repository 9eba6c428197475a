"""jaxfuse.measure: matching CUPTI kernel names to the report's kernels (the timing itself needs a GPU)."""

import os

import pytest

import hlo_inspect
from jaxfuse import measure

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_match_fusions_libraries_and_pallas():
    with open(os.path.join(DATA, "h100_pallas.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    pallas = next(k for k in rep.kernels if k.category == "pallas")
    pallas_name = measure._device_name(pallas)
    times = {"loop_multiply_fusion": 3.0, pallas_name: 5.0, "input_reduce_fusion": 2.0, "memset32_kernel": 0.5}
    assigned, unmatched = measure.match(rep.kernels, times)
    assert {rep.kernels[i].name: names for i, names in assigned.items()} == {
        "loop_multiply_fusion": ["loop_multiply_fusion"], pallas.name: [pallas_name],
        "input_reduce_fusion": ["input_reduce_fusion"]}
    assert unmatched == ["memset32_kernel"]


def test_match_cudnn_by_library_prefix_and_dotted_names():
    with open(os.path.join(DATA, "h100_block_fwd.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    times = {k.name.replace(".", "_"): 1.0 for k in rep.kernels}
    assigned, unmatched = measure.match(rep.kernels, times)
    assert len(assigned) == len(rep.kernels) and unmatched == []
    with open(os.path.join(DATA, "h100_cudnn_attention.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    assigned, unmatched = measure.match(rep.kernels, {"cudnn_generated_fort_native_sdpa_sm90": 40.0})
    assert assigned == {0: ["cudnn_generated_fort_native_sdpa_sm90"]} and unmatched == []


def test_measure_needs_a_gpu():
    from jaxfuse import costmodel

    rep = hlo_inspect.inspect(lambda x: x + 1, 1.0)
    with pytest.raises(ValueError, match="needs a GPU"):
        measure.measure_kernels(rep, lambda x: x + 1, (1.0,), device=costmodel.device("h100"))
