"""The flash-attention tests every backend passes: forward and the three gradients against the float32 reference,
masks, transforms, the compiled program, input errors. A backend's test module instantiates it:

    class TestTriton(AttentionTests):
        backend = "triton"

On CPU the Triton kernels run in interpret mode at tiny shapes (16-row tiles still give several tiles per sequence);
on a GPU the same tests run at real shapes (``SIZES``). A case a backend declares unsupported (its
``unsupported_reason``) is skipped with that reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import (ON_GPU, assert_close, cuda_program, key, normal, pallas_calls, rel_err, require, tensors_with,
                      tolerance)
from pallas_kernels import attention, backends, reference

# Named sequence lengths: (short, long, odd_short, odd_long) and the batch.
SIZES = (dict(B=2, short=256, long=1024, odd_short=300, odd_long=777) if ON_GPU
         else dict(B=1, short=17, long=40, odd_short=17, odd_long=33))
_S = SIZES
CASES = {
    # name: (dtype, causal, T, S, N, K, H)
    "fp32": (jnp.float32, False, _S["long"], _S["long"], 2, 2, 64),
    "fp32-causal-gqa": (jnp.float32, True, _S["long"], _S["long"], 4, 2, 64),
    "fp32-causal-mqa-T<S": (jnp.float32, True, _S["odd_short"], _S["long"], 2, 1, 64),
    "fp32-causal-T>S": (jnp.float32, True, _S["long"], _S["odd_short"], 2, 2, 64),
    "fp32-H128-odd": (jnp.float32, False, _S["odd_long"], _S["odd_short"], 2, 1, 128),
    "bf16-causal-mqa": (jnp.bfloat16, True, _S["long"], _S["long"], 4, 1, 64),
    "bf16-one-query": (jnp.bfloat16, False, 1, _S["odd_short"], 2, 2, 64),
    "bf16-H256-causal": (jnp.bfloat16, True, _S["odd_short"], _S["odd_short"], 2, 2, 256),
    "fp16-H32-causal-odd": (jnp.float16, True, _S["odd_long"], _S["odd_long"], 4, 2, 32),
    "fp16-H128-gqa-odd": (jnp.float16, False, _S["odd_short"], _S["odd_long"], 4, 2, 128),
}


FAST_CASES = ("bf16-causal-mqa", "fp16-H32-causal-odd")  # the rest run in the full suite only (slow)


def qkv(B, T, S, N, K, H, dtype=jnp.float32):
    """Fresh N(0, 1) q (B, T, N, H), k and v (B, S, K, H)."""
    return normal((B, T, N, H), dtype), normal((B, S, K, H), dtype), normal((B, S, K, H), dtype)


def fwd_bwd(fn, q, k, v, do):
    """(o, dq, dk, dv) of fn under one jit."""

    @jax.jit
    def run(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    return run(q, k, v, do)


def tol(q, k) -> float:
    """The tolerance rule at these shapes: the reductions run over S (softmax, p·v) and T (dk, dv)."""
    return tolerance(q.dtype, max(q.shape[1], k.shape[1]))


class AttentionTests:
    pytestmark = [pytest.mark.timeout(120)]  # per test, where pytest-timeout is installed (the GPU machine)
    backend: str  # the backend under test, as flash_attention(backend=...) takes it
    forward_kernels = 1  # Pallas calls of the forward
    train_kernels = 3  # Pallas calls of forward + backward

    # Tests that need no machine able to run the backend: input errors, and the program lowered for CUDA.
    ANY_MACHINE = ("test_bad_inputs", "test_bad_options", "test_segment_ids_single_array_needs_equal_lengths",
                   "test_program_has_its_kernels_and_no_score_tensor")

    @pytest.fixture(autouse=True)
    def _skip_where_the_backend_cannot_run(self, request):
        """The other tests skip before drawing inputs where the backend cannot run at all (Mosaic off an sm90
        GPU), with the registry's reason; a backend that runs here skips per case (``require``)."""
        reason = backends.unavailable_reason(self.backend)
        if reason is not None and request.function.__name__ not in self.ANY_MACHINE:
            pytest.skip(f"backend={self.backend!r}: {reason}")

    def attention(self, q, k, v, **kwargs):
        return attention.flash_attention(q, k, v, backend=self.backend, **kwargs)

    def require(self, q, k, v, **kwargs):
        """Skips the test when this backend cannot run these arguments here (its ValueError says why)."""
        require(attention.plan, q, k, v, backend=self.backend, **kwargs)

    def check_against_reference(self, q, k, v, tol, *, kernel_kv=None, **kwargs):
        """Forward and the three gradients for a fresh random cotangent vs the float32 reference; ``kernel_kv``:
        the (k, v) the kernel gets instead (garbage where the reference must not look)."""
        self.require(q, k, v, **kwargs)
        do = normal(q.shape, q.dtype)
        got = fwd_bwd(lambda q, k, v: self.attention(q, k, v, **kwargs), q, *(kernel_kv or (k, v)), do)
        attn_kwargs = {name: value for name, value in kwargs.items() if name != "block_sizes"}
        up = lambda x: x.astype(jnp.float32)
        want = fwd_bwd(lambda q, k, v: reference.attention(q, k, v, **attn_kwargs), up(q), up(k), up(v), up(do))
        for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
            assert g.dtype == q.dtype, name
            assert_close(g, w, tol, name)
        return got

    # -------------------------------------------------------------------------------------------- correctness
    @pytest.mark.parametrize("case", [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
    def test_matches_reference(self, case):
        dtype, causal, T, S, N, K, H = CASES[case]
        q, k, v = qkv(_S["B"], T, S, N, K, H, dtype)
        self.check_against_reference(q, k, v, tol(q, k), causal=causal)

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_segment_ids_single_array(self, dtype):
        B, T, N, K, H = _S["B"], _S["long"], 4, 2, 64
        q, k, v = qkv(B, T, T, N, K, H, dtype)
        # Three packed sequences of uneven length per row.
        cuts = np.sort(np.asarray(jax.random.choice(key(), np.arange(1, T), (2,), replace=False)))
        seg = jnp.asarray(np.broadcast_to(np.searchsorted(cuts, np.arange(T), side="right"), (B, T)), jnp.int32)
        self.check_against_reference(q, k, v, tol(q, k), causal=True, segment_ids=seg)

    @pytest.mark.slow
    def test_segment_ids_pair_with_lengths(self):
        B, T, S, N, K, H = 2, _S["odd_short"], _S["long"], 2, 1, 64
        q, k, v = qkv(B, T, S, N, K, H)
        q_seg = jax.random.randint(key(), (B, T), 0, 3)
        kv_seg = jax.random.randint(key(), (B, S), 0, 3)
        lengths = jnp.array([S, S // 2 + 1], jnp.int32)
        self.check_against_reference(q, k, v, tol(q, k), segment_ids=(q_seg, kv_seg), kv_seq_lengths=lengths)

    @pytest.mark.parametrize("causal,dtype", [(True, jnp.float32),
                                              pytest.param(False, jnp.bfloat16, marks=pytest.mark.slow)])
    def test_kv_seq_lengths(self, causal, dtype):
        """Keys past the length hold inf (K) and NaN (V) from a position off the tile grid: nothing of them
        reaches the output or a gradient (the reference sees clean inputs)."""
        B, T, S, N, K, H = 2, _S["long"], _S["long"], 2, 2, 64
        q, k, v = qkv(B, T, S, N, K, H, dtype)
        lengths = jnp.array([S, 7], jnp.int32)
        padded = jnp.arange(S)[None, :, None, None] >= lengths[:, None, None, None]  # (B, S, 1, 1)
        garbage = (jnp.where(padded, jnp.inf, k).astype(dtype), jnp.where(padded, jnp.nan, v).astype(dtype))
        _, _, dk, dv = self.check_against_reference(q, k, v, tol(q, k), causal=causal, kv_seq_lengths=lengths,
                                                    kernel_kv=garbage)
        # Padded keys get exactly zero gradient.
        np.testing.assert_array_equal(np.asarray(dk[1, 7:], np.float32), 0.0)
        np.testing.assert_array_equal(np.asarray(dv[1, 7:], np.float32), 0.0)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow),
                                       pytest.param(jnp.float32, marks=pytest.mark.slow)])
    def test_saturated_softmax_gradients_against_float64(self, dtype):
        """q and k scaled by 30: scores up to ~4e3, most softmax rows one-hot. dS = P ∘ (dP − delta) then cancels
        to ~(1 − p) per row, so delta = rowsum(o · do) needs the unrounded output: dq, dk, dv within 2e-2 of a
        float64 reference for bf16 / fp16, and for float32 within 1.25x of the float32 XLA reference's own error
        (or the float32 tolerance). Both float32 sides sit at one floor: a score near 4e3 rounds to within
        2.4e-4 (half a float32 ulp), which moves its softmax weight by as much relative, so which side errs less
        is a draw (the H200 run of bc30400: Triton's dq 3.50e-4 against XLA's 3.18e-4)."""
        B, T, N, H = 1, _S["long"] if ON_GPU else 128, 4, 64
        q, k = normal((B, T, N, H), dtype, 30.0), normal((B, T, N, H), dtype, 30.0)
        v, do = normal((B, T, N, H), dtype), normal((B, T, N, H), dtype)
        self.require(q, k, v)
        got = fwd_bwd(self.attention, q, k, v, do)[1:]
        want = float64_grads(q, k, v, do, H**-0.5)
        assert np.max(np.abs(want[0])) > 1e-2  # some rows are not one-hot: relative errors mean something
        bounds = [2e-2] * 3
        if dtype == jnp.float32:
            xla = fwd_bwd(reference.attention, q, k, v, do)[1:]
            bounds = [max(1.25 * rel_err(x, w), tolerance(jnp.float32)) for x, w in zip(xla, want)]
        for name, g, w, bound in zip(("dq", "dk", "dv"), got, want, bounds):
            assert_close(g, w, bound, name)

    def test_rows_without_visible_keys_are_zero(self):
        B, T, S, N, K, H = 2, _S["odd_short"], _S["odd_short"], 2, 1, 64
        q, k, v = qkv(B, T, S, N, K, H)
        lengths = jnp.array([0, S], jnp.int32)  # batch 0: nothing to attend to
        q_seg = jnp.ones((B, T), jnp.int32).at[1, 3].set(7)  # query 3 of batch 1: a segment with no keys
        kv_seg = jnp.ones((B, S), jnp.int32)
        o, dq, dk, dv = self.check_against_reference(q, k, v, tol(q, k), segment_ids=(q_seg, kv_seg),
                                                     kv_seq_lengths=lengths)
        np.testing.assert_array_equal(o[0], 0.0)
        np.testing.assert_array_equal(o[1, 3], 0.0)
        np.testing.assert_array_equal(dq[0], 0.0)
        np.testing.assert_array_equal(dq[1, 3], 0.0)
        np.testing.assert_array_equal(dk[0], 0.0)
        assert np.all(np.abs(np.asarray(o[1, :3])) > 0)

    @pytest.mark.slow
    @pytest.mark.parametrize("scale", [0.37, -0.2])
    def test_scale(self, scale):
        B, T, N, H = 1, _S["odd_short"], 2, 64
        q, k, v = qkv(B, T, T, N, N, H)
        o = self.check_against_reference(q, k, v, tol(q, k), causal=True, scale=scale)[0]
        assert rel_err(o, reference.attention(q, k, v, causal=True)) > 1e-2  # the scale matters

    # -------------------------------------------------------------------------------------------- transforms
    @pytest.mark.slow
    def test_vmap_jit_grad(self):
        V, T, N, H = 2, _S["odd_short"], 2, 64
        q, k, v = normal((V, 1, T, N, H)), normal((V, 1, T, N, H)), normal((V, 1, T, N, H))
        self.require(q[0], k[0], v[0], causal=True)

        def loss(attn, q, k, v):
            o = jax.vmap(lambda q, k, v: attn(q, k, v, causal=True))(q, k, v)  # (V, 1, T, N, H)
            return jnp.sum(o * jnp.cos(o))

        grads = jax.jit(jax.grad(lambda *a: loss(self.attention, *a), argnums=(0, 1, 2)))(q, k, v)
        want = jax.grad(lambda *a: loss(reference.attention, *a), argnums=(0, 1, 2))(q, k, v)
        for g, w in zip(grads, want):
            assert rel_err(g, w) <= tolerance(jnp.float32)

    @pytest.mark.slow
    def test_inside_nnx_module(self):
        class Attention(nnx.Module):
            def __init__(self, dim, heads, *, rngs):
                self.heads = heads
                # Full float32 projection: on a GPU the default precision would round its inputs to TF32, and
                # jit and eager can round differently by an ulp of TF32 (~1e-4 relative) on either side of the
                # kernel.
                self.qkv = nnx.Linear(dim, 3 * dim, precision=jax.lax.Precision.HIGHEST, rngs=rngs)

            def __call__(self, x, attn):
                B, T, D = x.shape
                q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.heads, D // self.heads), 3, axis=2)
                return attn(q, k, v, causal=True).reshape(B, T, D)  # (B, T, N, H) -> (B, T, D)

        model = Attention(128, 2, rngs=nnx.Rngs(0))
        x = normal((1, _S["odd_short"], 128))
        self.require(*qkv(1, x.shape[1], x.shape[1], 2, 2, 64), causal=True)
        loss = lambda model, attn: jnp.mean(model(x, attn) ** 2)
        grads = nnx.jit(nnx.grad(lambda m: loss(m, self.attention)))(model)
        want = nnx.grad(lambda m: loss(m, reference.attention))(model)
        assert rel_err(grads.qkv.kernel[...], want.qkv.kernel[...]) <= tolerance(jnp.float32)

    # -------------------------------------------------------------------------------------------- program
    @pytest.mark.parametrize("dtype,H,causal,masks", [(jnp.bfloat16, 128, True, True),
                                                      pytest.param(jnp.float32, 256, False, False,
                                                                   marks=pytest.mark.slow),
                                                      pytest.param(jnp.float16, 64, False, True,
                                                                   marks=pytest.mark.slow)])
    def test_program_has_its_kernels_and_no_score_tensor(self, dtype, H, causal, masks):
        """Lowered for CUDA (on any machine): forward one Pallas call, forward + backward ``train_kernels``, and
        no tensor with both a T and an S dimension outside the kernels."""
        B, T, S, N, K = 2, 300, 177, 4, 2  # odd lengths: tails masked in every kernel
        q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
        kv = jax.ShapeDtypeStruct((B, S, K, H), dtype)
        extra = dict(segment_ids=(jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)),
                     kv_seq_lengths=jnp.full((B,), S, jnp.int32)) if masks else {}
        with backends.lowering_for_gpu():  # a GPU backend's structure is checked on any machine
            self.require(q, kv, kv, causal=causal, **extra)
        attn = lambda q, k, v: self.attention(q, k, v, causal=causal, **extra)
        fwd = cuda_program(attn, q, kv, kv)
        assert len(pallas_calls(fwd)) == self.forward_kernels, pallas_calls(fwd)
        train = cuda_program(jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)), q, kv, kv)
        assert len(pallas_calls(train)) == self.train_kernels, pallas_calls(train)
        for report in (fwd, train):
            assert not tensors_with(report, T, S), tensors_with(report, T, S)

    # -------------------------------------------------------------------------------------------- errors
    @pytest.mark.parametrize("mutate,match", [
        (lambda q, k, v: (q[0], k, v), r"q: expected rank 4 \(B, T, N, H\), got shape \(8, 2, 64\)"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), r"k: head dim 32 .* q's head dim 64"),
        (lambda q, k, v: (q, k, v[:, :4]), r"k, v: shapes must match"),
        (lambda q, k, v: (q[:, :, :, :48], k[..., :48], v[..., :48]),
         r"head dim H=48 .* allowed: \(32, 64, 128, 256\)"),
        (lambda q, k, v: (jnp.zeros((1, 8, 3, 64)), k, v), r"kv heads K=2 .* must divide q's heads N=3"),
        (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), r"dtypes must match, got q float32, k bfloat16"),
        (lambda q, k, v: (q.astype(jnp.int32), k, v), r"q: dtype int32 not supported"),
        (lambda q, k, v: (q, jnp.zeros((2, 8, 2, 64)), jnp.zeros((2, 8, 2, 64))), r"k: batch 2 .* q's batch 1"),
        (lambda q, k, v: (q[:0], k[:0], v[:0]), r"q: batch B=0 and heads N=\d+ must be positive"),
    ])
    def test_bad_inputs(self, mutate, match):
        with pytest.raises(ValueError, match=match):
            self.attention(*mutate(*zeros()))

    @pytest.mark.parametrize("kwargs,match", [
        (dict(segment_ids=jnp.zeros((1, 9), jnp.int32)), r"segment_ids: q_segment_ids must have shape"),
        (dict(segment_ids=(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 5), jnp.int32))),
         r"kv_segment_ids .* \(1, 8\)"),
        (dict(kv_seq_lengths=jnp.zeros((2,), jnp.int32)),
         r"kv_seq_lengths: expected shape \(B,\) = \(1,\), got \(2,\)"),
        (dict(kv_seq_lengths=jnp.array([-3], jnp.int32)), r"kv_seq_lengths: must be >= 0 .* got \[-3\]"),
        (dict(kv_seq_lengths=jnp.zeros((1,))), r"kv_seq_lengths: must be integers"),
        (dict(scale="a"), r"scale: must be None \(1/sqrt\(H\)\) or a number known when tracing, got 'a'"),
    ])
    def test_bad_options(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            self.attention(*zeros(), **kwargs)

    def test_block_sizes_must_be_a_config_or_a_mapping(self):
        self.require(*zeros())
        with pytest.raises(ValueError, match=r"block_sizes: expected a .*Config or a mapping of its fields, got list"):
            self.attention(*zeros(), block_sizes=[64])

    def test_segment_ids_single_array_needs_equal_lengths(self):
        q, k, v = zeros(T=8, S=12)
        with pytest.raises(ValueError, match=r"segment_ids: a single array is allowed only when T == S"):
            self.attention(q, k, v, segment_ids=jnp.zeros((1, 8), jnp.int32))


def float64_grads(q, k, v, do, scale: float):
    """(dq, dk, dv) of non-causal, unmasked attention with N == K in numpy float64: the reference where softmax rows
    saturate, and a float32 reference is itself off by more than a bf16 kernel."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("btnh,bsnh->bnts", do, v)
    ds = p * (dp - np.sum(p * dp, -1, keepdims=True))
    return (np.einsum("bnts,bsnh->btnh", ds, k) * scale, np.einsum("bnts,btnh->bsnh", ds, q) * scale,
            np.einsum("bnts,btnh->bsnh", p, do))


def zeros(B=1, T=8, S=8, N=2, K=2, H=64, dtype=jnp.float32):
    """q, k, v of zeros (for input errors: shapes matter, values do not)."""
    return jnp.zeros((B, T, N, H), dtype), jnp.zeros((B, S, K, H), dtype), jnp.zeros((B, S, K, H), dtype)
