"""hlo_inspect.triton_ir: the Triton IR of our Pallas kernels, lowered for CUDA on the CPU, says what the kernels
promise: scores only as (block_q, block_k) tiles, masks only where a tail needs them, no (B, V) tensor."""

import re

import jax
import jax.numpy as jnp
import pytest

from hlo_inspect import triton_ir
from pallas_kernels import flash_attention, linear_cross_entropy

_TILES = {"block_q": 32, "block_k": 16}


def triton_attention(q, k, v, **options):
    """flash_attention on the Triton backend ("auto" lowers to Mosaic kernels for CUDA where they run)."""
    return flash_attention(q, k, v, backend="triton", **options)


def _qkv(T):
    return [jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)] * 3


def test_flash_attention_forward_is_one_loop_of_two_tile_dots_without_masks_when_tiles_divide():
    (fwd,) = triton_ir.lower_kernels(
        lambda q, k, v: triton_attention(q, k, v, interpret=False, block_sizes=_TILES), *_qkv(64))
    assert fwd.name == "flash_attention_fwd" and fwd.grid == (2, 2, 1)  # (T / block_q, B·N, 1)
    assert fwd.dots() == ["tensor<32x64xbf16> x tensor<64x16xbf16> -> tensor<32x16xf32>",   # q kᵀ: one score tile
                          "tensor<32x16xbf16> x tensor<16x64xbf16> -> tensor<32x64xf32>"]   # p v
    assert fwd.op_counts()["scf.for"] == 1
    assert fwd.inline_asm() == {"ex2.approx.ftz.f32 $0, $1;": 2} and "__nv_exp2f" not in fwd.extern_calls()
    # q, k, v, and the old o and lse tiles that Pallas' store (a swap) reads and leaves unused: none masked
    assert "5 loads (0 masked)" in fwd.summary()


def test_two_query_chains_share_each_key_tile_and_issue_both_score_dots_first():
    tiles = dict(_TILES, query_chains=2)  # two chains of 16 rows
    (fwd,) = triton_ir.lower_kernels(
        lambda q, k, v: triton_attention(q, k, v, interpret=False, block_sizes=tiles), *_qkv(64))
    assert fwd.grid == (2, 2, 1) and fwd.op_counts()["scf.for"] == 1
    score, pv = "tensor<16x64xbf16> x tensor<64x16xbf16> -> tensor<16x16xf32>", \
        "tensor<16x16xbf16> x tensor<16x64xbf16> -> tensor<16x64xf32>"
    assert fwd.dots() == [score, score, pv, pv]  # both chains' q kᵀ before either softmax and p v
    assert sum(fwd.inline_asm().values()) == 4  # exp2 of alpha and p, per chain
    # one k and one v tile per key step for both chains: q (two halves), k, v, old o and lse (two halves each)
    assert "8 loads (0 masked)" in fwd.summary()


def test_an_odd_length_adds_a_masked_tail_loop():
    (fwd,) = triton_ir.lower_kernels(
        lambda q, k, v: triton_attention(q, k, v, interpret=False, block_sizes=_TILES), *_qkv(40))
    assert fwd.op_counts()["scf.for"] == 2 and len(fwd.dots()) == 4  # full tiles unmasked, then the tail
    assert "(0 masked)" not in fwd.summary()


def test_flash_attention_backward_kernels():
    def loss(q, k, v):
        return jnp.sum(triton_attention(q, k, v, interpret=False, block_sizes=_TILES).astype(jnp.float32))

    kernels = triton_ir.lower_kernels(jax.grad(loss, argnums=(0, 1, 2)), *_qkv(64))
    assert [k.name for k in kernels] == ["flash_attention_fwd", "flash_attention_dkdv", "flash_attention_dq"]
    assert [len(k.dots()) for k in kernels] == [2, 4, 3]  # dK/dV: s, dv, dp, dk; dQ: s, dp, dq
    assert [sum(k.inline_asm().values()) for k in kernels] == [2, 1, 1]  # exp2: alpha and p; p; p
    for k in kernels:
        assert all(int(n) <= 128 for dot in k.dots() for n in re.findall(r"(\d+)x", dot))  # tiles, not (T, S)


def test_linear_cross_entropy_has_no_vocabulary_sized_tensor():
    h = jax.ShapeDtypeStruct((40, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((40,), jnp.int32)
    grad = jax.grad(lambda h, w, y: linear_cross_entropy(h, w, y, interpret=False), argnums=(0, 1))
    kernels = triton_ir.lower_kernels(grad, h, w, labels)
    assert [k.name for k in kernels] == ["linear_cross_entropy_rows"]  # one token chunk: B=40 fits the rule
    for k in kernels:
        assert not k.dots()  # the GEMMs are XLA's
        assert not re.search(r"tensor<[^>]*\b(40|1000)x", k.text)  # tiles of a row and the vocabulary only


def test_no_triton_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="no Pallas-Triton kernel.*interpret=False"):
        triton_ir.lower_kernels(lambda q, k, v: triton_attention(q, k, v, interpret=True), *_qkv(16))
    with pytest.raises(ValueError, match="no Pallas-Triton kernel"):
        triton_ir.lower_kernels(jnp.tanh, jax.ShapeDtypeStruct((8,), jnp.float32))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the kernels lower for Triton anyway")
def test_lowering_for_gpu_makes_default_calls_lower_for_triton_only_inside_the_block():
    from pallas_kernels import triton_utils

    qkv = _qkv(64)
    with pytest.raises(ValueError, match="no Pallas-Triton kernel"):  # interpret=None on the CPU: interpret mode
        triton_ir.lower_kernels(lambda q, k, v: triton_attention(q, k, v), *qkv)
    assert triton_utils.resolve_interpret(None) is True
    with triton_utils.lowering_for_gpu():
        assert triton_utils.resolve_interpret(None) is False and triton_utils.resolve_interpret(True) is True
        (fwd,) = triton_ir.lower_kernels(lambda q, k, v: triton_attention(q, k, v), *qkv)
    assert triton_utils.resolve_interpret(None) is True
    assert fwd.num_stages == 3  # the GPU table's launch (the CPU table's has 1 stage)
