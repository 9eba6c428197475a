"""The GEMM kernels XLA's autotuner picked for the rmsnorm_matmul suite's XLA baselines: per fusion, its Triton tiles
(``triton_gemm_config``) or the cuBLAS custom call, read from the compiled program's optimized HLO.

    PYTHONPATH=$PWD python benchmarks/scripts/xla_gemm_configs.py --out $OUT \
        [--shapes 1x4096x14336-decode,16x4096x4096-decode] [--impls xla,xla_matmul_alone] [--modes fwd,fwd+bwd]

What the baseline's kernels are made of is what ours are measured against: a GEMV XLA runs at 3.9 TB/s with tiles
our sweep did not try, say. Writes ``xla_gemm_configs-<device>.json``: per shape, implementation and mode, a list of
{"fusion", "kind" ("triton" or "cublas"), "config" (the backend config's GEMM fields)}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import jax

from attention_fused_bwd import recorded_row, results_file
from jaxfuse.suites import rmsnorm_matmul as suite

# One HLO instruction line: "%name = type fusion(...), kind=kCustom, calls=..., backend_config={...}".
_FUSION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bbackend_config=(\{.*\})\s*$")


def gemm_kernels(hlo_text: str) -> list[dict]:
    """The GEMM kernels of an optimized HLO module: Triton GEMM fusions with their tiles, cuBLAS custom calls."""
    kernels = []
    for line in hlo_text.splitlines():
        match = _FUSION.match(line)
        if match is None:
            continue
        name, config_text = match.groups()
        try:
            config = json.loads(config_text)
        except json.JSONDecodeError:
            continue
        fusion = config.get("fusion_backend_config", {})
        if fusion.get("kind", "").startswith("__triton") and "gemm" in fusion["kind"]:  # "__triton_gemm", or
            # "__triton_nested_gemm_fusion" (not the "__triton" reductions and loops)
            kernels.append(dict(fusion=name, kind="triton", config={k: v for k, v in fusion.items() if k != "kind"},
                                triton_kind=fusion["kind"]))
        elif "gemm_backend_config" in config:
            gemm = config["gemm_backend_config"]
            kernels.append(dict(fusion=name, kind="cublas", config={
                k: gemm[k] for k in ("selected_algorithm", "alpha_real", "beta", "epilogue") if k in gemm}))
    return kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="1x4096x14336-decode,16x4096x4096-decode")
    parser.add_argument("--impls", default="xla,xla_matmul_alone")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    args = parser.parse_args()
    spec = suite.SPEC
    impls = spec.implementations()
    unknown = sorted(set(args.impls.split(",")) - set(impls))
    if unknown:
        parser.error(f"--impls: unknown {', '.join(unknown)}; known: {', '.join(impls)}")
    result, save, path = results_file(args.out, "xla_gemm_configs")
    for name in args.shapes.split(","):
        shape = suite.SHAPES[name]
        row = dict(shape=name, M=shape["M"], K=shape["K"], N=shape["N"])
        with recorded_row(result, save, row):
            inputs = spec.make_inputs(shape, 0)
            for impl in args.impls.split(","):
                for mode in args.modes.split(","):
                    args_ = inputs[:spec.num_args] if mode == "fwd" else inputs
                    text = jax.jit(spec.program(impls[impl], mode, shape, {})).lower(*args_).compile().as_text()
                    row.setdefault(impl, {})[mode] = gemm_kernels(text)
                    if not row[impl][mode]:  # a format this reader does not know: keep the lines to read
                        row.setdefault("unread", {})[f"{impl} {mode}"] = [
                            line.strip()[:3000] for line in text.splitlines() if "gemm" in line and "= " in line]
                    print(name, impl, mode, json.dumps(row[impl][mode]), flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
