"""The Mosaic (Hopper) backend of rmsnorm_matmul against the float32 reference: forward and every gradient.

On any machine: unsupported shapes and bad arguments give the ValueError text, and the CUDA lowering at the suite
shapes is one Mosaic kernel forward and three forward + backward, within shared memory, with no normalized
(M, K) tensor outside them. On an sm90 GPU: numbers at real and odd (tile-multiple) shapes, bf16 and fp16,
extreme magnitudes, NaN. On the CPU (slow): the same numbers in GPU interpret mode at tiny shapes.
"""

import dataclasses
import importlib
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlo_inspect import mosaic_ir
from pallas_kernels import mosaic_utils, reference
from pallas_kernels.gemm import MosaicGemmConfig

nm = importlib.import_module("pallas_kernels.norm_matmul.mosaic")  # the package's __init__ is the lead's

ON_SM90 = mosaic_utils.is_hopper()
gpu_only = pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU")
cpu_only = pytest.mark.skipif(jax.default_backend() == "gpu", reason="structure / interpret-mode checks")
S = jax.ShapeDtypeStruct
SUITE_SHAPES = [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144), (16384, 1024, 5504)]  # (M, K, N)
_KEYS = itertools.count(9000)
_BASE_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}  # relative, at a reduction of 1024; grows with its sqrt


def _key():
    return jax.random.key(next(_KEYS))


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _inputs(M, K, N, dtype, *, scale=1.0, residual=False):
    x = (scale * jax.random.normal(_key(), (M, K), jnp.float32)).astype(dtype)
    gamma = (1.0 + 0.2 * jax.random.normal(_key(), (K,), jnp.float32)).astype(dtype)
    w = (jax.random.normal(_key(), (K, N), jnp.float32) * K**-0.5).astype(dtype)
    res = (scale * jax.random.normal(_key(), (M, K), jnp.float32)).astype(dtype) if residual else None
    return x, gamma, w, res


def _fwd_bwd(fn, x, gamma, w, res, cotangents):
    args = (x, gamma, w) + ((res,) if res is not None else ())

    def run(*args):
        out, vjp = jax.vjp(lambda x, g, w, *r: fn(x, g, w, residual=r[0] if r else None), *args)
        return out, vjp(jax.tree.map(lambda c, o: c.astype(o.dtype), cotangents, out))
    return jax.jit(run)(*args)


def _check(M, K, N, dtype, *, residual=False, scale=1.0, eps=1e-6, config=None):
    """Forward and every gradient of the Mosaic backend against the float32 reference on the same inputs."""
    x, gamma, w, res = _inputs(M, K, N, dtype, scale=scale, residual=residual)
    dy = jax.random.normal(_key(), (M, N), jnp.float32).astype(dtype)
    cot = (jax.random.normal(_key(), (M, K), jnp.float32).astype(dtype), dy) if residual else dy
    got = _fwd_bwd(lambda *a, **k: nm.rmsnorm_matmul(*a, eps=eps, config=config, **k), x, gamma, w, res, cot)
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    want = _fwd_bwd(lambda *a, **k: reference.rmsnorm_matmul(*a, eps=eps, **k), f32(x), f32(gamma), f32(w),
                    f32(res), cot)
    names = ["h", "y"] if residual else ["y"]
    names += ["dx", "dres", "dgamma", "dw"] if residual else ["dx", "dgamma", "dw"]
    reductions = dict(h=1, y=K, dx=N, dres=N, dgamma=M * N, dw=M)
    for name, g, r in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == r.shape and g.dtype == jnp.dtype(dtype if name != "dgamma" else gamma.dtype), name
        tol = _BASE_TOL[dtype] * max(1.0, math.sqrt(min(reductions[name], 1 << 20) / 1024))
        err = _rel_err(g, r)
        assert err <= tol, (name, err, tol)  # a NaN error fails


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M, K, N, dtype, message", [
    (16, 4096, 4096, jnp.bfloat16, "M=16 is not a positive multiple of the rows"),
    (1, 4096, 14336, jnp.bfloat16, "M=1 is not a positive multiple"),
    (1024, 4100, 1024, jnp.bfloat16, "K=4100 is not a positive multiple of tile_k=64"),
    (1024, 1024, 1000, jnp.bfloat16, "N=1000 is not a positive multiple of the columns"),
    (1024, 1024, 1024, jnp.float32, "dtype float32 is not supported by the Mosaic backend"),
])
def test_unsupported_reason_names_the_constraint(M, K, N, dtype, message):
    reason = nm.unsupported_reason(M, K, N, dtype, False)
    assert reason is not None and message in reason
    x, g, w = S((M, K), dtype), S((K,), dtype), S((K, N), dtype)
    with pytest.raises(ValueError, match=re.escape(message)):
        jax.eval_shape(lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=1e-6), x, g, w)


@pytest.mark.parametrize("M, K, N", SUITE_SHAPES)
def test_the_suite_shapes_are_supported(M, K, N):
    assert nm.unsupported_reason(M, K, N, jnp.bfloat16, False) is None
    assert nm.unsupported_reason(M, K, N, jnp.bfloat16, True) is None


def test_out_dtype_other_than_x_dtype_is_unsupported():
    assert "out_dtype=float32" in nm.unsupported_reason(1024, 1024, 1024, jnp.bfloat16, False, out_dtype=jnp.float32)


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_negative_or_nan_eps_is_a_value_error_naming_eps(eps):
    x, g, w = S((256, 256), jnp.bfloat16), S((256,), jnp.bfloat16), S((256, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="eps: must be >= 0"):
        jax.eval_shape(lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=eps), x, g, w)


def test_config_fields_must_be_gemm_configs():
    with pytest.raises(ValueError, match="MosaicRMSNormMatmulConfig.dx"):
        nm.MosaicRMSNormMatmulConfig(forward=MosaicGemmConfig(), dx={"tile_m": 64}, dw=MosaicGemmConfig())
    config = nm.default_config(4096, 4096, 14336)
    assert nm.MosaicRMSNormMatmulConfig.from_dict(config.to_dict()) == config


# ---------------------------------------------------------------------------------------------------------------
# Structure (lowered for CUDA; no GPU needed)
# ---------------------------------------------------------------------------------------------------------------
_IN_KERNEL = dict(stats_in_kernel=True, rowdot_in_kernel=True)


def _lowered_fwd_bwd(M, K, N, residual, config=None):
    def fwd_bwd(x, g, w, dy, *r):
        out, vjp = jax.vjp(lambda x, g, w, *r: nm.rmsnorm_matmul(x, g, w, eps=1e-6, residual=r[0] if r else None,
                                                                 config=config), x, g, w, *r)
        return out, vjp((x, dy) if r else dy)

    dt = jnp.bfloat16
    args = [S((M, K), dt), S((K,), dt), S((K, N), dt), S((M, N), dt)] + ([S((M, K), dt)] if residual else [])
    return fwd_bwd, args


def _check_kernels(M, K, N, residual, config=None):
    fn, args = _lowered_fwd_bwd(M, K, N, residual, config)
    kernels = mosaic_ir.lower_kernels(fn, *args)
    assert [k.name for k in kernels] == ["rmsnorm_matmul_fwd", "rmsnorm_matmul_dx", "rmsnorm_matmul_dw"]
    gemms = (config.forward, config.dx, config.dw) if config else (None,) * 3
    for k, gemm in zip(kernels, gemms):
        dedicated = gemm is not None and gemm.prologue_wg == "dedicated"
        assert k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES and k.warpgroups == (4 if dedicated else 3)
        assert k.wgmma() and k.tma_loads() >= 2
    forward_only = mosaic_ir.lower_kernels(lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=1e-6, config=config),
                                           *args[:3])
    assert [k.name for k in forward_only] == ["rmsnorm_matmul_fwd"]


@cpu_only
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("M, K, N", SUITE_SHAPES)
def test_three_kernels_within_shared_memory_at_the_suite_shapes(M, K, N, residual):
    _check_kernels(M, K, N, residual)


@cpu_only
@pytest.mark.parametrize("M, K, N, residual", [(32768, 4096, 4096, False), (16384, 1024, 5504, True)])
def test_statistics_in_the_kernels_fit_too(M, K, N, residual):
    config = nm.default_config(M, K, N, residual=residual, **_IN_KERNEL)
    assert config.stats_in_kernel and config.rowdot_in_kernel
    _check_kernels(M, K, N, residual, config)


@cpu_only
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("M, K, N", SUITE_SHAPES)
def test_statistics_in_a_dedicated_warpgroup_fit(M, K, N, residual):
    config = nm.default_config(M, K, N, residual=residual, prologue_wg="dedicated", **_IN_KERNEL)
    if N % 256 == 0:  # tiles with wg_split "n": the forward's prologue gets its own warpgroup
        assert config.forward.prologue_wg == "dedicated" and config.forward.pipeline == "own"
    _check_kernels(M, K, N, residual, config)


def _mk_producers(program: str, M: int, K: int, dtype: str = "") -> list[str]:
    """Ops other than custom calls (the kernels) whose result is an (M, K) tensor (of ``dtype``, e.g. "bf16"),
    in StableHLO text, as (op name, line)."""
    found = []
    for line in program.splitlines():
        if "= stablehlo." not in line or "custom_call" in line:
            continue
        result = line.rsplit("->", 1)[1] if "->" in line else line.rsplit(": ", 1)[-1]
        if result.strip().startswith(f"tensor<{M}x{K}x{dtype}"):
            found.append((line.split("= stablehlo.", 1)[1].split()[0], line.strip()))
    return found


@cpu_only
@pytest.mark.parametrize("in_kernel", [False, True])
def test_no_normalized_activations_outside_the_kernels(in_kernel):
    from jaxfuse import kernels

    M, K, N = 2048, 1024, 768  # M, K, N distinct: an (M, K) tensor is recognizable by its shape
    config = nm.default_config(M, K, N, **(_IN_KERNEL if in_kernel else {}))
    fn, args = _lowered_fwd_bwd(M, K, N, residual=False, config=config)
    program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert program.count("mosaic_gpu_v2") == 3
    assert _mk_producers(program, M, K, "bf16") == []  # dx (M, K) comes out of the dx kernel
    ops = {op for op, _ in _mk_producers(program, M, K)}
    # the statistics' XLA reduction squares x in float32 (one fusion with its reduce); in-kernel: nothing at all
    assert ops == (set() if in_kernel else {"convert", "multiply"})
    # the check sees them where they exist: XLA's norm + matmul rounds rmsnorm(x) to bf16 for its GEMM
    xla = jax.jit(lambda x, g, w, dy: jax.vjp(kernels.NORM_MATMUL["xla"], x, g, w)[1](dy)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert len(_mk_producers(xla, M, K, "bf16")) >= 1


# ---------------------------------------------------------------------------------------------------------------
# Numbers: sm90 GPU; CPU interpret mode (slow)
# ---------------------------------------------------------------------------------------------------------------
@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, residual, in_kernel", [
    (4096, 4096, 4096, jnp.bfloat16, False, False),
    (4096, 4096, 4096, jnp.bfloat16, False, True),
    (384, 1152, 640, jnp.bfloat16, True, False),     # odd tile multiples: the smaller fallback tiles
    (384, 1152, 640, jnp.bfloat16, True, True),
    (2048, 2048, 1536, jnp.float16, False, False),
])
def test_forward_and_gradients_on_the_gpu(M, K, N, dtype, residual, in_kernel):
    config = nm.default_config(M, K, N, residual=residual, **(_IN_KERNEL if in_kernel else {}))
    _check(M, K, N, dtype, residual=residual, config=config)


@gpu_only
@pytest.mark.parametrize("dtype, scale", [(jnp.float16, 1e-6), (jnp.float16, 1e-7), (jnp.bfloat16, 1e3),
                                          (jnp.float16, 30.0)])
def test_extreme_magnitudes_on_the_gpu(dtype, scale):
    # fp16 x near 1e-6: x itself is the wgmma operand (never rounded after scaling), so it is as accurate as
    # the unfused fp16 computation; the relative error is measured against the float32 reference.
    _check(512, 1024, 768, dtype, scale=scale)


@gpu_only
def test_nan_never_passes():
    x, gamma, w, _ = _inputs(512, 512, 512, jnp.bfloat16)
    y = jax.jit(lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=1e-6))(x.at[7, 3].set(jnp.nan), gamma, w)
    assert bool(jnp.all(jnp.isnan(y[7]))) and not bool(jnp.any(jnp.isnan(jnp.delete(y, 7, axis=0))))


_TINY = MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=32, num_stages=2, epi_tile_n=32)
_TINY_CONFIG = nm.MosaicRMSNormMatmulConfig(forward=_TINY, dx=_TINY, dw=_TINY)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("in_kernel", [False, True, "dedicated"])
@pytest.mark.parametrize("dtype, residual, scale", [(jnp.bfloat16, False, 1.0), (jnp.bfloat16, True, 1.0),
                                                    (jnp.float16, False, 1e-6)])
def test_forward_and_gradients_in_interpret_mode(dtype, residual, scale, in_kernel):
    config = dataclasses.replace(_TINY_CONFIG, stats_in_kernel=bool(in_kernel), rowdot_in_kernel=bool(in_kernel))
    if in_kernel == "dedicated":  # the prologues run in a fourth warpgroup of our own K loop
        own = dataclasses.replace(_TINY, pipeline="own", prologue_wg="dedicated")
        config = dataclasses.replace(config, forward=own, dx=own)
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2 blocks walk 2-4 output tiles each
        _check(128, 128, 256, dtype, residual=residual, scale=scale, config=config)
