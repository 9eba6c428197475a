"""pallas_kernels.gemm.resident: c += aᵀ @ b with aᵀ's row block resident in shared memory. Errors and the lowered
structure on any machine; numbers against the float32 update on an sm90 GPU (a chunk loop updating c in place)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import GPU_TIMEOUT
from hlo_inspect import mosaic_ir
from pallas_kernels import mosaic_utils
from pallas_kernels.gemm.resident import ResidentConfig, accumulate_resident, resident_reason, smem_bytes

ON_SM90 = mosaic_utils.is_hopper()
cpu_only = pytest.mark.skipif(jax.default_backend() == "gpu", reason="structure checks")
S = jax.ShapeDtypeStruct
_KEYS = itertools.count(9100)


def gpu_only(test):
    """Runs on an sm90 GPU only, within GPU_TIMEOUT."""
    return pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU")(GPU_TIMEOUT(test))


def _key():
    return jax.random.key(next(_KEYS))


@cpu_only
@pytest.mark.parametrize("config", [ResidentConfig(), ResidentConfig(tile_k=64, num_stages=2, delay_release=0)])
def test_lowers_to_one_kernel_within_shared_memory_updating_c_in_place(config):
    """At the 4096x2048x256000 loss's update (K = 512 tokens): one kernel whose wgmma per step are (tile_m / 64) ·
    (tile_k / 16) m64n128k16, whose shared memory is the resident block, two c tiles and the ring (fits 227 KiB),
    with c aliased in and out."""
    args = S((512, 2048), jnp.bfloat16), S((512, 256000), jnp.bfloat16), S((2048, 256000), jnp.bfloat16)
    fn = lambda a_t, b, c: accumulate_resident(a_t, b, c, config=config)  # noqa: E731
    (k,) = mosaic_ir.lower_kernels(fn, *args)
    assert k.wgmma() == {"m64n128k16 f32 += bf16 x bf16": 2 * config.tile_k // 16}
    assert smem_bytes(512, jnp.bfloat16, config) <= k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    program = jax.jit(fn, donate_argnums=2).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "output_operand_alias<output_tuple_indices = [], operand_index = 2" in program


@cpu_only
def test_bad_arguments_name_what_was_seen():
    a_t, b, c = (jnp.zeros(s, jnp.bfloat16) for s in ((1024, 256), (1024, 512), (256, 512)))
    with pytest.raises(ValueError, match=r"K=1024: the resident \(128, K\) block, .* need 360448 bytes"):
        accumulate_resident(a_t, b, c)
    with pytest.raises(ValueError, match=r"N=500 is not a positive multiple of the tile 128"):
        accumulate_resident(a_t[:512], b[:512, :500], c[:, :500])
    with pytest.raises(ValueError, match=r"b: dtype float16 must equal a_t's bfloat16"):
        accumulate_resident(a_t[:512], b[:512].astype(jnp.float16), c)
    with pytest.raises(ValueError, match=r"shapes: a_t \(K, M\) = \(512, 256\), b \(K, N\) = \(256, 512\)"):
        accumulate_resident(a_t[:512], b[:256], c)
    with pytest.raises(ValueError, match=r"ResidentConfig.tile_k: must be 32 or 64, got 16"):
        ResidentConfig(tile_k=16)
    assert resident_reason(2048, 256000, 512, jnp.float32) == "dtype float32 is not 16-bit (bfloat16 or float16)"


@gpu_only
@pytest.mark.parametrize("M, N, K, dtype, config", [
    (2048, 25600, 512, jnp.bfloat16, ResidentConfig()),  # 16 row blocks, 8 groups of 25 column tiles
    (384, 640, 96, jnp.bfloat16, ResidentConfig()),  # 3 row blocks, 5 groups of one tile: warpgroup 1 idle
    (256, 3200, 64, jnp.float16, ResidentConfig(num_stages=3)),  # 2 steps a tile, fewer than the stages
    (1152, 13056, 384, jnp.bfloat16, ResidentConfig(tile_k=64, num_stages=2, delay_release=0)),  # 102 tiles / 14
])
def test_chunk_updates_match_the_float32_sum(M, N, K, dtype, config):
    """Three chunk updates c += a_iᵀ b_i in a loop, in place, against the float32 sum rounded once per update;
    b of dlogits' size (1e-3), c of a parameter gradient's, a few token rows of a_t 64 times larger or smaller."""
    chunks = 3
    a = jax.random.normal(_key(), (chunks * K, M), jnp.float32)
    a = a.at[::97].multiply(64.0).at[5::89].multiply(1 / 64).astype(dtype)
    b = (jax.random.normal(_key(), (chunks * K, N), jnp.float32) * 1e-3).astype(dtype)
    c0 = jax.random.normal(_key(), (M, N), jnp.float32).astype(dtype)

    @jax.jit
    def run(a, b, c):
        def step(i, c):
            rows = lambda x: jax.lax.dynamic_slice_in_dim(x, i * K, K)  # noqa: E731
            return accumulate_resident(rows(a), rows(b), c, config=config)
        return jax.lax.fori_loop(0, chunks, step, c)

    got = np.asarray(run(a, b, c0), np.float64)
    want = np.asarray(c0, np.float64) + np.asarray(a, np.float64).T @ np.asarray(b, np.float64)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    tol = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype] * max(1.0, math.sqrt(chunks * K / 1024)) * chunks ** 0.5
    assert np.all(np.isfinite(got)) and err <= tol, (err, tol)
