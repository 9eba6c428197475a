"""The Mosaic backend's last backward step on the K side, with dgamma from u: one Pallas-Triton kernel that reads
u and x once and writes dx and dgamma's column sums per row block.

  dx, dgamma_parts = finish_dx(u, x, coef_s, gamma_s, dh=None)   # dgamma = s · dgamma_parts.sum(0)

Shapes and units: u, x (M, K) in x's 16-bit dtype, dh (M, K) any float dtype; coef_s (M,) float32 =
s · r² · Σ_K(γ ⊙ u ⊙ x) / K per row; gamma_s (K,) float32 = s · γ. Out: dx = gamma_s ⊙ u − coef_s ⊙ x (+ dh),
rounded to x's dtype, and dgamma_parts (M / block_m, K) float32, row i holding Σ u ⊙ x over the i-th block of
block_m rows.

Why a kernel and not XLA: the fusion that finishes dx reads u and x anyway, and dgamma = s · Σ_M(u ⊙ x) needs the
same two tensors; given both as jnp expressions, XLA ran the column sum as a second fusion over them at 4096x4096
and 4096x2048 (74.0 and 35.2 µs against 25.0 and 11.6 for dx alone), though not at 8192x4096 (54.6 against 50.5).
Here each program loads a (block_m, block_k) tile of u and x once and writes dx's tile and the tile's column sums:
6MK bytes in all, the bytes of the dx fusion alone, at about 0.9x that fusion's speed (``block_sizes``). Runs where
the Mosaic kernels run (the GPU, or lowered for CUDA on a CPU inside ``backends.lowering_for_gpu()``), and in
interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu

__all__ = ["block_sizes", "finish_dx"]

_F32 = jnp.float32


def block_sizes(M: int, K: int) -> tuple[int, int]:
    """(block_m, block_k): 32 rows (16, or 8, where 32 does not divide M: the Mosaic kernels take any multiple of 8
    rows) by 128 columns (64 where 128 does not divide K).
    Measured on the H200 (``benchmarks/scripts/dx_finish_blocks.py``, dx_finish_blocks-h200-bfa708a.json, µs at
    4096x4096 / 8192x4096 / 4096x2048): 32x128 with 4 warps 28.2 / 55.4 / 14.0, 64x256 29.0 / 60.5 / 15.3, the
    best of the other eight 28.4 / 56.0 / 13.8; XLA's fusion of dx alone 25.0 / 50.5 / 11.6, and of dx with the
    column sum 74.0 / 54.6 / 35.2. ValueError naming the dimension when none divides."""
    block_m = next((b for b in (32, 16, 8) if M % b == 0), None)
    block_k = next((b for b in (128, 64) if K % b == 0), None)
    if block_m is None or block_k is None:
        raise ValueError(f"finish_dx: M={M} must be a multiple of 8 and K={K} a multiple of 64 (the kernel's "
                         f"tiles); the Mosaic GEMMs' tiles already make them so")
    return block_m, block_k


def _kernel(u_ref, x_ref, coef_ref, gamma_ref, *refs, block_m: int, block_k: int, has_dh: bool):
    dh_ref, (dx_ref, parts_ref) = (refs[0] if has_dh else None), refs[-2:]
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(i * block_m, block_m), pl.ds(j * block_k, block_k)
    u = u_ref[rows, cols].astype(_F32)
    x = x_ref[rows, cols].astype(_F32)
    dx = gamma_ref[cols][None, :] * u - coef_ref[rows][:, None] * x
    if has_dh:
        dx = dx + dh_ref[rows, cols].astype(_F32)
    dx_ref[rows, cols] = dx.astype(dx_ref.dtype)
    parts_ref[pl.ds(i, 1), cols] = jnp.sum(u * x, axis=0)[None, :]


def finish_dx(u: jax.Array, x: jax.Array, coef_s: jax.Array, gamma_s: jax.Array, dh: jax.Array | None = None, *,
              blocks: tuple[int, int] | None = None, num_warps: int = 4,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(dx (M, K) in x's dtype, dgamma_parts (M / block_m, K) float32); see the module docstring. ``blocks``:
    (block_m, block_k), powers of two dividing M and K (default ``block_sizes``)."""
    M, K = x.shape
    for name, a, shape in (("u", u, (M, K)), ("coef_s", coef_s, (M,)), ("gamma_s", gamma_s, (K,)),
                           ("dh", dh, (M, K))):
        if a is not None and tuple(a.shape) != shape:
            raise ValueError(f"finish_dx: {name} must have shape {shape} (x is {(M, K)}), got {tuple(a.shape)}")
    block_m, block_k = block_sizes(M, K) if blocks is None else blocks
    if M % block_m or K % block_k:
        raise ValueError(f"finish_dx: blocks={(block_m, block_k)} must divide (M, K) = {(M, K)}")
    kernel = functools.partial(_kernel, block_m=block_m, block_k=block_k, has_dh=dh is not None)
    call = tu.pallas_call(
        kernel, num_warps=num_warps, num_stages=1, interpret=interpret, grid=(M // block_m, K // block_k),
        out_shape=[jax.ShapeDtypeStruct((M, K), x.dtype), jax.ShapeDtypeStruct((M // block_m, K), _F32)],
        name="rmsnorm_matmul_dx_finish")
    with tu.quiet_triton_deprecation():
        return tuple(call(u, x, coef_s.astype(_F32), gamma_s.astype(_F32), *([] if dh is None else [dh])))
