"""The linear cross-entropy's dw update alone on the H100, dw (H, V) += h_cᵀ (H, Bc) @ dl_c (Bc, V) in a 4-step loop:
the Mosaic core with accumulate_into (c read, added, written) against the same tiles writing a fresh output (no c
read), cuBLAS with beta = 1 and without, at (2048, 256000, 512) and (4096, 32000, 1024); CUPTI µs per update and each
variant's costliest kernels (µs per call of 4 updates), twice, interleaved. Variants override the accumulating
default config:

    PYTHONPATH=$PWD OUT=DIR python benchmarks/scripts/cross_entropy_dw_update_c_read.py ["name:field=value;...,..."]

writes DIR/r/dw_update_probe.json. The loop's dw is not donated, so each call also copies dw once (the memcpy128
of the cuBLAS rows); the fresh-output variants add an (H, V) add (loop_add_fusion)."""
import dataclasses, json, os, sys
import jax, jax.numpy as jnp
from jaxfuse import bench
from pallas_kernels.gemm import matmul, default_config
STEPS = 4
out = {}
variants = sys.argv[1].split(",") if len(sys.argv) > 1 else []
for H, V, Bc in [(2048, 256000, 512), (4096, 32000, 1024)]:
    k = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(k[0], (STEPS * Bc, H), jnp.bfloat16)
    dl = (jax.random.normal(k[1], (STEPS * Bc, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    dws = [jax.random.normal(kk, (H, V), jnp.bfloat16) for kk in jax.random.split(k[2], 2)]
    base = default_config(H, V, Bc, jnp.bfloat16, accumulate_dtype=jnp.bfloat16)
    rows = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * Bc, Bc)
    def loop(update):
        return jax.jit(lambda h, dl, dw: jax.lax.fori_loop(0, STEPS, lambda i, dw: update(rows(h, i), rows(dl, i), dw), dw))
    cfgs = {"default": base}
    for v in variants:
        name, _, kv = v.partition(":")
        cfgs[name] = dataclasses.replace(base, **{a: (int(b) if b.isdigit() else b) for a, b in (p.split("=") for p in kv.split(";") if p)})
    fns = {}
    for name, cfg in cfgs.items():
        fns[f"acc_{name}"] = loop(lambda a, b, dw, cfg=cfg: matmul(a, b, transpose_a=True, accumulate_into=dw, config=cfg))
        if name == "default": fns[f"plain_{name}"] = loop(lambda a, b, dw, cfg=cfg: matmul(a, b, transpose_a=True, config=cfg, out_dtype=jnp.bfloat16) + 0 * dw[0, 0])
    fns["cublas_badd"] = loop(lambda a, b, dw: dw + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16))
    fns["cublas_plain"] = loop(lambda a, b, dw: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16) + 0 * dw[0, 0])
    res = {}
    for rep in range(2):
        for name, fn in fns.items():
            try:
                t = bench.time_kernels(fn, [(h, dl, dws[0]), (h, dl, dws[1])], iterations=10)
            except Exception as e:
                res[name] = str(e)[:300]; continue
            top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:3]
            res.setdefault(name, []).append({"us_per_update": t.median_us / STEPS, "top": top})
    key = f"{H}x{V}x{Bc}"
    out[key] = res
    for name, r in res.items():
        print(key, name, r if isinstance(r, str) else [(round(x["us_per_update"], 1), [(a[:30], round(b / STEPS, 1)) for a, b in x["top"]]) for x in r])
os.makedirs(os.environ["OUT"] + "/r", exist_ok=True)
json.dump({"environment": bench.environment() if hasattr(bench, "environment") else {}, "results": out, "cfgs": {k: str(v) for k, v in cfgs.items()}},
          open(os.environ["OUT"] + "/r/dw_update_probe.json", "w"), indent=1, default=str)
