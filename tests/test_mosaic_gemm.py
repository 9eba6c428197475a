"""pallas_kernels.gemm: the Mosaic-GPU GEMM core. Config and shape errors and the lowered structure on any machine;
numbers against a float32 product on an sm90 GPU (per-test timeout there), and (slow) in GPU interpret mode on the
CPU at tiny shapes, for every K loop."""

import dataclasses
import functools
import itertools
import math
import re
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import GPU_TIMEOUT
from hlo_inspect import mosaic_ir
from pallas_kernels import backends, mosaic_utils
from pallas_kernels.gemm import (FEW_ROWS, GEMV, SHORT_DEPTH, Fusion, MosaicGemmConfig, default_config,
                                  gemm, gemv, gemv_config, matmul, smem_bytes, stream_k)
from pallas_kernels.gemm.config import operand_swizzle_elems

ON_SM90 = mosaic_utils.is_hopper()


def gpu_only(test):
    """Runs on an sm90 GPU only, within GPU_TIMEOUT."""
    return pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU")(GPU_TIMEOUT(test))



cpu_only = pytest.mark.skipif(jax.default_backend() == "gpu", reason="structure / interpret-mode checks")
S = jax.ShapeDtypeStruct
SUITE_SHAPES = [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144), (16384, 1024, 5504)]  # (M, K, N)
_KEYS = itertools.count(7000)
_BASE_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}  # relative, at K = 1024; grows with sqrt(K)


def _key():
    return jax.random.key(next(_KEYS))


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _tol(dtype, K):
    return _BASE_TOL[dtype] * max(1.0, math.sqrt(K / 1024))


def _operands(M, K, N, dtype):
    a = jax.random.normal(_key(), (M, K), jnp.float32).astype(dtype)
    b = (jax.random.normal(_key(), (K, N), jnp.float32) * K**-0.5).astype(dtype)
    return a, b


def _wgmma_of(config: MosaicGemmConfig) -> dict:
    """The wgmma instructions one warpgroup issues per pipeline step under ``config`` (bf16 operands)."""
    return {f"m64n{config.tile_n}k16 f32 += bf16 x bf16": (config.tile_m // 64) * (config.tile_k // 16)}


def _f32_product(a, b):
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("tile_m", 96), ("tile_n", 512), ("tile_k", 24), ("num_stages", 1),
                                          ("wg_split", "k"), ("epi_tile_m", 32), ("epi_tile_n", 48),
                                          ("grid_minor", "x"), ("grid_tile_width", 0), ("delay_release", 3),
                                          ("semantics", "warp"), ("pipeline", "cutlass"), ("mma_registers", 236),
                                          ("schedule", "stream-k"), ("cluster", "k")])
def test_config_rejects_a_bad_field_by_name(field, value):
    with pytest.raises(ValueError, match=f"MosaicGemmConfig.{field}"):
        MosaicGemmConfig(**{field: value})


def test_a_cluster_needs_our_k_loop_and_two_tiles_along_its_axis():
    with pytest.raises(ValueError, match="MosaicGemmConfig.cluster: 'm' runs on pipeline 'own'"):
        MosaicGemmConfig(cluster="m", pipeline="pallas")
    a, b = S((384, 512), jnp.bfloat16), S((512, 1024), jnp.bfloat16)  # 3 CTA tiles of 128 rows: not pairs
    with pytest.raises(ValueError, match="M=384 is not a positive multiple of the rows of a cluster's two output "
                                         "tiles=256"):
        jax.eval_shape(lambda a, b: matmul(a, b, config=MosaicGemmConfig(cluster="m")), a, b)
    jax.eval_shape(lambda a, b: matmul(a, b, config=MosaicGemmConfig(cluster="n")), a, b)  # 4 CTA tiles along N


def test_config_rejects_an_accumulator_beyond_the_register_file():
    with pytest.raises(ValueError, match="128x256"):
        MosaicGemmConfig(tile_m=256, tile_n=256)


@pytest.mark.parametrize("shape_a, shape_b, transpose_a, config, message", [
    ((1024, 4100), (4100, 1024), False, {}, "K=4100 is not a positive multiple of tile_k=64"),
    ((512, 100), (512, 1024), True, {},  # (a read transposed: M is its minor axis)
     "M=100 is not a positive multiple of the rows of a block's output tile"),
    ((100, 512), (512, 1024), False, dict(tile_k=128),
     r"M=100 is not a multiple of 8 \(TMA's 8-row tiles\): .*A's blocks one swizzled row wide"),
    ((1024, 512), (512, 1000), False, {}, "N=1000 is not a positive multiple of 64"),  # a plain product: past N
])
def test_shapes_that_do_not_tile_are_a_value_error_naming_the_constraint(shape_a, shape_b, transpose_a, config,
                                                                          message):
    a, b = S(shape_a, jnp.bfloat16), S(shape_b, jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda a, b: matmul(a, b, config=MosaicGemmConfig(**config), transpose_a=transpose_a), a, b)


@cpu_only
@pytest.mark.parametrize("M", [1001, 1000, 100])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_matmul_takes_rows_past_its_tiles_padding_nothing(M, transpose_b):
    """M the tiles do not divide (1000, 100: not a multiple of 128; 1001, 100: nor of 8): the forward's and dA's
    last row of tiles runs past M (untiled views where M is not a multiple of 8), dB's last K step past M where M is
    a multiple of 8; else XLA's GEMM computes dB (ours steps through M in 8-row tiles). Nothing is padded."""
    K, N = 1024, 2048
    b_shape = (N, K) if transpose_b else (K, N)
    args = (S((M, K), jnp.bfloat16), S(b_shape, jnp.bfloat16), S((M, N), jnp.bfloat16))
    fn = lambda a, b, g: jax.vjp(lambda a, b: matmul(a, b, transpose_b=transpose_b), a, b)  # noqa: E731
    program = lambda a, b, g: (fn(a, b, g)[0], fn(a, b, g)[1](g))  # noqa: E731
    with backends.lowering_for_gpu():
        text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        kernels = mosaic_ir.lower_kernels(program, *args)
    ours = ["mosaic_matmul", "mosaic_matmul_da"] + (["mosaic_matmul_db"] if M % 8 == 0 else [])
    assert sorted(k.name for k in kernels) == ours
    assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels)
    assert "stablehlo.pad" not in text and text.count("stablehlo.dot_general") == (M % 8 != 0)
    out, (da, db) = jax.eval_shape(program, *args)
    assert (out.shape, da.shape, db.shape) == ((M, N), (M, K), b_shape)


@cpu_only
@pytest.mark.slow
def test_matmul_rows_past_its_tiles_in_interpret_mode():
    """75 rows on 64-row tiles (not a multiple of 8): the product and both gradients against float32."""
    config = MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=32, num_stages=2, epi_tile_n=32, wg_split="m")
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _check_product(75, 128, 128, jnp.bfloat16, config=config)
        _check_grads(75, 128, 128, jnp.bfloat16, config=config)


@cpu_only
def test_a_one_step_k_loop_lowers_on_ping_pong_tiles():
    """K = 64, one step of the ping-pong candidate's ring (matmul's dB at 64 rows): its drain indexes the owners'
    barriers (it raised "Operation is only valid for a single barrier" in the lowering)."""
    config = default_config(512, 512, 64)
    assert config.pingpong
    (kernel,) = mosaic_ir.lower_kernels(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16),
                                        S((512, 64), jnp.bfloat16), S((64, 512), jnp.bfloat16))
    assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES


@pytest.mark.parametrize("M, K, N, form", [(1, 4096, 14336, "whole"), (16, 4096, 4096, "parts"),
                                           (64, 4096, 14336, "whole"), (48, 2048, 4096, "parts"),
                                           (17, 2048, 2048, "parts"), (16, 512, 4096, "whole"),
                                           (32, 4096, 8192, "stream_k"), (32, 8192, 2048, "parts_8"),
                                           (32, 2048, 2048, "parts")])
def test_few_rows_take_64_row_tiles_in_k_parts_or_split_by_stream_k_where_they_are_few(M, K, N, form):
    """At M <= FEW_ROWS the default tiles are 64 rows, N / 128 tiles: where 8 or 4 times as many fit the 132 SMs
    and each part keeps 8 K steps, ping-pong tiles with their K loops in 8 or 4 parts (k_parts); else two 64-wide
    accumulators side by side, split over up to 4 blocks each by stream-K where they fill at most half of the SMs
    and the K loop is long enough (``STREAM_K_MIN_STEPS``), or whole."""
    config = default_config(M, N, K, partial_rows=True)
    assert (config.cta_m, config.cta_n) == (64, 128)
    parts = {"parts": 4, "parts_8": 8}.get(form, 1)
    assert (config.k_parts, config.pingpong) == (parts, parts > 1)
    tiles = N // config.cta_n
    plan = stream_k.plan_for(tiles, 132, K // config.tile_k, split=config.stream_k) if config.stream_k else None
    assert (plan is not None) == (form == "stream_k")  # (17x2048x2048: 32 steps, 4 parts of 8, not 8 of 4)
    if plan is not None:
        assert plan.units > 66
    assert default_config(FEW_ROWS + 1, N, K, partial_rows=True).cta_m == 128


@cpu_only
@pytest.mark.parametrize("transpose_b", [False, True])
def test_up_to_16_rows_run_the_transposed_gemv_forward_and_for_da(transpose_b):
    """M <= 16: the product and dA are the GEMV (b's columns as the GEMM's rows, y's rows the accumulator's columns,
    stored as row vectors: no output tile), dB XLA's (M not a multiple of 8, but one) or ours; the default tiles
    elsewhere (a given config, 17 rows or 13 (not a multiple of TMA's 8-row tiles, nor fewer), or b's N / K off the
    GEMV's tiles: N = 1088 is not a multiple of dA's 256-deep K steps)."""
    def kernels(M, K, N, **kwargs):
        args = (S((M, K), jnp.bfloat16), S((N, K) if transpose_b else (K, N), jnp.bfloat16), S((M, N), jnp.bfloat16))
        fn = lambda a, b: matmul(a, b, transpose_b=transpose_b, **kwargs)  # noqa: E731
        program = lambda a, b, g: (fn(a, b), jax.vjp(fn, a, b)[1](g))  # noqa: E731
        with backends.lowering_for_gpu():
            return sorted(k.name for k in mosaic_ir.lower_kernels(program, *args))
    assert kernels(1, 4096, 14336) == ["mosaic_matmul_da_gemv", "mosaic_matmul_db", "mosaic_matmul_gemv"]
    assert kernels(3, 1024, 2048) == ["mosaic_matmul_da_gemv", "mosaic_matmul_gemv"]  # (dB: XLA's GEMM)
    assert kernels(16, 1024, 2048) == ["mosaic_matmul_da_gemv", "mosaic_matmul_db", "mosaic_matmul_gemv"]
    assert kernels(1, 1024, 1088) == ["mosaic_matmul", "mosaic_matmul_da", "mosaic_matmul_db"]
    assert kernels(1, 1024, 2048, config=dict(tile_k=64)) == ["mosaic_matmul", "mosaic_matmul_da",
                                                              "mosaic_matmul_db"]
    assert kernels(17, 1024, 2048) == ["mosaic_matmul", "mosaic_matmul_da"]
    assert kernels(13, 1024, 2048) == ["mosaic_matmul", "mosaic_matmul_da"]  # (B's rows: fewer than 8 or whole 8s)


@cpu_only
def test_an_epilogues_tuple_of_row_vectors_needs_an_output_of_as_many_rows():
    """A tuple of C row vectors fills a (C, M) output's rows; into any other shape it is a ValueError naming both."""
    fusion = Fusion(outputs=(("y", S((512,), jnp.float32)),), store_tile=False, partial_columns=True,
                    epilogue=lambda ctx, acc, carry: (acc, {"y": (jnp.sum(acc, axis=1),) * 2}))
    fn = lambda b, a: gemm(b, a, config=GEMV, out_dtype=jnp.bfloat16, transpose_a=True, transpose_b=True,  # noqa
                           fusion=fusion)
    with backends.lowering_for_gpu(), pytest.raises(ValueError, match=r"tuple of 2 row vectors needs a \(2, M\) "
                                                                      r"output, got shape \(512,\)"):
        jax.jit(fn).trace(S((512, 512), jnp.bfloat16), S((2, 512), jnp.bfloat16)).lower(lowering_platforms=("cuda",))


@cpu_only
def test_the_gemv_cuts_its_k_loop_into_parts_where_its_tiles_or_steps_are_few():
    """gemv_config: b read transposed (the product), K in parts until N / 64 tiles times the parts fill over half
    the SMs; b read as stored (dA's form), until the 256-deep steps times the parts reach 32; only parts that divide
    the steps. At 16x14336x4096 the forward and dA lower as GEMVs (2 parts and 1)."""
    def parts(N, K, transpose_b=False):
        return gemv_config(N, K, transpose_b=transpose_b).k_parts

    assert (parts(4096, 4096), parts(2048, 8192), parts(4096, 14336), parts(14336, 4096)) == (2, 4, 2, 1)
    assert (parts(4096, 4096, True), parts(8192, 2048, True), parts(4096, 14336, True)) == (2, 4, 1)
    assert parts(4096, 768) == 1 and parts(1024, 768) == 1  # (3 steps: no part count divides them)
    assert gemv_config(14336, 4096) is GEMV
    args = (S((16, 14336), jnp.bfloat16), S((14336, 4096), jnp.bfloat16), S((16, 4096), jnp.bfloat16))
    program = lambda a, b, g: (matmul(a, b), jax.vjp(matmul, a, b)[1](g))  # noqa: E731
    with backends.lowering_for_gpu():
        kernels = mosaic_ir.lower_kernels(program, *args)
        text = jax.jit(program).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(k.name for k in kernels) == ["mosaic_matmul_da_gemv", "mosaic_matmul_db", "mosaic_matmul_gemv"]
    assert "tensor<32x4096xf32>" in text  # the forward's two parts of 16 rows, summed by XLA


@pytest.mark.parametrize("M, K, N, kwargs, message", [
    (13, 512, 512, {}, r"a: 13 rows; the GEMV takes 1 to 7, 8 or 16"),
    (17, 512, 512, {}, r"a: 17 rows"),
    (4, 512, 512, dict(config=dict(tile_n=32)), r"config.tile_n: must be 16 \(the GEMV's columns are a's rows\), "
                                                  r"got 32"),
    (4, 512, 96, {}, r"gemv \(mosaic\): N=96 is not a positive multiple of the rows of a block's output tile=64"),
    (4, 512, 512, dict(config=dict(tile_k=384, k_parts=1)), r"K=512 is not a positive multiple of tile_k=384"),
    (4, 512, 512, dict(config=dict(tile_k=384)), r"K=512 is not a positive multiple of k_parts · tile_k = 2 · 384"),
    (4, 512, 512, dict(out_dtype=jnp.int8), r"out_dtype: int8 not supported"),
])
def test_the_gemv_says_which_argument_it_cannot_take(M, K, N, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(functools.partial(gemv, **kwargs), S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16))


@cpu_only
def test_contractions_of_at_most_16_take_one_16_deep_step():
    """K <= SHORT_DEPTH (dB at up to 16 rows): one 16-deep K step, not a 64-deep one of TMA's zeros; the forward at
    K = 16 runs too (no candidate's 64-deep steps divide it)."""
    assert default_config(4096, 4096, 16).tile_k == SHORT_DEPTH
    assert default_config(4096, 4096, 1, partial_k=True).tile_k == SHORT_DEPTH  # (dB at one row)
    assert default_config(4096, 4096, 32).tile_k == 64
    with backends.lowering_for_gpu():
        kernels = mosaic_ir.lower_kernels(matmul, S((4096, 16), jnp.bfloat16), S((16, 4096), jnp.bfloat16))
    assert [k.name for k in kernels] == ["mosaic_matmul"]


@cpu_only
def test_the_16_deep_step_stores_its_pieces_in_place_in_interpret_mode():
    """dB's form (a read transposed, a contraction of 16; at 8 rows the same config, 8 of its 16 past K): the
    default 16-deep config, its output in 64x128 pieces (two per warpgroup tile), against float32; a piece stored
    at another's place shows (each piece stored at column (j // 2) * 128 failed it)."""
    for depth in (16, 8):
        config = default_config(256, 512, depth, partial_k=True)
        assert (config.tile_k, config.epi_tile_n, config.tile_n // config.epi_tile_n) == (SHORT_DEPTH, 128, 2)
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2 blocks, 2 tiles each
        _check_product(256, 16, 512, jnp.bfloat16, transpose_a=True)


_GEMV_PARTS = {"pingpong_2": dataclasses.replace(GEMV, tile_k=128, k_parts=2),
               "stacked_4": dataclasses.replace(GEMV, tile_k=64, num_stages=8, schedule="cooperative", wg_split="m",
                                                k_parts=4)}


@cpu_only
@pytest.mark.parametrize("parts, transpose_b", [("pingpong_2", False), ("stacked_4", True)])
def test_the_gemv_in_k_parts_in_interpret_mode(parts, transpose_b):
    """k_parts: each tile's K ranges run as tiles of their own, their partial rows summed by XLA; the interpreter
    runs the same K addressing, so an overlapped or skipped range would show in the product."""
    a, b = _operands(5, 512, 256, jnp.bfloat16)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        got = jax.jit(lambda a, b: gemv(a, b.T if transpose_b else b, transpose_b=transpose_b,
                                        config=_GEMV_PARTS[parts]))(a, b)
    assert got.shape == (5, 256) and got.dtype == jnp.bfloat16
    assert _rel_err(got, _f32_product(a, b)) <= _tol(jnp.bfloat16, 512)  # NaN fails


@cpu_only
def test_the_gemv_in_k_parts_stores_float32_parts_for_xla_to_sum():
    """At 16x4096x4096 the k_parts kernel writes (parts · 16, 4096) float32 rows and XLA adds the parts."""
    config = _GEMV_PARTS["stacked_4"]
    fn = lambda a, b: gemv(a, b, config=config)  # noqa: E731
    args = (S((16, 4096), jnp.bfloat16), S((4096, 4096), jnp.bfloat16))
    with backends.lowering_for_gpu():
        kernels = mosaic_ir.lower_kernels(fn, *args)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert [k.name for k in kernels] == ["mosaic_gemv"]
    assert kernels[0].smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert "tensor<64x4096xf32>" in text and "stablehlo.reduce" in text


def test_k_parts_is_refused_where_it_cannot_run():
    """k_parts beside stream-K, a K that k_parts · tile_k does not divide, and a fusion that stores its output tile
    are each a ValueError naming the constraint."""
    with pytest.raises(ValueError, match="k_parts: 2 parts run on pipeline 'own' without stream-K"):
        dataclasses.replace(_GEMV_PARTS["stacked_4"], k_parts=2, stream_k=4)
    with pytest.raises(ValueError, match=r"K=4096 is not a positive multiple of k_parts · tile_k = 3 · 256"):
        gemv(S((16, 4096), jnp.bfloat16), S((4096, 4096), jnp.bfloat16), config=dataclasses.replace(GEMV, k_parts=3))
    scaled = Fusion(epilogue=lambda ctx, acc, carry: (acc * 2.0, {}))  # (an epilogue on a stored tile)
    for kwargs in (dict(fusion=scaled), dict(accumulate_into=S((256, 256), jnp.bfloat16))):
        with backends.lowering_for_gpu(), pytest.raises(ValueError, match="k_parts=2 runs each tile's K ranges"):
            jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(k_parts=2), out_dtype=jnp.bfloat16,
                                             **kwargs), S((256, 1024), jnp.bfloat16), S((1024, 256), jnp.bfloat16))


_FEW_PARTS = MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=64, num_stages=4, wg_split="n", k_parts=2)


@cpu_only
def test_the_plain_product_in_k_parts_in_interpret_mode():
    """k_parts on the plain product: each K range's float32 tiles in its part of a (k_parts, M, N) buffer, summed by
    gemm; 40 rows (the last row of tiles past M)."""
    a, b = _operands(40, 512, 256, jnp.bfloat16)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        got = jax.jit(lambda a, b: matmul(a, b, config=_FEW_PARTS))(a, b)
    assert got.shape == (40, 256) and got.dtype == jnp.bfloat16
    assert _rel_err(got, _f32_product(a, b)) <= _tol(jnp.bfloat16, 512)  # NaN fails
    a, b = _operands(16, 512, 256, jnp.float16)  # float16 into float32
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        got = jax.jit(lambda a, b: matmul(a, b, config=_FEW_PARTS, out_dtype=jnp.float32))(a, b)
    assert got.dtype == jnp.float32 and _rel_err(got, _f32_product(a, b)) <= _tol(jnp.float16, 512)
    with backends.lowering_for_gpu():
        text = jax.jit(lambda a, b: matmul(a, b, config=_FEW_PARTS)).trace(
            S((17, 4096), jnp.bfloat16), S((4096, 4096), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<2x17x4096xf32>" in text  # the parts, at 17 rows (untiled views)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("M", [1, 5, 16])
def test_gemv_in_interpret_mode(M):
    """The GEMV's product (b both ways) and gradients against float32, at one row, 5 (TMA's zeros past them in
    the tile's 16 columns) and 16."""
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _check_product(M, 512, 256, jnp.bfloat16)
        _check_product(M, 512, 256, jnp.bfloat16, transpose_b=True)
        _check_grads(M, 512, 256, jnp.bfloat16)


@gpu_only
@pytest.mark.parametrize("M, K, N", [(1001, 1024, 2048), (4099, 2048, 1024), (1000, 4096, 4096), (13, 512, 512),
                                     (64, 512, 512), (1, 4096, 4096), (1, 4096, 14336), (16, 2048, 4096),
                                     (5, 4096, 4096), (48, 4096, 1024), (16, 14336, 4096), (8, 8192, 2048),
                                     (2, 4096, 4096)])
def test_matmul_rows_past_its_tiles_on_the_gpu(M, K, N):
    """The default configs (forward, dA and dB each its own), rows the tiles do not divide, against float32; the
    few-row ones: 13 and 48 on 64-row tiles split by stream-K, 1, 2, 5, 8 and 16 on the transposed GEMV (split by
    stream-K at 16x14336x4096 and 8x8192x2048 forward, 1x4096x14336 dA), dB at 1, 8 and 16 rows one 16-deep
    step."""
    _check_product(M, K, N, jnp.bfloat16)
    _check_product(M, K, N, jnp.bfloat16, transpose_b=True)
    _check_grads(M, K, N, jnp.bfloat16)


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, out_dtype", [
    (16, 4096, 4096, jnp.float16, jnp.float16), (5, 2048, 4096, jnp.bfloat16, jnp.float32),
    (16, 14336, 4096, jnp.float16, jnp.float32), (1, 4096, 2048, jnp.float16, jnp.float16)])
def test_the_gemv_in_float16_and_into_float32_on_the_gpu(M, K, N, dtype, out_dtype):
    """The GEMV (split by stream-K at 16x14336x4096) in float16, and its product stored in float32, against
    float32; with dA and dB in float16."""
    a, b = _operands(M, K, N, dtype)
    got = jax.jit(lambda a, b: matmul(a, b, out_dtype=out_dtype))(a, b)
    assert got.shape == (M, N) and got.dtype == out_dtype
    err = _rel_err(got, _f32_product(a, b))
    assert err <= _tol(dtype, K), err  # NaN fails
    if dtype == jnp.float16:
        _check_grads(M, K, N, dtype)


@gpu_only
@pytest.mark.parametrize("M, K, N", [(16, 4096, 4096), (1, 4096, 4096), (8, 8192, 2048), (16, 14336, 4096)])
@pytest.mark.parametrize("parts", sorted(_GEMV_PARTS))
def test_the_gemv_in_k_parts_on_the_gpu(M, K, N, parts):
    """The GEMV with each tile's K loop in parts (partial rows summed by XLA), b both ways, against float32."""
    a, b = _operands(M, K, N, jnp.bfloat16)
    want = _f32_product(a, b)
    for transpose_b in (False, True):
        got = jax.jit(lambda a, b: gemv(a, b.T if transpose_b else b, transpose_b=transpose_b,
                                        config=_GEMV_PARTS[parts]))(a, b)
        assert got.shape == (M, N) and got.dtype == jnp.bfloat16
        err = _rel_err(got, want)
        assert err <= _tol(jnp.bfloat16, K), (transpose_b, err)  # NaN fails


@gpu_only
@pytest.mark.parametrize("M, K, N", [(17, 4096, 4096), (32, 4096, 14336), (64, 8192, 2048)])
def test_the_plain_product_in_k_parts_on_the_gpu(M, K, N):
    """The product with each tile's K loop in 2 parts (float32 parts summed by gemm), against float32."""
    a, b = _operands(M, K, N, jnp.bfloat16)
    got = jax.jit(lambda a, b: matmul(a, b, config=_FEW_PARTS))(a, b)
    assert got.shape == (M, N) and got.dtype == jnp.bfloat16
    assert _rel_err(got, _f32_product(a, b)) <= _tol(jnp.bfloat16, K)  # NaN fails


@pytest.mark.parametrize("a, b, message", [
    (S((128, 64), jnp.float32), S((64, 128), jnp.float32), "a: dtype float32 not supported"),
    (S((128, 64), jnp.bfloat16), S((64, 128), jnp.float16), "b: dtype float16 must equal a's dtype bfloat16"),
    (S((128, 64), jnp.bfloat16), S((128, 128), jnp.bfloat16), "b: contraction size 128"),
    (S((128, 64, 1), jnp.bfloat16), S((64, 128), jnp.bfloat16), "a: expected a 2-D array"),
])
def test_bad_operands_are_a_value_error_naming_the_argument(a, b, message):
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(matmul, a, b)


@cpu_only
def test_a_machine_without_hopper_is_a_value_error_saying_where_it_runs():
    """Called eagerly off an sm90 GPU, matmul says so and how to lower or interpret it, not Pallas's "Only interpret
    mode is supported on CPU backend" from inside its lowering; inside lowering_for_gpu() it lowers."""
    a = jnp.ones((256, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"matmul \(mosaic\): Mosaic GPU kernels need an sm90 \(Hopper\) GPU; this "
                                         r"machine's default device is cpu \(lower it for CUDA inside "
                                         r"pallas_kernels.backends.lowering_for_gpu\(\), or run it in GPU interpret "
                                         r"mode inside pallas_kernels.mosaic_utils.interpret_on_cpu\(\)\)"):
        matmul(a, a)
    with backends.lowering_for_gpu():
        assert "mosaic_gpu" in jax.jit(matmul).trace(a, a).lower(lowering_platforms=("cuda",)).as_text()


def test_config_may_be_a_mapping_of_fields_over_the_default():
    a = S((1024, 1024), jnp.bfloat16)
    product = jax.eval_shape(lambda a, b: matmul(a, b, config={"tile_m": 64, "num_stages": 3}), a, a)
    assert product.shape == (1024, 1024)
    with pytest.raises(ValueError, match=r"config: unknown fields \['tile'\]; allowed: \['tile_m'"):
        jax.eval_shape(lambda a, b: matmul(a, b, config={"tile": 64}), a, a)
    with pytest.raises(ValueError, match="config: expected a MosaicGemmConfig or a mapping of its fields, got int"):
        jax.eval_shape(lambda a, b: matmul(a, b, config=64), a, a)


# ---------------------------------------------------------------------------------------------------------------
# Structure (lowered for CUDA; no GPU needed)
# ---------------------------------------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("M, K, N", SUITE_SHAPES)
def test_default_configs_lower_at_the_suite_shapes_within_shared_memory(M, K, N):
    config = default_config(M, N, K)
    (k,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b), S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16))
    assert k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert abs(k.smem_bytes - smem_bytes(config, jnp.bfloat16, jnp.bfloat16)) < 4096  # barriers, reduction scratch
    # the whole tiles' K loop and its first step taken out of it (the previous output stored under that step's
    # wgmma), and a stream-K phase where the whole rounds leave one (gemm.stream_k: 4 tiles left at the first)
    plan = config.stream_k and stream_k.plan_for(M // config.cta_m * (N // config.cta_n), mosaic_utils.H100_SMS,
                                                 K // config.tile_k, config.stream_k)
    assert config.epilogue_store == ("end" if config.pingpong else "next_tile")
    assert bool(plan) == ((M, K, N) == (32768, 4096, 4096))
    copies = 1 + (config.epilogue_store == "next_tile") + bool(plan)
    assert k.wgmma() == {op: n * copies for op, n in _wgmma_of(config).items()}
    assert k.tma_loads() >= 2 and k.tma_stores() >= 1


def test_the_defaults_are_the_measured_winners_and_matmul_is_exported():
    import pallas_kernels

    config = MosaicGemmConfig()  # gemm.config's docstring: the H100 numbers behind them
    assert (config.pipeline, config.semantics, config.grid_tile_width, config.grid_minor) == ("own", "lane", 8, "n")
    # matmul's picks (gemm/__init__.py: the tile sweeps against cuBLAS): 64x256 accumulators stacked along M, and
    # ping-pong 128x128 tiles where 256 does not divide N
    stacked, pingpong = default_config(32768, 4096, 4096), default_config(16384, 5504, 1024)
    assert (stacked.tile_m, stacked.tile_n, stacked.wg_split, stacked.grid_minor) == (64, 256, "m", "m")
    assert stacked.stream_k == 4  # gemm.stream_k: a last round less than half full on up to 4 blocks per tile
    assert stacked.epilogue_store == "next_tile"  # each output stored under the next tile's first wgmma
    # stream-K over K loops of 32 steps or more only (its workspace round trip outweighs the saving below)
    assert default_config(4352, 4096, 2048).stream_k == 4 and default_config(4352, 4096, 1536).stream_k == 0
    assert (pingpong.schedule, pingpong.cta_n, pingpong.delay_release) == ("pingpong", 128, 1)
    # whole-tile products load from one warp of the memory warpgroup; stream-K ones from all four
    assert (pingpong.memory_warps, stacked.memory_warps, default_config(4352, 4096, 1536).memory_warps) == (1, 4, 1)
    assert pallas_kernels.matmul is matmul and pallas_kernels.MosaicGemmConfig is MosaicGemmConfig


@pytest.mark.parametrize("fields", [dict(pipeline="pallas"), dict(pipeline="pallas_steady"), dict(wg_split="m")])
def test_a_prologue_needs_our_k_loop_and_shared_rows(fields):
    """A prologue runs in our K loop ("own"), in a fourth warpgroup reading the CTA's rows (wg_split "n") unless
    the memory warpgroup runs it."""
    fusion = Fusion(prologue_step=lambda ctx, a_ref, carry: carry, handoff_rows=1)
    a, b = S((512, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="runs it in the K loop pipeline='own' with schedule='cooperative', in a "
                                         "fourth warpgroup with wg_split='n' or in the memory warpgroup"):
        jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(**fields), out_dtype=a.dtype,
                                         fusion=fusion), a, b)


@pytest.mark.parametrize("fields", [dict(pipeline="pallas"), dict(schedule="pingpong"), dict(cluster="m")])
def test_the_memory_warpgroups_prologue_needs_our_cooperative_loop(fields):
    with pytest.raises(ValueError, match="prologue_in: 'memory' runs on pipeline 'own', schedule 'cooperative', "
                                         "cluster 'none'; got"):
        MosaicGemmConfig(prologue_in="memory", **fields)
    with pytest.raises(ValueError, match="MosaicGemmConfig.prologue_in: must be one of .*, got 'mma'"):
        MosaicGemmConfig(prologue_in="mma")


@pytest.mark.parametrize("fields", [dict(pipeline="pallas"), dict(schedule="pingpong")])
@pytest.mark.parametrize("store", ["next_tile", "split"])
def test_storing_under_the_next_tile_needs_our_cooperative_loop(fields, store):
    with pytest.raises(ValueError, match=rf"MosaicGemmConfig.epilogue_store: '{store}' runs on pipeline 'own', "
                                         r"schedule 'cooperative'; got "):
        MosaicGemmConfig(epilogue_store=store, **fields)
    with pytest.raises(ValueError, match=r"MosaicGemmConfig.epilogue_store: must be one of \('end', 'next_tile', "
                                         r"'split'\), got 'later'"):
        MosaicGemmConfig(epilogue_store="later")


def test_split_store_needs_an_even_number_of_pieces_across_the_tile():
    with pytest.raises(ValueError, match=r"'split' stores half of the tile's 3 pieces across tile_n=192 at its end "
                                         r"and half later: it needs an even number \(epi_tile_n=64\)"):
        MosaicGemmConfig(tile_m=64, tile_n=192, epilogue_store="split")


@cpu_only
@pytest.mark.parametrize("cluster, store", [("none", "next_tile"), ("m", "next_tile"), ("none", "split")])
def test_storing_under_the_next_tile_takes_the_first_step_out_of_the_k_loop(cluster, store):
    """epilogue_store="next_tile" (or "split", half of it): the first step's wgmma is issued outside the K loop (the
    previous output stored under it), so the module holds two copies of a step's wgmma; same shared memory; a
    cluster multicasts as ever."""
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", cluster=cluster, epilogue_store=store)
    M, K, N = SUITE_SHAPES[0]
    (k,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), S((M, K), jnp.bfloat16),
                                   S((K, N), jnp.bfloat16))
    at_end = dataclasses.replace(config, epilogue_store="end")
    (end,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=at_end), S((M, K), jnp.bfloat16),
                                     S((K, N), jnp.bfloat16))
    assert k.wgmma() == {op: 2 * n for op, n in _wgmma_of(config).items()} and end.wgmma() == _wgmma_of(config)
    assert k.smem_bytes == end.smem_bytes and k.tma_multicast_loads() == (cluster == "m")


def test_storing_under_the_next_tile_takes_no_fusion_storing_from_its_tile_input():
    a, b, c = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (128, 256), (256, 256)))
    with pytest.raises(ValueError, match=r"mosaic_matmul_accumulate: epilogue_store='next_tile' keeps the output "
                                         r"tile in registers and stages it in its own SMEM slots; a fusion storing "
                                         r"from its tile input \(store_in='accumulate_into', or accumulate_into\) "
                                         r"takes epilogue_store='end'"):
        jax.eval_shape(lambda a, b, c: matmul(a, b, accumulate_into=c, config=MosaicGemmConfig(
            epilogue_store="next_tile")), a, b, c)


def test_pingpong_needs_our_k_loop_and_no_prologue():
    """Ping-pong runs on our K loop only; a prologue warpgroup would have to follow two warpgroups' tiles."""
    with pytest.raises(ValueError, match="MosaicGemmConfig.schedule: 'pingpong' runs on pipeline 'own'"):
        MosaicGemmConfig(schedule="pingpong", pipeline="pallas")
    fusion = Fusion(prologue_step=lambda ctx, a_ref, carry: carry, handoff_rows=1)
    a, b = S((512, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="schedule='cooperative', .*; got .*schedule='pingpong'"):
        jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(schedule="pingpong"), out_dtype=a.dtype,
                                         fusion=fusion), a, b)


@cpu_only
@pytest.mark.parametrize("tile_m, tile_n, stages", [(128, 128, 6), (64, 256, 4)])
def test_pingpong_lowers_with_a_whole_tile_per_warpgroup(tile_m, tile_n, stages):
    """Under ping-pong the CTA tile is one warpgroup's accumulator: each stage holds (tile_m + tile_n) · tile_k
    operands (not cooperative's (tile_m + 2 · tile_n) · tile_k), and each warpgroup issues the whole stage's
    wgmma; ready and consumed barriers come in two sets of num_stages (one per owner)."""
    config = MosaicGemmConfig(tile_m=tile_m, tile_n=tile_n, num_stages=stages, schedule="pingpong")
    assert (config.cta_m, config.cta_n) == (tile_m, tile_n)
    M, K, N = SUITE_SHAPES[0]
    (k,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), S((M, K), jnp.bfloat16),
                                   S((K, N), jnp.bfloat16))
    assert k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES and k.warpgroups == 3
    assert abs(k.smem_bytes - smem_bytes(config, jnp.bfloat16, jnp.bfloat16)) < 4096
    assert k.wgmma() == {f"m64n{tile_n}k16 f32 += bf16 x bf16": (tile_m // 64) * 4}
    assert k.tma_loads() == 2


@cpu_only
@pytest.mark.parametrize("cluster, schedule", [("m", "cooperative"), ("n", "cooperative"), ("m", "pingpong"),
                                               ("n", "pingpong")])
def test_a_cluster_multicasts_the_operand_its_two_blocks_share(cluster, schedule):
    """Clusters of 2 blocks over the same 132 blocks; one of the two TMA loads (B's tile with cluster "m", A's
    with "n") goes to both blocks, and the consumers release stages on cluster barriers (remote arrivals)."""
    config = MosaicGemmConfig(cluster=cluster, schedule=schedule, delay_release=int(schedule == "pingpong"))
    M, K, N = SUITE_SHAPES[0]
    (k,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), S((M, K), jnp.bfloat16),
                                   S((K, N), jnp.bfloat16))
    assert k.cluster == (2, 1, 1) and k.grid == (mosaic_utils.H100_SMS, 1, 1)
    assert k.tma_loads() == 2 and k.tma_multicast_loads() == 1
    assert "mbarrier.arrive.shared::cluster" in k.text
    multicast = [line for line in k.text.splitlines() if "multicast_mask" in line][0]
    loads = [line for line in k.text.splitlines() if mosaic_ir._TMA_LOAD in line]
    assert loads.index(multicast) == {"m": 1, "n": 0}[cluster]  # loads in program order: A's, then B's
    (plain,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=dataclasses.replace(config, cluster="none")),
                                       S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16))
    assert plain.cluster == (1, 1, 1) and plain.tma_multicast_loads() == 0
    assert "mbarrier.arrive.shared::cluster" not in plain.text


@cpu_only
@pytest.mark.parametrize("fields", [dict(pipeline="pallas"), dict(pipeline="pallas_steady"), dict(pipeline="own"),
                                    dict(pipeline="own", delay_release=1), dict(semantics="warpgroup"),
                                    dict(semantics="warpgroup", pipeline="pallas"), dict(grid_tile_width=1)])
def test_every_k_loop_lowers_at_the_largest_suite_shape_within_shared_memory(fields):
    M, K, N = SUITE_SHAPES[0]
    config = dataclasses.replace(default_config(M, N, K), stream_k=0, epilogue_store="end", **fields)  # one K loop
    (k,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), S((M, K), jnp.bfloat16),
                                   S((K, N), jnp.bfloat16))
    assert k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES and k.warpgroups == 3
    assert k.wgmma() == _wgmma_of(config)
    # TMA loads in the program text: ours issues one per operand per step; jax's unrolls its prologue of
    # num_stages steps, unless it runs under START/STEADY/STOP (then its prologue's trip count is dynamic)
    expected = dict(own=2, pallas_steady=4, pallas=2 * (config.num_stages + 1))[config.pipeline]
    assert k.tma_loads() == expected


@cpu_only
def test_under_warpgroup_semantics_the_plain_kernel_is_jax_hopper_example_op_for_op():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as example

    a, b = S((4096, 1024), jnp.bfloat16), S((1024, 4096), jnp.bfloat16)
    config = MosaicGemmConfig(semantics="warpgroup", pipeline="pallas", grid_tile_width=1)  # jax's loop and order
    ours = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), a, b)
    tuning = example.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(example, "get_num_sms", lambda: mosaic_utils.H100_SMS)
        theirs = mosaic_ir.lower_kernels(lambda a, b: example.matmul(a, b, None, tuning), a, b)
    ops, their_ops = ours[0].op_counts(), theirs[0].op_counts()
    for op in ("nvvm.cp.async.bulk.tensor.shared.cluster.global", "nvvm.cp.async.bulk.tensor.global.shared.cta",
               "nvvm.mbarrier.init", "nvvm.mbarrier.try_wait.parity", "nvvm.wgmma.fence.aligned",
               "nvvm.wgmma.commit.group.sync.aligned", "nvvm.cp.async.bulk.wait_group", "scf.for", "llvm.load"):
        assert ops.get(op, 0) == their_ops.get(op, 0), op
    assert ours[0].wgmma() == theirs[0].wgmma() and ours[0].smem_bytes == theirs[0].smem_bytes
    # one more wgmma wait: the epilogue's wgmma_wait(0) (needed after delay_release=1 only)
    assert ops["nvvm.wgmma.wait.group.sync.aligned"] <= their_ops["nvvm.wgmma.wait.group.sync.aligned"] + 1


@cpu_only
def test_transposed_operands_are_read_transposed_not_copied():
    a_t, b, b_t = S((512, 1024), jnp.bfloat16), S((512, 1024), jnp.bfloat16), S((1024, 512), jnp.bfloat16)
    program = jax.jit(lambda a_t, b_t: matmul(a_t, b_t, transpose_a=True, transpose_b=True)).trace(
        a_t, b_t).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.transpose" not in program  # the kernel reads both as stored
    (k,) = mosaic_ir.lower_kernels(lambda a_t, b: matmul(a_t, b, transpose_a=True), a_t, b)
    config = default_config(1024, 1024, 512)  # the first step's wgmma also outside the K loop (next_tile)
    assert k.wgmma() == {op: n * (1 + (config.epilogue_store == "next_tile")) for op, n in _wgmma_of(config).items()}
    del b_t


@cpu_only
def test_gradients_are_two_more_gemms_without_transposes():
    def fwd_bwd(a, b, g):
        c, vjp = jax.vjp(matmul, a, b)
        return c, vjp(g)

    args = (S((1024, 512), jnp.bfloat16), S((512, 1024), jnp.bfloat16), S((1024, 1024), jnp.bfloat16))
    kernels = mosaic_ir.lower_kernels(fwd_bwd, *args)
    assert [k.name for k in kernels] == ["mosaic_matmul", "mosaic_matmul_da", "mosaic_matmul_db"]
    program = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.transpose" not in program


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, True)])
def test_gradient_gemms_take_the_default_tiles_of_their_own_shapes_unless_given(monkeypatch, transpose_a,
                                                                                 transpose_b):
    """The small preset's MLP projection x (8192, 512) @ w (512, 2816): its db GEMM (512 x 2816 over 8192) has 11
    output tiles per 64 of the forward's, so it takes its own default (with stream-K), not the forward's ping-pong
    tiles; a config given to ``matmul`` runs all three GEMMs."""
    import pallas_kernels.gemm as gemm_module

    M, K, N = 8192, 512, 2816
    used = {}

    def recording(a, b, *, config, name, **kwargs):
        used[name] = config
        return gemm(a, b, config=config, name=name, **kwargs)

    monkeypatch.setattr(gemm_module, "gemm", recording)
    a = S((K, M) if transpose_a else (M, K), jnp.bfloat16)
    b = S((N, K) if transpose_b else (K, N), jnp.bfloat16)
    assert default_config(*((N, K, M) if transpose_b else (K, N, M))).stream_k  # db: 44 tiles, 128 steps each
    assert default_config(M, N, K).pingpong  # the forward's 8 steps: ping-pong tiles (SHORT_K)
    for config in (None, MosaicGemmConfig(tile_m=64, tile_n=128, wg_split="m")):
        used.clear()
        fn = lambda a, b, g: jax.vjp(lambda a, b: matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                                                         config=config), a, b)[1](g)  # noqa: E731
        with backends.lowering_for_gpu():
            jax.eval_shape(fn, a, b, S((M, N), jnp.bfloat16))
        da_shape = (K, M, N) if transpose_a else (M, K, N)  # (rows, cols) of the GEMM's output, then its depth
        db_shape = (N, K, M) if transpose_b else (K, N, M)
        want = [config] * 3 if config else [default_config(M, N, K), default_config(*da_shape),
                                            default_config(*db_shape)]
        assert [used[n] for n in ("mosaic_matmul", "mosaic_matmul_da", "mosaic_matmul_db")] == want


@cpu_only
def test_accumulate_into_is_one_kernel_updating_its_buffer_in_place():
    """c + aᵀ b: one kernel (a dw update of the cross-entropy's chunk loop) with c aliased in and out; its stages
    fill the shared memory beside c's two prefetched tiles: five ping-pong stages of 128x128 tiles for a short K
    loop (K <= 512), three of 128x256 blocks for a longer one (four overflow); c's shape or dtype wrong is a
    ValueError."""
    a_t, b, c = S((512, 256), jnp.bfloat16), S((512, 1024), jnp.bfloat16), S((256, 1024), jnp.bfloat16)
    fn = lambda a_t, b, c: matmul(a_t, b, transpose_a=True, accumulate_into=c)  # noqa: E731
    (k,) = mosaic_ir.lower_kernels(fn, a_t, b, c)
    short_k = default_config(256, 1024, 512, accumulate_dtype=jnp.bfloat16)
    assert (short_k.schedule, short_k.num_stages) == ("pingpong", 5) and k.wgmma() == _wgmma_of(short_k)
    assert k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    long_k = default_config(256, 1024, 1024, accumulate_dtype=jnp.bfloat16)
    assert (long_k.schedule, long_k.cta_n, long_k.num_stages) == ("cooperative", 256, 3)
    program = jax.jit(fn, donate_argnums=2).trace(a_t, b, c).lower(lowering_platforms=("cuda",)).as_text()
    assert "output_operand_alias<output_tuple_indices = [], operand_index = 2" in program
    a, b = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((512, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"accumulate_into: expected shape \(256, 1024\) and dtype bfloat16"):
        matmul(a, b, transpose_a=True, accumulate_into=jnp.zeros((1024, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"accumulate_into: .* dtype float32 \(a @ b's\), got \(256, 1024\) bfloat16"):
        matmul(a, b, transpose_a=True, out_dtype=jnp.float32, accumulate_into=jnp.zeros((256, 1024), jnp.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# Numbers: sm90 GPU (real and odd tile-multiple shapes); CPU interpret mode (slow, tiny shapes)
# ---------------------------------------------------------------------------------------------------------------
def _check_product(M, K, N, dtype, transpose_a=False, transpose_b=False, config=None):
    a, b = _operands(M, K, N, dtype)
    got = jax.jit(lambda a, b: matmul(a.T if transpose_a else a, b.T if transpose_b else b, config=config,
                                      transpose_a=transpose_a, transpose_b=transpose_b))(a, b)
    assert got.shape == (M, N) and got.dtype == dtype
    err = _rel_err(got, _f32_product(a, b))
    assert err <= _tol(dtype, K), err  # NaN fails


def _check_grads(M, K, N, dtype, config=None):
    a, b = _operands(M, K, N, dtype)
    g = jax.random.normal(_key(), (M, N), jnp.float32).astype(dtype)
    _, vjp = jax.vjp(lambda a, b: matmul(a, b, config=config), a, b)
    da, db = jax.jit(vjp)(g)
    _, vjp_ref = jax.vjp(_f32_product, a.astype(jnp.float32), b.astype(jnp.float32))
    da_ref, db_ref = vjp_ref(g.astype(jnp.float32))
    assert _rel_err(da, da_ref) <= _tol(dtype, N) and _rel_err(db, db_ref) <= _tol(dtype, M)


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype", [(4096, 4096, 4096, jnp.bfloat16), (1280, 640, 384, jnp.bfloat16),
                                            (384, 4160, 1152, jnp.float16), (4096, 16, 2048, jnp.bfloat16)])
def test_product_on_the_gpu(M, K, N, dtype):
    _check_product(M, K, N, dtype)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (4096, 4096, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1)),
    (4096, 4160, 1024, MosaicGemmConfig()),  # 65 steps; 128 tiles on 132 blocks: four blocks run none
    (16896, 1024, 512, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m")),  # two tiles per block
    (1280, 640, 512, MosaicGemmConfig()),  # 20 tiles: one per block or none
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", stream_k=4))])  # + a stream-K round
@pytest.mark.parametrize("store", ["next_tile", "split"])
def test_output_stored_under_the_next_tile_on_the_gpu(M, K, N, config, store):
    """epilogue_store="next_tile": each tile's output stored under the next tile's first wgmma, the block's last
    after its loop: every tile lands where it belongs, twice in a row (the staging slots' waits across calls).
    "split": the left half at the tile's end, the right half so."""
    config = dataclasses.replace(config, epilogue_store=store)
    for _ in range(2):
        _check_product(M, K, N, jnp.bfloat16, config=config)


@gpu_only
@pytest.mark.parametrize("transpose_a, transpose_b", [(True, False), (False, True), (True, True)])
def test_transposed_reads_on_the_gpu(transpose_a, transpose_b):
    _check_product(1024, 768, 1280, jnp.bfloat16, transpose_a, transpose_b)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (4096, 512, 4096, MosaicGemmConfig(schedule="pingpong", num_stages=6)),  # ~8 tiles per block, 8 k steps
    (2304, 576, 2432, MosaicGemmConfig(schedule="pingpong", num_stages=4, delay_release=2)),  # odd tiles/block
    (1536, 1024, 3072, MosaicGemmConfig(tile_m=64, tile_n=256, schedule="pingpong", delay_release=1)),
])
def test_pingpong_product_on_the_gpu(M, K, N, config):
    _check_product(M, K, N, jnp.bfloat16, config=config)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (4096, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", cluster="m")),
    (2304, 576, 2560, MosaicGemmConfig(cluster="n")),  # 18 x 5 cluster tiles over 66 clusters: unequal counts
    (2560, 512, 2304, MosaicGemmConfig(schedule="pingpong", num_stages=6, delay_release=1, cluster="m")),
    (1280, 768, 2304, MosaicGemmConfig(schedule="pingpong", num_stages=5, delay_release=1, cluster="n")),
])
def test_cluster_product_on_the_gpu(M, K, N, config):
    _check_product(M, K, N, jnp.bfloat16, config=config)


@gpu_only
def test_gradients_on_the_gpu():
    _check_grads(1024, 512, 768, jnp.bfloat16, MosaicGemmConfig(tile_m=64, tile_n=128, wg_split="m"))


@gpu_only
@pytest.mark.parametrize("transpose_a", [False, True])
def test_gradients_with_their_own_default_tiles_on_the_gpu(transpose_a):
    """A short-K forward (the small preset's MLP projection): each gradient GEMM with the default tiles of its own
    shape (the db GEMM's stream-K over M)."""
    M, K, N = 8192, 512, 2816
    a, b = _operands(M, K, N, jnp.bfloat16)
    g = jax.random.normal(_key(), (M, N), jnp.float32).astype(jnp.bfloat16)
    a_in = a.T if transpose_a else a
    _, vjp = jax.vjp(lambda a_in, b: matmul(a_in, b, transpose_a=transpose_a), a_in, b)
    da, db = jax.jit(vjp)(g)
    _, vjp_ref = jax.vjp(_f32_product, a.astype(jnp.float32), b.astype(jnp.float32))
    da_ref, db_ref = vjp_ref(g.astype(jnp.float32))
    da = da.T if transpose_a else da
    assert _rel_err(da, da_ref) <= _tol(jnp.bfloat16, N) and _rel_err(db, db_ref) <= _tol(jnp.bfloat16, M)


@gpu_only
def test_nan_in_an_operand_reaches_the_output():
    a, b = _operands(256, 256, 256, jnp.bfloat16)
    got = jax.jit(matmul)(a.at[3, 5].set(jnp.nan), b)
    assert bool(jnp.all(jnp.isnan(got[3]))) and not bool(jnp.any(jnp.isnan(got[4:])))


@gpu_only
@pytest.mark.parametrize("dtype, config", [(jnp.bfloat16, None), (jnp.float16, None),
                                           (jnp.bfloat16, MosaicGemmConfig(schedule="pingpong", num_stages=5)),
                                           (jnp.bfloat16, MosaicGemmConfig(schedule="pingpong", num_stages=5,
                                                                           delay_release=1, cluster="m"))])
def test_accumulate_into_on_the_gpu(dtype, config):
    """Three chunked updates c += a_iᵀ b_i in a loop (in place) against the float32 sum, rounding once per update;
    the gradient of the accumulated input is the cotangent."""
    M, K, N, chunks = 768, 512, 1280, 3
    a, b = (jax.random.normal(_key(), (chunks * K, n), jnp.float32).astype(dtype) for n in (M, N))  # chunk i: rows
    c0 = jax.random.normal(_key(), (M, N), jnp.float32).astype(dtype) * 10

    @jax.jit
    def run(a, b, c):
        def step(i, c):
            rows = lambda x: jax.lax.dynamic_slice_in_dim(x, i * K, K)  # noqa: E731
            return matmul(rows(a), rows(b), transpose_a=True, accumulate_into=c, config=config)
        return jax.lax.fori_loop(0, chunks, step, c)

    got = run(a, b, c0)
    want = c0.astype(jnp.float32) + _f32_product(a.T, b)
    assert got.dtype == dtype and _rel_err(got, want) <= _tol(dtype, chunks * K) * chunks ** 0.5
    dc = jax.grad(lambda c: jnp.sum(matmul(a[:K], b[:K], transpose_a=True, accumulate_into=c).astype(jnp.float32)
                                    * 3.0))(c0)
    assert bool(jnp.all(dc == 3.0))


_TINY = MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=32, num_stages=2, epi_tile_n=32)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, True)])
def test_product_in_interpret_mode(transpose_a, transpose_b):
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2 blocks walk 4 output tiles
        _check_product(128, 96, 256, jnp.bfloat16, transpose_a, transpose_b, config=_TINY)


_LOOPS_ON_TWO_BLOCKS = (dict(pipeline="own"), dict(pipeline="pallas_steady"),
                        dict(pipeline="pallas", grid_tile_width=1),
                        dict(schedule="pingpong", num_stages=3, delay_release=2),
                        dict(cluster="m"))  # (run without the cluster: the interpreter has none)
_LOOPS_ALSO_ON_ONE_TILE = (dict(pipeline="own", delay_release=1), dict(schedule="pingpong"),
                           dict(schedule="pingpong", delay_release=1), dict(epilogue_store="next_tile"),
                           dict(epilogue_store="next_tile", delay_release=1), dict(epilogue_store="split"))


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("fields, num_sms", [*((f, 2) for f in (*_LOOPS_ON_TWO_BLOCKS, *_LOOPS_ALSO_ON_ONE_TILE)),
                                             *((f, 3) for f in _LOOPS_ALSO_ON_ONE_TILE)])
def test_every_k_loop_in_interpret_mode(fields, num_sms):
    """num_sms 3: one block walks a single tile (its loop starts and stops there), for the loops whose tile
    boundaries hold state (a wgmma group in flight, ping-pong owners, an output carried to the next tile)."""
    with mosaic_utils.interpret_on_cpu(num_sms=num_sms):  # 4 k steps over 2 stages: stage reuse crosses tiles
        _check_product(128, 128, 256, jnp.bfloat16, config=dataclasses.replace(_TINY, **fields))


@cpu_only
@pytest.mark.slow
def test_gradients_in_interpret_mode():
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _check_grads(128, 128, 128, jnp.float16, config=_TINY)


# ---------------------------------------------------------------------------------------------------------------
# Partial columns: a plain product's last column of tiles runs past N (TMA loads zeros there, stores nothing)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, transpose_b, elems", [
    (dict(tile_n=256), False, 64), (dict(tile_n=160, epi_tile_n=32), False, 32),  # 160 = 5 x 32: 64-byte swizzle
    (dict(tile_n=160, epi_tile_n=32), True, 64),  # B read transposed: its rows run along K
    (dict(tile_k=32, tile_n=256), False, 32), (dict(tile_n=48, epi_tile_n=16), False, 16)])
def test_a_and_b_share_the_widest_swizzle_that_tile_k_and_tile_n_allow(fields, transpose_b, elems):
    config = MosaicGemmConfig(tile_m=64, wg_split="m", **fields)
    assert operand_swizzle_elems(config, jnp.bfloat16, transpose_b) == elems


def test_a_plain_product_takes_n_past_its_tiles_and_a_fusion_only_if_it_says_so():
    a, b = S((1024, 512), jnp.bfloat16), S((512, 1088), jnp.bfloat16)  # 1088 = 4 x 256 + 64
    assert jax.eval_shape(lambda a, b: matmul(a, b), a, b).shape == (1024, 1088)
    assert default_config(1024, 1088, 1024).tile_n == 256  # the first long-K candidate, its last tiles partial
    fusion = Fusion(epilogue=lambda ctx, acc, carry: (acc, {}))
    with pytest.raises(ValueError, match="N=1088 is not a positive multiple of the columns of a block's output"):
        jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16, fusion=fusion), a, b)
    ragged = dataclasses.replace(fusion, partial_columns=True)
    out = jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16, fusion=ragged),
                         a, b)
    assert out[0].shape == (1024, 1088)


@cpu_only
def test_partial_columns_lower_with_one_more_column_of_tiles_within_shared_memory():
    M, K, N = 4096, 4096, 14336  # 192-column tiles: 74 whole columns and one of 128 real columns
    config = dataclasses.replace(default_config(M, N, K), tile_n=192)
    (kernel,) = mosaic_ir.lower_kernels(lambda a, b: matmul(a, b, config=config), S((M, K), jnp.bfloat16),
                                        S((K, N), jnp.bfloat16))
    assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert set(kernel.wgmma()) == set(_wgmma_of(config))  # m64n192k16


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("fields, transpose_b, grads", [(dict(tile_n=128), False, True),
                                                       (dict(tile_n=128), True, False),
                                                       (dict(tile_n=160, epi_tile_n=32), False, False)])
def test_partial_columns_in_interpret_mode(fields, transpose_b, grads):
    config = MosaicGemmConfig(tile_m=64, tile_k=64, num_stages=2, wg_split="m", **fields)
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # N = 192: two columns of tiles, the second 64 or 32 real
        _check_product(128, 128, 192, jnp.bfloat16, transpose_b=transpose_b, config=config)
        if grads:  # the gradients pad N to whole tiles
            _check_grads(128, 128, 192, jnp.bfloat16, config=config)


@cpu_only
def test_default_gradients_of_partial_columns_pad_nothing():
    """matmul's default configs take N = 5504 (the last column of tiles 128 of 256 real) in the gradients as they
    are: dA contracts over N in 64-deep steps, dB's last column of tiles runs past N. No pad or slice in the CUDA
    program (each a pass over g or dB through HBM: 126 µs of 841 at 16384x1024x5504 on the H200); a caller's config
    still pads N to whole tiles."""
    M, K, N = 2048, 1024, 5504
    args = (S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((M, N), jnp.bfloat16))

    def program(config):
        fn = lambda a, b, g: jax.vjp(lambda a, b: matmul(a, b, config=config), a, b)[1](g)  # noqa: E731
        with backends.lowering_for_gpu():
            return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    default, given = program(None), program(default_config(M, N, K))
    assert default.count("mosaic_gpu") >= 3 and given.count("mosaic_gpu") >= 3
    assert "stablehlo.pad" not in default and "stablehlo.slice" not in default
    assert "stablehlo.pad" in given


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, False), (False, True)])
def test_default_gradients_of_partial_columns_in_interpret_mode(transpose_a, transpose_b):
    """N = 192: the stacked tiles' second column 64 of 256 real; with b read transposed dB is (N, K), its 192 rows
    in 64-row tiles."""
    M, K, N = 128, 128, 192
    a, b = _operands(M, K, N, jnp.bfloat16)
    g = jax.random.normal(_key(), (M, N), jnp.float32).astype(jnp.bfloat16)
    stored_a, stored_b = (a.T if transpose_a else a), (b.T if transpose_b else b)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _, vjp = jax.vjp(lambda a, b: matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b),
                         stored_a, stored_b)
        da, db = vjp(g)
    da_ref, db_ref = jax.vjp(_f32_product, a.astype(jnp.float32), b.astype(jnp.float32))[1](g.astype(jnp.float32))
    assert _rel_err(da, da_ref.T if transpose_a else da_ref) <= _tol(jnp.bfloat16, N)
    assert _rel_err(db, db_ref.T if transpose_b else db_ref) <= _tol(jnp.bfloat16, M)


@gpu_only
@pytest.mark.parametrize("M, K, N", [(1024, 512, 1088), (2048, 1024, 1216)])  # last columns 64 of 128 / 192 of 256
@pytest.mark.parametrize("transpose_a, transpose_b", [(True, False), (False, True)])
def test_default_gradients_of_partial_columns_read_transposed_on_the_gpu(M, K, N, transpose_a, transpose_b):
    """The default configs' unpadded gradients with an operand read transposed (dA or dB computed from transposed
    reads of g, a and b, dB (N, K) in 64-row tiles with b transposed) against float32, two fresh draws."""
    for _ in range(2):
        a, b = _operands(M, K, N, jnp.bfloat16)
        g = jax.random.normal(_key(), (M, N), jnp.float32).astype(jnp.bfloat16)
        stored = (a.T if transpose_a else a, b.T if transpose_b else b)
        _, vjp = jax.vjp(lambda a, b: matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b), *stored)
        da, db = jax.jit(vjp)(g)
        da_ref, db_ref = jax.vjp(_f32_product, a.astype(jnp.float32), b.astype(jnp.float32))[1](g.astype(jnp.float32))
        assert _rel_err(da, da_ref.T if transpose_a else da_ref) <= _tol(jnp.bfloat16, N)  # NaN fails
        assert _rel_err(db, db_ref.T if transpose_b else db_ref) <= _tol(jnp.bfloat16, M)


@gpu_only
@pytest.mark.parametrize("M, K, N, fields", [
    (1024, 512, 1088, {}),  # the default (ping-pong) tiles, the last column 64 of 128 real
    (2048, 1024, 1088, {}),  # the default (stacked) tiles, the last column 64 of 256 real
    (4096, 4096, 14336, dict(tile_n=192)),  # 75 columns of tiles, the last 128 of 192 real
    (2048, 1024, 1216, dict(tile_n=160, epi_tile_n=32))])  # 64-byte swizzle; last column 96 of 160 real
def test_partial_columns_on_the_gpu(M, K, N, fields):
    config = dataclasses.replace(default_config(M, N, K), **fields)
    _check_product(M, K, N, jnp.bfloat16, config=config)
    if M * N <= 2048 * 1216:
        _check_grads(M, K, N, jnp.bfloat16, config=config)
        if not fields:  # the default configs' gradients, unpadded
            _check_grads(M, K, N, jnp.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Stream-K: the last rounds' tiles split by K steps (gemm.stream_k)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tiles, blocks, k_iters", [(4096, 132, 64), (1376, 132, 32), (180, 132, 16), (4, 132, 32),
                                                    (32, 132, 64), (7, 3, 5), (13, 4, 3), (3, 8, 4)])
@pytest.mark.parametrize("split", [2, 4])
def test_stream_k_plan_sums_every_step_of_every_tile_once(tiles, blocks, k_iters, split):
    plan = stream_k.plan_for(tiles, blocks, k_iters, split)
    rest = tiles % blocks
    pieces = min(split, blocks // rest, k_iters)
    assert plan.dp_rounds == tiles // blocks and plan.units == pieces * rest
    assert plan.rounds <= tiles // blocks + 1 - stream_k.MIN_ROUND_SAVED
    # every unit one range of one tile, aligned: unit u takes range u % pieces of tile u // pieces
    assert all(plan.num_segments(u) == 1 and plan.segment(u, 0)[0] == u // pieces for u in range(plan.units))
    tile_n = 2
    n_iters = 3 if tiles % 3 == 0 else 1
    rng = np.random.default_rng(tiles)
    a = rng.integers(-4, 5, (tiles // n_iters, k_iters)).astype(np.float64)  # 1x1 tiles of (tile_m=1, tile_k=1)
    b = rng.integers(-4, 5, (k_iters, n_iters * tile_n)).astype(np.float64)
    order = lambda lin: divmod(tiles - 1 - lin, n_iters)  # noqa: E731 - any order that visits each tile once
    got = stream_k.emulate(plan, a, b, tile_m=1, tile_n=tile_n, tile_k=1, tile_index=order)
    np.testing.assert_array_equal(got, a @ b)  # integers: exact, NaN (a tile never written) fails


def test_stream_k_segment_steps_is_the_one_static_length_of_aligned_ranges():
    assert stream_k.plan_for(4096, 132, 64, 4).segment_steps == 16  # 4 tiles left, 4 ranges of 16 steps each
    assert stream_k.plan_for(4096, 132, 60, 8).segment_steps is None  # 8 ranges of 7.5 steps
    assert stream_k.StreamKPlan(tiles=5, blocks=4, k_iters=2, dp_rounds=1, units=4).segment_steps is None  # < 1 step


def test_stream_k_kernel_arithmetic_takes_unaligned_ranges_too():
    """The kernel's segments (partial, whole, owned) for ranges that cut tiles anywhere (as 132 units over 76 tiles
    would; the plan does not choose them: they lost on the H100)."""
    plan = stream_k.StreamKPlan(tiles=76 + 3 * 132, blocks=132, k_iters=64, dp_rounds=3, units=132)
    assert plan.max_segments == 2 and any(plan.segment(u, 0)[1] > 0 for u in range(plan.units))
    rng = np.random.default_rng(0)
    a, b = rng.integers(-4, 5, (plan.tiles, 64)).astype(np.float64), rng.integers(-4, 5, (64, 2)).astype(np.float64)
    got = stream_k.emulate(plan, a, b, tile_m=1, tile_n=2, tile_k=1, tile_index=lambda lin: (lin, 0))
    np.testing.assert_array_equal(got, a @ b)


@pytest.mark.parametrize("plan", [
    stream_k.plan_for(688, 132, 64, 4), stream_k.plan_for(160, 132, 10, 4),  # aligned ranges; 2.5 steps each
    stream_k.StreamKPlan(tiles=76 + 3 * 132, blocks=132, k_iters=64, dp_rounds=3, units=132),  # partial + owned
    stream_k.StreamKPlan(tiles=7, blocks=2, k_iters=3, dp_rounds=1, units=2)])  # 7.5 steps: three segments each
@pytest.mark.parametrize("owned_extra", [0, 2])
def test_stream_k_segment_offsets_give_each_unit_contiguous_ring_positions(plan, owned_extra):
    """Every segment's steps and (an owned segment's) tile input positions after them, in segment order: each of the
    unit's unit_positions taken once, as the memory and MMA warpgroups walk them alike."""
    for u in range(plan.units):
        taken = []
        for j in range(plan.num_segments(u)):
            t, k0, k1 = plan.segment(u, j)
            offset = plan.segment_offset(u, j, owned_extra)
            assert offset == len(taken)
            taken += range(offset, offset + k1 - k0 + (owned_extra if k0 == 0 else 0))
        assert taken == list(range(plan.unit_positions(u, owned_extra)))
        assert plan.unit_positions(u) == np.subtract(*plan.unit_range(u)[::-1])
    traced = jax.jit(lambda u, j: (plan.segment_offset(u, j, owned_extra), plan.unit_positions(u, owned_extra)))
    u = plan.units - 1
    assert tuple(map(int, traced(u, plan.num_segments(u) - 1))) == (
        plan.segment_offset(u, plan.num_segments(u) - 1, owned_extra), plan.unit_positions(u, owned_extra))


@pytest.mark.parametrize("tiles, blocks, k_iters", [(1792, 132, 64), (1536, 132, 64), (7, 3, 5), (13, 4, 1)])
def test_stream_k_split_1_runs_the_last_round_whole_through_the_phase(tiles, blocks, k_iters):
    """stream_k=1: the part-empty last round's tiles, one whole tile per unit (no partial sums), in the stream-K
    phase; where rounds are whole, or there is no whole round, nothing is planned."""
    plan = stream_k.plan_for(tiles, blocks, k_iters, 1)
    assert (plan.dp_rounds, plan.units, plan.segment_steps) == (tiles // blocks, tiles % blocks, k_iters)
    assert all(plan.num_segments(u) == 1 and plan.segment(u, 0) == (u, 0, k_iters) for u in range(plan.units))
    assert all(last < first for first, last in map(plan.sources, range(plan.sk_tiles)))  # the owner's range only
    rng = np.random.default_rng(tiles)
    a = rng.integers(-4, 5, (tiles, k_iters)).astype(np.float64)
    b = rng.integers(-4, 5, (k_iters, 2)).astype(np.float64)
    got = stream_k.emulate(plan, a, b, tile_m=1, tile_n=2, tile_k=1, tile_index=lambda lin: (tiles - 1 - lin, 0))
    np.testing.assert_array_equal(got, a @ b)
    assert stream_k.plan_for(2 * blocks, blocks, k_iters, 1) is None and stream_k.plan_for(blocks - 1, blocks,
                                                                                            k_iters, 1) is None


@pytest.mark.parametrize("tiles, blocks, k_iters", [(4224, 132, 64), (256, 132, 512), (130, 132, 1), (263, 132, 64),
                                                    (1792, 132, 64)])
def test_stream_k_plans_nothing_where_rounds_are_whole_or_the_last_half_full(tiles, blocks, k_iters):
    assert stream_k.plan_for(tiles, blocks, k_iters) is None


@pytest.mark.parametrize("fields", [dict(schedule="pingpong"), dict(cluster="m"), dict(pipeline="pallas")])
def test_stream_k_needs_the_cooperative_own_loop_without_a_cluster(fields):
    with pytest.raises(ValueError, match=r"MosaicGemmConfig.stream_k: runs on pipeline 'own'"):
        MosaicGemmConfig(stream_k=1, **fields)
    with pytest.raises(ValueError, match=r"MosaicGemmConfig.stream_k: must be a non-negative int, got -1"):
        MosaicGemmConfig(stream_k=-1)


@cpu_only
@pytest.mark.parametrize("M, K, N, planned", [(32768, 4096, 4096, True), (33792, 4096, 4096, False)])
def test_stream_k_lowers_with_semaphores_and_a_workspace_only_where_planned(M, K, N, planned):
    config = dataclasses.replace(default_config(M, N, K), stream_k=4)
    fn = lambda a, b: matmul(a, b, config=config)  # noqa: E731
    (kernel,) = mosaic_ir.lower_kernels(fn, S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16))
    assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert ("red.release.gpu.global.add" in kernel.text) == planned  # the partial sum's signal
    assert ("atom.relaxed.gpu.global.cas" in kernel.text) == planned  # the owner's wait
    text = jax.jit(fn).trace(S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert ("tensor<16x2x64x256xf32>" in text) == planned  # the partial sums' workspace: 4 tiles on 16 units
    assert jax.eval_shape(fn, S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16)).shape == (M, N)


def test_stream_k_refuses_a_prologue_that_needs_whole_tiles():
    fusion = Fusion(prologue_step=lambda ctx, a_tile, carry: carry, prologue_init=lambda ctx: (), handoff_rows=0)
    with pytest.raises(ValueError, match="stream_k splits tiles along K; a fusion with a prologue_step"):
        jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(stream_k=1), out_dtype=jnp.bfloat16,
                                         fusion=fusion), S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16))


@pytest.mark.parametrize("changes, transpose_a, match", [
    (dict(stream_k=1), False, r"stream_k splits tiles along K; a fusion with a prologue_step, or an a_observe "
                              r"without carry_shapes \(or share_rows\), needs whole tiles"),
    (dict(pipeline="pallas"), False, "a_observe runs it in the MMA warpgroups of the K loop pipeline='own' .* got "
                                     "pipeline='pallas', transpose_a=False"),
    ({}, True, "on an A read as stored, without a prologue_step; got pipeline='own', transpose_a=True")])
def test_a_observe_needs_whole_tiles_of_an_untransposed_a_on_our_k_loop(changes, transpose_a, match):
    fusion = Fusion(a_observe=lambda ctx, a, carry: carry)
    a = S((256, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(**changes), out_dtype=jnp.bfloat16,
                                         transpose_a=transpose_a, fusion=fusion), a, S((256, 512), jnp.bfloat16))


def _row_sums_of_squares(config, M: int) -> Fusion:
    """A fusion whose a_observe sums the squares of its rows of each A block (float32, elementwise over the step's
    columns) and whose epilogue stores their row sums (M,): additive over K steps, so stream-K may split it."""
    def init(ctx):
        return mosaic_utils.layout_cast(jnp.zeros((config.wg_rows, config.tile_k), jnp.float32), mosaic_utils.TILE)

    def observe(ctx, a, sums):
        a = a.astype(jnp.float32)
        return sums + a * a

    return Fusion(outputs=(("sumsq", S((M,), jnp.float32)),), prologue_init=init, a_observe=observe,
                  carry_shapes=((config.wg_rows, config.tile_k),),
                  epilogue=lambda ctx, acc, sums: (acc, {"sumsq": jnp.sum(sums, axis=1)}))


def test_stream_k_passes_the_a_observe_carry_through_a_workspace():
    """Lowered for CUDA: beside the accumulators' (units, 2, 64, 256) float32 workspace, one (units, 2, 64, 64) for
    the sums of squares (16 tiles left over, each on 4 units); carry_shapes that do not match the carry fail."""
    M, K, N = 4352, 1024, 4096
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1, stream_k=4)
    operands = S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16)
    fusion = _row_sums_of_squares(config, M)
    text = jax.jit(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion)).trace(
        *operands).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<64x2x64x256xf32>" in text and "tensor<64x2x64x64xf32>" in text
    wrong = dataclasses.replace(fusion, carry_shapes=((64,),))
    with pytest.raises(ValueError, match=r"carry_shapes=\(\(64,\),\), but the hook carry holds \[\(64, 64\)\]"):
        mosaic_ir.lower_kernels(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=wrong),
                                *operands)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1, stream_k=4)),
    (4352, 640, 4096, MosaicGemmConfig(delay_release=1, stream_k=2)),  # wg_split "n": both warpgroups sum all rows
])
def test_stream_k_adds_the_a_observe_carry_on_the_gpu(M, K, N, config):
    assert stream_k.plan_for(M // config.cta_m * (N // config.cta_n), mosaic_utils.num_sms(), K // config.tile_k,
                             config.stream_k)
    a, b = _operands(M, K, N, jnp.bfloat16)
    fusion = _row_sums_of_squares(config, M)
    for _ in range(2):  # the semaphores persist across calls
        got, sumsq = jax.jit(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion))(a, b)
        assert _rel_err(got, _f32_product(a, b)) <= _tol(jnp.bfloat16, K)
        want = jnp.sum(jnp.square(a.astype(jnp.float32)), axis=1)
        assert _rel_err(sumsq, want) <= 1e-5


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (2304, 1024, 2560, dataclasses.replace(default_config(2304, 2560, 1024), stream_k=4)),  # 180 tiles: 48 split
    (256, 2048, 512, dataclasses.replace(default_config(256, 512, 2048), stream_k=4)),  # 4 tiles on 16 units
    (4352, 640, 4096, MosaicGemmConfig(delay_release=1, stream_k=2)),  # 17x16 tiles: 2 rounds + 8 on 16 units
    (1024, 8192, 1280, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", stream_k=3)),  # 40 tiles, 120 units
    (4352, 1040, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, tile_k=16, wg_split="m", stream_k=2)),  # 65 steps
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1, epilogue_store="split",
                                        stream_k=1)),  # 34x16 tiles: 4 rounds, then 16 whole tiles in the phase
])
def test_stream_k_product_on_the_gpu(M, K, N, config):
    assert stream_k.plan_for(M // config.cta_m * (N // config.cta_n), mosaic_utils.num_sms(), K // config.tile_k,
                             config.stream_k)
    for _ in range(3):  # the semaphores persist across calls: each call must leave them at zero
        _check_product(M, K, N, jnp.bfloat16, config=config)


@gpu_only
def test_stream_k_gradients_on_the_gpu():
    """The forward and both gradient GEMMs (32 tiles each, on 128 blocks) split by K steps."""
    config = dataclasses.replace(default_config(1024, 1024, 1024), stream_k=4)
    assert stream_k.plan_for(32, mosaic_utils.num_sms(), 1024 // config.tile_k, 4).units == 128
    _check_grads(1024, 1024, 1024, jnp.bfloat16, config)


@gpu_only
def test_stream_k_accumulate_into_on_the_gpu():
    M, K, N = 2304, 1024, 2560
    config = dataclasses.replace(default_config(M, N, K, accumulate_dtype=jnp.float32), stream_k=2)  # 48 tiles on 96
    a, b = _operands(M, K, N, jnp.bfloat16)
    c = jax.random.normal(_key(), (M, N), jnp.float32)
    got = jax.jit(lambda a, b, c: matmul(a, b, accumulate_into=c, config=config))(a, b, c)
    assert _rel_err(got, c + _f32_product(a, b)) <= _tol(jnp.bfloat16, K)


# ---------------------------------------------------------------------------------------------------------------
# Fusion.a_operand: the MMA warpgroups transform their rows of each A block in registers and wgmma reads them there
# ---------------------------------------------------------------------------------------------------------------
def _scaled_a(config, M: int, squares_in: str = "operand") -> Fusion:
    """A fusion whose a_operand multiplies A by a (K,) step vector "g" over its columns (in A's dtype), and which
    sums the squares of the loaded rows, stored as row sums (M,), in the a_operand or (``squares_in="observe"``) in
    an a_observe after the wgmma's issue (which loads the block again): a wrong step, vector slice or register block
    shows."""
    sums = _row_sums_of_squares(config, M)  # its zero carry, elementwise squares and row-sum epilogue
    add_squares = sums.a_observe

    def operand(ctx, a, vectors, carry):
        scaled = a * jax.lax.broadcast_in_dim(vectors["g"], a.shape, [1])
        return scaled, add_squares(ctx, a, carry) if squares_in == "operand" else carry

    return dataclasses.replace(sums, step_inputs=("g",), a_operand=operand,  # carry_shapes: sums add (stream-K)
                               a_observe=add_squares if squares_in == "observe" else None)


def _check_a_operand(M, K, N, config, calls=1, squares_in="operand", transpose_a=False):
    """``transpose_a``: A given (K, M) and read transposed (its blocks loaded through the transposed layout)."""
    a, b = _operands(M, K, N, jnp.bfloat16)
    g = (1.0 + 0.5 * jax.random.normal(_key(), (K,), jnp.float32)).astype(jnp.bfloat16)
    want = _f32_product((a.astype(jnp.float32) * g.astype(jnp.float32)).astype(jnp.bfloat16), b)
    fn = jax.jit(lambda a, b, g: gemm(a.T if transpose_a else a, b, config=config, out_dtype=jnp.bfloat16,
                                      transpose_a=transpose_a, fusion=_scaled_a(config, M, squares_in),
                                      arrays=dict(g=g)))
    for _ in range(calls):
        got, sumsq = fn(a, b, g)
        assert _rel_err(got, want) <= _tol(jnp.bfloat16, K)  # NaN fails
        assert _rel_err(sumsq, jnp.sum(jnp.square(a.astype(jnp.float32)), axis=1)) <= 1e-5


@pytest.mark.parametrize("config_changes, fusion_changes, transpose_a, match", [
    ({}, dict(outputs=(("sumsq", S((256,), jnp.float32)), ("a2", S((256, 256), jnp.bfloat16))),
          a_copy=("a2", lambda ctx, a, carry: a)), False,
     "a fusion with an a_operand takes no a_copy; got a_copy='a2'"),
    (dict(pipeline="pallas"), {}, False, "a_operand runs it in the MMA warpgroups of the K loop pipeline='own'"),
    ({}, dict(a_observe=lambda ctx, a, carry: carry), True,
     "a_observe runs it .* on an A read as stored, .* got pipeline='own', transpose_a=True"),
    ({}, dict(a_operand=None), False, r"step_inputs=\('g',\) are read by an a_operand only")])
def test_a_operand_needs_our_k_loop_and_no_a_copy(config_changes, fusion_changes, transpose_a, match):
    config = MosaicGemmConfig(**config_changes)
    fusion = dataclasses.replace(_scaled_a(config, 256), **fusion_changes)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a, b, g: gemm(a, b, config=config, out_dtype=jnp.bfloat16, transpose_a=transpose_a,
                                            fusion=fusion, arrays=dict(g=g)),
                       S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16), S((256,), jnp.bfloat16))


def test_a_operand_takes_an_a_read_transposed():
    config = MosaicGemmConfig()
    out = jax.eval_shape(lambda a, b, g: gemm(a, b, config=config, out_dtype=jnp.bfloat16, transpose_a=True,
                                              fusion=_scaled_a(config, 256), arrays=dict(g=g)),
                         S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16), S((256,), jnp.bfloat16))
    assert out[0].shape == (256, 512)


@cpu_only
@pytest.mark.parametrize("fields", [dict(tile_m=64, tile_n=256, wg_split="m", delay_release=1),
                                    dict(schedule="pingpong", delay_release=1)], ids=["stacked", "pingpong"])
def test_a_operand_on_an_a_read_transposed_lowers_through_the_transposed_layout(fields):
    """Lowered for CUDA: A (K, M) read transposed: each warpgroup's rows of the (tile_k, rows) block load in the
    transposed register layout, then one butterfly shuffle and one byte permute per register bring them to the
    accumulator layout that wgmma reads A from ({$..} operands, not a descriptor); read as stored, no shuffle."""
    config = MosaicGemmConfig(**fields)
    M, K, N = 2048, 1024, 2048
    shuffles = {}
    for transpose_a in (False, True):
        fn = lambda a, b, g, t=transpose_a: gemm(a, b, config=config, out_dtype=jnp.bfloat16,  # noqa: E731
                                                 transpose_a=t, fusion=_scaled_a(config, M), arrays=dict(g=g))
        a = S((K, M) if transpose_a else (M, K), jnp.bfloat16)
        (kernel,) = mosaic_ir.lower_kernels(fn, a, S((K, N), jnp.bfloat16), S((K,), jnp.bfloat16))
        wgmma = [line for line in kernel.text.splitlines() if "wgmma.mma_async" in line]
        assert wgmma and all(re.search(r"bf16 \{\$\d+(,\$\d+)*\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}, \$\d+",
                                       line) for line in wgmma)
        shuffles[transpose_a] = kernel.text.count("prmt.b32")  # (each beside a butterfly nvvm.shfl.sync)
    assert shuffles[False] == 0 and shuffles[True] >= 32, shuffles


def test_a_operand_step_input_must_run_along_k():
    config = MosaicGemmConfig()
    with pytest.raises(ValueError, match=r"step input 'g' must have shape \(256,\) .* got \(512,\)"):
        jax.eval_shape(lambda a, b, g: gemm(a, b, config=config, out_dtype=jnp.bfloat16,
                                            fusion=_scaled_a(config, 256), arrays=dict(g=g)),
                       S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16), S((512,), jnp.bfloat16))


def test_a_operand_takes_stream_k_ranges_of_one_length_only():
    """4 tiles on 3 blocks: one tile left over, cut into 3 ranges of its 4 K steps (2, 1, 1 steps): the unrolled
    K loop of an a_operand needs one static length; stream_k=2 (2 ranges of 2 steps) takes it."""
    def fn(a, b, g, split):
        return gemm(a, b, config=MosaicGemmConfig(stream_k=split), out_dtype=jnp.bfloat16,
                    fusion=_scaled_a(MosaicGemmConfig(), 256), arrays=dict(g=g), num_sms=3)

    operands = S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16), S((256,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"a_operand unrolls its K loop in static groups, so stream-K's ranges must "
                                         r"be equal and within one tile: stream_k=3 cuts 1 tiles of 4 steps over 3 "
                                         r"blocks; take a split that divides 4, or stream_k=0"):
        jax.eval_shape(lambda a, b, g: fn(a, b, g, 3), *operands)
    assert jax.eval_shape(lambda a, b, g: fn(a, b, g, 2), *operands)[0].shape == (256, 512)


@cpu_only
def test_a_operand_lowers_with_stream_k_segments_in_register_blocks():
    """Lowered for CUDA at 4352x1024x4096 (16 tiles left over, 4 ranges of 4 steps each): the stream-K workspace
    beside the output, wgmma reading A from registers in the rounds' K loop and in the segments' (two register
    blocks per iteration with one group in flight), and the sums of squares' partial carries (carry_shapes)."""
    M, K, N = 4352, 1024, 4096
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1, stream_k=4)
    fusion = _scaled_a(config, M)

    def fn(a, b, g):
        return gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion, arrays=dict(g=g))

    operands = S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((K,), jnp.bfloat16)
    text = jax.jit(fn).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<64x2x64x256xf32>" in text and "tensor<64x2x64x64xf32>" in text
    (kernel,) = mosaic_ir.lower_kernels(fn, *operands)
    wgmma = [line for line in kernel.text.splitlines() if "wgmma.mma_async" in line]
    assert len(wgmma) >= 2 * 2 * 4 and all(re.search(r"bf16 \{\$\d+(,\$\d+)*\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}",
                                                      line) for line in wgmma)


@cpu_only
@pytest.mark.parametrize("delay_release, steps_per_iteration", [(0, 1), (1, 2), (2, 3)])
def test_a_operand_gives_each_step_in_flight_its_own_registers(delay_release, steps_per_iteration):
    """Lowered for CUDA: wgmma reads A from registers ({$..} operands, not a shared-memory descriptor), and the K
    loop's body holds delay_release + 1 steps (4 wgmma each at 64x256 with tile_k 64), so no register block is
    loaded again while its wgmma may still read it; 32 steps leave 32 % (delay_release + 1) steps after the loop."""
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=delay_release, num_stages=4)
    M, K, N = 4096, 2048, 4096
    fn = lambda a, b, g: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_scaled_a(config, M),  # noqa: E731
                              arrays=dict(g=g))
    (kernel,) = mosaic_ir.lower_kernels(fn, S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((K,), jnp.bfloat16))
    rest = 32 % steps_per_iteration
    assert kernel.wgmma() == {"m64n256k16 f32 += bf16 x bf16": 4 * (steps_per_iteration + rest)}
    wgmma = [line for line in kernel.text.splitlines() if "wgmma.mma_async" in line]
    assert wgmma and all(re.search(r"bf16 \{\$\d+(,\$\d+)*\}, \{\$\d+,\$\d+,\$\d+,\$\d+\}, \$\d+", line)
                         for line in wgmma)  # accumulator {..}, A in four registers {..}, B's descriptor
    assert kernel.tma_loads() == 3 and kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES  # A, B and g's slice


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("fields, squares_in", [
    (dict(delay_release=0), "operand"), (dict(delay_release=1), "operand"),
    (dict(wg_split="m", delay_release=1), "observe"), (dict(num_stages=3, delay_release=2), "observe"),
    (dict(schedule="pingpong", delay_release=1), "operand")])
def test_a_operand_in_interpret_mode(fields, squares_in):
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 5 steps: an odd count leaves steps after the paired loop
        _check_a_operand(128, 160, 256, dataclasses.replace(_TINY, **fields), squares_in=squares_in)
        if squares_in == "operand":  # (the interpreter reads the transposed A materialized)
            _check_a_operand(128, 160, 256, dataclasses.replace(_TINY, **fields), transpose_a=True)


@gpu_only
@pytest.mark.parametrize("M, K, N, config, squares_in", [
    (4096, 4096, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1),
     "operand"),
    (4096, 4096, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1),
     "observe"),
    (2048, 1088, 2048, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1), "operand"),  # 17 steps
    (2048, 1024, 2048, MosaicGemmConfig(delay_release=1), "observe"),  # wg_split "n": both warpgroups load all rows
    (2048, 1024, 2048, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=4, delay_release=2),
     "operand"),
    (2048, 1024, 2048, MosaicGemmConfig(schedule="pingpong", delay_release=1), "operand"),
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1, stream_k=4),
     "operand"),  # 16 tiles left over, 4 ranges of 4 steps each; the sums' partial carries added
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=0, stream_k=4),
     "observe")])
def test_a_operand_on_the_gpu(M, K, N, config, squares_in):
    """With one or two wgmma groups in flight: a register block rewritten under its wgmma gave wrong products."""
    _check_a_operand(M, K, N, config, calls=2, squares_in=squares_in)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (2048, 1024, 2048, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1)),
    (2048, 1088, 2048, MosaicGemmConfig(delay_release=1)),  # wg_split "n": both warpgroups load all rows; 17 steps
    (2048, 1024, 2048, MosaicGemmConfig(schedule="pingpong", delay_release=1)),
    (2048, 1024, 2048, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=4, delay_release=2))])
def test_a_operand_on_an_a_read_transposed_on_the_gpu(M, K, N, config):
    """A (K, M) read transposed: the products of its rows scaled by g, and their sums of squares (the registers the
    a_operand received are A's rows, not its columns)."""
    _check_a_operand(M, K, N, config, calls=2, transpose_a=True)


# ---------------------------------------------------------------------------------------------------------------
# MosaicGemmConfig.tile_input_in="ring": the epilogue's tile input loaded into two B stages after the K loop
# ---------------------------------------------------------------------------------------------------------------
def _added_tile(M: int, col_blocks: int = 1) -> Fusion:
    """A fusion whose epilogue adds its tile input "c" to the product, stores the result from c's SMEM (store_in)
    and writes the row sums of acc ⊙ c over each column block's columns ("dot", (col_blocks, M)): a wrong, stale
    or overwritten tile input shows in both."""
    def epilogue(ctx, acc, carry):
        c = ctx.load_tile("c")
        return acc + c, {"dot": jnp.sum(acc * c, axis=1)}

    return Fusion(tile_inputs=("c",), store_in="c", outputs=(("dot", S((col_blocks, M), jnp.float32)),),
                  epilogue=epilogue)


def _check_ring_input(M, K, N, config, calls=1, transpose_a=False, transpose_b=False):
    a, b = _operands(M, K, N, jnp.bfloat16)
    c = jax.random.normal(_key(), (M, N), jnp.float32).astype(jnp.bfloat16)
    blocks = N // config.tile_n
    fn = jax.jit(lambda a, b, c: gemm(a.T if transpose_a else a, b.T if transpose_b else b, config=config,
                                      out_dtype=jnp.bfloat16, transpose_a=transpose_a, transpose_b=transpose_b,
                                      fusion=_added_tile(M, blocks), arrays=dict(c=c)))
    product = _f32_product(a, b)
    want_dot = jnp.sum((product * c.astype(jnp.float32)).reshape(M, blocks, -1), axis=2).T
    for _ in range(calls):
        got, dot = fn(a, b, c)
        assert _rel_err(got, product + c.astype(jnp.float32)) <= _tol(jnp.bfloat16, K)  # NaN fails
        assert _rel_err(dot, want_dot) <= _tol(jnp.bfloat16, K)


_RING = MosaicGemmConfig(tile_m=64, tile_n=256, tile_k=64, num_stages=4, wg_split="m", tile_input_in="ring")


@pytest.mark.parametrize("fields, match", [
    (dict(wg_split="n"), "tile_input_in: 'ring' puts each warpgroup's .* got tile_m=64, tile_k=64, wg_split='n'"),
    (dict(tile_k=32), "it needs tile_m == tile_k, .* got tile_m=64, tile_k=32"),
    (dict(cluster="m"), "and no cluster; .* cluster='m'"),
    (dict(schedule="pingpong", tile_m=128, tile_n=128, tile_k=128), "schedule='pingpong'")])
def test_ring_tile_input_needs_the_b_stage_shape_and_cooperative_tiles(fields, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(_RING, **fields)


@pytest.mark.parametrize("fusion, arrays, transpose_b, match", [
    (Fusion(tile_inputs=("c", "d"), store_in="c"), ("c", "d"), False, r"exactly one.* tile_inputs=\('c', 'd'\)"),
    (Fusion(tile_inputs=("c",)), ("c",), True, "store_in=None")])
def test_ring_tile_input_is_the_one_store_in_tile_of_b_s_dtype(fusion, arrays, transpose_b, match):
    with pytest.raises(ValueError, match="tile_input_in='ring' loads the one tile input, the output's store_in, into "
                                         "B stages .*" + match):
        jax.eval_shape(lambda a, b, **arr: gemm(a, b, config=_RING, out_dtype=jnp.bfloat16, transpose_b=transpose_b,
                                                fusion=fusion, arrays=arr),
                       S((256, 256), jnp.bfloat16), S((256, 256), jnp.bfloat16),
                       **{n: S((256, 256), jnp.bfloat16) for n in arrays})


def _lowered_added_tile(M: int, K: int, N: int, config: MosaicGemmConfig):
    """The kernel of ``_added_tile``'s fused GEMM at MxKxN (bfloat16), lowered for CUDA."""
    operands = S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((M, N), jnp.bfloat16)
    (kernel,) = mosaic_ir.lower_kernels(
        lambda a, b, c: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_added_tile(M, N // 256),
                             arrays=dict(c=c)), *operands)
    return kernel


@cpu_only
def test_ring_tile_input_takes_no_shared_memory_of_its_own():
    """Lowered for CUDA at 4096x4096x4096: the 64 KiB tile buffer gone (with 3 stages; with 4, which the buffer
    leaves no room for, the stages and barriers only), and the tile's prefetch replaced by the halves' loads."""
    lowered = functools.partial(_lowered_added_tile, 4096, 4096, 4096)
    three = dataclasses.replace(_RING, num_stages=3)
    ring, buffer = lowered(three), lowered(dataclasses.replace(three, tile_input_in="buffer"))
    assert 0 <= buffer.smem_bytes - ring.smem_bytes - 2 * 64 * 256 * 2 <= 64  # (and the buffer's barriers)
    assert (ring.tma_loads(), buffer.tma_loads()) == (6, 3)  # A, B, each warpgroup's two halves; A, B, the prefetch
    assert lowered(_RING).smem_bytes <= smem_bytes(_RING, jnp.bfloat16, jnp.bfloat16, tile_input_dtypes=(
        jnp.bfloat16,), store_in_tile=True) + 1024 <= mosaic_utils.H100_SMEM_BYTES


@cpu_only
def test_ring_tile_input_with_b_read_transposed_shares_the_b_stages_memory():
    """B given as (N, K) (the rmsnorm_matmul dx kernel's w): the halves go into a second view of the B stages
    (plgpu.RefUnion), so the kernel takes the shared memory and TMA loads of B read as stored."""
    M, K, N = 4096, 4096, 4096

    def lowered(transpose_b):
        operands = S((M, K), jnp.bfloat16), S((N, K) if transpose_b else (K, N), jnp.bfloat16), S((M, N), jnp.bfloat16)
        (kernel,) = mosaic_ir.lower_kernels(
            lambda a, b, c: gemm(a, b, config=_RING, out_dtype=jnp.bfloat16, transpose_b=transpose_b,
                                 fusion=_added_tile(M, N // 256), arrays=dict(c=c)), *operands)
        return kernel

    transposed, stored = lowered(True), lowered(False)
    assert transposed.smem_bytes == stored.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert transposed.tma_loads() == stored.tma_loads() == 6


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("M, K, N, fields, transpose_a, transpose_b", [
    (512, 256, 64, dict(num_stages=2), False, False),  # 4 tiles on 2 blocks, 4 steps each: the slots wrap the ring
    (384, 320, 64, dict(num_stages=3, delay_release=1), True, False),  # 5 steps, one group in flight; A transposed
    (256, 256, 128, dict(num_stages=2), False, True)])  # B given transposed (the interpreter reads it as stored)
def test_ring_tile_input_in_interpret_mode(M, K, N, fields, transpose_a, transpose_b):
    config = dataclasses.replace(_RING, tile_n=64, epi_tile_n=32, **fields)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _check_ring_input(M, K, N, config, transpose_a=transpose_a, transpose_b=transpose_b)


@gpu_only
@pytest.mark.parametrize("M, K, N, config, transpose_a, transpose_b", [
    (4096, 4096, 4096, _RING, False, False),
    (4096, 4096, 14336, dataclasses.replace(_RING, grid_minor="m", num_stages=4), True, False),  # the dw GEMM's form
    (2048, 640, 1024, dataclasses.replace(_RING, num_stages=3, delay_release=1), False, False),  # 10 steps, 1 in flight
    (1024, 128, 512, dataclasses.replace(_RING, num_stages=2), False, False),  # 2 steps: every slot turns over
    (4096, 4096, 4096, dataclasses.replace(_RING, grid_minor="m", num_stages=3), False, True),  # the dx GEMM's form
    (1024, 128, 512, dataclasses.replace(_RING, num_stages=2), False, True)])
def test_ring_tile_input_on_the_gpu(M, K, N, config, transpose_a, transpose_b):
    """Two calls each (the barriers' phases carry over tiles, not calls)."""
    _check_ring_input(M, K, N, config, calls=2, transpose_a=transpose_a, transpose_b=transpose_b)


@cpu_only
def test_ring_tile_input_beside_stream_k_lowers_in_the_same_shared_memory():
    """Lowered for CUDA at 2048x4096x11008 (688 tiles: 28 left over, each cut into 4 ranges of 16 steps): the
    owners load their tile input into the ring as the whole rounds' tiles do, so stream-K adds its semaphores and
    no shared memory."""
    lowered = functools.partial(_lowered_added_tile, 2048, 4096, 11008)
    whole, split = lowered(_RING), lowered(dataclasses.replace(_RING, stream_k=4))
    assert split.smem_bytes == whole.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert "red.release.gpu.global.add" in split.text and "red.release.gpu.global.add" not in whole.text


@gpu_only
@pytest.mark.parametrize("M, K, N, config, transpose_a, transpose_b", [
    (2048, 4096, 11008, dataclasses.replace(_RING, grid_minor="m"), True, False),  # the dw GEMM's form at the 1b MLP
    (2048, 640, 2560, dataclasses.replace(_RING, num_stages=3, delay_release=1), False, False),  # 160 tiles, 10 steps:
    # ranges of 2.5 steps, three of each tile's four starting mid-tile
    (8704, 4096, 4096, dataclasses.replace(_RING, grid_minor="m", num_stages=3), False, True)])  # the dx GEMM's form
def test_ring_tile_input_beside_stream_k_on_the_gpu(M, K, N, config, transpose_a, transpose_b):
    """The last round's tiles cut by K steps (stream_k=4), each owner's tile input loaded into the two ring
    positions after its own range: the product plus the input and the row sums against float32, two calls."""
    _check_ring_input(M, K, N, dataclasses.replace(config, stream_k=4), calls=2, transpose_a=transpose_a,
                      transpose_b=transpose_b)


# ---------------------------------------------------------------------------------------------------------------
# Fusion.a_copy: the MMA warpgroups write each A block, transformed, into an (M, K) output
# ---------------------------------------------------------------------------------------------------------------
def _doubled_a(M: int, K: int) -> Fusion:
    """A fusion whose a_copy writes 2·A (exact in bfloat16: a wrong block, row or step shows as a mismatch)."""
    return Fusion(outputs=(("a2", S((M, K), jnp.bfloat16)),),
                  a_copy=("a2", lambda ctx, a, carry: a.astype(jnp.float32) * 2.0))


@pytest.mark.parametrize("fusion_changes, transpose_a, match", [
    ({}, True, "a fusion with an a_copy runs it in the MMA warpgroups .* got pipeline='own', transpose_a=True"),
    (dict(outputs=(("a2", S((256, 512), jnp.bfloat16)),)), False,
     r"a_copy='a2' must name an output of A's shape \(256, 256\) and a 16-bit dtype, got \(\(256, 512\)"),
    (dict(outputs=()), False, "a_copy='a2' must name an output .* got None")])
def test_a_copy_needs_an_output_like_a_and_our_k_loop(fusion_changes, transpose_a, match):
    fusion = dataclasses.replace(_doubled_a(256, 256), **fusion_changes)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a, b: gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16,
                                         transpose_a=transpose_a, fusion=fusion),
                       S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16))


def _check_a_copy(M, K, N, config, calls=2):
    a, b = _operands(M, K, N, jnp.bfloat16)
    for _ in range(calls):
        got, a2 = jax.jit(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16,
                                            fusion=_doubled_a(M, K)))(a, b)
        assert _rel_err(got, _f32_product(a, b)) <= _tol(jnp.bfloat16, K)
        np.testing.assert_array_equal(np.asarray(a2, np.float32), 2 * np.asarray(a, np.float32))


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("fields", [dict(wg_split="m"), dict(wg_split="n"), dict(schedule="pingpong")])
def test_a_copy_in_interpret_mode(fields):
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2 column blocks (1 with pingpong) over 4 steps
        _check_a_copy(128, 128, 128, dataclasses.replace(_TINY, **fields), calls=1)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (2048, 4096, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=3)),  # 16 column blocks
    (2048, 1024, 512, MosaicGemmConfig(num_stages=3)),  # wg_split "n": 4 column blocks of 16 steps
    (1024, 256, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=3)),  # 4 steps, 16 blocks
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=3, stream_k=4)),
    (2048, 1024, 2048, MosaicGemmConfig(schedule="pingpong", delay_release=1))])
def test_a_copy_on_the_gpu(M, K, N, config):
    _check_a_copy(M, K, N, config)


# ---------------------------------------------------------------------------------------------------------------
# Fusion.tile_copy: a second (M, N) output staged in the store_in tile input's buffer
# ---------------------------------------------------------------------------------------------------------------
def _copied_tile(M: int, N: int) -> Fusion:
    """out = A @ B + C stored from C's buffer, and 2·C (exact in bfloat16) copied out through the same buffer first:
    a copy at the wrong place, or an output written over the buffer before the copy has left it, shows as a
    mismatch."""
    return Fusion(tile_inputs=("c",), store_in="c", outputs=(("c2", S((M, N), jnp.bfloat16)),),
                  epilogue=lambda ctx, acc, carry: (acc + ctx.load_tile("c"), {}),
                  tile_copy=("c2", lambda ctx, carry: 2.0 * ctx.load_tile("c")))


@pytest.mark.parametrize("fusion_changes, match", [
    (dict(store_in=None), "tile_copy='c2' is staged in the store_in tile input's buffer: .* got store_in=None"),
    (dict(outputs=(("c2", S((256, 256), jnp.float32)),)), r"got store_in='c', \(\(256, 256\), dtype\('float32'\)\)"),
    (dict(outputs=()), "tile_copy='c2' .* got store_in='c', None")])
def test_tile_copy_needs_a_store_in_buffer_and_an_output_like_the_product(fusion_changes, match):
    fusion = dataclasses.replace(_copied_tile(256, 256), **fusion_changes)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a, b, c: gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16, fusion=fusion,
                                            arrays=dict(c=c)),
                       S((256, 256), jnp.bfloat16), S((256, 256), jnp.bfloat16), S((256, 256), jnp.bfloat16))


def _check_tile_copy(M, K, N, config, calls=2):
    a, b = _operands(M, K, N, jnp.bfloat16)
    c = jax.random.normal(_key(), (M, N), jnp.float32).astype(jnp.bfloat16)
    for _ in range(calls):
        got, c2 = jax.jit(lambda a, b, c: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_copied_tile(M, N),
                                               arrays=dict(c=c)))(a, b, c)
        assert _rel_err(got, _f32_product(a, b) + c.astype(jnp.float32)) <= _tol(jnp.bfloat16, K)
        np.testing.assert_array_equal(np.asarray(c2, np.float32), 2 * np.asarray(c, np.float32))


@cpu_only
@pytest.mark.slow
def test_tile_copy_in_interpret_mode():
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2 blocks over 4 output tiles of 4 steps
        _check_tile_copy(128, 128, 128, dataclasses.replace(_TINY, wg_split="m"), calls=1)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (2048, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=3)),  # C in a buffer
    (2048, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=4,
                                        tile_input_in="ring")),  # C through the B stages
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=3, stream_k=4))])
def test_tile_copy_on_the_gpu(M, K, N, config):
    _check_tile_copy(M, K, N, config)


# ---------------------------------------------------------------------------------------------------------------
# A prologue in the memory warpgroup (MosaicGemmConfig.prologue_in="memory")
# ---------------------------------------------------------------------------------------------------------------
def _row_sums(M: int) -> Fusion:
    """A prologue summing each row of A over K (float32, per step of tile_k columns) and an epilogue storing the
    sums (M,) beside the product: a step summed twice, skipped or taken from the wrong tile shows as a mismatch."""
    def step(ctx, a_ref, sums):
        del ctx
        return sums + jnp.sum(mosaic_utils.load(a_ref, layout=mosaic_utils.TILE).astype(jnp.float32), axis=1)

    return Fusion(outputs=(("sums", S((M,), jnp.float32)),), handoff_rows=1,
                  prologue_init=lambda ctx: mosaic_utils.layout_cast(jnp.zeros((ctx.config.cta_m,), jnp.float32),
                                                                     mosaic_utils.ROWS),
                  prologue_step=step, epilogue=lambda ctx, acc, sums: (acc, {"sums": sums}))


def _check_row_sums(M, K, N, config, calls=2):
    a, b = _operands(M, K, N, jnp.bfloat16)
    for _ in range(calls):
        got, sums = jax.jit(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_row_sums(M)))(a, b)
        assert _rel_err(got, _f32_product(a, b)) <= _tol(jnp.bfloat16, K)
        want = np.asarray(a, np.float64).sum(axis=1)
        np.testing.assert_allclose(np.asarray(sums, np.float64), want, rtol=0, atol=1e-5 * K ** 0.5)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("fields, num_sms", [
    (dict(wg_split="m", prologue_in="memory"), 2), (dict(wg_split="n", prologue_in="memory"), 2),
    (dict(wg_split="n", prologue_in="fourth"), 2),
    (dict(wg_split="m", prologue_in="memory", num_stages=3), 3)])  # 3: one block walks a single tile, its last steps
# after the loop; each stage count (the memory warpgroup's lag) and each block count once
def test_prologue_in_interpret_mode(fields, num_sms):
    with mosaic_utils.interpret_on_cpu(num_sms=num_sms):  # 4 output tiles of 4 steps (2 with 3 stages: 4 steps)
        _check_row_sums(128, 128, 256, dataclasses.replace(_TINY, **fields), calls=1)


@cpu_only
def test_the_memory_warpgroups_prologue_lowers_with_stacked_tiles():
    """Three warpgroups (no fourth for the prologue), 64x256 wgmma per warpgroup, within shared memory."""
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=4, prologue_in="memory")
    fn = lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_row_sums(4096))  # noqa: E731
    (kernel,) = mosaic_ir.lower_kernels(fn, S((4096, 2048), jnp.bfloat16), S((2048, 4096), jnp.bfloat16))
    assert kernel.warpgroups == 3 and kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES and kernel.tma_loads() >= 2


def test_the_memory_warpgroups_prologue_keeps_registers_within_the_launch():
    """setmaxnreg moves registers within the block's launch allocation (168 per thread with three warpgroups):
    MMA and memory add up to 504, and the memory warpgroup keeps enough for the prologue."""
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", prologue_in="memory", mma_registers=232)
    fn = lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_row_sums(4096))  # noqa: E731
    with pytest.raises(ValueError, match="mma_registers=232 leaves the memory warpgroup running the prologue 40 "
                                         r"registers \(needs >= 56: mma_registers <= 224\)"):
        jax.eval_shape(fn, S((4096, 2048), jnp.bfloat16), S((2048, 4096), jnp.bfloat16))
    from pallas_kernels.gemm import specialized
    for mma_registers, want in ((0, (216, 72, 0)), (224, (224, 56, 0)), (168, (168, 168, 0))):
        shape = types.SimpleNamespace(cfg=dataclasses.replace(config, mma_registers=mma_registers),
                                      fusion=_row_sums(4096))
        assert specialized.registers(shape) == want


@pytest.mark.parametrize("changes, fusion_with_prologue, want, match", [
    (dict(epilogue_in="fourth", mma_registers=176), False, (176, 40, 120), None),
    (dict(epilogue_in="fourth"), False, (184, 40, 104), None),
    # the fourth's 136 would be an increase from the launch's 128: an illegal instruction on the H200
    (dict(epilogue_in="fourth", mma_registers=168), False, None, r"4 warpgroups launch with 128 .* fourth 136\); "
                                                                  r"allowed: mma_registers >= 176"),
    (dict(epilogue_in="fourth", mma_registers=232), False, None, "leaves the epilogue warpgroup 8 registers"),
    (dict(wg_split="n", mma_registers=168), True, None, "allowed: mma_registers >= 176"),
    (dict(wg_split="n", mma_registers=176), True, (176, 40, 120), None),
    (dict(), False, (232, 40, 0), None),
    (dict(mma_registers=168), False, (168, 40, 0), None),
])
def test_register_splits_stay_on_setmaxnregs_side_of_the_launch(changes, fusion_with_prologue, want, match):
    """The MMA warpgroups' count is an increase from the launch's (168 a thread with three warpgroups, 128 with
    four) and the others' decreases: a split that needs otherwise is refused with the bound, not faulted."""
    from pallas_kernels.gemm import specialized
    base = MosaicGemmConfig(tile_m=128, tile_n=128, wg_split="n", tile_input_in="buffer", num_stages=3)
    shape = types.SimpleNamespace(cfg=dataclasses.replace(base, **changes),
                                  fusion=_row_sums(4096) if fusion_with_prologue else Fusion())
    if match is None:
        assert specialized.registers(shape) == want
    else:
        with pytest.raises(ValueError, match=match):
            specialized.registers(shape)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (2048, 4096, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", prologue_in="memory")),
    (2048, 4096, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", prologue_in="memory", delay_release=1)),
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=3, prologue_in="memory")),
    (1024, 256, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", prologue_in="memory")),  # 4 steps
    (2048, 1024, 512, MosaicGemmConfig(prologue_in="memory")),  # wg_split "n"
    (2048, 1024, 512, MosaicGemmConfig())])  # a fourth warpgroup
def test_prologue_on_the_gpu(M, K, N, config):
    _check_row_sums(M, K, N, config)


# ---------------------------------------------------------------------------------------------------------------
# Fusion.share_rows: one tile per row block takes the a_observe; the others wait for its row vector
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m_iters, n_iters, minor_dim, width", [(4, 3, 0, 2), (5, 1, 0, 8), (3, 7, 1, 2),
                                                                 (256, 16, 0, 8), (32, 24, 0, 8)])
def test_the_first_column_runs_first_then_every_other_tile_once(m_iters, n_iters, minor_dim, width):
    from pallas_kernels.gemm.mosaic import first_column_then_snake
    lin = jnp.arange(m_iters * n_iters, dtype=jnp.int32)
    m_idx, n_idx = (np.asarray(i) for i in jax.vmap(
        lambda i: first_column_then_snake(i, m_iters, n_iters, minor_dim, width))(lin))
    assert sorted(zip(m_idx.tolist(), n_idx.tolist())) == [(m, n) for m in range(m_iters) for n in range(n_iters)]
    assert m_idx[:m_iters].tolist() == list(range(m_iters)) and not n_idx[:m_iters].any()


def _shared_row_scale(config, M: int, K: int) -> Fusion:
    """A fusion sharing each row block's sums of squares of A (float32, stored as "sumsq" (M,)) from its first tile
    with its others, whose epilogue scales the rows by rsqrt(mean(a²)): a wrong or stale row vector shows."""
    sums = _row_sums_of_squares(config, M)
    return dataclasses.replace(sums, carry_shapes=None, share_rows=("sumsq", lambda ctx, c: jnp.sum(c, axis=1)),
                               epilogue=lambda ctx, acc, shared: (
                                   acc * jax.lax.broadcast_in_dim(jax.lax.rsqrt(shared[0] * (1.0 / K)), acc.shape,
                                                                  [0]), {}))


@pytest.mark.parametrize("config_changes, fusion_changes, match", [
    (dict(schedule="pingpong", tile_m=128, tile_n=128), {}, "needs an a_observe or an a_operand, "
                                                                "schedule='cooperative'"),
    ({}, dict(a_observe=None), "a_observe=None"),
    ({}, dict(outputs=(("sumsq", S((256,), jnp.bfloat16)),)),
     r"share_rows='sumsq' must name an \(256,\) float32 output, got shape \(256,\), dtype bfloat16"),
    ({}, dict(outputs=()), "share_rows='sumsq' must name an .* got no such output")])
def test_share_rows_needs_an_a_observe_cooperative_tiles_and_a_float32_row_output(config_changes, fusion_changes,
                                                                                   match):
    config = MosaicGemmConfig(**dict(dict(tile_m=64, tile_n=256, wg_split="m", delay_release=1), **config_changes))
    fusion = dataclasses.replace(_shared_row_scale(config, 256, 256), **fusion_changes)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion),
                       S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16))


@cpu_only
@pytest.mark.parametrize("epilogue_store", ["end", "next_tile"])
def test_share_rows_lowers_a_k_loop_for_each_kind_of_tile(epilogue_store):
    """Lowered for CUDA: twice the wgmma of the a_observe alone (the first column's tiles and the others each in a
    tile loop of their own, ``TileContext.first_column``: no step branches on the kind of tile; a K loop inside a
    branch had ptxas serialize its wgmma), and no more shared memory. With the output stored under the next tile's
    first wgmma, each loop takes its first step out (as the a_observe alone does)."""
    M, K, N = 4096, 1024, 4096
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1,
                              epilogue_store=epilogue_store)
    operands = S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16)
    (kernel,) = mosaic_ir.lower_kernels(
        lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_shared_row_scale(config, M, K)),
        *operands)
    (alone,) = mosaic_ir.lower_kernels(
        lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_row_sums_of_squares(config, M)),
        *operands)
    assert {k: 2 * v for k, v in alone.wgmma().items()} == kernel.wgmma()
    assert kernel.smem_bytes == alone.smem_bytes


def test_share_rows_takes_stream_k_only_with_the_first_column_in_the_whole_rounds():
    """One column of 8 row blocks on 6 blocks: the whole round holds 6 first tiles, the 2 left over would be cut
    into K ranges that never run the a_observe."""
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1, stream_k=4)
    fusion = _shared_row_scale(config, 1024, 256)
    with pytest.raises(ValueError, match=r"share_rows needs every row block's first tile in the whole rounds .* the "
                                         r"rounds hold 6 tiles of the 8 first ones; take stream_k=0 here"):
        jax.eval_shape(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion, num_sms=6),
                       S((1024, 256), jnp.bfloat16), S((256, 256), jnp.bfloat16))


@cpu_only
@pytest.mark.parametrize("with_operand", [False, True])
def test_share_rows_lowers_with_stream_k_and_no_partial_carries(with_operand):
    """Lowered for CUDA at 4352x1024x4096 (16 tiles left over on 4 units each): the accumulators' stream-K workspace
    but none for the a_observe carry (stream-K tiles never take it), and the shared memory of whole tiles."""
    M, K, N = 4352, 1024, 4096
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1)
    fusion = _shared_row_scale(config, M, K)
    operands = [S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16)]
    if with_operand:
        fusion = dataclasses.replace(fusion, step_inputs=("g",), a_operand=lambda ctx, x, v, c: (x, c))
        operands.append(S((K,), jnp.bfloat16))

    def fn(config):
        return lambda a, b, *g: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion,
                                     arrays=dict(g=g[0]) if g else {})

    split = dataclasses.replace(config, stream_k=4)
    text = jax.jit(fn(split)).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<64x2x64x256xf32>" in text and "tensor<64x2x64x64xf32>" not in text
    (kernel,) = mosaic_ir.lower_kernels(fn(split), *operands)
    (whole,) = mosaic_ir.lower_kernels(fn(config), *operands)
    assert kernel.smem_bytes == whole.smem_bytes <= mosaic_utils.H100_SMEM_BYTES


_SHARED_STACKED = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1)


def _shared_row_dot(M: int, K: int) -> Fusion:
    """A fusion whose a_observe sums a · e per row, e's block loaded beside A's (``Fusion.a_beside``), shared from
    each row block's first tile ("dot" (M,) float32), and whose epilogue scales the rows by the dot / K."""
    def init(ctx):
        return mosaic_utils.layout_cast(jnp.zeros((ctx.config.tile_m,), jnp.float32), mosaic_utils.ROWS)

    def observe(ctx, a, dot, e):
        return dot + jnp.sum(a.astype(jnp.float32) * e.astype(jnp.float32), axis=1)

    return Fusion(outputs=(("dot", S((M,), jnp.float32)),), prologue_init=init, a_observe=observe, a_beside="e",
                  share_rows=("dot", lambda ctx, c: c),
                  epilogue=lambda ctx, acc, shared: (
                      acc * jax.lax.broadcast_in_dim(shared[0] * (1.0 / K), acc.shape, [0]), {}))


def _check_beside(M, K, N, config, calls=2):
    """The row dot Σ a · e from e's blocks beside A's against float32, and the rows it scales."""
    a, b = _operands(M, K, N, jnp.bfloat16)
    e = jax.random.normal(jax.random.fold_in(_key(), 7), (M, K), jnp.float32).astype(jnp.bfloat16)
    fusion = _shared_row_dot(M, K)
    dot_want = jnp.sum(a.astype(jnp.float32) * e.astype(jnp.float32), axis=1)
    want = _f32_product(a, b) * (dot_want / K)[:, None]
    fn = jax.jit(lambda a, b, e: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion, arrays=dict(e=e)))
    for _ in range(calls):
        got, dot = fn(a, b, e)
        assert _rel_err(dot, dot_want) <= _tol(jnp.bfloat16, K)  # NaN fails
        assert _rel_err(got, want) <= 2 * _tol(jnp.bfloat16, K)


def test_a_beside_needs_an_a_observe_and_an_array_of_a_s_shape_and_dtype():
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1)
    fusion = _shared_row_dot(256, 256)
    for changes, e in [(dict(a_observe=None, share_rows=None), S((256, 256), jnp.bfloat16)),
                       ({}, S((256, 128), jnp.bfloat16)), ({}, S((256, 256), jnp.float32))]:
        with pytest.raises(ValueError, match=r"a_beside='e' is loaded beside A for an a_observe: it needs one and an "
                                             r"array of A's shape \(256, 256\) and dtype bfloat16; got"):
            jax.eval_shape(lambda a, b, e: gemm(a, b, config=config, out_dtype=jnp.bfloat16,
                                                fusion=dataclasses.replace(fusion, **changes), arrays=dict(e=e)),
                           S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16), e)


@cpu_only
def test_a_beside_lowers_a_third_stage_buffer_and_its_load():
    """Lowered for CUDA at 4096x1024x4096: one (cta_m, tile_k) block more per stage of shared memory and one TMA
    load more than the same row dot's fusion without e (which sums a · a)."""
    M, K, N = 4096, 1024, 4096
    config = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1, num_stages=3)
    operands = S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((M, K), jnp.bfloat16)
    fusion = _shared_row_dot(M, K)
    (kernel,) = mosaic_ir.lower_kernels(
        lambda a, b, e: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion, arrays=dict(e=e)), *operands)
    alone = dataclasses.replace(fusion, a_beside=None, a_observe=lambda ctx, a, dot: fusion.a_observe(ctx, a, dot, a))
    (plain,) = mosaic_ir.lower_kernels(
        lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=alone), *operands[:2])
    assert kernel.smem_bytes - plain.smem_bytes == config.num_stages * config.cta_m * config.tile_k * 2
    assert kernel.tma_loads() == plain.tma_loads() + 1


@cpu_only
@pytest.mark.slow
def test_a_beside_in_interpret_mode():
    """(Every tile observes in interpret mode, share_rows or not: no semaphores.)"""
    config = dataclasses.replace(_TINY, wg_split="m", delay_release=1)
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2x4 tiles
        _check_beside(128, 128, 256, config, calls=1)


_BESIDE = dataclasses.replace(_SHARED_STACKED, num_stages=3)  # 3 stages of A, B and the beside block: 192 KiB


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (32768, 1024, 1024, _BESIDE),  # 256 row blocks: the first column takes two rounds
    (4096, 2048, 256, _BESIDE),  # one column: every tile its row block's first
    (4352, 1024, 4096, dataclasses.replace(_BESIDE, stream_k=4)),  # stream-K tiles: arrivals, no loads
    (4096, 4096, 4096, dataclasses.replace(_BESIDE, delay_release=0))])  # the dx kernel's
def test_a_beside_on_the_gpu(M, K, N, config):
    _check_beside(M, K, N, config)


def _check_shared_rows(M, K, N, config, calls=2, with_operand=False):
    """Each call on fresh operands whose rows are scaled by factors in [1/2, 2]: a row vector left over from the
    previous call, or read before its first tile stored it, scales the rows by the wrong rsqrt and shows."""
    fusion = _shared_row_scale(config, M, K)
    if with_operand:  # an a_operand multiplying A by g in registers beside it (rmsnorm_matmul's gamma_on="a")
        fusion = dataclasses.replace(fusion, step_inputs=("g",),
                                     a_operand=lambda ctx, x, v, c: (x * jax.lax.broadcast_in_dim(v["g"], x.shape, [1]),
                                                                      c))
    fn = jax.jit(lambda a, b, arrays: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion,
                                           arrays=arrays))
    for _ in range(calls):
        a, b = _operands(M, K, N, jnp.bfloat16)
        a = (a.astype(jnp.float32) * 2.0 ** jax.random.uniform(_key(), (M, 1), jnp.float32, -1.0, 1.0)).astype(
            jnp.bfloat16)
        arrays = {}
        if with_operand:
            arrays = dict(g=(1.0 + 0.5 * jax.random.normal(_key(), (K,), jnp.float32)).astype(jnp.bfloat16))
        a32 = a.astype(jnp.float32)
        sumsq_want = jnp.sum(a32 * a32, axis=1)
        a_used = (a32 * arrays["g"].astype(jnp.float32)).astype(jnp.bfloat16) if with_operand else a
        want = _f32_product(a_used, b) * jax.lax.rsqrt(sumsq_want / K)[:, None]
        got, sumsq = fn(a, b, arrays)
        err = _rel_err(got, want)
        assert err <= _tol(jnp.bfloat16, K), err  # NaN fails
        assert _rel_err(sumsq, sumsq_want) <= 1e-5


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("fields, with_operand", [(dict(wg_split="m", delay_release=1), False),
                                                  (dict(delay_release=1), True)])
def test_share_rows_in_interpret_mode(fields, with_operand):
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2x4 tiles on 2 blocks (every tile sums its own rows here)
        _check_shared_rows(128, 128, 256, dataclasses.replace(_TINY, **fields), calls=1, with_operand=with_operand)


@gpu_only
@pytest.mark.parametrize("M, K, N, config, with_operand", [
    (32768, 1024, 1024, _SHARED_STACKED, False),  # 256 row blocks: the first column takes two rounds
    (4096, 4096, 4096, _SHARED_STACKED, False),  # 32 row blocks: most of the first round waits for its row block
    (4096, 2048, 256, _SHARED_STACKED, False),  # one column: every tile its row block's first
    (2048, 1024, 2048, MosaicGemmConfig(delay_release=1), False),  # wg_split "n": both warpgroups share all rows
    (8192, 4096, 6144, _SHARED_STACKED, True),  # beside an a_operand (gamma_on="a" of rmsnorm_matmul)
    (4096, 4096, 4096, dataclasses.replace(_SHARED_STACKED, shared_rows_wait=0), False),  # after the K loop
    (2048, 128, 2048, _SHARED_STACKED, False),  # 2 steps: the wait 4 steps before the end is at the first
    (4096, 1024, 4096, dataclasses.replace(_SHARED_STACKED, shared_rows_wait=1), True),
    (4352, 1024, 4096, dataclasses.replace(_SHARED_STACKED, stream_k=4), False),  # 16 tiles left over, 4 units each
    (4352, 1024, 4096, dataclasses.replace(_SHARED_STACKED, stream_k=4), True),  # the same beside an a_operand
    (32768, 1024, 4096, dataclasses.replace(_SHARED_STACKED, stream_k=4), True),  # 4 left over; 256 first tiles
    # each output stored under the next tile's first wgmma, carried from the first column's loop into the others'
    (32768, 1024, 1024, dataclasses.replace(_SHARED_STACKED, epilogue_store="next_tile"), False),
    (4096, 2048, 256, dataclasses.replace(_SHARED_STACKED, epilogue_store="next_tile"), False),  # no second loop
    (8192, 4096, 6144, dataclasses.replace(_SHARED_STACKED, epilogue_store="next_tile"), True),
    (4352, 1024, 4096, dataclasses.replace(_SHARED_STACKED, epilogue_store="next_tile", stream_k=4), False),
])
def test_share_rows_on_the_gpu(M, K, N, config, with_operand):
    _check_shared_rows(M, K, N, config, with_operand=with_operand)


# ---------------------------------------------------------------------------------------------------------------
# Fusion.col_inputs: a column vector's slice at each tile TMA-loaded into shared memory at the tile's start
# ---------------------------------------------------------------------------------------------------------------
def _scaled_columns(col_inputs: tuple = ("v",)) -> Fusion:
    """out = (A @ B) ⊙ v over the columns, v (N,) read (as float32) by ``TileContext.load_cols``."""
    return Fusion(inputs=("v",), col_inputs=col_inputs, epilogue=lambda ctx, acc, carry: (
        acc * jax.lax.broadcast_in_dim(ctx.load_cols("v"), acc.shape, [1]), {}))


@pytest.mark.parametrize("fusion, v, match", [
    (Fusion(col_inputs=("v",)), S((512,), jnp.float32),
     r"col_inputs='v' must name a \(512,\) float32, bfloat16 or float16 array of inputs, N a multiple of tile_n=128 "
     r"and tile_n elements whole 128-byte lines \(its slices load by TMA\); got not among inputs, N=512"),
    (_scaled_columns(), S((512,), jnp.int32), r"col_inputs='v' .* got shape \(512,\), dtype int32, N=512"),
    (_scaled_columns(), S((512,), jnp.float8_e4m3fn), r"col_inputs='v' .* got shape \(512,\), dtype float8_e4m3fn"),
    (_scaled_columns(), S((256,), jnp.float32), r"col_inputs='v' .* got shape \(256,\), dtype float32, N=512")])
def test_col_inputs_must_be_float_column_vectors_of_the_inputs(fusion, v, match):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a, b, v: gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16, fusion=fusion,
                                            arrays=dict(v=v)),
                       S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16), v)


def test_col_inputs_need_whole_128_byte_slices():
    """A (tile_n,) slice Mosaic's TMA copies as whole 128-byte lines: 160 bfloat16 elements are 320 bytes."""
    config = MosaicGemmConfig(tile_n=160, epi_tile_n=32)
    with pytest.raises(ValueError, match=r"tile_n elements whole 128-byte lines .* got shape \(640,\), dtype "
                                         r"bfloat16, N=640"):
        jax.eval_shape(lambda a, b, v: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_scaled_columns(),
                                            arrays=dict(v=v)),
                       S((256, 256), jnp.bfloat16), S((256, 640), jnp.bfloat16), S((640,), jnp.bfloat16))


def test_col_inputs_need_n_a_multiple_of_tile_n():
    """A last column of tiles past N (partial_columns) has no whole (tile_n,) slice for TMA to load."""
    fusion = dataclasses.replace(_scaled_columns(), partial_columns=True)
    with pytest.raises(ValueError, match=r"col_inputs='v' must name a \(320,\) float32, bfloat16 or float16 array of "
                                         r"inputs, N a multiple of tile_n=128 .* got shape \(320,\), dtype float32, "
                                         r"N=320"):
        jax.eval_shape(lambda a, b, v: gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16, fusion=fusion,
                                            arrays=dict(v=v)),
                       S((256, 256), jnp.bfloat16), S((256, 320), jnp.bfloat16), S((320,), jnp.float32))


@cpu_only
@pytest.mark.parametrize("v_dtype", [jnp.float32, jnp.bfloat16])
def test_col_inputs_load_by_tma_beside_the_operands(v_dtype):
    """Lowered for CUDA: one more TMA load (the vector's slice) and its SMEM, 2 x tile_n elements of the vector's own
    dtype (at least: aligned) and a barrier pair, over reading the vector from GMEM in the epilogue."""
    operands = S((4096, 1024), jnp.bfloat16), S((1024, 2048), jnp.bfloat16), S((2048,), v_dtype)

    def lowered(fusion):
        (kernel,) = mosaic_ir.lower_kernels(
            lambda a, b, v: gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16, fusion=fusion,
                                 arrays=dict(v=v)), *operands)
        return kernel

    by_tma, from_gmem = lowered(_scaled_columns()), lowered(_scaled_columns(col_inputs=()))
    assert by_tma.tma_loads() == from_gmem.tma_loads() + 1
    slices = 2 * MosaicGemmConfig().tile_n * jnp.dtype(v_dtype).itemsize  # (Mosaic aligns buffers to 1024 bytes)
    assert slices <= by_tma.smem_bytes - from_gmem.smem_bytes <= max(slices, 1024) + 64


@gpu_only
@pytest.mark.parametrize("M, K, N, config, v_dtype", [
    (1024, 512, 1024, MosaicGemmConfig(), jnp.float32),
    (2048, 1024, 2048, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m"), jnp.float32),
    (2048, 1024, 2048, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m"), jnp.bfloat16),
    (1024, 512, 1024, MosaicGemmConfig(), jnp.float16)])
def test_col_inputs_on_the_gpu(M, K, N, config, v_dtype):
    """Each tile scales its columns by its own slice of v (in v's dtype, a ramp so that a slice from the wrong place
    or a misread half-precision element shows), two calls on fresh inputs."""
    fn = jax.jit(lambda a, b, v: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_scaled_columns(),
                                      arrays=dict(v=v))[0])
    for _ in range(2):
        a, b = _operands(M, K, N, jnp.bfloat16)
        v = (jax.random.uniform(_key(), (N,), jnp.float32, 0.5, 2.0) * jnp.linspace(0.25, 4.0, N)).astype(v_dtype)
        assert _rel_err(fn(a, b, v), _f32_product(a, b) * v.astype(jnp.float32)) < _tol(jnp.bfloat16, K)


@cpu_only
@pytest.mark.slow
def test_col_inputs_in_interpret_mode():
    """Two blocks walk 4 tiles of 2 column blocks: each tile scales by its own slice of v (bfloat16 here: read as
    float32)."""
    a, b = _operands(128, 64, 128, jnp.bfloat16)
    v = jax.random.uniform(_key(), (128,), jnp.float32, 0.5, 2.0).astype(jnp.bfloat16)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        (out,) = gemm(a, b, config=_TINY, out_dtype=jnp.float32, fusion=_scaled_columns(), arrays=dict(v=v))
    np.testing.assert_allclose(np.asarray(out), np.asarray(_f32_product(a, b) * v), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------------
# Fusion.sum_rows: a row vector summed over each row's tiles inside the kernel (global semaphores)
# ---------------------------------------------------------------------------------------------------------------
def _centered_rows(M: int, N: int, config: MosaicGemmConfig) -> Fusion:
    """out = c − mean_N(c) per row, c = A @ B: each accumulator's row sums over its columns ("parts", one row per
    column block), summed over the row's tiles in the kernel (``Fusion.sum_rows``); a tile that used its own part
    only, or another row's, shows at once."""
    parts = S((-(-N // config.tile_n), M), jnp.float32)
    return Fusion(outputs=(("parts", parts),),
                  epilogue=lambda ctx, acc, carry: (acc, {"parts": jnp.sum(acc, axis=1)}),
                  sum_rows=("parts", lambda ctx, acc, total, carry: acc - jax.lax.broadcast_in_dim(
                      total * (1.0 / N), acc.shape, [0])))


_SUM_ROWS_STACKED = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", memory_warps=1)


@pytest.mark.parametrize("config_changes, fusion_changes, match", [
    (dict(schedule="pingpong", tile_m=128, tile_n=128), {}, "sum_rows sums a row vector .* schedule='pingpong'"),
    (dict(stream_k=4, memory_warps=4), {}, "sum_rows sums a row vector .* stream_k=4"),
    ({}, dict(outputs=(("parts", S((256,), jnp.float32)),)),
     r"sum_rows='parts' must name a \(2, 256\) float32 output \(one row per column block\), got shape \(256,\)"),
    ({}, dict(outputs=()), "sum_rows='parts' must name a .* got no such output")])
def test_sum_rows_needs_cooperative_whole_tiles_and_a_float32_output_per_column_block(config_changes, fusion_changes,
                                                                                      match):
    config = dataclasses.replace(_SUM_ROWS_STACKED, **config_changes)
    fusion = dataclasses.replace(_centered_rows(256, 512, config), **fusion_changes)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=fusion),
                       S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16))


def test_sum_rows_refuses_rows_of_more_tiles_than_blocks():
    """A row's tiles wait for each other, so they must all be resident: 136 column blocks on 132 SMs would hang."""
    config = dataclasses.replace(_SUM_ROWS_STACKED, tile_n=64)
    N = 136 * 64
    with pytest.raises(ValueError, match=r"sum_rows waits for all of a row's N / cta_n = 8704 / 64 = 136 tiles at "
                                         r"once, so they must run together on the 132 blocks"):
        jax.eval_shape(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16,
                                         fusion=_centered_rows(128, N, config)),
                       S((128, 256), jnp.bfloat16), S((256, N), jnp.bfloat16))


@cpu_only
def test_sum_rows_is_refused_in_interpret_mode():
    """jax's GPU interpreter has no semaphores: the hook says so rather than computing a wrong sum."""
    config = _SUM_ROWS_STACKED
    a, b = _operands(128, 64, 512, jnp.bfloat16)
    with mosaic_utils.interpret_on_cpu(num_sms=2), pytest.raises(ValueError, match="sum_rows .* interpret=True"):
        gemm(a, b, config=dataclasses.replace(config, tile_k=64), out_dtype=jnp.bfloat16,
             fusion=_centered_rows(128, 512, config))


@cpu_only
@pytest.mark.parametrize("K, N, tile_n, wg_split", [(1024, 1024, 256, "m"), (512, 2048, 128, "n")])
def test_sum_rows_lowers_one_release_and_one_acquiring_wait(K, N, tile_n, wg_split):
    """Lowered for CUDA, whatever the column blocks: one release-add per accumulator (its part's count) and one
    polling wait for the parts (a relaxed load, an acquire fence), no compare-and-swap (no count goes back to zero);
    the counts, one per row group, start each call at zero: jax passes the kernel a zero-filled int32 scratch of
    M / tile_m; no more shared memory than the plain epilogue; a grid of whole rows of tiles (132 SMs)."""
    M = 4096
    config = dataclasses.replace(_SUM_ROWS_STACKED, tile_m=64 if wg_split == "m" else 128, tile_n=tile_n,
                                 wg_split=wg_split)
    operands = S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16)

    def summed(a, b):
        return gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_centered_rows(M, N, config))

    (kernel,) = mosaic_ir.lower_kernels(summed, *operands)
    plain = Fusion(outputs=(("parts", S((N // tile_n, M), jnp.float32)),),
                   epilogue=lambda ctx, acc, carry: (acc, {"parts": jnp.sum(acc, axis=1)}))
    (alone,) = mosaic_ir.lower_kernels(
        lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=plain), *operands)
    assert kernel.text.count("red.release.gpu.global.add.u32") == 1
    assert "atom.relaxed.gpu.global.cas" not in kernel.text
    assert kernel.text.count("ld.relaxed.gpu.global.b32") == 1 and kernel.text.count("fence.acquire.gpu") == 1
    assert "red.release.gpu.global.add" not in alone.text
    assert kernel.smem_bytes == alone.smem_bytes
    row_tiles = N // config.cta_n  # 4 and 8 CTA tiles per row block, row-major (grid_minor "n")
    assert kernel.grid == (132 - 132 % row_tiles, 1, 1) and alone.grid == (132, 1, 1)
    with backends.lowering_for_gpu():
        program = jax.jit(summed).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    counts = f"tensor<{M // config.tile_m}xi32>"
    zeros = re.search(r"(%\S+) = stablehlo.broadcast_in_dim (%\S+), dims = \[\] : \(tensor<i32>\) -> " + counts,
                      program)
    assert zeros and re.search(re.escape(zeros.group(2)) + r" = stablehlo.constant dense<0> : tensor<i32>", program)
    call = next(line for line in program.splitlines() if "custom_call @mosaic_gpu" in line)
    assert call.split("(", 1)[1].split(")", 1)[0].split(", ")[-1] == zeros.group(1)


@pytest.mark.parametrize("m_iters, row_tiles, width, minor, sms, want", [
    (256, 16, 8, "m", 132, (128, True, 8)),  # the 32768x4096x4096 dx kernel: one run of 8 rows a round
    (128, 4, 8, "m", 132, (128, True, 8)),  # 4 runs a round
    (37, 4, 8, "m", 132, (128, True, 8)),  # the last run 5 rows
    (64, 22, 8, "m", 132, (132, False, 8)),  # a run of 176 tiles > 132: row-major, 6 rows a round
    (64, 4, 8, "n", 132, (132, False, 8)),  # grid_minor "n": row-major
    (64, 16, 2, "m", 132, (128, True, 2)),
    (256, 12, 8, "m", 132, (132, True, 11)),  # width 8 would keep 96 blocks: 11 rows, one run a round
    (64, 10, 8, "m", 132, (130, True, 13)),  # 8 would keep 80
    (64, 6, 8, "m", 132, (132, True, 22)),  # 8 would keep 96
    (128, 3, 8, "m", 132, (120, True, 8)),  # 120 of 132: width 8 stays
    (64, 20, 8, "m", 132, (120, False, 8)),  # row-major 120 of 132: stays
    (64, 12, 8, "n", 132, (132, False, 8))])
def test_sum_rows_rounds_hold_whole_rows(m_iters, row_tiles, width, minor, sms, want):
    """``Fusion.sum_rows``' grid and tile order (``gemm.config.sum_rows_grid``, ``_Shape.tile_context``'s orders):
    every round of the persistent loop (tile lin on block lin % grid) holds all or none of each row block's tiles, so
    a tile never waits for one queued behind it; where the configured runs would leave over an eighth of the blocks idle,
    a width that keeps the most takes their place."""
    from pallas_kernels.gemm.config import sum_rows_grid
    from pallas_kernels.gemm.mosaic import _Shape

    config = dataclasses.replace(_SUM_ROWS_STACKED, grid_minor=minor, grid_tile_width=width)
    grid, snake, width = sum_rows_grid(config, row_tiles, sms)
    assert (grid, snake, width) == want
    config = dataclasses.replace(config, grid_tile_width=width)
    M, N = m_iters * config.cta_m, row_tiles * config.cta_n
    shape = _Shape(config, _centered_rows(M, N, config), (), ("parts",), (False, False), (M, N, 256), jnp.bfloat16,
                   jnp.bfloat16, (), sum_rows_snake=snake)
    lin = jnp.arange(m_iters * row_tiles, dtype=jnp.int32)
    rows, cols = (np.asarray(v) for v in jax.vmap(lambda i: (lambda c: (c.m_idx, c.n_idx))(
        shape.tile_context(i, 0, {})))(lin))
    assert sorted(zip(rows, cols)) == [(m, n) for m in range(m_iters) for n in range(row_tiles)]
    rounds = np.asarray(lin) // grid
    for m in range(m_iters):
        assert len(set(rounds[rows == m])) == 1, m


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (4096, 1024, 1024, _SUM_ROWS_STACKED),  # 4 column blocks: 33 row blocks a round on 132 SMs
    (4096, 1024, 1024, dataclasses.replace(_SUM_ROWS_STACKED, grid_minor="m")),  # planar-snake runs: 32 on 128
    (4096, 512, 2048, dataclasses.replace(_SUM_ROWS_STACKED, tile_m=128, tile_n=128, wg_split="n")),  # 16 blocks
    (8192, 1024, 2816, dataclasses.replace(_SUM_ROWS_STACKED, tile_n=128)),  # 22 per row: rows across rounds
    (4096, 1024, 3072, dataclasses.replace(_SUM_ROWS_STACKED, grid_minor="m")),  # 12 per row: runs of 11 rows
    (2048, 2048, 8192, dataclasses.replace(_SUM_ROWS_STACKED, memory_warps=4, num_stages=3))])  # 32 column blocks
def test_sum_rows_on_the_gpu(M, K, N, config):
    """Each row centered by its mean over all N columns, summed over the row's tiles in the kernel: against the
    float32 reference, two calls (each starts its counts at zero; a stale count would let a tile read old parts). The
    parts sum to the rows' sums."""
    fn = jax.jit(lambda a, b: gemm(a, b, config=config, out_dtype=jnp.bfloat16,
                                   fusion=_centered_rows(M, N, config)))
    for _ in range(2):
        a, b = _operands(M, K, N, jnp.bfloat16)
        b = b + 0.05 * jax.random.normal(_key(), (1, N), jnp.float32).astype(jnp.bfloat16)  # rows' means not 0
        c = _f32_product(a, b)
        want = c - jnp.mean(c, axis=1, keepdims=True)
        got, parts = fn(a, b)
        assert _rel_err(got, want) <= _tol(jnp.bfloat16, K)  # NaN fails
        assert _rel_err(jnp.sum(parts, axis=0), jnp.sum(c, axis=1)) <= _tol(jnp.bfloat16, K)


# ---------------------------------------------------------------------------------------------------------------
# The epilogue in a fourth warpgroup (MosaicGemmConfig.epilogue_in="fourth")
# ---------------------------------------------------------------------------------------------------------------
_APART = MosaicGemmConfig(tile_m=128, tile_n=128, wg_split="n", num_stages=3, epilogue_in="fourth")
_APART_TINY = dataclasses.replace(_TINY, wg_split="m", epilogue_in="fourth")  # slices of epi_tile_n=32 columns


@pytest.mark.parametrize("changes, match", [
    (dict(tile_input_in="ring", tile_m=64, wg_split="m"), "epilogue_in: 'fourth' runs on .* tile_input_in='ring'"),
    (dict(tile_m=64, tile_n=256, wg_split="m"), "epilogue_in: 'fourth' .* too few for a m64n256 wgmma.* tile_n=256"),
    (dict(stream_k=4), "epilogue_in: 'fourth' .* stream_k=4"),
    (dict(epilogue_store="split"), "epilogue_in: 'fourth' .* epilogue_store='split'"),
    (dict(epilogue_in="third"), r"epilogue_in: must be one of \('mma', 'fourth'\), got 'third'")])
def test_the_epilogue_apart_needs_whole_cooperative_tiles_of_at_most_128_columns(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(_APART, **changes)


def test_the_epilogue_apart_stores_the_output_tile_and_takes_no_prologue():
    fusion = Fusion(store_tile=False, outputs=(("rows", S((256,), jnp.float32)),),
                    epilogue=lambda ctx, acc, carry: (acc, {"rows": jnp.sum(acc, axis=1)}))
    with pytest.raises(ValueError, match="epilogue_in='fourth' runs the epilogue in a fourth warpgroup.* "
                                         "store_tile=False"):
        jax.eval_shape(lambda a, b: gemm(a, b, config=_APART, out_dtype=jnp.bfloat16, fusion=fusion),
                       S((256, 256), jnp.bfloat16), S((256, 512), jnp.bfloat16))


def _row_parts(M: int, N: int, config: MosaicGemmConfig) -> Fusion:
    """out = A @ B, and each accumulator's row sums over its columns (one row of "parts" per column block)."""
    return Fusion(outputs=(("parts", S((N // config.tile_n, M), jnp.float32)),),
                  epilogue=lambda ctx, acc, carry: (acc, {"parts": jnp.sum(acc, axis=1)}))


@cpu_only
@pytest.mark.parametrize("wg_split", ["m", "n"])
def test_the_epilogue_apart_in_interpret_mode(wg_split):
    """Two blocks over the tiles, so each block hands its second tile's accumulators over once the first's are
    read: the tile input's slices, a copy staged in its slot and the output stored from the accumulators' buffer;
    a column vector's slices; row vectors summed over the slices (one slice left out fails each). The two
    accumulators stacked along M, or side by side along N."""
    config = dataclasses.replace(_APART_TINY, wg_split=wg_split)
    N = 128 * (1 + (wg_split == "n"))  # 4 CTA tiles either way
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _check_tile_copy(128, 128, N, config, calls=1)
        a, b = _operands(128, 64, N, jnp.bfloat16)
        v = jax.random.uniform(_key(), (N,), jnp.float32, 0.5, 2.0)
        (out,) = gemm(a, b, config=config, out_dtype=jnp.float32, fusion=_scaled_columns(), arrays=dict(v=v))
        np.testing.assert_allclose(np.asarray(out), np.asarray(_f32_product(a, b) * v), rtol=1e-2, atol=1e-2)
        out, parts = gemm(a, b, config=config, out_dtype=jnp.float32, fusion=_row_parts(128, N, config))
    want = _f32_product(a, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(parts), np.asarray(want).reshape(128, N // 64, 64).sum(axis=2).T,
                               rtol=1e-2, atol=1e-2)


@cpu_only
def test_the_epilogue_apart_lowers_with_four_warpgroups_and_no_output_staging():
    """Lowered for CUDA: 512 threads; shared memory of 3 stages, the accumulators' buffer (2 · 128 · 128 bf16) and
    one 128x64 slot of the tile input, against 3 stages and two prefetched 128x128 tiles with the epilogue in the
    MMA warpgroups."""
    M, K, N = 2048, 1024, 4096
    args = (S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((M, N), jnp.bfloat16))

    def lowered(config):
        fn = lambda a, b, c: gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_copied_tile(M, N),  # noqa
                                  arrays=dict(c=c))
        with backends.lowering_for_gpu():
            (kernel,) = mosaic_ir.lower_kernels(fn, *args)
        return kernel

    apart, inside = lowered(_APART), lowered(dataclasses.replace(_APART, epilogue_in="mma"))
    assert (apart.threads, inside.threads) == (512, 384)
    stages = 3 * (128 * 64 + 64 * 256) * 2
    assert 0 <= apart.smem_bytes - (stages + 2 * 128 * 128 * 2 + 128 * 64 * 2) <= 1024
    assert 0 <= inside.smem_bytes - (stages + 2 * 128 * 128 * 2) <= 1024


@gpu_only
@pytest.mark.parametrize("M, K, N", [(4096, 1024, 1024), (2048, 2048, 8192)])
def test_the_epilogue_apart_on_the_gpu(M, K, N):
    """Rows centered by their means summed over the row's tiles (Fusion.sum_rows) and a tile input's copy, with the
    epilogue in the fourth warpgroup: against the float32 reference, two calls each."""
    fn = jax.jit(lambda a, b: gemm(a, b, config=_APART, out_dtype=jnp.bfloat16, fusion=_centered_rows(M, N, _APART)))
    for _ in range(2):
        a, b = _operands(M, K, N, jnp.bfloat16)
        b = b + 0.05 * jax.random.normal(_key(), (1, N), jnp.float32).astype(jnp.bfloat16)  # rows' means not 0
        c = _f32_product(a, b)
        got, parts = fn(a, b)
        assert _rel_err(got, c - jnp.mean(c, axis=1, keepdims=True)) <= _tol(jnp.bfloat16, K)  # NaN fails
        assert _rel_err(jnp.sum(parts, axis=0), jnp.sum(c, axis=1)) <= _tol(jnp.bfloat16, K)
    _check_tile_copy(M, K, N, _APART)


# ---------------------------------------------------------------------------------------------------------------
# The memory warpgroup's loads from one warp (MosaicGemmConfig.memory_warps)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(8, 8), (5, 7), (128, 43), (1, 9), (9, 1), (64, 112)])
@pytest.mark.parametrize("minor_dim", [0, 1])
@pytest.mark.parametrize("width", [1, 3, 8, 16])
def test_our_planar_snake_is_jax_s_tile_order(shape, minor_dim, width):
    """gemm.mosaic.planar_snake (lax ops only, so one warp's code lowers) visits the tiles in jax's order."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.gemm.mosaic import planar_snake

    lin = jnp.arange(shape[0] * shape[1], dtype=jnp.int32)
    ours = jax.vmap(lambda i: planar_snake(i, shape, minor_dim, width))(lin)
    jaxs = jax.vmap(lambda i: plgpu.planar_snake(i, shape, minor_dim, width))(lin)
    np.testing.assert_array_equal(np.stack(ours), np.stack(jaxs))
    assert sorted(zip(*map(np.asarray, ours))) == [(m, n) for m in range(shape[0]) for n in range(shape[1])]


@pytest.mark.parametrize("fields, got", [(dict(prologue_in="memory"), "prologue_in='memory'"),
                                         (dict(pipeline="pallas"), "pipeline='pallas'")])
def test_one_loading_warp_needs_our_k_loop_without_a_prologue_in_the_memory_warpgroup(fields, got):
    with pytest.raises(ValueError, match=f"memory_warps: 1 runs on pipeline 'own' with prologue_in 'fourth' .*{got}"):
        MosaicGemmConfig(memory_warps=1, **fields)
    with pytest.raises(ValueError, match="MosaicGemmConfig.memory_warps: must be 1 or 4, got 2"):
        MosaicGemmConfig(memory_warps=2)


@cpu_only
@pytest.mark.parametrize("fields", [dict(schedule="pingpong", num_stages=6, delay_release=1),
                                    dict(tile_m=64, tile_n=256, wg_split="m", cluster="m"),
                                    dict(_RING.to_dict())])
def test_one_loading_warp_arrives_for_the_warpgroup_on_each_copy(fields):
    """With one loading warp each TMA load's barrier gets, from each of its 32 threads, an arrival for three more
    (mbarrier.arrive.nocomplete, count 3) beside the one carrying the expected bytes: 128 arrivals, as the whole
    warpgroup's; the same loads, wgmma and shared memory as with four."""
    def lowered(memory_warps):
        config = MosaicGemmConfig(**dict(fields, memory_warps=memory_warps))
        fusion, arrays = (_added_tile(4096, 4096 // config.tile_n), dict(c=S((4096, 4096), jnp.bfloat16))) if (
            config.tile_input_in == "ring") else (None, {})
        (k,) = mosaic_ir.lower_kernels(lambda a, b, arrays: gemm(a, b, config=config, out_dtype=a.dtype,
                                                                 fusion=fusion, arrays=arrays),
                                       S((4096, 1024), jnp.bfloat16), S((1024, 4096), jnp.bfloat16), arrays)
        return k

    four, one = lowered(4), lowered(1)
    assert four.text.count("mbarrier.arrive.nocomplete") == 0
    assert one.text.count("mbarrier.arrive.nocomplete") == one.tma_loads() == four.tma_loads() >= 2
    assert (one.wgmma(), one.smem_bytes) == (four.wgmma(), four.smem_bytes)


@gpu_only
@pytest.mark.parametrize("M, K, N, config", [
    (2304, 576, 2432, MosaicGemmConfig(schedule="pingpong", num_stages=4, delay_release=2)),  # odd tiles per block
    (4096, 1024, 5504, MosaicGemmConfig(schedule="pingpong", num_stages=6, delay_release=1, grid_minor="m")),
    (4096, 4096, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1,
                                        epilogue_store="split")),
    (2560, 512, 2304, MosaicGemmConfig(schedule="pingpong", num_stages=6, delay_release=1, cluster="m")),
    (2304, 576, 2560, MosaicGemmConfig(cluster="n")),
    (4352, 1024, 4096, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", stream_k=4)),  # + a stream-K round
    (1024, 8192, 1280, MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", stream_k=4))])
def test_one_loading_warp_on_the_gpu(M, K, N, config):
    """Two calls each: the loading warp's barrier phases carry over tiles, not calls."""
    config = dataclasses.replace(config, memory_warps=1)
    for _ in range(2):
        _check_product(M, K, N, jnp.bfloat16, config=config)


@gpu_only
@pytest.mark.parametrize("transpose_b, stream_k", [(False, 0), (True, 0), (False, 4)])
def test_one_loading_warp_with_a_ring_tile_input_on_the_gpu(transpose_b, stream_k):
    """The ring's tile input loaded by the one warp too; beside stream-K at 2048x4096x11008 (688 tiles, 28 left
    over for the stream-K round), whose owners load theirs after their segments."""
    config = dataclasses.replace(_RING, grid_minor="m", num_stages=3 if transpose_b else 4, memory_warps=1,
                                 stream_k=stream_k)
    M, K, N = (2048, 4096, 11008) if stream_k else (4096, 2048, 4096)
    _check_ring_input(M, K, N, config, calls=2, transpose_b=transpose_b)


# ---------------------------------------------------------------------------------------------------------------
# gemm's partial_rows and partial_k: the last row of tiles past M, the last K step past K
# ---------------------------------------------------------------------------------------------------------------
def _scaled_rows(M: int, col_blocks: int, tile: bool = False) -> Fusion:
    """out = s ⊙ (A @ B) (+ c with ``tile``: a tile input), s an (M,) input; outputs each accumulator's row sums
    ("parts", (col_blocks, M)) and 2s ("twice", (M,)): a row vector read or stored at the wrong rows shows."""
    def epilogue(ctx, acc, carry):
        s = ctx.load_rows("s")
        out = acc * jax.lax.broadcast_in_dim(s, acc.shape, [0]) + (ctx.load_tile("c") if tile else 0)
        return out, {"parts": jnp.sum(out, axis=1), "twice": s * 2}

    return Fusion(inputs=("s",), tile_inputs=("c",) if tile else (),
                  outputs=(("parts", S((col_blocks, M), jnp.float32)), ("twice", S((M,), jnp.float32))),
                  epilogue=epilogue)


def _check_scaled_rows(M, K, N, config, tile=False, out_dtype=jnp.float32):
    a, b = _operands(M, K, N, jnp.bfloat16)
    s = jax.random.uniform(_key(), (M,), jnp.float32, 0.5, 2.0)
    c = jax.random.normal(_key(), (M, N), jnp.float32).astype(jnp.bfloat16)
    blocks = N // config.tile_n
    out, parts, twice = jax.jit(lambda a, b, s, c: gemm(
        a, b, config=config, out_dtype=out_dtype, fusion=_scaled_rows(M, blocks, tile),
        arrays=dict(s=s, c=c) if tile else dict(s=s), partial_rows=True))(a, b, s, c)
    want = _f32_product(a, b) * s[:, None] + (c.astype(jnp.float32) if tile else 0)
    assert out.shape == (M, N) and out.dtype == out_dtype and parts.shape == (blocks, M) and twice.shape == (M,)
    assert _rel_err(out, want) <= _tol(jnp.bfloat16, K) * (2 if out_dtype == jnp.bfloat16 else 1)  # NaN fails
    assert _rel_err(parts, jnp.sum(want.reshape(M, blocks, -1), axis=2).T) <= _tol(jnp.bfloat16, K)
    np.testing.assert_array_equal(np.asarray(twice), np.asarray(s * 2))


def _check_partial_k(M, K, N, config):
    """A read transposed (K, M), B (K, N), K not a multiple of tile_k (``partial_k``)."""
    a, b = _operands(M, K, N, jnp.bfloat16)
    (got,) = jax.jit(lambda at, b: gemm(at, b, config=config, out_dtype=jnp.float32, transpose_a=True,
                                        partial_k=True))(a.T, b)
    assert _rel_err(got, _f32_product(a, b)) <= _tol(jnp.bfloat16, K)  # NaN fails


@pytest.mark.parametrize("call, match", [
    (lambda a, b: gemm(a, b, config=dataclasses.replace(_TINY, epi_tile_n=64), out_dtype=jnp.float32,
                       partial_rows=True),
     r"M=100 is not a multiple of 8 \(TMA's 8-row tiles\): .*output's pieces one swizzled row wide .*"
     r"got epi_tile_n=64 of float32 \(256 bytes\)"),
    (lambda a, b: gemm(a, b, config=_TINY, out_dtype=jnp.float32, partial_rows=True,
                       fusion=_scaled_rows(100, 2, tile=True), arrays=dict(s=S((100,), jnp.float32),
                                                                           c=S((100, 128), jnp.float32))),
     r"M=100 is not a multiple of 8 .*only A's blocks and the output's pieces, got tile_inputs=\('c',\)"),
    (lambda a, b: gemm(a.T, b, config=_TINY, out_dtype=jnp.float32, transpose_a=True, partial_rows=True),
     r"partial_rows takes A read as stored .* got transpose_a=True"),
    (lambda a, b: gemm(a, b, config=_TINY, out_dtype=jnp.float32, partial_k=True),
     r"partial_k takes A read transposed and B as stored .* got transpose_a=False"),
    (lambda a, b: gemm(a.T, b, config=_TINY, out_dtype=jnp.float32, transpose_a=True, partial_k=True,
                       fusion=_row_sums(100)),
     r"no hook reading along K; .*hooks \['prologue_step'\]"),
    (lambda a, b: gemm(a, b, config=_TINY, out_dtype=jnp.float32),
     r"M=100 is not a positive multiple of the rows of a block's output tile=64")])
def test_partial_rows_and_k_name_what_they_cannot_take(call, match):
    a, b = S((100, 104), jnp.bfloat16), S((104, 128), jnp.bfloat16)  # (neither M nor K whole tiles of _TINY)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(call, a, b)


@cpu_only
def test_partial_rows_lower_with_the_operands_as_they_are_and_row_vectors_padded():
    """M = 200 on 128-row tiles: A, the tile input and the output keep their 200 rows in the CUDA program (TMA
    loads zeros past them and stores nothing); the (M,) input is padded to 256 and the row outputs sliced back."""
    config = MosaicGemmConfig(tile_m=64, tile_n=128, wg_split="m")
    M, K, N = 200, 512, 512

    def fn(a, b, s, c):
        return gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_scaled_rows(M, 4, tile=True),
                    arrays=dict(s=s, c=c), partial_rows=True)

    args = (S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((M,), jnp.float32), S((M, N), jnp.bfloat16))
    with backends.lowering_for_gpu():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (kernel,) = mosaic_ir.lower_kernels(fn, *args)
    pads = re.findall(r"stablehlo\.pad .*-> tensor<([^>]*)>", text)
    assert pads == ["256xf32"], pads
    assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    outs = jax.eval_shape(fn, *args)
    assert [o.shape for o in outs] == [(M, N), (4, M), (M,)]


@cpu_only
@pytest.mark.slow
def test_partial_rows_and_k_in_interpret_mode():
    """(The interpreter runs on operands padded to whole tiles, as TMA loads them.) 200 rows on 128-row tiles with
    row vectors and a tile input; K = 200 in 64-deep steps with A read transposed."""
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _check_scaled_rows(200, 128, 256, MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=32, num_stages=2,
                                                           epi_tile_n=32, wg_split="m"), tile=True)
        _check_partial_k(128, 200, 128, dataclasses.replace(_TINY, tile_k=64))


@cpu_only
def test_rows_not_a_multiple_of_8_lower_through_untiled_views_with_nothing_padded_but_row_vectors():
    """M = 1001 (and 100) on 128-row tiles, bf16 out: A and the output keep their rows in the CUDA program, and
    the kernel's A stages and output slots each have a second view without the 8-row tiles (TMA moves any rows
    through it); only the (M,) input is padded."""
    for M, fields in ((1001, dict(tile_m=64, tile_n=128, wg_split="m")),
                      (100, dict(tile_m=64, tile_n=128, wg_split="m", stream_k=2))):
        config = MosaicGemmConfig(**fields)
        K, N = 512, 512

        def fn(a, b, s):
            return gemm(a, b, config=config, out_dtype=jnp.bfloat16, fusion=_scaled_rows(M, 4), arrays=dict(s=s),
                        partial_rows=True)

        args = (S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((M,), jnp.float32))
        with mock.patch.object(plgpu, "RefUnion", side_effect=plgpu.RefUnion) as union:
            with backends.lowering_for_gpu():
                text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                (kernel,) = mosaic_ir.lower_kernels(fn, *args)
        whole = -(-M // 128) * 128
        assert re.findall(r"stablehlo\.pad .*-> tensor<([^>]*)>", text) == [f"{whole}xf32"]
        assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
        assert [o.shape for o in jax.eval_shape(fn, *args)] == [(M, N), (4, M), (M,)]
        # A's stages and the output's slots, each as (8-row tiles, swizzle) and (swizzle) views of one shape
        stages = min(config.num_stages, K // config.tile_k)
        assert {c.args[0].shape for c in union.call_args_list} == {
            (stages, config.cta_m, config.tile_k), (2, 2, config.epi_tile_m, config.epi_tile_n)}
        for call in union.call_args_list:
            tiled, untiled = call.args
            assert tiled.shape == untiled.shape and tiled.dtype == untiled.dtype
            assert [type(t).__name__ for t in tiled.transforms] == ["TilingTransform", "SwizzleTransform"]
            assert [type(t).__name__ for t in untiled.transforms] == ["SwizzleTransform"]


@cpu_only
@pytest.mark.slow
def test_rows_not_a_multiple_of_8_in_interpret_mode():
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _check_scaled_rows(75, 128, 128, MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=32, num_stages=2,
                                                          epi_tile_n=32, wg_split="m"))


_ANY_ROWS_CASES = [  # (M, K, N, config fields, out dtype): rows not a multiple of 8 (untiled views) on the GPU
    (1001, 1024, 2048, dict(tile_m=64, tile_n=256, wg_split="m", num_stages=3), jnp.bfloat16),
    (4099, 2048, 1024, dict(tile_m=128, tile_n=128, wg_split="n", num_stages=3), jnp.bfloat16),
    (100, 512, 512, dict(tile_m=64, tile_n=128, wg_split="m", stream_k=2, epi_tile_n=32), jnp.float32),
    (13, 512, 512, dict(tile_m=64, tile_n=128, wg_split="m", schedule="pingpong"), jnp.bfloat16)]


@cpu_only
def test_the_gpu_cases_of_any_rows_lower_within_shared_memory():
    for M, K, N, fields, out_dtype in _ANY_ROWS_CASES:
        config = MosaicGemmConfig(**fields)
        (kernel,) = mosaic_ir.lower_kernels(
            lambda a, b, s: gemm(a, b, config=config, out_dtype=out_dtype, partial_rows=True,
                                 fusion=_scaled_rows(M, N // config.tile_n), arrays=dict(s=s)),
            S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16), S((M,), jnp.float32))
        assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES


@gpu_only
@pytest.mark.parametrize("M, K, N, fields, out_dtype", _ANY_ROWS_CASES)
def test_rows_not_a_multiple_of_8_on_the_gpu(M, K, N, fields, out_dtype):
    _check_scaled_rows(M, K, N, MosaicGemmConfig(**fields), out_dtype=out_dtype)


_PARTIAL_ROWS_CASES = [  # (M, K, N, config fields) of the GPU tests
    (1000, 1024, 2048, dict(tile_m=64, tile_n=256, wg_split="m", tile_k=32, num_stages=3)),  # 8 rows of tiles, the
    (4104, 2048, 1024, dict(tile_m=128, tile_n=128, wg_split="n", tile_k=32, num_stages=3)),  # last 104 / 8 real
    (200, 512, 512, dict(tile_m=64, tile_n=128, wg_split="m", stream_k=2))]  # stream-K over a row past M
_PARTIAL_K_CASES = [(1024, 1000, 2048), (2048, 4104, 1024), (512, 200, 512)]  # (M, K, N)
_PARTIAL_K_CONFIG = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", num_stages=3)


@cpu_only
def test_the_gpu_cases_of_partial_rows_and_k_lower_within_shared_memory():
    for M, K, N, fields in _PARTIAL_ROWS_CASES:
        config = MosaicGemmConfig(**fields)
        for tile in (False, True):
            fn = functools.partial(gemm, config=config, out_dtype=jnp.float32, partial_rows=True,
                                   fusion=_scaled_rows(M, N // config.tile_n, tile))
            args = (S((M, K), jnp.bfloat16), S((K, N), jnp.bfloat16))
            arrays = dict(s=S((M,), jnp.float32), c=S((M, N), jnp.bfloat16)) if tile else dict(s=S((M,), jnp.float32))
            (kernel,) = mosaic_ir.lower_kernels(lambda a, b, arrays: fn(a, b, arrays=arrays), *args, arrays)
            assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    for M, K, N in _PARTIAL_K_CASES:
        (kernel,) = mosaic_ir.lower_kernels(
            lambda at, b: gemm(at, b, config=_PARTIAL_K_CONFIG, out_dtype=jnp.float32, transpose_a=True,
                               partial_k=True), S((K, M), jnp.bfloat16), S((K, N), jnp.bfloat16))
        assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES


@gpu_only
@pytest.mark.parametrize("M, K, N, fields", _PARTIAL_ROWS_CASES)
@pytest.mark.parametrize("tile", [False, True], ids=["rows", "rows_and_tile"])
def test_partial_rows_on_the_gpu(M, K, N, fields, tile):
    _check_scaled_rows(M, K, N, MosaicGemmConfig(**fields), tile=tile)


@gpu_only
@pytest.mark.parametrize("M, K, N", _PARTIAL_K_CASES)
def test_partial_k_on_the_gpu(M, K, N):
    _check_partial_k(M, K, N, _PARTIAL_K_CONFIG)
