"""The Mosaic backend's last backward step where XLA runs the dw GEMM (``dw_by_xla``): one Pallas-Triton kernel
that reads the GEMM's float32 product g once and writes both dw and dgamma.

  dw, dgamma = finish_dw(g, w, gamma, scale)

Shapes and units: g (K, N) float32 = xrᵀ @ dy (or xᵀ @ dyr), the dw GEMM before gamma; w (K, N) and gamma (K,)
the layer's parameters in their own dtypes; scale (1,) float32, the s of ``norm_matmul.mosaic`` (1 for bfloat16,
max r for float16). Out: dw = (s · gamma) ⊙ g over the rows, in w's dtype, and dgamma = s · Σ_N(g ⊙ w) per row, in
gamma's dtype.

Why a kernel and not XLA: given the two as jnp expressions, XLA ran them as two fusions over g (the convert writing
dw, the row reduction for dgamma), each reading g's 4KN bytes: 2.98 and 4.02 µs at 512x2816 on the H200, beside a
1.17 µs kernel converting gamma to float32 (``rmsnorm_matmul-model_shapes_qkv_entry-h200-600d35d.json``,
8192x512x2816 forward + backward). Here each program owns ``block_k`` whole rows: it walks them across N in
``block_n``-wide column blocks, writes dw's blocks and keeps the products g ⊙ w, and writes the rows' dgamma at the
end, so g, w and dw move once (4KN + 2KN + 2KN bytes) and nothing is left to sum. Runs where the Mosaic kernels
run (the GPU, or lowered for CUDA on a CPU inside ``backends.lowering_for_gpu()``), and in interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu

__all__ = ["block_sizes", "finish_dw"]

_F32 = jnp.float32


def block_sizes(K: int, N: int) -> tuple[int, int]:
    """(block_k, block_n): 4 rows (2, then 1, where 4 does not divide K) by 256 columns (128, then 64, where 256
    does not divide N): K / 4 programs, 128 at the small preset's K = 512, about one per SM. ValueError naming N
    when no column block divides it."""
    block_k = next(b for b in (4, 2, 1) if K % b == 0)
    block_n = next((b for b in (256, 128, 64) if N % b == 0), None)
    if block_n is None:
        raise ValueError(f"finish_dw: N={N} must be a multiple of 64 (the kernel's column blocks); the Mosaic GEMMs' "
                         f"tiles already make it so")
    return block_k, block_n


def _kernel(g_ref, w_ref, gamma_ref, scale_ref, dw_ref, dgamma_ref, *, block_k: int, block_n: int, n_blocks: int):
    rows = pl.ds(pl.program_id(0) * block_k, block_k)
    scale = scale_ref[pl.ds(0, 1)]  # (1,)
    gamma_s = gamma_ref[rows].astype(_F32) * scale  # (block_k,)

    def column_block(j, products):
        cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
        g = g_ref[rows, cols]
        dw_ref[rows, cols] = (g * gamma_s[:, None]).astype(dw_ref.dtype)
        return products + g * w_ref[rows, cols].astype(_F32)

    products = lax.fori_loop(0, n_blocks, column_block, jnp.zeros((block_k, block_n), _F32))
    dgamma_ref[rows] = (jnp.sum(products, axis=1) * scale).astype(dgamma_ref.dtype)


def finish_dw(g: jax.Array, w: jax.Array, gamma: jax.Array, scale: jax.Array, *,
              blocks: tuple[int, int] | None = None, num_warps: int = 4, num_stages: int = 2,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(dw (K, N) in w's dtype, dgamma (K,) in gamma's dtype); see the module docstring. ``blocks``: (block_k,
    block_n), powers of two dividing K and N (default ``block_sizes``)."""
    K, N = w.shape
    for name, a, shape in (("g", g, (K, N)), ("gamma", gamma, (K,)), ("scale", scale, (1,))):
        if tuple(a.shape) != shape:
            raise ValueError(f"finish_dw: {name} must have shape {shape} (w is {(K, N)}), got {tuple(a.shape)}")
    if g.dtype != _F32:
        raise ValueError(f"finish_dw: g must be float32 (the dw GEMM's product before gamma), got {g.dtype}")
    block_k, block_n = block_sizes(K, N) if blocks is None else blocks
    if K % block_k or N % block_n:
        raise ValueError(f"finish_dw: blocks={(block_k, block_n)} must divide (K, N) = {(K, N)}")
    kernel = functools.partial(_kernel, block_k=block_k, block_n=block_n, n_blocks=N // block_n)
    call = tu.pallas_call(
        kernel, num_warps=num_warps, num_stages=num_stages, interpret=interpret, grid=(K // block_k,),
        out_shape=[jax.ShapeDtypeStruct((K, N), w.dtype), jax.ShapeDtypeStruct((K,), gamma.dtype)],
        name="rmsnorm_matmul_dw_finish")
    with tu.quiet_triton_deprecation():
        return tuple(call(g, w, gamma, scale.astype(_F32)))
