"""Small helpers shared by the Pallas (Triton lowering) kernels of this package.

  from pallas_kernels import triton_utils as tu
  call = tu.pallas_call(kernel, num_warps=8, num_stages=3, interpret=interpret, grid=(n,), out_shape=...)
  with tu.quiet_triton_deprecation():
      y = call(x, w)
  tile = tu.load(x_ref, (pl.ds(m0, bm), pl.ds(k0, bk)), mask=(rows < M)[:, None])   # masked rows read 0
  tu.store(y_ref, (pl.ds(m0, bm), pl.ds(n0, bn)), y, mask=(rows < M)[:, None])

Why masked loads: on GPU an unmasked out-of-bounds tile reads past the array; in interpret mode a window that
runs past the end is shifted back or padded with garbage. Only ``plgpu.load(..., mask=, other=)`` gives the same
answer on both, so every tile that may cross an array's end goes through ``load``/``store`` with a mask.

``resolve_interpret`` and ``lowering_for_gpu`` (which decide interpret mode for every backend) live in
``pallas_kernels.backends`` and are importable from here too. Nothing here is kernel-specific; no import-time side
effects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.backends import (first_derivatives_only, lowering_for_gpu, resolve_interpret,
                                    traced_with_32_bit_indices)
from pallas_kernels.index_math import is_int

__all__ = [
    "check_launch_fields",
    "compiler_params",
    "dot",
    "exp2",
    "load",
    "lowering_for_gpu",
    "pallas_call",
    "quiet_triton_deprecation",
    "resolve_interpret",
    "store",
]

# jax >= 0.11 warns "The Pallas Triton backend is deprecated and will be removed in a future JAX version." at every
# lowering of a Triton pallas_call. We choose Triton on purpose; only that message is silenced.
_TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quiet_triton_deprecation():
    """Silences exactly the Triton-backend DeprecationWarning while our own calls trace and compile.

    Under a caller's jit the lowering happens later, at the caller's compile, outside this scope; wrap that
    compile too if the warning matters there (benchmarks do)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
        yield


def check_launch_fields(config) -> None:
    """Validates a kernel config dataclass's tile and launch fields by their names, raising ValueError that names
    the field: ``block_*`` a power of two >= 16 (Triton tile shapes, tl.dot's minimum), ``num_warps*`` one of
    1, 2, 4, 8, 16, ``num_stages*`` an int in [1, 8]. Other fields are the config's own to check."""
    cls = type(config).__name__
    for field in dataclasses.fields(config):
        name, value = field.name, getattr(config, field.name)
        if name.startswith("block_"):
            if not is_int(value) or value < 16 or value & (value - 1):
                raise ValueError(f"{cls}.{name}: must be a power of two >= 16, got {value!r}")
        elif name.startswith("num_warps"):
            if not is_int(value) or value not in (1, 2, 4, 8, 16):
                raise ValueError(f"{cls}.{name}: must be one of 1, 2, 4, 8, 16, got {value!r}")
        elif name.startswith("num_stages"):
            if not is_int(value) or not 1 <= value <= 8:
                raise ValueError(f"{cls}.{name}: must be an int in [1, 8], got {value!r}")


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler parameters: passing them is what selects the Triton backend on GPU."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, num_warps: int, num_stages: int, interpret: bool, **kwargs):
    """``pl.pallas_call`` on the Triton backend (interpret mode when ``interpret``); kwargs as pl.pallas_call. Its
    kernel traces with 32-bit indices where ``jax_enable_x64`` is on (``backends.traced_with_32_bit_indices``); a
    derivative of the call is refused by name (``backends.first_derivatives_only``)."""
    return first_derivatives_only(traced_with_32_bit_indices(pl.pallas_call(
        kernel, compiler_params=compiler_params(num_warps, num_stages), interpret=interpret, **kwargs)))


def load(ref, idx, *, mask: jax.Array | None = None, other=0.0) -> jax.Array:
    """``ref[idx]``; with a bool ``mask`` (broadcastable to the tile, e.g. ``valid_rows[:, None]``), masked-out
    elements read ``other`` instead of memory. Without a mask the tile must lie entirely in bounds."""
    if mask is None:
        return ref[idx]
    view = ref.at[idx]
    return plgpu.load(view, mask=jnp.broadcast_to(mask, view.shape), other=other)


def store(ref, idx, value: jax.Array, *, mask: jax.Array | None = None) -> None:
    """``ref[idx] = value``; with a bool ``mask`` (broadcastable to value), masked-out elements are not written.
    A mask that is False everywhere writes nothing (predication, not control flow)."""
    if mask is None:
        ref[idx] = value
        return
    plgpu.store(ref.at[idx], value, mask=jnp.broadcast_to(mask, value.shape))


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """a @ b on 2-D tiles (aᵀ / bᵀ with trans_a / trans_b), accumulated and returned in float32.

    Precision HIGHEST: the Triton lowering maps DEFAULT precision of a float32 dot to TF32 (10-bit mantissa) and
    HIGHEST to IEEE float32. For 16-bit operands it changes nothing (tensor cores, float32 accumulation)."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def exp2(x: jax.Array, *, interpret: bool) -> jax.Array:
    """2**x, elementwise, for a float32 tile inside a kernel.

    On GPU: PTX ``ex2.approx.ftz.f32`` as inline assembly (one MUFU op per element; results below 2**-126 flush to
    0, -inf gives 0, NaN stays NaN). ``jnp.exp2`` there lowers to libdevice's ``__nv_exp2f``; at the flash-attention
    forward's main shape the inline form measured 2% faster (benchmarks/results/attention-forward-floor-h100.json).
    Interpret mode (and other dtypes): ``jnp.exp2``."""
    if interpret or x.dtype != jnp.float32:
        return jnp.exp2(x)
    (out,) = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return out
