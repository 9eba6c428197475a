"""The rmsnorm_matmul dx kernel with its row sum's wait, finish and store deferred under the next tile's first wgmmas
(variant "dx_defer", gemm.mosaic.DEFER_POLL_STEP / DEFER_PREFETCH_GAP), beside the entry and "dx_buf3": each setting
compiled, all timed interleaved (CUPTI medians), the largest output difference from the entry.

    git checkout dx-finish-deferred-measured-531b394 -- pallas_kernels benchmarks/scripts/rmsnorm_matmul_configs.py
    PYTHONPATH=$PWD python benchmarks/scripts/dx_finish_deferred_ab.py OUT [32768x4096x4096,...]

The form and its knobs exist only at that tag (NOTES.md, forty-ninth session: slower, removed); this script came
after it. Writes ``<OUT>/defer_ab-<device>.json`` (``defer_ab_dx_finish-h200-531b394.json``)."""
import dataclasses, functools, sys
sys.path.insert(0, __import__("os").path.dirname(__file__))
import jax
from attention_fused_bwd import results_file
from jaxfuse import bench
from jaxfuse.suites import rmsnorm_matmul as suite
from pallas_kernels.gemm import mosaic as gm
from pallas_kernels.norm_matmul import rmsnorm_matmul
from rmsnorm_matmul_configs import combined, variant_config

def _program(x, gamma, w, dy, config=None):
    y, vjp = jax.vjp(lambda x, gamma, w: rmsnorm_matmul(x, gamma, w, backend="mosaic", block_sizes=config), x, gamma, w)
    return y, vjp(dy)

SETTINGS = [("entry", "default", {}, {}), ("buf3", "dx_buf3", {}, {}), ("defer", "dx_defer", {}, {}),
            ("defer_d1", "dx_defer", dict(delay_release=1), {}),
            ("defer_p1_g2", "dx_defer", {}, dict(DEFER_POLL_STEP=1, DEFER_PREFETCH_GAP=2)),
            ("defer_d1_p1_g2", "dx_defer", dict(delay_release=1), dict(DEFER_POLL_STEP=1, DEFER_PREFETCH_GAP=2)),
            ("defer_p2_g4", "dx_defer", {}, dict(DEFER_POLL_STEP=2, DEFER_PREFETCH_GAP=4))]
out = sys.argv[1]
shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["32768x4096x4096"]
result, save, path = results_file(out, "defer_ab")
for shape in shapes:
    M, K, N = map(int, shape.split("x"))
    operands = suite.make_inputs(M, K, N, seed=1)
    compiled = []
    for name, variant, dx_changes, knobs in SETTINGS:
        config = variant_config(M, K, N, combined(variant))
        config = dataclasses.replace(config, dx=dataclasses.replace(config.dx, **dx_changes))
        gm.DEFER_POLL_STEP, gm.DEFER_PREFETCH_GAP = knobs.get("DEFER_POLL_STEP", 0), knobs.get("DEFER_PREFETCH_GAP", 0)
        jax.clear_caches()
        compiled.append(jax.jit(functools.partial(_program, config=config)).lower(*operands).compile())
    ref = jax.tree.leaves(compiled[0](*operands))
    diffs = [bench.max_difference(zip(ref, jax.tree.leaves(fn(*operands)))) for fn in compiled]
    timed = bench.time_interleaved([(fn, operands) for fn in compiled], iterations=20)
    row = dict(shape=shape, settings={})
    for (name, variant, dx_changes, knobs), t, d in zip(SETTINGS, timed, diffs):
        row["settings"][name] = dict(variant=variant, dx_changes=dx_changes, knobs=knobs, us=t.median_us,
                                     max_abs_diff_vs_entry=d, kernels=t.per_kernel_us)
        dxk = {k: round(v, 1) for k, v in t.per_kernel_us.items() if "dx_mosaic" in k}
        print(shape, name, round(t.median_us, 1), dxk, "diff", d, flush=True)
    result["timings"].append(row)
    save()
print("wrote", path)
