"""The rmsnorm_matmul tests every backend passes: forward and every gradient against the float32 reference, leading
axes, jit and grad, the program (one forward kernel, no normalized tensor), input errors. A backend's test module
instantiates it:

    class TestTriton(NormMatmulTests):
        backend = "triton"

On CPU the Triton kernels run in interpret mode at tiny shapes (16-wide tiles still give several tiles along every
axis, masked row tails and the grouped program order); on a GPU the same tests run at real shapes (``SIZES``; a
backend may name its own, ``sizes``). A case a backend declares unsupported (its ``unsupported_reason``, or a
backend this machine cannot run) is skipped with that reason. The program test runs inside ``program_context``
(``backends.lowering_for_gpu`` for a backend that only lowers here).
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import pytest

from conftest import KERNEL_PRIMITIVES, ON_GPU, assert_close, eqns_outside_kernels, normal, rel_err, require, tolerance
from pallas_kernels import norm_matmul, reference

# Named sizes: an odd row count, a single row, K and N (multiples of 16; on CPU small enough for interpret mode).
SIZES = (dict(odd=1000, one=1, few=37, K=1024, N=768, N_odd=784) if ON_GPU
         else dict(odd=37, one=1, few=5, K=64, N=32, N_odd=48))


def inputs(M, K, N, dtype, *, lead=None, residual=False):
    """Fresh x (M, K) (or (*lead, K)), gamma (K,) near 1, w (K, N) ~ N(0, 1/K), residual or None."""
    shape = (M, K) if lead is None else (*lead, K)
    x = normal(shape, dtype)
    gamma = (1.0 + normal((K,), jnp.float32, 0.2)).astype(dtype)
    w = normal((K, N), dtype, K**-0.5)
    res = normal(shape, dtype) if residual else None
    return x, gamma, w, res


def fwd_and_vjp(fn, args, cotangent, programs=None, name=""):
    """(out, vjp(cotangent)) of fn at args under one jit. With ``programs`` (a dict) the jitted program is kept
    there under ``name`` and taken from there when present: the caller vouches that it is the same fn."""
    run = None if programs is None else programs.get((name, len(args)))
    if run is None:
        @jax.jit
        def run(args, cotangent):
            out, vjp = jax.vjp(fn, *args)
            return out, vjp(cotangent)

        if programs is not None:
            programs[(name, len(args))] = run
    return run(args, cotangent)


class NormMatmulTests:
    backend: str  # the backend under test, as rmsnorm_matmul(backend=...) takes it
    train_kernels = 3  # Pallas calls of forward + backward at the CPU table's tiles (forward, dx, dw)
    sizes = SIZES  # the named sizes of the correctness tests
    program_shape = (37, 64, 32)  # (M, K, N) of the program test: distinct, so that (M, K) is unambiguous
    program_context = staticmethod(contextlib.nullcontext)  # around the program test's tracing
    # Primitives that may make an (M, K) tensor outside the kernels in forward + backward, without / with a
    # residual: with one, the loss's cotangent of h (a pad of the slice) joins the norm's dx.
    mk_ops_outside_kernels = {False: (), True: ("pad",)}

    def rmsnorm_matmul(self, x, gamma, w, **kwargs):
        return norm_matmul.rmsnorm_matmul(x, gamma, w, backend=self.backend, **kwargs)

    def require(self, x, gamma, w, **kwargs):
        """Skips the test when this backend cannot run these arguments here (its ValueError says why)."""
        require(norm_matmul.plan, x, gamma, w, backend=self.backend, **kwargs)

    def check_against_reference(self, x, gamma, w, res, tol, *, programs=None, **kwargs):
        """Forward and all gradients of the kernel vs the float32 reference, for one fresh random cotangent.
        ``programs``: a dict a test passes to several calls with the same kwargs (inside the same context) at
        other inputs: the jitted programs are kept there, so that the later calls reuse them (compiled once)."""
        if programs is not None:
            assert programs.setdefault("kwargs", kwargs) == kwargs, ("programs: reused with other kwargs", kwargs)
        self.require(x, gamma, w, residual=res, **kwargs)
        args = (x, gamma, w) if res is None else (x, gamma, w, res)
        fused = lambda x, g, w, r=None: self.rmsnorm_matmul(x, g, w, residual=r, **kwargs)
        ref_kwargs = {k: v for k, v in kwargs.items() if k in ("eps", "out_dtype")}
        ref = lambda x, g, w, r=None: reference.rmsnorm_matmul(x, g, w, residual=r, **ref_kwargs)
        out_shapes = jax.eval_shape(fused, *args)
        cotangent = jax.tree.map(lambda s: normal(s.shape, s.dtype), out_shapes)
        got_out, got_grads = fwd_and_vjp(fused, args, cotangent, programs, "kernel")
        want_out, want_grads = fwd_and_vjp(ref, args, cotangent, programs, "reference")
        names = ((["y"] if res is None else ["h", "y"]) + ["dx", "dgamma", "dw"]
                 + ([] if res is None else ["dresidual"]))
        got, want = jax.tree.leaves((got_out, got_grads)), jax.tree.leaves((want_out, want_grads))
        assert len(got) == len(names) == len(want)
        for name, g, r in zip(names, got, want):
            assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, g.dtype, r.shape, r.dtype)
            assert_close(g, r, tol, name)

    # -------------------------------------------------------------------------------------------- correctness
    @pytest.mark.parametrize("dtype,m,n,residual", [
        pytest.param(dtype, m, n, residual, id=f"{name}-{'residual' if residual else 'plain'}",
                     marks=[] if (name, residual) in (("fp32-odd", False), ("bf16-odd", True)) else [pytest.mark.slow])
        for dtype, m, n, name in [(jnp.float32, "odd", "N", "fp32-odd"), (jnp.bfloat16, "odd", "N", "bf16-odd"),
                                  (jnp.bfloat16, "one", "N_odd", "bf16-one-row"), (jnp.float16, "few", "N", "fp16-few")]
        for residual in (False, True)])
    def test_matches_reference(self, dtype, m, n, residual):
        M, K, N = self.sizes[m], self.sizes["K"], self.sizes[n]
        x, gamma, w, res = inputs(M, K, N, dtype, residual=residual)
        self.check_against_reference(x, gamma, w, res, tolerance(dtype, max(M, K, N)))

    @pytest.mark.parametrize("scale", [1e-6, pytest.param(1e-7, marks=pytest.mark.slow)])
    def test_float16_near_1e_6_is_as_accurate_as_the_unfused_computation(self, scale):
        """fp16 x of magnitude ~scale: x·γ lies below float16's normal range (6.1e-5), where rounding keeps only a
        few bits, while the normalized value x·r·γ (r ~ 1e3, eps-bound) is a normal float16. y must come out as
        accurate as the unfused fp16 computation (normalize, round to float16, matmul with float32 accumulation),
        and the gradients within the float16 tolerance."""
        M, K, N = self.sizes["odd"], self.sizes["K"], self.sizes["N"]
        x, gamma, w, _ = inputs(M, K, N, jnp.float16)
        x = (x.astype(jnp.float32) * scale).astype(jnp.float16)
        self.check_against_reference(x, gamma, w, None, tolerance(jnp.float16, max(M, K, N)))
        want = reference.rmsnorm_matmul(*(a.astype(jnp.float32) for a in (x, gamma, w)))
        unfused = jnp.dot(reference.rmsnorm(x, gamma), w, preferred_element_type=jnp.float32).astype(jnp.float16)
        got = jax.jit(self.rmsnorm_matmul)(x, gamma, w)
        assert rel_err(got, want) <= 2 * rel_err(unfused, want), (rel_err(got, want), rel_err(unfused, want))

    @pytest.mark.slow
    def test_leading_axes_out_dtype_and_eps(self):
        x, gamma, w, _ = inputs(None, self.sizes["K"], self.sizes["N"], jnp.bfloat16, lead=(2, 3))
        self.check_against_reference(x, gamma, w, None, tolerance(jnp.bfloat16), out_dtype=jnp.float32, eps=1e-2)
        y = self.rmsnorm_matmul(x, gamma, w)
        assert y.shape == (2, 3, self.sizes["N"]) and y.dtype == jnp.bfloat16

    def test_jit_and_grad_of_a_scalar_loss(self):
        x, gamma, w, res = inputs(self.sizes["odd"], self.sizes["K"], self.sizes["N"], jnp.float32, residual=True)
        self.require(x, gamma, w, residual=res)

        def loss(impl, x, gamma, w, res):
            h, y = impl(x, gamma, w, residual=res)
            return jnp.sum(y * y) + jnp.sum(jnp.sin(h))

        got = jax.jit(jax.grad(lambda *a: loss(self.rmsnorm_matmul, *a), argnums=(0, 1, 2, 3)))(x, gamma, w, res)
        want = jax.grad(lambda *a: loss(reference.rmsnorm_matmul, *a), argnums=(0, 1, 2, 3))(x, gamma, w, res)
        for g, r in zip(got, want):
            assert rel_err(g, r) <= tolerance(jnp.float32)

    # -------------------------------------------------------------------------------------------- program
    @pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
    def test_one_kernel_forward_and_no_normalized_tensor(self, residual):
        """The forward is exactly one kernel; in forward + backward no equation outside the kernels makes an
        (M, K) float tensor (the normalized activations, or their gradient, would be one) beyond the backend's
        ``mk_ops_outside_kernels``."""
        M, K, N = self.program_shape
        x, gamma, w, res = inputs(M, K, N, jnp.bfloat16, residual=residual)
        fn = lambda x, g, w, r: self.rmsnorm_matmul(x, g, w, residual=r)

        def loss(x, g, w, r):
            out = fn(x, g, w, r)
            y = out if r is None else out[1] + out[0][:, :N]  # (M, N) either way; h's cotangent is non-zero
            return jnp.sum(y.astype(jnp.float32) ** 2)

        with self.program_context():
            self.require(x, gamma, w, residual=res)
            fwd_eqns = list(eqns_outside_kernels(jax.make_jaxpr(fn)(x, gamma, w, res).jaxpr))
            argnums = (0, 1, 2) if res is None else (0, 1, 2, 3)
            train = jax.make_jaxpr(jax.grad(loss, argnums=argnums))(x, gamma, w, res)
        # The custom_vjp call holds the forward once as its primal.
        assert sum(e.primitive.name in KERNEL_PRIMITIVES for e in fwd_eqns) == 1
        eqns = list(eqns_outside_kernels(train.jaxpr))
        assert sum(e.primitive.name in KERNEL_PRIMITIVES for e in eqns) == self.train_kernels
        mk_producers = sorted({e.primitive.name for e in eqns for v in e.outvars
                               if getattr(v.aval, "shape", None) == (M, K)
                               and e.primitive.name not in (*KERNEL_PRIMITIVES, "pjit", "jit", "custom_vjp_call",
                                                            "custom_jvp_call", "custom_vmap_call")})
        assert mk_producers == sorted(self.mk_ops_outside_kernels[residual]), mk_producers

    # -------------------------------------------------------------------------------------------- errors
    @pytest.mark.parametrize("mutate,kwargs,match", [
        (lambda x, g, w: (jnp.zeros((5, 24)), jnp.ones(24), jnp.zeros((24, 16))), {},
         r"x: K=24 \(shape \(5, 24\)\) must be a positive multiple of 16"),
        (lambda x, g, w: (x, g, jnp.zeros((32, 20))), {},
         r"w: N=20 \(shape \(32, 20\)\) must be a positive multiple"),
        (lambda x, g, w: (x, g, jnp.zeros((48, 16))), {}, r"w: first dim 48 .* must equal x's last dim K=32"),
        (lambda x, g, w: (x, g, jnp.zeros((32,))), {}, r"w: expected rank 2 \(K, N\), got shape \(32,\)"),
        (lambda x, g, w: (x, jnp.ones(16), w), {}, r"gamma: expected shape \(K,\) = \(32,\), got \(16,\)"),
        (lambda x, g, w: (x, g, w.astype(jnp.bfloat16)), {},
         r"w: dtype bfloat16 must match x's dtype float32"),
        (lambda x, g, w: (x.astype(jnp.int32), g, w), {}, r"x: dtype int32 not supported"),
        (lambda x, g, w: (jnp.zeros((0, 32)), g, w), {}, r"x: needs at least one row"),
        (lambda x, g, w: (x, g, w), dict(residual=jnp.zeros((4, 32))),
         r"residual: shape \(4, 32\) must equal"),
        (lambda x, g, w: (x, g, w), dict(residual=jnp.zeros((5, 32), jnp.bfloat16)),
         r"residual: dtype bfloat16"),
        (lambda x, g, w: (x, g, w), dict(out_dtype=jnp.int8), r"out_dtype: int8 not supported"),
        (lambda x, g, w: (x, g, w), dict(eps=-1e-6), r"eps: must be >= 0 .*, got -1e-06"),
        (lambda x, g, w: (x, g, w), dict(eps=math.nan), r"eps: must be >= 0 .*, got nan"),
        (lambda x, g, w: (x, g, w), dict(eps="small"), r"eps: expected a number >= 0, got 'small'"),
    ])
    def test_bad_inputs(self, mutate, kwargs, match):
        with pytest.raises(ValueError, match=match):
            self.rmsnorm_matmul(*mutate(*zeros()), **kwargs)

    def test_block_sizes_must_be_a_config_or_a_mapping(self):
        self.require(*zeros())
        with pytest.raises(ValueError, match=r"block_sizes: expected a .*Config or a mapping of its fields, got list"):
            self.rmsnorm_matmul(*zeros(), block_sizes=[16])


def zeros(M=5, K=32, N=16, dtype=jnp.float32):
    """x (M, K) and w (K, N) of zeros, gamma (K,) of ones (for input errors: shapes matter, values do not)."""
    return jnp.zeros((M, K), dtype), jnp.ones((K,), dtype), jnp.zeros((K, N), dtype)
