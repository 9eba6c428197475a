"""The linear cross-entropy's dw update alone on the H100, dw (H, V) += h_cᵀ (H, Bc) @ dl_c (Bc, V) in a 4-step loop:
the Mosaic core with accumulate_into (c read, added, written) against the same tiles writing a fresh output (no c
read), cuBLAS with beta = 1 and without, at (2048, 256000, 512) and (4096, 32000, 1024); CUPTI µs per update and each
variant's costliest kernels (µs per call of 4 updates), twice, interleaved. Variants override the accumulating
default config:

    PYTHONPATH=$PWD OUT=DIR python benchmarks/scripts/cross_entropy_dw_update_c_read.py ["name:field=value;...,..."]

writes DIR/r/dw_update_probe.json. The loop's dw is not donated, so each call also copies dw once (the memcpy128
of the cuBLAS rows); the fresh-output variants add an (H, V) add (loop_add_fusion)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp

from jaxfuse import bench
from pallas_kernels.gemm import default_config, matmul

STEPS = 4  # chunk updates per timed call
SHAPES = [(2048, 256000, 512), (4096, 32000, 1024)]  # (H, V, Bc)


def parse_variants(arg: str) -> dict:
    """"name:field=value;field=value,..." -> {name: {field: value}} (ints where the value is digits)."""
    out = {}
    for item in filter(None, arg.split(",")):
        name, _, fields = item.partition(":")
        pairs = (p.split("=") for p in fields.split(";") if p)
        out[name] = {k: int(v) if v.isdigit() else v for k, v in pairs}
    return out


def update_loops(Bc: int, configs: dict) -> dict:
    """{name: jitted (h, dl, dw) -> dw after STEPS chunk updates}: the Mosaic update under each config ("acc_"),
    the default config writing a fresh output instead ("plain_": no c read; the scalar dw[0, 0] keeps dw a
    carry, at the cost of one (H, V) add per step), and cuBLAS with and without beta = 1."""
    rows = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * Bc, Bc)  # noqa: E731
    contract = (((0,), (0,)), ((), ()))

    def loop(update):
        return jax.jit(lambda h, dl, dw: jax.lax.fori_loop(
            0, STEPS, lambda i, dw: update(rows(h, i), rows(dl, i), dw), dw))

    fns = {}
    for name, config in configs.items():
        fns[f"acc_{name}"] = loop(lambda a, b, dw, c=config: matmul(a, b, transpose_a=True, accumulate_into=dw,
                                                                     config=c))
        if name == "default":
            fns["plain_default"] = loop(lambda a, b, dw, c=config: matmul(
                a, b, transpose_a=True, config=c, out_dtype=jnp.bfloat16) + 0 * dw[0, 0])
    fns["cublas_badd"] = loop(lambda a, b, dw: dw + jax.lax.dot_general(a, b, contract,
                                                                        preferred_element_type=jnp.bfloat16))
    fns["cublas_plain"] = loop(lambda a, b, dw: jax.lax.dot_general(a, b, contract,
                                                                    preferred_element_type=jnp.bfloat16) + 0 * dw[0, 0])
    return fns


def main() -> int:
    variants = parse_variants(sys.argv[1] if len(sys.argv) > 1 else "")
    out, configs = {}, {}
    for H, V, Bc in SHAPES:
        k = jax.random.split(jax.random.key(1), 3)
        h = jax.random.normal(k[0], (STEPS * Bc, H), jnp.bfloat16)
        dl = (jax.random.normal(k[1], (STEPS * Bc, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
        dws = [jax.random.normal(key, (H, V), jnp.bfloat16) for key in jax.random.split(k[2], 2)]
        base = default_config(H, V, Bc, jnp.bfloat16, accumulate_dtype=jnp.bfloat16)
        configs = {"default": base, **{n: dataclasses.replace(base, **f) for n, f in variants.items()}}
        fns = update_loops(Bc, configs)
        res = {}
        for _ in range(2):  # two passes over the variants, interleaved
            for name, fn in fns.items():
                try:
                    t = bench.time_kernels(fn, [(h, dl, dws[0]), (h, dl, dws[1])], iterations=10)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded
                    res[name] = f"{type(e).__name__}: {e}"[:300]
                    continue
                top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:3]
                res.setdefault(name, []).append({"us_per_update": t.median_us / STEPS, "top": top})
        key = f"{H}x{V}x{Bc}"
        out[key] = res
        for name, r in res.items():
            print(key, name, r if isinstance(r, str) else
                  [(round(x["us_per_update"], 1), [(a[:30], round(b / STEPS, 1)) for a, b in x["top"]]) for x in r])
    os.makedirs(os.environ["OUT"] + "/r", exist_ok=True)
    with open(os.environ["OUT"] + "/r/dw_update_probe.json", "w") as f:
        json.dump({"environment": bench.environment(), "results": out,
                   "cfgs": {k: str(v) for k, v in configs.items()}}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
