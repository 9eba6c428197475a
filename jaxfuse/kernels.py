"""Per-site implementation choice for the model: which kernel runs attention, norm→matmul and the loss.

The model has three sites where a hand-fused kernel can replace what XLA does with plain jnp:

  attention    q (B, T, N, H), k/v (B, S, K, H), N % K == 0, *, causal: bool, scale: float -> (B, T, N, H) in q.dtype
  norm_matmul  x (..., D), gamma (D,), w (D, F), *, eps: float -> rmsnorm(x) @ w, (..., F) in x.dtype
  loss         h (M, D), w (D, V), labels (M,) int (-100 = ignored) -> scalar float32 mean cross-entropy

Each site has one registry, a dict from implementation name to callable (``ATTENTION``, ``NORM_MATMUL``,
``LOSS``; ``REGISTRIES`` maps site name to registry). Every site has:

  xla      plain jnp as a model writes it, in the compute dtype (bf16 GEMMs that accumulate in float32, a float32
           softmax / log-sum-exp over the materialized scores or logits): XLA fuses what it can and materializes
           the rest. The baseline the benchmark suites time, so model-level and kernel-level comparisons agree.
  xla_f32  the float32 references of ``pallas_kernels.reference`` (HIGHEST precision, nothing rounded to the
           compute dtype): what the kernels are tested against; slower, for checking numerics.
  pallas   the fused Pallas kernels of ``pallas_kernels``, backend "auto" (the fastest tuned backend that runs
           here; Triton when nothing is tuned, interpret mode on CPU); on a device mesh each
           kernel runs under ``shard_map`` (``jaxfuse.sharded_kernels``)
  pallas_triton, pallas_mosaic   the same kernels on that backend (``backend="triton"`` / ``"mosaic"``); a
           backend the op does not implement yet raises ValueError when called (``unavailable_reason`` says so
           before). Results name these, never ``pallas``, so a record says which backend ran.

``"cudnn"`` (attention only) is ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU only). A module that
provides another implementation registers it with ``register("attention", "name", fn)``. The Pallas entries pass
extra keyword options (``block_sizes=``) on to the kernel; inside ``recording_backends()`` they note the backend
each call runs (what "auto" resolved to).

    >>> ks = KernelSet.parse("attention=cudnn")
    >>> ks
    KernelSet(attention='cudnn', norm_matmul='xla', loss='xla')
    >>> str(ks)
    'attention=cudnn,norm_matmul=xla,loss=xla'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels
from jaxfuse import sharded_kernels
from pallas_kernels import reference

__all__ = [
    "ATTENTION",
    "LOSS",
    "NORM_MATMUL",
    "PALLAS_BACKENDS",
    "REGISTRIES",
    "SITES",
    "SITE_OPS",
    "KernelSet",
    "plain_attention",
    "plain_cross_entropy",
    "recording_backends",
    "register",
    "unavailable_reason",
    "unimplemented_reason",
]


def _rmsnorm_then_matmul(x: jax.Array, gamma: jax.Array, w: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """The unfused pair, as a plain jnp model writes it: rmsnorm(x) (..., D) rounded to x.dtype, then @ w (D, F).

    The normalized activations are an array of their own here; that is the HBM round trip a fused kernel removes.
    (``reference.rmsnorm_matmul`` instead keeps them in float32; both agree exactly for float32 inputs.)
    The two halves carry their own scopes ("rmsnorm", "matmul") in HLO op_name metadata.
    """
    with jax.named_scope("rmsnorm"):
        normed = reference.rmsnorm(x, gamma, eps=eps)  # (..., D) in x.dtype
    with jax.named_scope("matmul"):
        return jnp.dot(normed, w.astype(x.dtype))  # (..., F); the GEMM accumulates in float32 internally


def plain_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, scale: float | None = None
) -> jax.Array:
    """Attention as plain jnp commonly writes it: q (B, T, N, H), k/v (B, S, K, H), N % K == 0 -> (B, T, N, H).

    Compute-dtype einsums (bf16 GEMMs accumulate in float32 and round to bf16), a float32 softmax over the
    materialized scores, probabilities rounded back to q's dtype. Every GEMM of the forward and of its autodiff
    backward is then bf16 x bf16 (the casts' transposes bring the cotangents back to bf16). The scores are laid out
    (B, K, T, G, S), the free dims in the order dot_general gives them: laid out (B, K, G, T, S) instead, XLA adds a
    transpose of the scores or probabilities around each GEMM, forward and backward, and under grouped-query
    attention that form took 1.4-2.3x as long on the H200. Causal masks are top-left aligned (key s visible to
    query t iff s <= t), built from iotas of the scores' shape: a (T, S) mask from aranges became a kernel of its
    own whose output XLA's softmax fusion read broadcast, up to 1.8x slower (both measured by
    ``benchmarks/scripts/attention_einsum_order.py``; NOTES.md). scale defaults to 1/sqrt(H). The three steps
    carry scopes "scores", "softmax" and "weighted_sum" in HLO op_name metadata.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    scale = H**-0.5 if scale is None else scale
    qg = q.reshape(B, T, K, N // K, H)  # (B, T, K, G, H): query head n = k * G + g reads kv head k
    with jax.named_scope("scores"):
        scores = jnp.einsum("BTKGH,BSKH->BKTGS", qg, k).astype(jnp.float32) * scale  # (B, K, T, G, S)
    with jax.named_scope("softmax"):
        if causal:  # from iotas of the scores' own shape: XLA computes the mask inside the softmax's fusion
            query_pos, key_pos = (lax.broadcasted_iota(jnp.int32, scores.shape, axis) for axis in (2, 4))
            scores = jnp.where(query_pos >= key_pos, scores, -jnp.inf)
        p = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # (B, K, T, G, S)
    with jax.named_scope("weighted_sum"):
        o = jnp.einsum("BKTGS,BSKH->BTKGH", p, v)  # (B, T, K, G, H)
    return o.reshape(B, T, N, H)


def plain_cross_entropy(h: jax.Array, w: jax.Array, labels: jax.Array, *, ignore_index: int = -100) -> jax.Array:
    """Mean cross-entropy of softmax(h @ w) as plain jnp writes it: h (M, D), w (D, V), labels (M,) int -> float32.

    The (M, V) logits are materialized: one compute-dtype GEMM (w cast to h's dtype), then a float32 log-sum-exp
    and the label logit. Rows labelled ``ignore_index`` add nothing and are not counted (all ignored: 0, not NaN).
    Scopes: "logits" (the GEMM) and "cross_entropy" (the rest).
    """
    with jax.named_scope("logits"):
        logits = jnp.dot(h, w.astype(h.dtype)).astype(jnp.float32)  # (M, V)
    with jax.named_scope("cross_entropy"):
        valid = labels != ignore_index
        safe_labels = jnp.where(valid, labels, 0)
        lse = jax.nn.logsumexp(logits, axis=-1)  # (M,)
        label_logit = jnp.take_along_axis(logits, safe_labels[:, None], axis=-1)[:, 0]  # (M,)
        total = jnp.sum(jnp.where(valid, lse - label_logit, 0.0))
        return total / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)


def _cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, scale: float | None = None
) -> jax.Array:
    """cuDNN fused attention through ``jax.nn.dot_product_attention(implementation="cudnn")``.

    Raises a short ``RuntimeError`` off GPU and a ``ValueError`` for dtypes cuDNN does not take, instead of
    the deep lowering traceback JAX would give.
    """
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda"):
        raise RuntimeError(
            f"attention='cudnn' needs an NVIDIA GPU with cuDNN, but the default JAX backend is {backend!r}; "
            f"use attention='xla' here (KernelSet(attention='xla'))"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"attention='cudnn': q, k and v must be bfloat16 or float16, got {q.dtype}; "
            f"use a bfloat16 compute dtype or attention='xla'"
        )
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")


# Pallas implementation name -> the kernels' backend= argument.
PALLAS_BACKENDS = {"pallas": "auto", "pallas_triton": "triton", "pallas_mosaic": "mosaic"}
# site -> the op's name in pallas_kernels.BACKENDS and the tuning cache.
SITE_OPS = {"attention": "flash_attention", "norm_matmul": "rmsnorm_matmul", "loss": "linear_cross_entropy"}


_BACKENDS_RUN: contextvars.ContextVar[dict[str, set[str]] | None] = contextvars.ContextVar(
    "jaxfuse_backends_run", default=None)


@contextlib.contextmanager
def recording_backends() -> Iterator[dict[str, set[str]]]:
    """Within this block every call of a Pallas site adds the backend it runs ("triton" or "mosaic": what "auto"
    resolves to for its arguments here) to the yielded {site: backends}. Only calls made while tracing inside the
    block count: a function jax has traced before (and cached) calls no site."""
    backends_run: dict[str, set[str]] = {}
    token = _BACKENDS_RUN.set(backends_run)
    try:
        yield backends_run
    finally:
        _BACKENDS_RUN.reset(token)


def _note_backend(site: str, backend: str, *args, **options) -> None:
    """Inside ``recording_backends``: notes the backend the op's ``plan`` picks for the site's call."""
    backends_run = _BACKENDS_RUN.get()
    if backends_run is not None:
        plan = pallas_kernels.OPS[SITE_OPS[site]].plan(*args, backend=backend, **options)
        backends_run.setdefault(site, set()).add(plan.backend)


def _pallas_attention(backend: str) -> Callable[..., jax.Array]:
    def attention(q, k, v, *, causal: bool = False, scale: float | None = None, **options):
        """The Pallas flash-attention kernel on backend ``backend``."""
        _note_backend("attention", backend, q, k, v, causal=causal, scale=scale, **options)
        return pallas_kernels.flash_attention(q, k, v, causal=causal, scale=scale, backend=backend, **options)

    return attention


def _pallas_norm_matmul(backend: str) -> Callable[..., jax.Array]:
    def norm_matmul(x, gamma, w, *, eps: float = 1e-6, **options):
        """The fused Pallas kernel on backend ``backend``; w is cast to x's dtype (one operand dtype)."""
        w = w.astype(x.dtype)
        _note_backend("norm_matmul", backend, x, gamma, w, eps=eps, **options)
        return pallas_kernels.rmsnorm_matmul(x, gamma, w, eps=eps, backend=backend, **options)

    return norm_matmul


def _pallas_loss(backend: str) -> Callable[..., jax.Array]:
    def loss(h, w, labels, **options):
        """The fused Pallas linear cross-entropy on backend ``backend``; w is cast to h's dtype."""
        w = w.astype(h.dtype)
        _note_backend("loss", backend, h, w, labels, **options)
        return pallas_kernels.linear_cross_entropy(h, w, labels, backend=backend, **options)

    return loss


# One registry per site: implementation name -> callable with the site's signature (module docstring).
# The Pallas entries run under shard_map when a mesh is current (jaxfuse.sharded_kernels); XLA partitions the rest.
ATTENTION: dict[str, Callable[..., jax.Array]] = {
    "xla": plain_attention, "xla_f32": reference.attention, "cudnn": _cudnn_attention,
    **{name: sharded_kernels.attention(_pallas_attention(backend)) for name, backend in PALLAS_BACKENDS.items()}}
NORM_MATMUL: dict[str, Callable[..., jax.Array]] = {
    "xla": _rmsnorm_then_matmul, "xla_f32": reference.rmsnorm_matmul,
    **{name: sharded_kernels.norm_matmul(_pallas_norm_matmul(backend)) for name, backend in PALLAS_BACKENDS.items()}}
LOSS: dict[str, Callable[..., jax.Array]] = {
    "xla": plain_cross_entropy, "xla_f32": reference.linear_cross_entropy,
    **{name: sharded_kernels.loss(_pallas_loss(backend)) for name, backend in PALLAS_BACKENDS.items()}}
REGISTRIES: dict[str, dict[str, Callable[..., jax.Array]]] = {
    "attention": ATTENTION,
    "norm_matmul": NORM_MATMUL,
    "loss": LOSS,
}
SITES: tuple[str, ...] = tuple(REGISTRIES)


def _registry(site: str) -> dict[str, Callable[..., jax.Array]]:
    if site not in REGISTRIES:
        raise ValueError(f"site: expected one of {list(SITES)}, got {site!r}")
    return REGISTRIES[site]


def unimplemented_reason(site: str, name: str) -> str | None:
    """Why implementation ``name`` of ``site`` has no code behind it yet (a Pallas backend its op does not
    implement), or None."""
    backend = PALLAS_BACKENDS.get(name)
    if backend in (None, "auto"):
        return None
    registry = pallas_kernels.BACKENDS[SITE_OPS[site]]
    if backend not in registry.names:
        return (f"{name}: {registry.op} has no {backend} backend yet (implemented: "
                f"{', '.join(registry.names)})")
    return None


def unavailable_reason(site: str, name: str) -> str | None:
    """Why implementation ``name`` of ``site`` cannot run on this machine (not implemented, cuDNN without a GPU,
    a GPU backend this machine lacks), or None. Shape constraints are the kernels' own ValueErrors."""
    _registry(site)
    if name == "cudnn" and jax.default_backend() not in ("gpu", "cuda"):
        return f"cudnn: needs an NVIDIA GPU with cuDNN; the default JAX backend is {jax.default_backend()!r}"
    reason = unimplemented_reason(site, name)
    if reason is None and PALLAS_BACKENDS.get(name, "auto") != "auto":
        reason = pallas_kernels.backends.unavailable_reason(PALLAS_BACKENDS[name])
    return reason


def register(site: str, name: str, fn: Callable[..., jax.Array], *, replace: bool = False) -> None:
    """Makes ``fn`` selectable as ``KernelSet(<site>=name)``; ``fn`` must take the site's signature.

    Raises ``ValueError`` for an unknown site, or when ``name`` is taken and ``replace`` is False.
    """
    registry = _registry(site)
    if not callable(fn):
        raise TypeError(f"fn: expected a callable for site {site!r}, got {type(fn).__name__}")
    if name in registry and not replace and registry[name] is not fn:
        raise ValueError(f"name: {site!r} already has an implementation named {name!r}; pass replace=True")
    registry[name] = fn


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """Which implementation runs at each model site. Hashable, so it can live in static (jit) model state.

    Every field names an entry of that site's registry; unknown names raise ``ValueError`` on construction.
    """

    attention: str = "xla"
    norm_matmul: str = "xla"
    loss: str = "xla"

    def __post_init__(self):
        for site in SITES:
            name = getattr(self, site)
            allowed = sorted(_registry(site))
            if not isinstance(name, str) or name not in allowed:
                owners = [other for other in SITES if isinstance(name, str) and name in _registry(other)]
                if owners:  # e.g. all=cudnn
                    raise ValueError(f"KernelSet.{site}: {name!r} exists only for the {' and '.join(owners)} site "
                                     f"(name it there: {owners[0]}={name}); {site} takes one of {allowed}")
                raise ValueError(f"KernelSet.{site}: unknown implementation {name!r}; expected one of {allowed}")

    @classmethod
    def parse(cls, spec: str) -> KernelSet:
        """``"attention=cudnn,loss=xla"`` -> KernelSet; omitted sites stay "xla", ``"all=NAME"`` sets every site.

        Later items win over ``all=``; a site given twice, an unknown site or an item without ``=`` raises
        ``ValueError``. The empty string gives the defaults. ``str(ks)`` is the inverse.
        """
        choices: dict[str, str] = {}
        all_name = None
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            site, sep, name = (s.strip() for s in item.partition("="))
            if not sep or not site or not name:
                raise ValueError(f"kernels: expected items like 'attention=cudnn', got {item!r} in {spec!r}")
            if site == "all":
                all_name = name
                continue
            if site not in SITES:
                raise ValueError(f"kernels: unknown site {site!r} in {spec!r}; expected one of {list(SITES)} or 'all'")
            if site in choices:
                raise ValueError(f"kernels: site {site!r} given twice in {spec!r}")
            choices[site] = name
        if all_name is not None:
            choices = {site: all_name for site in SITES} | choices
        return cls(**choices)

    def __str__(self) -> str:
        return ",".join(f"{site}={getattr(self, site)}" for site in SITES)

    def impl(self, site: str) -> Callable[..., jax.Array]:
        """The callable chosen for ``site`` (looked up now, so late registrations are seen)."""
        return _registry(site)[getattr(self, site)]

    @property
    def attention_fn(self) -> Callable[..., jax.Array]:
        """(q (B, T, N, H), k, v (B, S, K, H), *, causal, scale) -> (B, T, N, H)."""
        return self.impl("attention")

    @property
    def norm_matmul_fn(self) -> Callable[..., jax.Array]:
        """(x (..., D), gamma (D,), w (D, F), *, eps) -> (..., F)."""
        return self.impl("norm_matmul")

    @property
    def loss_fn(self) -> Callable[..., jax.Array]:
        """(h (M, D), w (D, V), labels (M,)) -> scalar float32."""
        return self.impl("loss")
