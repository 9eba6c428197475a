"""rmsnorm_matmul against the float32 reference: forward and every gradient, variants, precision, program, errors.

On CPU the kernels run in Pallas interpret mode at tiny shapes (the CPU table's 16-wide tiles still give several
tiles along every axis, masked row tails and the grouped program order). On a GPU the same tests run the Triton
kernels at real shapes (``_SIZES`` picks the set). The lowering tests lower for CUDA even on CPU and assert on the
program: one Triton kernel forward, three for forward + backward, and no normalized (M, K) tensor outside them.
"""

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import reference, triton_utils

rm_module = importlib.import_module("pallas_kernels.rmsnorm_matmul")
rmsnorm_matmul = rm_module.rmsnorm_matmul
RMSNormMatmulConfig = rm_module.RMSNormMatmulConfig

ON_GPU = jax.default_backend() == "gpu"
# Named sizes: an odd row count, a single row, K and N (multiples of 16; on CPU small enough for interpret mode).
_SIZES = (dict(odd=1000, one=1, few=37, K=1024, N=768, N_odd=784) if ON_GPU
          else dict(odd=37, one=1, few=5, K=64, N=32, N_odd=48))
_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
_KEYS = itertools.count(2000)


def _key():
    """A fresh key per input."""
    return jax.random.key(next(_KEYS))


def _normal(shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(_key(), shape, jnp.float32)).astype(dtype)


def _rel_err(got, want):
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _inputs(M, K, N, dtype, *, lead=None, residual=False):
    shape = (M, K) if lead is None else (*lead, K)
    x = _normal(shape, dtype)
    gamma = (1.0 + _normal((K,), jnp.float32, 0.2)).astype(dtype)
    w = _normal((K, N), dtype, K**-0.5)
    res = _normal(shape, dtype) if residual else None
    return x, gamma, w, res


def _fwd_and_vjp(fn, args, cotangent):
    @jax.jit
    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangent)

    return run(args, cotangent)


def _check_against_reference(x, gamma, w, res, tol, **kwargs):
    """Forward and all gradients of the kernel vs the float32 reference, for one fresh random cotangent."""
    args = (x, gamma, w) if res is None else (x, gamma, w, res)
    fused = lambda x, g, w, r=None: rmsnorm_matmul(x, g, w, residual=r, **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k in ("eps", "out_dtype")}
    ref = lambda x, g, w, r=None: reference.rmsnorm_matmul(x, g, w, residual=r, **ref_kwargs)
    out_shapes = jax.eval_shape(fused, *args)
    cotangent = jax.tree.map(lambda s: _normal(s.shape, s.dtype), out_shapes)
    got_out, got_grads = _fwd_and_vjp(fused, args, cotangent)
    want_out, want_grads = _fwd_and_vjp(ref, args, cotangent)
    names = (["y"] if res is None else ["h", "y"]) + ["dx", "dgamma", "dw"] + ([] if res is None else ["dresidual"])
    got, want = jax.tree.leaves((got_out, got_grads)), jax.tree.leaves((want_out, want_grads))
    assert len(got) == len(names) == len(want)
    for name, g, r in zip(names, got, want):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, g.dtype, r.shape, r.dtype)
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        err = _rel_err(g, r)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# ------------------------------------------------------------------------------------------------ correctness
_S = _SIZES


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype,M,N", [(jnp.float32, _S["odd"], _S["N"]), (jnp.bfloat16, _S["odd"], _S["N"]),
                                       (jnp.bfloat16, _S["one"], _S["N_odd"]), (jnp.float16, _S["few"], _S["N"])],
                         ids=["fp32-odd", "bf16-odd", "bf16-one-row", "fp16-few"])
def test_matches_reference(dtype, M, N, residual):
    x, gamma, w, res = _inputs(M, _S["K"], N, dtype, residual=residual)
    _check_against_reference(x, gamma, w, res, _TOL[dtype])


@pytest.mark.parametrize("variant", [
    dict(gamma_on_w=True, rowdot_in_dx=True, rstd_on_dy=True),
    dict(block_m=32, block_n=16, block_k=32, block_m_dx=32, block_k_dx=32, block_n_dx=16, block_k_dw=32,
         block_n_dw=16, block_m_dw=32, group=3, num_warps=4, num_warps_dx=4, num_warps_dw=4),
], ids=["folded-variants", "other-tiles"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_config_variants_match_reference(variant, dtype):
    """The alternative code paths a sweep may pick (gamma folded into w, the row dot inside the dx kernel, r on
    the dy tile, other tile shapes) compute the same function."""
    x, gamma, w, res = _inputs(_S["odd"], _S["K"], _S["N"], dtype, residual=True)
    _check_against_reference(x, gamma, w, res, _TOL[dtype], block_sizes=variant)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("variant", [dict(split_k=2), dict(split_k=2, gamma_on_w=True),
                                     dict(split_n_dx=2, rowdot_in_dx=False), dict(dw_in_xla=True)],
                         ids=["split_k", "split_k-gamma_on_w", "split_n_dx", "dw_in_xla"])
def test_split_variants_match_reference(variant, residual):
    """Split-K forward and split-N dx (float32 partials combined, and the epilogue applied, outside the kernel),
    with and without a residual (whose cotangent joins dx), gamma in registers or folded into w, odd row count."""
    x, gamma, w, res = _inputs(_S["odd"], _S["K"], _S["N"], jnp.float32, residual=residual)
    _check_against_reference(x, gamma, w, res, _TOL[jnp.float32], block_sizes=variant)


def test_split_k_bf16_four_splits_match_reference():
    """bf16 inputs, K split over 4 programs, few rows: forward and all gradients within the bf16 tolerance."""
    x, gamma, w, _ = _inputs(_S["few"], _S["K"] * 2, _S["N"], jnp.bfloat16)
    _check_against_reference(x, gamma, w, None, _TOL[jnp.bfloat16], block_sizes=dict(split_k=4))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gamma_on_w_without_residual_at_the_swept_tiles(dtype):
    """The config the H100 sweep picked (gamma folded into w, r on the dy tile, 128x256x64 forward tiles, group 8)
    without a residual, which is how the sweep and the model call it: several tiles along every axis and a
    partial last group of row blocks (3 row blocks of 128, group 8). The variants test above only ran the folded
    path with a residual, where the A tile is computed in registers and the failing pattern never arises."""
    cfg = dict(_SWEPT_CONFIG, block_m=128, block_n=128) if not ON_GPU else _SWEPT_CONFIG
    x, gamma, w, _ = _inputs(384 if ON_GPU else 192, 256, 512, dtype)
    _check_against_reference(x, gamma, w, None, _TOL[dtype], block_sizes=cfg)


def test_leading_axes_out_dtype_and_eps():
    x, gamma, w, _ = _inputs(None, _S["K"], _S["N"], jnp.bfloat16, lead=(2, 3))
    _check_against_reference(x, gamma, w, None, _TOL[jnp.bfloat16], out_dtype=jnp.float32, eps=1e-2)
    y = rmsnorm_matmul(x, gamma, w)
    assert y.shape == (2, 3, _S["N"]) and y.dtype == jnp.bfloat16


def test_jit_and_grad_of_a_scalar_loss():
    x, gamma, w, res = _inputs(_S["odd"], _S["K"], _S["N"], jnp.float32, residual=True)

    def loss(impl, x, gamma, w, res):
        h, y = impl(x, gamma, w, residual=res)
        return jnp.sum(y * y) + jnp.sum(jnp.sin(h))

    got = jax.jit(jax.grad(lambda *a: loss(rmsnorm_matmul, *a), argnums=(0, 1, 2, 3)))(x, gamma, w, res)
    want = jax.grad(lambda *a: loss(reference.rmsnorm_matmul, *a), argnums=(0, 1, 2, 3))(x, gamma, w, res)
    for g, r in zip(got, want):
        assert _rel_err(g, r) <= 1e-4


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
    x, gamma, w, _ = _inputs(M, K, N, jnp.bfloat16)
    want = reference.rmsnorm_matmul(x, gamma, w, out_dtype=jnp.float32)
    assert _rel_err(_rmsnorm_matmul_with_stat_dtype(x, gamma, w, jnp.bfloat16), want) > 1e-2
    assert _rel_err(_rmsnorm_matmul_with_stat_dtype(x, gamma, w, jnp.float32), want) < 1e-3
    got = rmsnorm_matmul(x, gamma, w, out_dtype=jnp.float32, block_sizes={"block_k": 256})
    assert _rel_err(got, want) <= 1e-2


# ------------------------------------------------------------------------------------------------ program
def _eqns_outside_kernels(jaxpr):
    """Every equation of a jaxpr and its sub-jaxprs, not descending into pallas_call kernels."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                inner = getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr
                if inner is not None and hasattr(inner, "eqns"):
                    yield from _eqns_outside_kernels(inner)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_one_kernel_forward_and_no_normalized_tensor(residual):
    """The forward is exactly one pallas_call; in forward + backward no equation outside the three kernels makes
    an (M, K) float tensor (the normalized activations, or their gradient, would be one)."""
    M, K, N = 37, 64, 32  # distinct sizes so that an (M, K) shape is unambiguous
    x, gamma, w, res = _inputs(M, K, N, jnp.bfloat16, residual=residual)
    fn = lambda x, g, w, r: rmsnorm_matmul(x, g, w, residual=r)
    fwd_eqns = list(_eqns_outside_kernels(jax.make_jaxpr(fn)(x, gamma, w, res).jaxpr))
    kernels = [e for e in fwd_eqns if e.primitive.name == "pallas_call"]
    # The custom_vjp call holds the forward once as its primal; the traced jit appears once inside it.
    assert len({id(e) for e in kernels}) == len(kernels)
    assert str(jax.make_jaxpr(fn)(x, gamma, w, res)).count("pallas_call[") == 1

    def loss(x, g, w, r):
        out = fn(x, g, w, r)
        y = out if r is None else out[1] + out[0][:, :N]  # (M, N) either way; h's cotangent is non-zero
        return jnp.sum(y.astype(jnp.float32) ** 2)

    argnums = (0, 1, 2) if res is None else (0, 1, 2, 3)
    train = jax.make_jaxpr(jax.grad(loss, argnums=argnums))(x, gamma, w, res)
    eqns = list(_eqns_outside_kernels(train.jaxpr))
    assert sum(e.primitive.name == "pallas_call" for e in eqns) == 3  # forward, dx, dw
    mk_producers = sorted({e.primitive.name for e in eqns for v in e.outvars
                           if getattr(v.aval, "shape", None) == (M, K)
                           and e.primitive.name not in ("pallas_call", "pjit", "jit", "custom_vjp_call")})
    # With a residual, the loss's cotangent of h (a pad of the slice) and its sum with the norm's dx are the only
    # (M, K) tensors made outside the kernels; nothing multiplies or converts one (no normalized tensor).
    assert mk_producers == ([] if res is None else ["pad"]), mk_producers


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
@pytest.mark.parametrize("variant", [{}, dict(gamma_on_w=True), dict(rstd_on_dy=True), _SWEPT_CONFIG],
                         ids=["default", "gamma_on_w", "rstd_on_dy", "swept"])
def test_no_loaded_tile_feeds_a_dot_and_other_arithmetic(variant, residual):
    """Regression for the H100 failure (0.5 relative error in y and every gradient with gamma_on_w, the sweep's
    pick): Triton's software pipeliner (num_stages > 1; on Hopper the wgmma operand stays in shared memory)
    miscompiles a loop in which one loaded tile is both a dot operand and the input of other arithmetic (there:
    the x tile was the A operand and also squared into the RMS statistic). Interpret mode computes such a kernel
    correctly, so the test asserts on the kernels' programs: no raw tile is shared by a dot and anything else.
    (rowdot_in_dx=True still has that shape in the dx kernel, dy feeding both the dot and the row dot; it is not
    covered here and the GPU sweep checks it numerically.)"""
    M, K, N = 256, 256, 512
    x, gamma, w, res = _inputs(M, K, N, jnp.bfloat16, residual=residual)
    table = dict(rm_module.default_config(M, K, N, on_gpu=True).to_dict(), dw_in_xla=False)  # all 3 kernels
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


def _lower_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


_SPLIT_DECODE = dict(block_n=128, block_k=128, split_k=4, block_k_dx=128, block_n_dx=256, split_n_dx=8,
                     rowdot_in_dx=False)


@pytest.mark.parametrize("dtype,M,K,N,residual,blocks", [
    (jnp.bfloat16, 300, 256, 512, True, None), (jnp.float32, 16, 4096, 4096, False, None),
    (jnp.float16, 1, 4096, 14336, False, None), (jnp.bfloat16, 16, 4096, 4096, False, _SPLIT_DECODE),
    (jnp.bfloat16, 16, 4096, 4096, True, _SPLIT_DECODE)])
def test_lowers_to_triton_kernels(dtype, M, K, N, residual, blocks):
    """Even on CPU: the Triton lowering accepts every kernel at the GPU table's tiles (prefill and decode) and
    the split decode variants."""
    x = jax.ShapeDtypeStruct((M, K), dtype)
    gamma = jax.ShapeDtypeStruct((K,), jnp.float32)
    w = jax.ShapeDtypeStruct((K, N), dtype)
    res = x if residual else None

    def fn(x, g, w, r):
        out = rmsnorm_matmul(x, g, w, residual=r, interpret=False, block_sizes=blocks)
        return out if r is None else out[1]

    with triton_utils.quiet_triton_deprecation():
        fwd = _lower_for_cuda(fn, x, gamma, w, res)
        argnums = (0, 1, 2) if res is None else (0, 1, 2, 3)
        train = _lower_for_cuda(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=argnums),
                                x, gamma, w, res)
    cfg = rm_module._resolve_config(M, K, N, dtype, residual, blocks, on_gpu=True)
    assert fwd.count("__gpu$xla.gpu.triton") == 1
    assert train.count("__gpu$xla.gpu.triton") == (2 if cfg.dw_in_xla else 3)  # fwd, dx (, dw)


# ------------------------------------------------------------------------------------------------ config
def test_default_config_fits_the_shape():
    cfg = rm_module.default_config(37, 48, 80, on_gpu=False)
    assert cfg.block_k == 16 and cfg.block_n == 16  # 48 = 16·3, 80 = 16·5: only 16 divides
    # Shapes with no tuning-cache entry (on a GPU the cache would override the table for the shapes).
    big = rm_module.default_config(4096, 2048, 8192, on_gpu=True)
    assert (big.block_m, big.block_n) == (128, 256) and big.dw_in_xla
    decode = rm_module.default_config(1, 2048, 8192, on_gpu=True)
    assert decode.block_m == 16 and decode.split_k > 1
    for M, K, N in [(4096, 4096, 14336), (16, 4096, 4096), (1, 4096, 14336)]:
        fwd, bwd = rm_module.sweep_candidates(M, K, N)
        assert fwd and bwd
        for params in fwd + bwd:
            RMSNormMatmulConfig(**params).check_shape(K, N)  # valid, and fits the shape it is swept at
        assert any(c["split_k"] > 1 for c in fwd) == (M <= 64)
    assert triton_utils.resolve_interpret(None) == (jax.default_backend() == "cpu")


# ------------------------------------------------------------------------------------------------ errors
def _arrays(M=5, K=32, N=16, dtype=jnp.float32):
    return jnp.zeros((M, K), dtype), jnp.ones((K,), dtype), jnp.zeros((K, N), dtype)


@pytest.mark.parametrize("mutate,kwargs,match", [
    (lambda x, g, w: (jnp.zeros((5, 24)), jnp.ones(24), jnp.zeros((24, 16))), {},
     r"x: K=24 \(shape \(5, 24\)\) must be a positive multiple of 16"),
    (lambda x, g, w: (x, g, jnp.zeros((32, 20))), {}, r"w: N=20 \(shape \(32, 20\)\) must be a positive multiple"),
    (lambda x, g, w: (x, g, jnp.zeros((48, 16))), {}, r"w: first dim 48 .* must equal x's last dim K=32"),
    (lambda x, g, w: (x, g, jnp.zeros((32,))), {}, r"w: expected rank 2 \(K, N\), got shape \(32,\)"),
    (lambda x, g, w: (x, jnp.ones(16), w), {}, r"gamma: expected shape \(K,\) = \(32,\), got \(16,\)"),
    (lambda x, g, w: (x, g, w.astype(jnp.bfloat16)), {}, r"w: dtype bfloat16 must match x's dtype float32"),
    (lambda x, g, w: (x.astype(jnp.int32), g, w), {}, r"x: dtype int32 not supported"),
    (lambda x, g, w: (jnp.zeros((0, 32)), g, w), {}, r"x: needs at least one row"),
    (lambda x, g, w: (x, g, w), dict(residual=jnp.zeros((4, 32))), r"residual: shape \(4, 32\) must equal"),
    (lambda x, g, w: (x, g, w), dict(residual=jnp.zeros((5, 32), jnp.bfloat16)), r"residual: dtype bfloat16"),
    (lambda x, g, w: (x, g, w), dict(out_dtype=jnp.int8), r"out_dtype: int8 not supported"),
    (lambda x, g, w: (x, g, w), dict(block_sizes={"block_q": 16}), r"block_sizes: unknown fields \['block_q'\]"),
    (lambda x, g, w: (x, g, w), dict(block_sizes={"block_n": 48}),
     r"RMSNormMatmulConfig.block_n: must be a power of two >= 16, got 48"),
    (lambda x, g, w: (x, g, w), dict(block_sizes={"block_k": 64}), r"block_sizes: block_k=64 must divide K=32"),
    (lambda x, g, w: (x, g, w), dict(block_sizes={"gamma_on_w": 1}), r"RMSNormMatmulConfig.gamma_on_w: must be"),
    (lambda x, g, w: (x, g, w), dict(block_sizes={"split_k": 0}), r"RMSNormMatmulConfig.split_k: must be an int"),
    (lambda x, g, w: (x, g, w), dict(block_sizes={"block_k": 16, "split_k": 4}),
     r"block_sizes: split_k=4 times block_k=16 must divide K=32"),
    (lambda x, g, w: (x, g, w), dict(block_sizes={"split_n_dx": 2, "rowdot_in_dx": True}),
     r"split_n_dx > 1 needs rowdot_in_dx=False"),
])
def test_bad_inputs(mutate, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rmsnorm_matmul(*mutate(*_arrays()), **kwargs)
