"""One Mosaic-GPU kernel per token chunk: chunk c − 1's dw update beside chunk c's logits GEMM.

    logits, dw, lse = update_and_logits(h_prev, dl, h_next, w, dw)   # dw None: dw = h_prevᵀ·dl (the first)
        # h_prev, h_next (Bc, H) chunks c − 1 and c; dl (Bc, V) chunk c − 1's dlogits; w (H, V); dw (H, V)
        # -> logits (Bc, V) = h_next·w in h's dtype, written over dl's buffer; dw + h_prevᵀ·dl; lse (Bc,) float32
    unsupported_reason(Bc, H, V, dtype)   # None, or the sentence why these shapes cannot take it

Why one kernel: with short chunks (512 rows at 4096x2048x256000, the 5% memory rule) the dw update (K = Bc) moves
2.36 GB per chunk for 0.54 TFLOP and runs on bandwidth (1017 µs against its 803 µs byte floor; 667 µs of FLOPs at
805 TFLOP/s), while the logits GEMM, the same FLOPs, runs on the tensor cores (727 µs, reading 1.3 GB). In one
kernel the update's dw traffic could flow while the logits' wgmma run: 1334 µs of FLOPs and 3.7 GB (1250 µs) per
chunk, against 1745 µs for the two kernels.

Measured, it does not (H100, ``benchmarks/scripts/cross_entropy_fused_step.py``, cross_entropy_fused_step-h100-
fa22309.json): at 4096x2048x256000 (512-row chunks) 1962 µs against 1745 for the two kernels, its update tiles alone
1040 and its logits tiles alone 763 (the separate kernels 1020 and 725); at 8192x4096x128256 (1024 rows) 4137
against 3091. The kernel takes at least the sum of its parts. Our reading, not yet profiled: its two MMA
warpgroups alternate whole tiles (one K loop at a time), so a block pulls an update tile's operands and dw only as
fast as that one K loop runs, and the logits tiles between them add no concurrency; a layout where one warpgroup
runs update tiles while the other runs logits tiles (two rings) would test it. ``config.fused_step`` is therefore
off by default. Earlier layouts
were slower still (NOTES.md): each block owning whole units read w's columns from HBM once per logits tile (2944 µs)
and dl's once per update tile at 8192x4096x128256.

Layout. The vocabulary is cut into units of 128 columns (U = V / 128); unit v has H / 128 update tiles (128 rows of
dw, K = Bc: A = h_prevᵀ rows, B = dl[:, v]) and Bc / 128 logits tiles (128 rows of the chunk, K = H: A = h_next
rows, B = w[:, v]); every tile is 128 x 128. A block (one per SM, persistent) walks rounds: round j holds the update
tiles of units [j·grid, (j + 1)·grid) and the logits tiles of round j − 2's units, each kind spread so that
neighbouring blocks take one unit's row blocks at once (its B columns shared through L2), in groups of H / Bc update
tiles and one logits tile. A unit's logits tiles are stored over dl[:, v], which only that unit's update tiles read:
per-unit global semaphores make the logits tile of row block 0 wait (before its store only) for all the unit's
update tiles, and the unit's other logits tiles for it; two rounds of lag make those waits rare.

Warpgroups (ping-pong, as ``gemm.specialized``): 0 and 1 issue wgmma on alternate tiles of the block's sequence (one's
epilogue runs under the other's K loop), 2 issues the TMA loads into a ring of stages. ``ready`` has one barrier per
(owner, stage): a warpgroup waits only on its own steps' loads; ``consumed`` one per stage, arrived on by whichever
warpgroup read it and awaited by the memory warpgroup in ring order. Epilogues: an update tile adds the dw tile
prefetched at its start (none for the first chunk) and stores the sum from that SMEM buffer in place; a logits tile
stores the tile rounded to h's dtype and, per row, its max and Σ exp(z − max) over those rounded values (as
``mosaic_logits``), combined into the lse by XLA.

Needs an sm90 GPU (no interpret mode: the buffers are updated in place), 16-bit h, w and dw of one dtype, H, V and Bc
multiples of 128 and H a multiple of Bc.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import backends
from pallas_kernels import mosaic_utils as mu
from pallas_kernels.cross_entropy import mosaic_logits

__all__ = ["NUM_STAGES", "unsupported_reason", "update_and_logits"]

_F32 = jnp.float32
_TILE = 128  # rows and columns of every tile (one warpgroup's float32 accumulator)
_TILE_K = 64  # K per pipeline step
NUM_STAGES = 5  # ring of (128 x 64, 64 x 128) operand stages: 160 KiB, plus two 32 KiB epilogue buffers
_MEMORY_WG = 2
_MMA_REGISTERS, _MEMORY_REGISTERS = 232, 40
_UPDATE, _LOGITS = "update", "logits"
_LAG = 2  # rounds between a unit's update tiles and its logits tiles (which wait for them only before storing)
# The tile kinds a kernel runs: both. A measurement hook (benchmarks/scripts/cross_entropy_fused_step.py times each
# kind alone by patching it); with one kind the kernel's results are incomplete.
_PARTS = (_UPDATE, _LOGITS)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static sizes of one kernel: Bc, H, V and the tile counts and K steps they give."""

    Bc: int
    H: int
    V: int

    @property
    def units(self) -> int:  # 128-column blocks of the vocabulary
        return self.V // _TILE

    @property
    def update_tiles(self) -> int:  # per unit: row blocks of dw
        return self.H // _TILE

    @property
    def logits_tiles(self) -> int:  # per unit: row blocks of the chunk
        return self.Bc // _TILE

    @property
    def group(self) -> int:  # update tiles per logits tile in a round
        return self.H // self.Bc

    def k_steps(self, kind: str) -> int:
        return (self.Bc if kind == _UPDATE else self.H) // _TILE_K


def unsupported_reason(Bc: int, H: int, V: int, dtype) -> str | None:
    """None when chunks of Bc rows can run their dw update and the next chunk's logits in this kernel; else one
    sentence why not."""
    if mu.interpreting():
        return "the fused chunk step updates its buffers in place, which GPU interpret mode does not run"
    reason = backends.unavailable_reason("mosaic")
    if reason:
        return reason
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the fused chunk step takes 16-bit h, w and dw, got {jnp.dtype(dtype).name}"
    for name, size in (("chunk_rows", Bc), ("H", H), ("V", V)):
        if size <= 0 or size % _TILE:
            return f"{name}={size} is not a positive multiple of the fused chunk step's {_TILE}-row tiles"
    if H % Bc:
        return f"H={H} is not a multiple of chunk_rows={Bc} (the fused step's groups of update and logits tiles)"
    return None


def _walk(geom: _Geometry, sm, grid: int, tile):
    """Calls ``tile(kind, m, v, t, g)`` for the block's tiles in order (kind, row block m, unit v, the tile's index t
    in the block's sequence, the ring position g of its first K step); returns (tiles, K steps) of the block.

    Round j covers the update tiles of units [j·grid, (j + 1)·grid) and the logits tiles of round j − _LAG's units,
    each kind's tiles numbered τ = unit·n + row block (n of them per unit) within its round; the block's i-th tile of
    a kind is τ = i·grid + sm, so neighbouring blocks take the row blocks of one unit at once and share its B
    columns (dl[:, v], w[:, v]) through L2. The block's update tiles run in groups of ``group``, each followed by one
    logits tile."""
    n_d, n_l, q = geom.update_tiles, geom.logits_tiles, geom.group
    k_d, k_l = geom.k_steps(_UPDATE), geom.k_steps(_LOGITS)
    rounds = pl.cdiv(geom.units, grid)

    def one_round(j, carry):
        def group(i, carry):
            def update(r, carry):
                t, g = carry
                tau = (i * q + r) * grid + sm
                v = j * grid + lax.div(tau, n_d)
                present = (j < rounds) & (v < geom.units) & (_UPDATE in _PARTS)

                @pl.when(present)
                def _update():
                    tile(_UPDATE, lax.rem(tau, n_d), v, t, g)

                p = present.astype(jnp.int32)
                return t + p, g + k_d * p

            t, g = lax.fori_loop(0, q, update, carry)
            tau = i * grid + sm
            v = (j - _LAG) * grid + lax.div(tau, n_l)
            present = (j >= _LAG) & (v < geom.units) & (_LOGITS in _PARTS)

            @pl.when(present)
            def _logits():
                tile(_LOGITS, lax.rem(tau, n_l), v, t, g)

            p = present.astype(jnp.int32)
            return t + p, g + k_l * p

        return lax.fori_loop(0, n_l, group, carry)

    return lax.fori_loop(0, rounds + _LAG, one_round, (jnp.int32(0), jnp.int32(0)))


def _kernel(h_t, h_next, w, chunk, *refs, geom: _Geometry, grid: int, accumulate: bool):
    """The kernel body. refs: (dw, block_max, block_sumexp) with dw an in-place buffer when ``accumulate``, an
    output otherwise (the order is the same)."""
    dw, block_max, block_sumexp = refs
    dtype = h_t.dtype
    stages = NUM_STAGES
    operand_transforms = mu.smem_transforms(_TILE_K, dtype)
    sources = {_UPDATE: (h_t, chunk), _LOGITS: (h_next, w)}
    scoped_types = dict(
        a_stages=plgpu.SMEM((stages, _TILE, _TILE_K), dtype, transforms=operand_transforms),
        b_stages=plgpu.SMEM((stages, _TILE_K, _TILE), dtype, transforms=operand_transforms),
        tiles=plgpu.SMEM((2, _TILE, _TILE), dtype, transforms=mu.smem_transforms(_TILE, dtype)),
        tile_loaded=plgpu.Barrier(num_barriers=2),
        ready=plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=stages))

    def scope(a_stages, b_stages, tiles, tile_loaded, ready, consumed):
        wg = lax.axis_index("wg")
        sm = lax.axis_index("sm")
        # Per unit v: updated[v] gets 1 from each update tile once its wgmma (so its loads of dl[:, v]) are done;
        # the unit's logits tile of row block 0 takes all H / 128 before it stores over dl[:, v], then gives
        # Bc / 128 − 1 to gate[v], from which each other logits tile of the unit takes 1 (both 0 again at exit).
        updated = pl.get_global(plgpu.SemaphoreType.REGULAR((geom.units,)))
        gate = pl.get_global(plgpu.SemaphoreType.REGULAR((geom.units,)))

        def wait_for_updates(m, v):
            @pl.when(m == 0)
            def _first():
                plgpu.semaphore_wait(updated.at[v], geom.update_tiles, memory_scope="gpu")
                plgpu.semaphore_signal(gate.at[v], geom.logits_tiles - 1, memory_scope="gpu")

            @pl.when(m != 0)
            def _others():
                plgpu.semaphore_wait(gate.at[v], 1, memory_scope="gpu")

        @pl.when(wg == _MEMORY_WG)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

            def loads(kind, m, v, t, g):
                a_ref, b_ref = sources[kind]
                a_rows, b_cols = a_ref.at[pl.ds(m * _TILE, _TILE)], b_ref.at[:, pl.ds(v * _TILE, _TILE)]
                owner = lax.rem(t, 2)

                def step(k, carry):
                    gk = g + k
                    slot = lax.rem(gk, stages)

                    @pl.when(gk >= stages)
                    def _wait_free():
                        plgpu.barrier_wait(consumed.at[slot])

                    ks = pl.ds(k * _TILE_K, _TILE_K)
                    plgpu.copy_gmem_to_smem(a_rows.at[:, ks], a_stages.at[slot], ready.at[owner * stages + slot])
                    plgpu.copy_gmem_to_smem(b_cols.at[ks], b_stages.at[slot], ready.at[owner * stages + slot])
                    return carry

                lax.fori_loop(0, geom.k_steps(kind), step, ())

            _, total = _walk(geom, sm, grid, loads)  # the block's K steps: the last `stages` releases are awaited
            for j in range(stages):
                @pl.when(total - stages + j >= 0)
                def _drain():
                    plgpu.barrier_wait(consumed.at[lax.rem(total - stages + j, stages)])

        @pl.when(wg < 2)
        def _mma():
            plgpu.set_max_registers(_MMA_REGISTERS, action="increase")
            buffer = tiles.at[wg]

            def run(kind, m, v, t, g):
                rows, cols = pl.ds(m * _TILE, _TILE), pl.ds(v * _TILE, _TILE)
                if kind == _UPDATE and accumulate:  # prefetch the dw tile once the last store left the buffer
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.copy_gmem_to_smem(dw.at[rows, cols], buffer, tile_loaded.at[wg])
                k_steps = geom.k_steps(kind)

                def acc_scope(acc_ref):
                    def step(k, carry):  # one wgmma group in flight: release the step before this one
                        gk = g + k
                        slot = lax.rem(gk, stages)
                        plgpu.barrier_wait(ready.at[wg * stages + slot])
                        plgpu.wgmma(acc_ref, a_stages.at[slot], b_stages.at[slot])
                        plgpu.wgmma_wait(1)

                        @pl.when(k >= 1)
                        def _release_previous():
                            plgpu.barrier_arrive(consumed.at[lax.rem(gk - 1, stages)])

                        return carry

                    lax.fori_loop(0, k_steps, step, ())
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[lax.rem(g + k_steps - 1, stages)])
                    if kind == _UPDATE and _LOGITS in _PARTS:  # its loads of dl[:, v] have landed
                        plgpu.semaphore_signal(updated.at[v], 1, memory_scope="gpu")
                    acc = acc_ref[...]
                    if kind == _UPDATE:
                        if accumulate:
                            plgpu.barrier_wait(tile_loaded.at[wg])
                            acc = acc + mu.load(buffer, layout=mu.TILE).astype(_F32)
                        else:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_tile, out = acc.astype(dtype), dw.at[rows, cols]
                    else:
                        z, tile_max, tile_sumexp = mosaic_logits.tile_statistics(acc, dtype)
                        if _UPDATE in _PARTS:  # the unit's update tiles (_LAG rounds ago) have read dl[:, v]
                            wait_for_updates(m, v)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_tile, out = z.astype(dtype), chunk.at[rows, cols]
                        block_max.at[v, rows][...] = tile_max
                        block_sumexp.at[v, rows][...] = tile_sumexp
                    buffer[...] = out_tile
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buffer, out)

                pl.run_scoped(acc_scope, plgpu.ACC((_TILE, _TILE), _F32))

            def owned(kind, m, v, t, g):
                @pl.when(lax.rem(t, 2) == wg)
                def _own():
                    run(kind, m, v, t, g)

            _walk(geom, sm, grid, owned)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # all stores have left shared memory before exit

    pl.run_scoped(scope, **scoped_types, collective_axes="wg")


def update_and_logits(h_prev: jax.Array, dl: jax.Array, h_next: jax.Array, w: jax.Array,
                      dw: jax.Array | None = None, *, num_sms: int | None = None):
    """(logits (Bc, V) over dl's buffer, dw + h_prevᵀ·dl (or h_prevᵀ·dl when dw is None) (H, V), lse (Bc,)
    float32 of the logits rounded to h's dtype) in one kernel; ValueError (naming the constraint) where
    ``unsupported_reason`` says no or the arrays do not match."""
    (Bc, H), V = h_prev.shape, w.shape[1]
    expected = {"h_prev": (h_prev, (Bc, H)), "dl": (dl, (Bc, V)), "h_next": (h_next, (Bc, H)), "w": (w, (H, V))}
    if dw is not None:
        expected["dw"] = (dw, (H, V))
    for name, (array, shape) in expected.items():
        if tuple(array.shape) != shape or array.dtype != h_prev.dtype:
            raise ValueError(f"update_and_logits: {name} must be {shape} {h_prev.dtype}, got {tuple(array.shape)} "
                             f"{array.dtype}")
    reason = unsupported_reason(Bc, H, V, h_prev.dtype)
    if reason:
        raise ValueError(f"linear_cross_entropy fused chunk step: {reason}")
    geom = _Geometry(Bc, H, V)
    stats = jax.ShapeDtypeStruct((geom.units, Bc), _F32)
    grid = num_sms or mu.num_sms()
    launch = dict(grid=(grid,), grid_names=("sm",), num_threads=3, thread_name="wg",
                  name="linear_cross_entropy_update_and_logits", semantics="lane")
    body = functools.partial(_kernel, geom=geom, grid=grid, accumulate=dw is not None)
    h_t = h_prev.T  # (H, Bc): the update tiles' A rows, K-contiguous like h_next's (2·H·Bc bytes, one XLA copy)
    if dw is None:  # refs (h_t, h_next, w, chunk, dw, ...) in both: the buffer, then the outputs
        (new_dw, maxes, sums), logits = mu.kernel_updating(
            body, out_type=[jax.ShapeDtypeStruct((H, V), h_prev.dtype), stats, stats], **launch)(h_t, h_next, w, dl)
    else:
        (maxes, sums), (logits, new_dw) = mu.kernel_updating(body, out_type=[stats, stats], buffers=2, **launch)(
            h_t, h_next, w, dl, dw)
    return logits, new_dw, mosaic_logits.lse_from_blocks(maxes, sums)
