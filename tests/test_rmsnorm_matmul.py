"""rmsnorm_matmul: the shared tests (``base_norm_matmul``) for each backend, backend selection, and the Triton backend's
own: the config variants a sweep may pick, the pipeliner hazard, fp16 precision at tiny magnitudes, the Triton
lowering at GPU tiles, the tables, config errors. The Mosaic backend's own tests: ``test_norm_matmul_mosaic.py``."""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from base_norm_matmul import SIZES, NormMatmulTests, inputs, zeros
from conftest import GPU_TIMEOUT, ON_GPU, cuda_program, pallas_calls, rel_err, tolerance
from jaxfuse import kernels
from pallas_kernels import RMSNormMatmulConfig, backends, norm_matmul, reference, triton_utils
from pallas_kernels.norm_matmul import config as nm_config

rmsnorm_matmul = norm_matmul.rmsnorm_matmul


@GPU_TIMEOUT
class TestTriton(NormMatmulTests):
    backend = "triton"


@contextlib.contextmanager
def _lowering_with_the_built_in_tables():
    """Lowering for CUDA with the built-in tables' forms on any machine: on an H200 the untuned rule would run XLA's
    backward at TestMosaic's 384 rows (``config._untuned_backward``), where the program test counts our kernels."""
    with mock.patch.object(nm_config, "UNTUNED_DEVICES", ()), backends.lowering_for_gpu():
        yield


@GPU_TIMEOUT
class TestMosaic(NormMatmulTests):
    """On CPU the numbers skip (the registry: Mosaic needs an sm90 GPU) and the program test traces inside
    ``lowering_for_gpu``. Sizes: multiples of the Mosaic tiles (no partial tiles), odd ones (3 row blocks, K and N
    that 256 does not divide: the fallback tiles); the one-row, few-row and float32 cases skip with the backend's
    reason."""

    backend = "mosaic"
    sizes = dict(odd=384, one=1, few=37, K=1152, N=640, N_odd=784)
    program_shape = (384, 1152, 640)
    train_kernels = 2  # forward and dx: dw's (1152, 640) output has 45 tiles, too few for the core (cuBLAS runs it)
    program_context = staticmethod(_lowering_with_the_built_in_tables)
    # XLA's row statistics: x squared in float32 inside the reduction fusion that gives r (and, with a residual,
    # h = x + residual, the op's output) -- never a normalized tensor (test_norm_matmul_mosaic checks the HLO); x ⊙
    # gamma (gamma_on "x", the default at M < 2N); the row dot on the K side (the default): dx = s · (u − (r² / K)
    # · c · x) from the dx kernel's u, in one XLA fusion.
    mk_ops_outside_kernels = {False: ("convert_element_type", "mul", "sub"),
                              True: ("add", "convert_element_type", "mul", "pad", "sub")}


_TRITON = TestTriton()


# ------------------------------------------------------------------------------------------------ backend selection
def test_auto_keeps_triton_and_mosaic_names_why_it_cannot_run():
    x, gamma, w = zeros(384, 1152, 640, jnp.bfloat16)
    assert norm_matmul.BACKENDS.names == ("mosaic", "triton")
    if not ON_GPU:
        assert norm_matmul.plan(x, gamma, w).backend == "triton"
    with backends.lowering_for_gpu():  # both can run: nothing tuned at this shape, so Mosaic (first in the registry)
        assert norm_matmul.plan(x, gamma, w).backend == "mosaic"
        assert norm_matmul.plan(x, gamma, w, backend="mosaic").backend == "mosaic"
        for args, kwargs, match in [
                (zeros(16, 1152, 640, jnp.bfloat16), {}, "M=16 is below 24 rows"),
                (zeros(384, 1100 + 4, 640, jnp.bfloat16), {}, "K=1104 is not a positive multiple"),
                (zeros(384, 1152, 640), {}, "dtype float32 is not supported by the Mosaic backend"),
                ((x, gamma, w), dict(out_dtype=jnp.float32), "out_dtype=float32 must equal x's dtype bfloat16"),
                ((x, gamma, w), dict(interpret=True), r"no interpret mode \(interpret=True\)")]:
            assert norm_matmul.plan(*args, **kwargs).backend == "triton"  # "auto" falls back
            with pytest.raises(ValueError, match=rf"backend='mosaic' cannot run rmsnorm_matmul here: .*{match}"):
                norm_matmul.plan(*args, backend="mosaic", **kwargs)
    if not ON_GPU:
        with pytest.raises(ValueError, match=r"backend='mosaic' cannot run rmsnorm_matmul here: Mosaic GPU kernels "
                                             r"need an sm90 \(Hopper\) GPU.*; available here: 'triton'"):
            rmsnorm_matmul(x, gamma, w, backend="mosaic")


@pytest.mark.parametrize("backend", ["auto", "mosaic"])
def test_plan_takes_shape_dtype_structs(backend):
    """plan() of abstract arguments (leading axes, a residual) is the plan of arrays of those shapes and dtypes:
    nothing is allocated to ask what a call at 16384x1024x5504 would run (Mosaic inside lowering_for_gpu off a GPU)."""
    S = jax.ShapeDtypeStruct
    args = (S((4, 4096, 1024), jnp.bfloat16), S((1024,), jnp.bfloat16), S((1024, 5504), jnp.bfloat16))
    residual = S((4, 4096, 1024), jnp.bfloat16)
    with backends.lowering_for_gpu() if backend == "mosaic" else contextlib.nullcontext():
        abstract = norm_matmul.plan(*args, residual=residual, backend=backend)
        arrays = norm_matmul.plan(*(jnp.zeros(a.shape, a.dtype) for a in args),
                                  residual=jnp.zeros(residual.shape, residual.dtype), backend=backend)
    assert abstract == arrays and (backend == "auto" or abstract.backend == "mosaic")


def test_plan_refuses_a_config_the_call_refuses():
    """plan() runs the backend's check_config, so a plan that returns is one the call runs (it returned a Triton
    block_k that does not divide K, which only the call refused)."""
    x, gamma, w = zeros(64, 96, 64)
    for call in (norm_matmul.plan, rmsnorm_matmul):
        with pytest.raises(ValueError, match=r"block_sizes: block_k=64 must divide K=96"):
            call(x, gamma, w, block_sizes={"block_k": 64})
    x, gamma, w = zeros(384, 1152, 640, jnp.bfloat16)
    with backends.lowering_for_gpu():
        with pytest.raises(ValueError, match=r"rmsnorm_matmul \(mosaic\): .*N=640"):
            norm_matmul.plan(x, gamma, w, backend="mosaic", block_sizes={"forward": {"tile_n": 256}})


@pytest.mark.skipif(not ON_GPU, reason="the tuned Triton entries run on a GPU")
@pytest.mark.parametrize("M, K, N", [(1, 4096, 14336), (16, 4096, 4096), (16384, 1024, 5504)])
def test_this_devices_tuned_triton_entries_on_the_gpu(M, K, N):
    """Forward and gradients with the tuning cache's Triton entry for this device (the H200's own at decode sizes
    and at 16384x1024x5504, from rmsnorm_matmul-sweep_decode_dw_in_dx-h200-496308c.json and
    rmsnorm_matmul-sweep_mlp1024_triton-h200-d2f0f12-log.txt), against the float32 reference."""
    x, gamma, w, _ = inputs(M, K, N, jnp.bfloat16)
    _TRITON.check_against_reference(x, gamma, w, None, tolerance(jnp.bfloat16, max(M, K, N)))


@pytest.mark.parametrize("times, chosen", [({"triton": 100.0, "mosaic": 90.0}, "mosaic"),
                                           ({"triton": 100.0, "mosaic": 110.0}, "triton"),
                                           ({"mosaic": 500.0}, "mosaic"), ({"triton": 80.0}, "mosaic"),
                                           ({}, "mosaic")])  # not both tuned: the first in the registry
def test_auto_takes_the_faster_tuned_time(times, chosen, monkeypatch):
    from pallas_kernels import tuning

    x, gamma, w = zeros(384, 1152, 640, jnp.bfloat16)
    key = norm_matmul.tuning_key(x, gamma, w)
    monkeypatch.setattr(tuning, "tuned_time_us",
                        lambda op, k, *, backend: times.get(backend) if (op, k) == ("rmsnorm_matmul", key) else None)
    with backends.lowering_for_gpu():
        assert norm_matmul.plan(x, gamma, w).backend == chosen


def test_auto_with_one_backends_fields_runs_that_backend(monkeypatch):
    """block_sizes given as a mapping of fields only one backend's config has (a Triton tuned entry's params) asks
    for that backend where "auto" would take the other (notebook 03 lowers the H100's Triton entry on a Hopper GPU,
    where Mosaic is tuned faster); fields of neither are still a ValueError naming them."""
    from pallas_kernels import tuning

    x, gamma, w = zeros(384, 1152, 640, jnp.bfloat16)
    monkeypatch.setattr(tuning, "tuned_time_us", lambda op, k, *, backend: {"triton": 100.0, "mosaic": 90.0}[backend])
    with backends.lowering_for_gpu():
        assert norm_matmul.plan(x, gamma, w).backend == "mosaic"
        chosen = norm_matmul.plan(x, gamma, w, block_sizes=dict(gamma_on_w=True, block_m=64))
        assert (chosen.backend, chosen.config.gamma_on_w, chosen.config.block_m) == ("triton", True, 64)
        assert norm_matmul.plan(x, gamma, w, block_sizes=dict(row_dot="k")).backend == "mosaic"
        with pytest.raises(ValueError, match=r"block_sizes: unknown fields \['block_q'\]"):
            norm_matmul.plan(x, gamma, w, block_sizes=dict(block_q=64))


def test_the_h100_cache_times_triton_wherever_mosaic_is_tuned():
    """"auto" compares tuned times only where every backend has one (Mosaic, first in the registry, otherwise): at
    each shape the H100 cache holds a Mosaic entry for, Triton has a time too, and Mosaic's is the lower, so "auto"
    runs Mosaic there (rmsnorm_matmul-sweep-triton-h100-19054fc.json: Triton 2336 / 2004 / 974 / 199 µs fwd+bwd at
    4096x4096x14336 / 8192x4096x6144 / 4096x2048x11008 / 8192x512x2816; -sweep-qkv-h100-6aa71dd.json: 307 against
    258 at the 1b train step's QKV projection 4096x2048x3072, 77 against 65 at the small one's 8192x512x768)."""
    from pallas_kernels import tuning

    device = "NVIDIA H100 80GB HBM3"
    mosaic_keys = tuning.load_cache(tuning.DEFAULT_CACHE_PATH)["entries"][device]["mosaic"]["rmsnorm_matmul"]
    assert len(mosaic_keys) >= 7
    for key in mosaic_keys:
        triton, mosaic = (tuning.tuned_time_us("rmsnorm_matmul", key, backend=b, device=device)
                          for b in ("triton", "mosaic"))
        assert triton is not None and mosaic is not None and mosaic < triton, (key, triton, mosaic)


# ------------------------------------------------------------------------------------------------ Triton variants
@pytest.mark.parametrize("variant", [
    dict(gamma_on_w=True, rowdot_in_dx=True, rstd_on_dy=True),
    pytest.param(dict(block_m=32, block_n=16, block_k=32, block_m_dx=32, block_k_dx=32, block_n_dx=16, block_k_dw=32,
                      block_n_dw=16, block_m_dw=32, group=3, num_warps=4, num_warps_dx=4, num_warps_dw=4),
                 marks=pytest.mark.slow),
], ids=["folded-variants", "other-tiles"])
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
def test_config_variants_match_reference(variant, dtype):
    """The alternative code paths a sweep may pick (gamma folded into w, the row dot inside the dx kernel, r on
    the dy tile, other tile shapes) compute the same function."""
    x, gamma, w, res = inputs(SIZES["odd"], SIZES["K"], SIZES["N"], dtype, residual=True)
    _TRITON.check_against_reference(x, gamma, w, res, tolerance(dtype), block_sizes=variant)


@pytest.mark.parametrize("residual", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["plain", "residual"])
@pytest.mark.parametrize("variant", [pytest.param(dict(split_k=2), marks=pytest.mark.slow),
                                     dict(split_k=2, gamma_on_w=True), dict(split_n_dx=2, rowdot_in_dx=False),
                                     pytest.param(dict(dw_in_xla=True), marks=pytest.mark.slow)],
                         ids=["split_k", "split_k-gamma_on_w", "split_n_dx", "dw_in_xla"])
def test_split_variants_match_reference(variant, residual):
    """Split-K forward and split-N dx (float32 partials combined, and the epilogue applied, outside the kernel),
    with and without a residual (whose cotangent joins dx), gamma in registers or folded into w, odd row count."""
    x, gamma, w, res = inputs(SIZES["odd"], SIZES["K"], SIZES["N"], jnp.float32, residual=residual)
    _TRITON.check_against_reference(x, gamma, w, res, tolerance(jnp.float32), block_sizes=variant)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_dw_written_by_the_dx_kernel_matches_reference(split, dtype, residual):
    """dw_in_dx (decode): the dx kernel's programs hold every row and write each dw tile beside the w tile they
    read; whole or with N split over two programs per dx tile (then XLA finishes dx), few rows (some masked), with
    and without a residual (whose cotangent the dx kernel, or XLA's finish, adds)."""
    x, gamma, w, res = inputs(SIZES["few"], SIZES["K"], SIZES["N"], dtype, residual=residual)
    tiles = dict(block_k_dx=64, block_n_dx=128) if ON_GPU else dict(block_k_dx=16, block_n_dx=16)
    blocks = dict(tiles, block_m_dx=64, split_n_dx=split, rowdot_in_dx=False, dw_in_dx=True)
    _TRITON.check_against_reference(x, gamma, w, res, tolerance(dtype), block_sizes=blocks)


@pytest.mark.slow
def test_split_k_bf16_four_splits_match_reference():
    """bf16 inputs, K split over 4 programs, few rows: forward and all gradients within the bf16 tolerance."""
    x, gamma, w, _ = inputs(SIZES["few"], SIZES["K"] * 2, SIZES["N"], jnp.bfloat16)
    _TRITON.check_against_reference(x, gamma, w, None, tolerance(jnp.bfloat16), block_sizes=dict(split_k=4))


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_gamma_on_w_without_residual_at_the_swept_tiles(dtype):
    """The config the H100 sweep picked (gamma folded into w, r on the dy tile, 128x256x64 forward tiles, group 8)
    without a residual, which is how the sweep and the model call it: several tiles along every axis and a
    partial last group of row blocks (3 row blocks of 128, group 8). The variants test above only ran the folded
    path with a residual, where the A tile is computed in registers and the failing pattern never arises."""
    cfg = dict(_SWEPT_CONFIG, block_m=128, block_n=128) if not ON_GPU else _SWEPT_CONFIG
    x, gamma, w, _ = inputs(384 if ON_GPU else 192, 256, 512, dtype)
    _TRITON.check_against_reference(x, gamma, w, None, tolerance(dtype), block_sizes=cfg)


# ------------------------------------------------------------------------------------------------ precision
def _rmsnorm_matmul_with_stat_dtype(x, gamma, w, stat_dtype, eps=1e-6):
    """rmsnorm(x)·γ @ w whose sum of squares runs along K in a ``stat_dtype`` accumulator, one element at a time
    (what a kernel carrying its row statistic in that dtype through the K loop does)."""
    x32 = x.astype(jnp.float32)
    sq = (x32 * x32).astype(stat_dtype)  # (M, K)

    def add(acc, column):
        return (acc.astype(stat_dtype) + column).astype(stat_dtype), None

    sum_sq, _ = lax.scan(add, jnp.zeros(x.shape[0], stat_dtype), sq.T)
    rstd = lax.rsqrt(sum_sq.astype(jnp.float32) / x.shape[1] + eps)
    normed = x32 * rstd[:, None] * gamma.astype(jnp.float32)
    return jnp.dot(normed, w.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def test_statistics_need_a_float32_accumulator_at_k8192():
    """At K = 8192 a bfloat16 running sum of x² stalls (its spacing passes 1 near 256), so the norm comes out
    several times too large and fails the 1e-2 tolerance; a float32 accumulator passes, and so does the kernel."""
    M, K, N = 4, 8192, 16
    x, gamma, w, _ = inputs(M, K, N, jnp.bfloat16)
    want = reference.rmsnorm_matmul(x, gamma, w, out_dtype=jnp.float32)
    assert rel_err(_rmsnorm_matmul_with_stat_dtype(x, gamma, w, jnp.bfloat16), want) > 1e-2
    assert rel_err(_rmsnorm_matmul_with_stat_dtype(x, gamma, w, jnp.float32), want) < 1e-3
    got = rmsnorm_matmul(x, gamma, w, out_dtype=jnp.float32, block_sizes={"block_k": 256})
    assert rel_err(got, want) <= 1e-2


# ------------------------------------------------------------------------------------------------ program
def _sub_jaxprs(eqn):
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            inner = getattr(sub, "jaxpr", None)
            inner = getattr(inner, "jaxpr", inner)
            if inner is not None and hasattr(inner, "eqns"):
                yield inner


def _kernel_jaxprs(jaxpr):
    """The kernel jaxpr of every pallas_call in a jaxpr (and its sub-jaxprs)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            kernel = eqn.params["jaxpr"]
            yield getattr(kernel, "jaxpr", kernel)
        else:
            for inner in _sub_jaxprs(eqn):
                yield from _kernel_jaxprs(inner)


def _raw_tiles_shared_by_dot_and_arithmetic(jaxpr):
    """Tiles read from a ref (get / masked load) that feed a dot_general directly AND any other equation, in this
    jaxpr or its sub-jaxprs (the loop bodies): [(dot, other users)]."""
    found = []
    users = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not hasattr(v, "val"):  # a Var, not a Literal
                users.setdefault(v, []).append(eqn.primitive.name)
        for inner in _sub_jaxprs(eqn):
            found += _raw_tiles_shared_by_dot_and_arithmetic(inner)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("get", "load"):
            for v in eqn.outvars:
                names = users.get(v, [])
                if "dot_general" in names and len(names) > 1:
                    found.append(sorted(names))
    return found


# The config the H100 sweep chose at 32768x4096x4096, 4096x4096x14336 and 8192x4096x6144 (0.5 relative error there).
_SWEPT_CONFIG = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, gamma_on_w=True,
                     block_m_dx=128, block_k_dx=128, block_n_dx=64, num_warps_dx=8, num_stages_dx=3,
                     rowdot_in_dx=False, block_k_dw=128, block_n_dw=128, block_m_dw=64, num_warps_dw=8,
                     num_stages_dw=3, rstd_on_dy=True, group=8)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("variant, dtype", [({}, jnp.bfloat16), ({}, jnp.float16),
                                            (dict(gamma_on_w=True), jnp.bfloat16), (dict(rstd_on_dy=True), jnp.bfloat16),
                                            (_SWEPT_CONFIG, jnp.bfloat16)],
                         ids=["default", "fp16-rows-rescaled", "gamma_on_w", "rstd_on_dy", "swept"])
def test_no_loaded_tile_feeds_a_dot_and_other_arithmetic(variant, dtype, residual):
    """Regression for the H100 failure (0.5 relative error in y and every gradient with gamma_on_w, the sweep's
    pick): Triton's software pipeliner (num_stages > 1; on Hopper the wgmma operand stays in shared memory)
    miscompiles a loop in which one loaded tile is both a dot operand and the input of other arithmetic (there:
    the x tile was the A operand and also squared into the RMS statistic). Interpret mode computes such a kernel
    correctly, so the test asserts on the kernels' programs: no raw tile is shared by a dot and anything else.
    (rowdot_in_dx=True still has that shape in the dx kernel, dy feeding both the dot and the row dot, and
    dw_in_dx has dy feeding two dots; they are not covered here and the GPU sweep checks them numerically: every
    dw_in_dx candidate within 4.2e-3 on the H200, rmsnorm_matmul-sweep_decode_dw_in_dx-h200-496308c-log.txt.)"""
    M, K, N = 256, 256, 512
    x, gamma, w, res = inputs(M, K, N, dtype, residual=residual)
    table = dict(nm_config.default_config(M, K, N, on_gpu=True).to_dict(), dw_in_xla=False)  # all 3 kernels
    cfg = RMSNormMatmulConfig(**dict(table, **variant))
    assert not cfg.rowdot_in_dx

    def loss(x, g, w, r):
        out = rmsnorm_matmul(x, g, w, residual=r, block_sizes=cfg, interpret=False)
        y = out if r is None else out[1]
        return jnp.sum(y.astype(jnp.float32) ** 2)

    train = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, gamma, w, res)
    kernels = list(_kernel_jaxprs(train.jaxpr))
    assert len(kernels) == 3
    for kernel in kernels:
        assert not _raw_tiles_shared_by_dot_and_arithmetic(kernel), _raw_tiles_shared_by_dot_and_arithmetic(kernel)


_SPLIT_DECODE = dict(block_n=128, block_k=128, split_k=4, block_k_dx=128, block_n_dx=256, split_n_dx=8,
                     rowdot_in_dx=False)


@pytest.mark.parametrize("dtype,M,K,N,residual,blocks", [
    (jnp.bfloat16, 300, 256, 512, True, None), (jnp.float32, 16, 4096, 4096, False, None),
    (jnp.float16, 1, 4096, 14336, False, None), (jnp.bfloat16, 16, 4096, 4096, False, _SPLIT_DECODE),
    (jnp.bfloat16, 16, 4096, 4096, True, _SPLIT_DECODE),
    (jnp.bfloat16, 16, 4096, 4096, False, dict(_SPLIT_DECODE, block_m_dx=16, block_k_dx=32, dw_in_dx=True)),
    (jnp.bfloat16, 1, 4096, 14336, False, dict(block_m_dx=16, split_n_dx=1, dw_in_dx=True))])
def test_lowers_to_triton_kernels(dtype, M, K, N, residual, blocks):
    """Even on CPU: the Triton lowering accepts every kernel at the GPU table's tiles (prefill and decode) and
    the split decode variants."""
    x = jax.ShapeDtypeStruct((M, K), dtype)
    gamma = jax.ShapeDtypeStruct((K,), jnp.float32)
    w = jax.ShapeDtypeStruct((K, N), dtype)
    res = x if residual else None

    def fn(x, g, w, r):
        out = rmsnorm_matmul(x, g, w, residual=r, interpret=False, block_sizes=blocks, backend="triton")
        return out if r is None else out[1]

    fwd = cuda_program(fn, x, gamma, w, res)
    argnums = (0, 1, 2) if res is None else (0, 1, 2, 3)
    train = cuda_program(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=argnums), x, gamma, w, res)
    cfg = backends.resolve_config(blocks, RMSNormMatmulConfig, lambda: nm_config.default_config(
        M, K, N, dtype, residual=residual, on_gpu=True))
    assert len(pallas_calls(fwd)) == 1
    assert len(pallas_calls(train)) == (2 if cfg.dw_in_xla or cfg.dw_in_dx else 3)  # fwd, dx (, dw)


# ------------------------------------------------------------------------------------------------ config
def test_default_config_fits_the_shape():
    cfg = nm_config.default_config(37, 48, 80, on_gpu=False)
    assert cfg.block_k == 16 and cfg.block_n == 16  # 48 = 16·3, 80 = 16·5: only 16 divides
    # Shapes with no tuning-cache entry (on a GPU the cache would override the table for the shapes).
    big = nm_config.default_config(4096, 2048, 8192, on_gpu=True)
    assert (big.block_m, big.block_n) == (128, 256) and big.dw_in_xla
    decode = nm_config.default_config(1, 2048, 8192, on_gpu=True)
    assert decode.block_m == 16 and decode.split_k > 1
    assert decode.dw_in_dx and decode.split_n_dx == 4  # every row in one dx row block: dw from the dx kernel
    assert not nm_config.default_config(32, 2048, 8192, on_gpu=True).dw_in_dx  # two row blocks of 16
    small_prefill = nm_config.default_config(128, 2048, 8192, on_gpu=True)  # one 128-row dx block, not decode
    assert small_prefill.dw_in_xla and not small_prefill.dw_in_dx
    for M, K, N in [(4096, 4096, 14336), (16, 4096, 4096), (1, 4096, 14336)]:
        fwd, bwd = nm_config.sweep_candidates(M, K, N)
        assert fwd and bwd
        for params in fwd + bwd:
            RMSNormMatmulConfig(**params).check_shape(K, N)  # valid, and fits the shape it is swept at
        assert any(c["split_k"] > 1 for c in fwd) == (M <= 64)
        if M <= 16:  # both backward forms at decode sizes, whichever the base config (table or entry) has
            assert {c["dw_in_dx"] for c in bwd} == {True, False}
    assert triton_utils.resolve_interpret(None) == (jax.default_backend() == "cpu")


# ------------------------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize("block_sizes,match", [
    ({"block_q": 16}, r"block_sizes: unknown fields \['block_q'\]"),
    ({"block_n": 48}, r"RMSNormMatmulConfig.block_n: must be a power of two >= 16, got 48"),
    ({"block_k": 64}, r"block_sizes: block_k=64 must divide K=32"),
    ({"gamma_on_w": 1}, r"RMSNormMatmulConfig.gamma_on_w: must be"),
    ({"split_k": 0}, r"RMSNormMatmulConfig.split_k: must be an int"),
    ({"block_k": 16, "split_k": 4}, r"block_sizes: split_k=4 times block_k=16 must divide K=32"),
    ({"split_n_dx": 2, "rowdot_in_dx": True}, r"split_n_dx > 1 needs rowdot_in_dx=False"),
    ({"dw_in_dx": True, "dw_in_xla": True}, r"dw_in_dx and dw_in_xla both name who computes dw"),
    ({"dw_in_dx": True, "block_m_dx": 16}, r"dw_in_dx needs every row in one dx row block: M=17 > block_m_dx=16"),
])
def test_bad_block_sizes(block_sizes, match):
    with pytest.raises(ValueError, match=match):
        rmsnorm_matmul(*zeros(M=17), block_sizes=block_sizes)
