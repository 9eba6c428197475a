"""Scalar index arithmetic inside Pallas kernels, for every backend (Triton and Mosaic GPU), and the int check of
config validation.

  from pallas_kernels.index_math import cdiv, div, i32, minimum, round_up
  num_tiles = cdiv(kv_len, block_k)   # a Python int for a static length, an int32 scalar for a traced one

Python ints stay Python ints (a kernel may not close over array constants, and static bounds keep loops static);
traced int32 scalars use lax ops. Every operand is non-negative, so truncating division is floor division.
Nothing here is kernel-specific; no import-time side effects.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["cdiv", "div", "i32", "is_int", "minimum", "round_up"]


def is_int(value) -> bool:
    """Whether value is a Python int and not a bool (config validation: True is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def i32(x):
    """A Python int as a strongly typed int32 scalar; a traced scalar unchanged. (jnp.where of two weakly typed
    Python ints makes the Triton lowering of jax 0.10.2 give the constants the predicate's i1 type, so select
    operands are made strong.)"""
    return jnp.asarray(x, jnp.int32) if isinstance(x, int) else x


def cdiv(a, b: int):
    """ceil(a / b) for a >= 0 and a Python int b > 0."""
    return -(-a // b) if isinstance(a, int) else lax.div(a + (b - 1), i32(b))


def div(a, b: int):
    """floor(a / b) for a >= 0 and a Python int b > 0."""
    return a // b if isinstance(a, int) else lax.div(a, i32(b))


def minimum(a, b):
    """min(a, b): a Python int when both are."""
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def round_up(a: int, b: int) -> int:
    """The smallest multiple of b that is >= a (Python ints: shapes and padded lengths)."""
    return -(-a // b) * b
