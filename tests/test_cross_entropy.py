"""linear_cross_entropy: the shared tests (``base_cross_entropy``) for each backend, and the Triton backend's own: its
vocabulary chunks and splits, the peeled last backward step, config validation, the GPU defaults' shared memory."""

import jax.numpy as jnp
import pytest

from base_cross_entropy import SMALL, CrossEntropyTests, inputs
from conftest import ON_GPU
from pallas_kernels import LinearCrossEntropyConfig, cross_entropy
from pallas_kernels.cross_entropy import config as ce_config


class TestTriton(CrossEntropyTests):
    backend = "triton"
    chunked_block_sizes = {"chunk_v": 4096} if ON_GPU else {"chunk_v": 64}


_TRITON = TestTriton()


def test_several_backward_chunks_and_splits():
    """Explicit small chunk_v / num_splits (the defaults on GPU give one chunk at test sizes)."""
    B, H, V = SMALL
    sizes = {"chunk_v": 64, "num_splits": 3} if not ON_GPU else {"chunk_v": 1024, "num_splits": 5}
    _TRITON.check_against_reference(B, H, V, jnp.bfloat16, block_sizes=sizes, logit_soft_cap=3.0)


@pytest.mark.parametrize("V,chunk_v", [(256, 64), (257, 64), (200, 256)],
                         ids=["steps_divide_V", "last_step_shares_columns", "one_step"])
def test_backward_counts_each_vocabulary_column_once(V, chunk_v):
    """The backward's steps and its peeled last step: V a multiple of the chunk (nothing shared), a last step that
    starts at V - chunk_v and shares columns with the step before (they must enter dh once), a single step."""
    _TRITON.check_against_reference(37, 16, V, jnp.float32, block_sizes={"chunk_v": chunk_v})


def test_bad_block_sizes_and_mosaic():
    h, w, labels = inputs(4, 16, 40, jnp.float32, ignored_rows=())
    with pytest.raises(ValueError, match=r"block_sizes: unknown fields \['block_q'\]"):
        cross_entropy.linear_cross_entropy(h, w, labels, block_sizes={"block_q": 16})
    with pytest.raises(ValueError, match=r"backend='mosaic' is not implemented for linear_cross_entropy"):
        cross_entropy.linear_cross_entropy(h, w, labels, backend="mosaic")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_v"):
        LinearCrossEntropyConfig(block_v=96)
    with pytest.raises(ValueError, match="block_h"):
        LinearCrossEntropyConfig(block_h=8)
    with pytest.raises(ValueError, match="chunk_v"):
        LinearCrossEntropyConfig(chunk_v=0)
    with pytest.raises(ValueError, match="num_warps"):
        LinearCrossEntropyConfig(num_warps=3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_gpu_defaults_fit_shared_memory(dtype):
    """The GPU default tiles' software pipeline fits the H100's 227 KiB of shared memory per block: Triton asks
    for (block_b·block_h + block_h·block_v)·itemsize·stages (on the H100 the float32 inputs at block_v 256 asked
    for exactly (128·64 + 64·256)·4·3 = 294912 bytes and failed)."""
    h, w = jnp.zeros((300, 256), dtype), jnp.zeros((256, 5003), dtype)
    cfg = ce_config.default_config(h, w, on_gpu=True)
    item = jnp.dtype(dtype).itemsize
    fwd = (cfg.block_b * cfg.block_h + cfg.block_h * cfg.block_v) * item * cfg.num_stages
    bwd = (cfg.block_b_bwd * cfg.block_h_bwd + cfg.block_h_bwd * cfg.block_v_bwd) * item * cfg.num_stages_bwd
    assert max(fwd, bwd) <= 232448, (fwd, bwd)


def test_sweep_candidates_are_valid_and_split_by_kernel():
    h, w = jnp.zeros((8192, 64), jnp.bfloat16), jnp.zeros((64, 1000), jnp.bfloat16)
    forward, backward = ce_config.sweep_candidates(h, w)
    base = forward[0]
    assert backward[0] == base and len(forward) > 3 and len(backward) > 3
    for c in forward:
        LinearCrossEntropyConfig(**c)
        assert all(c[f] == base[f] for f in c if f not in ce_config.FORWARD_FIELDS)
    for c in backward:
        LinearCrossEntropyConfig(**c)
        assert all(c[f] == base[f] for f in ce_config.FORWARD_FIELDS)
