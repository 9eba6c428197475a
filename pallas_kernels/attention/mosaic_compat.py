"""TEMPORARY jax-version shim for the Mosaic-GPU attention forward (jax 0.10.2 on CPU/CI, 0.11.2 on the GPU).

This module exists only until ``pallas_kernels/mosaic_utils.py`` (the project's ONE narrow jax-version shim for
Pallas Mosaic GPU, written in parallel) lands: the lead folds these helpers into it at merge and deletes this file.
Nothing here is attention-specific.

What differs between the two versions, for the APIs the attention kernel uses:
  - ``plgpu.load(src, idx, *, layout, optimized)``: 0.10.2 requires ``idx``; 0.11 deprecates it (index the ref with
    ``ref.at[...]`` instead). ``load`` below never passes an index.
  - ``CompilerParams.lowering_semantics`` defaults to Lane in 0.10.2 and to Warpgroup in 0.11: ``compiler_params``
    always sets it.
Everything else the kernel calls (``plgpu.kernel(out_type=, scratch_types=)``, ``copy_gmem_to_smem`` without
``oob_mode``, ``copy_smem_to_gmem``, ``wait_smem_to_gmem(n, wait_read_only=)``, barriers, ``wgmma``, ``ACC``,
``layout_cast``, ``broadcasted_iota``, ``set_max_registers``, ``ref.transpose``) has the same signature in both.
"""

from __future__ import annotations

import inspect

from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["compiler_params", "load"]

# True where plgpu.load's index argument is still required (jax 0.10.2).
_LOAD_NEEDS_IDX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def load(ref, *, layout=None, optimized: bool = True):
    """The whole of ``ref`` (index it with ``ref.at[...]`` first) as an array in ``layout``; SMEM or GMEM."""
    if _LOAD_NEEDS_IDX:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def compiler_params(**kwargs) -> plgpu.CompilerParams:
    """``plgpu.CompilerParams`` with Lane lowering semantics (per-thread arrays in explicit layouts, as the kernels
    here are written), unless ``lowering_semantics`` is given."""
    kwargs.setdefault("lowering_semantics", plgpu.LoweringSemantics.Lane)
    return plgpu.CompilerParams(**kwargs)
