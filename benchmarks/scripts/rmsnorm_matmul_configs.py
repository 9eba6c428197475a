"""The Mosaic rmsnorm_matmul under named config changes, against XLA's norm + matmul and cuBLAS's matmul alone.

    PYTHONPATH=$PWD python benchmarks/scripts/rmsnorm_matmul_configs.py --out $OUT \
        [--shapes 32768x4096x4096,4096x4096x14336,...] [--variants default,stats,gamma,gamma_on_x+dx_d1] \
        [--iterations 20] [--modes fwd,fwd+bwd]

Per suite shape (``jaxfuse.suites.rmsnorm_matmul``: bf16 inputs, the suite's forward and forward + backward
programs) and mode, every variant of VARIANTS (changes to the shape's default Mosaic config: its tuned entry, the
H200's untuned rule or the built-in tiles; "builtin": the built-in tables' config, ``mosaic_builtin_config``) and the
suite's "xla" and "xla_matmul_alone", timed interleaved (CUPTI medians; the input sets rotated as the suite
rotates them, ``runner.input_sets``: 3 where one set fits in the L2, so that no call finds its inputs left there by
the call before; until b75d1a6 one set, which at few rows left w in the L2 for the forward programs), each variant's
largest output difference from the "default" variant relative to its largest value, and the costliest kernels. A
variant asking for the row dot in the dx kernel where y's stages do not fit (so XLA's pass takes it) is named in
the row's "fallbacks".
Writes ``rmsnorm_matmul_configs-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from attention_fused_bwd import recorded_row, results_file
from jaxfuse import bench, costmodel
from jaxfuse.suites import rmsnorm_matmul as suite
from jaxfuse.suites.runner import input_sets
from pallas_kernels import tuning
from pallas_kernels.norm_matmul import config as nm_config

# name -> changes to the default Mosaic config (forward tiles with wg_split "n" where the statistics warpgroup runs;
# "forward", "dx", "dw": changes to that GEMM's config). A fourth warpgroup writing x ⊙ gamma over each x tile in shared
# memory (no w_γ pass; ``gamma_in_kernel`` at commits 11e4921, d83d186, beb29d4) ran slower in all three forms
# tried and was removed: rmsnorm_matmul_configs-h100-{11e4921,d83d186,beb29d4}.json, benchmarks/results/NOTES.md.
# So did the MMA warpgroups writing x ⊙ gamma over their own rows before each wgmma (``Fusion.a_transform``,
# 0bcb2e7; variants "mma_gamma_x", "mma_gamma_x_d0": rmsnorm_matmul_configs_gamma_mma-h100-0bcb2e7.json), and the
# forward's output stored from registers (``out_store="direct"``, a5bfb81, "fwd_direct":
# rmsnorm_matmul_configs_direct_store-h100-a5bfb81.json). So did dyr copied by the dx kernel's memory warpgroup
# (``a_copy_in="memory"``, c7e9fbf-245e44f, reverted; "dyr_memory*": rmsnorm_matmul_configs_dyr_memory*-h100-*.json),
# and dgamma summed over rows in the dx kernel's epilogue, sparing the dw kernel its w tile (``dgamma_in_dx``,
# 9d66ba4-dd77cc4, reverted; "default" there, "dgamma_in_dw", "dgamma_dx_dw4":
# rmsnorm_matmul_configs_dgamma_in_dx-h100-dd77cc4.json). The forward's output stored under the next tile's first
# wgmma ("*next_tile") and r's squares summed per row at each step ("mma_rows*") were slower too:
# rmsnorm_matmul_configs_next_tile-h100-63798a7.json, rmsnorm_matmul_configs_mma_rows-h100-d0df74c.json. So did
# dgamma summed by XLA from the K side's u before gamma, sparing the dw kernel its w tile (``dgamma_from="u"``,
# 136258a, reverted; "k_dgamma_u*", "gamma_{x,a}_k_dgamma_u_dw4": rmsnorm_matmul_configs_dgamma_u{,_mlp}-h200-
# 136258a.json): XLA ran the column sum as a pass of its own. And the dw kernel's output staged in slots of its own,
# so that the ring's two w slots free right after the epilogue (``tile_input_in="ring_staged"``, 2515134, reverted;
# "dw_ring_staged4": rmsnorm_matmul_configs_dw_ring_staged-h200-2515134.json): no faster than storing from them.
# And x ⊙ gamma made once per row block by its column-0 tile, in place in shared memory, and read back from HBM as A
# by the later tiles (``gemm.Fusion.a_shared``, gamma_on "once", 8ae2f46-a88ba1f, reverted; "gamma_once",
# "gamma_once_r2", "gamma_once_all", "gamma_once_lead1", "gamma_a_mma_shared_lead1":
# rmsnorm_matmul_configs_gamma_once*-h200-*.json): 2-5% slower than gamma in the registers at the three suite shapes.
# And the dx kernel's x tile loaded into registers at each tile's start, its 64 KiB buffer freed for a fourth stage
# (``tile_input_in="registers"``, df685ce, reverted; "dx_regs_s3", "dx_regs_s4" (output staged in 64x32 pieces, beside
# the dyr copy), "dx_regs_s4_e64": rmsnorm_matmul_configs_dx_registers-h200-df685ce.json): 0.4-0.7%
# slower at 8192x4096x6144 and 32768x4096x4096, equal at 4096x4096x14336.
# And the forward's output staged through more, smaller slots (``epi_slots``, 495606f; "fwd_epi32x4", "fwd_epi16x8":
# rmsnorm_matmul_configs_epi_slots-h200-495606f.json), fewer, larger pieces ("fwd_epi128x1", within noise;
# "fwd_epi128x2_s3", "fwd_epi256x1_s3" at 3 stages, 5-7% slower: ..._epi_pieces-h200-495606f.json), or written whole
# into its B stages and stored from there (``epilogue_store="ring"``, d6e5c26; "fwd_ring": ..._ring_output-h200-
# d6e5c26.json): the TMA copy's read of 32 KiB held the slot 1.5k cycles (mosaic_timeline_ring_output-h200-d6e5c26).
# Both removed.
_STACKED = dict(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", schedule="cooperative", num_stages=4)
_OWN = dict(pipeline="own", semantics="lane", stream_k=0)  # our K loop, whole tiles
# r summed by the MMA warpgroups of each row block's first tile only (the whole first column runs first), the other
# tiles loading it after a global semaphore (gemm.Fusion.share_rows): gamma on w, or in the registers
VARIANTS_SHARED = {
    "mma_shared": dict(stats_in_kernel="mma_shared", gamma_on="w", forward=dict(_STACKED, stream_k=0,
                                                                                delay_release=1)),
    "gamma_a_mma_shared": dict(gamma_on="a", stats_in_kernel="mma_shared", forward=dict(_STACKED, stream_k=0,
                                                                                        delay_release=1)),
}
VARIANTS = {
    "default": {},
    "stats": dict(stats_in_kernel=True),  # r from a fourth warpgroup summing x² over each x tile
    # where XLA runs the dw GEMM: its two halves summed into dw and dgamma by one Triton kernel, or XLA's fusions
    "dw_finish": dict(dw_finish_kernel=True), "dw_finish_xla": dict(dw_finish_kernel=False),
    "stacked_m": dict(forward=dict(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", schedule="cooperative")),
    "gamma_on_x": dict(gamma_on="x", stats_in_kernel=False),  # XLA writes x ⊙ gamma (2MK bytes), no w_γ (2KN)
    # stream-K (gemm.stream_k) where the last round of tiles is less than half full: forward (stacked tiles, r from
    # XLA's reduction: the statistics warpgroup needs whole tiles), dx, or both
    "fwd_stream_k": dict(stats_in_kernel=False, forward=dict(tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                             schedule="cooperative", stream_k=4)),
    "dx_stream_k": dict(dx=dict(stream_k=4)),
    # the backward's row dot (config.row_dot): Σ_N(dy · y) in an XLA pass with dyr, or u from the dx kernel (A = dyr)
    # and one XLA row fusion over u and x
    "stacked_fwd_dw": dict(forward=dict(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", schedule="cooperative"),
                           dw=dict(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", schedule="cooperative")),
    "row_dot_n": dict(row_dot="n"),
    "row_dot_k": dict(row_dot="k"),
    "stream_k": dict(stats_in_kernel=False, forward=dict(tile_m=64, tile_n=256, wg_split="m", grid_minor="m",
                                                         schedule="cooperative", stream_k=4), dx=dict(stream_k=4)),
    # r from the MMA warpgroups: after issuing each step's wgmma (A from SMEM) they load their rows of the x block
    # into registers and add its squares (gemm.Fusion.a_observe); one wgmma group in flight, or none; gamma on w
    "mma_stats": dict(stats_in_kernel="mma", gamma_on="w", forward=dict(_STACKED, stream_k=0, delay_release=1)),
    "mma_stats_d0": dict(stats_in_kernel="mma", gamma_on="w", forward=dict(_STACKED, stream_k=0)),
    # and the last round of tiles split by K steps, the partial sums of squares added like the accumulators
    "mma_stats_sk4": dict(stats_in_kernel="mma", gamma_on="w", forward=dict(_STACKED, stream_k=4, delay_release=1)),
    # and the tile order: runs of 4 or 16 tiles along M, or 8 along N
    **{f"mma_stats_{name}": dict(stats_in_kernel="mma", gamma_on="w",
                                 forward=dict(_STACKED, stream_k=0, delay_release=1, **order))
       for name, order in (("w4", dict(grid_tile_width=4)), ("w16", dict(grid_tile_width=16)),
                           ("minor_n", dict(grid_minor="n")))},
    # the dx kernel's row sum over planar-snake runs of 4 or 2 row blocks (gemm.config.sum_rows_grid; the entries 8)
    # the dx kernel's epilogue in a fourth warpgroup (gemm.MosaicGemmConfig.epilogue_in), the MMA warpgroups handing
    # it their accumulators through shared memory: 3 stages beside that buffer (or 2)
    **{f"dx_epi4_s{stages}": dict(dx=dict(epilogue_in="fourth", tile_input_in="buffer", num_stages=stages, tile_m=128,
                                          tile_n=128, wg_split="n")) for stages in (2, 3)},
    # and its slices 32 columns wide (a 128x32 float32 slice is 32 registers a thread of the fourth's 104)
    "dx_epi4_s3_e32": dict(dx=dict(epilogue_in="fourth", tile_input_in="buffer", num_stages=3, tile_m=128,
                                   tile_n=128, wg_split="n", epi_tile_n=32)),
    # the same with fewer registers for its MMA warpgroups (the fourth's 512 - 2 * mma - 40: 120 at 176, the least
    # setmaxnreg allows there), so that 64-column slices (half the slices and their tile input's TMA waits) do not
    # spill (ptxas: none at 176 with 64 or 32 columns, mosaic_ptxas_registers_dx_epi_registers-h200-c46fff4.json)
    **{f"dx_epi_r176_e{width}": dict(dx=dict(mma_registers=176, epi_tile_n=width)) for width in (64, 32)},
    # (128x128 dx tiles, 64x128 stacked, with the epilogue in the fourth warpgroup, where 128x256 ones make a single
    # round: two rounds, the second's K loop under the first's epilogue. At 8192x512x2816 the dx kernel took
    # 46.7-56.4 µs with 4 or 5 stages and 64- or 32-column slices against the entry's 37.7, forward + backward
    # 140.0-148.6 against 130.0: rmsnorm_matmul_configs_dx_epi4_128_small-h200-32496e9.json; removed)
    # (Measured and removed, tag mma-loads-measured-e99a0ac: no memory warpgroup, the MMA warpgroups loading their
    # own A or B block under the wgmma just issued (loads_in "mma"), so three warpgroups and stacked 64x256
    # accumulators (one m64n256 wgmma a step). The dx kernel at 32768x4096x4096 against the entry's 1481.5-1513.1
    # µs: 128x128 side by side +42-53, 64x256 with 32-column slices +141-165, 64-column +8-21, 128-column +70,
    # warpgroup 0 loading both blocks +29, each warpgroup's first warp loading +84 (28 bytes spilled), one wgmma
    # in flight +896-1343 (its refills one step ahead): rmsnorm_matmul_configs_dx_mma{,0}_loads*-h200-*.json.)
    # the 32768x4096x4096 entry's dx kernel before the fifty-first session: stacked 64x256 accumulators, the epilogue
    # in the MMA warpgroups, the x tile through the ring at 4 stages
    "dx_stacked_ring4": dict(dx=dict(epilogue_in="mma", tile_input_in="ring", num_stages=4, tile_m=64, tile_n=256,
                                     wg_split="m", epi_tile_n=64)),
    # cooperative 64x128 forward tiles (each warpgroup's accumulator 64 registers, room for gamma and r's squares in
    # the registers at 16384x1024x5504, where N = 43 x 128 and the entry's ping-pong 128x128 tiles have none)
    **{f"fwd_coop128_s{stages}": dict(forward=dict(schedule="cooperative", tile_m=64, tile_n=128, wg_split="m",
                                                   grid_minor="m", stream_k=0, delay_release=1, num_stages=stages))
       for stages in (5, 6)},
    "dx_w4": dict(dx=dict(grid_tile_width=4)),
    "dx_w2": dict(dx=dict(grid_tile_width=2)),
    # narrower snake runs where the row sums' grid cuts blocks at the entry's width of 8 (96 of 132 at K = 3072 with
    # width 8, 132 with width 1 or 11; 120 / 132 at K = 768 with 8 / 4; 128 / 132 at K = 512 and 1024 with 8 / 6 and
    # 3). At 16384x3072x8192 width 11 took the dx kernel 1382.1 → 1092.3 µs, 1 to 1110.4; at the three others none
    # gained (rmsnorm_matmul_configs_dx_grid{,_suite}-h200-1b2644e.json). gemm.config.sum_rows_grid now widens
    # runs that idle over an eighth of the grid, so "dx_w4" etc. are overridden there.
    "dx_w1": dict(dx=dict(grid_tile_width=1)),
    "dx_w3": dict(dx=dict(grid_tile_width=3)),
    "dx_w6": dict(dx=dict(grid_tile_width=6)),
    "dx_w11": dict(dx=dict(grid_tile_width=11)),  # 132 blocks at K = 768, 1024 and 512 (runs of 33, 44, 22 tiles)
    # the dx kernel's tiles narrower along K, for fuller rounds where few tiles fill the grid (8192x768x3072: 192
    # tiles of 128x256 on 132 blocks, 2 rounds at 73%; 256 tiles of 128x192 on 128, 2 rounds full)
    "dx_n192": dict(dx=dict(tile_n=192)),
    "dx_n128": dict(dx=dict(tile_n=128)),
    "dx_n64": dict(dx=dict(tile_n=64)),  # few rows (256x2048x8192: 32 dx tiles 128 wide on 132 blocks)
    "dx_n160": dict(dx=dict(tile_n=160, epi_tile_n=32)),  # 4096x5120x13824: 1024 tiles on 128 blocks, 8 full rounds
    "dx_n224": dict(dx=dict(tile_n=224, epi_tile_n=32)),  # 8192x3584x18944: 1024 on 128, 8 full (256: 896 on 126)
    # the dw kernel's last, part-full round through the stream-K phase: 8192x1536x8960's dw has 420 tiles, 4 rounds
    # at 80%. stream_k=1 keeps those tiles whole (the rounds' schedule): no change, 331.6 → 331.7 µs there, 587.9 →
    # 588.9 at 8192x2560x10240 (rmsnorm_matmul_configs_dw_stream_k-h200-3974e32.json). Split along its K loop in 4:
    # 334.5 → 292.6 and 590.5 → 551.7 (rmsnorm_matmul_configs_dw_stream_k4-h200-c900f53.json; the untuned rule's
    # ``norm_matmul.config._untuned_dw`` since).
    "dw_sk1": dict(dw=dict(stream_k=1)),
    "dw_sk4": dict(dw=dict(stream_k=4)),
    "dw_sk0": dict(dw=dict(stream_k=0)),  # the dw kernel's tiles whole where the untuned rule splits them
    "dw_sk8": dict(dw=dict(stream_k=8)),  # a lone last-round tile (133 of 128x256 at K = 896, N = 4864) split finer
    "dw_sk16": dict(dw=dict(stream_k=16)),
    # narrower forward tiles where 128x256 ones leave rounds part-empty at few rows (512x4096x4096: 64 tiles on 132
    # blocks; cuBLAS runs 256x64 there)
    "fwd_n128": dict(forward=dict(tile_n=128)),
    "fwd_n192": dict(forward=dict(tile_n=192, epi_tile_n=32)),
    # (cuBLAS's 128x160 at short K, 4096x960x2560; 5 pieces of 32 columns: stored at the tile's end)
    "fwd_n160": dict(forward=dict(tile_n=160, epi_tile_n=32, epilogue_store="end")),
    "fwd_n64": dict(forward=dict(tile_n=64)),
    "fwd_n256": dict(forward=dict(tile_n=256)),  # the entry's width where the untuned rule narrows it
    # the dx kernel's 64-row CTA tiles at few rows (warpgroups side by side along K): 256x2048x8192 has 64 dx tiles
    # of 128x64 on 132 blocks, 64x64 ones make 128 (the x tile through its buffer: the ring needs stacked
    # warpgroups). They lower; not measured
    "dx_wgn32": dict(dx=dict(wg_split="n", tile_n=32, epi_tile_n=32, tile_input_in="buffer")),
    "dx_wgn64": dict(dx=dict(wg_split="n", tile_n=64, tile_input_in="buffer")),
    # few rows: the dx kernel as a plain GEMM (u and its row dots out, dx finished by XLA, dyr from XLA) so that
    # stream-K can split its K loop (N) where its tiles fill under half the grid (row sums refuse stream-K)
    **{f"dx_sk{split}": dict(dx_in_kernel=False, xr_in_dx=False, dx=dict(stream_k=split)) for split in (1, 2, 4)},
    **{f"dx_sk{split}_128": dict(dx_in_kernel=False, xr_in_dx=False, dx=dict(stream_k=split, tile_n=128))
       for split in (2, 4)},
    # and dgamma summed from u by dx_finish (M x K: small at few rows), the dw kernel's epilogue without a w tile
    **{f"dx_sk{split}_dgu": dict(dx_in_kernel=False, xr_in_dx=False, dgamma_from="u", dx=dict(stream_k=split))
       for split in (1, 2)},
    # dgamma from u where XLA runs the dw GEMM (few (K, N) tiles: 8192x768x3072, 8192x512x2816, 8192x512x768), which
    # then writes dw with gamma on A at once (norm_matmul.mosaic._dw_by_cublas); the dx kernel plain. Lowers; not
    # measured
    "dgu_plain": dict(dx_in_kernel=False, xr_in_dx=False, dgamma_from="u", dw_finish_kernel=False),
    # the entry's forward forms where the untuned rule takes r and x ⊙ gamma from XLA at few rows (M <= 1024)
    "fwd_shared_r": dict(gamma_on="a", stats_in_kernel="mma_shared", squares_from="operand"),
    # few rows: the dw GEMM's K loop is M / 64 steps (4 at 256 rows). With dgamma from dw's side it lost (92.4 →
    # 139.1 µs at 256x2048x8192: dgamma read the whole float32 g, rmsnorm_matmul_configs_few_rows_dx_wgn_dw_xla-h200-
    # 2dbf877.json); beside the few-row rule's dgamma from u cuBLAS writes dw at once (mosaic._dw_by_cublas): not
    # measured
    "dw_xla": dict(dw_in_xla=True),
    # the fused forward and XLA's own backward from its r (two cuBLAS GEMMs, XLA's fusions): few rows, where our
    # backward kernels' short rounds trail cuBLAS's split GEMMs (256x2048x8192: dx 28.7, dw 18.3 µs against 14-17)
    "bwd_xla": dict(backward_in_xla=True),
    "bwd_ours": dict(backward_in_xla=False),  # our backward kernels where the untuned rule takes XLA's
    # deeper forward rings: at few rows the forward is one round reading w from HBM (cuBLAS's tiles there take 6
    # stages of 64)
    **{f"fwd_s{stages}": dict(forward=dict(num_stages=stages)) for stages in (5, 6, 7, 8)},
    # longer runs, and runs along N, in each kernel's tile order (the 8-wide runs along M of the entries beat 4 and 2
    # in the dx kernel at d262776, before its epilogue moved to a fourth warpgroup). None won at 32768x4096x4096:
    # the dx kernel 1525.3 µs (entry) against 1562.4 (16-wide) and 1564.3 (along N), the forward 1405.0 against
    # 1412.1 (16-wide), the dw kernel equal: rmsnorm_matmul_configs_tile_order-h200-a19c145.json
    "dx_w16": dict(dx=dict(grid_tile_width=16)),
    "dx_minor_n": dict(dx=dict(grid_minor="n")),
    "fwd_w16": dict(forward=dict(grid_tile_width=16)),
    "dw_w16": dict(dw=dict(grid_tile_width=16)),
    # the forward's and the dw kernel's planar-snake runs of 4 or 16 row blocks (the entries 8)
    **{f"{name}_w{width}": {kernel: dict(grid_tile_width=width)} for name, kernel in (("fwd", "forward"), ("dw", "dw"))
       for width in (4, 16)},
    "dw_stream_k": dict(dw=dict(stream_k=4)),  # the dw kernel's part-empty last round spread over K (gemm.stream_k)
    "fwd_dw_stream_k": dict(forward=dict(stream_k=4), dw=dict(stream_k=4)),
    "stacked_whole_d1": dict(stats_in_kernel=False, forward=dict(_STACKED, stream_k=0, delay_release=1)),
    # the backward kernels beside their prefetched x / w tiles (3 stages of 64x256 stacked tiles): B shared by two
    # blocks of a cluster (TMA multicast: half the L2 reads of it), one wgmma group in flight, 32-wide K steps.
    # None won: rmsnorm_matmul_configs_bwd_tiles-h100-0bcb2e7.json
    "dx_cluster_m": dict(dx=dict(cluster="m", stream_k=0)),
    "dx_d1": dict(dx=dict(delay_release=1)),
    # (and at the H200 entry with the fourth warpgroup's epilogue, 128x128 side-by-side tiles, 3 stages: the dx
    # kernel 1475.7 -> 1652.3 µs, forward + backward 4211.2 -> 4385.8 at 32768x4096x4096:
    # rmsnorm_matmul_configs_dx_k32_s6-h200-c5f01fd.json; its delay_release 1 there ("dx_d1"), 1519.2 -> 1615.7,
    # 4340.1 -> 4439.9: rmsnorm_matmul_configs_dx_d1_epi4-h200-10acd51.json)
    "dx_k32": dict(dx=dict(tile_k=32, num_stages=6)),
    "dw_cluster_m": dict(dw=dict(cluster="m")),
    # the forward's B tiles shared by a cluster's two blocks (cuBLAS's kernel at 16384x1024x5504 runs 128x128 tiles
    # in clusters of two; predicted: without them its 5504 tiles read 2.8 GB from L2, about 12 TB/s over 240 µs).
    # None of the four was faster there: rmsnorm_matmul_configs_mlp1024_cluster-h200-c4e00cf.json
    "fwd_cluster_m": dict(forward=dict(cluster="m")),
    "fwd_cluster_m_minor_m": dict(forward=dict(cluster="m", grid_minor="m")),
    # the forward's A (x) tiles shared by two column blocks: at few rows cuBLAS runs 128x64 tiles, 8 stages, in
    # clusters of 1x2 (256x8192x2048: nvjet_sm90_tss_128x64_64x8_1x2_h, 16.2 µs where our whole 128x64 tiles at 8
    # stages took 30.6); no stream-K beside a cluster
    "fwd_cluster_n": dict(forward=dict(cluster="n", stream_k=0)),
    "fwd_cluster_n_minor_n": dict(forward=dict(cluster="n", stream_k=0, grid_minor="n")),
    # and the backward kernels' (their tile input in a buffer of its own: the ring takes no cluster; no stream-K)
    "dx_cluster_m_buf": dict(dx=dict(cluster="m", stream_k=0, tile_input_in="buffer", num_stages=3)),
    "dw_cluster_m_buf": dict(dw=dict(cluster="m", stream_k=0, tile_input_in="buffer", num_stages=5)),
    # 64x128 stacked dx tiles: half the x tile's buffer, so more stages fit beside it and the dyr staging. Beside
    # the H200 entry's fourth-warpgroup epilogue at 32768x4096x4096 (169064 / 201848 B) the dx kernel took 1954.8 /
    # 2024.0 µs against the entry's 1494.1 (128x256 blocks): half the FLOPs per byte loaded, and a fifth stage
    # slower than a fourth: rmsnorm_matmul_configs_dx_n128-h200-308acd2.json
    "dx_n128_s4": dict(dx=dict(tile_m=64, tile_n=128, wg_split="m", num_stages=4)),
    "dx_n128_s5": dict(dx=dict(tile_m=64, tile_n=128, wg_split="m", num_stages=5)),
    "dw_d1": dict(dw=dict(delay_release=1)),
    # the dw kernel's w tile loaded into two B stages after each tile's last K step (tile_input_in "ring"): no
    # buffer of its own, so a fourth stage fits beside 64x256 tiles
    "dw_ring": dict(dw=dict(tile_input_in="ring", stream_k=0)),
    "dw_ring4": dict(dw=dict(tile_input_in="ring", num_stages=4, stream_k=0)),
    "dw_ring5": dict(dw=dict(tile_input_in="ring", num_stages=5, stream_k=0)),
    # 128x128 dw tiles: a 32 KiB w tile leaves room for 6 stages, and twice the tiles a short last round (stream-K)
    "dw_128_s6": dict(dw=dict(tile_m=64, tile_n=128, wg_split="m", num_stages=6, stream_k=0)),
    "dw_128_s6_sk": dict(dw=dict(tile_m=64, tile_n=128, wg_split="m", num_stages=6, stream_k=4)),
    "dw_pp_s5": dict(dw=dict(tile_m=128, tile_n=128, schedule="pingpong", num_stages=5, delay_release=1,
                             stream_k=0)),
    # dyr = r ⊙ dy written by the dx kernel from its dy blocks in shared memory (gemm.Fusion.a_copy): XLA's pass
    # over dy and y only reduces (no (M, N) write)
    "dyr_in_dx": dict(row_dot="n", dyr_in_dx=True),
    "dyr_in_xla": dict(row_dot="n", dyr_in_dx=False),  # where the default writes it from the dx kernel
    # the K side with dy as the dx kernel's A operand, which writes dyr (no XLA pass over dy); _s4: one stage fewer
    "k_dyr_in_dx": dict(row_dot="k", dyr_in_dx=True),
    # (the K side with dy as the dx kernel's A and no dyr copy where XLA runs dw's GEMM, dyr only that GEMM's operand
    # expression: dyr_in_dx="xla_dot" at 3667889, reverted; "k_xdot", "k_xdot_dwx": XLA did not fuse it into cuBLAS's
    # GEMM but wrote dyr in a pass of its own, 30 µs at 8192x512x2816, fwd+bwd 159.4 against the entry's 134.5 µs,
    # 65.2 against 58.1 at 8192x512x768: rmsnorm_matmul_configs_xla_dot_models-h200-3667889.json; dw's GEMM by
    # cuBLAS alone, "dwx": 134.8 against 134.5, 255.9 against 241.1 at 4096x2048x3072, 811.7 against 755.7 at
    # 4096x2048x11008, the same record)
    # the H200's 8192x512x2816 entry (γ on x, the K side with dyr from stacked dx tiles, ping-pong forward and dw
    # tiles; the tile order stays the shape's), for shapes with no H200 entry of their own: the H200's 8192x512x768
    # entry since rmsnorm_matmul_configs_qkv_small-h200-7c5fd33.json (fwd+bwd 60.4 against 65.2 µs for the H100's)
    "small_mlp_entry": dict(gamma_on="x", stats_in_kernel=False, row_dot="k", dyr_in_dx=True, dw_in_xla=None,
                            forward=dict(_OWN, tile_m=128, tile_n=128, num_stages=6, wg_split="n",
                                         schedule="pingpong", delay_release=1),
                            dx=dict(_OWN, **dict(_STACKED, num_stages=3), delay_release=0),
                            dw=dict(_OWN, tile_m=128, tile_n=128, num_stages=5, wg_split="n", schedule="pingpong",
                                    delay_release=1)),
    "k_dyr_in_dx_s4": dict(row_dot="k", dyr_in_dx=True, dx=dict(num_stages=4)),
    # and the dx kernel's tiles beside the copy (at the model's MLP shapes, K of 512 or 2048 gives 256-wide tiles
    # few column blocks); "k_dyr_in_xla": XLA writes dyr instead
    "k_dyr_in_xla": dict(row_dot="k", dyr_in_dx=False),
    "fwd_d0": dict(forward=dict(delay_release=0)),
    "fwd_stacked": dict(forward=dict(_STACKED, stream_k=0, delay_release=0)),  # whatever the entry's stages
    "fwd_stacked_sk": dict(forward=dict(_STACKED, stream_k=4, delay_release=0)),
    "fwd_sk": dict(forward=dict(stream_k=4)),  # combine: "mma_shared+fwd_sk", "gamma_a+fwd_sk", ...
    # split in 2 (few rows, long K: 64 tiles of 128x64 split in 4 make two rounds of 128 units at 256x8192x2048)
    "fwd_sk2": dict(forward=dict(stream_k=2)),
    "kdyr_dx_pp": dict(row_dot="k", dyr_in_dx=True, dx=dict(tile_m=128, tile_n=128, wg_split="n", grid_minor="m",
                                                             schedule="pingpong", delay_release=1, num_stages=4,
                                                             stream_k=0)),
    "kdyr_dx_pp_d0": dict(row_dot="k", dyr_in_dx=True, dx=dict(tile_m=128, tile_n=128, wg_split="n", grid_minor="m",
                                                                schedule="pingpong", delay_release=0, num_stages=4,
                                                                stream_k=0)),
    "kdyr_dx_stacked": dict(row_dot="k", dyr_in_dx=True, dx=dict(_STACKED, num_stages=3, stream_k=0,
                                                                  delay_release=0)),
    "kdyr_dx_stacked_d1": dict(row_dot="k", dyr_in_dx=True, dx=dict(_STACKED, num_stages=3, stream_k=0,
                                                                     delay_release=1)),
    "kdyr_dx_stacked_n128": dict(row_dot="k", dyr_in_dx=True, dx=dict(_STACKED, tile_n=128, num_stages=5,
                                                                       stream_k=0, delay_release=0)),
    "kdyr_dx_side64": dict(row_dot="k", dyr_in_dx=True, dx=dict(tile_m=128, tile_n=64, wg_split="n", grid_minor="m",
                                                                 schedule="cooperative", num_stages=5, stream_k=0,
                                                                 delay_release=0)),
    # and dgamma from u (dgamma_from "u": norm_matmul.dx_finish finishes dx and sums it; the dw kernel has no w
    # tile), its dw kernel at the same 3 stages or a fourth; the last two with gamma on x or in the registers (the dx
    # GEMM then reads w itself, which dgamma from u needs) and 64x256 stacked dw tiles, 4 stages
    "k_dgamma_u": dict(row_dot="k", dyr_in_dx=True, dgamma_from="u"),
    "k_dgamma_u_dw4": dict(row_dot="k", dyr_in_dx=True, dgamma_from="u", dw=dict(num_stages=4)),
    "gamma_x_k_dgamma_u_dw4": dict(gamma_on="x", stats_in_kernel=False, row_dot="k", dyr_in_dx=True,
                                   dgamma_from="u", dw=dict(_STACKED, stream_k=0)),
    "gamma_a_k_dgamma_u_dw4": dict(gamma_on="a", stats_in_kernel=False, row_dot="k", dyr_in_dx=True,
                                   dgamma_from="u", forward=dict(_STACKED, stream_k=0, delay_release=1),
                                   dw=dict(_STACKED, stream_k=0)),
    # r summed by the memory warpgroup between its loads (gemm prologue_in "memory"), stacked tiles, whole tiles
    "stats_memory": dict(stats_in_kernel=True, gamma_on="w", forward=dict(_STACKED, stream_k=0, delay_release=0,
                                                                          prologue_in="memory")),
    "stats_memory_d1": dict(stats_in_kernel=True, gamma_on="w", forward=dict(_STACKED, stream_k=0, delay_release=1,
                                                                             prologue_in="memory")),
    "stats_memory_r200": dict(stats_in_kernel=True, gamma_on="w", forward=dict(
        _STACKED, stream_k=0, prologue_in="memory", mma_registers=200)),  # memory warpgroup: 104 registers
    "stats_memory_r176": dict(stats_in_kernel=True, gamma_on="w", forward=dict(
        _STACKED, stream_k=0, prologue_in="memory", mma_registers=176)),  # 152
    "dyr_in_dx_d1": dict(row_dot="n", dyr_in_dx=True, dx=dict(delay_release=1)),  # the copy under 2 wgmmas
    # gamma multiplied into the x block in the MMA warpgroups' registers, wgmma reading A from there
    # (gemm.Fusion.a_operand: delay_release + 1 steps per loop iteration, each its own registers): no w_γ or x ⊙ gamma
    # pass; r from XLA's reduction, or from the same registers ("mma": the forward reads x and w once, in one kernel)
    "gamma_a": dict(gamma_on="a", stats_in_kernel=False, forward=dict(_STACKED, stream_k=0, delay_release=1)),
    "gamma_a_mma": dict(gamma_on="a", stats_in_kernel="mma", forward=dict(_STACKED, stream_k=0, delay_release=1)),
    "gamma_a_mma_d2": dict(gamma_on="a", stats_in_kernel="mma", forward=dict(_STACKED, stream_k=0, delay_release=2)),
    "gamma_a_mma_n": dict(gamma_on="a", stats_in_kernel="mma", forward=dict(
        _STACKED, stream_k=0, delay_release=1, grid_minor="n")),
    # the forward's output tile kept in registers and stored under the next tile's first wgmma
    # (MosaicGemmConfig.epilogue_store): the tensor cores no longer idle through each tile's stores
    "fwd_next_tile": dict(forward=dict(epilogue_store="next_tile", stream_k=0)),
    # r's squares reduced per row at each step ("mma_rows": a (rows,) carry, not (rows, tile_k) elementwise)
    "mma_rows": dict(stats_in_kernel="mma_rows", gamma_on="w", forward=dict(_STACKED, stream_k=0, delay_release=1)),
    "mma_next_tile": dict(stats_in_kernel="mma", gamma_on="w", forward=dict(_STACKED, stream_k=0, delay_release=1,
                                                                           epilogue_store="next_tile")),
    "mma_rows_next_tile": dict(stats_in_kernel="mma_rows", gamma_on="w", forward=dict(
        _STACKED, stream_k=0, delay_release=1, epilogue_store="next_tile")),
    "mma_rows_d0_next_tile": dict(stats_in_kernel="mma_rows", gamma_on="w", forward=dict(
        _STACKED, stream_k=0, delay_release=0, epilogue_store="next_tile")),
    "gamma_a_mma_rows": dict(gamma_on="a", stats_in_kernel="mma_rows", forward=dict(_STACKED, stream_k=0,
                                                                                   delay_release=1)),
    "gamma_a_next_tile": dict(gamma_on="a", stats_in_kernel=False, forward=dict(_STACKED, stream_k=0, delay_release=1,
                                                                                epilogue_store="next_tile")),
    **VARIANTS_SHARED,
    # and where the other tiles wait for r: after the K loop (0), or 2, 8 steps before its end (default 4)
    **{f"{name}_w{lag}": dict(VARIANTS_SHARED[name], forward=dict(VARIANTS_SHARED[name]["forward"],
                                                                    shared_rows_wait=lag))
       for name in ("mma_shared", "gamma_a_mma_shared") for lag in (0, 2, 8)},
    # Σ_N(dy · y) from the dx kernel's first tile of each row block (row_dot_in_dx: y's blocks loaded from HBM by
    # its MMA warpgroups, the row dot shared like r above): no XLA pass over dy and y; whole dx tiles (and the same
    # dx tiles without stream-K for comparison), alone or with the forward's shared r
    "dx_whole": dict(dx=dict(stream_k=0)),
    "row_dot_in_dx": dict(row_dot="n", row_dot_in_dx=True, dx=dict(stream_k=0)),
    "row_dot_in_dx_prefetch": dict(row_dot="n", row_dot_in_dx="prefetch", dx=dict(stream_k=0)),  # y a step ahead
    "dx_delay1": dict(dx=dict(stream_k=0, delay_release=1)),  # one wgmma group in flight: the step's loads under it
    "row_dot_in_dx_delay1": dict(row_dot="n", row_dot_in_dx=True, dx=dict(stream_k=0, delay_release=1)),
    "gamma_a_mma_shared_row_dot_in_dx": dict(VARIANTS_SHARED["gamma_a_mma_shared"], row_dot="n", row_dot_in_dx=True,
                                             dx=dict(stream_k=0)),
    # the same with y's blocks loaded by TMA beside dy's (row_dot_in_dx "tma", gemm.Fusion.a_beside): the dx
    # kernel's x tile through its B stages to make room (ring; "_sk": with stream-K), beside the same dx tiles
    # without the row dot. From the K side's entries (4096x4096x14336) the N side with dgamma from the dw kernel,
    # its w tile through its ring. (Each group's first tiles one or two groups ahead of its others, shared_rows_lead "_lead1" / "_lead2",
    # cost more: rmsnorm_matmul_configs_row_dot_tma_lead-h200-3c827db.json; removed after it. Every tile of a row
    # block summing its share of the steps, its K loop rotated to start there, "_spread", measured equal:
    # rmsnorm_matmul_configs_row_dot_spread-h200-488562e.json; removed after it)
    "dx_ring": dict(dx=dict(stream_k=0, tile_input_in="ring")),
    "dx_ring4": dict(dx=dict(stream_k=0, tile_input_in="ring", num_stages=4)),  # the room the x tile left: a stage
    # (the dx kernel's output stored under the next tile's first wgmma through its x buffer, "dx_next", cost the dx
    # kernel 5-29 µs: rmsnorm_matmul_configs_dx_next-h200-b8d0a5b.json; removed after it)
    "n_side_dx_ring": dict(row_dot="n", dyr_in_dx=None, dgamma_from=None, dx=dict(stream_k=0, tile_input_in="ring"),
                           dw=dict(tile_input_in="ring")),
    # (3 stages: with 4, as the 32768x4096x4096 entry's dx kernel takes now, y's stages do not fit and the row dot
    # falls back to XLA's pass)
    "row_dot_tma": dict(row_dot="n", row_dot_in_dx="tma", dyr_in_dx=None, dgamma_from=None, dx_in_kernel=False,
                        dx=dict(stream_k=0, tile_input_in="ring", num_stages=3), dw=dict(tile_input_in="ring")),
    # (removed, code at the tag row-dot-each-measured-ea7499e: "row_dot_each", every dx tile its own row dot from
    # y's blocks by TMA, no tile waiting on another: the dx kernel 1963.4 against the entry's 1586.6 µs at
    # 32768x4096x4096, 737.2 against 585.7 at 8192x4096x6144: rmsnorm_matmul_configs_row_dot_each-h200-ea7499e.json)
    # with one wgmma group in flight over the first tiles' loads and sums (and the same dx tiles without the row dot)
    "row_dot_tma_d1": dict(row_dot="n", row_dot_in_dx="tma", dyr_in_dx=None, dgamma_from=None,
                           dx=dict(stream_k=0, tile_input_in="ring", delay_release=1, num_stages=3),
                           dw=dict(tile_input_in="ring")),
    "dx_ring_d1": dict(dx=dict(stream_k=0, tile_input_in="ring", delay_release=1)),
    # the forward's K loop without hooks (x ⊙ gamma and r's sums from XLA): waiting for each wgmma (d0, as the plain
    # core does) or one group in flight (d1), the output stored at the tile's end or under the next tile's first wgmma
    "plain_x_d0": dict(gamma_on="x", stats_in_kernel=False, forward=dict(_STACKED, stream_k=0, delay_release=0)),
    "plain_x_d0_next": dict(gamma_on="x", stats_in_kernel=False, forward=dict(_STACKED, stream_k=0, delay_release=0,
                                                                            epilogue_store="next_tile")),
    "plain_x_d1_next": dict(gamma_on="x", stats_in_kernel=False, forward=dict(_STACKED, stream_k=0, delay_release=1,
                                                                            epilogue_store="next_tile")),
    "gamma_a_d0": dict(gamma_on="a", stats_in_kernel=False, forward=dict(_STACKED, stream_k=0, delay_release=0)),
    # r shared beside gamma on w, waiting for each wgmma: only the column-0 tiles run the a_observe (1/16 of the
    # tiles at 32768x4096x4096), the others a plain K loop; whole tiles or the last round cut by K steps
    "mma_shared_d0": dict(stats_in_kernel="mma_shared", gamma_on="w", forward=dict(_STACKED, stream_k=0,
                                                                                   delay_release=0)),
    "mma_shared_d0_sk4": dict(stats_in_kernel="mma_shared", gamma_on="w", forward=dict(_STACKED, stream_k=4,
                                                                                       delay_release=0)),
    "mma_shared_sk4": dict(stats_in_kernel="mma_shared", gamma_on="w", forward=dict(_STACKED, stream_k=4,
                                                                                    delay_release=1)),
    # gamma in the registers with r's squares taken from those registers (squares_from="operand") instead of the x
    # block loaded again after the wgmma's issue: in the row blocks' first tiles (shared), or every tile its own r
    # (elementwise, or per row at each step), whole tiles or the last round cut by K steps
    "gamma_a_mma_shared_operand": dict(VARIANTS_SHARED["gamma_a_mma_shared"], squares_from="operand"),
    "gamma_a_mma_operand": dict(gamma_on="a", stats_in_kernel="mma", squares_from="operand",
                                forward=dict(_STACKED, stream_k=0, delay_release=1)),
    "gamma_a_mma_rows_operand": dict(gamma_on="a", stats_in_kernel="mma_rows", squares_from="operand",
                                     forward=dict(_STACKED, stream_k=0, delay_release=1)),
    "gamma_a_mma_operand_sk4": dict(gamma_on="a", stats_in_kernel="mma", squares_from="operand",
                                    forward=dict(_STACKED, stream_k=4, delay_release=1)),
    # on the entry as it is: r's squares from the operand, and where the other tiles wait for r (combine them:
    # "squares_operand+fwd_wait0")
    "squares_operand": dict(squares_from="operand"),
    # gamma on w (w_γ by XLA: 2KN bytes each way) so that A stays in shared memory, which lets the output leave
    # under the next tile's first wgmma as the plain core's does (an a_operand's wgmma ptxas serializes beside it);
    # r shared as in the entries (the first column's tiles observe the x blocks), waiting for each wgmma or one
    # group in flight, the output stored at the tile's end for comparison
    # (dgamma from the dw kernel: the K side's dgamma from u needs gamma off w); and the entry as it is with its
    # output under the next tile (beside the a_operand ptxas serialized that wgmma on the H100, without share_rows)
    **{f"gamma_w_shared_{store}{suffix}": dict(gamma_on="w", stats_in_kernel="mma_shared", squares_from="observe",
                                               dgamma_from=None,
                                               forward=dict(delay_release=delay, epilogue_store=store_form))
       for store, store_form in (("next", "next_tile"), ("end", "end")) for suffix, delay in (("", 0), ("_d1", 1))},
    "fwd_next": dict(forward=dict(epilogue_store="next_tile")),
    # on the entry as it is: two wgmma groups in flight (three register blocks of the a_operand), the last round's
    # tiles cut into 2 or 8 K ranges instead of 4
    "fwd_d2": dict(forward=dict(delay_release=2)),
    # the output's left half stored at the tile's end (two pieces, into free slots), its right half kept in registers
    # and stored under the next tile's first wgmma: half the registers of "next_tile" beside the a_operand's
    "fwd_split": dict(forward=dict(epilogue_store="split")),
    "fwd_end": dict(forward=dict(epilogue_store="end")),  # (the entries before the split store at 32768x4096x4096)
    **{f"fwd_sk{split}": dict(forward=dict(stream_k=split)) for split in (0, 1, 2, 8)},
    # (the row blocks' first tiles one or two groups of 8 row blocks ahead of their others, each tile through a loop
    # of 0 or 1 trips per kind: ``shared_rows_lead`` at 8210289, "fwd_lead1", "fwd_lead2", 4-15 µs slower than the
    # first column first at the three shapes: rmsnorm_matmul_configs_lead-h200-8210289.json; removed after it)
    **{f"fwd_wait{lag}": dict(forward=dict(shared_rows_wait=lag)) for lag in (0, 1, 2, 8)},
    # the tile input through the stage ring beside stream-K (the owner loads it after its own segment's steps):
    # the dw kernel's w tile at 4 stages where its last round is part-empty (4096x2048x11008: 5.2 rounds), the dx
    # kernel's x tile at 4 stages, or with y's blocks beside dy's (the row dot by TMA) at 3
    "dw_ring4_sk": dict(dw=dict(tile_input_in="ring", num_stages=4, stream_k=4)),
    "dx_ring4_sk": dict(dx=dict(stream_k=4, tile_input_in="ring", num_stages=4)),
    "dx_ring4": dict(dx=dict(stream_k=0, tile_input_in="ring", num_stages=4)),  # (the model shapes: one round)
    # where 256 does not divide N (16384x1024x5504: 5504 = 43 x 128): the dw kernel's 128x128 tiles stacked, with
    # stream-K (344 output tiles, 2.6 rounds), its tile input in a buffer or through the ring; the forward's
    # cooperative 128x128 tiles stacked, with stream-K
    "dw128_sk": dict(dw=dict(_OWN, tile_m=64, tile_n=128, wg_split="m", grid_minor="m", schedule="cooperative",
                             num_stages=6, stream_k=4, delay_release=0, tile_input_in="buffer")),
    "dw128_ring_sk": dict(dw=dict(_OWN, tile_m=64, tile_n=128, wg_split="m", grid_minor="m", schedule="cooperative",
                                  num_stages=6, stream_k=4, delay_release=0, tile_input_in="ring")),
    # (our dw kernel where the rule gives dw's GEMM to cuBLAS, "dwk" with 256-wide tiles spread over 3 blocks each by
    # stream-K, "dw256_sk": 45.2 µs against cuBLAS's 39.0 at 8192x512x2816, 34.4 against 12.8 at 8192x512x768; with
    # 128x128 tiles, 88 of them, no stream-K plan: 64.6; rmsnorm_matmul_configs_dw_stream_k_small-h200-90037cc.json.
    # The ping-pong forward's K loops issued in turn, "fwd_turns" at tag mma-turns-measured-b88b75c: forward 39.6
    # against 38.6 µs at 8192x512x2816, 261.5 against 258.8 at 16384x1024x5504;
    # rmsnorm_matmul_configs_fwd_turns-h200-b88b75c.json. Both removed.)
    # ping-pong 128x128 forward tiles where the entry's are cooperative (the plain core at 4096x2048x11008: 238.5 µs
    # ping-pong against 247.2 cooperative, 240.2 its default; mosaic_gemm_tiles_1b_mlp-h200-787f555.json); in the
    # entry's tile strips of one (fwd_pp) the forward took 290.3 against 250.8 µs, in strips of 8 245.5 against 245.6
    # (rmsnorm_matmul_configs_1b_mlp_fwd_pp{,_w8}-h200-{76ad550,5b95307}.json)
    "fwd_pp": dict(forward=dict(_OWN, tile_m=128, tile_n=128, wg_split="n", grid_minor="m", schedule="pingpong",
                                num_stages=6, delay_release=1, memory_warps=1)),
    "fwd_pp_w8": dict(forward=dict(_OWN, tile_m=128, tile_n=128, wg_split="n", grid_minor="m", grid_tile_width=8,
                                   schedule="pingpong", num_stages=6, delay_release=1, memory_warps=1)),
    # the 16384x1024x5504 entry's ping-pong forward (each warpgroup a whole 128x128 tile, its epilogue under the
    # other's wgmma) where the short-K rule takes r from XLA's pass: stored at each tile's end
    "fwd_pp_end": dict(forward=dict(_OWN, tile_m=128, tile_n=128, wg_split="n", grid_minor="m", grid_tile_width=8,
                                    schedule="pingpong", num_stages=6, delay_release=1, memory_warps=1,
                                    epilogue_store="end")),
    # knobs beside it at short K (combine: "fwd_pp_end+fwd_w4", ...)
    "fwd_w4": dict(forward=dict(grid_tile_width=4)),
    "fwd_minor_n": dict(forward=dict(grid_minor="n")),
    "fwd_s4": dict(forward=dict(num_stages=4)),
    "fwd_k128_s3": dict(forward=dict(tile_k=128, num_stages=3)),
    # the output stored in 64x128 pieces (half as many stores, each piece's slot waiting for the store two pieces
    # earlier: dB's 16-deep step gained 8% so, NOTES.md seventy-seventh session), a stage given up for the slots
    "fwd_e128_s5": dict(forward=dict(epi_tile_n=128, num_stages=5)),
    "gamma_a_shared128": dict(gamma_on="a", stats_in_kernel="mma_shared", squares_from="operand", forward=dict(
        _OWN, tile_m=64, tile_n=128, wg_split="m", grid_minor="m", schedule="cooperative", num_stages=6,
        delay_release=1)),
    # (at 16384x1024x5504 none beat the entry's γ on x: forward µs 264.4 with γ on w, 484.1 with the statistics
    # warpgroup, 289.0 with r shared, 311.9 with γ in the registers and r shared, against 261.6:
    # rmsnorm_matmul_configs_mlp1024_{gamma_w-h200-bfe8723,gamma_a-h200-d2f0f12}.json)
    "gamma_on_w": dict(gamma_on="w", stats_in_kernel=False),  # w_γ (2KN bytes) and XLA's r, x read as it is
    "mma_shared128": dict(stats_in_kernel="mma_shared", gamma_on="w", squares_from="observe", forward=dict(
        _OWN, tile_m=64, tile_n=128, wg_split="m", grid_minor="m", schedule="cooperative", num_stages=6,
        delay_release=1)),
    "fwd128_sk": dict(forward=dict(_OWN, tile_m=64, tile_n=128, wg_split="m", grid_minor="m",
                                   schedule="cooperative", num_stages=6, stream_k=4, delay_release=0)),
    "row_dot_tma_sk": dict(row_dot="n", row_dot_in_dx="tma", dyr_in_dx=None, dgamma_from=None, dx_in_kernel=False,
                           dx=dict(stream_k=4, tile_input_in="ring", num_stages=3), dw=dict(tile_input_in="ring")),
    # (the first tiles' row dot as the diagonal of a second wgmma per step, dy · yᵀ, instead of dy and y loaded into
    # registers: row_dot_in_dx="wgmma", gemm.Fusion.beside_dot at aebd95d, reverted; "row_dot_wgmma": the dx kernel
    # 578.3 against 578.5 µs at 8192x4096x6144, rmsnorm_matmul_configs_row_dot_wgmma_6144-h200-aebd95d.json; at
    # 32768x4096x4096 that call's variants inherited the entry's 4 dx stages and fell back to XLA's pass)
    # the kernels' tile order (planar snake): strips of w row blocks (minor "m") or w column blocks (minor "n"),
    # which sets how often the other operand streams from HBM (the entries: minor "m", w = 8)
    **{f"{prefix}_{minor}{w}": {kernel: dict(grid_minor=minor, grid_tile_width=w)}
       for kernel, prefix in (("forward", "fwd"), ("dx", "dx"), ("dw", "dw"))
       for minor, widths in (("m", (4, 8, 16, 32)), ("n", (4, 8, 16))) for w in widths},
    # each kernel's loads from one warp of its memory warpgroup (``MosaicGemmConfig.memory_warps``; no stream-K)
    **{f"{prefix}_mw1": {kernel: dict(memory_warps=1)} for kernel, prefix in (("forward", "fwd"), ("dx", "dx"),
                                                                                ("dw", "dw"))},
    # (and back to all four: the entries that take one warp, against their four-warp form)
    **{f"{prefix}_mw4": {kernel: dict(memory_warps=4)} for kernel, prefix in (("forward", "fwd"), ("dx", "dx"),
                                                                                ("dw", "dw"))},
    **{f"{prefix}_sk0": {kernel: dict(stream_k=0)} for kernel, prefix in (("forward", "fwd"), ("dx", "dx"),
                                                                            ("dw", "dw"))},
    # r from the MMA warpgroups beside the ping-pong forward tiles (each warpgroup a whole 128x128 tile): its x
    # block's squares after each wgmma's issue (gamma on w: no XLA pass over x), summed elementwise ("mma") or per row
    # ("mma_rows"); or gamma in the registers (A from them), r from XLA or from the same registers. All slower at
    # 16384x1024x5504 (forward µs 1275.1, 333.2, 295.2, 992.7, 340.9 against the entry's 260.2:
    # rmsnorm_matmul_configs_mlp1024_pingpong_stats-h200-d63ded2.json)
    # the K side's dx finished by the dx kernel: each row's tiles sum their row-dot parts through global semaphores
    # (gemm.Fusion.sum_rows) and write dx; no u, no XLA pass over u and x (the 16384x1024x5504 entry's since 2b564d9)
    "dx_in_kernel": dict(dx_in_kernel=True),
    "dx_finish_xla": dict(dx_in_kernel=False),  # (against an entry that takes it: XLA's pass as before)
    # an N-side entry (or one taking dgamma from u) moved to the K side with the dx kernel finishing dx; dgamma from
    # the dw kernel's epilogue, whole dx tiles (sum_rows takes no stream-K)
    "k_dx_in_kernel": dict(row_dot="k", dyr_in_dx=True, row_dot_in_dx=False, dgamma_from=None, dx_in_kernel=True,
                           dx=dict(stream_k=0)),
    "k_dx_finish_xla": dict(row_dot="k", dyr_in_dx=True, row_dot_in_dx=False, dgamma_from=None, dx_in_kernel=False,
                            dx=dict(stream_k=0)),
    # the dw GEMM xrᵀ @ dy, xr = (r / s) ⊙ x written by the dx kernel's epilogue from its x tile (gemm.Fusion.tile_copy)
    # instead of dyr copied from its dy blocks in the K loop
    "xr_in_dx": dict(dyr_in_dx=None, xr_in_dx=True),
    # (removed, code at 8abe919: ``xr_in_dx="xla"``, xr formed by XLA for the dw GEMM and nothing written for it by
    # the dx kernel; "xr_by_xla", forward + backward µs against the entries: 134.9 / 128.4 at 8192x512x2816, 60.3 /
    # 55.7 at 8192x512x768, 735.3 / 730.8 at 4096x2048x11008, 773.7 / 757.0 at 16384x1024x5504: XLA ran xr as a
    # pass of its own (6.1 µs at 8192x512x2816) beside cuBLAS's dw GEMM, and the dx kernel gained 0.7 µs there:
    # rmsnorm_matmul_configs_xr_by_xla-h200-8abe919.json)
    "k_xr_dx_in_kernel": dict(row_dot="k", dyr_in_dx=None, xr_in_dx=True, row_dot_in_dx=False, dgamma_from=None,
                              dx_in_kernel=True, dx=dict(stream_k=0)),
    # (removed, code at 1235333: ``row_dot_slices``, gemm.Fusion.slice_part: every dx tile summed dy · y over its
    # share of N's steps, its K loop turned by its column block, and the row's tiles summed the parts, so none waited
    # for a partner's K loop; "n_slices" (y loaded into registers), "n_slices_tma" (beside dy's by TMA), "slices".
    # Slower at both shapes measured: the dx kernel 1717.8 / 1784.7 against the entry's 1582.3 µs at
    # 32768x4096x4096, 623.8 against 586-591 at 8192x4096x6144: each observed step cost about a step more, the
    # turned loop 12 µs, and the wait it removed was about 2k cycles a tile; NOTES.md, forty-sixth session)
    # (removed, code at d580ef7: ``MosaicGemmConfig.sum_rows_later``, the K side's dx finished under the block's next
    # tile, u stored at the tile's end and read back from GMEM with x; "dx_later{1,4,8}": the dx kernel 1749.7 /
    # 1758.8 / 1765.1 against the entry's 1563.7 µs at 32768x4096x4096, its 4-byte loads and stores competing with
    # the next tile's operand streams; one GPU test failed at 4096x2048x11008: NOTES.md, forty-sixth session)
    # the dx kernel's x tile in buffers of its own, 3 stages: 4277.0 against the entry's 4281.5 µs at 32768x4096x4096
    # (the dx kernel 1550.0 / 1557.9), prefetched under the tile's first wgmma 4294.3 against 4288.9 (a timing switch
    # at 0ee5e84, removed; rmsnorm_matmul_configs_dx_buf3-h200-0ee5e84.json, toggle_ab_prefetch_under_first-h200-
    # 0ee5e84.json: NOTES.md, forty-seventh session)
    "dx_buf3": dict(dx=dict(tile_input_in="buffer", num_stages=3)),
    # (removed: "dx_defer", this form with the row sum's wait, the finish and the store deferred under the next
    # tile's first wgmmas, u held in registers as bfloat16; correct, the dx kernel 1585.2 µs against 1545.8 for this
    # form and 1524.2 for the entry at 32768x4096x4096: defer_ab_dx_finish-h200-531b394.json, tag
    # dx-finish-deferred-measured-531b394)
    # the dx kernel on cooperative 128x128 tiles (64x128 a warpgroup: 64 registers of accumulator, so that a tile's u
    # could stay in registers beside the next tile's K loop), the row sum over 32 column blocks: the dx kernel 1942.1
    # (4 stages) / 1740.5 (6) against the entry's 1589.2 µs at 32768x4096x4096 (rmsnorm_matmul_configs_dx128-h200-
    # 6df47bf.json: NOTES.md, forty-eighth session)
    **{f"dx128_s{stages}": dict(dx=dict(tile_n=128, num_stages=stages)) for stages in (4, 6)},
    "dw3": dict(dw=dict(num_stages=3)),  # (beside "dw_ring": the dw kernel's w tile, for dgamma, in its stages)
    # (removed, code at 63cde2c: ``xr_in_forward``, the VJP's forward writing xr = r ⊙ x from its A blocks with gamma
    # on w, the dw GEMM xrᵀ @ dy, no dyr copied by the dx kernel; "xr_in_forward", forward + backward µs against the
    # entry: 772.9 / 766.8 and 808.1 / 797.4 at 16384x1024x5504, 761.4 / 737.9 and 785.6 / 763.3 at 4096x2048x11008,
    # equal at 8192x512x2816: rmsnorm_matmul_configs_xr_in_forward{,_slots}-h200-{dcf6585,63cde2c}.json)
    "pp_mma": dict(stats_in_kernel="mma", gamma_on="w"),
    "pp_mma_rows": dict(stats_in_kernel="mma_rows", gamma_on="w"),
    # (removed, code at the tag pp-mma-shared-measured-c95fb85: "pp_mma_shared", r from each row block's first
    # ping-pong tile, gamma on w: forward 289.1 against 258.5 µs at 16384x1024x5504, 51.2 against 38.1 at
    # 8192x512x2816, 280.0 against 249.6 at 4096x2048x11008 (cooperative there); waiting after the K loop 297.4 / 44.8:
    # rmsnorm_matmul_configs_pp_mma_shared{,_wait}-h200-c95fb85.json)
    # (removed: "dx_row_whole*", the dx kernel's block holding a row's whole K = 512, two 64x256 accumulators side by
    # side (wg_split "n"; tile_k 32 with 4 or 3 stages, tile_k 64 with 2), so that a row's parts are summed within
    # one block: forward + backward 141.9 / 150.4 / 148.6 against the entry's 129.1 µs at 8192x512x2816, 58.7 / 60.6
    # / 57.7 against 55.8 at 8192x512x768: rmsnorm_matmul_configs_dx_row_whole-h200-7c2dbe0.json)
    "pp_gamma_a": dict(gamma_on="a", stats_in_kernel=False),
    "pp_gamma_a_mma": dict(gamma_on="a", stats_in_kernel="mma", squares_from="operand"),
    "pp_gamma_a_mma_rows": dict(gamma_on="a", stats_in_kernel="mma_rows", squares_from="operand"),
}


# A tuned H200 entry taken whole to other shapes ("like_<M>x<K>x<N>"): what the built-in tables were up against at
# shapes no entry covers (rmsnorm_matmul_configs_untuned*-h200-*.json; since then the H200 takes the 8192x4096x6144
# entry there, so "default" at those shapes is "like_8192x4096x6144": norm_matmul.config.UNTUNED_FROM).
_H200_ENTRIES = tuning.load_cache(tuning.DEFAULT_CACHE_PATH)["entries"].get("NVIDIA H200", {}).get(
    "mosaic", {}).get(nm_config.OP, {})
VARIANTS.update({"like_" + key.split("[")[1].rstrip("]").replace("M=", "").replace(",K=", "x").replace(",N=", "x"):
                 dict(entry["params"]) for key, entry in _H200_ENTRIES.items()
                 if "M=1," not in key and key.endswith("]")})  # (not one row, not "+res")


def combined(name: str) -> dict:
    """The changes of a variant name, or of "a+b+...": each part's changes in turn (a later part's wins; the
    "forward", "dx" and "dw" changes merged field by field)."""
    changes = {}
    for part in name.split("+"):
        for key, value in VARIANTS[part].items():
            changes[key] = dict(changes.get(key, {}), **value) if key in ("forward", "dx", "dw") else value
    return changes


def variant_config(M: int, K: int, N: int, changes: dict):
    """The shape's default Mosaic config with ``changes``; the statistics warpgroup's forward tiles when asked. An
    entry's r squared from the a_operand's registers (squares_from "operand") falls back to "observe" where the
    changes take gamma out of the registers or r out of the MMA warpgroups without naming squares_from; an entry's
    xr from the dx kernel (xr_in_dx) gives way to changes asking for dyr from it (dyr_in_dx True) without naming
    xr_in_dx."""
    base = nm_config.mosaic_default_config(M, K, N, jnp.bfloat16)
    takes_operand = (changes.get("gamma_on", base.gamma_on) == "a"
                     and changes.get("stats_in_kernel", base.stats_in_kernel) in nm_config.MMA_STATS)
    if "squares_from" not in changes and not takes_operand:
        base = dataclasses.replace(base, squares_from="observe")
    if changes.get("stats_in_kernel") is True and (base.forward.wg_split != "n" or base.forward.pingpong):
        base = dataclasses.replace(base, forward=nm_config.mosaic_default_config(
            M, K, N, jnp.bfloat16, stats_in_kernel=True).forward)
    if changes.get("dyr_in_dx") is True and "xr_in_dx" not in changes:
        base = dataclasses.replace(base, xr_in_dx=False)
    changes = dict(changes)
    kernels = {k: dataclasses.replace(getattr(base, k), **changes.pop(k, {})) for k in ("forward", "dx", "dw")}
    return dataclasses.replace(base, **kernels, **changes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="32768x4096x4096,4096x4096x14336,8192x4096x6144-qkv",
                        help="names of the suite's shapes (jaxfuse.suites.rmsnorm_matmul.SHAPES) or custom MxKxN "
                        "ones, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help='of VARIANTS, comma-separated, or "builtin"')
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="of the suite's modes, comma-separated")
    args = parser.parse_args()
    unknown = sorted({p for v in args.variants.split(",") if v != "builtin" for p in v.split("+")} - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)} (joined by '+'), or "
                     f"'builtin' alone")
    spec = suite.SPEC
    for name in args.shapes.split(","):
        try:
            spec.shape(name)
        except ValueError as error:
            parser.error(f"--shapes: {error}")
    impls = spec.implementations()
    dev = costmodel.detect()
    result, save, path = results_file(args.out, "rmsnorm_matmul_configs")
    for name in args.shapes.split(","):
        shape = spec.shape(name)
        M, K, N = shape["M"], shape["K"], shape["N"]
        row = dict(shape=name, M=M, K=K, N=N)
        with recorded_row(result, save, row):
            sets = input_sets(spec, shape, dev)
            inputs = sets[0]
            fns = {}
            for variant in args.variants.split(","):
                try:  # a variant this shape's config cannot take is recorded, not timed; the others still run
                    config = nm_config.mosaic_builtin_config(M, K, N) if variant == "builtin" else \
                        variant_config(M, K, N, combined(variant))
                    fn = lambda *a, _c=config: pallas_kernels.rmsnorm_matmul(*a, backend="mosaic", block_sizes=_c)
                    jax.eval_shape(jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)),
                                   *inputs[:spec.num_args])
                except ValueError as error:
                    row.setdefault("skipped", {})[variant] = str(error)
                    print(name, "skipped", variant, error, flush=True)
                    continue
                row.setdefault("configs", {})[variant] = config.to_dict()
                if config.row_dot_in_dx and not config.row_dot_by_dx(jnp.bfloat16, residual=False):  # said, not hidden
                    fallback = (f"row_dot_in_dx={config.row_dot_in_dx!r} falls back to XLA's row-dot pass: y's "
                                f"stages do not fit beside the dx kernel's {config.dx.num_stages}")
                    row.setdefault("fallbacks", {})[variant] = fallback
                    print(name, "fallback", variant, fallback, flush=True)
                fns[variant] = fn
            fns["xla"], fns["xla_matmul_alone"] = impls["xla"], impls["xla_matmul_alone"]
            for mode in args.modes.split(","):
                mode_sets = [s[:spec.num_args] if mode == "fwd" else s for s in sets]
                args_ = mode_sets[0]
                programs = {k: jax.jit(spec.program(fn, mode, shape, {})) for k, fn in fns.items()}
                outs = {k: [np.asarray(o, np.float32) for o in jax.tree.leaves(p(*args_))]
                        for k, p in programs.items() if k not in ("xla", "xla_matmul_alone")}
                ref = outs.get("default")
                timings = bench.time_interleaved([(p, mode_sets) for p in programs.values()],
                                                 iterations=args.iterations)
                section = {}
                for k, t in zip(programs, timings):
                    top = sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:6]
                    section[k] = dict(us=t.median_us, top_kernels=top)
                    if ref is not None and k in outs:
                        section[k]["max_rel_diff_vs_default"] = bench.max_difference(zip(outs[k], ref),
                                                                                    relative=True)
                base = section["xla"]["us"]
                section["speedup_vs_xla"] = {k: base / v["us"] for k, v in section.items() if k != "xla"}
                row[mode] = dict(section, input_sets=len(sets))
                print(name, mode, {k: round(v, 3) for k, v in section["speedup_vs_xla"].items()},
                      {k: round(v["us"], 1) for k, v in section.items() if isinstance(v, dict) and "us" in v},
                      flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
