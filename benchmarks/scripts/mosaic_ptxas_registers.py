"""Registers and spills of Mosaic-GPU kernels as ptxas reports them: the rmsnorm_matmul forward under named variants
of ``rmsnorm_matmul_configs.VARIANTS`` (or their "a+b" combinations), and the plain GEMM core under configs of
``mosaic_gemm_tiles.CONFIGS``.

    PYTHONPATH=$PWD python benchmarks/scripts/mosaic_ptxas_registers.py --out $OUT \
        [--shapes 4096x4096x14336,...] [--variants default,fwd_next_tile] [--configs 64x256_m_minor_m,...] \
        [--backward-variants default,row_dot_in_dx]

``--backward-variants``: the kernels of the variant's gradient program (dx, dw and the forward, each as ptxas reports
it; a kernel an earlier program of this process built already is not compiled again, so not listed).

Each program is compiled (not run) by ``hlo_inspect.ptxas.compile_report``, which reads ptxas's log through Mosaic's
``MOSAIC_GPU_DUMP_PTXAS`` switch: registers per thread (the launch's allocation under setmaxnreg), stack frame and
spill bytes, and ptxas's warnings (C7513: the kernel's wgmma serialized). Writes
``mosaic_ptxas_registers-<device>.json``. (The record at 003728a came from this script's first version, which
parsed the log itself: the same numbers, and the raw ptxas lines instead of the warnings.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from attention_fused_bwd import results_file
from hlo_inspect import ptxas
from jaxfuse import bench
from mosaic_gemm_tiles import CONFIGS
from pallas_kernels.gemm import matmul
from pallas_kernels.norm_matmul import mosaic as nm
from rmsnorm_matmul_configs import combined, variant_config


def report(fn, *args) -> dict:
    """ptxas's numbers for the one Mosaic-GPU kernel ``jax.jit(fn)`` builds for ``args``."""
    (kernel,) = ptxas.compile_report(fn, *args)
    return dict(dataclasses.asdict(kernel), serialized_wgmma=kernel.serialized_wgmma)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("MxKxN"), default="32768x4096x4096,4096x4096x14336")
    parser.add_argument("--variants", default="default,fwd_next_tile,mma_next_tile,gamma_a,gamma_a_next_tile")
    parser.add_argument("--configs", default="64x256_m_minor_m_delay1,64x256_m_minor_m_delay1_next_tile")
    parser.add_argument("--backward-variants", default="")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "mosaic_ptxas_registers")
    for M, K, N in args.shapes:
        shape = f"{M}x{K}x{N}"
        x, w = jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
        gamma = jax.ShapeDtypeStruct((K,), jnp.bfloat16)
        row = dict(shape=shape, forward={}, core={}, backward={})
        for variant in filter(None, args.variants.split(",")):
            config = variant_config(M, K, N, combined(variant))

            def fn(x, g, w, c=config):
                return nm.rmsnorm_matmul(x, g, w, eps=1e-6, residual=None, out_dtype=x.dtype, interpret=False,
                                         config=c)

            row["forward"][variant] = dict(config=config.to_dict(), **report(fn, x, gamma, w))
            print(shape, variant, {k: v for k, v in row["forward"][variant].items() if k != "config"}, flush=True)
        for variant in filter(None, args.backward_variants.split(",")):
            config = variant_config(M, K, N, combined(variant))

            def grads(x, g, w, dy, c=config):
                y, vjp = jax.vjp(lambda *a: nm.rmsnorm_matmul(*a, eps=1e-6, residual=None, out_dtype=x.dtype,
                                                              interpret=False, config=c), x, g, w)
                return vjp(dy)

            dy = jax.ShapeDtypeStruct((M, N), jnp.bfloat16)
            try:
                kernels = ptxas.compile_report(grads, x, gamma, w, dy)
            except ValueError as error:  # every kernel built before in this process
                row["backward"][variant] = dict(config=config.to_dict(), error=str(error))
            else:
                row["backward"][variant] = dict(config=config.to_dict(), kernels={
                    k.name: dict(dataclasses.asdict(k), serialized_wgmma=k.serialized_wgmma) for k in kernels})
            print(shape, variant, "backward", {k: v for k, v in row["backward"][variant].items() if k != "config"},
                  flush=True)
        for name in filter(None, args.configs.split(",")):
            row["core"][name] = report(lambda x, w, c=CONFIGS[name]: matmul(x, w, config=c), x, w)
            print(shape, name, row["core"][name], flush=True)
        result["timings"].append(row)
        save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
