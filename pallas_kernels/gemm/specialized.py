"""Our own warp-specialized K loop for the GEMM core (``MosaicGemmConfig.pipeline == "own"``).

Warpgroups of a block (``wg``): 0 and 1 issue wgmma (MMA), 2 issues the TMA loads (memory) and, when the fusion
has a ``Fusion.prologue_step``, 3 runs the prologue on each stage (prologue; with ``prologue_in="memory"`` the
memory warpgroup runs it instead, below). Every warpgroup walks the same
persistent sequence of CTA tiles (planar snake, ``_Shape.tile_context``); the global step g = local tile index ·
k_iters + k of a warpgroup uses stage g % S of S pipeline stages in shared memory.

  memory    per step: wait ``consumed[s]`` (from the second round of the stages on), TMA-load the step's A and B
            blocks into stage s, signalling ``ready[s]``. It never waits for a tile to end: the next tile's first
            blocks load as soon as the current tile's last stages are released. With ``tile_input_in="ring"`` each
            tile takes two more ring positions after its K steps: the MMA warpgroups' halves of the epilogue's tile
            input, loaded into those B stages (a second view of them where B is read transposed), which the MMA
            warpgroups release once the output stored from them has left. With ``Fusion.a_beside`` a stage holds a
            third block beside A's, loaded for the tiles that run the a_observe; the others' stages get a plain
            arrival in its place (and so do the ring input's positions), so ``ready`` always counts three.
            With ``MosaicGemmConfig.memory_warps`` 1 only its first warp runs this (``loading_warps``: tile by
            tile, each tile's coordinates computed by all four beforehand, then the stream-K phase), its 32 threads
            arriving for the warpgroup's 128; the other three warps skip it.
  MMA       per tile: prefetch the epilogue's tile inputs; per step: wait ``ready[s]``, issue wgmma (both operands
            from shared memory), with a ``Fusion.a_observe`` load its rows of the A block into registers and run
            it (under the wgmma just issued; a ``Fusion.a_copy`` likewise, on the steps its column block writes),
            ``wgmma_wait(delay_release)``, arrive on ``consumed`` of the step whose wgmma is complete
            (delay_release steps back); then the epilogue (``_Shape.finish_tile``), with the prologue warpgroup's
            carry from ``handoff`` when there is one. With ``epilogue_store="next_tile"`` the output tile stays in
            registers, carried by the tile loop into the next tile, whose first step runs before its K loop and
            stores it right after issuing its wgmma; the block's last whole tile is stored after the loop.
  prologue  per tile: ``prologue_init``; per step: wait ``ready[s]``, ``prologue_step`` on the stage's A block,
            arrive on ``consumed[s]``; then writes its carry, ``Fusion.handoff_rows`` (tile_m,) float32 row
            vectors, into ``handoff`` and arrives on ``handoff_full``; the MMA warpgroups wait for it only before
            their epilogue and arrive on ``handoff_free`` after it, which the prologue awaits before it writes the
            next tile's (one slot: the next tile's prologue ends with that tile's K loop, long after).
  memory + prologue (``prologue_in="memory"``, ``loads_with_prologue``): per step g, after loading g, wait
            ``ready`` of step g - (S - 1) and run the prologue on it, then arrive on its ``consumed``: the slot it
            refills next, so its own arrival is never what it waits for. A tile's first S - 1 loads run the
            previous tile's last steps; after the last tile, its last ones. The carry goes to ``handoff`` as
            above. Measured on the H100 at 32768x4096x4096 (``gemm_prologue_cost-h100-cd21120.json``): the
            protocol is free (1409.5 against 1406.7 µs with a prologue passing its carry on), but the work is on
            the loads' critical path: row sums of each 128x64 A block took 1722.9 µs (1636.9 with 104 registers
            there), where a fourth warpgroup beside 128x128 accumulators took 1477.8 against their plain 1415.4.
``consumed[s]`` counts one arrival per consumer warpgroup (2, or 3 with the prologue): a stage is refilled only
when every consumer has read it. With ``MosaicGemmConfig.cluster``, the two blocks of a cluster walk tile pairs in
step; the shared operand's copy is a TMA multicast (each memory warpgroup loads half of the tile into both blocks'
stage), so ``consumed`` is a cluster barrier: every consumer arrives on it in both blocks, and a memory warpgroup
refills a stage only once both blocks have read it.

Schedule "pingpong" (``MosaicGemmConfig.schedule``): the block's local tiles alternate between the MMA warpgroups
(tile i to warpgroup i % 2, each with a whole (tile_m, tile_n) CTA tile), so one warpgroup's epilogue runs while
the other's K loop keeps the tensor cores busy. The stages stay one ring in load order, but each owner has its
own ``ready`` and ``consumed`` barriers (index owner · S + s): a warpgroup waits only on the barriers of its own
steps, so Mosaic's per-thread barrier phases stay in step with the completions it skips; the memory warpgroup
waits on the barrier of the slot's previous owner. ``consumed`` then counts one arrival.

Stream-K (``MosaicGemmConfig.stream_k``, a ``gemm.stream_k`` plan; cooperative schedule, no cluster, no
prologue warpgroup): the tile loop above covers the whole rounds only; then every warpgroup walks the block's range
of K steps of the last round's tiles (``StreamKPlan.unit_range``), the memory warpgroup step by step at the same
ring positions, the MMA warpgroups segment by segment (``StreamKPlan.segment``): a segment starting mid-tile stores
its float32 accumulator (and its ``Fusion.a_observe`` carry, ``Fusion.carry_shapes``) into the workspace outputs
(rows of this unit and warpgroup) and signals a global semaphore; a tile's first segment, after its K loop, waits
for the semaphores of the units holding the rest, adds their partial sums and runs the epilogue. With a ring input
the memory warpgroup walks the range segment by segment, loading an owned segment's tile input into the two ring
positions after its steps (``StreamKPlan.segment_offset``), where the owner's epilogue reads it. The memory
warpgroup drains ``consumed`` after both phases.

Registers per thread (setmaxnreg within the launch's allocation, ``registers``): memory 40, MMA ``mma_registers``
(default 232 with three warpgroups, 208 with four), the prologue warpgroup the rest (56); with the prologue in the
memory warpgroup, MMA 216 and memory 72.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_utils as mu
from pallas_kernels.gemm.config import operand_swizzle_elems

__all__ = ["kernel_body", "num_threads", "registers"]

_F32 = jnp.float32
_MEMORY_REGISTERS = 40
_MEMORY_PROLOGUE_REGISTERS = 56  # the memory warpgroup that also runs a prologue (a 128x64 block in registers)
_MEMORY_WG, _PROLOGUE_WG = 2, 3
_EPILOGUE_WG = 3  # (MosaicGemmConfig.epilogue_in "fourth"; no prologue warpgroup then)


def dedicated(shape) -> bool:
    """Whether the kernel runs a prologue in a fourth warpgroup (a prologue_step, ``prologue_in="fourth"``)."""
    return shape.fusion.prologue_step is not None and shape.cfg.prologue_in == "fourth"


def in_memory(shape) -> bool:
    """Whether the memory warpgroup runs the prologue between its loads (``prologue_in="memory"``)."""
    return shape.fusion.prologue_step is not None and shape.cfg.prologue_in == "memory"


def epilogue_apart(shape) -> bool:
    """Whether a fourth warpgroup runs the epilogue (``MosaicGemmConfig.epilogue_in="fourth"``)."""
    return shape.cfg.epilogue_in == "fourth"


def num_threads(shape) -> int:
    """Warpgroups of one block: 3, or 4 with a dedicated prologue or epilogue warpgroup."""
    return 4 if dedicated(shape) or epilogue_apart(shape) else 3


def registers(shape) -> tuple[int, int, int]:
    """(MMA, memory, fourth warpgroup: the prologue or the epilogue one, else 0) registers per thread. setmaxnreg
    only moves registers within the block's launch allocation, 65536 / threads per thread rounded down to 8 (168
    with three warpgroups, 128 with four): an increase the decreases do not cover waits forever. So they add up
    to 504 per lane across three warpgroups and 512 across four; the memory warpgroup running the prologue takes
    what the MMA warpgroups leave (72). The MMA warpgroups' count is an increase from the launch's and the others'
    decreases (a count on the wrong side of the launch's faults with an illegal instruction: measured on the H200
    with mma_registers=168 beside the epilogue warpgroup, NOTES.md fifty-second session), so a split that needs
    otherwise raises."""
    launch = 168 if num_threads(shape) == 3 else 128
    if epilogue_apart(shape):  # (MMA, memory, epilogue): the MMA warpgroups only hold the accumulator now
        mma = shape.cfg.mma_registers or 184
        split = mma, _MEMORY_REGISTERS, 512 - 2 * mma - _MEMORY_REGISTERS
    else:
        mma = shape.cfg.mma_registers or (208 if dedicated(shape) else 216 if in_memory(shape) else 232)
        memory = 504 - 2 * mma if in_memory(shape) else _MEMORY_REGISTERS
        split = mma, memory, 512 - 2 * mma - _MEMORY_REGISTERS if dedicated(shape) else 0
        if in_memory(shape) and memory < _MEMORY_PROLOGUE_REGISTERS:
            raise ValueError(f"mma_registers={mma} leaves the memory warpgroup running the prologue {memory} "
                             f"registers (needs >= {_MEMORY_PROLOGUE_REGISTERS}: mma_registers <= "
                             f"{(504 - _MEMORY_PROLOGUE_REGISTERS) // 2})")
    fourth = split[2]
    if (dedicated(shape) or epilogue_apart(shape)) and fourth < 24:
        role = "epilogue" if epilogue_apart(shape) else "prologue"
        raise ValueError(f"mma_registers={mma} leaves the {role} warpgroup {fourth} registers (needs >= 24)")
    # (with a fourth warpgroup its count, 512 - 2 * mma - 40, must not exceed the launch's: mma >= 176)
    lowest = max(launch, -(-(512 - _MEMORY_REGISTERS - launch) // 16) * 8) if fourth else launch
    if mma < lowest:
        raise ValueError(f"mma_registers={mma} is below what setmaxnreg can give this kernel's MMA warpgroups: "
                         f"{num_threads(shape)} warpgroups launch with {launch} registers a thread, which "
                         f"the MMA warpgroups can only raise and the others only lower (memory {split[1]}"
                         f"{f', fourth {fourth}' if fourth else ''}); allowed: mma_registers >= {lowest}")
    return split


def _consumed_barrier(shape, *, num_arrivals: int, num_barriers: int):
    """The barriers a consumer arrives on once it has read a stage: a cluster barrier when the stage also receives
    the other block's multicast (its memory warpgroup must wait for this block's consumers too)."""
    axes = shape.multicast(0) or shape.multicast(1)
    if not axes:
        return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=num_barriers)
    return plgpu.ClusterBarrier(collective_axes=axes, num_arrivals=num_arrivals, num_barriers=num_barriers)


def kernel_body(a_gmem, b_gmem, *refs, shape):
    """The kernel (``plgpu.kernel`` body) of one fused GEMM, ``shape`` a ``gemm.mosaic._Shape``."""
    cfg, fusion = shape.cfg, shape.fusion
    named_in, out_gmem, named_out = shape.split_refs(refs)
    k_iters = shape.iters[2]
    num_stages = min(cfg.num_stages, k_iters)
    ring_input = shape.ring_input  # (MosaicGemmConfig.tile_input_in "ring") the tile input loaded into B stages
    tile_steps = k_iters + (2 if ring_input else 0)  # ring positions per tile: its K steps, then its input's halves
    has_prologue_wg = dedicated(shape)
    prologue_in_memory = in_memory(shape)
    has_handoff = fusion.prologue_step is not None  # the prologue's carry reaches the epilogue through SMEM
    mma_registers, memory_registers, fourth_registers = registers(shape)
    blocks = shape.operand_blocks()
    gmem = (a_gmem, b_gmem)
    transforms = shape.stage_transforms
    owners = 2 if cfg.pingpong else 1  # sets of barriers: one per warpgroup owning whole tiles
    beside = named_in[fusion.a_beside] if fusion.a_beside else None  # (Fusion.a_beside) loaded beside A
    stage_refs = (*gmem, beside) if beside is not None else gmem  # one stage buffer each
    stage_types = [plgpu.SMEM((num_stages, *block), ref.dtype, transforms=transforms)
                   for ref, (block, _, _) in zip(stage_refs, [*blocks, blocks[0]])]
    stage_types[0] = shape.untiled_union(stage_types[0])  # (at M not a multiple of 8, A loads through a second view)
    ring_view = ring_input is not None and shape.transposes[1]  # the B stages hold (cta_n, tile_k) blocks: the
    if ring_view:  # ring input's (tile_k, cta_n) halves go into a second view of the same memory
        stage_types[1] = plgpu.RefUnion(stage_types[1], plgpu.SMEM(
            (num_stages, cfg.tile_k, cfg.cta_n), b_gmem.dtype,
            transforms=mu.smem_transforms(operand_swizzle_elems(cfg, b_gmem.dtype), b_gmem.dtype)))
    scoped_types = dict(
        stages=stage_types,
        ready=plgpu.Barrier(num_arrivals=len(stage_refs) + len(fusion.step_inputs), num_barriers=owners * num_stages),
        consumed=_consumed_barrier(shape, num_arrivals=1 if cfg.pingpong else 2 + has_handoff,
                                   num_barriers=owners * num_stages),
        **shape.scratch_types())
    if has_handoff:
        scoped_types.update(handoff=plgpu.SMEM((fusion.handoff_rows, cfg.cta_m), _F32),
                            handoff_full=plgpu.Barrier(num_arrivals=1), handoff_free=plgpu.Barrier(num_arrivals=2))
    apart = epilogue_apart(shape)
    if apart:  # the MMA warpgroups' accumulators, handed to the epilogue warpgroup
        scoped_types.update(u_smem=plgpu.SMEM((2, cfg.tile_m, cfg.tile_n), shape.out_dtype,  # (swizzled by the
                                              transforms=mu.smem_transforms(cfg.epi_tile_n, shape.out_dtype)),  # slice)
                            u_full=plgpu.Barrier(num_arrivals=2), u_free=plgpu.Barrier(num_arrivals=1))

    plan = shape.stream_k  # None: every tile whole, round after round
    round_tiles = shape.cluster_tiles if plan is None else plan.dp_tiles  # tiles run whole by the tile loop

    def scope(stages, ready, consumed, handoff=None, handoff_full=None, handoff_free=None, u_smem=None, u_full=None,
              u_free=None, **scoped):
        wg = lax.axis_index("wg")
        stages = list(stages)
        a_loads = stages[0]  # the view TMA loads A's blocks into
        if shape.untiled_rows:
            stages[0], a_loads = stages[0]
        if ring_view:  # (a ring slot holds a B block or a ring input's half, never both at once)
            stages[1], ring_stages = stages[1]
        else:
            ring_stages = stages[1]
        refs_by_name = {**named_in, **named_out, **scoped["scratch"]}
        if fusion.sum_rows is not None:  # one count per accumulator row group (gemm.mosaic._sum_row_parts)
            scoped["row_semaphores"] = pl.get_global(plgpu.SemaphoreType.REGULAR((-(-shape.mnk[0] // cfg.tile_m),)))
        carry_tree = []  # the prologue warpgroup's carry structure (traced before the MMA warpgroups' code)

        def each_tile(body):
            if round_tiles == 0:
                return

            @plgpu.nd_loop((round_tiles,), collective_axes="sm")
            def _tile_loop(loop_info):
                body(loop_info.index[0], loop_info.local_index, loop_info.num_local_steps)

        sharing = fusion.share_rows is not None  # (Fusion.share_rows) one tile per row block takes the a_observe

        def observes(ctx):
            """Whether the tile at ctx runs the a_observe (with share_rows, a row block's first tile; in interpret
            mode every tile): its steps take the a_beside block."""
            return (ctx.n_idx == 0) if sharing and not mu.interpreting() else True

        def load_beside(ctx, ks, slot, barrier):
            """(Fusion.a_beside) The step's block of the beside input into its stage, or where the tile does not
            observe, the arrival that copy would have made."""
            take = observes(ctx)

            @pl.when(take)
            def _copy():
                plgpu.copy_gmem_to_smem(blocks[0][2](beside, ctx.m_idx, ctx.n_idx).at[:, ks], stages[2].at[slot],
                                        barrier)

            @pl.when(jnp.logical_not(take))
            def _arrive():
                plgpu.barrier_arrive(barrier)

        if sharing and not mu.interpreting():  # (row block, warpgroup): its row vector is stored
            row_semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((shape.iters[0] * 2,)))
        if plan is not None:
            unit = lax.axis_index("sm")  # the block's stream-K unit
            sk_start, sk_end = plan.unit_range(unit)
            sk_steps = jnp.where(unit < plan.units, sk_end - sk_start, 0)  # this block's stream-K steps
            sk_g0 = plan.dp_rounds * k_iters - sk_start  # ring position of stream-K step s: sk_g0 + s (no ring input)
            sk_positions = (jnp.where(unit < plan.units, plan.unit_positions(unit, 2), 0) if ring_input
                            else sk_steps)  # the block's ring positions in the stream-K phase
            semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR((plan.units * 2,)))  # (unit, wg): partial ready
            workspace = shape.workspace(refs)
            carry_workspaces = shape.carry_workspaces(refs)

        def sk_position(j, t, k0):
            """The ring position of the first step of the block's j-th stream-K segment (steps [k0, ...) of stream-K
            tile t): after the whole rounds' positions; with a ring input, two more after each earlier owned
            segment's steps (``StreamKPlan.segment_offset``)."""
            if not ring_input:
                return sk_g0 + t * k_iters + k0
            return plan.dp_rounds * tile_steps + plan.segment_offset(unit, j, 2)

        def drain(barrier, local, num_local, uses_per_tile, num_slots, slot_of_use=None):
            """In the block's last tile: wait for the last completions of ``barrier`` that no later wait observes
            (the last num_slots uses), so that no barrier is left mid-phase at exit. ``slot_of_use``: the index of
            a use's barrier in ``barrier``, None where it is one barrier (a ring of one stage may still index one
            of the ping-pong owners' barriers)."""
            @pl.when(local == num_local - 1)
            def _drain():
                total = num_local * uses_per_tile
                for j in range(num_slots):
                    @pl.when(total - num_slots + j >= 0)
                    def _wait():
                        plgpu.barrier_wait(barrier if slot_of_use is None else
                                           barrier.at[slot_of_use(total - num_slots + j)])

        def drain_consumed(total):
            """After the memory warpgroup's last load of the block's ``total`` steps: wait for the completions of
            ``consumed`` that no load waited for (the last num_stages steps'), so none is left mid-phase at exit."""
            for j in range(num_stages):
                @pl.when(total - num_stages + j >= 0)
                def _drain():
                    plgpu.barrier_wait(consumed.at[barrier_of(total - num_stages + j)])

        def slot_of(local, k):
            return lax.rem(local * k_iters + k, num_stages)

        def owner_of(local):
            """The MMA warpgroup computing the block's local-th tile (always 0 when both share each tile)."""
            return lax.rem(local, 2) if cfg.pingpong else 0

        def barrier_of(step):
            """Index into ``ready`` / ``consumed`` of the block's step-th step (step = local · k_iters + k)."""
            return owner_of(lax.div(step, k_iters)) * num_stages + lax.rem(step, num_stages)

        def prologue_on(lin, local, k, carry, valid):
            """(``prologue_in="memory"``) The prologue on the A block of step k of the block's local-th tile, its
            carry handed to the MMA warpgroups after the tile's last step. Not ``valid`` (a step before the block's
            first): computed on whatever the slot holds, discarded, no barrier touched. Returns the carry."""
            g = local * k_iters + k
            slot = lax.rem(g + num_stages, num_stages)  # g >= 1 - num_stages
            ctx = dataclasses.replace(shape.tile_context(lin, 0, refs_by_name), step=k)

            @pl.when(valid)
            def _wait_loaded():
                plgpu.barrier_wait(ready.at[slot])

            init = fusion.prologue_init(ctx) if fusion.prologue_init is not None else ()
            start = jax.tree.map(lambda c, z: jnp.where(k == 0, z, c), carry, init)
            new = fusion.prologue_step(ctx, stages[0].at[slot], start)

            @pl.when(valid)
            def _release():
                plgpu.barrier_arrive(consumed.at[slot])

            @pl.when(valid & (k == k_iters - 1))
            def _hand_off():
                @pl.when(local >= 1)
                def _wait_read():  # the MMA warpgroups have read the previous tile's carry
                    plgpu.barrier_wait(handoff_free)

                for i, vec in enumerate(jax.tree.leaves(new)):
                    handoff.at[i][...] = vec.astype(_F32)
                plgpu.barrier_arrive(handoff_full)

            return jax.tree.map(lambda n, c: jnp.where(valid, n, c), new, carry)

        def loads_with_prologue(load_step):
            """The memory warpgroup's loop with the prologue: per step g, load g, then run the prologue on step
            g - (num_stages - 1), the oldest loaded step whose slot it refills next (the previous tile's at a tile's
            start); after the last tile, its last steps and the drains."""
            lag = num_stages - 1
            carry0 = fusion.prologue_init(shape.tile_context(0, 0, refs_by_name)) if fusion.prologue_init else ()
            leaves, tree = jax.tree.flatten(carry0)
            if len(leaves) != fusion.handoff_rows or any(v.shape != (cfg.cta_m,) for v in leaves):
                raise ValueError(f"Fusion.handoff_rows={fusion.handoff_rows}: the prologue's carry must hold that "
                                 f"many ({cfg.cta_m},) row vectors, got {[v.shape for v in leaves]}")
            carry_tree[:] = [tree]

            def tile(loop_info, carry):
                lin, local = loop_info.index[0], loop_info.local_index
                prev_lin, _, hook_carry = carry

                def step(k, hook_carry):
                    load_step(lin, k, local * k_iters + k)
                    behind = k < lag  # the step lag loads back belongs to the previous tile
                    return prologue_on(jnp.where(behind, prev_lin, lin), jnp.where(behind, local - 1, local),
                                       jnp.where(behind, k - lag + k_iters, k - lag), hook_carry,
                                       local * k_iters + k >= lag)

                return lin, local + 1, lax.fori_loop(0, k_iters, step, hook_carry)

            last_lin, num_local, hook_carry = plgpu.nd_loop(
                (round_tiles,), collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0), carry0))(tile)
            for d in range(lag):  # the last tile's last steps
                hook_carry = prologue_on(last_lin, num_local - 1, k_iters - lag + d, hook_carry, num_local >= 1)
            drain_consumed(num_local * k_iters)

            @pl.when(num_local >= 1)
            def _drain_handoff():
                plgpu.barrier_wait(handoff_free)

        def loading_warps(body):
            """Runs body() (loads and waits, no axis index) in the memory warpgroup's warps that issue its loads: all
            four, or with ``MosaicGemmConfig.memory_warps`` 1 the first only (its threads arrive for the four), the
            others skipping it."""
            if cfg.memory_warps == 4 or mu.interpreting():
                body()
                return

            @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
            def _per_warp():
                pl.when(lax.axis_index("warp") == 0)(body)

        def memory_loads():
            """The memory warpgroup's loads, tile by tile, then the stream-K phase's."""
            def load_step(lin, k, g, ctx=None):
                """TMA-loads step k of tile lin into the ring at position g, once its previous use is consumed.
                ``ctx``: the tile's context (``_Shape.tile_context``), where the caller has it."""
                ctx = shape.tile_context(lin, 0, refs_by_name) if ctx is None else ctx

                @pl.when(g >= num_stages)
                def _wait_free():  # the slot's previous step has been consumed (by its owner)
                    plgpu.barrier_wait(consumed.at[barrier_of(g - num_stages)])

                ks = pl.ds((ctx.k_part * k_iters + k) * cfg.tile_k, cfg.tile_k)  # (k_parts: the part's range)
                for operand, (ref, smem, (_, k_axis, cta)) in enumerate(zip(gmem, (a_loads, stages[1]), blocks)):
                    ref = cta(ref, ctx.m_idx, ctx.n_idx)
                    plgpu.copy_gmem_to_smem(ref.at[ks] if k_axis == 0 else ref.at[:, ks],
                                            smem.at[lax.rem(g, num_stages)], ready.at[barrier_of(g)],
                                            collective_axes=shape.multicast(operand))
                for n in fusion.step_inputs:  # the step's slice of each (K,) vector, for the a_operand
                    plgpu.copy_gmem_to_smem(named_in[n].at[ks], scoped["step_smem"][n].at[lax.rem(g, num_stages)],
                                            ready.at[barrier_of(g)])
                if beside is not None:
                    load_beside(ctx, ks, lax.rem(g, num_stages), ready.at[barrier_of(g)])

            if prologue_in_memory:
                loads_with_prologue(load_step)
                return

            def load_tile_input(lin, g, wg_half, ctx=None):
                """(tile_input_in "ring") TMA-loads compute warpgroup wg_half's (tile_m, tile_n) tile of the tile
                input into the B stage at ring position g, in two halves: the two arrivals ``ready`` counts."""
                ctx = shape.tile_context(lin, wg_half, refs_by_name) if ctx is None else ctx

                @pl.when(g >= num_stages)
                def _wait_free():
                    plgpu.barrier_wait(consumed.at[barrier_of(g - num_stages)])

                half = cfg.tile_m // 2
                for h in range(2):
                    plgpu.copy_gmem_to_smem(
                        named_in[ring_input].at[pl.ds(ctx.row0 + h * half, half), ctx.cols],
                        ring_stages.at[lax.rem(g, num_stages)].at[pl.ds(h * half, half)], ready.at[barrier_of(g)])
                if beside is not None:  # the third arrival the stage's barrier counts
                    plgpu.barrier_arrive(ready.at[barrier_of(g)])

            @each_tile
            def _(lin, local, num_local):
                ctxs = [shape.tile_context(lin, h, refs_by_name) for h in range(2 if ring_input else 1)]

                @loading_warps
                def _tile():
                    g0 = local * tile_steps
                    lax.fori_loop(0, k_iters, lambda k, c: (load_step(lin, k, g0 + k, ctxs[0]), c)[1], ())
                    if ring_input:
                        for wg_half in range(2):
                            load_tile_input(lin, g0 + k_iters + wg_half, wg_half, ctxs[wg_half])
                    if plan is None:
                        drain(consumed, local, num_local, tile_steps, num_stages, barrier_of)

            if plan is not None:
                def stream_k_loads():
                    if not ring_input:
                        def step(s, c):
                            load_step(plan.dp_tiles + lax.div(s, k_iters), lax.rem(s, k_iters), sk_g0 + s)
                            return c

                        lax.fori_loop(sk_start, sk_end, step, ())
                        return

                    def segment(j, c):  # its steps, then (an owned segment) the tile input's halves
                        t, k0, k1 = plan.segment(unit, j)
                        lin, g0 = plan.dp_tiles + t, sk_position(j, t, k0)
                        lax.fori_loop(k0, k1, lambda k, c: (load_step(lin, k, g0 + k - k0), c)[1], ())

                        @pl.when(k0 == 0)
                        def _tile_input():
                            for wg_half in range(2):
                                load_tile_input(lin, g0 + k1 - k0 + wg_half, wg_half)

                        return c

                    lax.fori_loop(0, plan.num_segments(unit), segment, ())

                def stream_k_phase():
                    pl.when(unit < plan.units)(stream_k_loads)
                    drain_consumed(plan.dp_rounds * tile_steps + sk_positions)  # (tile_steps: k_iters, no ring)

                loading_warps(stream_k_phase)

        @pl.when(wg == _MEMORY_WG)
        def _memory():
            plgpu.set_max_registers(memory_registers, action="decrease")
            memory_loads()

        if has_prologue_wg:
            @pl.when(wg == _PROLOGUE_WG)
            def _prologue():
                plgpu.set_max_registers(fourth_registers, action="decrease")

                @each_tile
                def _(lin, local, num_local):
                    ctx = shape.tile_context(lin, 0, refs_by_name)
                    carry0 = fusion.prologue_init(ctx) if fusion.prologue_init is not None else ()

                    def step(k, carry):
                        slot = slot_of(local, k)
                        plgpu.barrier_wait(ready.at[slot])
                        carry = fusion.prologue_step(dataclasses.replace(ctx, step=k), stages[0].at[slot], carry)
                        plgpu.barrier_arrive(consumed.at[slot])
                        return carry

                    leaves, tree = jax.tree.flatten(lax.fori_loop(0, k_iters, step, carry0))
                    if len(leaves) != fusion.handoff_rows:
                        raise ValueError(f"Fusion.handoff_rows={fusion.handoff_rows}, but the prologue's carry "
                                         f"holds {len(leaves)} arrays")
                    carry_tree[:] = [tree]

                    @pl.when(local >= 1)
                    def _wait_read():  # the MMA warpgroups have read what the previous tile left here
                        plgpu.barrier_wait(handoff_free)

                    for i, vec in enumerate(leaves):
                        handoff.at[i][...] = vec.astype(_F32)
                    plgpu.barrier_arrive(handoff_full)
                    drain(handoff_free, local, num_local, 1, 1)

        if apart:
            @pl.when(wg == _EPILOGUE_WG)
            def _epilogue():
                plgpu.set_max_registers(fourth_registers, action="decrease")

                @each_tile
                def _(lin, local, num_local):
                    del local, num_local
                    ctxs = [shape.tile_context(lin, h, refs_by_name) for h in range(2)]
                    carries = [fusion.prologue_init(c) if fusion.prologue_init is not None else () for c in ctxs]
                    with mu.region("accumulators_wait"):
                        plgpu.barrier_wait(u_full)
                    with mu.region("epilogue_apart"):
                        shape.finish_in_slices(ctxs, u_smem, carries, out_gmem, named_in, named_out, scoped)
                    plgpu.barrier_arrive(u_free)

        @pl.when(wg < 2)
        def _mma():
            plgpu.set_max_registers(mma_registers, action="increase")

            delay = cfg.delay_release  # wgmma groups left in flight; their stages are released later

            in_mma = fusion.prologue_init is not None and not has_handoff

            def k_loop(acc_ref, g0, k0, k1, ctx=None, hook_carry=(), under_first=None, observe=True,
                       fetch_at=None, length=None):
                """wgmma over steps [k0, k1) of the tile, at ring positions g0, g0 + 1, ...; every stage released.
                With ``Fusion.a_observe``, run after each wgmma is issued (where ``observe``, a Python bool); with
                ``Fusion.a_operand``, before it, on the registers it reads. ``under_first()``: run once, right after
                the first step's wgmma is issued (that step taken out of the loop; k0, k1 static). ``fetch_at``:
                (step, fetch, rows): a second carry starting at rows, which at that step, after the wgmma's issue,
                becomes fetch() (the shared row vector of ``Fusion.share_rows``). ``length``: k1 - k0 as a Python int where k0 and k1 are traced (a stream-K
                segment); an a_operand needs the step count static. Returns the hook's carry, or (it, that second
                carry) with fetch_at. No branch holds a wgmma: ptxas keeps them asynchronous."""
                def step(k, carry, after_issue=None):
                    acc_ref, hook_carry, rows = carry
                    g = g0 + k - k0
                    slot = lax.rem(g, num_stages)
                    plgpu.barrier_wait(ready.at[barrier_of(g)])
                    a_regs = None
                    if fusion.a_operand is not None:  # registers of its own (the caller's unrolled steps)
                        a = shape.load_a(stages[0].at[slot], wg)
                        vectors = {n: mu.load(buf.at[slot], layout=mu.COLS, optimized=False)
                                   for n, buf in scoped["step_smem"].items()}
                        a_regs, hook_carry = fusion.a_operand(  # (ctx.step: the step along all of K)
                            dataclasses.replace(ctx, step=ctx.k_part * k_iters + k), a, vectors, hook_carry)
                        if mu.interpreting():  # the interpreter's wgmma takes A from SMEM only
                            staged = scoped["a_operand_smem"].at[wg]
                            staged[...] = a_regs
                            a_regs = staged
                    shape.issue_wgmma(acc_ref, stages[0].at[slot], stages[1].at[slot], wg, a_regs=a_regs)
                    if after_issue is not None:
                        after_issue()
                    if fusion.a_observe is not None and observe:  # under the wgmma just issued
                        # (and one in flight with delay); loaded again with an a_operand: its registers passed
                        # through an optimization barrier past the issue cost the rmsnorm_matmul forward 10%
                        def observed(c):
                            a = mu.load(stages[0].at[slot].at[shape.wg_a_rows(wg)], layout=mu.TILE)
                            if beside is None:
                                return fusion.a_observe(dataclasses.replace(ctx, step=k), a, c)
                            side = mu.load(stages[2].at[slot].at[shape.wg_a_rows(wg)], layout=mu.TILE)
                            return fusion.a_observe(dataclasses.replace(ctx, step=k), a, c, side)

                        hook_carry = observed(hook_carry)
                    if fusion.a_copy is not None:  # likewise, on the steps this warpgroup's column block writes
                        shape.copy_a(ctx, k, stages[0].at[slot], hook_carry, named_out, scoped)
                    if fetch_at is not None:  # under the wgmma just issued
                        at, fetch, _ = fetch_at
                        rows = lax.cond(k == at, lambda r: fetch(), lambda r: r, rows)
                    plgpu.wgmma_wait(delay)
                    if delay:  # the wgmma of step k - delay is complete

                        @pl.when(k - k0 >= delay)
                        def _release_older():
                            plgpu.barrier_arrive(consumed.at[barrier_of(g - delay)])
                    else:
                        plgpu.barrier_arrive(consumed.at[barrier_of(g)])
                    return acc_ref, hook_carry, rows

                rows = () if fetch_at is None else fetch_at[2]
                first = k0
                if under_first is not None:  # outside the loop: what it stores is no loop constant
                    _, hook_carry, rows = step(k0, (acc_ref, hook_carry, rows), after_issue=under_first)
                    first = k0 + 1
                if fusion.a_operand is None:
                    _, hook_carry, rows = lax.fori_loop(first, k1, step, (acc_ref, hook_carry, rows))
                else:  # delay + 1 steps per iteration, each its own register block: a block is loaded again only
                    # after the wgmma_wait(delay) of a later step has seen its wgmma complete (a static count)
                    unroll = delay + 1
                    count = (k1 - k0 if length is None else length) - (under_first is not None)
                    rounds, rest = divmod(count, unroll)

                    def steps(j, carry):
                        for i in range(unroll):
                            carry = step(first + j * unroll + i, carry)
                        return carry

                    carry = lax.fori_loop(0, rounds, steps, (acc_ref, hook_carry, rows))
                    for i in range(rest):
                        carry = step(first + rounds * unroll + i, carry)
                    _, hook_carry, rows = carry
                if delay:
                    plgpu.wgmma_wait(0)
                    for d in range(delay):  # the last `delay` steps (fewer where the segment is shorter)
                        last = k1 - k0 - delay + d

                        @pl.when(last >= 0)
                        def _release_last():
                            plgpu.barrier_arrive(consumed.at[barrier_of(g0 + last)])
                return hook_carry if fetch_at is None else (hook_carry, rows)

            def fetch_shared_rows(ctx):
                """A row block's shared vector (``Fusion.share_rows``), this tile's rows, once its first tile has
                stored it. One load polls for the signal (a decrementing wait compares-and-swaps, two round trips
                to L2 at least, each contended by the row block's other tiles); then -1, fire and forget: the count
                stays >= 1 until the row block's last tile has passed, and ends the call at zero."""
                semaphore = row_semaphores.at[ctx.m_idx * 2 + wg]
                plgpu.semaphore_wait(semaphore, 1, decrement=False, memory_scope="gpu")  # acquire
                plgpu.semaphore_signal(semaphore, -1, memory_scope="gpu")
                return mu.load(named_out[fusion.share_rows[0]].at[ctx.rows], layout=mu.ROWS, optimized=False)

            def shared_rows_k_loop(acc_ref, ctx, local, hook_carry, under_first=None):
                """The K loop of a tile under ``Fusion.share_rows``: a row block's column-0 tile runs the a_observe,
                stores fn(ctx, carry) into the shared output and signals the row block's other tiles (n_iters - 1
                of them); those skip the a_observe and wait for that signal and load the row vector
                ``MosaicGemmConfig.shared_rows_wait`` steps before the loop's end, under a wgmma (0: after the
                loop). Each kind of tile has a K loop of its own (``ctx.first_column``: the GPU's two tile loops),
                so no step branches on it (a K loop inside a branch made ptxas serialize the wgmma). Returns (the
                row vector, the hook's carry): the epilogue's carry. In interpret mode every tile computes it
                itself. ``under_first``: as ``k_loop``'s (the previous tile's output, stored under the first wgmma)."""
                name, rows_from = fusion.share_rows
                shared_out = named_out[name]
                others = shape.iters[1] - 1
                g0 = local * tile_steps

                def produce(carry):
                    rows = rows_from(ctx, carry).astype(_F32)

                    @pl.when(ctx.n_idx == 0)  # in interpret mode every tile gets here
                    def _store():
                        shared_out.at[ctx.rows][...] = rows

                    if others and not mu.interpreting():
                        plgpu.semaphore_signal(row_semaphores.at[ctx.m_idx * 2 + wg], others,
                                               memory_scope="gpu")  # after a warpgroup barrier: a release
                        # by one lane that orders every lane's stores above before it
                    return rows

                if mu.interpreting() or not others:
                    carry = k_loop(acc_ref, g0, 0, k_iters, ctx, hook_carry, under_first)
                    return produce(carry), carry

                def fetch():
                    return fetch_shared_rows(ctx)

                if ctx.first_column is None:  # (on the GPU every tile loop under share_rows names it)
                    raise RuntimeError("share_rows: a tile's K loop without TileContext.first_column")
                if ctx.first_column:
                    carry = k_loop(acc_ref, g0, 0, k_iters, ctx, hook_carry, under_first, observe=True)
                    return produce(carry), carry
                if not cfg.shared_rows_wait:
                    carry = k_loop(acc_ref, g0, 0, k_iters, ctx, hook_carry, under_first, observe=False)
                    return fetch(), carry
                zeros = mu.layout_cast(jnp.zeros((cfg.tile_m,), _F32), mu.ROWS)
                at = max(0, k_iters - cfg.shared_rows_wait)
                carry, rows = k_loop(acc_ref, g0, 0, k_iters, ctx, hook_carry, under_first, observe=False,
                                     fetch_at=(at, fetch, zeros))
                return rows, carry

            def free_ring_input(local):
                """(ring input) The output stored from the local-th tile's ring slots has left them: both freed
                (each MMA warpgroup arrives on both halves' ``consumed``)."""
                g_in = local * tile_steps + k_iters
                with mu.region("store_wait"):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for h in range(2):
                    plgpu.barrier_arrive(consumed.at[barrier_of(g_in + h)])

            def mma_tile(lin, local, pending=None, first_column=None):
                """The lin-th tile step's K loop and epilogue. ``pending``: (the previous tile's output, its lin),
                stored under this tile's first wgmma (none at the block's first tile); this tile's is then returned
                the same way (``epilogue_store="next_tile"``). ``first_column``: ``TileContext.first_column``."""
                ctx = dataclasses.replace(shape.tile_context(lin, wg, refs_by_name), first_column=first_column)
                if not apart:  # (the epilogue warpgroup loads what its slices need itself)
                    shape.start_tile(ctx, named_in, scoped)
                hook_carry = fusion.prologue_init(ctx) if in_mma else ()
                under_first = None
                if pending is not None:
                    def under_first():
                        @pl.when(local > 0)
                        def _store_previous():
                            tile, prev = pending
                            shape.store_later(shape.tile_context(prev, wg, refs_by_name), tile, scoped, out_gmem)

                def acc_scope(acc_ref):
                    with mu.region("k_loop"):
                        if sharing:
                            carry = shared_rows_k_loop(acc_ref, ctx, local, hook_carry, under_first)
                        else:
                            carry = k_loop(acc_ref, local * tile_steps, 0, k_iters, ctx, hook_carry, under_first)
                    with mu.region("epilogue"):
                        return tile_epilogue(acc_ref, carry)

                def tile_epilogue(acc_ref, carry):
                    if apart:  # the accumulator into the buffer, once the epilogue warpgroup is done with it
                        del carry

                        @pl.when(local >= 1)
                        def _wait_free():
                            plgpu.barrier_wait(u_free)

                        u_smem.at[wg][...] = acc_ref[...].astype(u_smem.dtype)
                        plgpu.barrier_arrive(u_full)
                        return None
                    if has_handoff:
                        plgpu.barrier_wait(handoff_full)
                        carry = carry_tree[0].unflatten([
                            mu.load(handoff.at[i, shape.wg_a_rows(wg)], layout=mu.ROWS, optimized=False)
                            for i in range(fusion.handoff_rows)])
                    tile_refs = None
                    if ring_input:  # both halves' arrivals waited for by both warpgroups (barrier phases)
                        g_in = local * tile_steps + k_iters
                        with mu.region("tile_inputs"):
                            for h in range(2):
                                plgpu.barrier_wait(ready.at[barrier_of(g_in + h)])
                        tile_refs = {ring_input: ring_stages.at[lax.rem(g_in + wg, num_stages)]}
                    tile = shape.finish_tile(ctx, acc_ref, carry, out_gmem, named_out, scoped,
                                             store=pending is None, tile_refs=tile_refs)
                    if ring_input:  # the output stored from this warpgroup's slot has left it: both slots free
                        free_ring_input(local)
                    if has_handoff:
                        plgpu.barrier_arrive(handoff_free)
                    return tile

                tile = pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n), _F32))
                return None if pending is None else (tile, lin)

            def no_output_yet():
                """The carry of the tile loops that store later (``epilogue_store`` "next_tile" or "split") before
                the block's first tile: what a tile holds for the next one (``_Shape.held_shape``), and its lin."""
                return (mu.layout_cast(jnp.zeros(shape.held_shape(), shape.out_dtype), mu.TILE), jnp.int32(0))

            def store_last_output(last_output):
                @pl.when(lax.axis_index("sm") < round_tiles)  # the block ran a tile: its last one is pending
                def _store_last():
                    tile, lin = last_output
                    shape.store_later(shape.tile_context(lin, wg, refs_by_name), tile, scoped, out_gmem)

            def each_tile_storing_later():
                """The tile loop of ``epilogue_store`` "next_tile" or "split": each tile's output (or its right
                half) carried to the next."""
                @plgpu.nd_loop((round_tiles,), collective_axes="sm", init_carry=no_output_yet())
                def last_output(loop_info, carry):
                    return mma_tile(loop_info.index[0], loop_info.local_index, pending=carry)

                store_last_output(last_output)

            def first_column_then_the_rest(storing_later):
                """(share_rows, GPU) The block's tiles in two loops: those of the first column (lin < m_iters, which
                the tile order runs first), then the others, each loop's K loop compiled for its kind of tile
                (``TileContext.first_column``), so no step branches on it. ``storing_later``: each tile's output
                (or its right half) carried to the next through both loops (``epilogue_store`` not "end")."""
                sm, blocks = lax.axis_index("sm"), lax.axis_size("sm")

                def count(limit):  # the block's local indices whose lin = local · blocks + sm is below limit
                    return jnp.maximum(0, lax.div(limit - sm + blocks - 1, blocks))

                n_first, n_all = count(shape.iters[0]), count(round_tiles)
                carry = no_output_yet() if storing_later else ()
                for first, (start, stop) in ((True, (0, n_first)), (False, (n_first, n_all))):
                    def tile(local, carry, first=first):
                        if storing_later:
                            return mma_tile(local * blocks + sm, local, pending=carry, first_column=first)
                        mma_tile(local * blocks + sm, local, first_column=first)
                        return carry

                    carry = lax.fori_loop(start, stop, tile, carry)
                if storing_later:
                    store_last_output(carry)

            if sharing and not mu.interpreting():
                if round_tiles:
                    first_column_then_the_rest(storing_later=cfg.stores_later)
            elif cfg.stores_later:
                if round_tiles:
                    each_tile_storing_later()
            else:
                @each_tile
                def _(lin, local, num_local):
                    if not cfg.pingpong:
                        mma_tile(lin, local)
                        if apart:  # the epilogue warpgroup's last release, so that none is left mid-phase
                            drain(u_free, local, num_local, 1, 1)
                        return

                    @pl.when(owner_of(local) == wg)
                    def _own_tile():
                        mma_tile(lin, local)

            if plan is not None:
                def sk_segment(j, c):
                    """The unit's j-th stream-K segment: its partial sum stored and signalled for the tile's owner
                    (a segment starting mid-tile: only the first), or (the owner) the tile finished with its
                    sources' partial sums."""
                    t, k0, k1 = plan.segment(unit, j)
                    ctx = shape.tile_context(plan.dp_tiles + t, wg, refs_by_name)
                    if sharing and not mu.interpreting():  # (no stream-K tile is a first one)
                        ctx = dataclasses.replace(ctx, first_column=False)
                    owner = k0 == 0

                    @pl.when(owner)
                    def _prefetch():
                        shape.start_tile(ctx, named_in, scoped)

                    hook_carry = fusion.prologue_init(ctx) if in_mma else ()
                    observed = fusion.a_observe is not None and not sharing  # (share_rows: never a first tile)
                    combined = bool(shape.observed_carry_shapes)  # partial carries the owner adds

                    def acc_scope(acc_ref):
                        g0 = sk_position(j, t, k0)
                        with mu.region("stream_k_loop"):
                            carry = k_loop(acc_ref, g0, k0, k1, ctx, hook_carry, observe=observed,
                                           length=plan.segment_steps)  # (None: an a_operand is refused then)
                        with mu.region("stream_k_epilogue"):
                            sk_epilogue(acc_ref, carry)

                    def sk_epilogue(acc_ref, carry):
                        parts, tree = jax.tree.flatten(carry) if combined else ([], None)
                        if [p.shape for p in parts] != [tuple(s) for s in shape.observed_carry_shapes]:
                            raise ValueError(f"Fusion.carry_shapes={fusion.carry_shapes}, but the hook carry "
                                             f"holds {[p.shape for p in parts]}")

                        @pl.when(jnp.logical_not(owner))
                        def _partial():
                            workspace.at[unit, wg][...] = acc_ref[...]
                            for part, buffer in zip(parts, carry_workspaces):
                                buffer.at[unit, wg][...] = part
                            plgpu.semaphore_signal(semaphores.at[unit * 2 + wg], memory_scope="gpu")  # release

                        @pl.when(owner)
                        def _finish():
                            def add(src, sums):
                                acc, parts = sums
                                plgpu.semaphore_wait(semaphores.at[src * 2 + wg], 1, memory_scope="gpu")
                                acc = acc + mu.load(workspace.at[src, wg], layout=mu.TILE, optimized=False)
                                parts = [p + mu.load(b.at[src, wg], layout=mu.TILE if p.ndim == 2 else mu.ROWS,
                                                     optimized=False) for p, b in zip(parts, carry_workspaces)]
                                return acc, parts

                            first, last = plan.sources(t)
                            acc, summed = lax.fori_loop(first, last + 1, add, (acc_ref[...], parts))
                            epilogue_carry = tree.unflatten(summed) if parts else carry
                            if sharing:  # (the row vector, the carry), as the whole rounds' tiles get it
                                epilogue_carry = (fetch_shared_rows(ctx), epilogue_carry)
                            tile_refs = None
                            if ring_input:  # in the two positions after the segment's steps, as in tile_epilogue
                                g_in = sk_position(j, t, k0) + k1 - k0
                                for h in range(2):
                                    plgpu.barrier_wait(ready.at[barrier_of(g_in + h)])
                                tile_refs = {ring_input: ring_stages.at[lax.rem(g_in + wg, num_stages)]}
                            shape.finish_tile(ctx, acc_ref, epilogue_carry, out_gmem, named_out, scoped, acc=acc,
                                              tile_refs=tile_refs)
                            if ring_input:
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                for h in range(2):
                                    plgpu.barrier_arrive(consumed.at[barrier_of(g_in + h)])

                    pl.run_scoped(acc_scope, plgpu.ACC((cfg.tile_m, cfg.tile_n), _F32))
                    return c

                @pl.when(unit < plan.units)
                def _stream_k():
                    lax.fori_loop(0, plan.num_segments(unit), sk_segment, ())

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # all stores have left shared memory before exit

    pl.run_scoped(scope, **scoped_types, collective_axes="wg")
