"""hlo_inspect on layouts with tiles and memory spaces: a TPU program's VMEM prefetch and padded tiles, a GPU
program's host offloading. Byte counts are worked out by hand from XLA's tiled-layout rule."""

import json

import pytest

import hlo_inspect
from hlo_inspect import fuzz
from hlo_inspect.scanning import HloParseError
from hlo_inspect.shapes import HOST_MEMORY_SPACE, hbm_resident, parse_shape

# A TPU MLP as XLA prints it: w_up prefetched into VMEM (S(1)) across programs, the hidden layer written to VMEM
# and read from there, the input (2 rows) in the small 2x128 tiles, bf16 packed in (2,1) sub-tiles.
TPU_MLP = """HloModule jit_mlp, is_scheduled=true, entry_computation_layout={(bf16[2,1000]{1,0:T(2,128)(2,1)}, bf16[1000,512]{1,0:T(8,128)(2,1)}, bf16[512,256]{1,0:T(8,128)(2,1)})->bf16[2,256]{1,0:T(2,128)(2,1)}}

%fused_up (param_0: bf16[2,1000], param_1: bf16[1000,512]) -> bf16[2,512] {
  %param_0 = bf16[2,1000]{1,0:T(2,128)(2,1)} parameter(0)
  %param_1 = bf16[1000,512]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  %convolution.1 = f32[2,512]{1,0:T(2,128)} convolution(%param_0, %param_1), dim_labels=bf_io->bf, metadata={op_name="jit(mlp)/up/dot_general" source_file="/tmp/m.py" source_line=5}
  %tanh.1 = f32[2,512]{1,0:T(2,128)} tanh(%convolution.1), metadata={op_name="jit(mlp)/up/tanh" source_file="/tmp/m.py" source_line=6}
  ROOT %convert.1 = bf16[2,512]{1,0:T(2,128)(2,1)S(1)} convert(%tanh.1)
}

%fused_down (param_0.1: bf16[2,512], param_1.1: bf16[512,256]) -> bf16[2,256] {
  %param_0.1 = bf16[2,512]{1,0:T(2,128)(2,1)S(1)} parameter(0)
  %param_1.1 = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(1)
  %convolution.2 = f32[2,256]{1,0:T(2,128)} convolution(%param_0.1, %param_1.1), dim_labels=bf_io->bf, metadata={op_name="jit(mlp)/down/dot_general" source_file="/tmp/m.py" source_line=7}
  ROOT %convert.2 = bf16[2,256]{1,0:T(2,128)(2,1)} convert(%convolution.2)
}

ENTRY %main.12 (Arg_0.1: bf16[2,1000], Arg_1.2: bf16[1000,512], Arg_2.3: bf16[512,256]) -> bf16[2,256] {
  %Arg_0.1 = bf16[2,1000]{1,0:T(2,128)(2,1)} parameter(0)
  %Arg_1.2 = bf16[1000,512]{1,0:T(8,128)(2,1)} parameter(1)
  %Arg_2.3 = bf16[512,256]{1,0:T(8,128)(2,1)} parameter(2)
  %copy-start = (bf16[1000,512]{1,0:T(8,128)(2,1)S(1)}, bf16[1000,512]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%Arg_1.2), cross_program_prefetch_index=0
  %copy-done = bf16[1000,512]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %fusion.1 = bf16[2,512]{1,0:T(2,128)(2,1)S(1)} fusion(%Arg_0.1, %copy-done), kind=kOutput, calls=%fused_up
  ROOT %fusion.2 = bf16[2,256]{1,0:T(2,128)(2,1)} fusion(%fusion.1, %Arg_2.3), kind=kOutput, calls=%fused_down
}
"""

# A GPU program that offloads an activation to host memory (S(5)) and brings it back; the all-reduce's buffer in
# the collective memory space (S(1) on GPUs: still device memory).
GPU_OFFLOAD = """HloModule jit_offload, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_exp (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  ROOT %e = f32[1024,1024]{1,0} exponential(%p), metadata={op_name="jit(f)/layer/exp"}
}

%fused_mul (p0: f32[1024,1024], p1: f32[1024,1024]) -> f32[1024,1024] {
  %p0 = f32[1024,1024]{1,0} parameter(0)
  %p1 = f32[1024,1024]{1,0} parameter(1)
  ROOT %m = f32[1024,1024]{1,0} multiply(%p0, %p1), metadata={op_name="jit(f)/layer/mul"}
}

ENTRY %main (x: f32[1024,1024], g: f32[1024]) -> (f32[1024,1024], f32[1024]) {
  %x = f32[1024,1024]{1,0} parameter(0)
  %g = f32[1024]{0} parameter(1)
  %fusion = f32[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp
  %copy-start = (f32[1024,1024]{1,0:S(5)}, f32[1024,1024]{1,0}, u32[]) copy-start(%fusion)
  %copy-done = f32[1024,1024]{1,0:S(5)} copy-done(%copy-start)
  %all-reduce = f32[1024]{0:S(1)} all-reduce(%g), replica_groups={{0,1}}, to_apply=%add
  %copy-start.1 = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0:S(5)}, u32[]) copy-start(%copy-done)
  %copy-done.1 = f32[1024,1024]{1,0} copy-done(%copy-start.1)
  %fusion.1 = f32[1024,1024]{1,0} fusion(%copy-done.1, %fusion), kind=kLoop, calls=%fused_mul
  ROOT %out = (f32[1024,1024]{1,0}, f32[1024]{0:S(1)}) tuple(%fusion.1, %all-reduce)
}
"""


@pytest.mark.parametrize("text, tiles, space, nbytes", [
    ("f32[3,5]{1,0:T(2,2)}", ((2, 2),), 0, 4 * 2 * 3 * 2 * 2),  # XLA's figure 1: 2x3 tiles of 2x2
    ("f32[3,5]{0,1:T(2,2)}", ((2, 2),), 0, 4 * 3 * 2 * 2 * 2),  # minor dimension 3 first: 3x2 tiles
    ("bf16[2,1000]{1,0:T(4,128)(2,1)S(1)}", ((4, 128), (2, 1)), 1, 2 * 4 * 1024),  # rows to 4, columns to 1024
    ("bf16[4,8]{1,0:T(2,4)(2,1)}", ((2, 4), (2, 1)), 0, 2 * 4 * 8),  # the (2,1) sub-tiles pad nothing here
    ("f32[2,7,8,11,10]{4,3,2,1,0:T(*,*,2,*,3)}", ((-1, -1, 2, -1, 3),), 0, 4 * 56 * 37 * 2 * 3),  # 112x110 by 2x3
    ("f32[5]{0:T(8,128)}", ((8, 128),), 0, 4 * 8 * 128),  # a tile with more dims than the array: leading 1s
    ("u32[]{:S(2)}", (), 2, 4),
    ("f32[64,512]{1,0}", (), 0, 4 * 64 * 512),
    ("bf16[8,128]{1,0:T(8,128)(2,1)SC(0:1)}", ((8, 128), (2, 1)), 0, 2 * 8 * 128),  # SC(...) is no memory space
    ("f32[6,7]{1,0:T(0,128)}", ((0, 128),), 0, 4 * 42),  # no tile XLA prints: the plain count
])
def test_tiles_pad_and_memory_space_is_read(text, tiles, space, nbytes):
    shape = parse_shape(text)
    assert (shape.tiles, shape.memory_space, shape.size_bytes) == (tiles, space, nbytes)
    assert str(shape) == text  # printed back as written


def test_hbm_residency_by_backend():
    """S(1) is VMEM on a TPU (tiled layouts), device memory set aside for collectives on a GPU; S(5) is host
    memory on both."""
    vmem_or_collective, host = parse_shape("f32[8]{0:S(1)}"), parse_shape(f"f32[8]{{0:S({HOST_MEMORY_SPACE})}}")
    assert not hbm_resident(vmem_or_collective, tiled_program=True)
    assert hbm_resident(vmem_or_collective, tiled_program=False)
    assert not hbm_resident(host, tiled_program=True) and not hbm_resident(host, tiled_program=False)
    assert hbm_resident(parse_shape("f32[8]{0}"), True) and hbm_resident(parse_shape("f32[8]{0}"), False)


def test_tpu_prefetch_into_vmem_reads_hbm_once():
    """The weight crosses HBM once, in the prefetch; the fusion reads it from VMEM; the hidden layer lives in VMEM
    and makes no HBM round trip; padded tiles count what the buffers hold."""
    rep = hlo_inspect.from_text(TPU_MLP)
    kernels = {k.name: k for k in rep.kernels}
    assert list(kernels) == ["copy-start", "fusion.1", "fusion.2"]
    prefetch, up, down = kernels["copy-start"], kernels["fusion.1"], kernels["fusion.2"]
    w_up = 2 * 1000 * 512  # 1000 rows are 125 tiles of 8; 512 columns 4 of 128: no padding
    assert (prefetch.category, prefetch.bytes_read, prefetch.bytes_written) == ("copy", w_up, 0)
    x_padded = 2 * 2 * 1024  # 2 rows of 1000 columns, padded to 8 tiles of 2x128
    assert (up.bytes_read, up.bytes_written) == (x_padded, 0)  # w_up from VMEM, the hidden layer to VMEM
    assert (down.bytes_read, down.bytes_written) == (2 * 512 * 256, 2 * 2 * 256)
    assert rep.totals.bytes_read == w_up + x_padded + 2 * 512 * 256
    assert rep.ledger.round_trips == []  # fusion.1 -> fusion.2 stays in VMEM
    assert any("outside HBM" in w and "2 in S(1) (VMEM)" in w and "padding" in w for w in rep.warnings), \
        rep.warnings
    data = json.loads(rep.to_json())
    assert [k["bytes_read"] for k in data["kernels"]] == [w_up, x_padded, 2 * 512 * 256]


def test_gpu_host_offload_is_a_host_transfer_without_hbm_bytes_on_the_host_side():
    rep = hlo_inspect.from_text(GPU_OFFLOAD)
    kernels = {k.name: k for k in rep.kernels}
    size = 4 * 1024 * 1024
    to_host, to_device = kernels["copy-start"], kernels["copy-start.1"]
    assert (to_host.category, to_host.bytes_read, to_host.bytes_written) == ("host", size, 0)
    assert (to_device.category, to_device.bytes_read, to_device.bytes_written) == ("host", 0, size)
    assert kernels["all-reduce"].bytes_written == 4 * 1024  # S(1) on a GPU: collective buffers, still HBM
    trips = {t.name: t for t in rep.ledger.round_trips}
    assert set(trips) == {"fusion", "copy-done.1"}  # the copy in host memory (copy-done) is no HBM round trip
    assert [c.name for c in trips["fusion"].consumers] == ["copy-start", "fusion.1"]
    assert any("1 in S(5) (host memory)" in w for w in rep.warnings), rep.warnings
    assert not any("padding" in w for w in rep.warnings)


def test_untiled_programs_keep_their_bytes():
    """No tiles and no memory space: nothing changes (the CPU and GPU captures' exact counts are in
    test_hlo_captured)."""
    rep = hlo_inspect.from_text(GPU_OFFLOAD.replace(":S(5)", "").replace(":S(1)", ""))
    kernels = {k.name: k for k in rep.kernels}
    assert kernels["copy-start"].category == "copy"  # a device-to-device asynchronous copy
    assert (kernels["copy-start"].bytes_read, kernels["copy-start"].bytes_written) == (4 << 20, 4 << 20)
    assert not any("outside HBM" in w for w in rep.warnings)


def test_padding_past_int64_is_a_parse_error():
    with pytest.raises(HloParseError, match="tiles' padding"):
        parse_shape("f32[3,5]{1,0:T(4611686018427387904,2)}")


def test_mutated_tiled_and_offloaded_programs_end_in_a_report_or_a_parse_error():
    """The fuzzer's mutations (numbers in tiles and memory spaces among them) on these two programs."""
    seeds = [fuzz.Seed.of("tpu_mlp", TPU_MLP), fuzz.Seed.of("gpu_offload", GPU_OFFLOAD)]
    result = fuzz.fuzz(seeds, 300, seed=0, limit_s=20.0, slow_s=2.0)
    assert set(result["outcomes"]) <= {fuzz.OK, fuzz.PARSE_ERROR}, (result["outcomes"], result["failures"])
    assert result["over_slow_s"] == 0, result["slowest"]
    assert result["outcomes"].get(fuzz.OK, 0) >= 60, result["outcomes"]
