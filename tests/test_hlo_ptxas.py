"""hlo_inspect.ptxas: ptxas's log parsed on any machine (a log as the H100 printed it); compiling for it needs an
sm90 GPU (the GPU side runs in test_norm_matmul_mosaic.py, on the fused kernels it is for)."""

import jax
import jax.numpy as jnp
import pytest

from hlo_inspect import ptxas

# As ptxas printed it on the H100 (jax 0.11.2) for the rmsnorm_matmul forward with gamma in the registers and its
# output stored under the next tile (mosaic_ptxas_registers-h100-003728a.json), then a second kernel with spills.
_LOG = """\
ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions defining input registers of a wgmma between start and end of the pipeline stage in the function \
'rmsnorm_matmul_fwd_mosaic_gpu_kernel'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'rmsnorm_matmul_fwd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for rmsnorm_matmul_fwd_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas info    : Compile time = 381.407 ms
ptxas info    : (C7519) warpgroup.arrive is injected in around line 560 by compiler to allow use of registers in \
GMMA in function 'mosaic_matmul_mosaic_gpu_kernel'
ptxas info    : Compiling entry function 'mosaic_matmul_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for mosaic_matmul_mosaic_gpu_kernel
    48 bytes stack frame, 40 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 1 bytes smem
"""


def test_each_kernel_gets_its_registers_spills_and_warnings():
    fwd, core = ptxas.parse(_LOG)
    assert (fwd.name, fwd.registers, fwd.barriers, fwd.spills) == ("rmsnorm_matmul_fwd_mosaic_gpu_kernel", 168, 16,
                                                                    False)
    assert fwd.serialized_wgmma and fwd.warnings[0][0] == "C7513"
    assert (core.stack_frame_bytes, core.spill_store_bytes, core.spill_load_bytes) == (48, 40, 44) and core.spills
    assert not core.serialized_wgmma and [code for code, _ in core.warnings] == ["C7519"]


def test_a_log_without_kernels_is_empty_and_a_truncated_one_an_error():
    assert ptxas.parse("ptxas info    : 0 bytes gmem\n") == []
    with pytest.raises(ValueError, match=r"ptxas log: no register or stack-frame line for kernel 'k'"):
        ptxas.parse("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the error of a machine without an sm90 GPU")
def test_compiling_needs_an_sm90_gpu():
    with pytest.raises(ValueError, match=r"compile_report: ptxas runs when Mosaic-GPU kernels compile for an sm90 GPU; "
                                         r"this machine's first device is 'cpu' \(cpu\)"):
        ptxas.compile_report(lambda x: x + 1, jnp.zeros(4))
