"""The rmsnorm_matmul dx kernel at 32768x4096x4096 with parts of its fusion taken away (the probes
gemm.mosaic.PROBE_NO_HOOK / PROBE_NO_ROW_SUM / PROBE_NO_A_COPY, then PROBE_SNAKE / PROBE_FULL_GRID for its tile
order and grid: wrong outputs, timing only), beside the plain Mosaic core with the dx kernel's tiles and the core's
own default: all timed interleaved (CUPTI medians).

    git checkout dx-probes-97d8421 -- pallas_kernels
    PYTHONPATH=$PWD python benchmarks/scripts/dx_probe_ab.py OUT

The probes exist only at that tag (NOTES.md, forty-ninth session); this script came after it. Writes
``<OUT>/probe_ab-<device>.json`` (``probe_ab_dx_order-h200-97d8421.json``)."""
import dataclasses, functools, sys, json
sys.path.insert(0, __import__("os").path.dirname(__file__))
import jax, jax.numpy as jnp
from attention_fused_bwd import results_file
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from pallas_kernels.gemm import mosaic as gm
from pallas_kernels.gemm.mosaic import gemm
from pallas_kernels.gemm import default_config
from pallas_kernels.norm_matmul import rmsnorm_matmul
from rmsnorm_matmul_configs import combined, variant_config

def _program(x, gamma, w, dy, config=None):
    y, vjp = jax.vjp(lambda x, gamma, w: rmsnorm_matmul(x, gamma, w, backend="mosaic", block_sizes=config), x, gamma, w)
    return y, vjp(dy)

P3 = dict(PROBE_NO_HOOK=True, PROBE_NO_ROW_SUM=True, PROBE_NO_A_COPY=True)
SETTINGS = [("entry", {}), ("no_hook_rowsum_acopy", P3), ("+snake", dict(P3, PROBE_SNAKE=True)),
            ("+full_grid", dict(P3, PROBE_FULL_GRID=True)), ("+snake+full_grid", dict(P3, PROBE_SNAKE=True, PROBE_FULL_GRID=True))]
NAMES = ["PROBE_NO_HOOK", "PROBE_NO_ROW_SUM", "PROBE_NO_A_COPY", "PROBE_SNAKE", "PROBE_FULL_GRID"]
out = sys.argv[1]
M, K, N = 32768, 4096, 4096
result, save, path = results_file(out, "probe_ab")
operands = suite.make_inputs(M, K, N, seed=1)
config = variant_config(M, K, N, combined("default"))
compiled = []
for name, knobs in SETTINGS:
    for n in NAMES:
        setattr(gm, n, knobs.get(n, False))
    jax.clear_caches()
    compiled.append((jax.jit(functools.partial(_program, config=config)).lower(*operands).compile(), operands))
for n in NAMES:
    setattr(gm, n, False)
dy, w = operands[3], operands[2]
core_cfgs = {"core_dx_tiles": dataclasses.replace(config.dx, tile_input_in="buffer"),
             "core_auto": default_config(M, K, N)}
for cname, ccfg in core_cfgs.items():
    fn = jax.jit(lambda dy, w, ccfg=ccfg: gemm(dy, w, transpose_b=True, config=ccfg, out_dtype=jnp.bfloat16)[0])
    compiled.append((fn.lower(dy, w).compile(), (dy, w)))
timed = bench.time_interleaved(compiled, iterations=20)
row = dict(shape="32768x4096x4096", settings={})
for name, t in zip([s[0] for s in SETTINGS] + list(core_cfgs), timed):
    row["settings"][name] = dict(us=t.median_us, kernels=t.per_kernel_us)
    print(name, round(t.median_us, 1), {k: round(v, 1) for k, v in t.per_kernel_us.items() if "mosaic" in k}, flush=True)
result["timings"].append(row)
save()
print("wrote", path)
