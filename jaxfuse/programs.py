"""The programs that ``jaxfuse inspect`` and ``hlo_inspect`` compile: a model, its inputs, forward or train step.

    >>> from jaxfuse.programs import build_program
    >>> p = build_program("block", train_step=True)
    >>> loss, grads = jax.jit(p.fn)(*p.args)          # or hlo_inspect.inspect(p.fn, *p.args)

``Program.fn`` is pure: parameters are its first argument (an ``nnx.State`` split off the model with
``nnx.split``), so they are explicit jit arguments, not constants folded into the HLO.

  model="block", forward:     fn(params, x (B, T, D)) -> y (B, T, D)
  model="block", train_step:  fn(params, x) -> (loss, grads); loss = mean(y²) in float32, grads like params
  model="lm", forward:        fn(params, tokens (B, T)) -> logits (B, T, V), final norm fused into the LM head
                              through the norm_matmul site
  model="lm", train_step:     fn(params, tokens, labels (B, T)) -> (loss, grads); mean next-token cross-entropy
                              through the loss site

Defaults (a Llama-shaped block that compiles in seconds on CPU): batch 2, seq 128, dim 256, 4 query heads and 2
key/value heads (head dim 64, GQA), MLP hidden 704, bfloat16 compute with float32 parameters; the LM adds
2 layers and a 4096-token vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfuse.kernels import KernelSet
from jaxfuse.models import Block, Config, Transformer

__all__ = ["MODELS", "Program", "build_program"]

MODELS = ("block", "lm")
IGNORE_LABEL = -100  # label of the last position, which has no next token


@dataclasses.dataclass(frozen=True)
class Program:
    """A pure function and concrete arguments to call (or jit, lower, compile) it with."""

    fn: Callable[..., Any]  # fn(params, *inputs); jit-able
    args: tuple[Any, ...]  # (params nnx.State, *inputs), random values
    description: str  # one line: model, shapes, dtype, mode, kernels
    config: Config
    kernels: KernelSet


def build_program(
    model: str = "block",
    *,
    batch: int = 2,
    seq: int = 128,
    dim: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    dtype: Any = "bfloat16",
    train_step: bool = False,
    kernels: KernelSet = KernelSet(),
    seed: int = 0,
    layers: int = 2,
    vocab: int = 4096,
) -> Program:
    """Builds the model ("block": one decoder block; "lm": ``layers`` blocks with embedding and LM head).

    Head dim is dim / heads and the MLP hidden width 8/3·dim rounded up to 64 (``Config.from_width``).
    ``layers`` and ``vocab`` apply to "lm" only. Parameters come from ``nnx.Rngs(seed)``, inputs from
    ``jax.random.key(seed + 1)``. Raises ``ValueError`` naming the argument for bad values.
    """
    if model not in MODELS:
        raise ValueError(f"model: expected one of {list(MODELS)}, got {model!r}")
    for name, value in (("batch", batch), ("seq", seq), ("heads", heads), ("kv_heads", kv_heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if not isinstance(kernels, KernelSet):
        raise TypeError(f"kernels: expected a KernelSet, got {type(kernels).__name__}")
    cfg = Config.from_width(dim, heads, kv_heads, n_layers=layers if model == "lm" else 1,
                            vocab=vocab, max_seq=seq, dtype=dtype)
    x_key = jax.random.key(seed + 1)
    mode = "train_step" if train_step else "forward"

    if model == "block":
        graphdef, params = nnx.split(Block(cfg, kernels=kernels, rngs=nnx.Rngs(seed)))
        x = jax.random.normal(x_key, (batch, seq, dim), cfg.dtype)  # (B, T, D)

        def block_forward(params: nnx.State, x: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, params)(x)  # (B, T, D)

        def block_train_step(params: nnx.State, x: jax.Array) -> tuple[jax.Array, nnx.State]:
            def loss_of(params):
                y = nnx.merge(graphdef, params)(x)  # (B, T, D)
                return jnp.mean(jnp.square(y.astype(jnp.float32)))

            return jax.value_and_grad(loss_of)(params)

        fn, args = (block_train_step if train_step else block_forward), (params, x)
        shapes = f"x ({batch}, {seq}, {dim})"
    else:
        graphdef, params = nnx.split(Transformer(cfg, kernels=kernels, rngs=nnx.Rngs(seed)))
        tokens = jax.random.randint(x_key, (batch, seq), 0, vocab, dtype=jnp.int32)  # (B, T)
        labels = jnp.concatenate([tokens[:, 1:], jnp.full((batch, 1), IGNORE_LABEL, jnp.int32)], axis=1)  # (B, T)

        def lm_forward(params: nnx.State, tokens: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, params)(tokens)  # (B, T, V)

        def lm_train_step(params: nnx.State, tokens: jax.Array, labels: jax.Array) -> tuple[jax.Array, nnx.State]:
            def loss_of(params):
                return nnx.merge(graphdef, params).loss(tokens, labels)

            return jax.value_and_grad(loss_of)(params)

        fn, args = (lm_train_step, (params, tokens, labels)) if train_step else (lm_forward, (params, tokens))
        shapes = f"tokens ({batch}, {seq}), {layers} layers, vocab {vocab}"

    description = (
        f"{model} {mode}: {shapes}, dim {dim}, heads {heads}/{kv_heads} (head dim {cfg.head_dim}), "
        f"mlp {cfg.mlp_hidden}, {cfg.dtype.name} compute, {cfg.param_dtype.name} params, kernels {kernels}"
    )
    return Program(fn=fn, args=args, description=description, config=cfg, kernels=kernels)
