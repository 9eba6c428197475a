"""The Mosaic backend's last backward step where XLA runs the dw GEMM (``dw_by_xla``): one Pallas-Triton kernel
that reads the GEMM's float32 products once, sums them and writes both dw and dgamma.

  g = dot(xr split into P row blocks, dy split the same way)   # (P, K, N) float32, P partial products over M
  dw, dgamma = finish_dw(g, w, gamma, scale)

Shapes and units: g (P, K, N) float32, P >= 1 partial sums of xrᵀ @ dy (or xᵀ @ dyr), the dw GEMM before gamma,
each over a block of M's rows (a (K, N) g is P = 1); w (K, N) and gamma (K,) the layer's parameters in their own
dtypes; scale (1,) float32, the s of ``norm_matmul.mosaic`` (1 for bfloat16, max r for float16). Out: with
G = Σ_P g, dw = (s · gamma) ⊙ G over the rows, in w's dtype, and dgamma = s · Σ_N(G ⊙ w) per row, in gamma's dtype.

Why a kernel and not XLA: at these small outputs XLA splits the GEMM's M reduction in two itself (cuBLAS writes
(2, K, N) float32), and then ran dw and dgamma as two fusions, each summing the two halves again (4.00 and 3.01 µs
at 512x2816 on the H200, 2.98 and 2.08 at 512x768 with the sum as a third: ``toggle_ab_dw_finish-h200-35b3731``).
Here the split is ours and each program owns ``block_k`` whole rows of N columns (N padded to a power of two
and masked), so g, w and dw move once and nothing is left to sum: forward + backward 127.9 → 126.1 µs at
8192x512x2816 (``toggle_ab_dw_finish_split-h200-75f7159.json``). Alone, with g in L2, it is slower than XLA's single
fusion of the same work (4.03 against 3.26 µs at 512x2816, ``dw_finish_blocks-h200-75f7159.json``), and at
8192x512x768 the split of our own made XLA pick a slower GEMM: so it is a per-entry choice,
``MosaicRMSNormMatmulConfig.dw_finish_kernel``. Runs where the Mosaic kernels run (the GPU, or lowered for CUDA on
a CPU inside ``backends.lowering_for_gpu()``), and in interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu

__all__ = ["MAX_N", "block_sizes", "finish_dw"]

_F32 = jnp.float32
MAX_N = 16384  # widest row a program holds (N padded to a power of two); wider rows stay with XLA's fusions
_ELEMENTS = 4096  # about this many elements of each operand a program (block_k rows times the padded N)


def block_sizes(K: int, N: int) -> tuple[int, int]:
    """(block_k, block_n): block_n = N rounded up to a power of two (masked past N), block_k the largest power of
    two dividing K with block_k · block_n <= 4096 (at least 1): one row a program at 512x2816, 4 at 512x768.
    ValueError naming N above MAX_N."""
    if not 0 < N <= MAX_N:
        raise ValueError(f"finish_dw: N={N} must be in [1, {MAX_N}] (one program holds whole rows); wider dw "
                         f"outputs stay with XLA's fusions")
    block_n = 1 << (N - 1).bit_length()
    block_k = 1
    while K % (2 * block_k) == 0 and 2 * block_k * block_n <= _ELEMENTS:
        block_k *= 2
    return block_k, block_n


def _kernel(g_ref, w_ref, gamma_ref, scale_ref, dw_ref, dgamma_ref, *, parts: int, block_k: int, block_n: int,
            n: int):
    i = pl.program_id(0)
    rows, cols = pl.ds(i * block_k, block_k), pl.ds(0, block_n)
    mask = (lax.broadcasted_iota(jnp.int32, (block_k, block_n), 1) < n) if block_n != n else None
    total = None
    for p in range(parts):  # (an int index does not discharge in interpret mode: a slice of one)
        part = tu.load(g_ref, (pl.ds(p, 1), rows, cols), mask=mask).reshape(block_k, block_n)
        total = part if total is None else total + part
    scale = scale_ref[pl.ds(0, 1)]  # (1,)
    gamma_s = gamma_ref[rows].astype(_F32) * scale  # (block_k,)
    tu.store(dw_ref, (rows, cols), (total * gamma_s[:, None]).astype(dw_ref.dtype), mask=mask)
    products = total * tu.load(w_ref, (rows, cols), mask=mask).astype(_F32)  # (0 past N)
    dgamma_ref[rows] = (jnp.sum(products, axis=1) * scale).astype(dgamma_ref.dtype)


def finish_dw(g: jax.Array, w: jax.Array, gamma: jax.Array, scale: jax.Array, *, block_k: int | None = None,
              num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(dw (K, N) in w's dtype, dgamma (K,) in gamma's dtype); see the module docstring. ``block_k``: rows a
    program, a power of two dividing K (default ``block_sizes``)."""
    K, N = w.shape
    g3 = g[None] if g.ndim == 2 else g
    for name, a, shape in (("g", g3, (g3.shape[0], K, N)), ("gamma", gamma, (K,)), ("scale", scale, (1,))):
        if a.ndim != len(shape) or tuple(a.shape) != shape:
            raise ValueError(f"finish_dw: {name} must have shape {'(P, K, N) or (K, N)' if name == 'g' else shape} "
                             f"(w is {(K, N)}), got {tuple((g if name == 'g' else a).shape)}")
    if g.dtype != _F32:
        raise ValueError(f"finish_dw: g must be float32 (the dw GEMM's products before gamma), got {g.dtype}")
    default_k, block_n = block_sizes(K, N)
    block_k = default_k if block_k is None else block_k
    if block_k < 1 or K % block_k or block_k & (block_k - 1):
        raise ValueError(f"finish_dw: block_k={block_k} must be a power of two dividing K={K}")
    kernel = functools.partial(_kernel, parts=g3.shape[0], block_k=block_k, block_n=block_n, n=N)
    call = tu.pallas_call(
        kernel, num_warps=num_warps, num_stages=1, interpret=interpret, grid=(K // block_k,),
        out_shape=[jax.ShapeDtypeStruct((K, N), w.dtype), jax.ShapeDtypeStruct((K,), gamma.dtype)],
        name="rmsnorm_matmul_dw_finish")
    with tu.quiet_triton_deprecation():
        return tuple(call(g3, w, gamma, scale.astype(_F32)))
