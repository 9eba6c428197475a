"""The Mosaic-GPU (Hopper) GEMM core: out = epilogue(a @ b) with a prologue on the operand tiles, one kernel.

  out, *extra = gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16)            # a (M, K), b (K, N)
  out = gemm(a_t, b, transpose_a=True, ...)[0]             # a given as (K, M): the A tiles are read transposed
  out = gemm(a, b_t, transpose_b=True, ...)[0]             # b given as (N, K)
  y, r = gemm(x, w, fusion=Fusion(prologue_step=..., epilogue=..., outputs=...), arrays={...}, ...)
  c = gemm(a, b, accumulate_into=c, ...)[0]                # c + a @ b, written over c (XLA's beta = 1)

One kernel launch, persistent: grid = one block per SM, each block walks the (cta_m, cta_n) output tiles in
planar-snake order. A block has three warpgroups: two compute warpgroups, each owning a float32 (tile_m, tile_n)
accumulator in registers (the CTA tile is two accumulators stacked along M or N: ``wg_split``; or, with
``schedule="pingpong"``, one accumulator, the block's tiles alternating between the two warpgroups so that one's
epilogue runs under the other's K loop: ``gemm.specialized``), and one memory warpgroup issuing the TMA loads of
the A and B tiles ``num_stages`` steps ahead into swizzled shared memory. Per output tile, in each compute
warpgroup:
  1. start: TMA prefetch of the fusion's tile inputs (its (tile_m, tile_n) tile of each, e.g. the x tile an
     epilogue adds), and ``prologue_init`` (a carry for the epilogue: e.g. row vectors loaded from HBM);
  2. K loop, per step of tile_k: wait for the step's tiles, issue wgmma (both operands from SMEM), wait for the
     wgmma (``delay_release``: keep one in flight), release the slot to the memory warpgroup;
  3. epilogue(acc f32, carry) -> (the f32 tile to store, row vectors to store): the tile is cast to out_dtype,
     written to SMEM in (epi_tile_m, epi_tile_n) pieces and each piece stored by TMA; row vectors (tile_m,) are
     stored from registers into the fusion's outputs (1-D (M,) outputs from the first column block only; 2-D
     (C, M) outputs get row ``col_block``, the warpgroup's tile_n column block).
A fusion with a ``prologue_step`` (a hook on each A tile in shared memory, e.g. the sums of squares of x) runs it
beside the MMA warpgroups, in a fourth warpgroup (wg_split "n") or in the memory warpgroup between its loads
(``MosaicGemmConfig.prologue_in``), and hands its carry to their epilogue through shared memory
(``gemm.specialized``; needs pipeline "own"). A fusion with an ``a_observe`` runs it in the
compute warpgroups instead, on their rows of each A block loaded into registers right after the step's wgmma is
issued: with one wgmma group in flight (``delay_release=1``) that hides under the tensor cores (the sums of squares
of x cost the rmsnorm_matmul forward 2% at 32768x4096x4096, where waiting for each wgmma cost 14%; NOTES.md).
A fusion with an ``a_operand`` changes the A block itself: each compute warpgroup loads its rows into registers (an
A read transposed through the transposed register layout, then one shuffle and one byte permute a register:
``_Shape.load_a``), the hook transforms them (e.g. gamma over the contraction) and wgmma reads A from those
registers. A wgmma reads its register operand until it completes, so a register block must not be rewritten while
its wgmma is in flight: in one rolled loop every step's load writes the same registers, which with a group in flight
gave wrong products on the H100 (2026-11-24). The K loop therefore runs delay_release + 1 steps per iteration, each
loading into its own registers: a step's registers are written again only after ``wgmma_wait(delay_release)`` has
seen its wgmma complete. A hook always sees whole tiles: shapes divide the CTA tile (``unsupported_reason``), or the
tiles past M, N or K hold the zeros TMA loaded there (``gemm``'s partial_rows and partial_k, and
``Fusion.partial_columns``), and what a hook writes there is dropped.

The K loop (``config.pipeline``): "own" is ours (``gemm.specialized``): the memory warpgroup loads the next tile's
first stages as soon as the current tile's last ones are released. "pallas" is jax's
``emit_pipeline_warp_specialized`` once per output tile (its memory warpgroup waits for a tile's last stages to
be consumed before it loads the next tile's first ones); "pallas_steady" passes it START / STEADY / STOP so the
loads of tile i+1 start as stages of tile i free up (needs k_iters % num_stages == 0 and no delay_release: else it
runs as "pallas"). Which is the default, and why: ``gemm.config``.

``MosaicGemmConfig.k_parts`` P: each output tile's K loop cut into P equal ranges, run by the persistent loop as
tiles of their own (more blocks at work where few tiles meet a long K loop: decode GEMVs, few rows). The plain
product's ranges store float32 tiles into a (P, M, N) buffer that ``gemm`` sums by XLA; a fusion's linear epilogue
stores each range's row vectors into its part of a (P · C, M) output for the caller to sum (``gemm.gemv``); an
a_operand may transform each range's A blocks (ctx.step counts along all of K), its carry passing through.

``accumulate_into=c`` (M, N) of out_dtype: each compute warpgroup TMA-prefetches its tile of c at the tile's
start, the epilogue adds it to the float32 accumulator and the sum is stored back from that same SMEM buffer into
c's HBM buffer, aliased in and out of the kernel (``mosaic_utils.kernel_updating``): the read of c overlaps the
K loop, where a GEMM with beta = 1 reads c in its epilogue. For a sum over K-chunks too short to hide the
(M, N) read and write behind their FLOPs (a dw accumulated over token chunks).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm import specialized, stream_k
from pallas_kernels.gemm.config import (PARTIAL_ROWS_MULTIPLE, PIPELINES, MosaicGemmConfig, any_rows_reason,
                                        operand_swizzle_elems, smem_bytes, sum_rows_grid, unsupported_reason)

__all__ = ["COL_DTYPES", "PIPELINES", "Fusion", "MosaicGemmConfig", "TileContext", "gemm", "smem_bytes",
           "unsupported_reason"]

_F32 = jnp.float32
COL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # ``Fusion.col_inputs``
_MEMORY_REGISTERS = 40  # registers per thread left to the memory warpgroup (it only issues TMA)
_ACCUMULATED = "accumulate_into"  # the tile-input name of ``accumulate_into``'s buffer (the output itself)
_CLUSTER = "cluster"  # the axis name of a block within its cluster (``MosaicGemmConfig.cluster``)


@dataclasses.dataclass(frozen=True)
class TileContext:
    """Where a compute warpgroup is, for the hooks (traced values; Python ints where static).

    row0, col0: first output row / column of this warpgroup's (tile_m, tile_n) accumulator.
    m_idx, n_idx: the CTA tile's indices; wg: the compute warpgroup (0 or 1); col_block: this accumulator's
      tile_n column block in the output (n_idx · 2 + wg with wg_split "n", else n_idx; pingpong: n_idx).
    refs: the fusion's inputs and outputs (GMEM refs) and scratch (SMEM refs), by name.
    tiles: (epilogue only) this warpgroup's prefetched (tile_m, tile_n) SMEM tile of each tile input, by name.
    col_slices: (epilogue only) this warpgroup's prefetched (tile_n,) SMEM slice of each ``Fusion.col_inputs`` vector.
    step: (prologue only) the pipeline step: the A tile holds columns [step · tile_k, (step + 1) · tile_k).
    k_part: (``MosaicGemmConfig.k_parts``) which of the tile's K ranges this accumulator holds (0 without parts).
    first_column: under ``Fusion.share_rows`` on the GPU, a Python bool: whether this is a row block's first
      (column-0) tile, the one taking the row statistic; the kernel runs those tiles in a K loop of their own, so a
      hook may branch on it statically. None elsewhere (in interpret mode every tile takes the statistic).
    """

    row0: Any
    col0: Any
    m_idx: Any
    n_idx: Any
    wg: Any
    col_block: Any
    config: MosaicGemmConfig
    refs: Mapping[str, Any]
    tiles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    col_slices: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    step: Any = None
    first_column: bool | None = None
    k_part: Any = 0

    @property
    def rows(self):
        return pl.ds(self.row0, self.config.tile_m)

    @property
    def cols(self):
        return pl.ds(self.col0, self.config.tile_n)

    def load_rows(self, name: str) -> jax.Array:
        """This accumulator's rows of the (M,) GMEM input ``name``, one float32 value per row (layout ROWS)."""
        return mu.load(self.refs[name].at[self.rows], layout=mu.ROWS, optimized=False).astype(_F32)

    def load_cols(self, name: str) -> jax.Array:
        """This accumulator's columns of the (N,) input ``name``, one float32 value per column (layout COLS): from
        its SMEM slice where the tile prefetched it (``Fusion.col_inputs``), else from GMEM."""
        if name in self.col_slices:
            return mu.load(self.col_slices[name], layout=mu.COLS, optimized=False).astype(_F32)
        return mu.load(self.refs[name].at[self.cols], layout=mu.COLS, optimized=False).astype(_F32)

    def load_tile(self, name: str) -> jax.Array:
        """The prefetched tile input ``name`` as a float32 (tile_m, tile_n) array in the accumulator layout."""
        return mu.load(self.tiles[name], layout=mu.TILE).astype(_F32)


@dataclasses.dataclass(frozen=True)
class Fusion:
    """What a fused GEMM adds to the plain one. Hooks run in each compute warpgroup; names refer to ``arrays``.

    tile_inputs: (M, N) arrays whose (tile_m, tile_n) tile at each accumulator is prefetched for the epilogue.
    inputs: other arrays the hooks read from GMEM themselves (row / column vectors).
    col_inputs: (N,) float32, bfloat16 or float16 vectors of ``inputs`` whose (tile_n,) slice at each accumulator is
      TMA-loaded into shared memory at the tile's start (beside the tile inputs), so the epilogue's
      ``TileContext.load_cols`` reads it there (as float32), not from GMEM after the K loop.
    outputs: (name, jax.ShapeDtypeStruct) the hooks or the epilogue's row vectors write.
    scratch: (name, SMEM type) the hooks use; allocated once per block, shared by both compute warpgroups.
    store_in: a tile input (of out_dtype) whose SMEM tile, once the epilogue has read it, receives the output tile
      and is stored from there by one TMA copy: no separate output staging (saves 2 · 2 · epi pieces of SMEM).
    prologue_init(ctx) -> carry: without a prologue_step, run by each compute warpgroup at a tile's start (e.g.
      row vectors the epilogue needs); with one, the prologue warpgroup's initial carry.
    prologue_step(ctx, a_tile_ref, carry) -> carry: run per K step on the step's A block (cta_m, tile_k) in SMEM
      (ctx.wg = 0, ctx.step the step), by a fourth warpgroup (wg_split "n") or, with ``prologue_in="memory"``,
      by the memory warpgroup; its final carry, ``handoff_rows`` (cta_m,) float32 row vectors in any pytree,
      reaches the epilogue through shared memory, each compute warpgroup taking its rows (pipeline "own";
      ``gemm.specialized``). In the memory warpgroup prologue_init runs at every step (its value used on a
      tile's first): keep it cheap.
    a_observe(ctx, a, carry) -> carry: run per K step by each MMA warpgroup right after it issues the step's wgmma
      (A from shared memory, as ever), on its rows of the step's A block loaded into registers ((tile_m, tile_k) in
      the accumulator layout; (cta_m, tile_k) with wg_split "n"); ctx.step the step. It reads A, never feeds the
      wgmma: with ``delay_release`` 1 its loads and arithmetic run under the wgmma in flight. Its carry starts at
      ``prologue_init`` and reaches the epilogue (e.g. sums of squares of x). Pipeline "own", A read as stored,
      no prologue_step (``gemm.specialized``); with stream-K, ``carry_shapes``.
    carry_shapes: (stream-K with an a_observe or a carry-changing a_operand) the shapes of the hook carry's float32
      leaves, in tree order:
      (rows, cols) arrays in the accumulator layout or (rows,) row vectors. They must add over K steps (sums): a
      segment that starts mid-tile stores its partial carry beside its partial accumulator, and the tile's owner
      adds them to its own before the epilogue. None: the carry needs whole tiles (no stream-K), unless
      ``share_rows`` takes it from whole first tiles only.
    a_beside: an (M, K) input of A's dtype whose (cta_m, tile_k) block at each step the memory warpgroup loads
      by TMA into a third stage buffer beside A's, for the tiles that run the a_observe (with ``share_rows`` each
      row block's first tile; its other tiles' stages get an arrival instead of the copy); the a_observe then
      takes it as a fourth argument, a_observe(ctx, a, carry, beside), its rows loaded like a's (e.g. y beside dy
      for the rmsnorm_matmul dx kernel's row dot Σ dy · y). Costs num_stages · cta_m · tile_k elements of SMEM.
    a_copy: (name, fn): the MMA warpgroups also write each A block, transformed, into the output ``name`` (an
      (M, K) 16-bit array of ``outputs``): fn(ctx, a, carry) -> the block's values, a as for a_observe, carry
      ``prologue_init``'s (ctx.step the step; with an a_observe too, its carry after this step's). Each block is
      written once, by the accumulators whose column block is the step modulo the column blocks (N / tile_n;
      ``_Shape.copy_step``), right after issuing its wgmma, through a per-warpgroup SMEM buffer and one TMA copy:
      e.g. dyr = r ⊙ dy from the rmsnorm_matmul dx kernel's dy blocks, sparing the XLA pass that writes it.
      Pipeline "own", A read as stored, no prologue_step.
    a_operand(ctx, a, vectors, carry) -> (a, carry): run per K step by each MMA warpgroup before the step's wgmma,
      on its rows of the A block loaded into registers (as for a_observe, in A's dtype); the array it returns (same
      shape and dtype) is the wgmma's A operand, read from registers. ``vectors``: the step's tile_k slice of each
      ``step_inputs`` vector, (tile_k,) in layout COLS; ctx.step the step; carry as for a_observe. The K loop then
      takes delay_release + 1 steps per iteration, one register block each (module docstring). With an a_observe
      too, that one loads the block again after the wgmma's issue (as without an a_operand), and the carry passes
      through both. Pipeline "own", A as stored or transposed (then no a_observe), no prologue_step or a_copy;
      stream-K only where its ranges all have one length within a tile (``StreamKPlan.segment_steps``: the split
      divides the K steps), and then the a_operand's carry must pass through unchanged unless ``carry_shapes`` says
      how its partial sums add.
    step_inputs: (K,) vectors whose tile_k slice at each step the memory warpgroup loads by TMA into the stage
      beside the A and B blocks, for ``a_operand`` (e.g. gamma over the contraction).
    share_rows: (name, fn): the a_observe carry is a statistic of the A rows alone (the same in every column
      block), so only one CTA tile per row block takes it: the tile loop runs each row block's column-0 tile first
      (all of them, then the other tiles in the usual order; on the GPU in a tile loop of their own), and only
      those tiles run the a_observe (an a_operand taking the statistic instead runs in every tile: it takes it where
      ``ctx.first_column``); fn(ctx,
      carry) -> (tile_m,) float32 row vector (e.g. r from the sums of squares), stored into the (M,) float32
      output ``name``, and a global count per row block and warpgroup raised by the number of the other tiles.
      Those poll it with one load a few steps before their K loop ends (``MosaicGemmConfig.shared_rows_wait``,
      under a wgmma), take their one off (a reduction, no compare-and-swap: that loop cost 1-2% of each tile) and
      load the vector back; the counts end each call at zero. Every tile's epilogue receives (the row vector, the
      carry) as its carry (the other tiles' carry as prologue_init and any a_operand left it). No tile waits for
      one that waits, and a row block's first tile runs before its others (the whole first column runs first), so
      with one block per SM it cannot deadlock and seldom waits. Needs an a_observe; cooperative schedule, no
      cluster (with epilogue_store "next_tile" or "split" a tile's output leaves under the next tile's first
      wgmma, across the first column's loop and the others'). With stream-K the last round's tiles (never a first
      tile: the whole rounds must hold the first column) skip the a_observe, and each tile's owner polls after its
      range. In interpret mode (no semaphores) every tile takes the a_observe itself.
    epilogue(ctx, acc, carry) -> (tile, {output name: (tile_m,) row vector}); acc (tile_m, tile_n) float32. For a
      (C, M) output the value may also be a tuple of C row vectors, stored as its rows (else its row col_block).
    tile_copy: (name, fn): after the epilogue, a second (M, N) output ``name`` (a 16-bit dtype of ``outputs``) gets
      fn(ctx, carry) -> (tile_m, tile_n) float32 at the accumulator's place (e.g. from the tile inputs), staged in
      the ``store_in`` tile input's SMEM buffer and stored from there by one TMA copy before the output tile takes
      the buffer: no SMEM of its own. The buffer then holds the copy, so a later ``load_tile`` of the store_in input
      (``sum_rows``' finish) reads it in place of the input (e.g. the rmsnorm_matmul dx kernel's xr = (r / s) ⊙ x
      from its x tile, for the dw GEMM; its finish takes x as xr · s / r). The output waits for the copy to have
      left the buffer. Needs store_in, epilogue_store "end".
    handoff_rows: the number of row vectors in the prologue's carry.
    reduction_scratch_bytes: shared memory Mosaic reserves for cross-warp reductions (its default 2048 whenever a
      hook reduces); row sums (axis 1) of the accumulator layout stay within a warp and need none.
    partial_columns: the hooks read no (N,) input and no tile input, so the last column of tiles may run past N
      (tile_n not dividing N, to even out the rounds as cuBLAS's 128x160 tiles do): TMA loads zeros past N and
      stores nothing there. A plain GEMM (no fusion) takes it too. With B read transposed and no output tile
      stored (``store_tile``), N may be any positive size (e.g. one row of x as a GEMV's B: 15 rows of zeros).
    store_tile: False: the epilogue's row vectors are the result and the (M, N) output tile is never stored (the
      kernel's first output is allocated, its contents undefined): e.g. a GEMV run transposed, whose one useful
      accumulator column the epilogue returns as a row vector. epilogue_store "end" only.
    sum_rows: (name, finish): the epilogue's row vector ``name`` (a (N / tile_n, M) float32 output: each
      accumulator's part over its tile_n columns) summed over all of a row's column blocks inside the kernel, and
      finish(ctx, tile, total, carry) -> the tile to store, ``tile`` the epilogue's, ``total`` (tile_m,) float32
      (e.g. the rmsnorm_matmul dx kernel's row dot Σ_K(u ⊙ x), then dx from u: no (M, K) tensor written twice).
      Each accumulator stores its part, counts it on its row group's global semaphore, waits for all of them and
      sums them itself (the counts end the call at P: ``_sum_row_parts``); with a ``tile_copy`` it counts its part
      before the copy and waits after it, so the copy runs while the row's other tiles finish. The tile loop walks
      the CTA tiles in whole runs of the planar snake (``grid_minor`` "m": grid_tile_width rows times the row's
      tiles), on a grid cut to a multiple of that run, or (``grid_minor`` "n", or a run longer than the grid)
      row-major on a grid cut to a multiple of the row's tile count (``config.sum_rows_grid``, which may take
      another width): either way a row's tiles never straddle two rounds (where they did, the blocks holding the
      first ones waited a whole tile for the rest); with one block per SM every block is resident, so no tile waits
      for one that cannot run (the tiles a tile waits for start once their blocks' earlier tiles end, and those
      tiles come before it). Cooperative schedule, pipeline "own", no stream-K, cluster, share_rows or a_beside,
      epilogue_store "end"; not in interpret mode (no semaphores).
    """

    tile_inputs: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    col_inputs: tuple[str, ...] = ()
    outputs: tuple[tuple[str, jax.ShapeDtypeStruct], ...] = ()
    scratch: tuple[tuple[str, Any], ...] = ()
    store_in: str | None = None
    handoff_rows: int = 1
    reduction_scratch_bytes: int = 0
    partial_columns: bool = False
    store_tile: bool = True
    prologue_init: Callable | None = None
    prologue_step: Callable | None = None
    a_observe: Callable | None = None
    carry_shapes: tuple[tuple[int, ...], ...] | None = None
    a_beside: str | None = None
    a_copy: tuple[str, Callable] | None = None
    a_operand: Callable | None = None
    step_inputs: tuple[str, ...] = ()
    share_rows: tuple[str, Callable] | None = None
    epilogue: Callable | None = None
    sum_rows: tuple[str, Callable] | None = None
    tile_copy: tuple[str, Callable] | None = None


def gemm(a: jax.Array, b: jax.Array, *, config: MosaicGemmConfig, out_dtype, transpose_a: bool = False,
         transpose_b: bool = False, fusion: Fusion | None = None, arrays: Mapping[str, jax.Array] | None = None,
         accumulate_into: jax.Array | None = None, num_sms: int | None = None, partial_rows: bool = False,
         partial_k: bool = False, name: str = "mosaic_gemm") -> list[jax.Array]:
    """[out (M, N) in out_dtype, *fusion outputs] of epilogue(A @ B) in one Mosaic-GPU kernel.

    a: (M, K), or (K, M) with transpose_a; b: (K, N), or (N, K) with transpose_b; 16-bit floats of one dtype.
    The shapes must satisfy ``unsupported_reason`` (checked here: ValueError). ``arrays`` holds the fusion's
    named inputs. ``accumulate_into``: an (M, N) array of out_dtype; out = accumulate_into + A @ B, written in
    place where XLA can (no fusion then). Runs on an sm90 GPU; lowers for CUDA anywhere.
    ``partial_rows`` (A read as stored, no accumulate_into, pipeline "own"): M need only be a multiple of
    ``config.PARTIAL_ROWS_MULTIPLE`` (8), the last row of tiles running past it: TMA loads zeros there (A's and
    the (M, ·) inputs' rows) and stores nothing (the output's and the (M, ·) outputs'), and the fusion's row
    vectors ((M,) inputs and outputs, (C, M) outputs) run padded to whole tiles here, so the hooks see rows of
    zeros past M and their values there are dropped. Any positive M where ``config.any_rows_reason`` is None and
    the fusion has no (M, ·) input or output besides A and the output (tile inputs, a_copy, a_beside, tile_copy):
    A's blocks and the output's pieces then go through untiled views of their shared memory. ``partial_k`` (A
    read transposed, B as stored, no hook reading along K): K the same, the last step's rows past K loaded as zeros
    by TMA, so they add nothing. Both are ignored where the tiles divide M or K."""
    if accumulate_into is not None:
        if fusion is not None:
            raise ValueError(f"{name}: accumulate_into is its own epilogue; it takes no fusion")
        fusion = Fusion(tile_inputs=(_ACCUMULATED,), store_in=_ACCUMULATED,
                        epilogue=lambda ctx, acc, carry: (acc + ctx.load_tile(_ACCUMULATED), {}))
    fusion = fusion or Fusion(partial_columns=accumulate_into is None)
    arrays = dict(arrays or {})
    k_hooks = [h for h in ("prologue_step", "a_observe", "a_copy", "a_operand", "a_beside")
               if getattr(fusion, h) is not None] + (["step_inputs"] if fusion.step_inputs else [])
    rows, depth = (a.shape[1] if transpose_a else a.shape[0]), (a.shape[0] if transpose_a else a.shape[1])
    partial_rows = partial_rows and rows % config.cluster_m != 0  # (whole tiles: nothing to take past M or K)
    partial_k = partial_k and depth % config.tile_k != 0
    if partial_rows and (transpose_a or accumulate_into is not None or config.pipeline != "own"):
        raise ValueError(f"{name}: partial_rows takes A read as stored (its rows are TMA's outer axis), the K loop "
                         f"pipeline='own' and no accumulate_into; got transpose_a={transpose_a}, pipeline="
                         f"{config.pipeline!r}, accumulate_into={'set' if accumulate_into is not None else None}")
    if partial_k and (not transpose_a or transpose_b or k_hooks or config.pipeline != "own"):
        raise ValueError(f"{name}: partial_k takes A read transposed and B as stored (K is both operands' TMA outer "
                         f"axis), the K loop pipeline='own' and no hook reading along K; got "
                         f"transpose_a={transpose_a}, transpose_b={transpose_b}, pipeline={config.pipeline!r}, hooks "
                         f"{k_hooks}")
    rows_padded = -(-rows // config.cluster_m) * config.cluster_m if partial_rows and rows > 0 else rows
    depth_padded = -(-depth // config.tile_k) * config.tile_k if partial_k and depth > 0 else depth
    untiled_rows = partial_rows and rows % PARTIAL_ROWS_MULTIPLE != 0  # (A's blocks, the output's pieces)
    if untiled_rows:
        reason = any_rows_reason(config, a.dtype, out_dtype, transpose_b) or _any_rows_fusion_reason(fusion)
        if reason:
            raise ValueError(f"{name}: M={rows} is not a multiple of {PARTIAL_ROWS_MULTIPLE} (TMA's 8-row tiles): "
                             f"{reason}")
    if mu.interpreting() and (rows_padded, depth_padded) != (rows, depth):
        # the interpreter clamps slices where TMA would load zeros: the product of zero-padded operands, sliced
        return _gemm_padded(a, b, (rows_padded, depth_padded), config=config, out_dtype=out_dtype,
                            transpose_a=transpose_a, transpose_b=transpose_b, fusion=fusion, arrays=arrays,
                            num_sms=num_sms, name=name)
    padded_rows_out = ()  # the row vectors (M,) and (C, M) outputs run padded to rows_padded, sliced at the end
    if rows_padded != rows:
        fusion, arrays, padded_rows_out = _row_vectors_padded(fusion, arrays, rows, rows_padded)
    if mu.interpreting() and config.cluster != "none":  # jax's GPU interpreter has no cluster barriers; the
        config = dataclasses.replace(config, cluster="none")  # multicast changes no value, only where tiles load
    if mu.interpreting() and config.stream_k:  # nor semaphores: tile by tile computes the same sums (the plan's
        config = dataclasses.replace(config, stream_k=0)  # arithmetic is checked by ``stream_k.emulate``)
    # B read transposed, its rows past N zero-filled by TMA, and no output tile stored: N need only be positive
    any_n = fusion.partial_columns and not fusion.tile_inputs and transpose_b and not fusion.store_tile
    if mu.interpreting() and (transpose_a or transpose_b):  # the CPU interpreter reads no transposed SMEM refs
        a, b = (a.T if transpose_a else a), (b.T if transpose_b else b)
        transpose_a = transpose_b = False
    M, K = a.shape[::-1] if transpose_a else a.shape
    N = b.shape[0] if transpose_b else b.shape[1]
    partial = fusion.partial_columns and not fusion.tile_inputs
    reason = unsupported_reason(M, N, K, config, partial_columns=partial, any_columns=any_n,
                                partial_rows=partial_rows, partial_k=partial_k, any_rows=untiled_rows)
    if reason:
        raise ValueError(f"{name}: {reason}")
    padded_n = -(-N // config.cta_n) * config.cta_n
    if mu.interpreting() and padded_n != N:  # the interpreter clamps slices where TMA would load zeros: pad B
        b = jnp.pad(b, ((0, padded_n - N), (0, 0)) if transpose_b else ((0, 0), (0, padded_n - N)))
        outs = gemm(a, b, config=config, out_dtype=out_dtype, transpose_a=transpose_a, transpose_b=transpose_b,
                    fusion=fusion, arrays=arrays, accumulate_into=accumulate_into, num_sms=num_sms, name=name)
        return [outs[0][:, :N], *outs[1:]]
    if fusion.prologue_step is not None and (config.pipeline != "own" or config.pingpong or (
            config.wg_split != "n" and config.prologue_in == "fourth")):
        raise ValueError(f"{name}: a fusion with a prologue_step runs it in the K loop pipeline='own' with "
                         f"schedule='cooperative', in a fourth warpgroup with wg_split='n' or in the memory warpgroup "
                         f"(prologue_in='memory'); got pipeline={config.pipeline!r}, wg_split={config.wg_split!r}, "
                         f"schedule={config.schedule!r}, prologue_in={config.prologue_in!r}")
    for hook in ("a_observe", "a_copy", "a_operand"):
        as_stored = hook != "a_operand"  # (an a_operand also takes an A read transposed: ``_Shape.load_a``)
        if getattr(fusion, hook) is not None and (config.pipeline != "own" or (transpose_a and as_stored)
                                                  or fusion.prologue_step is not None):
            raise ValueError(f"{name}: a fusion with an {hook} runs it in the MMA warpgroups of the K loop "
                             f"pipeline='own'{' on an A read as stored' if as_stored else ''}, without a "
                             f"prologue_step; got pipeline={config.pipeline!r}, transpose_a={transpose_a}, "
                             f"prologue_step={'set' if fusion.prologue_step else None}")
    if fusion.a_copy is not None:
        copied = dict(fusion.outputs).get(fusion.a_copy[0])
        if copied is None or copied.shape != (M, K) or jnp.dtype(copied.dtype).itemsize != 2:
            raise ValueError(f"{name}: a_copy={fusion.a_copy[0]!r} must name an output of A's shape ({M}, {K}) and a "
                             f"16-bit dtype, got {None if copied is None else (copied.shape, copied.dtype)}")
    if fusion.tile_copy is not None:
        copied = dict(fusion.outputs).get(fusion.tile_copy[0])
        if (fusion.store_in is None or copied is None or copied.shape != (M, N)
                or jnp.dtype(copied.dtype).itemsize != 2):
            raise ValueError(f"{name}: tile_copy={fusion.tile_copy[0]!r} is staged in the store_in tile input's "
                             f"buffer: it needs a store_in and an output of the product's shape ({M}, {N}) and a "
                             f"16-bit dtype; got store_in={fusion.store_in!r}, "
                             f"{None if copied is None else (copied.shape, copied.dtype)}")
    if fusion.a_operand is not None and fusion.a_copy is not None:
        raise ValueError(f"{name}: a fusion with an a_operand takes no a_copy; got a_copy={fusion.a_copy[0]!r}")
    if config.epilogue_in == "fourth" and (fusion.prologue_step is not None or fusion.share_rows is not None
                                           or not fusion.store_tile):
        raise ValueError(f"{name}: epilogue_in='fourth' runs the epilogue in a fourth warpgroup, column slice by "
                         f"column slice, and stores the output tile: it takes no prologue_step or share_rows, needs "
                         f"store_tile and a GPU (no interpret mode); got prologue_step="
                         f"{'set' if fusion.prologue_step else None}, share_rows="
                         f"{'set' if fusion.share_rows else None}, store_tile={fusion.store_tile}, "
                         f"interpret={mu.interpreting()}")
    plain = fusion == Fusion(partial_columns=fusion.partial_columns) and accumulate_into is None
    summing_hooks = [h for h in k_hooks if h not in ("a_operand", "step_inputs")]  # (hooks whose carry sums over K)
    if config.k_parts > 1 and not plain and (
            fusion.store_tile or fusion.epilogue is None or summing_hooks or fusion.tile_inputs
            or fusion.sum_rows is not None or fusion.share_rows is not None or partial_k):
        raise ValueError(f"{name}: k_parts={config.k_parts} runs each tile's K ranges apart: it takes the plain "
                         f"product (float32 parts summed here) or a fusion whose epilogue stores row vectors the "
                         f"caller sums (no output tile: store_tile=False; no tile inputs, sum_rows, share_rows or "
                         f"hooks along K but an a_operand), K in whole steps; got store_tile={fusion.store_tile}, "
                         f"epilogue={'set' if fusion.epilogue else None}, tile_inputs={fusion.tile_inputs}, hooks "
                         f"{k_hooks}, partial_k={partial_k}, accumulate_into="
                         f"{'set' if accumulate_into is not None else None}")
    tile_parts = config.k_parts if config.k_parts > 1 and fusion.store_tile else 1  # (the plain product's)
    final_dtype, out_dtype = out_dtype, (_F32 if tile_parts > 1 else out_dtype)
    if tile_parts > 1 and config.epi_tile_n > 32:  # float32 pieces one 128-byte swizzled row wide
        config = dataclasses.replace(config, epi_tile_n=32)
    if config.stores_later and not fusion.store_tile:
        raise ValueError(f"{name}: a fusion that stores no output tile (store_tile=False) takes epilogue_store='end', "
                         f"got {config.epilogue_store!r}")
    if config.stores_later and fusion.store_in is not None:
        raise ValueError(f"{name}: epilogue_store={config.epilogue_store!r} keeps the output tile in registers and "
                         f"stages it in its own SMEM slots; a fusion storing from its tile input "
                         f"(store_in={fusion.store_in!r}, or accumulate_into) takes epilogue_store='end'")
    if fusion.share_rows is not None:
        shared = dict(fusion.outputs).get(fusion.share_rows[0])
        if (fusion.a_observe is None and fusion.a_operand is None) or config.pingpong or config.cluster != "none":
            raise ValueError(f"{name}: share_rows takes an a_observe's (or a_operand's) carry from one tile per row "
                             f"block; it needs an a_observe or an a_operand, schedule='cooperative' and "
                             f"cluster='none'; got a_observe={'set' if fusion.a_observe else None}, "
                             f"schedule={config.schedule!r}, cluster={config.cluster!r}")
        if shared is None or shared.shape != (rows_padded,) or jnp.dtype(shared.dtype) != jnp.dtype(_F32):
            seen = "no such output" if shared is None else f"shape {shared.shape}, dtype {jnp.dtype(shared.dtype)}"
            raise ValueError(f"{name}: share_rows={fusion.share_rows[0]!r} must name an ({M},) float32 output, got "
                             f"{seen}")
    if fusion.sum_rows is not None:
        summed = dict(fusion.outputs).get(fusion.sum_rows[0])
        want = (-(-N // config.tile_n), rows_padded)
        if (config.pipeline != "own" or config.pingpong or config.stream_k or config.cluster != "none"
                or config.stores_later or fusion.share_rows is not None or fusion.a_beside is not None
                or mu.interpreting()):
            raise ValueError(f"{name}: sum_rows sums a row vector over a row block's tiles through global semaphores: "
                             f"it needs pipeline='own', schedule='cooperative', stream_k=0, cluster='none', "
                             f"epilogue_store='end', no share_rows or a_beside, and a GPU (no interpret mode); got "
                             f"pipeline={config.pipeline!r}, schedule={config.schedule!r}, "
                             f"stream_k={config.stream_k}, cluster={config.cluster!r}, "
                             f"epilogue_store={config.epilogue_store!r}, interpret={mu.interpreting()}")
        if summed is None or summed.shape != want or jnp.dtype(summed.dtype) != jnp.dtype(_F32):
            seen = "no such output" if summed is None else f"shape {summed.shape}, dtype {jnp.dtype(summed.dtype)}"
            raise ValueError(f"{name}: sum_rows={fusion.sum_rows[0]!r} must name a {want} float32 output (one row "
                             f"per column block), got {seen}")
    for n in fusion.col_inputs:
        vec = (arrays or {}).get(n)
        if n not in fusion.inputs or vec is None or vec.shape != (N,) or jnp.dtype(vec.dtype) not in COL_DTYPES \
                or N % config.tile_n or config.tile_n * vec.dtype.itemsize % 128:
            seen = "not among inputs" if n not in fusion.inputs else "no such array" if vec is None else \
                f"shape {tuple(vec.shape)}, dtype {jnp.dtype(vec.dtype)}"
            raise ValueError(f"{name}: col_inputs={n!r} must name a ({N},) float32, bfloat16 or float16 array of "
                             f"inputs, N a multiple of tile_n={config.tile_n} and tile_n elements whole 128-byte "
                             f"lines (its slices load by TMA); got {seen}, N={N}")
    if fusion.step_inputs and fusion.a_operand is None:
        raise ValueError(f"{name}: step_inputs={fusion.step_inputs} are read by an a_operand only; the fusion has none")
    if accumulate_into is not None:
        arrays[_ACCUMULATED] = accumulate_into
        if accumulate_into.shape != (M, N) or accumulate_into.dtype != jnp.dtype(out_dtype):
            raise ValueError(f"{name}: accumulate_into must be ({M}, {N}) {jnp.dtype(out_dtype)}, got "
                             f"{tuple(accumulate_into.shape)} {accumulate_into.dtype}")
    in_names = tuple(n for n in (*fusion.tile_inputs, *fusion.inputs, *fusion.step_inputs,
                                 *((fusion.a_beside,) if fusion.a_beside else ())) if n != _ACCUMULATED)
    missing = [n for n in in_names if n not in arrays]
    if missing:
        raise ValueError(f"{name}: arrays is missing {missing}")
    if fusion.a_beside is not None:
        beside = arrays[fusion.a_beside]
        if fusion.a_observe is None or beside.shape != (M, K) or beside.dtype != a.dtype:
            raise ValueError(f"{name}: a_beside={fusion.a_beside!r} is loaded beside A for an a_observe: it needs "
                             f"one and an array of A's shape ({M}, {K}) and dtype {a.dtype}; got a_observe="
                             f"{'set' if fusion.a_observe else None}, {tuple(beside.shape)} {beside.dtype}")
    for n in fusion.step_inputs:
        if arrays[n].shape != (K,):
            raise ValueError(f"{name}: step input {n!r} must have shape ({K},) (one value per K index), got "
                             f"{tuple(arrays[n].shape)}")
    if fusion.store_in is not None and (fusion.store_in not in fusion.tile_inputs
                                        or arrays[fusion.store_in].dtype != jnp.dtype(out_dtype)):
        raise ValueError(f"{name}: store_in={fusion.store_in!r} must name a tile input of dtype {out_dtype}")
    if config.tile_input_in == "ring":
        dtypes = [jnp.dtype(arrays[n].dtype) for n in fusion.tile_inputs]
        if (len(fusion.tile_inputs) != 1 or fusion.store_in != fusion.tile_inputs[0]
                or dtypes[0] != jnp.dtype(b.dtype) or fusion.prologue_step is not None or fusion.step_inputs):
            raise ValueError(f"{name}: tile_input_in='ring' loads the one tile input, the output's store_in, into "
                             f"B stages (a second view of them where B is read transposed): it needs exactly one, "
                             f"of B's dtype {jnp.dtype(b.dtype)}, and no prologue_step or step_inputs; got "
                             f"tile_inputs={fusion.tile_inputs} ({', '.join(map(str, dtypes))}), "
                             f"store_in={fusion.store_in!r}, prologue_step={'set' if fusion.prologue_step else None}, "
                             f"step_inputs={fusion.step_inputs}")
    grid = (num_sms or mu.num_sms()) // config.cluster_size
    row_tiles = -(-N // config.cta_n)
    snake = False  # (Fusion.sum_rows) its tiles in planar-snake runs (``config.sum_rows_grid``)
    if fusion.sum_rows is not None:  # whole rows of tiles per round (Fusion.sum_rows)
        if row_tiles > grid:
            raise ValueError(f"{name}: sum_rows waits for all of a row's N / cta_n = {N} / {config.cta_n} = "
                             f"{row_tiles} tiles at once, so they must run together on the {grid} blocks: at most "
                             f"{grid} tiles a row; take a wider tile_n")
        grid, snake, width = sum_rows_grid(config, row_tiles, grid)
        config = dataclasses.replace(config, grid_tile_width=width)
    plan = None
    if config.stream_k:
        if fusion.prologue_step is not None or (fusion.a_observe is not None and fusion.carry_shapes is None
                                                and fusion.share_rows is None):
            raise ValueError(f"{name}: stream_k splits tiles along K; a fusion with a prologue_step, or an a_observe "
                             f"without carry_shapes (or share_rows), needs whole tiles (got "
                             f"stream_k={config.stream_k}; allowed with it: 0)")
        plan = stream_k.plan_for(-(-M // config.cta_m) * -(-N // config.cta_n), grid, -(-K // config.tile_k),
                                 split=config.stream_k)
        m_iters = -(-M // config.cta_m)
        if plan is not None and fusion.a_operand is not None and plan.segment_steps is None:
            raise ValueError(f"{name}: a fusion with an a_operand unrolls its K loop in static groups, so stream-K's "
                             f"ranges must be equal and within one tile: stream_k={config.stream_k} cuts "
                             f"{plan.sk_tiles} tiles of {plan.k_iters} steps over {plan.units} blocks; take a split "
                             f"that divides {plan.k_iters}, or stream_k=0")
        if plan is not None and fusion.share_rows is not None and plan.dp_tiles < m_iters:
            raise ValueError(f"{name}: share_rows needs every row block's first tile in the whole rounds (stream-K "
                             f"tiles never run the a_observe), but the rounds hold {plan.dp_tiles} tiles of the "
                             f"{m_iters} first ones; take stream_k=0 here")
    shape = _Shape(config, fusion, in_names, tuple(n for n, _ in fusion.outputs), (transpose_a, transpose_b),
                   (M, N, K), a.dtype, jnp.dtype(out_dtype), tuple(arrays[n].dtype for n in fusion.tile_inputs),
                   accumulate_into is not None, plan, tuple(arrays[n].dtype for n in fusion.step_inputs),
                   sum_rows_snake=snake, col_dtypes=tuple(arrays[n].dtype for n in fusion.col_inputs),
                   untiled_rows=untiled_rows)
    if config.pipeline == "own":
        body, num_threads = functools.partial(specialized.kernel_body, shape=shape), specialized.num_threads(shape)
    else:
        body, num_threads = functools.partial(_kernel_body, shape=shape), 3
    launch = dict(grid=(grid,), grid_names=("sm",),
                  num_threads=num_threads, thread_name="wg", name=name, semantics=config.semantics,
                  reduction_scratch_bytes=fusion.reduction_scratch_bytes)
    if config.cluster_size > 1:
        launch.update(cluster=(config.cluster_size,), cluster_names=(_CLUSTER,))
    inputs = [a, b, *[arrays[n] for n in in_names]]
    if accumulate_into is not None:  # the output is the aliased buffer, between the inputs and the other outputs
        outs, out = mu.kernel_updating(body, out_type=[*[s for _, s in fusion.outputs], *shape.workspace_type()],
                                       **launch)(*inputs, accumulate_into)
        return [out, *outs[:len(fusion.outputs)]]
    out_shape = (M, N) if tile_parts == 1 else (tile_parts, M, N)  # (k_parts: each part's float32 tiles)
    call = mu.kernel(body, out_type=[jax.ShapeDtypeStruct(out_shape, out_dtype), *[s for _, s in fusion.outputs],
                                     *shape.workspace_type()], **launch)
    outs = list(call(*inputs))[:1 + len(fusion.outputs)]
    if tile_parts > 1:
        outs[0] = jnp.sum(outs[0], axis=0).astype(final_dtype)
    return [outs[0], *[o[..., :M] if n in padded_rows_out else o for (n, _), o in zip(fusion.outputs, outs[1:])]]


def _any_rows_fusion_reason(fusion: Fusion) -> str | None:
    """(``gemm``'s partial_rows at an M not a multiple of 8) None when the fusion moves no (M, ·) block by TMA
    besides A's and the output's, which go through untiled views; else the sentence naming what does."""
    tiles = [f"{h}={getattr(fusion, h)!r}" for h in ("a_copy", "a_beside", "tile_copy", "store_in")
             if getattr(fusion, h) is not None]
    if fusion.tile_inputs or tiles:
        return (f"rows past whole 8-row tiles load and store only A's blocks and the output's pieces, got tile_inputs="
                f"{fusion.tile_inputs}{''.join(', ' + t for t in tiles)}")
    return None


def _row_vectors_padded(fusion: Fusion, arrays: dict, rows: int, padded: int) -> tuple[Fusion, dict, tuple]:
    """(``gemm``'s partial_rows) The fusion's row vectors padded from ``rows`` to ``padded`` rows, which TMA does
    not load or store (the hooks read and write them as whole (tile_m,) slices): its (M,) inputs with zeros, and
    its outputs other than the TMA-stored (M, ·) tiles (``a_copy``, ``tile_copy``) whose last axis is M. Returns
    (fusion, arrays, the padded outputs' names)."""
    tiles_out = {h[0] for h in (fusion.a_copy, fusion.tile_copy) if h is not None}
    vectors = set(fusion.inputs) - set(fusion.col_inputs)
    arrays = {n: jnp.pad(v, (0, padded - rows)) if n in vectors and v.shape == (rows,) else v
              for n, v in arrays.items()}
    outputs, padded_out = [], []
    for n, sds in fusion.outputs:
        if n not in tiles_out and sds.shape and sds.shape[-1] == rows:
            sds = jax.ShapeDtypeStruct((*sds.shape[:-1], padded), sds.dtype)
            padded_out.append(n)
        outputs.append((n, sds))
    return dataclasses.replace(fusion, outputs=tuple(outputs)), arrays, tuple(padded_out)


def _gemm_padded(a, b, padded: tuple[int, int], *, config, out_dtype, transpose_a, transpose_b, fusion: Fusion,
                 arrays: dict, num_sms, name) -> list[jax.Array]:
    """(``gemm``'s partial_rows and partial_k in interpret mode, whose slices clamp where TMA loads zeros) The
    product of A padded with zero rows to padded[0] = M' and both operands padded along K to padded[1], the fusion's
    (M, ·) and (M,) inputs padded with zero rows and its outputs' M axes to M', every result sliced back to M."""
    (M, K), (M2, K2) = ((a.shape[1], a.shape[0]) if transpose_a else a.shape), padded
    a = jnp.pad(a, ((0, K2 - K), (0, M2 - M)) if transpose_a else ((0, M2 - M), (0, K2 - K)))
    b = jnp.pad(b, ((0, 0), (0, K2 - K)) if transpose_b else ((0, K2 - K), (0, 0)))
    tiles_out = {h[0] for h in (fusion.a_copy, fusion.tile_copy) if h is not None}
    arrays = {n: jnp.pad(v, [(0, M2 - M)] + [(0, 0)] * (v.ndim - 1)) if v.ndim and v.shape[0] == M and n not in
              fusion.col_inputs + fusion.step_inputs else v for n, v in arrays.items()}
    outputs = tuple((n, jax.ShapeDtypeStruct((M2, *s.shape[1:]) if n in tiles_out else (*s.shape[:-1], M2),
                                             s.dtype)) if s.shape and (s.shape[0] if n in tiles_out else
                                                                       s.shape[-1]) == M else (n, s)
                    for n, s in fusion.outputs)
    outs = gemm(a, b, config=config, out_dtype=out_dtype, transpose_a=transpose_a, transpose_b=transpose_b,
                fusion=dataclasses.replace(fusion, outputs=outputs), arrays=arrays, num_sms=num_sms, name=name)
    sliced = [outs[0][:M]]
    for (n, s), (_, s2), o in zip(fusion.outputs, outputs, outs[1:]):
        sliced.append(o if s.shape == s2.shape else o[:M] if n in tiles_out else o[..., :M])
    return sliced


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The static facts of one kernel, shared by both K loops (this module's and ``gemm.specialized``)."""

    cfg: MosaicGemmConfig
    fusion: Fusion
    in_names: tuple
    out_names: tuple
    transposes: tuple
    mnk: tuple
    dtype: Any
    out_dtype: Any
    tile_dtypes: tuple
    accumulates: bool = False  # the output ref is also the tile input ``_ACCUMULATED`` (``accumulate_into``)
    stream_k: stream_k.StreamKPlan | None = None  # the last rounds' tiles split by K steps (``gemm.stream_k``)
    step_dtypes: tuple = ()  # the dtypes of ``Fusion.step_inputs``
    sum_rows_snake: bool = False  # (Fusion.sum_rows) planar-snake tiles, whole runs a round: see ``tile_context``
    col_dtypes: tuple = ()  # the dtypes of ``Fusion.col_inputs``
    untiled_rows: bool = False  # M not a multiple of 8: A's blocks and the output's pieces by untiled views

    @property
    def iters(self) -> tuple[int, int, int]:
        """(m_iters, n_iters, k_iters): CTA tiles along M and N (the last of them may run past M or N:
        ``gemm``'s partial_rows, ``Fusion.partial_columns``), pipeline steps along K (the last may run past K:
        ``gemm``'s partial_k) of one tile, or of one of its ``k_parts`` ranges."""
        M, N, K = self.mnk
        return -(-M // self.cfg.cta_m), -(-N // self.cfg.cta_n), -(-K // self.cfg.tile_k) // self.cfg.k_parts

    @property
    def stage_transforms(self) -> tuple:
        """The swizzle and tiling of every A and B stage tile (``operand_swizzle_elems``: one for both)."""
        return mu.smem_transforms(operand_swizzle_elems(self.cfg, self.dtype, self.transposes[1]), self.dtype)

    @property
    def cluster_tiles(self) -> int:
        """Tile steps of the persistent loop: CTA tiles (k_parts of them per output tile), or pairs of them along
        the cluster axis."""
        m_iters, n_iters, _ = self.iters
        return m_iters * n_iters * self.cfg.k_parts // self.cfg.cluster_size

    def multicast(self, operand: int) -> tuple[str, ...] | None:
        """The collective axes of operand 0 (A) or 1 (B) when both blocks of a cluster load the same tiles of it
        (TMA multicast: B with cluster "m", A with cluster "n"); else None."""
        return (_CLUSTER,) if self.cfg.cluster == ("n", "m")[operand] else None

    @property
    def pieces(self) -> list:
        cfg = self.cfg
        return [(i, j) for i in range(cfg.tile_m // cfg.epi_tile_m) for j in range(cfg.tile_n // cfg.epi_tile_n)]

    def operand_blocks(self) -> list:
        """(block shape, K axis, (ref, m_idx, n_idx) -> the CTA's GMEM slice along all of K) of A and B: a pipeline
        stage holds one block of each."""
        cfg, (transpose_a, transpose_b) = self.cfg, self.transposes
        cm, cn, tk = cfg.cta_m, cfg.cta_n, cfg.tile_k
        if transpose_a:
            a = ((tk, cm), 0, lambda ref, m, n: ref.at[:, pl.ds(m * cm, cm)])
        else:
            a = ((cm, tk), 1, lambda ref, m, n: ref.at[pl.ds(m * cm, cm)])
        if transpose_b:
            b = ((cn, tk), 1, lambda ref, m, n: ref.at[pl.ds(n * cn, cn)])
        else:
            b = ((tk, cn), 0, lambda ref, m, n: ref.at[:, pl.ds(n * cn, cn)])
        return [a, b]

    def scratch_types(self) -> dict:
        """Shared memory besides the pipeline stages: output staging, prefetched tile inputs, the hooks' scratch."""
        cfg, fusion = self.cfg, self.fusion
        if cfg.epilogue_in == "fourth":  # (gemm.specialized: the accumulators' buffer is the protocol's)
            return dict(
                out_smem=None,
                tile_smem={n: plgpu.SMEM((cfg.tile_m, cfg.epi_tile_n), d, transforms=mu.smem_transforms(
                    cfg.epi_tile_n, d)) for n, d in zip(fusion.tile_inputs, self.tile_dtypes)},
                tile_barriers={n: plgpu.Barrier(num_arrivals=1) for n in fusion.tile_inputs},
                col_smem={n: plgpu.SMEM((2, cfg.tile_n), d) for n, d in zip(fusion.col_inputs, self.col_dtypes)},
                col_barriers={n: plgpu.Barrier(num_barriers=2) for n in fusion.col_inputs},
                a_copy_smem=None if fusion.a_copy is None else plgpu.SMEM(
                    (2, cfg.wg_rows, cfg.tile_k), self.a_copy_dtype, transforms=mu.smem_transforms(
                        cfg.tile_k, self.a_copy_dtype)),
                a_operand_smem=None,
                step_smem={n: plgpu.SMEM((max(1, min(cfg.num_stages, self.iters[2])), cfg.tile_k), d)
                           for n, d in zip(fusion.step_inputs, self.step_dtypes)},
                scratch=dict(fusion.scratch))
        return dict(
            out_smem=None if fusion.store_in else self.untiled_union(plgpu.SMEM(
                (2, min(2, len(self.pieces)), cfg.epi_tile_m, cfg.epi_tile_n), self.out_dtype,
                transforms=mu.smem_transforms(cfg.epi_tile_n, self.out_dtype))),
            tile_smem={n: plgpu.SMEM((2, cfg.tile_m, cfg.tile_n), d, transforms=mu.smem_transforms(cfg.tile_n, d))
                       for n, d in zip(fusion.tile_inputs, self.tile_dtypes) if n != self.ring_input},
            tile_barriers={n: plgpu.Barrier(num_barriers=2) for n in fusion.tile_inputs if n != self.ring_input},
            col_smem={n: plgpu.SMEM((2, cfg.tile_n), d) for n, d in zip(fusion.col_inputs, self.col_dtypes)},
            col_barriers={n: plgpu.Barrier(num_barriers=2) for n in fusion.col_inputs},
            a_copy_smem=None if fusion.a_copy is None else plgpu.SMEM(
                (2, cfg.wg_rows, cfg.tile_k), self.a_copy_dtype, transforms=mu.smem_transforms(cfg.tile_k,
                                                                                              self.a_copy_dtype)),
            # jax's GPU interpreter multiplies no register A: there the a_operand's output goes through SMEM
            a_operand_smem=plgpu.SMEM((2, cfg.wg_rows, cfg.tile_k), self.dtype) if (
                fusion.a_operand is not None and mu.interpreting()) else None,
            step_smem={n: plgpu.SMEM((max(1, min(cfg.num_stages, self.iters[2])), cfg.tile_k), d)
                       for n, d in zip(fusion.step_inputs, self.step_dtypes)},
            scratch=dict(fusion.scratch))

    def untiled_union(self, smem: plgpu.SMEM):
        """``smem`` (8-row tiles, rows of one swizzle atom), and where ``untiled_rows`` a second view of the same
        bytes without the tiles, through which TMA moves any rows (``any_rows_reason``)."""
        if not self.untiled_rows:
            return smem
        swizzle = mu.smem_transforms(smem.shape[-1], smem.dtype)[1]
        return plgpu.RefUnion(smem, plgpu.SMEM(smem.shape, smem.dtype, transforms=(swizzle,)))

    @property
    def a_copy_dtype(self):
        """The dtype of the ``Fusion.a_copy`` output."""
        return jnp.dtype(dict(self.fusion.outputs)[self.fusion.a_copy[0]].dtype)

    def copy_step(self, ctx: TileContext, k):
        """Whether this warpgroup writes step k's A block (``Fusion.a_copy``): its column block is k modulo the
        column blocks (N / tile_n); the second of two warpgroups stacked along M shifted by half of them, so that
        the two copy on different steps (the dx kernel of rmsnorm_matmul took 35 against 44 µs more than without
        the copy at 32768x4096x4096; storing a step later, under the next wgmma, changed nothing measurable:
        rmsnorm_matmul_configs_dyr_schedule*-h100-63e8ede.*)."""
        cols = self.mnk[1] // self.cfg.tile_n
        shift = cols // 2 if self.cfg.wg_rows < self.cfg.cta_m else 0
        return lax.rem(k + ctx.wg * shift, cols) == ctx.col_block

    def copy_a(self, ctx: TileContext, k, a_smem, carry, named_out, scoped) -> None:
        """``Fusion.a_copy`` at step k of this warpgroup's tile, if it writes that step: its rows of the A block
        (a_smem, the stage's) loaded into registers, transformed, staged in SMEM and stored by TMA."""
        cfg = self.cfg
        name, fn = self.fusion.a_copy

        @pl.when(self.copy_step(ctx, k))
        def _copy():
            a = mu.load(a_smem.at[self.wg_a_rows(ctx.wg)], layout=mu.TILE)
            buffer = scoped["a_copy_smem"].at[ctx.wg]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the buffer's last copy has read it
            buffer[...] = fn(dataclasses.replace(ctx, step=k), a, carry).astype(buffer.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buffer, named_out[name].at[pl.ds(ctx.row0, cfg.wg_rows),
                                                               pl.ds(k * cfg.tile_k, cfg.tile_k)])

    def split_refs(self, refs):
        """The kernel's refs after A and B -> (named inputs, out, named outputs)."""
        n_in = len(self.in_names)
        named_in = dict(zip(self.in_names, refs[:n_in]))
        if self.accumulates:
            named_in[_ACCUMULATED] = refs[n_in]
        return named_in, refs[n_in], dict(zip(self.out_names, refs[n_in + 1:]))

    def workspace(self, refs):
        """The stream-K partial sums' GMEM buffer (units, 2, tile_m, tile_n) float32: the output after the fusion's."""
        return refs[len(self.in_names) + 1 + len(self.out_names)]

    def carry_workspaces(self, refs) -> list:
        """The stream-K partial a_observe carries' GMEM buffers (units, 2, *shape) float32, one per carry leaf."""
        first = len(self.in_names) + 2 + len(self.out_names)
        return list(refs[first:first + len(self.observed_carry_shapes)])

    @property
    def observed_carry_shapes(self) -> tuple:
        """The hook carry's leaf shapes whose partial sums stream-K segments pass on: ``Fusion.carry_shapes`` with
        an a_observe or an a_operand (none with share_rows: stream-K tiles do not observe)."""
        hooked = self.fusion.a_observe is not None or self.fusion.a_operand is not None
        return tuple(self.fusion.carry_shapes or ()) if hooked and self.fusion.share_rows is None else ()

    def workspace_type(self) -> list:
        """[the stream-K workspace's ShapeDtypeStruct, then the partial carries'], or [] without stream-K."""
        if self.stream_k is None:
            return []
        units = self.stream_k.units
        return [jax.ShapeDtypeStruct((units, 2, self.cfg.tile_m, self.cfg.tile_n), _F32),
                *[jax.ShapeDtypeStruct((units, 2, *shape), _F32) for shape in self.observed_carry_shapes]]

    def tile_context(self, lin, wg, refs_by_name) -> TileContext:
        """Where compute warpgroup ``wg`` works on the lin-th tile step (planar-snake order over CTA tiles, or over
        pairs of them along the cluster axis; with ``k_parts``, an output tile's K ranges at consecutive steps)."""
        cfg = self.cfg
        m_iters, n_iters, _ = self.iters
        k_part = 0
        if cfg.k_parts > 1:
            lin, k_part = lax.div(lin, cfg.k_parts), lax.rem(lin, cfg.k_parts)
        pairs_m, pairs_n = (cfg.cluster == "m") + 1, (cfg.cluster == "n") + 1
        minor = 1 if cfg.grid_minor == "n" else 0
        if self.fusion.share_rows is not None:  # column 0 of every row block first, then columns 1.. in snake order
            m_idx, n_idx = first_column_then_snake(lin, m_iters, n_iters, minor, cfg.grid_tile_width)
        elif self.fusion.sum_rows is not None and not self.sum_rows_snake:  # row-major: a row's tiles adjacent
            m_idx, n_idx = lax.div(lin, n_iters), lax.rem(lin, n_iters)
        else:
            m_idx, n_idx = planar_snake(lin, (m_iters // pairs_m, n_iters // pairs_n), minor, cfg.grid_tile_width)
        if cfg.cluster_size > 1:  # the cluster's tile pair; this block takes the one at its index in the cluster
            block = lax.axis_index(_CLUSTER)
            m_idx, n_idx = (m_idx * 2 + block, n_idx) if cfg.cluster == "m" else (m_idx, n_idx * 2 + block)
        wg_m, wg_n = (0, 0) if cfg.pingpong else (wg, 0) if cfg.wg_split == "m" else (0, wg)
        return TileContext(row0=m_idx * cfg.cta_m + wg_m * cfg.tile_m, col0=n_idx * cfg.cta_n + wg_n * cfg.tile_n,
                           m_idx=m_idx, n_idx=n_idx, wg=wg,
                           col_block=n_idx * (cfg.cta_n // cfg.tile_n) + wg_n, config=cfg, refs=refs_by_name,
                           k_part=k_part)

    def wg_a_rows(self, wg):
        """The rows of a stage's A block that compute warpgroup ``wg`` multiplies (all of them unless the cooperative
        warpgroups stack along M)."""
        cfg = self.cfg
        return pl.ds(wg * cfg.wg_rows, cfg.wg_rows) if cfg.wg_rows < cfg.cta_m else slice(None)

    def load_a(self, a_smem, wg) -> jax.Array:
        """This warpgroup's rows of a stage's A block in registers, (wg_rows, tile_k) in the accumulator layout (for
        ``Fusion.a_operand``). An A read transposed is stored (tile_k, rows) in the stage: its columns load in the
        transposed layout, and one shuffle and one byte permute a register bring them to the accumulator layout."""
        if not self.transposes[0]:
            return mu.load(a_smem.at[self.wg_a_rows(wg)], layout=mu.TILE)
        block = a_smem.at[:, self.wg_a_rows(wg)].transpose((1, 0))
        return mu.layout_cast(mu.load(block, layout=mu.TILE_TRANSPOSED), mu.TILE)

    def issue_wgmma(self, acc_ref, a_smem, b_smem, wg, a_regs=None) -> None:
        """wgmma of this warpgroup's (tile_m, tile_n) share of one stage: both operands from shared memory, or A
        from ``a_regs`` (this warpgroup's rows of the A block, ``Fusion.a_operand``'s output)."""
        cfg, (transpose_a, transpose_b) = self.cfg, self.transposes
        shared = not cfg.pingpong  # cooperative: the stage holds both warpgroups' shares
        wg_rows = self.wg_a_rows(wg)
        wg_cols = pl.ds(wg * cfg.tile_n, cfg.tile_n) if shared and cfg.wg_split == "n" else slice(None)
        if a_regs is not None:
            a_op = a_regs
        else:
            a_op = a_smem.at[:, wg_rows].transpose((1, 0)) if transpose_a else a_smem.at[wg_rows]
        b_op = b_smem.at[wg_cols].transpose((1, 0)) if transpose_b else b_smem.at[:, wg_cols]
        plgpu.wgmma(acc_ref, a_op, b_op)

    @property
    def ring_input(self) -> str | None:
        """The tile input that arrives through the B stages (``MosaicGemmConfig.tile_input_in="ring"``), or None."""
        return self.fusion.tile_inputs[0] if self.cfg.tile_input_in == "ring" and self.fusion.tile_inputs else None

    def start_tile(self, ctx: TileContext, named_in, scoped) -> None:
        """At a tile's start in each compute warpgroup: TMA prefetch of the epilogue's tile inputs (a ring input
        comes with the stages instead) and column slices (``Fusion.col_inputs``)."""
        for n in self.fusion.col_inputs:
            plgpu.copy_gmem_to_smem(named_in[n].at[ctx.cols], scoped["col_smem"][n].at[ctx.wg],
                                    scoped["col_barriers"][n].at[ctx.wg])
        if self.ring_input:
            return
        if self.fusion.store_in is not None:  # the last tile's output has left the buffer we prefetch into
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for n in self.fusion.tile_inputs:
            plgpu.copy_gmem_to_smem(named_in[n].at[ctx.rows, ctx.cols], scoped["tile_smem"][n].at[ctx.wg],
                                    scoped["tile_barriers"][n].at[ctx.wg])

    def finish_tile(self, ctx: TileContext, acc_ref, carry, out_gmem, named_out, scoped, acc=None, store=True,
                    tile_refs=None):
        """After the K loop: the epilogue on the float32 accumulator (``acc``: its value where the caller added to
        it, e.g. stream-K partial sums), the row vectors stored, and the output tile stored (``store``) or returned
        in out_dtype (for ``store_later`` under the next tile's first wgmma: ``epilogue_store="next_tile"``; with
        "split" the left half is stored now and the right half returned).
        ``tile_refs``: the tile inputs' SMEM, loaded already (a ring input's B stage), instead of the buffers."""
        fusion, wg = self.fusion, ctx.wg
        if acc is None:
            if self.cfg.delay_release:
                plgpu.wgmma_wait(0)
            acc = acc_ref[...]
        if tile_refs is None:
            tile_refs = {n: scoped["tile_smem"][n].at[wg] for n in fusion.tile_inputs}
            with mu.region("tile_inputs"):
                for n in fusion.tile_inputs:
                    plgpu.barrier_wait(scoped["tile_barriers"][n].at[wg])
        col_slices = {n: scoped["col_smem"][n].at[wg] for n in fusion.col_inputs}
        for n in fusion.col_inputs:
            plgpu.barrier_wait(scoped["col_barriers"][n].at[wg])
        ctx = dataclasses.replace(ctx, col_slices=col_slices)
        rows_out = {}
        if fusion.epilogue is not None:
            with mu.region("epilogue_hook"):
                tile_ctx = dataclasses.replace(ctx, tiles=tile_refs)
                acc, rows_out = fusion.epilogue(tile_ctx, acc, carry)
                for n, vec in rows_out.items():
                    _store_rows(vec, named_out[n], ctx)
        signal_early = fusion.sum_rows is not None and fusion.tile_copy is not None
        if signal_early:  # the row's other tiles may sum while this one copies its tile (NOTES.md, forty-fifth
            # session: the dx kernel 255.3 -> 252.3 µs at 16384x1024x5504, 39.3 -> 38.8 at 8192x512x2816)
            _signal_row_part(scoped["row_semaphores"], ctx)
        if fusion.tile_copy is not None:  # staged where the output goes next, stored before it goes there
            name, fn = fusion.tile_copy
            buffer = tile_refs[fusion.store_in]
            with mu.region("tile_copy"):
                buffer[...] = fn(dataclasses.replace(ctx, tiles=tile_refs), carry).astype(buffer.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buffer, named_out[name].at[ctx.rows, ctx.cols])
        if fusion.sum_rows is not None:
            name, finish = fusion.sum_rows
            with mu.region("sum_rows"):
                total = _sum_row_parts(named_out[name], scoped["row_semaphores"], ctx, signalled=signal_early)
            with mu.region("finish"):
                acc = finish(dataclasses.replace(ctx, tiles=tile_refs), acc, total, carry)
        if not fusion.store_tile:
            return None
        tile = acc.astype(self.out_dtype)
        if not store and self.cfg.epilogue_store == "split":
            half = self.cfg.tile_n // 2
            self.store_output(ctx, tile[:, :half], scoped, out_gmem, part=0)
            return tile[:, half:]
        if not store:
            return tile
        if fusion.store_in is not None:
            buffer = tile_refs[fusion.store_in]
            if fusion.tile_copy is not None:  # the copy has left the buffer
                with mu.region("store_wait"):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            with mu.region("store_in_tile"):
                buffer[...] = tile
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buffer, out_gmem.at[ctx.rows, ctx.cols])
        else:
            self.store_output(ctx, tile, scoped, out_gmem)
        return None

    def finish_in_slices(self, ctxs, u_smem, carries, out_gmem, named_in, named_out, scoped) -> None:
        """(``MosaicGemmConfig.epilogue_in="fourth"``) The epilogue of both MMA warpgroups' accumulators, in the
        fourth warpgroup: u_smem (2, tile_m, tile_n) holds them in out_dtype (``ctxs``: their tile contexts,
        ``carries``: their hook carries). Each accumulator is walked in (tile_m, epi_tile_n) column slices, each
        tile input's slice TMA-loaded into its slot. First the epilogue hook on every slice, the slice written back
        over the accumulator and the hook's row vectors summed over the slices (they must add up: e.g. row sums),
        then stored and, with ``Fusion.sum_rows``, counted; then per accumulator the row sum, and on every slice
        the ``tile_copy`` (staged in the store_in input's slot, which then holds it, as the buffer does in
        ``finish_tile``) and the finish, written back; then the accumulator's tile stored from the buffer. Returns
        once every store has read shared memory: the buffer is free."""
        cfg, fusion = self.cfg, self.fusion
        width = cfg.epi_tile_n
        sliced = dataclasses.replace(cfg, tile_n=width)  # a slice's context: its columns (TileContext.cols)
        slots, slot_barriers = scoped["tile_smem"], scoped["tile_barriers"]

        def load_inputs(ctx, j):
            if not fusion.tile_inputs:
                return {}
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # a copy staged in a slot has left it
            for n in fusion.tile_inputs:
                plgpu.copy_gmem_to_smem(named_in[n].at[ctx.rows, pl.ds(ctx.col0 + j * width, width)], slots[n],
                                        slot_barriers[n])
            for n in fusion.tile_inputs:
                plgpu.barrier_wait(slot_barriers[n])
            return dict(slots)

        def slice_context(ctx, h, j, tiles):
            return dataclasses.replace(ctx, col0=ctx.col0 + j * width, config=sliced, tiles=tiles, col_slices={
                n: scoped["col_smem"][n].at[h].at[pl.ds(j * width, width)] for n in fusion.col_inputs})

        def piece(h, j):
            return u_smem.at[h].at[:, pl.ds(j * width, width)]

        for h, ctx in enumerate(ctxs):
            for n in fusion.col_inputs:
                plgpu.copy_gmem_to_smem(named_in[n].at[ctx.cols], scoped["col_smem"][n].at[h],
                                        scoped["col_barriers"][n].at[h])
        for h in range(len(ctxs)):
            for n in fusion.col_inputs:
                plgpu.barrier_wait(scoped["col_barriers"][n].at[h])
        for h, ctx in enumerate(ctxs):
            rows_out = {}
            for j in range(cfg.tile_n // width):
                tiles = load_inputs(ctx, j)
                acc = mu.load(piece(h, j), layout=mu.TILE).astype(_F32)
                if fusion.epilogue is not None:
                    acc, rows = fusion.epilogue(slice_context(ctx, h, j, tiles), acc, carries[h])
                    rows_out = {n: _add_rows(rows_out[n], v) if n in rows_out else v for n, v in rows.items()}
                piece(h, j)[...] = acc.astype(u_smem.dtype)
            for n, vec in rows_out.items():
                _store_rows(vec, named_out[n], ctx)
            if fusion.sum_rows is not None:
                _signal_row_part(scoped["row_semaphores"], ctx)
        for h, ctx in enumerate(ctxs):
            total = None
            if fusion.sum_rows is not None:
                total = _sum_row_parts(named_out[fusion.sum_rows[0]], scoped["row_semaphores"], ctx, signalled=True)
            if fusion.tile_copy is not None or fusion.sum_rows is not None:
                for j in range(cfg.tile_n // width):
                    sctx = slice_context(ctx, h, j, load_inputs(ctx, j))
                    if fusion.tile_copy is not None:
                        name, fn = fusion.tile_copy
                        buffer = sctx.tiles[fusion.store_in]
                        buffer[...] = fn(sctx, carries[h]).astype(buffer.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(buffer, named_out[name].at[sctx.rows, sctx.cols])
                    if fusion.sum_rows is not None:
                        u = mu.load(piece(h, j), layout=mu.TILE).astype(_F32)
                        piece(h, j)[...] = fusion.sum_rows[1](sctx, u, total, carries[h]).astype(u_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(u_smem.at[h], out_gmem.at[ctx.rows, ctx.cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def store_output(self, ctx: TileContext, tile: jax.Array, scoped, out_gmem, part=None) -> None:
        """Stores this warpgroup's (tile_m, tile_n) output tile (out_dtype registers) at ctx's place, piece by piece
        through its SMEM staging slots; ``part`` 0 or 1: only the left or right half of its columns (``tile`` that
        half, ``epilogue_store="split"``)."""
        pieces, col_pieces = self.pieces, self.cfg.tile_n // self.cfg.epi_tile_n
        first = 0
        if part is not None:
            first = part * col_pieces // 2
            pieces = [(i, j) for i, j in pieces if first <= j < first + col_pieces // 2]
        slots = copies = scoped["out_smem"]
        if self.cfg.k_parts > 1:  # (the plain product in parts: (k_parts, M, N) float32)
            out_gmem = out_gmem.at[ctx.k_part]
        if self.untiled_rows:  # written through the tiled view, copied out through the untiled one
            slots, copies = slots
        _store_tile(tile, slots.at[ctx.wg], out_gmem, ctx, pieces, first_col=first, copies=copies.at[ctx.wg])

    def store_later(self, ctx: TileContext, held: jax.Array, scoped, out_gmem) -> None:
        """Stores what ``finish_tile(store=False)`` returned: the whole tile ("next_tile") or its right half
        ("split")."""
        self.store_output(ctx, held, scoped, out_gmem, part=1 if self.cfg.epilogue_store == "split" else None)

    def held_shape(self) -> tuple:
        """The shape of what a tile keeps for the next tile's first wgmma (``epilogue_store`` not "end")."""
        cfg = self.cfg
        return (cfg.tile_m, cfg.tile_n // 2 if cfg.epilogue_store == "split" else cfg.tile_n)


def _kernel_body(a_gmem, b_gmem, *refs, shape: _Shape):
    """K loop "pallas" / "pallas_steady": jax's warp-specialized pipeline, once per output tile."""
    cfg, fusion = shape.cfg, shape.fusion
    named_in, out_gmem, named_out = shape.split_refs(refs)
    m_iters, n_iters, k_iters = shape.iters
    stages = min(cfg.num_stages, k_iters)
    steady = cfg.pipeline == "pallas_steady" and k_iters % stages == 0 and cfg.delay_release == 0
    transforms = shape.stage_transforms
    index_maps = (lambda k: (k, 0), lambda k: (0, k))  # by the block's K axis
    specs = [plgpu.BlockSpec(block, index_maps[k_axis], transforms=transforms, delay_release=cfg.delay_release)
             for block, k_axis, _ in shape.operand_blocks()]

    def pipeline(body, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=_MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
            num_compute_wgs=2, max_concurrent_steps=stages, compute_context=compute_context, pipeline_state=state)

    ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body

    def scope(pipeline_allocs, **scoped):
        wg = lax.axis_index("wg")
        refs_by_name = {**named_in, **named_out, **scoped["scratch"]}

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tile_loop(loop_info):
            ctx = shape.tile_context(loop_info.index[0], wg, refs_by_name)
            state = None
            if steady:  # the memory warpgroup loads the next tile's first stages while this one's last run
                last = loop_info.local_index == loop_info.num_local_steps - 1
                state = jnp.where(loop_info.local_index == 0, int(plgpu.PipelinePipeline.START),
                                  jnp.where(last, int(plgpu.PipelinePipeline.STOP),
                                            int(plgpu.PipelinePipeline.STEADY)))

            def mma_body(idxs, a_smem, b_smem, acc_and_carry):
                del idxs
                acc_ref, carry = acc_and_carry
                shape.issue_wgmma(acc_ref, a_smem, b_smem, wg)
                plgpu.wgmma_wait(cfg.delay_release)
                return acc_ref, carry

            def compute_context(eval_pipeline):
                shape.start_tile(ctx, named_in, scoped)
                carry0 = fusion.prologue_init(ctx) if fusion.prologue_init is not None else ()

                def acc_scope(acc_ref):
                    _, carry = eval_pipeline((acc_ref, carry0))
                    shape.finish_tile(ctx, acc_ref, carry, out_gmem, named_out, scoped)

                pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n), _F32))

            gmem = [cta(ref, ctx.m_idx, ctx.n_idx)
                    for ref, (_, _, cta) in zip((a_gmem, b_gmem), shape.operand_blocks())]
            pipeline(mma_body, compute_context, state)(*gmem, allocations=pipeline_allocs)
            if steady:  # a block of one tile ran START only: await the releases its STOP would have awaited
                @pl.when((wg == 2) & (loop_info.num_local_steps == 1))
                def _quiesce():
                    (consumed,) = pipeline_allocs["flat_consumed_barrier_refs"]
                    for slot in range(stages):
                        plgpu.barrier_wait(consumed.at[slot])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # all stores have left shared memory before exit

    pl.run_scoped(scope, pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
                  **shape.scratch_types(), collective_axes="wg")


def planar_snake(lin, shape: tuple[int, int], minor_dim: int, tile_width: int):
    """(m_idx, n_idx) of the lin-th tile of a (m_iters, n_iters) grid in ``plgpu.planar_snake``'s order (runs of
    tile_width tiles along minor_dim, every other run reversed), from lax.div / rem / select of lin with Python-int
    shape constants only: jax's helper divides jnp scalars, whose floor division has no warp-level lowering
    (``MosaicGemmConfig.memory_warps`` 1 computes tile coordinates in one warp). lin: a traced int32 scalar."""
    major_size, minor_size = shape[1 - minor_dim], shape[minor_dim]
    run = tile_width * major_size  # tiles per full run of tile_width along the minor dimension
    minor_run = lax.div(lin, run)

    def coordinates(idx, width):  # within a run of width minor positions
        minor = minor_run * tile_width + lax.rem(idx, width)
        major_within = lax.rem(lax.div(idx, width), major_size)
        major = lax.select(lax.rem(minor_run, 2) == 0, major_within, major_size - 1 - major_within)
        return (minor, major) if minor_dim == 0 else (major, minor)

    full_runs = minor_size // tile_width
    full = coordinates(lin, tile_width)
    if minor_size == full_runs * tile_width:  # no last, narrower run
        return full
    last = coordinates(lin - full_runs * run, minor_size - full_runs * tile_width)
    in_full = lin < full_runs * run
    return tuple(lax.select(in_full, f, l) for f, l in zip(full, last))


def first_column_then_snake(lin, m_iters: int, n_iters: int, minor_dim: int, tile_width: int):
    """(m_idx, n_idx) of the lin-th CTA tile in the order of ``Fusion.share_rows``: tiles 0 .. m_iters - 1 are
    column 0 of each row block (the tiles that compute the shared row vectors), the rest columns 1 .. n_iters - 1
    in planar-snake order. lin: a traced int32 scalar, or a Python int (tests)."""
    if n_iters == 1:
        return lin, lin * 0
    rest = jnp.maximum(lin - m_iters, 0)
    m_rest, n_rest = planar_snake(jnp.asarray(rest, jnp.int32), (m_iters, n_iters - 1), minor_dim, tile_width)
    first = lin < m_iters
    return jnp.where(first, lin, m_rest), jnp.where(first, 0, n_rest + 1)


def _store_tile(tile: jax.Array, slots, out_gmem, ctx: TileContext, pieces, first_col: int = 0,
                copies=None) -> None:
    """Stores a register tile at the accumulator's place in out_gmem, piece by piece through two alternating SMEM
    slots (a slot is reused once the store issued two pieces earlier has read it). ``tile``'s column 0 is that of
    piece column ``first_col`` (a right half: ``epilogue_store="split"``). ``copies``: another view of the slots
    that TMA stores from (``_Shape.untiled_union``)."""
    copies = slots if copies is None else copies
    cfg = ctx.config
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for p, (i, j) in enumerate(pieces):
        slot = p % slots.shape[0]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        slots[slot] = tile[i * em:(i + 1) * em, (j - first_col) * en:(j - first_col + 1) * en]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(copies.at[slot],
                                out_gmem.at[pl.ds(ctx.row0 + i * em, em), pl.ds(ctx.col0 + j * en, en)])


def _signal_row_part(semaphores, ctx: TileContext) -> None:
    """(``Fusion.sum_rows``) This accumulator's part is stored: 1 added to its row group's count (a release
    after the warpgroup's stores; ``_sum_row_parts`` waits for the others')."""
    plgpu.semaphore_signal(semaphores.at[ctx.row0 // ctx.config.tile_m], 1, memory_scope="gpu")


def _sum_row_parts(parts_gmem, semaphores, ctx: TileContext, signalled: bool = False) -> jax.Array:
    """(``Fusion.sum_rows``) Σ over the P column blocks' parts of parts_gmem (P, M) at this accumulator's rows, each
    stored before this by its column block's accumulator. One count per row group (``semaphores``: (M / tile_m,)):
    each accumulator adds 1 (a release after the warpgroup's stores), waits for it to reach P without taking
    anything off (an acquire) and sums the P parts itself, in column-block order, so every tile of the row gets the
    same float32 total. The counts end the call at P: each row group's is counted once per call, and jax zeroes a
    kernel's GMEM scratch (where ``pl.get_global`` puts them) before each call. One release per accumulator, one
    round trip to L2 after the last part lands. (As first built, each accumulator signalled every column block:
    about 17 µs a tile in 43 releases; then the column-0 accumulator summed the parts and released the others, a
    second round trip; then each count went back to zero through a second one, a second release per accumulator
    and the column-0 one's wait for the others: the dx kernel 1539.4 → 1527.3 µs at 32768x4096x4096 without it.
    NOTES.md, forty-second, forty-third and forty-seventh sessions.) ``signalled``: this accumulator has added its
    1 already (``_signal_row_part``, before other work). Returns (tile_m,) float32 in layout ROWS."""
    num_parts = parts_gmem.shape[0]
    if not signalled:
        _signal_row_part(semaphores, ctx)
    gathered = semaphores.at[ctx.row0 // ctx.config.tile_m]
    plgpu.semaphore_wait(gathered, num_parts, decrement=False, memory_scope="gpu")  # acquire: every part stored
    total = mu.load(parts_gmem.at[0, ctx.rows], layout=mu.ROWS, optimized=False)
    for p in range(1, num_parts):
        total = total + mu.load(parts_gmem.at[p, ctx.rows], layout=mu.ROWS, optimized=False)
    return total


def _add_rows(total, part):
    """The sum of two epilogue row values: (tile_m,) vectors, or tuples of them (``Fusion.epilogue``)."""
    return tuple(map(jnp.add, total, part)) if isinstance(total, tuple) else total + part


def _store_rows(vec, out_gmem, ctx: TileContext) -> None:
    """Stores a (tile_m,) row vector straight from registers: into an (M,) output from the first column block
    only (every column block computes the same values), into a (C, M) output at row ctx.col_block; a tuple of C
    row vectors into a (C, M) output's rows. With ``MosaicGemmConfig.k_parts`` P the (P · C, M) output's part
    ctx.k_part takes them (its rows k_part · C to (k_part + 1) · C)."""
    parts = ctx.config.k_parts
    if isinstance(vec, tuple):
        if len(out_gmem.shape) != 2 or out_gmem.shape[0] != len(vec) * parts:
            per = f" (k_parts={parts})" if parts > 1 else ""
            raise ValueError(f"an epilogue's tuple of {len(vec)} row vectors needs a ({len(vec) * parts}, M) "
                             f"output{per}, got shape {tuple(out_gmem.shape)}")
        for j, row in enumerate(vec):
            out_gmem.at[ctx.k_part * len(vec) + j, ctx.rows][...] = row.astype(out_gmem.dtype)
        return
    if parts > 1:
        if len(out_gmem.shape) != 2 or out_gmem.shape[0] % parts:
            raise ValueError(f"an epilogue's row vectors under k_parts={parts} need a (k_parts · C, M) output, got "
                             f"shape {tuple(out_gmem.shape)}")
        out_gmem.at[ctx.k_part * (out_gmem.shape[0] // parts) + ctx.col_block, ctx.rows][...] = vec.astype(
            out_gmem.dtype)
        return
    if len(out_gmem.shape) == 1:
        @pl.when(ctx.col_block == 0)
        def _():
            out_gmem.at[ctx.rows][...] = vec.astype(out_gmem.dtype)
    else:
        out_gmem.at[ctx.col_block, ctx.rows][...] = vec.astype(out_gmem.dtype)
