"""jaxfuse.measure: matching CUPTI kernel names to the report's kernels (the timing itself needs a GPU)."""

import os

import pytest

import hlo_inspect
from conftest import CPU_ONLY
from jaxfuse import measure

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_match_fusions_libraries_and_pallas():
    with open(os.path.join(DATA, "h100_pallas.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    # CUPTI names a Pallas kernel by its pallas_call name: the kernel function `kernel` of tests/data/capture.py.
    launches = [("loop_multiply_fusion", 3.0), ("memset32_kernel", 0.5), ("kernel", 5.0),
                ("input_reduce_fusion", 2.0)]
    assigned, unmatched = measure.match(rep.kernels, launches)
    assert assigned == {0: [0], 1: [2], 2: [3]} and unmatched == [1]


def test_library_calls_matched_in_launch_order():
    """Two cuBLAS calls running the same library kernel are told apart by their position."""
    with open(os.path.join(DATA, "h100_cudnn_attention.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    assigned, unmatched = measure.match(rep.kernels, [("cudnn_generated_fort_native_sdpa_sm90", 40.0)])
    assert assigned == {0: [0]} and unmatched == []
    with open(os.path.join(DATA, "h100_block_fwd.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    launches = [(k.name.replace(".", "_"), float(i)) for i, k in enumerate(rep.kernels)]
    assigned, unmatched = measure.match(rep.kernels, launches)
    assert assigned == {i: [i] for i in range(len(rep.kernels))} and unmatched == []
    # a program with two library GEMMs of the same kernel name, each followed by a fusion
    gemm = rep.kernels[2]
    gemm.category = "cublas"
    launches[2] = ("nvjet_sm90_tst_256x128", 7.0)
    assigned, _ = measure.match(rep.kernels, launches)
    assert assigned[2] == [2] and assigned[3] == [3]


def test_reused_kernel_launches_under_the_first_fusions_name():
    """Identical fusions share one compiled kernel: CUPTI names the later launch after the earlier fusion."""
    with open(os.path.join(DATA, "h100_block_fwd.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    launches = [(measure._device_name(k), float(i)) for i, k in enumerate(rep.kernels)]
    first = next(i for i, k in enumerate(rep.kernels) if k.category == "loop")
    later = next(i for i, k in enumerate(rep.kernels) if i > first + 1 and k.category == "loop")
    launches[later] = launches[first]
    assigned, unmatched = measure.match(rep.kernels, launches)
    assert assigned[later] == [later] and unmatched == []
    assert assigned == {i: [i] for i in range(len(rep.kernels))}


def test_second_site_of_a_pallas_kernel_launches_with_a_suffix():
    """Two pallas_calls of one kernel: CUPTI names the second NAME__1; it still matches its report kernel."""
    with open(os.path.join(DATA, "h100_pallas.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    loop, pallas, reduction = rep.kernels
    kernels = [loop, pallas, reduction, pallas]  # the same kernel at a second site
    launches = [("loop_multiply_fusion", 1.0), ("kernel", 2.0), ("input_reduce_fusion", 3.0), ("kernel__1", 4.0)]
    assigned, unmatched = measure.match(kernels, launches)
    assert assigned == {0: [0], 1: [1], 2: [2], 3: [3]} and unmatched == []


def test_collectives_match_nccl_kernels():
    """A collective launches as NCCL's kernel; its bandwidth is the bytes one device sends over its time."""
    with open(os.path.join(DATA, "cpu4_sharded_matmul.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    assert [k.category for k in rep.kernels] == ["cpu_fusion", "collective", "loop"]
    launches = [("ynn_fusion", 2.0), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 6.0), ("wrapped_tanh", 1.0)]
    assigned, unmatched = measure.match(rep.kernels, launches)
    assert assigned == {0: [0], 1: [1], 2: [2]} and unmatched == []
    row = measure.MeasuredKernel(rep.kernels[1], ("ncclDevKernel_AllReduce_Sum_f32_RING_LL",), 6.0, None)
    assert row.achieved_bytes_per_s == pytest.approx(3072 / 6e-6)  # 2·3/4 of f32[16,32] sent in 6 µs


@CPU_ONLY
def test_measure_needs_a_gpu():
    from jaxfuse import costmodel

    rep = hlo_inspect.inspect(lambda x: x + 1, 1.0)
    with pytest.raises(ValueError, match="needs a GPU"):
        measure.measure_kernels(rep, lambda x: x + 1, (1.0,), device=costmodel.device("h100"))


def test_a_mosaic_kernel_matches_its_launch():
    """Mosaic GPU launches kernel NAME (its named scope) as NAME_mosaic_gpu_kernel; a launch of another name still
    matches the next Mosaic launch. h200_mosaic_norm_matmul.hlo.txt: the rmsnorm_matmul forward (backend "mosaic")
    at 4096x1024x2048 on the H200, jax 0.11.2, and its launches as CUPTI named them there (tests/data/capture_mosaic.py
    at 05455a8)."""
    with open(os.path.join(DATA, "h200_mosaic_norm_matmul.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    assert [k.category for k in rep.kernels] == ["reduction", "loop", "mosaic"]
    launches = [("input_reduce_fusion", 2.7), ("loop_convert_fusion", 3.6),
                ("rmsnorm_matmul_fwd_mosaic_gpu_kernel", 25.1)]
    assert measure.match(rep.kernels, launches) == ({0: [0], 1: [1], 2: [2]}, [])
    launches[2] = ("mosaic_matmul_mosaic_gpu_kernel", 25.1)
    assert measure.match(rep.kernels, launches) == ({0: [0], 1: [1], 2: [2]}, [])
    launches[2] = ("memset32_kernel", 0.5)  # no Mosaic launch: left unattributed, not taken
    assert measure.match(rep.kernels, launches) == ({0: [0], 1: [1]}, [2])


def test_measured_table_names_the_device_and_leaves_rooflines_out_without_figures():
    """costmodel.detect() None (a GPU without figures): the table says so and has no roofline column values."""
    import jax

    with open(os.path.join(DATA, "h100_block_fwd.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    rows = [measure.MeasuredKernel(rep.kernels[0], ("loop_fusion",), 10.0, None)]
    summary = {"iterations": 5, "sum_of_kernels_us": 10.0, "program_device_us": 11.0, "sum_over_program": 10 / 11,
               "program_wall_us": 40.0, "matched": 1, "kernels": len(rep.kernels), "unattributed": 0, "spread": 0.01}
    text = measure.measured_table(rows, summary, None)
    assert text.splitlines()[0].startswith(f"measured on {jax.devices()[0].device_kind} (no roofline figures)")
    from jaxfuse import costmodel

    with_figures = [measure.MeasuredKernel(rep.kernels[0], ("loop_fusion",), 10.0, 5.0)]
    text = measure.measured_table(with_figures, summary, costmodel.device("h100"))
    assert text.splitlines()[0].startswith("measured on NVIDIA H100 80GB HBM3") and "0.50" in text
