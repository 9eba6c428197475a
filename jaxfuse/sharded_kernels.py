"""The Pallas kernel sites on a device mesh: each kernel runs under ``jax.shard_map``, one call per device on its
block, with the collectives its math needs around it.

XLA's SPMD partitioner splits plain jnp code by itself, but a Pallas kernel is a custom call it cannot look into:
left alone it would gather the operands onto every device and run the whole kernel there. So the ``pallas*``
entries of ``jaxfuse.kernels`` go through the wrappers here, which do nothing unless a mesh is current
(``jaxfuse.sharding.Layout.tracing()`` while the step is traced; ``jax.sharding.get_abstract_mesh()``). With a mesh:

  attention     q (B, T, N, H), k/v (B, S, K, H): batch over ``data``, heads over ``model`` (query head n reads kv
                head n // (N / K), so equal blocks of the N query heads read equal blocks of the K kv heads). No
                collective: each device's heads are independent.
  norm_matmul   x (..., K), gamma (K,), w (K, N) -> (..., N): rows over ``data``, the GEMM's N over ``model``
                (column-parallel). The norm's statistics need whole rows, so x enters with K unsharded: where x
                arrives split along K, shard_map's input resharding all-gathers it along K before the kernel (an
                all-gather of the activations; the alternative, a psum of per-shard sums of squares, would need the
                kernel to take the statistics as an input). In our model x is never split along K.
  loss          h (M, D), w (D, V), labels (M,): tokens over ``data``, the vocabulary over ``model``. The kernel
                returns per-row losses, not the log-sum-exp, so each device recovers its block's log-sum-exp as
                row loss + its logit at the (local) label column, recomputed as h · w[:, column] (one gathered column
                of w and one D-long dot per token: ~1/V_block of the logits GEMM); then lse = m + log Σ exp(lse_b − m)
                with m = pmax(lse_b), the label's logit from the device that holds that column (a psum), and the
                mean over the tokens of every data block (a psum). Extra communication: two all-reduces of M float32
                over ``model`` forward and two in the backward, and the scalar over ``data``.

An axis whose size does not divide the dimension it would split is left out (that dimension is replicated over it:
correct, with XLA gathering the operand). ``check_vma=False``: pallas_call declares no varying-axes types for its
outputs; shard_map then psums the gradients of operands replicated over an axis, which is what each site needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxfuse.sharding import DATA, MODEL, current_mesh
from jaxfuse.sharding import mesh_axis as _axis

__all__ = ["attention", "loss", "norm_matmul"]


def _shard_map(fn, mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def attention(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """The attention site ``kernel`` (q, k, v, *, causal, scale) split over batch (data) and heads (model)."""

    @functools.wraps(kernel)
    def sharded(q, k, v, *, causal: bool = False, scale: float | None = None, **options):
        mesh = current_mesh()
        call = functools.partial(kernel, causal=causal, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                 **options)
        if mesh is None:
            return call(q, k, v)
        spec = P(_axis(mesh, DATA, q.shape[0]), None, _axis(mesh, MODEL, k.shape[2]), None)  # (B, T|S, N|K, H)
        return _shard_map(call, mesh, (spec, spec, spec), spec)(q, k, v)

    return sharded


def norm_matmul(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """The norm_matmul site ``kernel`` (x, gamma, w, *, eps) split over rows (data) and the GEMM's N (model)."""

    @functools.wraps(kernel)
    def sharded(x, gamma, w, *, eps: float = 1e-6, **options):
        mesh = current_mesh()
        call = functools.partial(kernel, eps=eps, **options)
        if mesh is None:
            return call(x, gamma, w)
        rows = _axis(mesh, DATA, x.shape[0]) if x.ndim > 1 else None
        cols = _axis(mesh, MODEL, w.shape[1])
        lead = (rows,) + (None,) * (x.ndim - 2) if x.ndim > 1 else ()
        x_spec = P(*lead, None)  # K whole: the norm needs whole rows (a K-split x is all-gathered here)
        return _shard_map(call, mesh, (x_spec, P(None), P(None, cols)), P(*lead, cols))(x, gamma, w)

    return sharded


def loss(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """The loss site ``kernel`` (h, w, labels, *, reduction=...) -> mean cross-entropy, split over tokens (data)
    and the vocabulary (model), the log-sum-exp combined across ``model`` (module docstring)."""

    @functools.wraps(kernel)
    def sharded(h, w, labels, *, ignore_index: int = -100, **options):
        mesh = current_mesh()
        if mesh is None:
            return kernel(h, w, labels, ignore_index=ignore_index, **options)
        rows = _axis(mesh, DATA, h.shape[0])
        vocab = _axis(mesh, MODEL, w.shape[1])
        V = w.shape[1]
        changed = {k: v for k, v in options.items() if k in ("z_loss", "logit_soft_cap") and v not in (None, 0, 0.0)}
        if vocab is not None and changed:
            # row loss + z_label is the block's log-sum-exp only for the plain loss
            raise ValueError(f"loss: {', '.join(f'{k}={v!r}' for k, v in changed.items())} with the vocabulary "
                             f"split over '{MODEL}': the sharded loss recovers each block's log-sum-exp from the "
                             "plain cross-entropy, so it takes neither z_loss nor logit_soft_cap (use a mesh whose "
                             f"'{MODEL}' axis does not divide the vocabulary, or drop them)")

        def local(h, w, labels):  # h (M_b, D), w (D, V_b), labels (M_b,)
            valid = labels != ignore_index
            if vocab is None:
                total = kernel(h, w, labels, ignore_index=ignore_index, reduction="sum", **options)
            else:
                V_b = w.shape[1]
                column = labels - lax.axis_index(MODEL) * V_b  # the label's column in this vocabulary block
                owned = valid & (column >= 0) & (column < V_b)
                column = jnp.where(owned, column, 0)
                row = kernel(h, w, column, ignore_index=ignore_index, reduction="none", **options)  # lse_b − z_col
                z = jnp.einsum("md,dm->m", h.astype(jnp.float32), w[:, column].astype(jnp.float32),
                               precision=lax.Precision.HIGHEST)  # (M_b,) logit at that column
                lse_b = row + z  # this block's log-sum-exp per row
                m = lax.pmax(lax.stop_gradient(lse_b), MODEL)  # a shift only: no gradient
                summed = lax.psum(jnp.stack([jnp.exp(lse_b - m), jnp.where(owned, z, 0.0)]), MODEL)
                lse, label_logit = m + jnp.log(summed[0]), summed[1]
                bad = valid & ((labels < 0) | (labels >= V))  # no block owns it: NaN, as the kernel gives
                total = jnp.sum(jnp.where(bad, jnp.nan, jnp.where(valid, lse - label_logit, 0.0)))
            count = jnp.sum(valid).astype(jnp.float32)
            if rows is not None:
                total, count = lax.psum((total, count), DATA)
            return total / jnp.maximum(count, 1.0)

        return _shard_map(local, mesh, (P(rows, None), P(None, vocab), P(rows)), P())(h, w, labels)

    return sharded
