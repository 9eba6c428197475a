"""RMSNorm→matmul configs of both backends: the Triton kernels' RMSNormMatmulConfig and the Mosaic kernels'
MosaicRMSNormMatmulConfig, the tuning-cache key, the default config of a call and the sweep's candidates.

  config = default_config(M, K, N, jnp.bfloat16)        # Triton: tuned entry for this device and shape, else the table
  forward, backward = sweep_candidates(32768, 4096, 4096)   # for `jaxfuse bench --tune`
  mosaic = mosaic_default_config(M, K, N, jnp.bfloat16)      # Mosaic: tuned entry if its tiles fit, else the tables
  builtin = mosaic_builtin_config(M, K, N)                   # the tables' tiles and forms alone
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import mosaic_utils, tuning
from pallas_kernels import triton_utils as tu
from pallas_kernels.gemm import GEMV, MosaicGemmConfig, gemv_config, pick_config, smem_bytes, stream_k
from pallas_kernels.gemm.config import BARRIER_BYTES, PARTIAL_ROWS_MULTIPLE, any_rows_reason, sum_rows_grid
from pallas_kernels.gemm import unsupported_reason as gemm_unsupported_reason

__all__ = ["FORWARD_FIELDS", "MOSAIC_FORWARD_FIELDS", "MosaicRMSNormMatmulConfig", "RMSNormMatmulConfig",
           "default_config", "fit_to_shape", "mosaic_builtin_config", "mosaic_default_config",
           "mosaic_sweep_candidates", "shape_key", "sweep_candidates"]

OP = "rmsnorm_matmul"  # the op's name in the tuning cache
# Config fields of the forward kernel: forward sweep candidates vary these, backward candidates the others.
FORWARD_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "gamma_on_w", "split_k")


@dataclasses.dataclass(frozen=True)
class RMSNormMatmulConfig:
    """Tiles and launch parameters of the three kernels (one static argument, hashable).

    Attributes:
      block_m, block_n, block_k: forward: a (block_m, block_n) tile of y per program, K streamed in block_k slices.
      num_warps, num_stages: Triton launch parameters of the forward kernel.
      gamma_on_w: forward variant: fold gamma into a scaled copy of w (one XLA pass over w, 4KN bytes) so the A
        operand is x itself; otherwise the A tile is scaled by gamma in registers. Without a residual this
        variant also takes r from one XLA row reduction over x (2MK bytes): a raw loaded tile must not feed both
        the dot and the sum of squares (Triton's pipeliner miscompiles that; see ``_forward``).
      split_k: forward programs per output tile, each streaming K / split_k of K (decode: few rows give too few
        output tiles to keep enough loads of w in flight). The split partials (split_k, M, N) float32 and their
        sums of squares are combined by one small XLA fusion. (K / split_k) must be a multiple of block_k.
      block_m_dx, block_k_dx, block_n_dx: dx kernel: a (block_m_dx, block_k_dx) tile of dx, N streamed.
      num_warps_dx, num_stages_dx: its launch parameters.
      split_n_dx: dx programs per (block_m_dx, block_k_dx) tile, each streaming N / split_n_dx of N; the float32
        partials (split_n_dx, M, K) are combined, and the dx epilogue and dgamma applied, by one XLA fusion
        (decode: few rows give too few dx tiles to keep enough loads of w in flight). Needs rowdot_in_dx=False.
      rowdot_in_dx: compute c = Σ_N(dy · y) / K inside the dx kernel (every column program of a row block redoes
        it: cheap for few rows) instead of in a separate XLA fusion.
      block_k_dw, block_n_dw, block_m_dw: dw kernel: a (block_k_dw, block_n_dw) tile of dw, M streamed.
      num_warps_dw, num_stages_dw: its launch parameters.
      rstd_on_dy: dw variant: scale the dy tile by r in registers instead of the x tile.
      dw_in_xla: compute dw = γ ⊙ ((x·r)ᵀ @ dy) with XLA (its GEMM recomputes x·r as an operand, fused or as
        one elementwise pass) instead of the Pallas dw kernel: a plain GEMM of this size is XLA's strength.
      dw_in_dx: the dx kernel also writes dw, with no dw kernel (decode: M <= block_m_dx, so a dx program holds
        every row): each step's (block_k_dx, block_n_dx) w tile is the tile of dw it writes, γ ⊙ ((x·r)ᵀ @ dy)
        from the dy tile the step loaded. One kernel streams w in and dw out, 4KN bytes, where the dx and dw
        kernels each paid their own launch, ramp and tail. Needs dw_in_xla=False.
      group: program order in all kernels: groups of `group` row blocks sweep the column blocks together, so the
        tiles they share stay in L2.
    Block sizes are powers of two >= 16; the K and N blocks must divide K and N (checked per call).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    gamma_on_w: bool = False
    split_k: int = 1
    block_m_dx: int = 128
    block_k_dx: int = 128
    block_n_dx: int = 64
    num_warps_dx: int = 8
    num_stages_dx: int = 3
    split_n_dx: int = 1
    rowdot_in_dx: bool = False
    block_k_dw: int = 128
    block_n_dw: int = 128
    block_m_dw: int = 64
    num_warps_dw: int = 8
    num_stages_dw: int = 3
    rstd_on_dy: bool = False
    dw_in_xla: bool = False
    dw_in_dx: bool = False
    group: int = 8

    def __post_init__(self):
        tu.check_launch_fields(self)  # block_*, num_warps*, num_stages*
        for name in ("group", "split_k", "split_n_dx"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RMSNormMatmulConfig.{name}: must be an int >= 1, got {value!r}")
        for name in ("gamma_on_w", "rowdot_in_dx", "rstd_on_dy", "dw_in_xla", "dw_in_dx"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RMSNormMatmulConfig.{name}: must be a bool, got {getattr(self, name)!r}")

        if self.split_n_dx > 1 and self.rowdot_in_dx:
            raise ValueError("RMSNormMatmulConfig: split_n_dx > 1 needs rowdot_in_dx=False (c comes from XLA)")
        if self.dw_in_dx and self.dw_in_xla:
            raise ValueError("RMSNormMatmulConfig: dw_in_dx and dw_in_xla both name who computes dw; set one")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_shape(self, K: int, N: int, M: int | None = None) -> None:
        """ValueError naming the field if a K or N block does not divide K or N, or if dw_in_dx is set and
        M (when given) needs more than one row block."""
        if self.dw_in_dx and M is not None and M > self.block_m_dx:
            raise ValueError(f"block_sizes: dw_in_dx needs every row in one dx row block: M={M} > "
                             f"block_m_dx={self.block_m_dx}")
        for name in ("block_k", "block_k_dx", "block_k_dw"):
            if K % getattr(self, name):
                raise ValueError(f"block_sizes: {name}={getattr(self, name)} must divide K={K}")
        if K % (self.split_k * self.block_k):
            raise ValueError(f"block_sizes: split_k={self.split_k} times block_k={self.block_k} must divide K={K}")
        if N % (self.split_n_dx * self.block_n_dx):
            raise ValueError(f"block_sizes: split_n_dx={self.split_n_dx} times block_n_dx={self.block_n_dx} must "
                             f"divide N={N}")
        for name in ("block_n", "block_n_dx", "block_n_dw"):
            if N % getattr(self, name):
                raise ValueError(f"block_sizes: {name}={getattr(self, name)} must divide N={N}")


# Built-in starting points (H100, bf16); the JSON tuning cache overrides them per shape.


def shape_key(M: int, K: int, N: int, dtype, *, residual: bool = False) -> str:
    """Tuning-cache key: dtype, M rounded up to a power of two (at least 16, but one row keeps its own: its Mosaic
    forward is a GEMV of another form, ``mosaic_gemv``), K, N, and whether a residual is added."""
    rows = 1 if M == 1 else max(16, pl.next_power_of_2(M))
    return f"{jnp.dtype(dtype).name}[M={rows},K={K},N={N}]" + ("+res" if residual else "")


def fit_to_shape(params: Mapping, M: int, K: int, N: int) -> dict:
    """Shrinks table/cache tiles to the shape: K and N blocks to divisors (the largest power of two dividing K or
    N is >= 16 since both are multiples of 16), M blocks to M rounded up. Never applied to explicit block_sizes."""
    out = dict(params)
    k_div, n_div, m_cap = K & -K, N & -N, max(16, pl.next_power_of_2(M))
    for name in ("block_k", "block_k_dx", "block_k_dw"):
        out[name] = min(out[name], k_div)
    for name in ("block_n", "block_n_dx", "block_n_dw"):
        out[name] = min(out[name], n_div)
    for name in ("block_m", "block_m_dx", "block_m_dw"):
        out[name] = min(out[name], m_cap)
    split = out.get("split_k", 1)
    while split > 1 and K % (split * out["block_k"]):
        split //= 2
    out["split_k"] = split
    split = out.get("split_n_dx", 1)
    while split > 1 and N % (split * out["block_n_dx"]):
        split //= 2
    out["split_n_dx"] = split
    return out


def default_config(M: int, K: int, N: int, dtype=jnp.bfloat16, *, residual: bool = False,
                   on_gpu: bool | None = None) -> RMSNormMatmulConfig:
    """The config a call would use without ``block_sizes``: the tuning-cache entry for this device and shape if
    there is one, else the built-in table, fitted to the shape."""
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    params = tuning.lookup(OP, shape_key(M, K, N, dtype, residual=residual)) if on_gpu else None
    if params is None:
        params = tuning.rmsnorm_matmul_table(M, dtype, on_gpu=on_gpu)
    return RMSNormMatmulConfig(**fit_to_shape(params, M, K, N))


def sweep_candidates(M: int, K: int, N: int) -> tuple[list[dict], list[dict]]:
    """(forward candidates, backward candidates) around the table entry for a GPU sweep: forward candidates vary
    only forward fields, backward ones only dx/dw fields (each fitted to the shape, duplicates removed)."""
    decode = M <= tuning.DECODE_ROWS
    base = dict(default_config(M, K, N, on_gpu=True).to_dict())
    fwd, bwd = [], []
    if decode:
        # (block_n, block_k, warps, stages, split_k): narrow column tiles, or wide ones with K split over programs.
        # The wide tiles split 8 ways won on the H200 (rmsnorm_matmul-sweep_decode-h200-def5b4b.json: 35.9 µs at
        # 1x4096x14336 against 37.3 for 128-column tiles split 4 ways), so more of them: more warps, stages or splits.
        for bn, bk, warps, stages, split in [(128, 128, 4, 4, 4), (256, 128, 4, 3, 8), (128, 64, 4, 4, 4),
                                             (128, 128, 4, 3, 4), (64, 128, 4, 4, 8), (64, 64, 4, 4, 16),
                                             (256, 64, 4, 4, 8), (128, 256, 4, 3, 4), (32, 256, 4, 4, 1),
                                             (256, 64, 8, 4, 8), (256, 64, 4, 4, 16), (256, 32, 4, 6, 8),
                                             (256, 64, 4, 6, 8), (512, 64, 4, 4, 8), (512, 64, 8, 4, 8),
                                             (512, 32, 8, 6, 8), (256, 128, 8, 4, 8),
                                             # XLA's own GEMV tiles there: 128 columns, 8 warps, 3 stages, K
                                             # whole or split 2 (xla_gemm_configs_decode-h200-e5a3143.json; in
                                             # ours 37.3 µs at best against 34.4 for the entry's:
                                             # rmsnorm_matmul-sweep_decode_xla_tiles-h200-cde6561-log.txt)
                                             (128, 256, 8, 3, 1), (128, 128, 8, 3, 1), (128, 256, 8, 3, 2),
                                             (128, 128, 8, 4, 2), (256, 128, 8, 3, 2), (128, 64, 8, 6, 2)]:
            fwd.append(dict(base, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split))
        # dx: (block_k_dx, block_n_dx, split_n_dx, rowdot_in_dx)
        for bk, bn, split, rowdot in [(32, 256, 1, False), (64, 256, 4, False), (128, 256, 8, False),
                                      (64, 128, 8, False), (128, 128, 16, False), (32, 256, 4, False),
                                      (32, 256, 1, True), (64, 256, 8, False), (128, 256, 4, False),
                                      (256, 128, 8, False), (128, 128, 8, False)]:
            bwd.append(dict(base, block_k_dx=bk, block_n_dx=bn, split_n_dx=split, rowdot_in_dx=rowdot,
                            dw_in_dx=False))
        for bk, bn in [(32, 128), (128, 128), (64, 256), (64, 128), (128, 256), (256, 128), (32, 256)]:
            bwd.append(dict(base, block_k_dw=bk, block_n_dw=bn, dw_in_dx=False))
        if M <= base["block_m_dx"]:  # dw written by the dx kernel: (block_k_dx, block_n_dx, split_n_dx)
            for bk, bn, split in [(32, 256, 1), (64, 256, 1), (32, 128, 1), (64, 128, 2), (32, 256, 2),
                                  (128, 128, 4), (64, 256, 4), (32, 128, 4)]:
                bwd.append(dict(base, block_k_dx=bk, block_n_dx=bn, split_n_dx=split, rowdot_in_dx=False,
                                dw_in_dx=True))
    else:
        # gamma folded into w (a plain GEMM plus the XLA statistic), and one tile with gamma applied in registers
        # (2x slower on the H100 in every sweep).
        for bm, bn, bk, warps, stages in [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 4),
                                          (128, 128, 64, 4, 4), (128, 128, 64, 8, 4)]:
            fwd.append(dict(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                            gamma_on_w=True))
        fwd.append(dict(base, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, gamma_on_w=False))
        for bm, bk, bn, warps, stages in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
                                          (64, 128, 64, 4, 4)]:
            bwd.append(dict(base, block_m_dx=bm, block_k_dx=bk, block_n_dx=bn, num_warps_dx=warps,
                            num_stages_dx=stages))
        bwd.append(dict(base, rowdot_in_dx=True))
        for bk, stages in [(128, 3), (256, 3)]:  # dw by XLA, dx by the Pallas kernel
            bwd.append(dict(base, block_k_dx=bk, num_stages_dx=stages, dw_in_xla=True))
        for bk, bn, bm, warps, stages, on_dy in [(128, 128, 64, 8, 3, False), (128, 128, 64, 8, 3, True),
                                                 (128, 256, 64, 8, 3, False), (128, 128, 32, 4, 4, False)]:
            bwd.append(dict(base, block_k_dw=bk, block_n_dw=bn, block_m_dw=bm, num_warps_dw=warps,
                            num_stages_dw=stages, rstd_on_dy=on_dy))

    def unique(cands):
        fitted = [fit_to_shape(c, M, K, N) for c in cands]
        return list({tuple(sorted(c.items())): c for c in fitted}.values())

    return unique(fwd), unique(bwd)


# ---------------------------------------------------------------------------------------------------------------
# Mosaic backend (``norm_matmul.mosaic``): three GEMMs of the core in ``pallas_kernels.gemm``
# ---------------------------------------------------------------------------------------------------------------
MOSAIC_FORWARD_FIELDS = ("forward", "stats_in_kernel", "gamma_on", "squares_from")
MMA_STATS = ("mma", "mma_rows", "mma_shared")  # stats_in_kernel values whose sums of squares the MMA warpgroups take
SQUARES_FROM = ("observe", "operand")  # where those sums read x (MosaicRMSNormMatmulConfig.squares_from)
# dw's GEMM (K, M) @ (M, N) goes to cuBLAS when its output has fewer CTA tiles than the H100 has SMs: the persistent
# core, without split-K, leaves SMs idle over the long M reduction, which cuBLAS splits. Measured at one shape,
# 8192x512x2816 (the 'small' preset's MLP projection; 44 tiles of 128x256, 88 of 128x128): fwd+bwd 180.7 µs with
# cuBLAS's dw (38.9 µs of it; rmsnorm_matmul-models-h100-e32b86c.json), 181.7 with the tuned ping-pong dw kernel and
# 212 with cooperative dx and dw kernels (rmsnorm_matmul-sweep-mosaic-models-h100-f7b9c98.json): neutral there.
FEW_TILES = 132
# Where the backward takes its row dot unless a config names it (``row_dot_side``). Bytes outside the GEMMs (2-byte
# elements): the N side reads dy and y and writes dyr (6MN), and the dx kernel reads x and writes dx (4MK); the K
# side reads dy and writes dyr (4MN), the dx kernel reads x and writes u (4MK) and one XLA fusion reads u and x and
# writes dx (6MK). With dy an input (the op benchmarked alone) the K side moves less from N > 3K: measured on the
# H100 (rmsnorm_matmul_configs_row_dot-h100-74cf102.json, fwd+bwd µs, "n" → "k") 8192x4096x6144 1720 → 1766,
# 4096x4096x14336 1986 → 1996, 4096x2048x11008 850 → 842, 4096x2048x128256 9518 → 9137. In a model dy comes out of
# an XLA fusion, which then writes dyr in place of dy (the K side's (M, N) pass goes), while the N side's
# reduction over dy gets fused into that producer and slows it: in the 1b train step XLA fused the QKV
# projection's row dot with the attention backward's output into a reduction fusion costing 286 µs per layer,
# beside the 44 µs loop fusion that makes dy (4.6 ms of the step; rmsnorm_matmul_row_dot-h100-3278f6b.json). So the
# K side is the default; the tuned entries of shapes measured alone may name "n".
ROW_DOT_DEFAULT = "k"


@dataclasses.dataclass(frozen=True)
class MosaicRMSNormMatmulConfig:
    """The three GEMMs' configs and where the forward's row statistics come from (one static argument, hashable).

    forward: y = r ⊙ (x @ w_γ), an (M, K) @ (K, N) GEMM.  dx: (M, N) @ (N, K), the x tile (and dh) prefetched for
    the epilogue.  dw: (K, M) @ (M, N), the w tile prefetched for the epilogue. Each a ``MosaicGemmConfig`` (a
    mapping of its fields is converted, so tuned entries and ``block_sizes`` may give dicts).
    One row (M = 1, decode): ``forward`` tiles the transposed GEMV yᵀ = wᵀ @ (x ⊙ gamma)ᵀ
      (``norm_matmul.mosaic_gemv``: tile_m along N, tile_n 16, ``one_row_reason``), and the backward runs the Triton
      backend's kernels with that backend's config for the shape: dx, dw and the other fields are not used.
    dw_in_xla: dw's GEMM g = xᵀ @ dyr by XLA (cuBLAS, float32 out) and dw, dgamma from g by XLA fusions (or one
      Pallas-Triton kernel: ``dw_finish_kernel``); None
      (default): when the dw kernel's output has fewer than FEW_TILES CTA tiles (``dw_by_xla``).
    stats_in_kernel: where r comes from. False (default): one XLA row reduction over x (2MK bytes read), the kernel
      only scaling rows in its epilogue. True: the forward kernel sums the squares of each x block in shared
      memory beside the MMA warpgroups (forward pipeline "own"), in a fourth warpgroup (wg_split "n") or, with the
      forward config's ``prologue_in="memory"``, in the memory warpgroup between its loads.
      "mma": the MMA warpgroups themselves, each loading its rows of the x block into registers after issuing the
      step's wgmma (``gemm.Fusion.a_observe``; forward pipeline "own"; with stream-K the warpgroups' partial sums
      are added like their partial accumulators): the squares added elementwise into a (rows, tile_k) float32
      carry, reduced across each row once per tile. "mma_rows": the same, each step's squares reduced across the
      row at once into a (rows,) carry (two registers per thread against 32 at 64x64 blocks, for a few shuffles
      per step): slower on the H100, the shuffles cost more than the registers (forward 1424.9 against 1410.8 µs at
      32768x4096x4096; 6-7% beside gamma_on "a": rmsnorm_matmul_configs_mma_rows-h100-d0df74c.json).
      "mma_shared": as "mma", but only the first tile of each row block sums the squares; the others get its r
      through HBM (``gemm.Fusion.share_rows``: the forward's whole first column runs first, then the other tiles,
      each polling the row block's count a few steps before its K loop ends). Cooperative tiles (no cluster or
      ping-pong: on ping-pong tiles, built at the tag pp-mma-shared-measured-c95fb85 and removed, the forward
      kernel took 280.5 µs against the entry's 243.9 at 16384x1024x5504, 47.7 against 33.9 at 8192x512x2816:
      NOTES.md, forty-eighth session); with stream-K the last round's tiles take r like the others. Beside gamma_on
      "a" the forward is one kernel reading x and w once, no XLA pass at all. Measured on the H100
      (rmsnorm_matmul_configs_mma_shared_poll-h100-8bada7c.json, forward µs, the tuned entry → gamma_on "a" with
      "mma_shared"): 1462.3 → 1453.2 at 32768x4096x4096, 621.4 → 620.9 at 4096x4096x14336, 548.3 → 533.8 at
      8192x4096x6144 (NOTES.md, 2026-11-28, twenty-third session). On the H200 (rmsnorm_matmul_configs_{stream_k_
      shared,shared_r}-h200-1bb672a.json, forward µs, H100 entry → this): 1432.1 → 1429.7 with stream-K (1438.8
      without), 613.9 → 610.9, 537.6 → 528.9; the H200's entries at the three shapes.
    gamma_on: where gamma goes. "w": the forward's B operand is w_γ = diag(gamma) w (one XLA pass over w, shared
      with dx's), and no (M, K) tensor is made outside the kernels. "x": the XLA fusion that computes r also
      writes x ⊙ gamma (the A operand: an (M, K) tensor written and read back by the kernel instead of x), and dx
      applies gamma on its output columns in its epilogue, so no w_γ exists. bfloat16 only (float16 x ⊙ gamma
      would round small x into subnormals), and with the statistics from XLA. The extra bytes are MK written (the
      fusion reads x for r anyway) against w_γ's 2KN, so "x" pays where M < 2N: measured on the H100
      (rmsnorm_matmul_configs-h100-93b449e.json, forward / forward + backward µs, "w" → "x"): 713 → 639 / 2098 →
      2021 at 4096x4096x14336, 287 → 258 / 889 → 856 at 4096x2048x11008, 588 → 572 / 1768 → 1754 at 8192x4096x6144;
      the tuned entries of those shapes take it. None (default): ``gamma_side``, "x" where it moves fewer bytes
      (bfloat16, statistics from XLA, M < 2N: an LM head's w_γ pass cost 369 µs of 9643 at 4096x2048x128256,
      rmsnorm_matmul_configs_row_dot-h100-68cbc7e.json), else "w". "a": the forward's MMA warpgroups multiply
      their rows of each x block by gamma's step slice in registers and feed wgmma from there
      (``gemm.Fusion.a_operand``: no (M, K) or (K, N) tensor made for gamma, no pass over x or w); with
      stats_in_kernel "mma" the sums of squares come from x's blocks loaded again after each wgmma's issue, so the
      forward is one kernel reading x and w once. bfloat16 only (gamma rounded to bfloat16, then x ⊙ gamma rounded),
      the forward on pipeline "own"; the backward as with "x" (gamma on dx's columns). At one row (the transposed
      GEMV) "a" multiplies w's blocks by gamma in the registers wgmma reads and "x" has XLA write x ⊙ gamma padded;
      None there: ``one_row_gamma_in_registers``.
    row_dot: where the backward takes its row dot c = Σ_N(dy · y) = Σ_K(u ⊙ x) / r, u = r ⊙ (dy @ w_γᵀ). "n": one
      XLA fusion over dy and y gives Σ_N(dy · y) and dyr = r ⊙ dy, and the dx kernel (A = dy) finishes dx in its
      epilogue with the prefetched x tile. "k": the dx kernel's A operand is dyr; it writes u = dyr @ w_γᵀ and
      per column block the partial sums Σ u ⊙ x; one XLA fusion over u and x finishes dx; dy is read only to form
      dyr, a product XLA can fuse into the fusion that produces dy, and y is not kept for the backward. None
      (default): ``row_dot_side`` ("k"; ROW_DOT_DEFAULT says why).
    dyr_in_dx: True: the dx kernel also writes dyr = (r / s) ⊙ dy for the dw GEMM, from the dy blocks of its A
      operand in shared memory (``gemm.Fusion.a_copy``). Row dot "n": the XLA fusion over dy and y then only
      reduces (4MN bytes read, none written, against 6MN). "k": A is dy instead of dyr, the epilogue scales u's rows
      by r / s, and no XLA pass over dy is left (4MN bytes fewer). False: XLA writes dyr. None (default):
      ``dyr_by_dx``, True with row_dot "n" where the copy's SMEM buffers fit beside the dx kernel's. Measured on the
      H100 (rmsnorm_matmul_configs_dyr_in_dx-h100-b8ddd9f.json, fwd+bwd µs, False → True, the tuned dx tiles):
      4473.1 → 4442.9 at 32768x4096x4096 (XLA's pass 260.1 → 172.9, the dx kernel 1419.6 → 1472.8),
      1970.8 → 1962.5 at 4096x4096x14336, 1710.6 → 1699.8 at 8192x4096x6144. The copy wants cooperative dx tiles
      that wait for each wgmma (delay_release 0): at 8192x512x2816 on the H200 the dx kernel took 40.8 µs with
      stacked 64x256 tiles against 56.3 with ping-pong 128x128 tiles and one wgmma group in flight (56.4 with the
      stacked tiles and one in flight; rmsnorm_matmul_configs_k_dyr_dx_tiles-h200-dc57a0b.json).
    row_dot_in_dx: (row_dot "n") True: Σ_N(dy · y) comes from the dx kernel instead of an XLA pass over dy and y
      (4MN bytes): the first tile of each row block sums dy · y over its K loop (over N), dy from its A blocks and
      y's blocks loaded from HBM by its MMA warpgroups, and passes the row dot to the row block's other tiles
      through HBM (``gemm.Fusion.share_rows``, as "mma_shared" does r in the forward). "prefetch": each step loads
      the next step's y block (one block of registers more in every tile's carry). The dx config takes whole
      cooperative tiles (no stream-K). Slower wherever measured (H200, fwd+bwd µs against the XLA pass,
      rmsnorm_matmul_configs_row_dot_in_dx-h200-28a1f9a.json): 4414.9 / 4387.9 at 32768x4096x4096, 2042.6 /
      1918.9 at 4096x4096x14336, 1681.9 / 1648.6 at 8192x4096x6144: the first tiles' loads of y into registers
      stall (ncu_dx_row_dot_in_dx-h200-182d5cf.txt). A sweep candidate, not a default. "tma": the memory warpgroup
      loads the first tiles' y blocks by TMA into a third stage buffer beside dy's (``gemm.Fusion.a_beside``) and
      the MMA warpgroups read both from shared memory; the dx config may keep stream-K. Its SMEM (num_stages
      (cta_m, tile_k) blocks more) fits beside the stages with the x tile through the B stages (dx
      ``tile_input_in="ring"``); with a residual (x and dh tiles, no ring) or wherever it does not fit
      (``row_dot_by_dx``) the XLA pass takes the row dot. Measured on the H200 (fwd+bwd µs, three calls,
      rmsnorm_matmul_configs_row_dot_tma{,_lead,_d1}-h200-*.json; the dx kernel in brackets): at 8192x4096x6144
      1658.1 / 1643.0 / 1640.1 against 1666.5 / 1650.1 / 1648.5 for the entry before (dx 586-591 against 546-550
      and XLA's 48 µs pass), its H200 entry now; at 32768x4096x4096 4385.5 against 4382.9 (the ring took no
      stream-K then: dx 1607.5 against 1510.2 with the ring alone, 1480.3 with stream-K, and XLA's 121 µs pass;
      beside stream-K since, 4294.8 against the entry's 4305.0, rmsnorm_matmul_configs_ring_stream_k_32768-h200-
      6ed694e.json, before that entry's dx kernel took the ring at 4 stages); at
      4096x4096x14336 1944.4 against the K side's 1880.8. Each row block's first tile takes about twice a tile's
      time: the first rounds read all of dy and y at once. Every tile summing its own row dot so (no tile waiting
      on another; at the tag row-dot-each-measured-ea7499e, removed) made each tile slower still: the dx kernel
      1963.4 against the entry's 1586.6 µs at 32768x4096x4096, 737.2 against 585.7 at 8192x4096x6144.
      Spreading the first tiles through the order (each group's a group or two ahead of its others; removed) cost
      more (1702.4 / 1698.4 at 8192x4096x6144: the others then wait for them), as did one wgmma group in flight
      (1678.6).
    dgamma_from: where dgamma comes from. "dw": the dw kernel's epilogue sums w ⊙ g over its columns, with the w
      tile prefetched into shared memory or through its B stages (``tile_input_in``). "u": (row_dot "k", with the
      dx GEMM reading w itself: gamma_on "x" or "a") the dx kernel writes u before gamma, u = (r / s) ⊙ (dy @ wᵀ),
      and one Pallas-Triton kernel (``norm_matmul.dx_finish``) finishes dx and sums dgamma = s · Σ_M(u ⊙ x) over
      the same two tensors, read once; the dw kernel's epilogue then only scales rows (no tile input: a fourth stage
      fits). Measured on the H200 (fwd+bwd µs, rmsnorm_matmul_configs_dgamma_u_finish-h200-943f73b.json, N side
      tuned → K side with dyr from dx → and dgamma from u): 1865.6 → 1836.6 → 1824.6 at 4096x4096x14336 (the dw
      kernel 603.4 → 580.3, the finish 31.3 against XLA's dx fusion's 24.4, the dx kernel 602.2 → 607.0), 1595.0
      → 1597.0 → 1611.4 at 8192x4096x6144, 738.7 → 740.1 → 737.3 at 4096x2048x11008; the H200's entry at
      4096x4096x14336 took it until the fiftieth session, when the dx kernel finishing dx and writing xr (dgamma
      from the dw kernel's w tile) beat it: 1837.1 → 1815.5 (rmsnorm_matmul_configs_k_xr_14336-h200-fb24c05.json).
      None (default): ``dgamma_source``, "dw".
    dx_in_kernel: (row_dot "k") True: the dx kernel finishes dx itself. Each tile stores its row dot's part over
      its columns, Σ u ⊙ x, waits for the other tiles of its rows (``gemm.Fusion.sum_rows``: global semaphores, the
      tiles walked row-major) and writes dx = s · u − (s · r² / K) · Σ_K(u ⊙ x) · x from u still in its registers
      and the x tile it holds: u is never written, and XLA's pass over u and x (reading 2MK elements, writing MK) is
      gone. Not with dgamma_from "u" (which sums dgamma from u); with a residual, or in interpret mode (no
      semaphores), XLA's pass finishes dx as without it. The dx config takes cooperative tiles, pipeline "own",
      no stream-K or cluster and epilogue_store "end". False (default): XLA's pass. Measured on the H200
      (rmsnorm_matmul_configs_dx_in_kernel-h200-5ac32b9.json, forward + backward µs, XLA's pass → the kernel's):
      794.0 → 774.1 at 16384x1024x5504 (its entry: the dx kernel 251.7 → 256.7, the pass 30.9), 133.8 → 132.6 at
      8192x512x2816, 741.6 → 746.3 at 4096x2048x11008 (8 column blocks: the kernel 236.5 → 251.1, the pass 15.1).
      With 16 column blocks, each tile summing the parts itself on a grid of whole rows of tiles (forty-third
      session; rmsnorm_matmul_configs_k_dx_in_kernel_{big-h200-61e5e05,one_phase-h200-181f0ee}.json, forward +
      backward µs of the K side with it against the N side's entry): 4228.4 against 4242.3 at 32768x4096x4096 (its
      entry now: the dx kernel 1532.7, where u for XLA's 193 µs pass took 1441.7 and the first protocol 1562.5),
      1601.0 against 1597.0 at 8192x4096x6144; 1839.8 against the entry's 1824.1 at 4096x4096x14336 (dgamma from
      the dw kernel's w tile: +32 µs there).
    xr_in_dx: (row_dot "k") True: the dw GEMM is g = xrᵀ @ dy, xr = (r / s) ⊙ x written by the dx kernel's epilogue
      from the x tile it holds (``gemm.Fusion.tile_copy``, staged in that tile's buffer), instead of xᵀ @ dyr with
      dyr copied from the dx kernel's dy blocks (``dyr_in_dx``) or written by XLA: M·K elements written where dyr
      is M·N, and no copy in the dx kernel's K loop (a copying warpgroup stalls the tensor pipe: 15.4 µs of the dx
      kernel at 16384x1024x5504, 29.9 at 32768x4096x4096, NOTES.md, forty-third session). A is dy, as with
      dyr_in_dx; not with dyr_in_dx True. With dx_in_kernel the finish reads xr where x was (x = xr · s / r, xr
      rounded once to x's dtype). False (default). Measured on the H200 (forward + backward µs, dyr from the dx
      kernel → xr; rmsnorm_matmul_configs_xr_in_dx{,_repeat5504,_model_shapes}-h200-da1d152.json,
      ..._xr_dx_in_kernel_model_shapes-h200-da1d152.json): 775.0 → 770.4 and 768.8 → 764.6 at 16384x1024x5504 (the
      dx kernel 258.1 → 255.2: the copy's 13.7 µs gone, the xr store's wait before dx takes the buffer 10.8 more),
      754.8 → 750.0 at 4096x2048x11008 and 134.3 → 130.0 at 8192x512x2816 (with dx_in_kernel; the entries of those
      three shapes take it; a second call: 771.8 → 766.7, 741.6 → 734.5 and 134.4 → 128.7 against the forms they
      replaced, rmsnorm_matmul_configs_model_entries_confirm-h200-09ceef6.json); slower where N is not much larger
      than K: 4302.9 → 4333.6 at 32768x4096x4096 (the dx kernel 1555.0 → 1586.3), 235.9 → 239.4 at 4096x2048x3072,
      54.9 → 57.3 at 8192x512x768. Since the row sum's planar-snake order (forty-ninth session) it is faster at
      32768x4096x4096, whose entry takes it: 4181.3 → 4158.3 and 4184.7 → 4159.8 in two calls (the dx kernel
      1485.6 → 1461.4, 1486.9 → 1461.8), equal at 4096x4096x14336 (1830.7 → 1828.3);
      rmsnorm_matmul_configs_xr_in_dx_snake{,_repeat,_14336_6144}-h200-d431860.json. (Not kept, code at the tag
      r-in-dw-measured-d431860: the dw GEMM xᵀ @ (r / s ⊙ dy), r / s applied to its A block, xᵀ read transposed, in
      registers, so that the dx kernel wrote neither dyr nor xr. Correct on the GPU, but that dw kernel took 1681.6
      µs against 1315.4 at 32768x4096x4096, for 43.7 saved in the dx kernel:
      rmsnorm_matmul_configs_r_in_dw-h200-d431860.json.)
    squares_from: (gamma_on "a" with stats_in_kernel "mma", "mma_rows" or "mma_shared") where the forward's MMA
      warpgroups read x for its squares: "observe" (default), each x block loaded again from shared memory after the
      step's wgmma is issued (``gemm.Fusion.a_observe``); "operand", the registers the a_operand has loaded to
      multiply by gamma, squared before the wgmma's issue (with "mma_shared" in the row blocks' first tiles only).
      Measured on the H200 (forward µs, "observe" → "operand" beside "mma_shared", two calls:
      rmsnorm_matmul_configs_squares_operand-h200-0be04fc.json with a branch per step, ..._first_column-h200-
      e308713.json with the first column's own K loop): 1403.8 → 1421.4 and 1414.5 → 1426.1 at 32768x4096x4096,
      610.0 → 608.6 and 614.2 → 611.4 at 4096x4096x14336, 524.3 → 524.8 and 528.0 → 525.6 at 8192x4096x6144;
      every tile its own r from the operand ("mma"): 1447.0, 630.0, 539.3. A first tile's K loop 77.6k → 70.5k
      cycles at 4096x4096x14336 (mosaic_timeline_first_column-h200-e308713.json), too few tiles to show. Two
      more calls on the entries as they are (..._order-h200-b0ba3ec.json, ..._squares_operand_entry-h200-f0be594
      .json): 1431.0 → 1424.4 at 32768x4096x4096; 620.3 → 618.3 and 606.3 → 603.9 at 4096x4096x14336 (forward +
      backward 1849.5 → 1848.6); 532.4 → 530.5 and 521.3 → 519.2 at 8192x4096x6144 (1603.0 → 1599.5). Faster in
      all four calls at 4096x4096x14336 and in three of four at 8192x4096x6144. At 32768x4096x4096 the first two
      calls compared the operand form without stream-K against the entry with it; on the entry itself
      (..._squares_operand_32768_run{1,2}-h200-e9e205c.json, two runs of one call) 1400.8 → 1394.6 and 1399.5 →
      1393.9, forward + backward 4332.1 → 4335.5 and 4336.7 → 4337.0. The three H200 entries take it.
    Why the default is the XLA reduction (H100, forward, benchmarks/results/mosaic_gemm-decide-h100.md): the
    fourth warpgroup took 1718 µs against 1746 at 32768x4096x4096, but 613 vs 608 at 8192x4096x6144, 736 vs 718 at
    4096x4096x14336 and 385 vs 368 at 16384x1024x5504. "mma" (rmsnorm_matmul_configs_mma_stats-h100-8a60578.json,
    forward µs, the default config's in brackets, XLA's norm + matmul in the same run): 1459.7 (1502.6, XLA 1513.9)
    at 32768x4096x4096, its tuned entry now: the sums cost the kernel 31 µs (1436.7 against 1405.3 with whole tiles
    and one group in flight) and spare the 88 µs reduction; but w_γ's pass (gamma cannot go on x: the kernel would
    square x ⊙ gamma) made it lose where the default takes gamma on x: 702.8 (629.6) at 4096x4096x14336, 564.2
    (560.7) at 8192x4096x6144, 320.1 (258.2) at 4096x2048x11008. Waiting for each wgmma instead (delay_release 0)
    it took 1624.4. Both in-kernel forms stay options (sweep candidates). The backward's row statistics come
    from one XLA fusion by default: computing them in every dx tile made forward + backward 1.48x slower with a
    fourth warpgroup (7654 vs 5177 µs at 32768x4096x4096) and 1.54x with the MMA warpgroups (NOTES.md, in the
    first sessions); ``row_dot_in_dx`` computes them in one tile per row block.
    dw_finish_kernel: (where XLA runs the dw GEMM, ``dw_by_xla``, dgamma from dw's side) True: the GEMM's M
      reduction is split in two row blocks (cuBLAS writes (2, K, N) float32) and one Pallas-Triton kernel sums them
      into dw and dgamma (``norm_matmul.dw_finish``). False (default): one dot and XLA's fusions, which split the
      reduction themselves there. Measured on the H200 (toggle_ab_dw_finish_split-h200-75f7159.json, forward +
      backward µs, False → True): 127.9 → 126.1 at 8192x512x2816 (XLA's two fusions of 4.11 and 3.01 µs, each
      summing the halves again, → the kernel's 5.12), its H200 entry; 55.3 → 61.1 at 8192x512x768, where XLA sums
      the halves once and makes dw and dgamma in one 2.11 µs fusion, and the split of our own made it run the GEMM
      as a Triton split-K fusion (14.7 µs against cuBLAS's 12.4) with a 4.9 µs sum after it. The kernel on XLA's
      own dot there (cuBLAS kept, XLA's sum of its halves before the kernel: 3.0 + 3.5 µs) took 53.9 against the
      entry's 52.0-52.3 (toggle_ab_dw_finish_unsplit{,_entry}-h200-c342e9d.json); at 8192x512x2816 125.1 against
      122.2 split.
    backward_in_xla: True: the backward is XLA's own (two cuBLAS GEMMs, dx and dgamma by XLA fusions) from the
      forward's r, no Mosaic kernel in it and the dx, dw and backward fields unused; the fused forward stays. For
      few rows, where our backward kernels' short rounds trail cuBLAS's split GEMMs (``mosaic._backward_by_xla``).
    """

    forward: MosaicGemmConfig
    dx: MosaicGemmConfig
    dw: MosaicGemmConfig
    stats_in_kernel: bool | str = False
    dw_in_xla: bool | None = None
    gamma_on: str | None = None
    row_dot: str | None = None
    dyr_in_dx: bool | None = None
    row_dot_in_dx: bool | str = False
    dgamma_from: str | None = None
    squares_from: str = "observe"
    dx_in_kernel: bool = False
    xr_in_dx: bool = False
    dw_finish_kernel: bool = False
    backward_in_xla: bool = False

    def __post_init__(self):
        for name in ("forward", "dx", "dw"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, MosaicGemmConfig(**value))
            elif not isinstance(value, MosaicGemmConfig):
                raise ValueError(f"MosaicRMSNormMatmulConfig.{name}: must be a MosaicGemmConfig or a mapping of its "
                                 f"fields, got {value!r}")
        if self.stats_in_kernel not in (False, True, *MMA_STATS):
            raise ValueError(f"MosaicRMSNormMatmulConfig.stats_in_kernel: must be False, True, 'mma', 'mma_rows' or "
                             f"'mma_shared', got {self.stats_in_kernel!r}")
        if self.stats_in_kernel in MMA_STATS and self.forward.pipeline != "own":
            raise ValueError(f"MosaicRMSNormMatmulConfig.stats_in_kernel: {self.stats_in_kernel!r} sums squares in the "
                             f"MMA warpgroups of our K loop: the forward config needs pipeline='own', got "
                             f"{self.forward.pipeline!r}")
        if self.stats_in_kernel == "mma_shared" and (self.forward.pingpong or self.forward.cluster != "none"):
            raise ValueError("MosaicRMSNormMatmulConfig.stats_in_kernel: 'mma_shared' passes r from each row block's "
                             "first tile to its others; the forward config needs schedule='cooperative' and "
                             f"cluster='none'; got schedule={self.forward.schedule!r}, "
                             f"cluster={self.forward.cluster!r}")
        if self.gamma_on not in (None, "w", "x", "a"):
            raise ValueError(f"MosaicRMSNormMatmulConfig.gamma_on: must be None, 'w', 'x' or 'a', got "
                             f"{self.gamma_on!r}")
        if self.gamma_on == "a" and (self.stats_in_kernel is True or self.forward.pipeline != "own"):
            raise ValueError("MosaicRMSNormMatmulConfig.gamma_on: 'a' multiplies the x blocks in the MMA warpgroups' "
                             "registers: it needs the forward config's pipeline='own' and stats_in_kernel False, "
                             f"'mma', 'mma_rows' or 'mma_shared'; got pipeline={self.forward.pipeline!r}, "
                             f"stats_in_kernel={self.stats_in_kernel!r}")
        if self.squares_from not in SQUARES_FROM or (self.squares_from == "operand" and (
                self.gamma_on != "a" or self.stats_in_kernel not in MMA_STATS)):
            raise ValueError(f"MosaicRMSNormMatmulConfig.squares_from: must be one of {SQUARES_FROM}, 'operand' only "
                             f"with gamma_on='a' and stats_in_kernel one of {MMA_STATS} (the x blocks in the MMA "
                             f"warpgroups' registers); got squares_from={self.squares_from!r}, "
                             f"gamma_on={self.gamma_on!r}, stats_in_kernel={self.stats_in_kernel!r}")
        if self.gamma_on == "x" and self.stats_in_kernel:
            raise ValueError("MosaicRMSNormMatmulConfig.gamma_on: 'x' feeds the kernel x ⊙ gamma, whose squares are "
                             "not x's: it needs stats_in_kernel=False (r from XLA)")
        if self.row_dot not in (None, "n", "k"):
            raise ValueError(f"MosaicRMSNormMatmulConfig.row_dot: must be None, 'n' or 'k', got {self.row_dot!r}")
        if self.dyr_in_dx not in (None, False, True):
            raise ValueError(f"MosaicRMSNormMatmulConfig.dyr_in_dx: must be None or a bool; got "
                             f"dyr_in_dx={self.dyr_in_dx!r}")
        in_dx = self.row_dot_in_dx
        if in_dx not in (False, True, "prefetch", "tma") or (in_dx and self.row_dot_side() != "n"):
            raise ValueError(f"MosaicRMSNormMatmulConfig.row_dot_in_dx: must be False, True, 'prefetch' or 'tma', "
                             f"not False only with row_dot='n' "
                             f"(the dx kernel sums dy · y over N); got row_dot_in_dx={self.row_dot_in_dx!r}, "
                             f"row_dot={self.row_dot!r}")
        dx = self.dx
        if in_dx and (dx.pipeline != "own" or dx.pingpong or dx.cluster != "none" or (dx.stream_k and in_dx != "tma")):
            raise ValueError("MosaicRMSNormMatmulConfig.row_dot_in_dx: the dx kernel's first tile of each row block "
                             "passes the row dot to its others; the dx config needs pipeline='own', "
                             "schedule='cooperative', cluster='none' and (unless 'tma') stream_k=0; got "
                             f"pipeline={dx.pipeline!r}, schedule={dx.schedule!r}, cluster={dx.cluster!r}, "
                             f"stream_k={dx.stream_k}")
        if self.dgamma_from not in (None, "dw", "u") or (self.dgamma_from == "u" and self.row_dot_side() != "k"):
            raise ValueError(f"MosaicRMSNormMatmulConfig.dgamma_from: must be None, 'dw' or 'u', 'u' only with "
                             f"row_dot='k' (u is the K side's dx output); got dgamma_from={self.dgamma_from!r}, "
                             f"row_dot={self.row_dot!r}")
        if self.dx_in_kernel not in (False, True) or (self.dx_in_kernel and (
                self.row_dot_side() != "k" or self.dgamma_from == "u" or dx.pipeline != "own" or dx.pingpong
                or dx.stream_k or dx.cluster != "none" or dx.stores_later)):
            raise ValueError("MosaicRMSNormMatmulConfig.dx_in_kernel: must be a bool; True (the dx kernel sums its "
                             "row dot over its row block's tiles and writes dx) needs row_dot='k', dgamma_from not "
                             "'u', and a dx config with pipeline='own', schedule='cooperative', stream_k=0, "
                             f"cluster='none' and epilogue_store='end'; got dx_in_kernel={self.dx_in_kernel!r}, "
                             f"row_dot={self.row_dot!r}, dgamma_from={self.dgamma_from!r}, "
                             f"pipeline={dx.pipeline!r}, schedule={dx.schedule!r}, stream_k={dx.stream_k}, "
                             f"cluster={dx.cluster!r}, epilogue_store={dx.epilogue_store!r}")
        if self.xr_in_dx not in (False, True) or (self.xr_in_dx and (self.row_dot_side() != "k"
                                                                    or self.dyr_in_dx is True)):
            raise ValueError("MosaicRMSNormMatmulConfig.xr_in_dx: must be a bool; True (the dx kernel writes xr = "
                             "(r / s) ⊙ x for the dw GEMM, which reads dy) needs row_dot='k' and dyr_in_dx not True "
                             f"(dyr is not made); got xr_in_dx={self.xr_in_dx!r}, row_dot={self.row_dot!r}, "
                             f"dyr_in_dx={self.dyr_in_dx!r}")
        if not isinstance(self.dw_finish_kernel, bool) or (self.dw_finish_kernel and self.dgamma_from == "u"):
            raise ValueError("MosaicRMSNormMatmulConfig.dw_finish_kernel: must be a bool; True (cuBLAS's dw GEMM in "
                             "two halves, dw and dgamma from one Triton kernel, where XLA runs that GEMM) needs "
                             f"dgamma from dw's side, not dgamma_from='u'; got dw_finish_kernel="
                             f"{self.dw_finish_kernel!r}, dgamma_from={self.dgamma_from!r}")
        if not isinstance(self.backward_in_xla, bool):
            raise ValueError(f"MosaicRMSNormMatmulConfig.backward_in_xla: must be a bool, got "
                             f"{self.backward_in_xla!r}")
        if self.dw_in_xla is not None and not isinstance(self.dw_in_xla, bool):
            raise ValueError(f"MosaicRMSNormMatmulConfig.dw_in_xla: must be None or a bool, got {self.dw_in_xla!r}")
        fwd = self.forward
        if self.stats_in_kernel is True and (fwd.pipeline != "own" or fwd.pingpong or (
                fwd.wg_split != "n" and fwd.prologue_in == "fourth")):
            raise ValueError("MosaicRMSNormMatmulConfig.stats_in_kernel: the statistics need the forward config's "
                             "pipeline='own' and schedule='cooperative', and wg_split='n' in a fourth warpgroup "
                             f"(prologue_in='fourth'); got pipeline={fwd.pipeline!r}, wg_split={fwd.wg_split!r}, "
                             f"schedule={fwd.schedule!r}, prologue_in={fwd.prologue_in!r}")

    def to_dict(self) -> dict:
        return dict({name: getattr(self, name).to_dict() for name in ("forward", "dx", "dw")},
                    stats_in_kernel=self.stats_in_kernel, dw_in_xla=self.dw_in_xla, gamma_on=self.gamma_on,
                    row_dot=self.row_dot, dyr_in_dx=self.dyr_in_dx, row_dot_in_dx=self.row_dot_in_dx,
                    dgamma_from=self.dgamma_from, squares_from=self.squares_from, dx_in_kernel=self.dx_in_kernel,
                    xr_in_dx=self.xr_in_dx, dw_finish_kernel=self.dw_finish_kernel,
                    backward_in_xla=self.backward_in_xla)

    def gamma_side(self, M: int, N: int, dtype) -> str:
        """Where gamma goes for x (M, K) of ``dtype`` and w (K, N): ``gamma_on``, or when None, "x" for bfloat16 with
        the statistics from XLA where M < 2N (x ⊙ gamma's MK bytes written cost less than w_γ's 2KN), else "w"."""
        if self.gamma_on is not None:
            return self.gamma_on
        on_x = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and not self.stats_in_kernel and M < 2 * N
        return "x" if on_x else "w"

    def one_row_gamma_in_registers(self, N: int) -> bool:
        """At one row (the transposed GEMV, w (K, N)): whether gamma multiplies w's blocks in the registers wgmma
        reads (B is x itself: the forward is the kernel alone) rather than x ⊙ gamma padded by one XLA fusion.
        ``gamma_on`` "a" or "x"; None: "a" where the GEMV's blocks make one round (N / cta_m at most
        ONE_ROW_GAMMA_MAX_TILES, no stream-K; the measurements are beside it)."""
        if self.gamma_on in ("a", "x"):
            return self.gamma_on == "a"
        return N // self.forward.cta_m <= ONE_ROW_GAMMA_MAX_TILES and not self.forward.stream_k

    def row_dot_side(self) -> str:
        """Where the backward takes its row dot: ``row_dot``, or when None, ROW_DOT_DEFAULT ("k")."""
        return self.row_dot if self.row_dot is not None else ROW_DOT_DEFAULT

    def dgamma_source(self, M: int, N: int, dtype) -> str:
        """Where dgamma comes from for x (M, K) of ``dtype`` and w (K, N): ``dgamma_from``, or when None, "dw"."""
        return self.dgamma_from or "dw"

    def dgamma_reason(self, M: int, N: int, dtype) -> str | None:
        """None when dgamma can come from where ``dgamma_source`` says; else the sentence saying why not."""
        side = self.gamma_side(M, N, dtype)
        if self.dgamma_source(M, N, dtype) == "u" and side == "w":
            return ("dgamma_from='u' needs the dx GEMM to read w itself (gamma_on 'x' or 'a'); with gamma on w "
                    "(here gamma_side is 'w') u holds gamma's product, and dgamma would need a division by gamma")
        return None

    def dx_config(self, residual: bool) -> MosaicGemmConfig:
        """The dx kernel's config for a call with or without a residual: ``dx``, its tile inputs taken into
        buffers of their own where the N side's dx tiles are two (x and dh: the B stages carry only one), with as
        many stages as fit beside them (at least 2)."""
        if not (residual and self.row_dot_side() == "n" and self.dx.tile_input_in == "ring"):
            return self.dx
        dx = dataclasses.replace(self.dx, tile_input_in="buffer")
        while dx.num_stages > 2 and smem_bytes(dx, jnp.bfloat16, jnp.bfloat16, tile_input_dtypes=(jnp.bfloat16,) * 2,
                                               store_in_tile=True) + BARRIER_BYTES > mosaic_utils.H100_SMEM_BYTES:
            dx = dataclasses.replace(dx, num_stages=dx.num_stages - 1)
        return dx

    def _dx_smem(self, dtype, residual: bool, *, dyr_staging: bool, y_stages: bool) -> int:
        """Bytes of shared memory the dx kernel needs with the dyr copy's staging (two (wg_rows, tile_k) blocks)
        and the row dot's y stages (num_stages (cta_m, tile_k) blocks, row_dot_in_dx "tma") or without."""
        dx, size = self.dx_config(residual), jnp.dtype(dtype).itemsize
        extra = (2 * dx.wg_rows * dx.tile_k * size if dyr_staging else 0) + (
            dx.num_stages * dx.cta_m * dx.tile_k * size if y_stages else 0)
        tiles = 2 if residual and self.row_dot_side() == "n" else 1  # x (and dh, added on the N side's epilogue)
        return smem_bytes(dx, dtype, dtype, tile_input_dtypes=(dtype,) * tiles, store_in_tile=True,
                          scratch_bytes=extra) + BARRIER_BYTES

    def row_dot_by_dx(self, dtype, residual: bool) -> bool | str:
        """The row dot's form in the dx kernel (``row_dot_in_dx``; False: XLA's pass): "tma" only without a
        residual and where the y stages fit in the dx kernel's shared memory, else False."""
        if self.row_dot_in_dx != "tma":
            return self.row_dot_in_dx
        fits = self._dx_smem(dtype, residual, dyr_staging=False, y_stages=True) <= mosaic_utils.H100_SMEM_BYTES
        return "tma" if fits and not residual else False

    def dyr_by_dx(self, dtype, residual: bool) -> bool:
        """Whether the dx kernel writes dyr: ``dyr_in_dx``, or when None, with row_dot "n" where its staging
        (two (wg_rows, tile_k) blocks) fits in shared memory beside the dx kernel's stages and x (and dh) tiles
        (and the row dot's y stages)."""
        if self.dyr_in_dx is not None or self.row_dot_side() != "n":
            return bool(self.dyr_in_dx)
        return self.dyr_smem_reason(dtype, residual) is None

    def dyr_smem_reason(self, dtype, residual: bool) -> str | None:
        """None when the dx kernel's shared memory holds the dyr copy's staging too; else the sentence saying how
        much it would need."""
        staging = 2 * self.dx.wg_rows * self.dx.tile_k * jnp.dtype(dtype).itemsize
        y_stages = self.row_dot_by_dx(dtype, residual) == "tma"
        need = self._dx_smem(dtype, residual, dyr_staging=True, y_stages=y_stages)
        if need <= mosaic_utils.H100_SMEM_BYTES:
            return None
        return (f"dyr_in_dx=True: the dx kernel would need {need} bytes of shared memory with the dyr copy's "
                f"{staging}-byte staging{' beside the row dot y stages' if y_stages else ''} (at most "
                f"{mosaic_utils.H100_SMEM_BYTES}); take dx tiles stacked along M "
                f"(wg_split='m': 64-row copies), fewer num_stages (config.with_dyr_from_dx() takes them off until "
                f"it fits), or dyr_in_dx=None (the copy where it fits)")

    def with_dyr_from_dx(self, dtype, residual: bool) -> "MosaicRMSNormMatmulConfig | None":
        """This config with ``dyr_in_dx=True``, its dx kernel one or more stages shallower where the copy's staging
        would not fit beside them (at least 2 stages); None where even 2 do not leave room."""
        config = dataclasses.replace(self, dyr_in_dx=True)
        while config.dyr_smem_reason(dtype, residual) is not None:
            if config.dx.num_stages <= 2:
                return None
            config = dataclasses.replace(config, dx=dataclasses.replace(config.dx, num_stages=config.dx.num_stages - 1))
        return config

    def dw_by_xla(self, K: int, N: int) -> bool:
        """Whether dw's GEMM runs in XLA (cuBLAS) for w (K, N): ``dw_in_xla``, or when None, when the dw kernel's
        output would have fewer CTA tiles than FEW_TILES."""
        if self.dw_in_xla is not None:
            return self.dw_in_xla
        return (K // self.dw.cta_m) * (N // self.dw.cta_n) < FEW_TILES

    def unsupported_reason(self, M: int, K: int, N: int) -> str | None:
        """None when the Mosaic GEMMs tile (M, K, N) (forward (M, N, K); unless the backward is XLA's, dx (M, K, N)
        and dw (K, N, M) unless XLA runs it; at one row the transposed GEMV, ``one_row_reason``); else the constraint,
        naming the kernel."""
        if M == 1:
            return one_row_reason(K, N, self.forward)
        if M < FEWEST_ROWS:
            return (f"M={M} is below {FEWEST_ROWS} rows (a row of tiles mostly past M; the Triton backend's decode "
                    f"kernels ran faster there)")
        sizes = dict(M=kernel_rows(M), K=K, N=N)
        kernels = (("forward", "MNK"),)
        if not self.backward_in_xla:
            kernels += (("dx", "MKN"),) + (() if self.dw_by_xla(K, N) else (("dw", "KNM"),))
        for kernel, names in kernels:  # (the kernels' rows a multiple of 8: the last row of forward and dx tiles, or
            # dw's last K step, may run past them: ``gemm``'s partial_rows and partial_k)
            reason = gemm_unsupported_reason(*(sizes[n] for n in names), getattr(self, kernel), names=tuple(names),
                                             partial_rows=names[0] == "M", partial_k=names[2] == "M")
            if reason:
                return f"{reason} ({kernel} kernel)"
        return None


# The fewest rows (beyond one) the kernels take: each row of tiles is at least 64 rows (wgmma's M), TMA loading zeros
# past M. Below, the Triton backend's decode kernels (16-row blocks) run: at 16x4096x14336 they took 46.5 / 117.4 µs
# forward / forward + backward on the H200 (XLA 33.5 / 109.1), where the Mosaic kernels took 47.7 / 129.0 (the call
# at 4212e55, NOTES.md: its file was not written). From 24 rows the Mosaic kernels ran faster, forward / forward +
# backward µs, Mosaic (Triton, XLA) (`benchmarks/scripts/ragged_rows.py`, rmsnorm_matmul-ragged_rows_few-h200-
# f099cf2.json): 62.1 / 138.6 (81.8 / 173.9, 34.8 / 116.7) at 24x4096x14336, 52.0 / 138.9 (81.8 / 178.2, 36.3 /
# 117.8) at 32x4096x14336, 24.7 / 58.9 (37.7 / 85.4, 15.6 / 53.0) at 48x2048x8192.
FEWEST_ROWS = 24


def kernel_rows(M: int) -> int:
    """The rows the kernels run for x of M rows: M rounded up to a multiple of PARTIAL_ROWS_MULTIPLE, whole 8-row
    tiles for TMA (the backward pads its operands with copies of x's last row and zeros, and slices dx back; so does
    the forward where its config cannot take M rows as they are: ``forward_takes_any_rows``), one row as it
    is (the GEMV)."""
    return M if M == 1 else -(-M // PARTIAL_ROWS_MULTIPLE) * PARTIAL_ROWS_MULTIPLE

_G = MosaicGemmConfig
# Built-in tiles (H100) per kernel, best first; each kernel takes the first whose tiles divide its GEMM. All take
# the core's default K loop ("own"), lane semantics and tile order (grid_tile_width 8): the K loop is the one the
# fused kernels measured fastest with, at every suite shape; the tile order was measured on the plain GEMM only
# (``gemm.config``). The dx kernel also holds the prefetched x tile (and dh with a residual) in shared memory.
_SMALLER = (_G(tile_m=64, tile_n=128, tile_k=64, num_stages=4, wg_split="m"),  # for shapes 256 does not divide
            _G(tile_m=64, tile_n=64, tile_k=64, num_stages=4, wg_split="n"))
_FORWARD = (_G(tile_m=128, tile_n=128, tile_k=64, num_stages=4, wg_split="n"), *_SMALLER)
_DX = _DW = (_G(tile_m=128, tile_n=128, tile_k=64, num_stages=3, wg_split="n"), *_SMALLER)
# Forward tiles for the MMA warpgroups' statistics (stats_in_kernel "mma"): one wgmma group left in flight, so that a
# step's x loads and squares run under the wgmma; whole tiles (stream-K, the partial sums of squares added like the
# accumulators, measured no faster where it applies: 1426.2 against 1424.9 µs at 32768x4096x4096,
# rmsnorm_matmul_configs_mma_stream_k-h100-df50ca8.json; a sweep candidate).
_MMA_STATS_FORWARD = tuple(dataclasses.replace(c, delay_release=1, stream_k=0) for c in (
    _G(tile_m=64, tile_n=256, tile_k=64, num_stages=4, wg_split="m", grid_minor="m"), *_SMALLER))
_DX_RESIDUAL = (_G(tile_m=128, tile_n=64, tile_k=64, num_stages=4, wg_split="n"), *_SMALLER)


# The one-row forward (``norm_matmul.mosaic_gemv``): B is x ⊙ gamma padded to ONE_ROW_PADDED rows (wgmma's N), and r
# comes from x viewed (ONE_ROW_STAT_ROWS, K / ONE_ROW_STAT_ROWS) in the accumulator layout (8-column groups).
ONE_ROW_PADDED = 16
ONE_ROW_STAT_ROWS = 64
# Its built-in tiles: ping-pong tiles of w's N axis, tile_k 256 and 4 stages (64 rows) or tile_k 128 and 3 stages
# (128 rows), one wgmma group in flight: 128 rows where they make one round that fills at least 3/4 of FEW_TILES SMs
# (``one_row_forward``), else 64. Measured on the H200 (jax 0.11.2, CUPTI). The kernel's time depends on where w lies
# in memory and on the call, XLA's GEMV's much less: at 1x4096x14336, over 8 paired runs in 4 calls (fresh buffers in
# each run; one_row_forward-h200-{9363d22,066ab73}.json, one_row_forward_repeats-h200-{38b092f,9e8a08c}.json) the
# 128-row kernel took 29.76-30.88 µs, the 64-row one 29.57-31.81, both 30.4 on average (the 128-row one the faster in 3
# of the 8), XLA's GEMV 29.47-30.24; with the suite's inputs 30.88 (128 rows) and 29.55 and 32.02 (64 rows: the
# rmsnorm_matmul-one_row-h200-{9e8a08c,f3e2adb}.json and -issue15_all-h200-0615a1f.json records). The 128-row tiles
# are taken there for their narrower range: the bar is never to be slower than XLA's forward. At 1x8192x28672 every
# form moved by 4-13 µs between three sets of buffers (64 rows: 111.89-115.65, faster than 128 in 2 of 3; XLA's GEMV
# 106.16-106.37). Forward µs with 64 rows, the small XLA fusion included, against XLA's norm + matmul in the same run
# (one_row_forward-h200-066ab73.json): 11.39 (XLA 12.58) at 1x2048x8192, 34.53 (36.96) at 1x8192x8192, 5.02 (10.88)
# at 1x1024x2816, 114.19 (109.97) at 1x8192x28672, 14.30 (14.37) at 1x4096x4096 (64 tiles: half the SMs idle;
# stacked 128-row tiles with stream-K over 4 blocks took 15.14 there, the Triton backend 12.56, its entry now). 128
# rows at N = 8192 leave half the SMs idle (14.96 at 1x2048x8192). Where the 64-row tiles leave over half the SMs idle
# their K loop runs in parts (``gemm.gemv_config``'s rule, ``MosaicGemmConfig.k_parts``), µs whole / 2 parts / 4 parts
# (XLA, Triton; one_row_forward_kparts-h200-0b5a241.json): 12.96 / 11.97 / 12.59 at 1x4096x4096 (13.55, 12.26); where
# they make a round, parts lost: 11.04 / 11.94 / 14.94 at 1x2048x8192 (12.32, 16.24), 33.63 / 35.30 / 36.03 at
# 1x8192x8192 (35.94, 41.50). The rule's picks, in a second call (one_row_forward_kparts_rule-h200-2f0afbb.json):
# 15.20 / 12.14 / 12.29 at 1x4096x4096 (13.26, 12.22), 8.03 / 7.07 / 8.38 at 1x2048x4096 (23.38, 9.92), 12.42 / 9.23 /
# 7.84 at 1x4096x2048 (30.94, 14.56), 5.26 / 4.80 / 5.15 at 1x1024x2816 (10.72, 6.14), 10.88 / 12.27 / 14.77 at
# 1x2048x8192 (12.22, 16.16). The sweep's candidates: ``mosaic_sweep_candidates``.
_ONE_ROW_64 = GEMV  # (the core's one-row tiles, which ``matmul`` takes at one row too)
ONE_ROW_FORWARD = (_ONE_ROW_64, dataclasses.replace(_ONE_ROW_64, tile_m=128, tile_k=128, num_stages=3))


# Where the one-row forward puts gamma (``MosaicRMSNormMatmulConfig.one_row_gamma_in_registers``), measured on the
# H200 (jax 0.11.2, CUPTI, XLA in the same run; one_row_forward_gamma*-h200-*.json, fresh buffers per run). On w's
# blocks in the GEMV's registers, B x itself (TMA zero-fills its other 15 rows), the forward is one kernel: at
# 1x4096x14336 (one round of 128-row tiles) it took 30.66-31.62 µs in 12 runs over four calls (31.07 on average),
# faster than XLA's forward in 11 of the 12 (31.30-31.81, 31.44 on average), where x ⊙ gamma by XLA (the fusion 1.3
# µs) took 30.75-32.35 (31.56) and was faster in 4 (the register path costs the kernel itself 0.6-1.6 µs there, 1.0 on
# average against the fusion's 1.3); 10.72-11.01 against 10.96-11.09 at 1x2048x8192, equal at 1x8192x8192 (33.48 /
# 33.66 on average over 12 runs, both one round of 64-row tiles). Over several rounds the register path costs more
# than the fusion: 113.9-114.7 against 110.9-112.1 at 1x8192x28672 (448 tiles of 64 rows; 112.2-162.9 at the other
# tiles tried, cooperative 128-row blocks and other delays among them).
ONE_ROW_GAMMA_MAX_TILES = FEW_TILES  # the most GEMV tiles (one round) for which gamma goes on w's blocks by default


def one_row_forward(K: int, N: int) -> MosaicGemmConfig:
    """The built-in tiles of the one-row forward for w (K, N) (ONE_ROW_FORWARD says why): 128 rows where N / 128
    tiles make one round filling at least 3/4 of FEW_TILES SMs, else 64 (or the first that divides N and K), the
    64-row tiles' K loop in parts where ``gemv_config`` cuts the plain GEMV's."""
    wide = ONE_ROW_FORWARD[1]
    if 4 * (N // wide.tile_m) >= 3 * FEW_TILES and N // wide.tile_m <= FEW_TILES and one_row_reason(K, N, wide) is None:
        return wide
    forward = pick_config(N, ONE_ROW_PADDED, K, ONE_ROW_FORWARD)
    in_parts = gemv_config(N, K)
    if forward == _ONE_ROW_64 and one_row_reason(K, N, forward) is None and one_row_reason(K, N, in_parts) is None:
        return in_parts
    return forward


def one_row_reason(K: int, N: int, forward: MosaicGemmConfig) -> str | None:
    """None when the one-row forward's transposed GEMV takes w (K, N) with these tiles; else the constraint."""
    if forward.tile_n != ONE_ROW_PADDED or forward.cta_n != ONE_ROW_PADDED:
        return (f"one row (M=1): the forward runs transposed, x padded to {ONE_ROW_PADDED} rows as the CTA's "
                f"columns: its config needs tile_n={ONE_ROW_PADDED} and schedule='pingpong' or wg_split='m'; got "
                f"tile_n={forward.tile_n}, schedule={forward.schedule!r}, wg_split={forward.wg_split!r}")
    if K % (ONE_ROW_STAT_ROWS * 8):
        return (f"one row (M=1): K={K} is not a multiple of {ONE_ROW_STAT_ROWS * 8} (x is viewed "
                f"({ONE_ROW_STAT_ROWS}, K / {ONE_ROW_STAT_ROWS}) in 8-column groups for r)")
    reason = gemm_unsupported_reason(N, ONE_ROW_PADDED, K, forward, names=("N", "x's padded rows", "K"))
    return f"one row (M=1): {reason} (forward GEMV)" if reason else None


# Where no tuned entry covers a shape, the devices below take the forms and tiles of their own entry at UNTUNED_FROM
# (γ in the MMA warpgroups' registers, r shared by each row block's first tile, the K side's row dot summed over the
# dx kernel's tiles, xr from its epilogue, 64x256 tiles, the tile inputs through the stage rings) wherever those
# tiles and forms fit (a row of at most 132 dx tiles for its row sums; every row block's first tile, which shares r,
# in the forward's whole rounds), bfloat16 without a residual; the entry's tiles are narrowed (below) before its fit is
# judged. Lowered for CUDA at 450 shapes (M 128-32768, K 256-40960, N 256-65536; benchmarks/scripts/
# untuned_rule_lowering.py), those it takes all lowered and the 30 it leaves to the tables would have raised. Taking
# the narrowed tiles where the entry's own do not divide the shape, forward + backward µs, tables → the rule (`--modes
# fwd,fwd+bwd --variants default,builtin`, rmsnorm_matmul_configs_untuned_narrowed_entry-h200-25268ff.json; XLA):
# 243.3 → 185.2 (174.1) at 4096x896x4864, 72.8 → 66.0 (77.3) at 4096x896x1152, 464.9 → 332.6 (310.8) at
# 8192x896x4864, 93.4 → 67.6 (63.1) at 1024x896x4864, 650.1 → 557.8 (746.0) at 32768x4096x256, 194.3 → 161.2 (212.0)
# at 32768x1024x256; the forward within 3% either way. K = 960 and 576 had no Mosaic config (Triton ran there: 202.9
# and 98.6 µs against the rule's 130.6 and 61.5, rmsnorm_matmul-short_k_triton-h200-6ae39ec.json).
# Measured on the H200 at seven shapes no entry covers, forward + backward × XLA, built-in tables → that entry
# (rmsnorm_matmul_configs_untuned*-h200-*.json, variant "like_8192x4096x6144";
# NOTES.md, sixty-second session): 8192x4096x11008 0.932 → 1.012, 8192x4096x12288 0.927 → 1.004, 8192x2048x5632
# 0.914 → 1.029, 2048x4096x4096 0.971 → 1.078, 16384x3072x8192 0.916 → 0.938, 4096x5120x13824 0.933 → 0.946,
# 8192x768x3072 0.772 → 0.907; the forward alone 0.94-1.03 → 0.99-1.06. With the dx kernel's row sums on fuller
# rounds since (``gemm.config.sum_rows_grid``'s widths, the dx tiles of ``_untuned_dx``), 1.008 at 16384x3072x8192,
# 0.968 at 4096x5120x13824, 0.955 at 8192x768x3072, the others within 0.002 (rmsnorm_matmul_configs_untuned_dx_rules-
# h200-94a3001.json). Six models' MLP shapes at 8192 tokens, with each kernel's rounds filled (below): 0.99-1.02
# (rmsnorm_matmul-model_zoo-h200-4d0d904.json). At 128-1024 rows, with r from XLA and the dx kernel split (below),
# 0.71-1.03, where the tables ran 0.43-0.93 (rmsnorm_matmul_configs_few_rows_rule-h200-1ac46de.json). Other devices
# (the H100's entry there was not measured away from its shape) keep the tables.
UNTUNED_FROM = (8192, 4096, 6144)
UNTUNED_DEVICES = ("NVIDIA H200",)
# The dx kernel's tile width along K there (``_untuned_dx``): the entry's 256 columns, or a narrower width where its
# rounds come out fuller. The row sums hold a row's K / 256 tiles in one round, so few tiles a row can leave the last
# round part-full (8192x768x3072: 64 row blocks of 3 tiles, 192 tiles on 132 blocks, 2 rounds at 73%). A width's time
# is taken as rounds x width x its cost per column against 256's, measured at 8192x768x3072 on the H200 (the dx
# kernel 77.1 µs with 256, 62.9 with 192 in 2 rounds of 256 tiles, 69.0 with 128 in 3 rounds of 384:
# rmsnorm_matmul_configs_dx_tile_n-h200-b07e299.json; 160's cost is 192's and 128's between). Forward + backward on
# the H200, 256 → the width taken (toggle_ab_dx_tile_n-h200-94a3001.json, switch SWITCH_DX_TILE_N since removed):
# 203.6 → 190.6 µs at 8192x768x3072 (192), 377.3 → 346.8 at 16384x768x3072 (192), 260.0 → 240.7 at 4096x1536x4096
# (192), 2384.7 → 2334.6 at 4096x5120x13824 (160), 484.3 → 470.1 at 8192x1280x5120 (160), 701.8 → 681.2 at
# 4096x2560x8192 (160); the dx kernel alone 78.1 → 63.4, 143.7 → 116.3, 96.5 → 76.3, 873.1 → 810.6, 166.1 → 149.1,
# 252.7 → 224.9. 224's cost was fitted at 8192x3584x18944, where 256 wide, a row's 14 tiles run 9 rows to 126 blocks,
# 8 rounds at 89%, and 224 wide 16 a row run 8 full rounds of 128 (`--variants default,dx_n224`,
# rmsnorm_matmul_configs_dx_n224-h200-20c9f39.json): the dx kernel 1584.7 → 1389.4 µs (a cost of 1.002), forward +
# backward 4378.0 → 4174.1, 0.965 → 1.012x XLA. 64's at few rows, one round either way (`--variants default,dx_n64`,
# rmsnorm_matmul_configs_dx_n64-h200-be8254c.json): the dx kernel 48.9 → 40.6 µs at 256x2048x8192 (32 tiles 128
# wide), 24.4 → 22.0 at 512x1024x4096: a cost of 1.98 and 2.14.
UNTUNED_DX_COLUMN_COST = {256: 1.0, 224: 1.0, 192: 1.09, 160: 1.11, 128: 1.19, 64: 2.1}
# The forward kernel's tile width along N, the same way (``_untuned_forward``): at few rows the entry's 128x256 tiles
# leave its one round part-empty (512x4096x4096: 64 tiles on 132 blocks; cuBLAS runs 256x64 there). Forward µs, 256
# → 128 wide (`--variants default,fwd_n128`, rmsnorm_matmul_configs_fwd_n_few_rows-h200-be8254c.json): 45.6 → 34.4
# at 512x4096x4096, 27.1 → 20.3 at 256x2048x8192, 17.0 → 13.1 at 512x1024x4096 (one round each way), 49.4 → 47.3
# at 1024x2048x5632 (2 rounds → 3); 176.9 → 200.5 at 1024x4096x14336 (4 → 7) and 95.6 → 121.7 at 2048x2048x8192 (4 →
# 8), from which 128's cost per column (1.27-1.30; 1.51 in one round, where the tile's fixed costs weigh more). 64's
# where 128-wide tiles leave a round half empty, one round either way (`--modes fwd --variants default,fwd_n64`, input
# sets rotated, rmsnorm_matmul_configs_few_rows_fwd_k1024-h200-e8d9689.json; XLA): 9.2 → 8.1 (7.7) at 256x1024x4096,
# 8.2 → 6.2 (7.2) at 128x1024x1024 (costs of 2.29 and 1.97); 9.9 → 14.4 (11.0) at 512x1024x4096, one round → two.
UNTUNED_FORWARD_COLUMN_COST = {256: 1.0, 128: 1.3, 64: 2.2}
# And the dw kernel's last round, where part-empty, split along M (its K loop) over the idle blocks: stream-K's split
# 4 (``_untuned_dw``; ``gemm.stream_k.plan_for`` says where it plans one). Measured on the H200 (`--variants
# default,dw_sk4`: rmsnorm_matmul_configs_dw_stream_k4-h200-c900f53.json), forward + backward × XLA and the dw kernel:
# 8192x1536x8960 0.961 → 1.006 (420 tiles, 4 rounds at 80%; 334.5 → 292.6 µs), 8192x2560x10240 0.972 → 0.996 (800
# tiles, 7 rounds at 87%; 590.5 → 551.7); outputs within 0.0034 of the whole tiles' (relative to the largest). Where
# the last round is fuller (at most half: beyond, plan_for plans none) its tiles split in fewer pieces, 2 at
# 8192x4096x11008 (56 tiles of 132) and 4096x5120x13824 (48), measured as well (`--variants default,dw_sk4`,
# rmsnorm_matmul_configs_dw_sk4_fuller-h200-20c9f39.json): the dw kernel 943.2 → 914.2 and 758.1 → 748.8 µs, forward
# + backward × XLA 1.013 → 1.024 and 0.973 → 0.977. So it is taken wherever plan_for plans one; whole → split,
# forward + backward µs (`--variants default,dw_sk0`, rmsnorm_matmul_configs_dw_sk0_untuned-h200-98b64af.json):
# 241.5 → 228.9 at 4096x1536x4096 (60 tiles left of 192), 204.0 → 201.0 at 2048x2560x4096 (56 of 320), 133.8 → 130.4
# at 2048x3584x1536 (36 of 168).
UNTUNED_DW_STREAM_K = 4
# At few rows, two more changes. The forward takes r and x ⊙ gamma from XLA's pass (gamma_on "x", no statistics in
# the kernel) at M <= UNTUNED_FEW_ROWS: with r shared by each row block's first tile, the one or two rounds wait on
# those tiles. Forward µs, shared r → XLA's pass (`--modes fwd --variants default,gamma_on_x`, rmsnorm_matmul_configs_
# fwd_gamma_x_few_rows-h200-c039b92.json, ..._fwd_gamma_x_crossover-h200-fe7fc08.json): 20.1 → 15.0 at 256x2048x8192
# (0.78 → 1.05x XLA), 13.1 → 9.5 at 512x1024x4096, 34.4 → 27.6 at 512x4096x4096, 46.3 → 39.9 at 1024x2048x5632,
# 48.0 → 47.2 at 1024x4096x4096, 178.9 → 176.4 at 1024x4096x14336; at 2048 rows and more it lost at 5 shapes of 6
# (95.0 → 98.0 at 2048x4096x4096, 181.3 → 190.1 at 4096x4096x4096; 97.4 → 95.9 at 2048x2048x8192). Forward +
# backward, the rule → the shared r again (`--variants default,fwd_shared_r`, rmsnorm_matmul_configs_fwd_shared_r_
# few_rows-h200-0ee3656.json): 97.4 → 104.8 µs at 512x4096x4096, 126.8 → 132.3 at 1024x2048x5632, 159.1 → 158.4 at
# 1024x4096x4096, 507.2 → 506.8 at 1024x4096x14336.
UNTUNED_FEW_ROWS = 1024
# Below the entry's 128-row forward tiles (64 or 192 rows: none of its widths takes them) the built-in tables' kernels
# run, and XLA's backward where ``_untuned_backward`` takes it: their dx and dw kernels fill a few blocks (16 dx tiles
# at 64x4096). Forward + backward µs, the tables' backward → XLA's (`--modes fwd,fwd+bwd --variants default,bwd_xla`,
# rmsnorm_matmul_configs_few_rows_builtin_xla_backward-h200-e0931f0.json; XLA): 186.6 → 126.7 (123.2) at
# 64x4096x14336, 81.2 → 53.6 (58.1) at 64x2048x8192, 73.6 → 63.1 (56.0) at 64x4096x4096, 43.1 → 23.5 (23.3) at
# 64x1024x3072, 97.9 → 70.6 (52.4) at 192x2048x8192; outputs within 0.7% of the tables' (relative to the largest).
# And where the dx kernel's tiles fill at most half the grid (``_untuned_backward``) the backward is XLA's own from
# the forward's r (``backward_in_xla``: two cuBLAS GEMMs, XLA's fusions): our backward kernels' one short round there
# trails cuBLAS's split GEMMs. Forward + backward µs, the rule before (the dx kernel a plain GEMM split by stream-K,
# dgamma from u: c039b92's change, 92.5 → 79.4 µs at 256x2048x8192) → XLA's backward, with XLA (`--modes fwd+bwd
# --variants default,bwd_xla`, input sets rotated, rmsnorm_matmul_configs_few_rows_stages_bwd_xla-h200-876ce91.json):
# 83.5 → 66.2 (61.5) at 256x2048x8192 (64 dx tiles), 44.5 → 37.7 (41.6) at 512x1024x4096 (64), 26.1 → 22.2 (21.5) at
# 128x1024x1024 (16), 36.8 → 32.3 (32.5) at 256x1024x4096 (32); where the tiles fill the grid, equal or slower: 98.1 →
# 97.7 (88.2) at 512x4096x4096 (128 tiles), 127.8 → 126.7 (125.9) at 1024x2048x5632 (128), and in another call
# (rmsnorm_matmul_configs_bwd_xla-h200-b75d1a6.json, one input set) 159.0 → 169.5 (159.2) at 1024x4096x4096 (256),
# 287.5 → 323.6 (307.2) at 2048x4096x4096. At 1024 rows and fewer, also where XLA runs the dw GEMM anyway (few (K, N)
# tiles, ``dw_by_xla``): there dgamma = Σ_N w ⊙ g read the float32 g and dw another XLA pass. Forward + backward µs, our
# backward kernels → XLA's (`--variants default,bwd_ours`, rmsnorm_matmul_configs_few_rows_dw_xla_bwd-h200-
# d17d089.json; XLA): 53.7 → 41.4 (45.2) at 512x2048x2048, 50.4 → 36.9 (38.6) at 384x2048x2048, 67.8 → 56.0 (54.5) at
# 1024x1024x4096, 66.0 → 58.3 (58.1) at 1024x2048x2048, 51.3 → 40.2 (41.8) at 768x1024x2816; at 2048 rows XLA's lost
# (2048x2048x2048: 101.0 → 110.1, XLA 99.7). And at 1024 rows and fewer where the entry's 128x256 dx tiles would fill
# at most half the grid, though ``_untuned_dx`` narrows them to fill it: the narrowed kernel's one round trailed
# cuBLAS's. Forward + backward µs, ours → XLA's (`--variants default,bwd_xla`, input sets rotated, rmsnorm_matmul_
# configs_one_round_bwd_xla-h200-ec8c889.json; XLA): 245.4 → 209.6 (204.2) at 512x4096x11008, 76.2 → 73.4 (60.7) at
# 256x8192x2048, 81.0 → 77.9 (76.5) at 768x2048x4096, 164.9 → 157.8 (150.7) at 1024x2048x8192 (128x128 dx tiles,
# 96-128 of them); and 97.3 → 93.2 (89.4) at 512x4096x4096, 127.5 → 124.1 (121.9) at 1024x2048x5632
# (rmsnorm_matmul_configs_mid_rows_dw_forms-h200-ec8c889.json). Where the entry's tiles fill the grid ours won (159.1
# → 169.8 at 1024x4096x4096, 128 of 128x256) or tied (768x4096x4096 142.2 → 139.3, 1536x2048x4096 138.4 → 137.7: 96
# tiles); beyond 1024 rows XLA's lost (ours → XLA's, rmsnorm_matmul_configs_bwd_xla_many_rows-h200-109dfba.json:
# 101.9 → 105.4 at 4096x512x4096, 69.0 → 74.1 at 8192x256x2048, 160.1 → 165.8 at 2048x1024x8192, 228.0 → 230.9 at
# 4096x512x11008), though it won at 2048x1024x4096 (99.7 → 96.4).
# And at 1024 rows and fewer where N is at least UNTUNED_XLA_BWD_N_OVER_K times K (the dx kernel's few output tiles,
# each a K loop over N). Forward + backward µs, ours → XLA's behind the split forward (`--modes fwd+bwd --variants
# default,bwd_xla`, rmsnorm_matmul_configs_few_rows_bwd_xla{,2}-h200-7ec5ab9.json; XLA): 507.7 → 493.4 (480.3) at
# 1000x4096x14336, 582.5 → 567.3 (554.0) at 1024x3584x18944, 410.7 → 395.1 (376.6) at 1000x4096x11008, 410.8 →
# 393.0 (384.6) at 1024x4096x11008, 333.8 → 295.2 (301.2) at 768x4096x11008 (the five this rule changes; at
# 1024x2048x8192, 1024x2048x5632 and 512x4096x14336 both variants were already XLA's backward: 160.7 / 160.8, 124.5 /
# 125.2, 266.5 / 268.6, the spread of one config timed twice); where N = K ours won (160.5 → 171.2 at
# 1024x4096x4096).
UNTUNED_XLA_BWD_N_OVER_K = 2.5
# And at few rows the forward kernel is one or two rounds reading w from HBM, each tile's K loop long: where that loop
# has at least UNTUNED_DEEP_RING_STEPS steps the ring takes UNTUNED_DEEP_RING_STAGES stages where they fit
# (``_untuned_deep_ring``; cuBLAS's tiles there take 6 of 64). Forward µs, 4 → 5 → 6 stages (`--modes fwd --variants
# default,fwd_s5,fwd_s6`, input sets rotated, rmsnorm_matmul_configs_few_rows_stages-h200-876ce91.json; XLA): 17.3 →
# 16.0 → 15.6 (16.6) at 256x2048x8192 (32 steps), 29.6 → 27.5 → 27.2 (28.3) at 512x4096x4096 (64), 41.6 → 38.9 → 38.4
# (38.3) at 1024x2048x5632; no gain where K = 1024 (16 steps: 9.6 → 9.8 → 9.7 at 512x1024x4096, 8.2 → 8.3 → 8.4 at
# 128x1024x1024, 9.0 → 9.1 → 9.2 at 256x1024x4096). Where the tiles are 64 wide 8 stages fit (9 overflow), and 8 ran
# faster than 6 and 7 at 4 shapes of 5 (`--modes fwd --variants default,fwd_s7,fwd_s8`, rmsnorm_matmul_configs_
# few_rows_fwd_s8-h200-5041852.json; forward µs, 6 → 7 → 8 stages, XLA): 27.4 → 27.9 → 26.6 (22.0) at 256x8192x2048,
# 14.5 → 14.5 → 14.1 (14.6) at 256x4096x1024, 18.4 → 18.5 → 17.6 (15.8) at 512x4096x1024, 12.9 → 13.8 → 11.0 (19.0)
# at 512x2048x2048; 14.1 → 14.2 → 14.4 (16.1) at 128x4096x2048. With the rule taking 8, 6 → 8 at six shapes
# (`--modes fwd --variants default,fwd_s6`, rmsnorm_matmul_configs_few_rows_fwd_ring8_rule-h200-f8169dd.json): 27.5 →
# 26.5 at 256x8192x2048, 14.1 → 13.9 at 256x4096x1024, 14.5 → 14.3 at 128x4096x2048, 18.3 → 18.0 at 512x4096x1024,
# 12.8 → 10.6 at 512x2048x2048, 12.5 → 10.3 at 384x2048x2048.
UNTUNED_DEEP_RING_STEPS = 32
UNTUNED_DEEP_RING_STAGES = (8, 6)
# And where the forward's tiles fill at most half the grid and its K loop has at least UNTUNED_SPLIT_FORWARD_STEPS
# steps, stream-K splits that loop over UNTUNED_SPLIT_FORWARD blocks (``_untuned_forward_split``). Forward µs, whole
# tiles → split in 4 (`--modes fwd --variants default,fwd_sk`, input sets rotated, rmsnorm_matmul_configs_few_rows_
# fwd_sk-h200-d17d089.json; XLA): 19.9 → 14.3 (13.9) at 256x4096x1024 (32 tiles of 128x64, 64 steps), 19.9 → 14.5
# (14.6) at 128x4096x2048 (32), 37.1 → 27.5 (21.4) at 256x8192x2048 (64 tiles, 128 steps), 21.7 → 18.3 (16.4) at
# 512x4096x1024 (64); slower with 16 steps (9.2 → 10.8 at 256x1024x4096, 8.2 → 11.5 at 128x1024x1024:
# rmsnorm_matmul_configs_few_rows_fwd_k1024-h200-e8d9689.json, where the tiles were 128 wide).
# Where the pieces overflow one round (4 per tile: more than 33 tiles on 132 blocks) neither form wins throughout.
# Forward µs, whole → split in 4 (`--modes fwd --variants default,fwd_sk0` at 530f301, `default,fwd_sk` at 25268ff,
# rmsnorm_matmul_configs_few_rows_fwd_cluster_n-h200-530f301.json, ..._few_rows_fwd_split_two_rounds-h200-25268ff.json):
# 16.6 → 18.0 at 512x4096x1024 (64 tiles, 64 steps), 16.5 → 17.4 at 384x4096x1024 (48, 64), 16.6 → 16.6 at
# 256x4096x2048 (64, 64), 19.5 → 19.6 at 256x5120x2048 (64, 80), 17.6 → 16.6 at 128x4096x4096 (64, 64), 20.3 → 19.2
# at 1024x4096x512 (64, 64), 22.3 → 21.9 at 256x6144x2048 (64, 96), 28.3 → 26.6 at 256x8192x2048 (64, 128): the
# split stays.
UNTUNED_SPLIT_FORWARD_STEPS = 64
UNTUNED_SPLIT_FORWARD = 4
# Over more than one round, where the last round is at most half full and the K loop has at least
# UNTUNED_SPLIT_TAIL_STEPS steps, the split in 4 also beat the entry's (1). Forward µs, entry → split in 4
# (`--modes fwd --variants default,fwd_sk`, rmsnorm_matmul_configs_few_rows_fwd_sk_{rounds,tail}-h200-{39b7946,
# 7b4938c}.json; last round's tiles of 132, K steps; XLA): 179.0 → 167.1 (157.8) at 1000x4096x14336 (52, 64),
# 176.8 → 164.6 (160.7) at 1024x4096x14336 (52, 64), 193.3 → 184.0 (179.5) at 1024x3584x18944 (64, 56); lost at
# 1024x2048x5632 (32 steps: 38.0 → 42.7, XLA 38.1); within 2% where the last round was fuller (1000x4096x11008,
# 80: 137.9 → 137.8; 512x4096x14336, 92: 92.5 → 92.1; 768x4096x11008, 126: 94.1 → 94.4; 1024x2048x8192, 124: 49.0 →
# 48.0).
UNTUNED_SPLIT_TAIL_STEPS = 56
# Beyond few rows, where K is short (at most UNTUNED_SHORT_K: 16 steps or fewer), N wider than K and the forward's
# tiles make at most UNTUNED_SHORT_K_ROUNDS rounds, the forward also takes r and x ⊙ gamma from XLA's pass, and whole
# tiles (``_untuned_short_k``): each row block's first tile, which shares r, is there most of a round the others wait
# on, and stream-K's last-round split gains little. Forward / forward + backward µs, the entry's forms → these
# (`--modes fwd,fwd+bwd --variants default,gamma_on_x+fwd_sk0`, rmsnorm_matmul_configs_short_k_r_from_xla-h200-
# 7aaf519.json; XLA): 46.3 → 39.7 / 132.2 → 125.5 (33.9 / 115.4) at 4096x960x2560 (2.4 rounds), 23.0 → 17.6 / 61.6 →
# 56.4 (18.0 / 67.8) at 4096x576x1536, 24.3 → 23.2 / 64.7 → 64.3 at 4096x896x1152, 18.1 → 16.7 / 56.4 → 56.4 at
# 2048x1024x2048, 24.0 → 18.8 / 71.0 → 66.9 (19.5 / 63.8) at 2048x768x3072, 41.6 → 39.1 / 130.4 → 130.7 at
# 2048x1024x5632, 26.2 → 24.6 / 76.0 → 75.7 at 4096x768x2048; where N = K it lost (4096x1024x1024: 18.2 → 19.0 /
# 57.1 → 59.7), and with more rounds whole tiles lose (fwd_sk0: 57.9 → 68.9 at 4096x896x4864, 4.6 rounds; 60.4 →
# 73.4 at 8192x768x3072, 5.8; rmsnorm_matmul_configs_short_k_forward_forms-h200-6ae39ec.json).
UNTUNED_SHORT_K = 1024
UNTUNED_SHORT_K_ROUNDS = 3
# Shorter still (K below UNTUNED_SHORT_K: 15 steps or fewer), the forward takes the 16384x1024x5504 entry's ping-pong
# tiles (UNTUNED_PINGPONG_FORWARD: each MMA warpgroup a whole 128x128 tile, its epilogue under the other's wgmma),
# with r and x ⊙ gamma from XLA's pass, at any number of rounds: there the epilogue is a fifteenth of a tile's time or
# more, and half-wide tiles fill the last round better (4096x960x2560: 640 tiles, 4.8 rounds of half a tile, against
# 320 in 2.4 rounds). Forward µs, the rule before → these (`--modes fwd --variants default,gamma_on_x+fwd_pp_end,
# gamma_on_x+fwd_sk0+fwd_n128`, rmsnorm_matmul_configs_short_k_pingpong-h200-bde8a16.json; XLA): 39.1 → 34.1 (33.5)
# at 4096x960x2560, 16.9 → 16.2 (17.3) at 4096x576x1536, 23.4 → 22.3 (19.9) at 4096x896x1152, 18.8 → 18.1 (19.0) at
# 2048x768x3072, 24.5 → 23.9 (24.0) at 4096x768x2048, and beyond 3 rounds, where the entry's r shared by the first
# tiles ran, 58.2 → 56.0 (54.2) at 4096x896x4864, 60.7 → 59.4 (60.3) at 8192x768x3072. At K = 1024 (16 steps) they
# did not win: 39.0 → 39.1 at 2048x1024x5632, 102.3 → 105.2 at 8192x1024x4096, 18.3 → 19.1 at 4096x1024x1024 (N = K);
# cooperative 128x128 tiles (fwd_n128) lost to them at every shape. Forward + backward, the rule before → this
# (toggle_ab_short_k_pingpong-h200-9cb3fb4.json, switch SWITCH_SHORT_K_PINGPONG since removed): 123.8 → 119.1 µs at
# 4096x960x2560 (XLA 117.1), 56.4 → 55.4 at 4096x576x1536, 64.1 → 62.6 at 4096x896x1152, 66.3 → 65.7 at 2048x768x3072,
# 74.7 → 74.6 at 4096x768x2048, 184.2 → 181.1 at 4096x896x4864, 188.0 → 187.1 at 8192x768x3072; 345.4 → 346.4 at
# 16384x768x3072 (23 rounds of 128x128 tiles), the one loss.
UNTUNED_PINGPONG_FORWARD = dict(tile_m=128, tile_n=128, wg_split="n", schedule="pingpong", num_stages=6,
                                delay_release=1, memory_warps=1, epilogue_store="end", stream_k=0, grid_minor="m",
                                grid_tile_width=8)


def _untuned_config(M: int, K: int, N: int, dtype, residual: bool) -> MosaicRMSNormMatmulConfig | None:
    """This device's entry at UNTUNED_FROM where it takes (M, K, N), the tables' kernels with XLA's backward below its
    forward tiles' rows (see above), else None."""
    if M == 1 or residual or jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16) or tuning.device_kind() not in \
            UNTUNED_DEVICES:
        return None
    params = tuning.lookup(OP, shape_key(*UNTUNED_FROM, dtype), backend="mosaic")
    if params is None:
        return None
    config = MosaicRMSNormMatmulConfig(**params)
    if config.dgamma_reason(M, N, dtype) is not None:
        return None
    sms = mosaic_utils.num_sms()
    entry_dx = config.dx
    if config.dx_in_kernel and -(-K // config.dx.cta_n) > sms:  # the dx kernel's row sums: a row's tiles in a round
        return None
    if config.dx_in_kernel:
        config = _if_supported(dataclasses.replace(config, dx=_untuned_dx(M, K, config.dx, sms)), config, M, K, N,
                               dtype)
    config = _if_supported(dataclasses.replace(config, dw=_untuned_dw(M, K, N, config.dw, sms)), config, M, K, N, dtype)
    config = _untuned_forward(M, K, N, config, sms)
    if config is None and M <= UNTUNED_FEW_ROWS:  # fewer rows than the entry's forward tiles hold (see above)
        return _untuned_below_entry(M, K, N, entry_dx, sms)
    if config is None or config.unsupported_reason(M, K, N) is not None:  # (the narrowed tiles, each kernel's)
        return None
    if M <= UNTUNED_FEW_ROWS:
        from_xla = dataclasses.replace(config, gamma_on="x", stats_in_kernel=False, squares_from="observe")
        config = _if_supported(_untuned_deep_ring(K, from_xla), config, M, K, N, dtype)
        config = _if_supported(_untuned_forward_split(M, K, N, config, sms), config, M, K, N, dtype)
    else:
        config = _if_supported(_untuned_short_k(M, K, N, config, sms), config, M, K, N, dtype)
    return _untuned_backward(M, K, N, config, entry_dx, sms)


def _if_supported(candidate: MosaicRMSNormMatmulConfig, config: MosaicRMSNormMatmulConfig, M: int, K: int, N: int,
                  dtype) -> MosaicRMSNormMatmulConfig:
    """``candidate`` where its kernels take (M, K, N) and dtype, or where ``config``'s do not either (the entry's
    tiles before another kernel's are narrowed: ``_untuned_config`` checks the result); else ``config``."""
    def ok(c: MosaicRMSNormMatmulConfig) -> bool:
        return c.unsupported_reason(M, K, N) is None and c.dgamma_reason(M, N, dtype) is None
    return candidate if ok(candidate) or not ok(config) else config


def _untuned_below_entry(M: int, K: int, N: int, entry_dx: MosaicGemmConfig,
                         sms: int) -> MosaicRMSNormMatmulConfig | None:
    """The built-in tables' kernels where none of the entry's forward tiles takes M's rows, with XLA's backward where
    ``_untuned_backward`` takes it (see above); None where the tables' kernels do not take the shape either."""
    builtin = mosaic_builtin_config(M, K, N)
    if builtin.unsupported_reason(M, K, N) is not None:
        return None
    return _untuned_backward(M, K, N, builtin, entry_dx, sms)


def _untuned_backward(M: int, K: int, N: int, config: MosaicRMSNormMatmulConfig, entry_dx: MosaicGemmConfig,
                      sms: int) -> MosaicRMSNormMatmulConfig:
    """``config`` with XLA's backward (``backward_in_xla``) where its dx kernel's (M, K) tiles fill at most half of
    ``sms`` blocks, or, at most UNTUNED_FEW_ROWS rows, where the entry's dx kernel's (``entry_dx``, before
    ``_untuned_dx`` narrows its tiles) would, XLA runs its dw GEMM anyway or N is at least UNTUNED_XLA_BWD_N_OVER_K
    times K (see above); else as it is."""
    def half_grid(dx: MosaicGemmConfig) -> bool:
        return 2 * -(-M // dx.cta_m) * -(-K // dx.cta_n) <= sms
    if half_grid(config.dx) or (M <= UNTUNED_FEW_ROWS and (half_grid(entry_dx) or config.dw_by_xla(K, N)
                                                           or N >= UNTUNED_XLA_BWD_N_OVER_K * K)):
        return dataclasses.replace(config, backward_in_xla=True)
    return config


def _untuned_forward_split(M: int, K: int, N: int, config: MosaicRMSNormMatmulConfig,
                           sms: int) -> MosaicRMSNormMatmulConfig:
    """``config`` with its forward's K loop split by stream-K over UNTUNED_SPLIT_FORWARD blocks where its tiles fill
    at most half of ``sms`` blocks and the loop has at least UNTUNED_SPLIT_FORWARD_STEPS steps, or fill more than a
    round, the last at most half, and the loop has at least UNTUNED_SPLIT_TAIL_STEPS, and ``stream_k.plan_for``
    plans the split (see above); else as it is."""
    fwd = config.forward
    tiles = -(-M // fwd.cta_m) * -(-N // fwd.cta_n)
    steps = K // fwd.tile_k
    half_grid = 2 * tiles <= sms and steps >= UNTUNED_SPLIT_FORWARD_STEPS
    short_tail = tiles > sms and 0 < 2 * (tiles % sms) <= sms and steps >= UNTUNED_SPLIT_TAIL_STEPS
    if not (half_grid or short_tail) or stream_k.plan_for(tiles, sms, steps, split=UNTUNED_SPLIT_FORWARD) is None:
        return config
    split = _tried(lambda: dataclasses.replace(fwd, stream_k=UNTUNED_SPLIT_FORWARD))
    return config if split is None else dataclasses.replace(config, forward=split)


def _untuned_short_k(M: int, K: int, N: int, config: MosaicRMSNormMatmulConfig,
                     sms: int) -> MosaicRMSNormMatmulConfig:
    """``config`` with r and x ⊙ gamma from XLA's pass where K is at most UNTUNED_SHORT_K and N wider than K: below
    UNTUNED_SHORT_K with the ping-pong forward tiles of UNTUNED_PINGPONG_FORWARD, at it with whole forward tiles where
    they make at most UNTUNED_SHORT_K_ROUNDS rounds on ``sms`` blocks (see above); else as it is."""
    fwd = config.forward
    if K > UNTUNED_SHORT_K or N <= K:
        return config
    if K < UNTUNED_SHORT_K:
        fwd = dataclasses.replace(fwd, **UNTUNED_PINGPONG_FORWARD)
    elif -(-M // fwd.cta_m) * -(-N // fwd.cta_n) <= UNTUNED_SHORT_K_ROUNDS * sms:
        fwd = dataclasses.replace(fwd, stream_k=0)
    else:
        return config
    return dataclasses.replace(config, gamma_on="x", stats_in_kernel=False, squares_from="observe", forward=fwd)


def _fits_smem(cfg: MosaicGemmConfig) -> bool:
    """Whether ``cfg``'s bfloat16 tiles fit in shared memory (``smem_bytes`` + BARRIER_BYTES)."""
    return smem_bytes(cfg, jnp.bfloat16, jnp.bfloat16) + BARRIER_BYTES <= mosaic_utils.H100_SMEM_BYTES


def _ring_within_smem(cfg: MosaicGemmConfig) -> MosaicGemmConfig:
    """``cfg`` with its stage ring shortened, to no fewer than delay_release + 1 stages, until it ``_fits_smem``."""
    while cfg.num_stages > cfg.delay_release + 1 and not _fits_smem(cfg):
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def _untuned_deep_ring(K: int, config: MosaicRMSNormMatmulConfig) -> MosaicRMSNormMatmulConfig:
    """``config`` with its forward ring as deep as the first of UNTUNED_DEEP_RING_STAGES that fits in shared memory
    where the K loop has at least UNTUNED_DEEP_RING_STEPS steps (see above); else as it is."""
    if K // config.forward.tile_k < UNTUNED_DEEP_RING_STEPS:
        return config
    for stages in UNTUNED_DEEP_RING_STAGES:
        deep = dataclasses.replace(config.forward, num_stages=stages)
        if stages > config.forward.num_stages and _fits_smem(deep):
            return dataclasses.replace(config, forward=deep)
    return config


def _untuned_forward(M: int, K: int, N: int, config: MosaicRMSNormMatmulConfig,
                     sms: int) -> MosaicRMSNormMatmulConfig | None:
    """``config`` with its forward kernel's tile width of UNTUNED_FORWARD_COLUMN_COST taking the least rounds x width x
    cost on ``sms`` blocks (the entry's where they tie), of those the forward kernel's checks take (e.g. 128 wide
    where 256 does not divide N); None where they take none."""
    best_work, best = None, None
    for tile_n, cost in UNTUNED_FORWARD_COLUMN_COST.items():
        stores = (config.forward.epilogue_store, "end")  # (64 wide has no two halves for the split store)
        candidate = next(filter(None, (_tried(lambda t=tile_n, e=e: dataclasses.replace(
            config, forward=dataclasses.replace(config.forward, tile_n=t, epilogue_store=e))) for e in stores)), None)
        if candidate is None:
            continue
        fwd = candidate.forward
        if M < fwd.cta_m or candidate.unsupported_reason(M, K, N) is not None:  # (fewer rows than a tile: the
            # tables' kernels, ``_untuned_below_entry``. At 64 rows the entry's 128-row tiles, 64 of them past M,
            # took 44.1 / 128.0 µs forward / forward + backward at 64x4096x14336 where the tables' kernels with XLA's
            # backward took 32.0 / 119.4, and 17.3 / 55.2 against 14.4 / 52.6 at 64x2048x8192 (the call at 4212e55,
            # NOTES.md; with this check, 32.8 / 120.8 and 14.4 / 52.1: rmsnorm_matmul-ragged_rows_few-h200-f099cf2)
            continue
        tiles = -(-M // fwd.cta_m) * -(-N // fwd.cta_n)  # (the last row of them may run past M)
        plan = stream_k.plan_for(tiles, sms, K // fwd.tile_k, split=fwd.stream_k) if fwd.stream_k else None
        # r shared by each row block's first tile, which must run in the whole rounds, and the a_operand's equal
        # stream-K ranges (the forward kernel's checks, ``gemm.mosaic.gemm``)
        if plan is not None and (plan.dp_tiles < -(-M // fwd.cta_m) or plan.segment_steps is None):
            continue
        if plan is None and fwd.epilogue_store == "split":  # no stream-K phase (at most one round, or whole rounds):
            # without one ptxas serializes the split store's wgmma beside γ's registers (C7513; NOTES.md,
            # thirty-seventh session), so the output is stored at the tile's end. On the H200, forward µs split → end
            # (`--variants default,fwd_split`, rmsnorm_matmul_configs_fwd_end_no_phase-h200-98b64af.json): 51.8 → 41.1
            # at 2048x3584x1536 (96 tiles), 58.8 → 48.1 at 1024x4096x4096 (128), 113.0 → 96.0 at 4224x4096x2048 (264)
            candidate = dataclasses.replace(candidate, forward=dataclasses.replace(fwd, epilogue_store="end"))
        work = -(-tiles // sms) * tile_n * cost  # rounds x width x cost per column
        if best_work is None or work < best_work or (work == best_work and tile_n == config.forward.tile_n):
            best_work, best = work, candidate
    return best


def _untuned_dx(M: int, K: int, dx: MosaicGemmConfig, sms: int) -> MosaicGemmConfig:
    """The entry's dx kernel (row sums over (M, K) tiles) with the tile width of UNTUNED_DX_COLUMN_COST taking the
    least rounds x width x cost on ``sms`` blocks, of the widths that tile K (256 where they tie)."""
    best_work, best = None, dx
    for tile_n, cost in UNTUNED_DX_COLUMN_COST.items():
        candidate = dataclasses.replace(dx, tile_n=tile_n,
                                        epi_tile_n=dx.epi_tile_n if tile_n % dx.epi_tile_n == 0 else 32)
        row_tiles = K // candidate.cta_n
        if K % candidate.cta_n or row_tiles > sms:
            continue
        grid = sum_rows_grid(candidate, row_tiles, sms)[0]
        work = -(-M // candidate.cta_m * row_tiles // grid) * tile_n * cost  # rounds x width x cost per column
        if best_work is None or work < best_work:
            best_work, best = work, candidate
    return best


def _untuned_dw(M: int, K: int, N: int, dw: MosaicGemmConfig, sms: int) -> MosaicGemmConfig:
    """The entry's dw kernel ((K, N) = xᵀ @ dy, over M) with stream-K split UNTUNED_DW_STREAM_K where
    ``stream_k.plan_for`` plans one for its tiles on ``sms`` blocks (a last round at most half full); else as it is."""
    if dw.stream_k or K % dw.cta_m:
        return dw
    tiles = K // dw.cta_m * -(-N // dw.cta_n)
    plan = stream_k.plan_for(tiles, sms, -(-M // dw.tile_k), split=UNTUNED_DW_STREAM_K)
    if plan is None:
        return dw
    return dataclasses.replace(dw, stream_k=UNTUNED_DW_STREAM_K)


def mosaic_default_config(M: int, K: int, N: int, dtype=jnp.bfloat16, *, residual: bool = False,
                          stats_in_kernel: bool | str = False) -> MosaicRMSNormMatmulConfig:
    """The Mosaic config a call uses without ``block_sizes``: the tuning-cache entry for this device and shape if
    its tiles fit the shape (else, M not a power of two, the entry for the power of two below M: 16448 rows take
    16384's, their last row of tiles running past M); else, on UNTUNED_DEVICES, the entry at UNTUNED_FROM where its
    tiles fit; else the built-in tables (``mosaic_builtin_config``, where ``stats_in_kernel`` leads). Rows not a
    multiple of 8 take XLA's backward where the forward takes them as they are (``forward_takes_any_rows``): our
    backward kernels need them padded, which cost more than XLA's backward at every shape measured (forward +
    backward 6-21% more at 1001-16401 rows; at 16401x1024x5504 1009.0 against 832.1 µs, XLA alone 791.2:
    rmsnorm_matmul-ragged_rows_bwd-h200-9f8ee54.json)."""
    config = _tuned_untuned_or_builtin(M, K, N, dtype, residual, stats_in_kernel)
    if (M >= FEWEST_ROWS and M % PARTIAL_ROWS_MULTIPLE and not config.backward_in_xla
            and forward_takes_any_rows(config, dtype, dtype)):
        config = dataclasses.replace(config, backward_in_xla=True)
    return config


def forward_takes_any_rows(config: MosaicRMSNormMatmulConfig, dtype, out_dtype) -> bool:
    """Whether the forward kernel of ``config`` takes rows that are not a multiple of 8 as they are (``gemm``'s
    partial_rows through untiled views: ``gemm.config.any_rows_reason``), so that only the backward pads them."""
    return config.forward.pipeline == "own" and any_rows_reason(config.forward, dtype, out_dtype) is None


def _tuned_untuned_or_builtin(M: int, K: int, N: int, dtype, residual: bool, stats_in_kernel
                              ) -> MosaicRMSNormMatmulConfig:
    if not stats_in_kernel:
        for rows in dict.fromkeys((M, 1 << (M.bit_length() - 1))):  # (the key rounds M up to a power of two)
            params = tuning.lookup(OP, shape_key(rows, K, N, dtype, residual=residual), backend="mosaic")
            tuned = None if params is None else MosaicRMSNormMatmulConfig(**params)
            if tuned is not None and tuned.unsupported_reason(M, K, N) is None:
                return tuned
        untuned = _untuned_config(M, K, N, dtype, residual)
        if untuned is not None:
            return untuned
    return mosaic_builtin_config(M, K, N, residual=residual, stats_in_kernel=stats_in_kernel)


def mosaic_builtin_config(M: int, K: int, N: int, *, residual: bool = False,
                          stats_in_kernel: bool | str = False) -> MosaicRMSNormMatmulConfig:
    """The built-in tables' config: per kernel the first tiles that divide its GEMM (``unsupported_reason`` of the
    result names what divides nothing), r and gamma's side from XLA's passes. ``stats_in_kernel``: True, forward
    tiles with wg_split "n" only; "mma", forward tiles with one wgmma group in flight, whole tiles."""
    forward = {False: _FORWARD, True: tuple(c for c in _FORWARD if c.wg_split == "n"),
               **{name: _MMA_STATS_FORWARD for name in MMA_STATS}}[stats_in_kernel]
    rows = kernel_rows(M)
    forward = one_row_forward(K, N) if M == 1 else pick_config(rows, N, K, forward, partial_rows=True)
    return MosaicRMSNormMatmulConfig(forward=forward, stats_in_kernel=stats_in_kernel,
                                     dx=pick_config(rows, K, N, _DX_RESIDUAL if residual else _DX, partial_rows=True),
                                     dw=pick_config(K, N, rows, _DW, partial_k=True))


def mosaic_sweep_candidates(M: int, K: int, N: int, dtype=jnp.bfloat16, *, residual: bool = False
                            ) -> tuple[list[dict], list[dict]]:
    """(forward, backward) Mosaic candidates (``MosaicRMSNormMatmulConfig.to_dict()`` dicts) around the built-in
    config: forward ones vary the forward GEMM and the statistics' placement (the choices the H100 decided at one
    shape: tile order, K loop and semantics, the statistics warpgroup), backward ones XLA's own backward or ours,
    and our dx and dw GEMMs' tile order and K loop; stream-K for a last round of tiles less than half full in both
    (at 32768x4096x4096 it won: rmsnorm_matmul_configs-h100-788ee3f.json). Candidates that do not tile the shape, or
    whose changes the base (a tuned entry, or on an H200 the entry at UNTUNED_FROM) cannot take, are left out; one
    that puts gamma on w beside a base's dgamma from u takes dgamma from dw's side."""
    base = mosaic_default_config(M, K, N, dtype, residual=residual)
    if M == 1:  # the transposed GEMV's tiles (ONE_ROW_FORWARD says what they measured); the backward is Triton's
        stacked = dict(tile_m=64, schedule="cooperative", wg_split="m", tile_k=128, num_stages=6)  # 128-row CTAs
        gemv = [dict(tile_m=64, tile_k=256, num_stages=4), dict(tile_m=64, tile_k=128, num_stages=8),
                dict(tile_m=64, tile_k=256, num_stages=5), dict(tile_m=64, tile_k=128, num_stages=8, delay_release=2),
                dict(tile_m=128, tile_k=128, num_stages=3), dict(tile_m=128, tile_k=256, num_stages=2),
                dict(tile_m=128, tile_k=64, num_stages=6),
                stacked, dict(stacked, stream_k=2), dict(stacked, stream_k=4),  # stream-K: fewer tiles than SMs
                dict(tile_m=64, tile_k=256, num_stages=4, k_parts=2),  # K loops in parts (gemm.gemv_config)
                dict(tile_m=64, tile_k=256, num_stages=4, k_parts=4)]
        one_row = dataclasses.replace(base, forward=ONE_ROW_FORWARD[0])
        fwd = [base] + [dataclasses.replace(one_row, forward=dataclasses.replace(one_row.forward, **c)) for c in gemv]
        fwd = [c for i, c in enumerate(fwd) if c not in fwd[:i]]
        return ([c.to_dict() for c in fwd if c.unsupported_reason(M, K, N) is None], [base.to_dict()])
    # the GEMM core's tile sweep winners (gemm/__init__.py): 64x256 accumulators stacked along M, ping-pong tiles
    stacked_m = dict(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", schedule="cooperative")
    pingpong = dict(tile_m=128, tile_n=128, schedule="pingpong", delay_release=1, grid_minor="m")
    fwd_changes = [{}, dict(grid_tile_width=1), dict(grid_minor="m", grid_tile_width=4), dict(grid_tile_width=16),
                   dict(pipeline="pallas_steady", semantics="warpgroup"), dict(delay_release=1), stacked_m,
                   dict(pingpong, num_stages=6), dict(stacked_m, stream_k=4),  # stream-K: gemm.stream_k
                   dict(memory_warps=1)]  # the loads from one warp (the H200's entries at 32768x4096x4096 and
    # 16384x1024x5504; slower at 4096x4096x14336 and 8192x4096x6144: NOTES.md, fifty-second session)
    fwd = [_tried(lambda c=c: dataclasses.replace(base, forward=dataclasses.replace(base.forward, **c)))
           for c in fwd_changes]
    if base.forward.wg_split == "n" and not base.forward.pingpong:
        fwd.append(_tried(lambda: dataclasses.replace(base, stats_in_kernel=True, gamma_on=None)))
    mma = _tried(lambda: dataclasses.replace(base, forward=pick_config(M, N, K, _MMA_STATS_FORWARD),
                                             stats_in_kernel="mma", gamma_on=None))  # r from the MMA warpgroups
    if mma is not None:
        fwd += [mma, _tried(lambda: dataclasses.replace(mma, forward=dataclasses.replace(mma.forward, stream_k=4))),
                _tried(lambda: dataclasses.replace(mma, stats_in_kernel="mma_shared"))]  # r from the first tiles
    if (base.forward.pipeline, base.forward.schedule) == ("own", "cooperative"):
        # the output's right half stored under the next tile's first wgmma, beside a stream-K phase (of whole tiles
        # where stream-K plans none): without one ptxas serializes it beside gamma's registers (NOTES.md,
        # thirty-seventh session; the H200's entries at the suite shapes)
        fwd.append(_tried(lambda: dataclasses.replace(base, forward=dataclasses.replace(
            base.forward, epilogue_store="split", stream_k=base.forward.stream_k or 1))))
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and not base.stats_in_kernel:
        fwd += [_tried(lambda side=side: dataclasses.replace(base, gamma_on=side)) for side in ("w", "x")]
        # gamma in the MMA warpgroups' registers (gemm.Fusion.a_operand), r from XLA: stacked tiles, one group in flight
        gamma_a = _tried(lambda: dataclasses.replace(base, gamma_on="a", forward=dataclasses.replace(
            pick_config(M, N, K, _MMA_STATS_FORWARD), grid_minor="m")))
        # and r from each row block's first tile only (gemm.Fusion.share_rows): one kernel, no XLA pass
        if gamma_a is not None:
            fwd += [gamma_a, _tried(lambda: dataclasses.replace(gamma_a, stats_in_kernel="mma_shared"))]
    # backward ones vary our kernels (where the base takes XLA's backward, ``backward_in_xla``, from the form it
    # replaced), beside the base and the other side of backward_in_xla
    ours = dataclasses.replace(base, backward_in_xla=False)
    bwd_changes = [{}, dict(grid_tile_width=1), dict(grid_minor="m", grid_tile_width=4),
                   dict(pipeline="pallas_steady", semantics="warpgroup")]
    if not residual:  # beside the x tile (and no dh tile): 3 stages of 128x256 blocks, 5 of ping-pong 128x128
        bwd_changes += [dict(stacked_m, num_stages=3), dict(pingpong, num_stages=5),
                        dict(stacked_m, num_stages=3, stream_k=4)]
    bwd = [base, dataclasses.replace(base, backward_in_xla=not base.backward_in_xla)]
    bwd += [_tried(lambda c=c: dataclasses.replace(ours, dx=dataclasses.replace(ours.dx, **c),
                                                   dw=dataclasses.replace(ours.dw, **c))) for c in bwd_changes]
    bwd.append(_tried(lambda: dataclasses.replace(ours, dw=_G(tile_m=64, tile_n=128, tile_k=64, num_stages=4,
                                                              wg_split="m"))))
    # the dw kernel's loads from one warp of its memory warpgroup, and the dx kernel's too (the H200's entries at the
    # three large suite shapes; at 16384x1024x5504, beside stream-K and the ring input, the dw kernel's lost 24%)
    one_warp_dw = _tried(lambda: dataclasses.replace(ours, dw=dataclasses.replace(ours.dw, memory_warps=1)))
    if one_warp_dw is not None:
        bwd += [one_warp_dw, _tried(lambda: dataclasses.replace(one_warp_dw, dx=dataclasses.replace(
            ours.dx, memory_warps=1)))]
    bwd += [_tried(lambda v=v: dataclasses.replace(ours, dw_in_xla=v)) for v in (True, False)]
    bwd += [_tried(lambda side=side: dataclasses.replace(ours, row_dot=side)) for side in ("n", "k")]
    # dyr by XLA's pass (dyr_in_dx None takes it from the dx kernel where it fits)
    bwd.append(_tried(lambda: dataclasses.replace(ours, row_dot="n", dyr_in_dx=False)))
    # K side, dyr from the dx kernel (A = dy): no XLA pass over dy at all
    bwd.append(_tried(lambda: dataclasses.replace(ours, row_dot="k").with_dyr_from_dx(dtype, residual)))
    if not ours.dx.pingpong and ours.dx.cluster == "none":  # the row dot from the dx kernel's first tiles
        bwd.append(_tried(lambda: dataclasses.replace(ours, row_dot="n", row_dot_in_dx=True,
                                                      dx=dataclasses.replace(ours.dx, stream_k=0))))
    dx = ours.dx
    if not (dx.pingpong or dx.stores_later) and (dx.pipeline, dx.cluster) == ("own", "none"):
        # the K side with the dx kernel finishing dx (gemm.Fusion.sum_rows, whole tiles), dyr copied from its dy
        # blocks or xr written from its x tile (the H200's entries at the model's QKV and MLP projections; xr at
        # the three large suite shapes since the fiftieth session)
        k_dx = _tried(lambda: dataclasses.replace(ours, row_dot="k", row_dot_in_dx=False, dgamma_from=None,
                                                  dx_in_kernel=True, dx=dataclasses.replace(dx, stream_k=0)))
        if k_dx is not None:
            bwd += [_tried(lambda: k_dx.with_dyr_from_dx(dtype, residual)),
                    _tried(lambda: dataclasses.replace(k_dx, dyr_in_dx=None, xr_in_dx=True))]
            if ours.dw_by_xla(K, N):  # and cuBLAS's dw in two halves summed with dw and dgamma by one Triton kernel
                # (dw_finish_kernel: the H200's entry at 8192x512x2816)
                bwd.append(_tried(lambda: dataclasses.replace(k_dx, dyr_in_dx=None, xr_in_dx=True,
                                                              dw_finish_kernel=True)))
            if not residual:  # and that dx kernel's epilogue in a fourth warpgroup (the H200's entry at
                # 32768x4096x4096 since the fifty-first session; 128x128 accumulators side by side, 3 stages)
                fourth = dict(epilogue_in="fourth", tile_input_in="buffer", num_stages=3, tile_m=128, tile_n=128,
                              wg_split="n", epi_tile_n=32, delay_release=0, memory_warps=1)
                bwd.append(_tried(lambda: dataclasses.replace(k_dx, dyr_in_dx=None, xr_in_dx=True,
                                                              dx=dataclasses.replace(k_dx.dx, **fourth))))
    if not residual:  # y's blocks by TMA beside dy's, the x tile through the dx kernel's B stages of 3 stacked
        # 64x256 stages (the H200's entry at 8192x4096x6144 until the fiftieth session)
        bwd.append(_tried(lambda: dataclasses.replace(ours, row_dot="n", row_dot_in_dx="tma", dgamma_from=None, dx=(
            dataclasses.replace(ours.dx, **stacked_m, tile_k=64, num_stages=3, stream_k=0, delay_release=0,
                                cluster="none", tile_input_in="ring")))))
    # the dw kernel's last round split along its K loop, or whole (``_untuned_dw``)
    bwd.append(_tried(lambda: dataclasses.replace(ours, dw=dataclasses.replace(
        ours.dw, stream_k=0 if ours.dw.stream_k else UNTUNED_DW_STREAM_K))))
    if ours.dx_in_kernel:  # the dx kernel's row sums at the other tile widths ``_untuned_dx`` weighs
        for tile_n in UNTUNED_DX_COLUMN_COST:
            if tile_n != ours.dx.tile_n:
                epi = ours.dx.epi_tile_n if tile_n % ours.dx.epi_tile_n == 0 else 32
                bwd.append(_tried(lambda t=tile_n, e=epi: dataclasses.replace(
                    ours, dx=dataclasses.replace(ours.dx, tile_n=t, epi_tile_n=e))))
    if base.forward.wg_split == "m":  # stacked 64-row accumulators: the forward widths ``_untuned_forward`` weighs
        fwd += [_tried(lambda t=tile_n: dataclasses.replace(base, forward=dataclasses.replace(base.forward, tile_n=t)))
                for tile_n in UNTUNED_FORWARD_COLUMN_COST if tile_n != base.forward.tile_n]
    def fitted(c):  # a candidate putting gamma on w beside the base's dgamma from u takes dgamma from dw's side;
        # one widening the forward's tiles beside a base's deep ring (``_untuned_deep_ring``) takes fewer stages
        if c is not None and c.dgamma_reason(M, N, dtype) is not None:
            c = _tried(lambda: dataclasses.replace(c, dgamma_from=None))
        if c is not None:
            c = dataclasses.replace(c, forward=_ring_within_smem(c.forward))
        ok = c is not None and c.unsupported_reason(M, K, N) is None and c.dgamma_reason(M, N, dtype) is None
        return c if ok else None

    fwd, bwd = ([c for c in map(fitted, cands) if c is not None] for cands in (fwd, bwd))
    bwd = [c for i, c in enumerate(bwd) if c not in bwd[:i]]
    return [c.to_dict() for c in fwd], [c.to_dict() for c in bwd]


def _tried(make):
    """A sweep candidate, ``make()``; None where its fields cannot go together (the configs' own ValueError, e.g.
    the pallas_steady K loop beside a tuned entry's stream-K or ping-pong tiles): the sweep leaves it out."""
    try:
        return make()
    except ValueError:
        return None
