"""Who adds each token chunk's dw update, on the H100: cuBLAS with beta = 1 (``dw_gemm="xla"``) against the
Mosaic-GPU GEMM core updating dw in place with its tiles prefetched (``dw_gemm="mosaic"``), inside the fused linear
cross-entropy's value and gradient and alone, plain XLA's loss in the same run; and the evaluation loop's chunk.

    PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_dw_gemm.py --out $OUT [--shapes 8k_128k,4k_256k,16k_32k]
        [--sections update,loss,update_configs,eval,chunks,precision] [--eval-multipliers 1,2,4] [--chunks 256,512,1024]
        [--chunk-variants dh_xla,softmax_rows,...] [--wall]
        [--temp-fraction 0.05] [--dw-configs pingpong_128x128,...] [--logits-configs pingpong_128x128,...]

Per shape (bf16, the suite's inputs, the memory rule's chunk): (1) one chunk's dw update alone, dw (H, V) +=
h_cᵀ (H, Bc) @ dl_c (Bc, V), in a 4-step loop over fresh chunks (cuBLAS via XLA's fused add, and the Mosaic
kernel), µs per update, with the floor of its FLOPs (at 805 TFLOP/s) and of its bytes (dw read and written, the
chunk's dl read once: 2.94 TB/s); (2) value_and_grad of the loss: plain XLA's, the fused loss with cuBLAS's dw
update and with the Mosaic one (its default config, and each --dw-configs entry of UPDATE_CONFIGS), interleaved
(CUPTI medians and each run's costliest kernels), with each variant's largest difference of dw from the cuBLAS
variant's relative to the largest |dw|, and the temporaries of the first three; (3) "update_configs": the Mosaic
update alone under the GEMM configs of UPDATE_CONFIGS; (4) "eval": the loss alone (evaluation) with eval_chunk_rows
= m · Bc (at most B) for each multiplier m, against plain XLA's forward, interleaved; (5) "chunks": value and
gradient with each chunk_rows of --chunks (and the memory rule's), against plain XLA's, interleaved, with each
program's temporary memory (and each --chunk-variants entry of CHUNK_VARIANTS at each size: the dh GEMM on cuBLAS
or on other Mosaic tiles); (6) "precision": the largest errors of the loss, dh and dw against the float32
reference at the memory rule's chunk (and each --chunk-variants entry). Writes ``cross_entropy_dw_gemm-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import reference
from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench, kernels
from jaxfuse.suites.cross_entropy import SHAPES, make_inputs
from pallas_kernels.cross_entropy import config as ce_config
from pallas_kernels.cross_entropy import mosaic_logits
from pallas_kernels import gemm as mosaic_gemm
from pallas_kernels.gemm import default_config, matmul

PEAK_FLOPS, PEAK_BYTES = 805e12, 2.94e12  # shared/anchors.md: the H100's measured bf16 GEMM and copy rates
STEPS = 4
UPDATE_CONFIGS = {  # overrides of the accumulating default (3 stages of 128x256 blocks beside two dw tiles)
    "delay1": dict(delay_release=1),
    "64x256_m": dict(tile_m=64, tile_n=256, wg_split="m"),
    "minor_m": dict(grid_minor="m"),
    "k32_6stages": dict(tile_k=32, num_stages=6),
    "width16": dict(grid_tile_width=16),
    "width4": dict(grid_tile_width=4),
    # ping-pong (one warpgroup's epilogue, the read-add-store of its dw tile, under the other's K loop)
    "pingpong_128x128": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5),
    "pingpong_64x256": dict(tile_m=64, tile_n=256, schedule="pingpong", num_stages=4),
    "pingpong_128x128_w16": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5, grid_tile_width=16),
    "pingpong_128x128_minor_m": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5, grid_minor="m"),
    "pingpong_128x128_delay1": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5, delay_release=1),
    "pingpong_128x128_delay1_minor_m": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5,
                                            delay_release=1, grid_minor="m"),
    "pingpong_128x128_delay2_minor_m": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5,
                                            delay_release=2, grid_minor="m"),
    "pingpong_64x256_delay1_minor_m": dict(tile_m=64, tile_n=256, schedule="pingpong", num_stages=4,
                                           delay_release=1, grid_minor="m"),
    # clusters of two blocks: B's (dl's) tiles multicast along "m", A's (h_cᵀ's) along "n"
    "pingpong_128x128_delay1_minor_m_cluster_m": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5,
                                                      delay_release=1, grid_minor="m", cluster="m"),
    "pingpong_128x128_delay1_minor_m_cluster_n": dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5,
                                                      delay_release=1, grid_minor="m", cluster="n"),
    "cluster_m": dict(cluster="m"),
    "cluster_n": dict(cluster="n"),
    # 128x256 blocks (two accumulators) in clusters along M: L2 reads of operands per output element 2/3 of the
    # ping-pong 128x128 cluster's; 3 stages fit beside the two prefetched dw tiles
    "coop_128x256_cluster_m": dict(tile_m=128, tile_n=128, wg_split="n", schedule="cooperative", num_stages=3,
                                   delay_release=0, grid_minor="m", cluster="m"),
    "coop_128x256_cluster_m_delay1": dict(tile_m=128, tile_n=128, wg_split="n", schedule="cooperative",
                                          num_stages=3, delay_release=1, grid_minor="m", cluster="m"),
    "coop_128x256_cluster_m_minor_n": dict(tile_m=128, tile_n=128, wg_split="n", schedule="cooperative",
                                           num_stages=3, delay_release=0, grid_minor="n", cluster="m"),
    "stacked_64x256": dict(tile_m=64, tile_n=256, wg_split="m", schedule="cooperative", num_stages=3,
                           delay_release=0, grid_minor="m", cluster="none"),
    "stacked_64x256_cluster_m": dict(tile_m=64, tile_n=256, wg_split="m", schedule="cooperative", num_stages=3,
                                     delay_release=0, grid_minor="m", cluster="m"),
    "pingpong_k32_cluster_m": dict(tile_m=128, tile_n=128, tile_k=32, schedule="pingpong", num_stages=10,
                                   delay_release=1, grid_minor="m", cluster="m"),
    "pingpong_k128_cluster_m": dict(tile_m=128, tile_n=128, tile_k=128, schedule="pingpong", num_stages=2,
                                    delay_release=1, grid_minor="m", cluster="m"),
}


def dw_update_fns(H: int, V: int, Bc: int, config=None):
    """(xla, mosaic): dw after STEPS chunk updates dw += h_iᵀ dl_i, h (STEPS·Bc, H), dl (STEPS·Bc, V)."""
    def loop(update):
        def run(h, dl, dw):
            rows = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * Bc, Bc)  # noqa: E731
            return jax.lax.fori_loop(0, STEPS, lambda i, dw: update(rows(h, i), rows(dl, i), dw), dw)
        return jax.jit(run, donate_argnums=2)

    xla = loop(lambda h_c, dl_c, dw: dw + jax.lax.dot_general(h_c, dl_c, (((0,), (0,)), ((), ())),
                                                              preferred_element_type=dw.dtype))
    mosaic = loop(lambda h_c, dl_c, dw: matmul(h_c, dl_c, transpose_a=True, accumulate_into=dw, config=config))
    return {"xla": xla, "mosaic": mosaic}


def time_dw_update(H: int, V: int, Bc: int, iterations: int, configs=None) -> dict:
    """µs per update of cuBLAS and the Mosaic kernel (default config), or, with ``configs`` ({name: overrides}),
    of the Mosaic kernel under each."""
    keys = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(keys[0], (STEPS * Bc, H), jnp.bfloat16)
    dl = (jax.random.normal(keys[1], (STEPS * Bc, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    if configs is None:
        fns = dw_update_fns(H, V, Bc)
    else:
        base = default_config(H, V, Bc, jnp.bfloat16, accumulate_dtype=jnp.bfloat16)
        fns = {"default": dw_update_fns(H, V, Bc)["mosaic"]}
        fns.update({name: dw_update_fns(H, V, Bc, dataclasses.replace(base, **o))["mosaic"]
                    for name, o in configs.items()})
    out = {}
    want = None
    for name, fn in fns.items():
        dw = jax.random.normal(keys[2], (H, V), jnp.bfloat16)
        try:
            got = np.asarray(fn(h, dl, dw), np.float32)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
            continue
        want = got if want is None else want
        out[f"{name}_vs_xla_max_rel"] = float(np.abs(got - want).max() / np.abs(want).max())
        dws = [jax.random.normal(k, (H, V), jnp.bfloat16) for k in jax.random.split(keys[2], iterations + 4)]
        samples = []
        for i in range(iterations + 2):  # each call donates its dw: a fresh one per call
            t = bench.time_kernels(fn, [(h, dl, dws[i])], iterations=1, warmup=0, jit=False)
            if i >= 2:
                samples.append(t.median_us / STEPS)
        out[f"{name}_us_per_update"] = float(np.median(samples))
    flops, bytes_ = 2.0 * Bc * H * V, 2.0 * (2 * H * V + Bc * V)
    out.update(floor_flops_us=flops / PEAK_FLOPS * 1e6, floor_bytes_us=bytes_ / PEAK_BYTES * 1e6)
    return out


def loss_fns(labels, Bc: int, dw_configs=(), logits_configs=()):
    """value_and_grad of plain XLA's loss, of the fused loss with cuBLAS's dw update, and with the Mosaic update:
    the accumulating default config, and for each name of ``dw_configs`` that UPDATE_CONFIGS entry over it
    (``dw_mosaic_<name>``); each with cuBLAS's logits, and all but the XLA one also with the logits and their
    statistics from the Mosaic GEMM core (``*_stats``: ``logits_gemm="mosaic"``; ``dw_mosaic_stats_<name>``).
    Each jitted function is traced at its first call inside ``with_config``."""
    def fused(dw_gemm, overrides=None, logits_gemm="xla"):
        sizes = {"chunk_rows": Bc, "dw_gemm": dw_gemm, "logits_gemm": logits_gemm}
        fn = jax.jit(jax.value_and_grad(lambda h, w: pallas_kernels.linear_cross_entropy(
            h, w, labels, backend="triton", block_sizes=sizes), argnums=(0, 1)))
        return fn if overrides is None else with_config(fn, overrides)

    plain = jax.jit(jax.value_and_grad(lambda h, w: kernels.plain_cross_entropy(h, w, labels), argnums=(0, 1)))
    fns = {"xla_plain": plain, "dw_xla": fused("xla"), "dw_mosaic": fused("mosaic"),
           "dw_xla_stats": fused("xla", logits_gemm="mosaic"),
           "dw_mosaic_stats": fused("mosaic", logits_gemm="mosaic")}
    fns.update({f"dw_mosaic_{name}": fused("mosaic", UPDATE_CONFIGS[name]) for name in dw_configs})
    fns.update({f"dw_mosaic_stats_{name}": fused("mosaic", UPDATE_CONFIGS[name], logits_gemm="mosaic")
                for name in dw_configs})
    dw_auto = "mosaic" if Bc <= mosaic_gemm.SHORT_K else "xla"
    fns.update({f"dw_{dw_auto}_stats_{name}": with_logits_config(fused(dw_auto, logits_gemm="mosaic"),
                                                                 LOGITS_CONFIGS[name]) for name in logits_configs})
    return fns


# Overrides of the Mosaic logits GEMM's config (``mosaic_logits.config_for``: ping-pong 128x128 tiles, one wgmma
# group in flight, where they divide the shapes).
LOGITS_CONFIGS = {
    "stacked_64x256": dict(tile_m=64, tile_n=256, wg_split="m", schedule="cooperative", num_stages=4,
                           delay_release=0),
    "pingpong_128x128_delay2": dict(delay_release=2),
    "pingpong_64x256": dict(tile_m=64, tile_n=256, num_stages=4),
    "pingpong_128x128_cluster_m": dict(cluster="m"),  # w's tiles multicast to two row blocks
    "pingpong_128x128_cluster_n": dict(cluster="n"),  # h_c's tiles multicast to two column blocks
}


def with_logits_config(fn, overrides: dict):
    """fn, traced (at its first call) with the Mosaic logits GEMM's config replaced by its default with
    ``overrides``."""
    default = mosaic_logits.config_for
    traced = []

    def call(*args):
        if not traced:
            patched = lambda *a: dataclasses.replace(default(*a), **overrides)
            with mock.patch.object(mosaic_logits, "config_for", patched):
                fn.lower(*args)  # traced under the patch; jit's cache keeps this trace
            traced.append(True)
        return fn(*args)

    return call


def with_config(fn, overrides: dict, accumulating: bool = True):
    """fn, traced (at its first call, or by its ``lower``) with the Mosaic GEMM core's default config for
    accumulating calls (the dw update; ``accumulating=False``: plain calls, the loss's dh GEMM) replaced by the
    default with ``overrides``: how the loss would run were that the default."""
    default = mosaic_gemm.default_config
    traced = []

    def patched(M, N, K, dtype=jnp.bfloat16, *, accumulate_dtype=None):
        config = default(M, N, K, dtype, accumulate_dtype=accumulate_dtype)
        hit = (accumulate_dtype is not None) == accumulating
        return dataclasses.replace(config, **overrides) if hit else config

    def lower(*args):
        with mock.patch.object(mosaic_gemm, "default_config", patched):
            return fn.lower(*args)  # traced under the patch; jit's cache keeps this trace

    def call(*args):
        if not traced:
            lower(*args)
            traced.append(True)
        return fn(*args)

    call.lower = lower
    return call


def time_evaluation(h, w, labels, Bc: int, multipliers, iterations: int) -> dict:
    """µs of the loss alone with eval_chunk_rows = m · Bc per multiplier (and plain XLA's), interleaved."""
    B = h.shape[0]
    fns = {"xla_plain": jax.jit(lambda h, w: kernels.plain_cross_entropy(h, w, labels))}
    for m in multipliers:
        sizes = {"chunk_rows": Bc, "eval_chunk_rows": min(B, m * Bc)}
        fns[f"eval_x{m}"] = jax.jit(lambda h, w, sizes=sizes: pallas_kernels.linear_cross_entropy(
            h, w, labels, backend="triton", block_sizes=sizes))
    want = float(fns["xla_plain"](h, w))
    out = {"loss_diff": {k: abs(float(fn(h, w)) - want) for k, fn in fns.items()}}
    timings = bench.time_interleaved([(fn, (h, w)) for fn in fns.values()], iterations=iterations)
    for name, t in zip(fns, timings):
        out[name] = dict(us=t.median_us, top_kernels=sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:6])
    out["speedup_vs_xla"] = {k: out["xla_plain"]["us"] / out[k]["us"] for k in fns}
    if wall:  # the host's wall clock of a blocked call: device time plus launch gaps and host syncs
        walls = bench.time_interleaved([(fn, (h, w)) for fn in fns.values()], iterations=iterations, wall=True)
        out["wall_us"] = {k: t.median_us for k, t in zip(fns, walls)}
    return out


# Variants of each chunk size in the "chunks" section: (block_sizes fields, overrides of the Mosaic dh GEMM's
# default config or None). The dh GEMM's (Bc / 128)·(H / 256) tiles of the default fill whole waves of SMs at some
# chunk sizes only (1024 x 4096: 128 tiles on 132 SMs; 1536: 192, a wave and a half).
CHUNK_VARIANTS = {
    "dh_xla": ({"dh_gemm": "xla"}, None),
    "logits_xla": ({"logits_gemm": "xla"}, None),  # cuBLAS's logits, the row kernel reading them twice
    "fused_on": ({"fused_step": "on"}, None),  # the dw update and the next chunk's logits as one kernel
    "softmax_rows": ({"softmax": "rows"}, None),  # the row kernel's softmax, not the logits GEMM's epilogue's
    "softmax_epilogue": ({"softmax": "epilogue"}, None),  # the epilogue's, also where "auto" would not take it
    "dh_stacked_64x128": ({"dh_gemm": "mosaic"}, dict(tile_m=64, tile_n=128, wg_split="m", schedule="cooperative",
                                                        num_stages=4, delay_release=0, grid_minor="m")),
    "dh_pingpong_128x128": ({"dh_gemm": "mosaic"}, dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=6,
                                                          delay_release=1, grid_minor="m")),
}


def time_chunks(h, w, labels, chunks, iterations: int, variants=(), wall: bool = False) -> dict:
    """µs and temporary MiB of value_and_grad with each chunk_rows (and plain XLA's), interleaved; each
    CHUNK_VARIANTS name of ``variants`` also runs at every chunk size (``chunk_<rows>_<name>``); ``wall``: also the
    wall clock of each (``wall_us``)."""
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))  # noqa: E731
    fns = {"xla_plain": grad(lambda h, w: kernels.plain_cross_entropy(h, w, labels))}
    for rows in chunks:
        for name in ("", *variants):
            fields, dh_config = CHUNK_VARIANTS[name] if name else ({}, None)
            fn = grad(lambda h, w, sizes=dict(fields, chunk_rows=rows): pallas_kernels.linear_cross_entropy(
                h, w, labels, backend="triton", block_sizes=sizes))
            fns[f"chunk_{rows}_{name}" if name else f"chunk_{rows}"] = fn if dh_config is None else with_config(
                fn, dh_config, accumulating=False)
    out = {"temp_mib": {k: fn.lower(h, w).compile().memory_analysis().temp_size_in_bytes / 2**20
                        for k, fn in fns.items()}}
    timings = bench.time_interleaved([(fn, (h, w)) for fn in fns.values()], iterations=iterations)
    for name, t in zip(fns, timings):
        out[name] = dict(us=t.median_us, top_kernels=sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:6])
    out["speedup_vs_xla"] = {k: out["xla_plain"]["us"] / out[k]["us"] for k in fns}
    if wall:  # the host's wall clock of a blocked call: device time plus launch gaps and host syncs
        walls = bench.time_interleaved([(fn, (h, w)) for fn in fns.values()], iterations=iterations, wall=True)
        out["wall_us"] = {k: t.median_us for k, t in zip(fns, walls)}
    out["temp_pct_of_xla"] = {k: 100 * out["temp_mib"][k] / out["temp_mib"]["xla_plain"] for k in fns}
    return out


def precision(h, w, labels, Bc: int, variants=()) -> dict:
    """Largest |ours − float32 reference| / largest |reference| of the loss, dh and dw (value and gradient, mean
    reduction) at chunk_rows Bc, and for each CHUNK_VARIANTS name of ``variants``."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = jax.jit(jax.value_and_grad(lambda h, w: reference.linear_cross_entropy(f32(h), f32(w), labels),
                                     argnums=(0, 1)))(h, w)
    out = {}
    for name in ("", *variants):
        fields = dict(CHUNK_VARIANTS[name][0] if name else {}, chunk_rows=Bc)
        ours = jax.jit(jax.value_and_grad(lambda h, w: pallas_kernels.linear_cross_entropy(
            h, w, labels, backend="triton", block_sizes=fields), argnums=(0, 1)))(h, w)
        out[f"chunk_{Bc}_{name}" if name else f"chunk_{Bc}"] = {
            what: float(jnp.max(jnp.abs(f32(a) - b)) / jnp.max(jnp.abs(b)))
            for what, a, b in zip(("loss", "dh", "dw"), jax.tree.leaves(ours), jax.tree.leaves(ref))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="8k_128k,4k_256k,16k_32k")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--sections", default="update,loss")
    parser.add_argument("--eval-multipliers", default="1,2,4")
    parser.add_argument("--chunks", default="256,512,1024,2048")
    parser.add_argument("--chunk-variants", default="", help="CHUNK_VARIANTS names the chunks section also runs")
    parser.add_argument("--wall", action="store_true", help="the chunks section also times wall clocks")
    parser.add_argument("--temp-fraction", type=float, default=ce_config.TEMP_FRACTION,
                        help="the memory rule's bound that picks each shape's chunk")
    parser.add_argument("--dw-configs", default="", help="UPDATE_CONFIGS names the loss section also runs")
    parser.add_argument("--logits-configs", default="", help="LOGITS_CONFIGS names the loss section also runs "
                        "(with the dw update \"auto\" picks)")
    parser.add_argument("--update-configs", default=",".join(UPDATE_CONFIGS),
                        help="UPDATE_CONFIGS names the update_configs section times")
    args = parser.parse_args()
    sections = args.sections.split(",")
    result, save, path = results_file(args.out, "cross_entropy_dw_gemm")
    for name in args.shapes.split(","):
        s = SHAPES[name]
        B, H, V = s["B"], s["H"], s["V"]
        Bc = ce_config.chunk_rows_for(B, H, V, jnp.bfloat16, args.temp_fraction)
        row = dict(shape=name, B=B, H=H, V=V, chunk_rows=Bc, temp_fraction=args.temp_fraction)
        with recorded_row(result, save, row):
            if "update" in sections:
                row["dw_update"] = time_dw_update(H, V, Bc, args.iterations)
                print(name, "dw update", row["dw_update"], flush=True)
            if "update_configs" in sections:
                configs = {n: UPDATE_CONFIGS[n] for n in args.update_configs.split(",")}
                row["dw_update_configs"] = time_dw_update(H, V, Bc, args.iterations, configs)
                print(name, "dw update configs", row["dw_update_configs"], flush=True)
            h, w, labels = make_inputs(B, H, V, seed=0)
            if "eval" in sections:
                multipliers = [int(m) for m in args.eval_multipliers.split(",")]
                row["eval"] = time_evaluation(h, w, labels, Bc, multipliers, args.iterations)
                print(name, "eval", {k: round(v, 3) for k, v in row["eval"]["speedup_vs_xla"].items()},
                      {k: round(row["eval"][k]["us"]) for k in row["eval"]["speedup_vs_xla"]}, flush=True)
            if "chunks" in sections:
                sizes = sorted({Bc, *[min(B, int(c)) for c in args.chunks.split(",")]})
                row["chunks"] = time_chunks(h, w, labels, sizes, args.iterations,
                                            [v for v in args.chunk_variants.split(",") if v], args.wall)
                print(name, "chunks", {k: (round(v, 3), round(row["chunks"]["temp_pct_of_xla"][k], 2))
                                       for k, v in row["chunks"]["speedup_vs_xla"].items()}, flush=True)
            if "precision" in sections:
                row["precision"] = precision(h, w, labels, Bc, [v for v in args.chunk_variants.split(",") if v])
                print(name, "precision", row["precision"], flush=True)
            if "loss" in sections:
                fns = loss_fns(labels, Bc, [c for c in args.dw_configs.split(",") if c],
                               [c for c in args.logits_configs.split(",") if c])
                want = np.asarray(fns["dw_xla"](h, w)[1][1], np.float32)
                row["dw_diff_rel"] = {k: float(np.abs(np.asarray(fn(h, w)[1][1], np.float32) - want).max()
                                               / np.abs(want).max()) for k, fn in fns.items() if k != "dw_xla"}
                row["temp_mib"] = {k: fns[k].lower(h, w).compile().memory_analysis().temp_size_in_bytes / 2**20
                                   for k in ("xla_plain", "dw_xla", "dw_mosaic", "dw_xla_stats")}
                timings = bench.time_interleaved([(fn, (h, w)) for fn in fns.values()], iterations=args.iterations)
                for impl, t in zip(fns, timings):
                    top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:16]
                    row[impl] = dict(us=t.median_us, top_kernels=top)
                    print(name, impl, round(t.median_us, 1), [(k[:40], round(v, 1)) for k, v in top[:5]], flush=True)
                base = row["xla_plain"]["us"]
                row["speedup_vs_xla"] = {k: base / row[k]["us"] for k in fns if k != "xla_plain"}
                print(name, "speedup vs plain XLA", row["speedup_vs_xla"], "dw diff", row["dw_diff_rel"], flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
