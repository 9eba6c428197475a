"""The Mosaic-GPU (Hopper) GEMM core: out = epilogue(a @ b) with a prologue on the operand tiles, one kernel.

  out, *extra = gemm(a, b, config=MosaicGemmConfig(), out_dtype=jnp.bfloat16)            # a (M, K), b (K, N)
  out = gemm(a_t, b, transpose_a=True, ...)[0]             # a given as (K, M): the A tiles are read transposed
  out = gemm(a, b_t, transpose_b=True, ...)[0]             # b given as (N, K)
  y, r = gemm(x, w, fusion=Fusion(prologue_step=..., epilogue=..., outputs=...), arrays={...}, ...)

One kernel launch, persistent: grid = one block per SM, each block walks the (cta_m, cta_n) output tiles in
planar-snake order. A block has three warpgroups: two compute warpgroups, each owning a float32 (tile_m, tile_n)
accumulator in registers (the CTA tile is two accumulators stacked along M or N: ``wg_split``), and one memory
warpgroup issuing the TMA loads of the A and B tiles (and of the fusion's side inputs) ``num_stages`` steps ahead
into swizzled shared memory (``emit_pipeline_warp_specialized``). Per output tile, in each compute warpgroup:
  1. start: TMA prefetch of the fusion's tile inputs (its (tile_m, tile_n) tile of each, e.g. the x tile an
     epilogue adds), and ``prologue_init`` (a carry: e.g. zeroed row sums, row vectors loaded from HBM);
  2. K loop, per step of tile_k: wait for the step's tiles, issue wgmma (both operands from SMEM), then
     ``prologue_step`` on the SMEM tiles of A and the side inputs while the tensor cores work, wait for the
     wgmma (``delay_release``: keep one in flight), release the slot to the memory warpgroup;
  3. epilogue(acc f32, carry) -> (the f32 tile to store, row vectors to store): the tile is cast to out_dtype,
     written to SMEM in (epi_tile_m, epi_tile_n) pieces and each piece stored by TMA; row vectors (tile_m,) are
     stored from registers into the fusion's outputs (1-D (M,) outputs from the first column block only; 2-D
     (C, M) outputs get row ``col_block``, the warpgroup's tile_n column block).
A hook never sees a partial tile: shapes must divide the CTA tile (``unsupported_reason``).
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

__all__ = ["Fusion", "MosaicGemmConfig", "TileContext", "gemm", "smem_bytes", "unsupported_reason"]

_F32 = jnp.float32
_MEMORY_REGISTERS = 40  # registers per thread left to the memory warpgroup (it only issues TMA)


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
    """Tiles and schedule of one Mosaic GEMM kernel (hashable: a static argument).

    Attributes:
      tile_m, tile_n: the float32 accumulator of one compute warpgroup, (tile_m, tile_n): tile_m a multiple of 64
        (wgmma's M), tile_n a multiple of epi_tile_n up to 256; tile_m · tile_n <= 128 · 256 (<= 256 registers
        per thread).
      tile_k: contraction slice per pipeline step, 16 <= tile_k, a multiple of 16.
      num_stages: A/B (and side input) tiles in flight in shared memory, >= 2.
      wg_split: "m": the two compute warpgroups stack along M (CTA tile (2·tile_m, tile_n), each owns its rows of
        the A tile); "n": along N (CTA tile (tile_m, 2·tile_n), both read all rows of the A tile).
      epi_tile_m, epi_tile_n: pieces the accumulator is stored in (two SMEM slots per warpgroup).
      grid_minor, grid_tile_width: planar-snake tile order: runs of grid_tile_width tiles along grid_minor.
      delay_release: 0: wait for each step's wgmma before releasing its slot; 1: keep one wgmma in flight.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    num_stages: int = 4
    wg_split: str = "n"
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    grid_minor: str = "n"
    grid_tile_width: int = 1
    delay_release: int = 0

    def __post_init__(self):
        cls = type(self).__name__
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{cls}.{field.name}: must be a non-negative int, got {value!r}")
        checks = [
            ("epi_tile_n", self.epi_tile_n in (16, 32, 64, 128, 256), "one of 16, 32, 64, 128, 256"),
            ("tile_m", self.tile_m > 0 and self.tile_m % 64 == 0, "a positive multiple of 64"),
            ("tile_n", 0 < self.tile_n <= 256 and self.tile_n % self.epi_tile_n == 0,
             f"in (0, 256] and a multiple of epi_tile_n={self.epi_tile_n}"),
            ("tile_k", self.tile_k >= 16 and self.tile_k % 16 == 0, "a multiple of 16, >= 16"),
            ("num_stages", self.num_stages >= 2, ">= 2"),
            ("wg_split", self.wg_split in ("m", "n"), "'m' or 'n'"),
            ("epi_tile_m", self.epi_tile_m % 64 == 0 and self.epi_tile_m > 0 and self.tile_m % self.epi_tile_m == 0,
             f"a multiple of 64 dividing tile_m={self.tile_m}"),
            ("grid_minor", self.grid_minor in ("m", "n"), "'m' or 'n'"),
            ("grid_tile_width", self.grid_tile_width >= 1, ">= 1"),
            ("delay_release", self.delay_release in (0, 1), "0 or 1"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{cls}.{name}: must be {allowed}, got {getattr(self, name)!r}")
        if self.tile_m * self.tile_n > 128 * 256:
            raise ValueError(f"{cls}.tile_m, tile_n: the accumulator {self.tile_m}x{self.tile_n} exceeds 128x256 "
                             "(256 float32 registers per thread)")
        if self.delay_release >= self.num_stages:
            raise ValueError(f"{cls}.delay_release: must be < num_stages={self.num_stages}")

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (2 if self.wg_split == "n" else 1)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def unsupported_reason(M: int, N: int, K: int, config: MosaicGemmConfig, *, names=("M", "N", "K")) -> str | None:
    """None when the kernel takes an (M, K) @ (K, N) product with this config; else one sentence naming the
    constraint: no partial tiles (M, N, K multiples of the CTA tile and tile_k). ``names``: what the caller
    calls M, N and K."""
    for dim, size, tile, what in ((names[0], M, config.cta_m, "rows"), (names[1], N, config.cta_n, "columns"),
                                  (names[2], K, config.tile_k, "tile_k")):
        if size <= 0 or size % tile:
            what = "tile_k" if what == "tile_k" else f"the {what} of a block's output tile"
            return f"{dim}={size} is not a positive multiple of {what}={tile}"
    return None


@dataclasses.dataclass(frozen=True)
class TileContext:
    """Where a compute warpgroup is, for the hooks (traced values; Python ints where static).

    row0, col0: first output row / column of this warpgroup's (tile_m, tile_n) accumulator.
    m_idx, n_idx: the CTA tile's indices; wg: the compute warpgroup (0 or 1); block_row0: row0 within the
      block's (cta_m, cta_n) tile (wg · tile_m with wg_split "m", else 0); col_block: this accumulator's
      tile_n column block in the output (n_idx · 2 + wg with wg_split "n", else n_idx).
    refs: the fusion's inputs and outputs (GMEM refs) and scratch (SMEM refs), by name.
    tiles: (epilogue only) this warpgroup's prefetched (tile_m, tile_n) SMEM tile of each tile input, by name.
    step: (prologue only) the pipeline step: the A tile holds columns [step · tile_k, (step + 1) · tile_k).
    """

    row0: Any
    col0: Any
    m_idx: Any
    n_idx: Any
    wg: Any
    block_row0: Any
    col_block: Any
    config: MosaicGemmConfig
    refs: Mapping[str, Any]
    tiles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    step: Any = None

    @property
    def rows(self):
        return pl.ds(self.row0, self.config.tile_m)

    @property
    def cols(self):
        return pl.ds(self.col0, self.config.tile_n)

    def load_rows(self, name: str) -> jax.Array:
        """This accumulator's rows of the (M,) GMEM input ``name``, one value per row (layout ROWS)."""
        return mu.load(self.refs[name].at[self.rows], layout=mu.ROWS, optimized=False)

    def load_tile(self, name: str) -> jax.Array:
        """The prefetched tile input ``name`` as a float32 (tile_m, tile_n) array in the accumulator layout."""
        return mu.load(self.tiles[name], layout=mu.TILE).astype(_F32)


@dataclasses.dataclass(frozen=True)
class Fusion:
    """What a fused GEMM adds to the plain one. Hooks run in each compute warpgroup; names refer to ``arrays``.

    side_inputs: (M, K) arrays streamed through SMEM with A, tile by tile (not with transpose_a).
    tile_inputs: (M, N) arrays whose (tile_m, tile_n) tile at each accumulator is prefetched for the epilogue.
    inputs: other arrays the hooks read from GMEM themselves (row / column vectors).
    outputs: (name, jax.ShapeDtypeStruct) the hooks or the epilogue's row vectors write.
    scratch: (name, SMEM type) the hooks use; allocated once per block, shared by both compute warpgroups.
    store_in: a tile input (of out_dtype) whose SMEM tile, once the epilogue has read it, receives the output tile
      and is stored from there by one TMA copy: no separate output staging (saves 2 · 2 · epi pieces of SMEM).
    prologue_init(ctx) -> carry; prologue_step(ctx, a_tile_ref, side_tile_refs, carry) -> carry: a_tile_ref is
      this warpgroup's rows of the step's A tile (tile_m, tile_k) in SMEM, side_tile_refs the same of each side
      input; called after the step's wgmma is issued.
    epilogue(ctx, acc, carry) -> (tile, {output name: (tile_m,) row vector}); acc (tile_m, tile_n) float32.
    """

    side_inputs: tuple[str, ...] = ()
    tile_inputs: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[tuple[str, jax.ShapeDtypeStruct], ...] = ()
    scratch: tuple[tuple[str, Any], ...] = ()
    store_in: str | None = None
    prologue_init: Callable | None = None
    prologue_step: Callable | None = None
    epilogue: Callable | None = None


def smem_bytes(config: MosaicGemmConfig, dtype, out_dtype, *, num_side_inputs: int = 0,
               tile_input_dtypes: tuple = (), store_in_tile: bool = False, scratch_bytes: int = 0) -> int:
    """Shared memory one block allocates (bytes; barriers and Mosaic's reduction scratch excluded): the
    pipeline's A/B/side tiles, the output staging, prefetched tile inputs and the hooks' scratch."""
    size = jnp.dtype(dtype).itemsize
    per_stage = (config.cta_m * (1 + num_side_inputs) + config.cta_n) * config.tile_k * size
    pieces = (config.tile_m // config.epi_tile_m) * (config.tile_n // config.epi_tile_n)
    staging = 0 if store_in_tile else 2 * min(2, pieces) * config.epi_tile_m * config.epi_tile_n * jnp.dtype(
        out_dtype).itemsize
    tiles = sum(2 * config.tile_m * config.tile_n * jnp.dtype(d).itemsize for d in tile_input_dtypes)
    return config.num_stages * per_stage + staging + tiles + scratch_bytes


def gemm(a: jax.Array, b: jax.Array, *, config: MosaicGemmConfig, out_dtype, transpose_a: bool = False,
         transpose_b: bool = False, fusion: Fusion | None = None, arrays: Mapping[str, jax.Array] | None = None,
         num_sms: int | None = None, name: str = "mosaic_gemm") -> list[jax.Array]:
    """[out (M, N) in out_dtype, *fusion outputs] of epilogue(A @ B) in one Mosaic-GPU kernel.

    a: (M, K), or (K, M) with transpose_a; b: (K, N), or (N, K) with transpose_b; 16-bit floats of one dtype.
    The shapes must satisfy ``unsupported_reason`` (checked here: ValueError). ``arrays`` holds the fusion's
    named inputs. Runs on an sm90 GPU; lowers for CUDA anywhere."""
    fusion = fusion or Fusion()
    arrays = dict(arrays or {})
    if mu.interpreting() and (transpose_a or transpose_b):  # the CPU interpreter reads no transposed SMEM refs
        a, b = (a.T if transpose_a else a), (b.T if transpose_b else b)
        transpose_a = transpose_b = False
    M, K = a.shape[::-1] if transpose_a else a.shape
    N = b.shape[0] if transpose_b else b.shape[1]
    reason = unsupported_reason(M, N, K, config)
    if reason:
        raise ValueError(f"{name}: {reason}")
    if fusion.side_inputs and transpose_a:
        raise ValueError(f"{name}: side inputs stream with an untransposed A")
    in_names = (*fusion.side_inputs, *fusion.tile_inputs, *fusion.inputs)
    missing = [n for n in in_names if n not in arrays]
    if missing:
        raise ValueError(f"{name}: arrays is missing {missing}")
    if fusion.store_in is not None and (fusion.store_in not in fusion.tile_inputs
                                        or arrays[fusion.store_in].dtype != jnp.dtype(out_dtype)):
        raise ValueError(f"{name}: store_in={fusion.store_in!r} must name a tile input of dtype {out_dtype}")
    out_names = [n for n, _ in fusion.outputs]
    body = functools.partial(_kernel_body, config=config, fusion=fusion, in_names=in_names, out_names=out_names,
                             transposes=(transpose_a, transpose_b), mnk=(M, N, K),
                             dtypes=(a.dtype, jnp.dtype(out_dtype), tuple(arrays[n].dtype for n in fusion.tile_inputs)))
    call = mu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((M, N), out_dtype), *[s for _, s in fusion.outputs]],
        grid=(num_sms or mu.num_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg", name=name)
    return list(call(a, b, *[arrays[n] for n in in_names]))


def _kernel_body(a_gmem, b_gmem, *refs, config: MosaicGemmConfig, fusion: Fusion, in_names, out_names,
                 transposes, mnk, dtypes):
    cfg = config
    transpose_a, transpose_b = transposes
    M, N, K = mnk
    dtype, out_dtype, tile_dtypes = dtypes
    n_in = len(in_names)
    named_in = dict(zip(in_names, refs[:n_in]))
    out_gmem = refs[n_in]
    named_out = dict(zip(out_names, refs[n_in + 1:]))
    m_iters, n_iters, k_iters = M // cfg.cta_m, N // cfg.cta_n, K // cfg.tile_k

    op_transforms = mu.smem_transforms(cfg.tile_k, dtype)  # every operand tile: swizzle of a tile_k-long row
    a_block = (cfg.tile_k, cfg.cta_m) if transpose_a else (cfg.cta_m, cfg.tile_k)
    b_block = (cfg.cta_n, cfg.tile_k) if transpose_b else (cfg.tile_k, cfg.cta_n)
    a_spec = plgpu.BlockSpec(a_block, (lambda k: (k, 0)) if transpose_a else (lambda k: (0, k)),
                             transforms=op_transforms, delay_release=cfg.delay_release)
    b_spec = plgpu.BlockSpec(b_block, (lambda k: (0, k)) if transpose_b else (lambda k: (k, 0)),
                             transforms=op_transforms, delay_release=cfg.delay_release)
    side_specs = [plgpu.BlockSpec((cfg.cta_m, cfg.tile_k), lambda k: (0, k), transforms=op_transforms,
                                  delay_release=cfg.delay_release) for _ in fusion.side_inputs]

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=_MEMORY_REGISTERS, in_specs=[a_spec, b_spec, *side_specs],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=min(cfg.num_stages, k_iters),
            compute_context=compute_context)

    pieces = [(i, j) for i in range(cfg.tile_m // cfg.epi_tile_m) for j in range(cfg.tile_n // cfg.epi_tile_n)]
    num_slots = min(2, len(pieces))
    tile_types = {n: plgpu.SMEM((2, cfg.tile_m, cfg.tile_n), d, transforms=mu.smem_transforms(cfg.tile_n, d))
                  for n, d in zip(fusion.tile_inputs, tile_dtypes)}
    ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body
    scoped = dict(
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(
            a_gmem, b_gmem, *[named_in[n] for n in fusion.side_inputs]),
        out_smem=None if fusion.store_in else plgpu.SMEM(
            (2, num_slots, cfg.epi_tile_m, cfg.epi_tile_n), out_dtype,
            transforms=mu.smem_transforms(cfg.epi_tile_n, out_dtype)),
        tile_smem=tile_types,
        tile_barriers={n: plgpu.Barrier(num_barriers=2) for n in fusion.tile_inputs},
        scratch=dict(fusion.scratch),
    )

    def scope(pipeline_allocs, out_smem, tile_smem, tile_barriers, scratch):
        wg = lax.axis_index("wg")
        wg_m, wg_n = (wg, 0) if cfg.wg_split == "m" else (0, wg)
        refs_by_name = {**named_in, **named_out, **scratch}

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tile_loop(loop_info):
            (lin,) = loop_info.index
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), 1 if cfg.grid_minor == "n" else 0,
                                              cfg.grid_tile_width)
            cta_rows, cta_cols = pl.ds(m_idx * cfg.cta_m, cfg.cta_m), pl.ds(n_idx * cfg.cta_n, cfg.cta_n)
            wg_rows = pl.ds(wg_m * cfg.tile_m, cfg.tile_m) if cfg.wg_split == "m" else slice(None)
            wg_cols = pl.ds(wg_n * cfg.tile_n, cfg.tile_n) if cfg.wg_split == "n" else slice(None)
            ctx = TileContext(row0=m_idx * cfg.cta_m + wg_m * cfg.tile_m, col0=n_idx * cfg.cta_n + wg_n * cfg.tile_n,
                              m_idx=m_idx, n_idx=n_idx, wg=wg, block_row0=wg_m * cfg.tile_m, col_block=n_idx * (cfg.cta_n // cfg.tile_n) + wg_n,
                              config=cfg, refs=refs_by_name)

            def mma_body(idxs, a_smem, b_smem, *rest):
                *side_smem, (acc_ref, carry) = rest
                if transpose_a:
                    a_op = a_smem.at[:, wg_rows].transpose((1, 0))
                else:
                    a_op = a_smem.at[wg_rows]
                b_op = b_smem.at[wg_cols].transpose((1, 0)) if transpose_b else b_smem.at[:, wg_cols]
                plgpu.wgmma(acc_ref, a_op, b_op)
                if fusion.prologue_step is not None:
                    step_ctx = dataclasses.replace(ctx, step=idxs[0])
                    carry = fusion.prologue_step(step_ctx, a_smem.at[wg_rows], [s.at[wg_rows] for s in side_smem],
                                                 carry)
                plgpu.wgmma_wait(cfg.delay_release)
                return acc_ref, carry

            def compute_context(eval_pipeline):
                if fusion.store_in is not None:  # the last tile's output has left the buffer we prefetch into
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for n in fusion.tile_inputs:  # prefetch the epilogue's tiles while the K loop runs
                    plgpu.copy_gmem_to_smem(named_in[n].at[ctx.rows, ctx.cols], tile_smem[n].at[wg],
                                            tile_barriers[n].at[wg])
                carry0 = fusion.prologue_init(ctx) if fusion.prologue_init is not None else ()

                def acc_scope(acc_ref):
                    _, carry = eval_pipeline((acc_ref, carry0))
                    plgpu.wgmma_wait(0)
                    acc = acc_ref[...]
                    for n in fusion.tile_inputs:
                        plgpu.barrier_wait(tile_barriers[n].at[wg])
                    rows_out = {}
                    if fusion.epilogue is not None:
                        tile_ctx = dataclasses.replace(ctx, tiles={n: tile_smem[n].at[wg] for n in fusion.tile_inputs})
                        acc, rows_out = fusion.epilogue(tile_ctx, acc, carry)
                    if fusion.store_in is not None:
                        buffer = tile_smem[fusion.store_in].at[wg]
                        buffer[...] = acc.astype(out_dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(buffer, out_gmem.at[ctx.rows, ctx.cols])
                    else:
                        _store_tile(acc.astype(out_dtype), out_smem.at[wg], out_gmem, ctx, pieces)
                    for n, vec in rows_out.items():
                        _store_rows(vec, named_out[n], ctx)

                pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n), _F32))

            pipeline(mma_body, compute_context)(
                a_gmem.at[:, cta_rows] if transpose_a else a_gmem.at[cta_rows],
                b_gmem.at[cta_cols] if transpose_b else b_gmem.at[:, cta_cols],
                *[named_in[n].at[cta_rows] for n in fusion.side_inputs],
                allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # all stores have left shared memory before exit

    pl.run_scoped(scope, **scoped, collective_axes="wg")


def _store_tile(tile: jax.Array, slots, out_gmem, ctx: TileContext, pieces) -> None:
    """Stores a (tile_m, tile_n) register tile at the accumulator's place in out_gmem, piece by piece through two
    alternating SMEM slots (a slot is reused once the store issued two pieces earlier has read it)."""
    cfg = ctx.config
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for p, (i, j) in enumerate(pieces):
        slot = p % slots.shape[0]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        slots[slot] = tile[i * em:(i + 1) * em, j * en:(j + 1) * en]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(slots.at[slot],
                                out_gmem.at[pl.ds(ctx.row0 + i * em, em), pl.ds(ctx.col0 + j * en, en)])


def _store_rows(vec: jax.Array, out_gmem, ctx: TileContext) -> None:
    """Stores a (tile_m,) row vector straight from registers: into an (M,) output from the first column block
    only (every column block computes the same values), into a (C, M) output at row ctx.col_block."""
    if len(out_gmem.shape) == 1:
        @pl.when(ctx.col_block == 0)
        def _():
            out_gmem.at[ctx.rows][...] = vec.astype(out_gmem.dtype)
    else:
        out_gmem.at[ctx.col_block, ctx.rows][...] = vec.astype(out_gmem.dtype)
