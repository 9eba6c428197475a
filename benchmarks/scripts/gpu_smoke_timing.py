"""On the GPU machine: check the CUPTI timing path of jaxfuse.bench against the anchors (8192³ bf16 matmul
~805 TFLOP/s, elementwise x + 1 over 2 GiB ~2.94 TB/s) and print what it measured.

    PYTHONPATH=$PWD python benchmarks/scripts/gpu_smoke_timing.py
"""
import jax
import jax.numpy as jnp

from jaxfuse import bench

n = 8192
keys = jax.random.split(jax.random.key(0), 4)
a_sets = [(jax.random.normal(keys[i], (n, n), jnp.bfloat16), jax.random.normal(keys[i + 1], (n, n), jnp.bfloat16))
          for i in (0, 2)]
t = bench.time_kernels(jnp.matmul, a_sets, iterations=20)
print(f"matmul {n}^3 bf16: {t.median_us:.0f} us, {2 * n**3 / t.median_us / 1e6:.0f} TFLOP/s, kernels {t.per_kernel_us}, "
      f"spread {t.spread:.3f}")
x = jax.random.normal(keys[3], (2**30,), jnp.bfloat16)
t = bench.time_kernels(lambda v: v + 1, [(x,)], iterations=20)
print(f"x + 1 over 2 GiB bf16: {t.median_us:.0f} us, {2 * 2**31 / t.median_us / 1e6:.2f} TB/s, kernels "
      f"{list(t.per_kernel_us)}")
