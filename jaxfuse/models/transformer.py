"""Llama-style decoder in Flax NNX whose fusable sites dispatch through a ``KernelSet``.

Shapes: B batch, T sequence, D model width (``dim``), N query heads, K key/value heads (N % K == 0), H head dim,
F MLP hidden width, V vocabulary. Parameters are stored in ``param_dtype`` and cast to the compute ``dtype`` where
they are used; activations are in ``dtype``; the loss is float32.

    Transformer: tokens (B, T) -> embed -> n_layers x Block -> final_norm -> lm_head -> logits (B, T, V)
    Block:       x = x + attn(norm1(x));  x = x + mlp(norm2(x))                      (B, T, D) -> (B, T, D)
    Attention:   qkv_proj -> RoPE on q, k -> causal GQA attention (attention site) -> out_proj
    MLP:         gate_up_proj -> silu(gate) * up -> down_proj                         (SwiGLU)

Fusable sites (``jaxfuse.kernels``): every RMSNorm that feeds a projection is handed to that projection, which
computes ``rmsnorm(x) @ w`` through the ``norm_matmul`` site (norm1 -> attn.qkv_proj, norm2 -> mlp.gate_up_proj,
final_norm -> lm_head). So that one call covers each pair, q/k/v and gate/up are stored as one fused weight
each, in column orders that any contiguous split keeps whole (tensor parallelism, ``jaxfuse.sharding``, splits
the columns into equal blocks): q/k/v grouped by key/value head (per kv head j: its G = N / K query heads, then
k_j, then v_j) and gate/up interleaved (column 2i is gate i, column 2i + 1 is up i). Attention goes through the ``attention`` site and ``Transformer.loss``
through the ``loss`` site (final_norm, then the LM head fused with cross-entropy).

HLO scopes: Flax NNX puts no module names in op_name metadata, so each module's ``__call__`` runs inside
``jax.named_scope(<its attribute name>)`` (``blocks.<i>`` for the layers). Ops of block 0's q/k/v projection then
carry op_name ``jit(f)/blocks.0/attn/qkv_proj/...`` (``.../qkv_proj/rmsnorm/...`` and ``.../qkv_proj/matmul/...``
for the unfused norm_matmul), and their gradients ``jit(f)/transpose(jvp(blocks.0))/attn/qkv_proj/...``.
A root module (the model you build) has no scope of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.kernels import KernelSet
from jaxfuse.sharding import DATA, MODEL, constrain_activation
from pallas_kernels import reference

__all__ = ["MLP", "Attention", "Block", "Config", "Embedding", "Linear", "RMSNorm", "Transformer", "rope"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Model hyper-parameters. Validated on construction; presets: ``tiny``, ``small``, ``block_default``.

    ``dtype`` is the compute dtype (activations, matmul inputs), ``param_dtype`` the storage dtype of weights.
    """

    vocab: int  # V
    dim: int  # D
    n_layers: int
    n_heads: int  # N
    n_kv_heads: int  # K; N % K == 0 (K < N is grouped-query attention)
    head_dim: int  # H; even (RoPE rotates pairs)
    mlp_hidden: int  # F
    max_seq: int  # longest T accepted
    eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10_000.0  # RoPE base wavelength
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        for field in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "max_seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Config.{field}: expected a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Config.n_kv_heads: n_heads % n_kv_heads must be 0, got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"Config.head_dim: must be even for RoPE, got {self.head_dim}")
        if not self.eps > 0:
            raise ValueError(f"Config.eps: expected > 0, got {self.eps!r}")
        for field in ("dtype", "param_dtype"):
            dtype = jnp.dtype(getattr(self, field))
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"Config.{field}: expected a floating dtype, got {dtype}")
            object.__setattr__(self, field, dtype)  # normalize "bfloat16" / jnp.bfloat16 -> dtype('bfloat16')

    @classmethod
    def from_width(
        cls, dim: int, n_heads: int, n_kv_heads: int | None = None, *, n_layers: int = 1, vocab: int = 4096,
        max_seq: int = 2048, **overrides,
    ) -> Config:
        """Llama proportions from the width: H = D / N, F = 8/3 D rounded up to a multiple of 64."""
        if dim % n_heads:
            raise ValueError(f"dim: must be divisible by n_heads={n_heads}, got dim={dim}")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        mlp_hidden = -(-(8 * dim // 3) // 64) * 64
        return cls(vocab=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   head_dim=dim // n_heads, mlp_hidden=mlp_hidden, max_seq=max_seq, **overrides)

    @classmethod
    def tiny(cls, **overrides) -> Config:
        """Fast CPU tests: D=64, 2 layers, N=4, K=2, H=16, F=96, V=128, float32."""
        base = dict(vocab=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=96,
                    max_seq=64)
        return cls(**(base | overrides))

    @classmethod
    def small(cls, **overrides) -> Config:
        """A ~35M-parameter LM for GPU studies: D=512, 8 layers, N=8, K=2, H=64, F=1408, V=8192, bfloat16."""
        base = dict(vocab=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, mlp_hidden=1408,
                    max_seq=1024, dtype=jnp.bfloat16)
        return cls(**(base | overrides))

    @classmethod
    def block_default(cls, **overrides) -> Config:
        """The default shape of ``jaxfuse.programs``: D=256, N=4, K=2, H=64, F=704, 2 layers, V=4096, bfloat16."""
        return cls.from_width(256, 4, 2, n_layers=2, vocab=4096, max_seq=2048,
                              **({"dtype": jnp.bfloat16} | overrides))


# ---------------------------------------------------------------------------------------------------------------
# Scopes: module attribute names in HLO op_name metadata
# ---------------------------------------------------------------------------------------------------------------
class _Scoped(nnx.Module):
    """A module whose ``__call__`` (decorated with ``_scoped``) runs inside ``jax.named_scope(scope_name)``."""

    scope_name: str = ""  # set by the parent (_name_children); "" for a root module: no scope


def _name_children(parent: nnx.Module) -> None:
    """Sets each direct submodule's scope_name to its attribute name (``attr.i`` for items of an nnx.List)."""
    for attr, value in vars(parent).items():
        if isinstance(value, _Scoped):
            value.scope_name = attr
        elif isinstance(value, nnx.List):
            for i, item in enumerate(value):
                if isinstance(item, _Scoped):
                    item.scope_name = f"{attr}.{i}"


def _scoped(call: Callable) -> Callable:
    @functools.wraps(call)
    def scoped_call(self: _Scoped, *args, **kwargs):
        if not self.scope_name:
            return call(self, *args, **kwargs)
        with jax.named_scope(self.scope_name):
            return call(self, *args, **kwargs)

    return scoped_call


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., D_in) @ w (D_in, D_out) -> (..., D_out) in x.dtype; GEMMs accumulate in float32 internally.

    Not ``preferred_element_type=float32`` followed by a cast: JAX's transpose of that dot feeds the float32
    cotangent to the backward GEMMs, which then run in float32 (TF32 on the GPU) behind convert kernels."""
    return jnp.dot(x, w.astype(x.dtype))


def rope(x: jax.Array, positions: jax.Array, *, theta: float = 10_000.0) -> jax.Array:
    """Rotary position embedding, rotate-half convention (Llama / GPT-NeoX).

    x (B, T, n, H) with H even; positions (T,) or (B, T) int. Pair (x[..., i], x[..., i + H/2]) is rotated by
    positions * theta^(-2i/H) radians, computed in float32; returns (B, T, n, H) in x.dtype.
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (H/2,)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (T, H/2) or (B, T, H/2)
    cos = jnp.cos(angles)[..., None, :]  # (T, 1, H/2) or (B, T, 1, H/2): broadcast over heads
    sin = jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # (B, T, n, H/2) each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # (B, T, n, H)
    return rotated.astype(x.dtype)


class RMSNorm(_Scoped):
    """x / sqrt(mean(x², -1) + eps) * scale; x (..., D) -> (..., D) in x.dtype. ``scale`` (D,) starts at 1."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype: Any = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    @_scoped
    def __call__(self, x: jax.Array) -> jax.Array:
        return reference.rmsnorm(x, self.scale[...], eps=self.eps)


class Linear(_Scoped):
    """y = x @ kernel without bias; kernel (D_in, D_out) ~ N(0, 1/D_in) in param_dtype, used in dtype.

    ``__call__(x, norm=n)`` computes ``n(x) @ kernel`` through the ``norm_matmul`` site instead, so a fused
    kernel can normalize x on load rather than read a normalized copy back from HBM.
    """

    def __init__(self, in_features: int, out_features: int, *, kernels: KernelSet, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(stddev=in_features**-0.5)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        self.kernels = kernels
        self.dtype = dtype

    @_scoped
    def __call__(self, x: jax.Array, *, norm: RMSNorm | None = None) -> jax.Array:
        x = x.astype(self.dtype)
        kernel = self.kernel[...].astype(self.dtype)  # (D_in, D_out)
        if norm is None:
            return _matmul(x, kernel)  # (..., D_out)
        return self.kernels.norm_matmul_fn(x, norm.scale[...], kernel, eps=norm.eps)  # (..., D_out)


class Embedding(_Scoped):
    """tokens (B, T) int -> (B, T, D) in dtype; table (V, D) ~ N(0, 1) in param_dtype (rows gathered, then cast)."""

    def __init__(self, vocab: int, dim: int, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), param_dtype))
        self.dtype = dtype

    @_scoped
    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)  # (B, T, D)


class Attention(_Scoped):
    """Causal grouped-query self-attention with RoPE: x (B, T, D) -> (B, T, D).

    qkv_proj: D -> (N + 2K)·H, columns grouped by key/value head: for kv head j (of K), its G = N / K query heads
    (query heads jG .. jG + G − 1, H columns each), then k_j, then v_j; query head n reads key/value head n // G.
    Equal column blocks of any size dividing K hold whole groups (tensor parallelism). out_proj: N·H -> D.
    """

    def __init__(self, cfg: Config, *, kernels: KernelSet, rngs: nnx.Rngs):
        self.cfg = cfg
        self.kernels = kernels
        qkv_features = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        linear = functools.partial(Linear, kernels=kernels, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.qkv_proj = linear(cfg.dim, qkv_features)
        self.out_proj = linear(cfg.n_heads * cfg.head_dim, cfg.dim)
        _name_children(self)

    @_scoped
    def __call__(self, x: jax.Array, positions: jax.Array, *, norm: RMSNorm | None = None) -> jax.Array:
        """x (B, T, D), positions (T,) or (B, T); ``norm`` is applied to x inside qkv_proj (norm_matmul site)."""
        cfg = self.cfg
        B, T, _ = x.shape
        N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = N // K
        qkv = self.qkv_proj(x, norm=norm).reshape(B, T, K, G + 2, H)  # (B, T, (N + 2K)·H) -> (B, T, K, G + 2, H)
        q = qkv[:, :, :, :G].reshape(B, T, N, H)  # (B, T, K, G, H) -> (B, T, N, H): head n = j·G + g
        k = qkv[:, :, :, G]  # (B, T, K, H)
        v = qkv[:, :, :, G + 1]  # (B, T, K, H)
        # On a mesh (jaxfuse.sharding): batch over data, heads over model (tensor parallelism); a no-op otherwise.
        q, k, v = (constrain_activation(a, DATA, None, MODEL, None) for a in (q, k, v))
        with jax.named_scope("rope"):
            q = rope(q, positions, theta=cfg.rope_theta)
            k = rope(k, positions, theta=cfg.rope_theta)
        with jax.named_scope("sdpa"):
            out = self.kernels.attention_fn(q, k, v, causal=True, scale=H**-0.5)  # (B, T, N, H)
        out = out.reshape(B, T, N * H)  # (B, T, N, H) -> (B, T, N·H)
        return self.out_proj(out)  # (B, T, D)


class MLP(_Scoped):
    """SwiGLU: x (B, T, D) -> down_proj(silu(gate) * up) (B, T, D); gate_up_proj D -> 2F, columns interleaved
    (2i: gate i, 2i + 1: up i), so that equal column blocks hold matching gate and up columns."""

    def __init__(self, cfg: Config, *, kernels: KernelSet, rngs: nnx.Rngs):
        linear = functools.partial(Linear, kernels=kernels, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.gate_up_proj = linear(cfg.dim, 2 * cfg.mlp_hidden)
        self.down_proj = linear(cfg.mlp_hidden, cfg.dim)
        _name_children(self)

    @_scoped
    def __call__(self, x: jax.Array, *, norm: RMSNorm | None = None) -> jax.Array:
        """x (B, T, D); ``norm`` is applied to x inside gate_up_proj (norm_matmul site)."""
        gate_up = self.gate_up_proj(x, norm=norm)  # (B, T, 2F)
        gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)  # (B, T, F, 2)
        gate, up = (constrain_activation(a, DATA, None, MODEL) for a in (gate_up[..., 0], gate_up[..., 1]))  # (B, T, F)
        with jax.named_scope("swiglu"):
            hidden = jax.nn.silu(gate) * up  # (B, T, F)
        return self.down_proj(hidden)  # (B, T, D)


class Block(_Scoped):
    """Pre-norm decoder block: (B, T, D) -> (B, T, D)."""

    def __init__(self, cfg: Config, *, kernels: KernelSet = KernelSet(), rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm1 = RMSNorm(cfg.dim, eps=cfg.eps, param_dtype=cfg.param_dtype)
        self.attn = Attention(cfg, kernels=kernels, rngs=rngs)
        self.norm2 = RMSNorm(cfg.dim, eps=cfg.eps, param_dtype=cfg.param_dtype)
        self.mlp = MLP(cfg, kernels=kernels, rngs=rngs)
        _name_children(self)

    @_scoped
    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """x (B, T, D); positions (T,) or (B, T) int, default arange(T)."""
        if positions is None:
            positions = jnp.arange(x.shape[1])  # (T,)
        # x = x + attn(norm1(x)); x = x + mlp(norm2(x)): each norm is applied by the projection that reads it.
        x = x + self.attn(x, positions, norm=self.norm1)
        x = x + self.mlp(x, norm=self.norm2)
        return x


class Transformer(_Scoped):
    """Decoder-only LM: tokens (B, T) int -> logits (B, T, V), or the mean next-token loss (``loss``)."""

    def __init__(self, cfg: Config, *, kernels: KernelSet = KernelSet(), rngs: nnx.Rngs):
        self.cfg = cfg
        self.kernels = kernels
        self.embed = Embedding(cfg.vocab, cfg.dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, kernels=kernels, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.dim, eps=cfg.eps, param_dtype=cfg.param_dtype)
        self.lm_head = Linear(cfg.dim, cfg.vocab, kernels=kernels, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                              rngs=rngs)
        _name_children(self)

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """tokens (B, T) -> residual stream after the last block (B, T, D), before final_norm."""
        if tokens.ndim != 2 or tokens.shape[1] > self.cfg.max_seq:
            raise ValueError(f"tokens: expected shape (B, T) with T <= max_seq={self.cfg.max_seq}, got {tokens.shape}")
        if positions is None:
            positions = jnp.arange(tokens.shape[1])  # (T,)
        x = self.embed(tokens)  # (B, T, D)
        for block in self.blocks:
            x = block(x, positions)
        return x

    @_scoped
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """tokens (B, T) -> logits (B, T, V) in dtype; final_norm is applied inside lm_head (norm_matmul site)."""
        return self.lm_head(self.hidden(tokens, positions), norm=self.final_norm)

    @_scoped
    def loss(self, tokens: jax.Array, labels: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Mean cross-entropy (float32 scalar) of logits(tokens) against labels (B, T); label -100 is ignored.

        The LM head and the loss run together through the ``loss`` site (the (B·T, V) logits need not exist).
        """
        h = self.final_norm(self.hidden(tokens, positions))  # (B, T, D)
        B, T, D = h.shape
        with jax.named_scope("loss"):
            w = self.lm_head.kernel[...].astype(self.cfg.dtype)  # (D, V)
            return self.kernels.loss_fn(h.reshape(B * T, D), w, labels.reshape(B * T))  # (B, T, D) -> (B·T, D)
