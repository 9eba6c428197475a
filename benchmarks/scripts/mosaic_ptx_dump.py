"""The PTX of the rmsnorm_matmul forward under named variants, as Mosaic hands it to ptxas, with ptxas's log: for
reading what ptxas does with a kernel on any machine that has a ptxas, no GPU needed there. The PTX is version 9.0
(jax 0.11.2's Mosaic on the H200): ptxas 13.x reads it (12.9 refuses it) and gives the device's warnings;
``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, 13.5: ``pip download --no-deps nvidia-cuda-nvdisasm``, unzip)
prints the SASS.

    PYTHONPATH=$PWD python benchmarks/scripts/mosaic_ptx_dump.py --out $OUT \
        [--shapes 32768x4096x4096,4096x4096x14336] [--variants default,fwd_sk0]      # on an sm90 GPU
    tar xzf $OUT/mosaic_ptx_dump-<device>.tar.gz && ptxas -arch=sm_90a -v SHAPE-VARIANT/*.ptx -o k.cubin
    nvdisasm -c k.cubin | grep -c WARPGROUP.DEPBAR    # SASS: a wait after every HGMMA is a serialized K loop

Variants are those of ``rmsnorm_matmul_configs.VARIANTS`` (or "a+b" combinations) on the shape's tuned entry. Each
program is compiled (not run) with Mosaic's ``MOSAIC_GPU_DUMP_TO`` switch, which writes the kernel's PTX, ptxas's
log and its resources into one folder per kernel (the MLIR pass log is left out). Writes
``mosaic_ptx_dump-<device>.tar.gz`` (a folder SHAPE-VARIANT per program) and ``mosaic_ptx_dump-<device>.json``
(ptxas's numbers per program, ``hlo_inspect.ptxas.parse``). How it served: NOTES.md, thirty-seventh session (ptxas
serializes the split store's wgmma only where the kernel has no stream-K phase; edits of the dumped PTX showed it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tarfile
import tempfile

import jax
import jax.numpy as jnp

from attention_fused_bwd import results_file
from hlo_inspect import ptxas
from jaxfuse import bench
from pallas_kernels.norm_matmul import mosaic as nm
from rmsnorm_matmul_configs import combined, variant_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", type=bench.shapes_arg("MxKxN"), default="32768x4096x4096,4096x4096x14336")
    parser.add_argument("--variants", default="default,fwd_sk0")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "mosaic_ptx_dump")
    archive = path.rsplit(".", 1)[0] + ".tar.gz"
    with tempfile.TemporaryDirectory() as root, tarfile.open(archive, "w:gz") as tar:
        for M, K, N in args.shapes:
            for variant in filter(None, args.variants.split(",")):
                name = f"{M}x{K}x{N}-{variant}"
                config = variant_config(M, K, N, combined(variant))
                folder = os.path.join(root, name)
                os.makedirs(folder)
                os.environ["MOSAIC_GPU_DUMP_TO"] = folder  # read by Mosaic at each kernel's compilation
                try:
                    S = jax.ShapeDtypeStruct
                    jax.jit(lambda x, g, w, c=config: nm.rmsnorm_matmul(
                        x, g, w, eps=1e-6, residual=None, out_dtype=x.dtype, interpret=False, config=c)).lower(
                        S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)).compile()
                finally:
                    del os.environ["MOSAIC_GPU_DUMP_TO"]
                files = sorted(f for f in os.listdir(folder) if not f.endswith(".mlir-passes.log"))
                log = "".join(open(os.path.join(folder, f)).read() for f in files if f.endswith(".ptxas"))
                kernels = [dict(dataclasses.asdict(k), serialized_wgmma=k.serialized_wgmma) for k in ptxas.parse(log)]
                for f in files:
                    tar.add(os.path.join(folder, f), arcname=f"{name}/{f}")
                result["timings"].append(dict(shape=f"{M}x{K}x{N}", variant=variant, config=config.to_dict(),
                                              files=files, kernels=kernels))
                print(name, [(k["name"], k["registers"], k["serialized_wgmma"]) for k in kernels], flush=True)
                save()
    print("wrote", path, "and", archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
