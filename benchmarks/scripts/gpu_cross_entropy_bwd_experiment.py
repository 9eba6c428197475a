"""On the H100: where the fused cross-entropy's backward loses time to XLA's, tried variant by variant.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_cross_entropy_bwd_experiment.py --out $OUT

The backward (``pallas_kernels.cross_entropy._backward``) walks the vocabulary in chunks: a Pallas kernel writes
dlogits (B, chunk), then dw[:, chunk] = hᵀ dlogits and dh += dlogits w_chunkᵀ run as XLA GEMMs. The last chunk
starts at V − chunk, and the columns it shares with the chunk before are zeroed in its copy of w for the dh GEMM.
Until commit 6f1b41b that zeroing was a select inside the loop, so XLA ran it at every step (a loop fusion of ~1.1 ms
per call at 8192x4096x128256, cross_entropy-h100.json). Variants:

  committed   the library's _backward as it is when the script runs
  peel_last   full steps in the loop, the clamped last step after it with the select
  peel_first  the clamped step first, outside the loop: its GEMM initializes dh (no add, so no second buffer), then
              the full steps accumulate in place

Each variant is timed on fwd+bwd (device-kernel time, per-kernel breakdown), with its error against the float32
reference and its temp memory. Writes $OUT/cross_entropy-bwd-peel-experiment-<device tag>.json.

Results (H100, commit 6f1b41b, where "committed" was the select in the loop;
benchmarks/results/cross_entropy-bwd-peel-experiment-h100.json), fwd+bwd µs and temp MiB:

  shape (B x H x V)      select in loop     peel_last          peel_first
  8192 x 4096 x 128256   56095  216         56483  340         55754  216
  16384 x 4096 x 32000   27409  308         27064  562         26854  308
  4096 x 2048 x 256000   29346  139         29010  196         29062  139

peel_first is faster than the select in the loop everywhere, within 0.2% of peel_last, with the select's memory:
it is the library's _backward since. (An earlier version of this script, commit 6d69cd0, compared a float32 vs bf16
dw output and two forward tilings: cross_entropy-bwd-experiment-h100.json; its winner, the bf16 output, is the
library's too.)
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


def make_backward(order: str):
    """cross_entropy._backward with the clamped last step peeled out of the loop: after it ("last") or before it
    ("first")."""
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
        num_steps = pl.cdiv(V, chunk)
        precision = lax.Precision.HIGHEST if h.dtype == jnp.float32 else lax.Precision.DEFAULT

        def step(i, carry, *, clamped: bool):
            dh, dw = carry
            v0 = V - chunk if clamped else i * chunk
            w_chunk = lax.dynamic_slice_in_dim(w, v0, chunk, axis=1)
            dl = ce._dlogits(h, w_chunk, labels - v0, lse, g, st)
            dw_chunk = lax.dot_general(h, dl, (((0,), (0,)), ((), ())), precision=precision,
                                       preferred_element_type=w.dtype)
            shared = (num_steps - 1) * chunk - (V - chunk)  # columns the clamped step shares with a full step
            if clamped and shared:
                new_cols = jnp.arange(chunk, dtype=jnp.int32) >= shared
                w_chunk = jnp.where(new_cols[None, :], w_chunk, jnp.zeros((), w.dtype))
            update = lax.dot_general(dl, w_chunk, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)
            dh = update if dh is None else dh + update
            return dh, lax.dynamic_update_slice_in_dim(dw, dw_chunk, v0, axis=1)

        full = functools.partial(step, clamped=False)
        dw = jnp.zeros((H, V), w.dtype)
        if order == "last":
            carry = lax.fori_loop(0, num_steps - 1, full, (jnp.zeros((B, H), jnp.float32), dw))
            dh, dw = step(num_steps - 1, carry, clamped=True)
        else:
            carry = step(num_steps - 1, (None, dw), clamped=True)
            dh, dw = lax.fori_loop(0, num_steps - 1, full, carry)
        return dh.astype(h.dtype), dw

    return backward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--small", action="store_true",
                        help="a CPU check of the script: B, H, V = 300, 64, 1000 with 256-column chunks")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    from jaxfuse import bench
    from jaxfuse.suites import cross_entropy as suite
    from pallas_kernels import cross_entropy as ce
    from pallas_kernels import triton_utils

    committed = ce._backward
    variants = {"committed": committed, "peel_last": make_backward("last"), "peel_first": make_backward("first")}
    shapes = {"8k_128k": (8192, 4096, 128256), "16k_32k": (16384, 4096, 32000), "4k_256k": (4096, 2048, 256000)}
    block_sizes = None
    if args.small:
        shapes, block_sizes = {"small": (300, 64, 1000)}, {"chunk_v": 256}
    loss = functools.partial(ce.linear_cross_entropy, block_sizes=block_sizes)
    results = []
    for shape_name, (B, H, V) in shapes.items():
        inputs = suite.make_inputs(B, H, V)
        ref = suite._reference(*inputs)
        log(f"{shape_name}: reference ready")
        for variant, backward in variants.items():
            ce._backward = backward
            try:
                fn = jax.jit(jax.value_and_grad(lambda h, w, y: loss(h, w, y), argnums=(0, 1)))
                with triton_utils.quiet_triton_deprecation():
                    compiled = fn.lower(*inputs).compile()
                    temp = compiled.memory_analysis().temp_size_in_bytes
                    value, (dh, dw) = jax.block_until_ready(fn(*inputs))
                    errors = {"loss": suite._rel_error(value, ref[0]), "dh": suite._rel_error(dh, ref[1]),
                              "dw": suite._rel_error(dw, ref[2])}
                    del value, dh, dw
                    timing = bench.time_kernels(fn, [inputs], iterations=args.iterations)
                row = dict(shape=shape_name, variant=variant, time_us=timing.median_us, timing=timing.method,
                           temp_mib=round(temp / 2**20, 2), errors=errors, spread=round(timing.spread, 3),
                           per_kernel_us=dict(sorted(timing.per_kernel_us.items(), key=lambda kv: -kv[1])))
                log(f"{shape_name} {variant}: {timing.median_us:.1f} µs ({timing.method}), "
                    f"temp {row['temp_mib']} MiB, errors {errors}")
                for name, us in list(row["per_kernel_us"].items())[:6]:
                    print(f"      {name:<60} {us:9.1f}", flush=True)
            except Exception:  # noqa: BLE001
                row = dict(shape=shape_name, variant=variant, error=traceback.format_exc())
                log(f"{shape_name} {variant} FAILED\n{row['error'][-1500:]}")
            finally:
                ce._backward = committed
            results.append(row)
        del inputs, ref
    env = bench.environment()
    path = os.path.join(args.out, f"cross_entropy-bwd-peel-experiment-{bench.device_tag(env['device'])}.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "results": results}, f, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
