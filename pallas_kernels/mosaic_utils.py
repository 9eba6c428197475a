"""Small helpers shared by the Pallas Mosaic-GPU (Hopper) kernels, and the one jax-version shim.

  from pallas_kernels import mosaic_utils as mu
  call = mu.kernel(body, out_type=..., grid=(mu.num_sms(),), grid_names=("sm",), num_threads=3,
                   thread_name="wg", name="gemm")             # Lane lowering semantics, set explicitly
  tile = mu.load(x_smem, layout=mu.TILE)                       # a tile in the wgmma accumulator layout
  rows = mu.load(r_gmem.at[pl.ds(m0, 128)], layout=mu.ROWS)    # one value per accumulator row
  transforms = mu.smem_transforms(64, jnp.bfloat16)            # (8, 64) tiling + 128-byte swizzle for TMA/wgmma

One source runs on jax 0.10.2 (CPU, CI: lowering only) and 0.11.2 (the H100). What differs between them and
is used here, handled in this module only:
  - ``plgpu.load(ref, idx, *, layout)``: 0.10.2 requires ``idx``; 0.11 deprecates it (index the ref with
    ``ref.at[...]`` first). ``load`` passes ``()`` only where the signature has no default for it.
  - ``CompilerParams.lowering_semantics`` defaults to Lane in 0.10.2 and Warpgroup in 0.11: ``compiler_params``
    always sets Lane (explicit layouts: ``TILE``, ``ROWS``, ``COLS``).
  - ``plgpu.kernel`` takes ``out_type=`` / ``scratch_types=`` (0.11.2 removed ``out_shape``); both versions
    take ``kernel_name``.
Everything else used by the kernels (``emit_pipeline_warp_specialized``, ``nd_loop``, ``planar_snake``, ``wgmma``,
``transpose_ref``, TMA copies, barriers) has the same signature in both versions.

Nothing here is kernel-specific; no import-time side effects.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["COLS", "H100_SMEM_BYTES", "H100_SMS", "ROWS", "TILE", "compiler_params", "is_hopper", "kernel", "load",
           "num_sms", "smem_transforms"]

# Register layouts (Lane semantics): the wgmma accumulator layout of a (64·i, 8·j) tile, and the layouts of its
# row vectors (one value per accumulator row: a reduction over axis 1) and column vectors.
TILE = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)
COLS = plgpu.Layout.WGMMA.reduce(0)

H100_SMS = 132  # streaming multiprocessors of an H100 SXM: the persistent grid when lowering without a GPU
H100_SMEM_BYTES = 227 * 1024  # shared memory one block may use on sm90 (232448 bytes)


@functools.lru_cache(maxsize=None)
def _load_needs_index() -> bool:
    """True on jax 0.10.x, where ``plgpu.load``'s ``idx`` argument has no default."""
    idx = inspect.signature(plgpu.load).parameters["idx"]
    return idx.default is inspect.Parameter.empty


def load(ref, *, layout=None) -> jax.Array:
    """The whole of ``ref`` (SMEM, or GMEM for row/column vectors) as a register array in ``layout``."""
    if _load_needs_index():
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def compiler_params(**kwargs) -> plgpu.CompilerParams:
    """Mosaic-GPU compiler parameters with Lane lowering semantics set explicitly (the default changed in 0.11)."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, **kwargs)


def kernel(body, *, out_type, scratch_types=(), grid, grid_names, num_threads, thread_name, name: str,
           **params):
    """``plgpu.kernel`` with the arguments both supported jax versions accept; ``params`` go to CompilerParams."""
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names,
                        num_threads=num_threads, thread_name=thread_name, compiler_params=compiler_params(**params),
                        kernel_name=name)


def is_hopper(device=None) -> bool:
    """Whether ``device`` (default: the first device) is an NVIDIA GPU of compute capability 9.x (sm90)."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9")


def num_sms() -> int:
    """SMs of the default GPU (the size of a persistent grid); the H100's 132 when there is no GPU (lowering for
    CUDA on a CPU machine)."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return int(device.core_count)
    return H100_SMS


def smem_transforms(minor_elems: int, dtype) -> tuple:
    """TMA/wgmma shared-memory transforms for a tile whose minor (contiguous) dimension is ``minor_elems`` long:
    (8, s) tiling and an s-element swizzle, s = the largest swizzle (32, 64 or 128 bytes) the minor dim fills."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)
