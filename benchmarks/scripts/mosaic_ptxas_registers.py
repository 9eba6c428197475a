"""Registers and spills of Mosaic-GPU kernels as ptxas reports them: the rmsnorm_matmul forward under named variants
of ``rmsnorm_matmul_configs.VARIANTS``, and the plain GEMM core under configs of ``mosaic_gemm_tiles.CONFIGS``.

    PYTHONPATH=$PWD python benchmarks/scripts/mosaic_ptxas_registers.py --out $OUT \
        [--shapes 4096x4096x14336,...] [--variants default,fwd_next_tile] [--configs 64x256_m_minor_m,...]

Each program is compiled (not run) with ``MOSAIC_GPU_DUMP_PTXAS=1``, Mosaic's switch that prints ptxas's log to
the process's stdout; the log is captured per program (file descriptor 1 redirected to a file) and its "Used N
registers", "N bytes stack frame" and "N bytes spill stores / loads" lines parsed. A kernel whose warpgroups raise
their registers with setmaxnreg is compiled for the launch's allocation; spill bytes there mean the MMA
warpgroups' values did not fit. Writes ``mosaic_ptxas_registers-<device>.json`` (the parsed numbers and the raw
ptxas lines of each program).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")  # before jax compiles anything

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from attention_fused_bwd import results_file  # noqa: E402
from mosaic_gemm_tiles import CONFIGS  # noqa: E402
from pallas_kernels.gemm import matmul  # noqa: E402
from pallas_kernels.norm_matmul import mosaic as nm  # noqa: E402
from rmsnorm_matmul_configs import VARIANTS, variant_config  # noqa: E402

_NUMBERS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame_bytes": re.compile(r"(\d+) bytes stack frame"),
    "spill_store_bytes": re.compile(r"(\d+) bytes spill stores"),
    "spill_load_bytes": re.compile(r"(\d+) bytes spill loads"),
}


@contextlib.contextmanager
def captured_stdout():
    """Everything written to file descriptor 1 (C++ included) while inside, as the yielded list's one string."""
    sys.stdout.flush()
    saved = os.dup(1)
    text = []
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield text
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            f.seek(0)
            text.append(f.read())


def ptxas_report(compile_fn) -> dict:
    """Compiles via ``compile_fn()`` and parses ptxas's log: the numbers of every kernel it reports, in order."""
    with captured_stdout() as text:
        compile_fn()
    lines = [line.strip() for line in text[0].splitlines() if "ptxas" in line or "bytes" in line]
    report = {name: [int(m) for m in pattern.findall(text[0])] for name, pattern in _NUMBERS.items()}
    report["lines"] = lines[:40]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="32768x4096x4096,4096x4096x14336")
    parser.add_argument("--variants", default="default,fwd_next_tile,mma_next_tile,gamma_a,gamma_a_next_tile")
    parser.add_argument("--configs", default="64x256_m_minor_m_delay1,64x256_m_minor_m_delay1_next_tile")
    args = parser.parse_args()
    result, save, path = results_file(args.out, "mosaic_ptxas_registers")
    for shape in args.shapes.split(","):
        M, K, N = map(int, shape.split("x"))
        x, w = jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
        gamma = jax.ShapeDtypeStruct((K,), jnp.bfloat16)
        row = dict(shape=shape, forward={}, core={})
        for variant in filter(None, args.variants.split(",")):
            config = variant_config(M, K, N, VARIANTS[variant])
            fn = jax.jit(lambda x, g, w, c=config: nm.rmsnorm_matmul(x, g, w, eps=1e-6, residual=None,
                                                                     out_dtype=x.dtype, interpret=False, config=c))
            row["forward"][variant] = dict(config=config.to_dict(), **ptxas_report(
                lambda fn=fn: fn.lower(x, gamma, w).compile()))
            print(shape, variant, {k: v for k, v in row["forward"][variant].items() if k not in ("lines", "config")},
                  flush=True)
        for name in filter(None, args.configs.split(",")):
            fn = jax.jit(lambda x, w, c=CONFIGS[name]: matmul(x, w, config=c))
            row["core"][name] = ptxas_report(lambda fn=fn: fn.lower(x, w).compile())
            print(shape, name, {k: v for k, v in row["core"][name].items() if k != "lines"}, flush=True)
        result["timings"].append(row)
        save()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
