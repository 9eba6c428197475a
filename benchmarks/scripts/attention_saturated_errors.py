"""dq, dk, dv of both attention backends and plain bf16 XLA against float64 on saturated inputs (q, k x 30), at T = 128,
256, 1024, H 64 / 128, three seeds: `PYTHONPATH=$PWD OUT=<dir> python benchmarks/scripts/attention_saturated_errors.py`
(GPU; reuses the tests' float64 reference)."""
import sys, os, json
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
from base_attention import float64_grads, fwd_bwd
import pallas_kernels
rows = []
for T in (128, 256, 1024):
    for H in (64, 128):
        for seed in (0, 1, 2):
            k = jax.random.split(jax.random.key(seed), 4)
            shape = (1, T, 4, H)
            q, kk = ((30.0 * jax.random.normal(k[i], shape, jnp.float32)).astype(jnp.bfloat16) for i in (0, 1))
            v, do = (jax.random.normal(k[i], shape, jnp.bfloat16) for i in (2, 3))
            want = float64_grads(q, kk, v, do, H ** -0.5)
            err = lambda g, w: float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))
            r = {"T": T, "H": H, "seed": seed}
            for be in ("mosaic", "triton"):
                got = fwd_bwd(lambda a, b, c: pallas_kernels.flash_attention(a, b, c, backend=be), q, kk, v, do)[1:]
                r[be] = [round(err(g, w), 5) for g, w in zip(got, want)]
            xla = fwd_bwd(lambda a, b, c: pallas_kernels.reference.attention(a, b, c), q, kk, v, do)[1:]
            r["xla_bf16"] = [round(err(g, w), 5) for g, w in zip(xla, want)]
            print(r, flush=True); rows.append(r)
json.dump({"commit": os.environ.get("JAXFUSE_COMMIT"), "rows": rows}, open(os.environ["OUT"] + "/saturated_small_t-h100.json", "w"), indent=1)
