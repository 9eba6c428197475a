"""The linear cross-entropy tests every backend passes: forward and both gradients against the float32 reference on
odd shapes, z-loss and soft cap, ignored and bad labels, the compiled program (no (B, V) tensor), input errors. A
backend's test module instantiates it:

    class TestTriton(CrossEntropyTests):
        backend = "triton"

On CPU the Triton kernels run in interpret mode with tiny shapes and the CPU config (16-token chunks, the last
sharing rows with the one before, small row tiles); on a GPU the same tests run at larger shapes, including LM-sized
vocabularies. Every case checks the loss twice (evaluation alone, and with the gradients: a backend may compute them
in its forward) and both gradients. A case a backend declares unsupported (its ``unsupported_reason``) is skipped
with that reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hlo_inspect
from conftest import ON_GPU, assert_close, cuda_program, key, pallas_calls, require, tensors_with, tolerance
from pallas_kernels import cross_entropy, reference

# (B, H, V): odd B and V, H a multiple of the tile or not.
SHAPES = [(1, 256, 1000), (300, 512, 50257), (257, 1024, 32000)] if ON_GPU else [(1, 16, 100), (37, 64, 257)]
SMALL = (300, 256, 5003) if ON_GPU else (37, 16, 257)


def inputs(B, H, V, dtype, *, ignored_rows=(3,)):
    """h (B, H) ~ N(0, 1), w (H, V) with logits ~ N(0, 4), labels uniform in [0, V) with ``ignored_rows`` -100."""
    h = jax.random.normal(key(), (B, H), jnp.float32).astype(dtype)
    w = (jax.random.normal(key(), (H, V), jnp.float32) * H**-0.5 * 2.0).astype(dtype)
    labels = jax.random.randint(key(), (B,), 0, V)
    for r in ignored_rows:
        if r < B:
            labels = labels.at[r].set(-100)
    return h, w, labels


def fwd_and_vjp(fn, h, w, ct):
    """(out, (dh, dw)) of fn at (h, w) for cotangent ct, under one jit."""

    @jax.jit
    def run(h, w, ct):
        out, vjp = jax.vjp(fn, h, w)
        return out, vjp(ct)

    return run(h, w, ct)


class CrossEntropyTests:
    backend: str  # the backend under test, as linear_cross_entropy(backend=...) takes it
    # Pallas calls of evaluation and of value and gradient at the program test's shape with chunked_block_sizes (a
    # loop body counts once): for Triton the row kernel of the peeled last token chunk and the one in the loop over
    # the others, in each.
    eval_calls = 2
    train_calls = 2
    # Block sizes under which the program test's shape runs in chunks smaller than (B, V) (at test sizes the
    # automatic chunk may cover everything, and a (B, V) chunk is then expected), and test_several_chunks runs
    # several chunks that do not divide B.
    chunked_block_sizes: dict | None = None

    def loss(self, h, w, labels, **kwargs):
        return cross_entropy.linear_cross_entropy(h, w, labels, backend=self.backend, **kwargs)

    def dw_tolerance_factor(self, h, w, labels, block_sizes) -> float:
        """How many times the tolerance rule dw may be off: a backend that rounds dw once per token chunk in a
        16-bit dtype says so (about sqrt(chunks) roundings); 1 here."""
        return 1.0

    def require(self, h, w, labels, **kwargs):
        """Skips the test when this backend cannot run these arguments here (its ValueError says why)."""
        require(cross_entropy.plan, h, w, labels, backend=self.backend, **kwargs)

    def check_against_reference(self, B, H, V, dtype, *, reduction="mean", block_sizes=None, **kwargs):
        h, w, labels = inputs(B, H, V, dtype)
        self.require(h, w, labels, reduction=reduction, block_sizes=block_sizes, **kwargs)
        ct = jax.random.normal(key(), (B,) if reduction == "none" else (), jnp.float32)
        ours = lambda h, w: self.loss(h, w, labels, reduction=reduction, block_sizes=block_sizes, **kwargs)
        ref = lambda h, w: reference.linear_cross_entropy(h, w, labels, reduction=reduction, **kwargs)
        evaluated = jax.jit(ours)(h, w)
        loss, (dh, dw) = fwd_and_vjp(ours, h, w, ct)
        loss_ref, (dh_ref, dw_ref) = fwd_and_vjp(ref, h, w, ct)
        tol = tolerance(dtype, max(B, H, V))
        assert loss.dtype == evaluated.dtype == jnp.float32 and dh.dtype == h.dtype and dw.dtype == w.dtype
        assert_close(evaluated, loss_ref, tol, "loss (evaluation)")
        assert_close(loss, loss_ref, tol, "loss (with gradients)")
        assert_close(dh, dh_ref, tol, "dh")
        assert_close(dw, dw_ref, tol * self.dw_tolerance_factor(h, w, labels, block_sizes), "dw")

    # -------------------------------------------------------------------------------------------- correctness
    @pytest.mark.parametrize("B,H,V,reduction,dtype", [
        pytest.param(*shape, reduction, dtype, id=f"{'-'.join(map(str, shape))}-{reduction}-{name}",
                     marks=[] if (shape, reduction, name) in ((SHAPES[-1], "mean", "bf16"), (SHAPES[0], "none", "f32"))
                     else [pytest.mark.slow])
        for shape in SHAPES for reduction in ("mean", "none")
        for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))])
    def test_matches_reference(self, B, H, V, reduction, dtype):
        self.check_against_reference(B, H, V, dtype, reduction=reduction)

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_z_loss_and_soft_cap(self, dtype):
        self.check_against_reference(*SMALL, dtype, z_loss=1e-3, logit_soft_cap=3.0)

    def test_sum_reduction_and_hidden_size_not_a_tile_multiple(self):
        B, _, V = SMALL
        self.check_against_reference(B, 24 if not ON_GPU else 200, V, jnp.float32, reduction="sum", z_loss=1e-2)

    @pytest.mark.parametrize("reduction,dtype", [("sum", jnp.bfloat16),
                                                 pytest.param("none", jnp.float32, marks=pytest.mark.slow),
                                                 pytest.param("mean", jnp.float32, marks=pytest.mark.slow)],
                             ids=["sum-bf16", "none-f32", "mean-f32"])
    def test_several_chunks(self, reduction, dtype):
        """The backend's chunked_block_sizes (chunks that do not divide B) with every option."""
        self.check_against_reference(*SMALL, dtype, reduction=reduction, block_sizes=self.chunked_block_sizes,
                                     z_loss=1e-3, logit_soft_cap=5.0)

    @pytest.mark.parametrize("reduction", ["mean", pytest.param("none", marks=pytest.mark.slow)])
    def test_gradient_of_one_input(self, reduction):
        """Differentiating h alone (a frozen LM head) or w alone gives the reference's gradient of that input."""
        B, H, V = SMALL
        h, w, labels = inputs(B, H, V, jnp.float32)
        self.require(h, w, labels, reduction=reduction)
        total = lambda fn: lambda h, w: jnp.sum(fn(h, w, labels, reduction=reduction))
        ours, ref = total(self.loss), total(reference.linear_cross_entropy)
        tol = tolerance(jnp.float32, max(B, H, V))
        for argnum, name in ((0, "dh"), (1, "dw")):
            got = jax.jit(jax.grad(ours, argnums=argnum))(h, w)
            assert_close(got, jax.grad(ref, argnums=argnum)(h, w), tol, name)

    def test_matches_optax(self):
        """The issue's reference, independent of pallas_kernels.reference: optax on materialized float32 logits."""
        B, H, V = SMALL
        h, w, labels = inputs(B, H, V, jnp.float32, ignored_rows=())
        self.require(h, w, labels)
        got = jax.jit(lambda h, w: self.loss(h, w, labels, reduction="none"))(h, w)
        logits = jnp.dot(h, w, precision=jax.lax.Precision.HIGHEST)
        want = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        assert_close(got, want, tolerance(jnp.float32, V), "per-row loss")

    def test_all_rows_ignored_gives_zero_not_nan(self):
        B, H, V = SMALL
        h, w, _ = inputs(B, H, V, jnp.float32)
        labels = jnp.full((B,), -1, jnp.int32)
        self.require(h, w, labels, ignore_index=-1, z_loss=1e-3)
        fn = lambda h, w: self.loss(h, w, labels, ignore_index=-1, z_loss=1e-3)
        loss, (dh, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, w)
        assert float(loss) == 0.0 and float(jax.jit(fn)(h, w)) == 0.0
        assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))

    # -------------------------------------------------------------------------------------------- bad labels
    def test_out_of_range_labels_raise_when_concrete(self):
        B, H, V = 5, 16, 40
        h, w, labels = inputs(B, H, V, jnp.float32, ignored_rows=())
        for bad in (V, -1, 10**6):
            with pytest.raises(ValueError, match=r"labels.*\[0, V=40\)"):
                self.loss(h, w, labels.at[2].set(bad))

    def test_out_of_range_labels_under_jit_give_nan(self):
        """Documented behaviour with traced labels: that row's loss is NaN (so is the mean, evaluated alone or with
        the gradients), gradients are NaN. The bad row is B − 12: on CPU a row the last 16-token chunk shares
        with the one before it."""
        B, H, V = SMALL
        h, w, labels = inputs(B, H, V, jnp.float32, ignored_rows=(0,))
        self.require(h, w, labels)
        bad = B - 12
        labels = labels.at[bad].set(V + 5)
        rows = jax.jit(lambda h, w, y: self.loss(h, w, y, reduction="none"))(h, w, labels)
        rows = np.asarray(rows)
        assert np.isnan(rows[bad]) and rows[0] == 0.0
        assert np.isfinite(np.delete(rows, bad)).all()
        for reduction in ("mean", "none"):
            fn = lambda h, w, y: jnp.sum(self.loss(h, w, y, reduction=reduction))
            loss, (dh, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, w, labels)
            assert np.isnan(float(loss)) and np.isnan(float(jax.jit(fn)(h, w, labels)))
            assert np.isnan(np.asarray(dh)[bad]).all() and np.isnan(np.asarray(dw)).any()

    def test_nan_inputs_give_nan(self):
        B, H, V = SMALL
        h, w, labels = inputs(B, H, V, jnp.float32)
        self.require(h, w, labels)
        loss, (dh, _) = jax.jit(jax.value_and_grad(lambda h, w: self.loss(h, w, labels), argnums=(0, 1)))(
            h.at[5, 0].set(jnp.nan), w)
        assert np.isnan(float(loss)) and np.isnan(np.asarray(dh)).any()

    # -------------------------------------------------------------------------------------------- program
    def test_program_has_its_kernels_and_no_batch_by_vocab_tensor(self):
        """Lowered for CUDA (on any machine): ``eval_calls`` Pallas calls for evaluation, ``train_calls`` for
        value and gradient (a loop body counts once), and no (B, V) tensor outside the kernels; on the CPU the
        interpret-mode program (kernels expanded into plain HLO) has none anywhere either."""
        B, H, V = (37, 16, 257) if not ON_GPU else (300, 256, 50257)
        h, w, labels = inputs(B, H, V, jnp.bfloat16)
        self.require(h, w, labels)
        loss = lambda h, w: self.loss(h, w, labels, block_sizes=self.chunked_block_sizes)
        grad = jax.grad(loss, argnums=(0, 1))
        fwd, train = cuda_program(loss, h, w), cuda_program(grad, h, w)
        assert len(pallas_calls(fwd)) == self.eval_calls, pallas_calls(fwd)
        assert len(pallas_calls(train)) == self.train_calls, pallas_calls(train)
        assert tensors_with(train, H, V)  # the walk does see the weights (and their gradient)
        for report in (fwd, train):
            assert not tensors_with(report, B, V), tensors_with(report, B, V)
        if not ON_GPU:  # a new function: jit's trace cache would hand back the CUDA trace of ``grad``
            interpreted = hlo_inspect.inspect(jax.grad(lambda h, w: loss(h, w), argnums=(0, 1)), h, w)
            assert not tensors_with(interpreted, B, V), tensors_with(interpreted, B, V)

    # -------------------------------------------------------------------------------------------- errors
    @pytest.mark.parametrize("mutate,match", [
        (lambda h, w, y: ((h, w, y), dict(reduction="avg")), "reduction"),
        (lambda h, w, y: ((h[None], w, y), {}), "h: expected rank 2"),
        (lambda h, w, y: ((h, w[None], y), {}), "w: expected rank 2"),
        (lambda h, w, y: ((h, w.astype(jnp.bfloat16), y), {}), "h, w: dtypes must match"),
        (lambda h, w, y: ((h.astype(jnp.int32), w.astype(jnp.int32), y), {}), "h: dtype int32"),
        (lambda h, w, y: ((h, w[:8], y), {}), "w: first dim 8"),
        (lambda h, w, y: ((h, w, y[:3]), {}), r"labels: expected shape \(B,\)"),
        (lambda h, w, y: ((h, w, y.astype(jnp.float32)), {}), "labels: must be integers"),
        (lambda h, w, y: ((h, w, y), dict(z_loss=-1.0)), "z_loss"),
        (lambda h, w, y: ((h, w, y), dict(logit_soft_cap=0.0)), "logit_soft_cap"),
        (lambda h, w, y: ((h, w, y), dict(ignore_index="x")), "ignore_index: must be an integer, got 'x'"),
        (lambda h, w, y: ((h, w, y), dict(ignore_index=1.5)), "ignore_index: must be an integer, got 1.5"),
    ])
    def test_input_errors_name_the_argument(self, mutate, match):
        args, kwargs = mutate(*inputs(4, 16, 40, jnp.float32, ignored_rows=()))
        with pytest.raises(ValueError, match=match):
            self.loss(*args, **kwargs)

    def test_block_sizes_must_be_a_config_or_a_mapping(self):
        h, w, labels = inputs(4, 16, 40, jnp.float32, ignored_rows=())
        self.require(h, w, labels)
        with pytest.raises(ValueError, match=r"block_sizes: expected a .*Config or a mapping of its fields, got list"):
            self.loss(h, w, labels, block_sizes=[16])
