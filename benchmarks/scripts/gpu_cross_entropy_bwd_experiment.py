"""On the H100: where the fused cross-entropy's backward loses time to XLA's, tried variant by variant.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_cross_entropy_bwd_experiment.py --out $OUT

The backward (``pallas_kernels.cross_entropy._backward``) walks the vocabulary in chunks: a Pallas kernel writes
dlogits (B, chunk), then dw[:, chunk] = hᵀ dlogits and dh += dlogits w_chunkᵀ run as XLA GEMMs. In the committed
run (cross_entropy-h100.json, 8192×4096×128256) the dw GEMM became a Triton GEMM fusion of 13.3 ms (its float32
output is rounded to bf16 inside the fusion) while XLA's own cuBLAS GEMMs of that size take 10.9 ms. Variants:

  f32_out   the committed code: dw GEMM accumulates into a float32 output, rounded to w.dtype afterwards
  bf16_out  dw GEMM returns w.dtype directly (the GEMM still accumulates in float32 inside; one rounding either way)

Each variant × forward config is timed on fwd+bwd (device-kernel time, per-kernel breakdown), with its error
against the float32 reference and its temp memory. Writes $OUT/cross_entropy-bwd-experiment-h100.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import traceback

START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def make_backward(dw_out_dtype_direct: bool):
    """A copy of cross_entropy._backward whose dw GEMM output dtype is the variable under test."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    from pallas_kernels import cross_entropy as ce

    @functools.partial(jax.jit, static_argnames="st")
    def backward(h, w, labels, lse, g, st):
        B, H = h.shape
        V = w.shape[1]
        chunk = st.config.chunk_v
        precision = lax.Precision.HIGHEST if h.dtype == jnp.float32 else lax.Precision.DEFAULT

        def body(i, carry):
            dh, dw = carry
            v0 = jnp.minimum(i * chunk, V - chunk)
            w_chunk = lax.dynamic_slice_in_dim(w, v0, chunk, axis=1)
            dl = ce._dlogits(h, w_chunk, labels - v0, lse, g, st)
            out_type = w.dtype if dw_out_dtype_direct else jnp.float32
            dw_chunk = lax.dot_general(h, dl, (((0,), (0,)), ((), ())), precision=precision,
                                       preferred_element_type=out_type).astype(w.dtype)
            new_cols = jnp.arange(chunk, dtype=jnp.int32) >= i * chunk - v0
            w_new = jnp.where(new_cols[None, :], w_chunk, jnp.zeros((), w.dtype))
            dh = dh + lax.dot_general(dl, w_new, (((1,), (1,)), ((), ())), precision=precision,
                                      preferred_element_type=jnp.float32)
            return dh, lax.dynamic_update_slice_in_dim(dw, dw_chunk, v0, axis=1)

        init = (jnp.zeros((B, H), jnp.float32), jnp.zeros((H, V), w.dtype))
        dh, dw = lax.fori_loop(0, pl.cdiv(V, chunk), body, init)
        return dh.astype(h.dtype), dw

    return backward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()

    import jax

    from jaxfuse import bench
    from jaxfuse.suites import cross_entropy as suite
    from pallas_kernels import cross_entropy as ce
    from pallas_kernels import triton_utils

    committed = ce._backward
    variants = {"f32_out": make_backward(False), "bf16_out": make_backward(True)}
    shapes = {"8k_128k": (8192, 4096, 128256), "16k_32k": (16384, 4096, 32000), "4k_256k": (4096, 2048, 256000)}
    fwd_configs = {"default": None, "fwd_bh128_s2": {"block_h": 128, "num_stages": 2},
                   "fwd_bb256_bv128": {"block_b": 256, "block_v": 128}}
    results = []
    for shape_name, (B, H, V) in shapes.items():
        inputs = suite.make_inputs(B, H, V)
        ref = suite._reference(*inputs)
        log(f"{shape_name}: reference ready")
        for variant, backward in variants.items():
            for cfg_name, cfg in fwd_configs.items():
                if shape_name != "8k_128k" and cfg_name != "default":
                    continue
                ce._backward = backward
                try:
                    loss = functools.partial(ce.linear_cross_entropy, block_sizes=cfg)
                    fn = jax.jit(jax.value_and_grad(lambda h, w, y: loss(h, w, y), argnums=(0, 1)))
                    with triton_utils.quiet_triton_deprecation():
                        compiled = fn.lower(*inputs).compile()
                        temp = compiled.memory_analysis().temp_size_in_bytes
                        value, (dh, dw) = jax.block_until_ready(fn(*inputs))
                        errors = {"loss": suite._rel_error(value, ref[0]), "dh": suite._rel_error(dh, ref[1]),
                                  "dw": suite._rel_error(dw, ref[2])}
                        del value, dh, dw
                        timing = bench.time_kernels(fn, [inputs], iterations=args.iterations)
                    row = dict(shape=shape_name, variant=variant, fwd_config=cfg_name, time_us=timing.median_us,
                               temp_mib=round(temp / 2**20, 1), errors=errors, spread=round(timing.spread, 3),
                               per_kernel_us=dict(sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])))
                    log(f"{shape_name} {variant} {cfg_name}: {timing.median_us:.1f} µs, temp {row['temp_mib']} MiB, "
                        f"errors {errors}")
                    for name, us in list(row["per_kernel_us"].items())[:6]:
                        print(f"      {name:<60} {us:9.1f}", flush=True)
                except Exception:  # noqa: BLE001
                    row = dict(shape=shape_name, variant=variant, fwd_config=cfg_name, error=traceback.format_exc())
                    log(f"{shape_name} {variant} {cfg_name} FAILED\n{row['error'][-1500:]}")
                finally:
                    ce._backward = committed
                results.append(row)
        del inputs, ref
    env = bench.environment()
    path = os.path.join(args.out, "cross_entropy-bwd-experiment-h100.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
