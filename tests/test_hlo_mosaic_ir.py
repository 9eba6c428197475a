"""hlo_inspect.mosaic_ir: a Mosaic-GPU kernel's structure, read from its CUDA lowering on any machine (no GPU)."""

import jax
import jax.numpy as jnp
import pytest

from hlo_inspect import mosaic_ir
from pallas_kernels import mosaic_utils
from pallas_kernels.gemm import MosaicGemmConfig, matmul

S = jax.ShapeDtypeStruct


def _lower(config=None, dtype=jnp.bfloat16, M=1024, K=512, N=1024):
    return mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), S((M, K), dtype), S((K, N), dtype))


def test_gemm_kernel_launch_and_structure():
    (k,) = _lower(MosaicGemmConfig(tile_m=128, tile_n=128, tile_k=64, num_stages=4, wg_split="n"))
    assert k.name == "mosaic_matmul"
    assert k.grid == (mosaic_utils.H100_SMS, 1, 1)  # persistent: one block per SM
    assert k.threads == 384 and k.warpgroups == 3  # two compute warpgroups and the TMA producer
    assert 0 < k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    # a 128x128 accumulator per warpgroup, 64-wide K steps: 2 (M halves of 64) x 4 (k of 16) instructions
    assert k.wgmma() == {"m64n128k16 f32 += bf16 x bf16": 8}
    assert k.tma_loads() >= 2 and k.tma_stores() >= 1  # A and B tiles in, output pieces out
    assert k.tma_reduce_stores() == {} and "reduce-" not in k.summary()  # plain stores: nothing added into out
    assert k.barriers() >= 2 * 4  # ready and consumed barrier per stage
    assert "wgmma: 8× m64n128k16" in k.summary() and "3 warpgroups" in k.summary()


def test_wgmma_shape_follows_the_accumulator_tile_and_dtype():
    (k,) = _lower(MosaicGemmConfig(tile_m=64, tile_n=256, tile_k=64, num_stages=3, wg_split="m"), jnp.float16)
    assert k.wgmma() == {"m64n256k16 f32 += f16 x f16": 4}


def test_smem_of_a_bigger_pipeline_is_larger():
    (three,) = _lower(MosaicGemmConfig(num_stages=3))
    (four,) = _lower(MosaicGemmConfig(num_stages=4))
    stage_bytes = (128 + 256) * 64 * 2  # A (128, 64) and B (64, 256) tiles, bf16
    barrier_bytes = 2 * 8  # the stage's ready and consumed mbarriers
    assert four.smem_bytes - three.smem_bytes == stage_bytes + barrier_bytes


def test_shared_memory_overflow_raises_like_the_gpu():
    with pytest.raises(ValueError, match="shared memory"):
        _lower(MosaicGemmConfig(num_stages=6))  # 6 x 48 KiB of tiles > 227 KiB


def test_a_program_without_mosaic_kernels_is_an_error():
    with pytest.raises(ValueError, match="no Mosaic-GPU kernel"):
        mosaic_ir.lower_kernels(lambda x: x + 1, S((8,), jnp.float32))
