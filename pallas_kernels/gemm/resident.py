"""c += aᵀ @ b with aᵀ's row block resident in shared memory: the cross-entropy's dw update over short chunks.

  c = accumulate_resident(a_t, b, c)            # a_t (K, M), b (K, N), c (M, N) 16-bit -> c + a_tᵀ @ b, in place
  resident_reason(M, N, K, dtype, config)       # None, or the sentence naming the constraint

For dw += h_cᵀ · dl (M = H, N = V, K = Bc <= 512 tokens) the GEMM core's persistent tiles re-read a (tile_m, K)
block of h_cᵀ for every output tile; on the H100 at 2048 x 256000 x 512 that traffic, 128 KiB per 128x128 tile
beside 64-128 KiB of dl, keeps L2 78% busy while DRAM runs at 68% of the copy's rate (NOTES.md, tenth session).
Here each block holds one (tile_m, K) row block of aᵀ for its whole life and walks a contiguous range of column
tiles: per tile only b's (K, tile_n) block streams through the ring, and c's tile is read and written once.

Schedule: the blocks form ``groups`` = num_sms // (M / tile_m) groups of M / tile_m blocks; block i of a group
owns row block i and the group's N / tile_n / groups column tiles (the first few one more). The blocks of a
group walk the same columns at about the same pace, so each b block leaves HBM once and L2 serves it to all the
row blocks. Warpgroups as in ``gemm.specialized`` under "pingpong": 2 is memory (the resident block once, then b
blocks ``num_stages`` steps ahead into a ring), 0 and 1 compute, the block's tiles alternating between them
(tile i to warpgroup i % 2), each TMA-prefetching its c tile at the tile's start, running the K loop (wgmma from
the resident block, transposed, and the ring; ``delay_release`` groups in flight), adding c in float32 and
storing the sum from the c tile's own buffer. Ring barriers are per owner (Mosaic's per-thread phases).
Shared memory: K · tile_m (resident) + 2 · tile_m · tile_n (c tiles) + num_stages · tile_k · tile_n, 16-bit.
Runs on an sm90 GPU; lowers for CUDA anywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_utils as mu

__all__ = ["ResidentConfig", "accumulate_resident", "resident_reason", "smem_bytes"]

_F32 = jnp.float32
_MEMORY_WG = 2
_MEMORY_REGISTERS, _MMA_REGISTERS = 40, 232


@dataclasses.dataclass(frozen=True)
class ResidentConfig:
    """tile_m x tile_n: one compute warpgroup's float32 accumulator (its whole output tile); tile_k: the K slice of
    one ring step; num_stages: b blocks in flight; delay_release: wgmma groups left in flight (1 keeps a lone
    warpgroup's tensor cores fed)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 32
    num_stages: int = 4
    delay_release: int = 1

    def __post_init__(self):
        cls = type(self).__name__
        checks = [("tile_m", self.tile_m in (64, 128), "64 or 128"),
                  ("tile_n", self.tile_n in (64, 128, 256), "64, 128 or 256"),
                  ("tile_k", self.tile_k in (32, 64), "32 or 64"),
                  ("num_stages", isinstance(self.num_stages, int) and self.num_stages >= 2, "an int >= 2"),
                  ("delay_release", self.delay_release in (0, 1), "0 or 1")]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{cls}.{name}: must be {allowed}, got {getattr(self, name)!r}")
        if self.tile_m * self.tile_n > 128 * 128 * 2 or self.delay_release >= self.num_stages:
            raise ValueError(f"{cls}: tile {self.tile_m}x{self.tile_n} with delay_release={self.delay_release} and "
                             f"num_stages={self.num_stages} is not allowed (accumulator <= 128x256, "
                             "delay_release < num_stages)")


def smem_bytes(K: int, dtype, config: ResidentConfig) -> int:
    """Shared memory one block allocates (bytes, barriers excluded): the resident block, two c tiles, the ring."""
    size = jnp.dtype(dtype).itemsize
    return size * (K * config.tile_m + 2 * config.tile_m * config.tile_n + config.num_stages * config.tile_k
                   * config.tile_n)


def resident_reason(M: int, N: int, K: int, dtype, config: ResidentConfig = ResidentConfig()) -> str | None:
    """None when ``accumulate_resident`` takes an (M, K)ᵀ @ (K, N) update with this config; else one sentence naming
    the constraint: whole tiles, 16-bit, and the resident block beside the c tiles and the ring in shared memory."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} is not 16-bit (bfloat16 or float16)"
    for name, size, tile in (("M", M, config.tile_m), ("N", N, config.tile_n), ("K", K, config.tile_k)):
        if size <= 0 or size % tile:
            return f"{name}={size} is not a positive multiple of the tile {tile}"
    need = smem_bytes(K, dtype, config)
    if need > mu.H100_SMEM_BYTES - 1024:  # 1 KiB: barriers
        return (f"K={K}: the resident ({config.tile_m}, K) block, two c tiles and {config.num_stages} ring stages "
                f"need {need} bytes of shared memory, more than {mu.H100_SMEM_BYTES - 1024}")
    return None


def _plan(M: int, N: int, config: ResidentConfig, num_sms: int) -> tuple[int, int, int]:
    """(row blocks, groups, column tiles): the grid is row blocks · groups blocks."""
    m_blocks, n_tiles = M // config.tile_m, N // config.tile_n
    return m_blocks, max(1, min(num_sms // m_blocks, n_tiles)), n_tiles


def _kernel_body(a_gmem, b_gmem, c_gmem, *, config: ResidentConfig, mnk, groups: int):
    """The kernel of ``accumulate_resident``; c_gmem is read and written in place (the aliased buffer)."""
    M, N, K = mnk
    tm, tn, tk, stages, delay = config.tile_m, config.tile_n, config.tile_k, config.num_stages, config.delay_release
    m_blocks, n_tiles, k_iters = M // tm, N // tn, K // tk
    dtype = a_gmem.dtype
    transforms = mu.smem_transforms(tk, dtype)

    def scope(resident, ring, c_tiles, resident_ready, ready, consumed, c_ready):
        wg = lax.axis_index("wg")
        block = lax.axis_index("sm")
        m_idx, group = lax.rem(block, m_blocks), lax.div(block, m_blocks)
        first = lax.div(group * n_tiles, groups)  # the group's column tiles [first, last)
        num_local = lax.div((group + 1) * n_tiles, groups) - first
        rows = pl.ds(m_idx * tm, tm)

        def barrier_of(step):  # ring barrier of the block's step-th step: its owner's set, the step's slot
            return lax.rem(lax.div(step, k_iters), 2) * stages + lax.rem(step, stages)

        @pl.when(wg == _MEMORY_WG)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
            for k in range(k_iters):  # the resident row block, once
                plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(k * tk, tk), rows], resident.at[k], resident_ready)

            def load(step, carry):
                @pl.when(step >= stages)
                def _wait_free():
                    plgpu.barrier_wait(consumed.at[barrier_of(step - stages)])

                n_idx, k = first + lax.div(step, k_iters), lax.rem(step, k_iters)
                plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(k * tk, tk), pl.ds(n_idx * tn, tn)],
                                        ring.at[lax.rem(step, stages)], ready.at[barrier_of(step)])
                return carry

            total = num_local * k_iters
            lax.fori_loop(0, total, load, ())
            for j in range(stages):  # the last releases, which no load waits for: no barrier left mid-phase
                @pl.when(total - stages + j >= 0)
                def _drain():
                    plgpu.barrier_wait(consumed.at[barrier_of(total - stages + j)])

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_MMA_REGISTERS, action="increase")
            plgpu.barrier_wait(resident_ready)

            def tile(j, carry):
                local = 2 * j + wg  # this warpgroup's tiles: every other one of the block's
                cols = pl.ds((first + local) * tn, tn)
                c_tile = c_tiles.at[wg]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's sum has left c_tile
                plgpu.copy_gmem_to_smem(c_gmem.at[rows, cols], c_tile, c_ready.at[wg])
                g0 = local * k_iters

                def acc_scope(acc_ref):
                    def step(k, acc_ref):
                        g = g0 + k
                        plgpu.barrier_wait(ready.at[barrier_of(g)])
                        plgpu.wgmma(acc_ref, resident.at[k].transpose((1, 0)), ring.at[lax.rem(g, stages)])
                        plgpu.wgmma_wait(delay)
                        if delay:
                            @pl.when(k >= 1)
                            def _release_older():
                                plgpu.barrier_arrive(consumed.at[barrier_of(g - 1)])
                        else:
                            plgpu.barrier_arrive(consumed.at[barrier_of(g)])
                        return acc_ref

                    lax.fori_loop(0, k_iters, step, acc_ref)
                    if delay:
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(consumed.at[barrier_of(g0 + k_iters - 1)])
                    plgpu.barrier_wait(c_ready.at[wg])
                    total = acc_ref[...] + mu.load(c_tile, layout=mu.TILE).astype(_F32)
                    c_tile[...] = total.astype(c_tile.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(c_tile, c_gmem.at[rows, cols])

                pl.run_scoped(acc_scope, plgpu.ACC((tm, tn), _F32))
                return carry

            lax.fori_loop(0, lax.div(num_local - wg + 1, 2), tile, ())

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # all stores have left shared memory before exit

    pl.run_scoped(
        scope,
        resident=plgpu.SMEM((k_iters, tk, tm), dtype, transforms=transforms),
        ring=plgpu.SMEM((stages, tk, tn), dtype, transforms=transforms),
        c_tiles=plgpu.SMEM((2, tm, tn), c_gmem.dtype, transforms=mu.smem_transforms(tn, c_gmem.dtype)),
        resident_ready=plgpu.Barrier(num_arrivals=k_iters),
        ready=plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
        c_ready=plgpu.Barrier(num_barriers=2),
        collective_axes="wg")


def accumulate_resident(a_t: jax.Array, b: jax.Array, c: jax.Array, *,
                        config: ResidentConfig = ResidentConfig(), num_sms: int | None = None) -> jax.Array:
    """c + a_tᵀ @ b (float32 sums, rounded once to c's dtype) in one kernel over c's buffer (in place where XLA
    can donate it: a loop carry). a_t (K, M), b (K, N), c (M, N), all of one 16-bit dtype. ValueError naming the
    argument or the constraint (``resident_reason``)."""
    for name, x in (("a_t", a_t), ("b", b), ("c", c)):
        if jnp.ndim(x) != 2:
            raise ValueError(f"{name}: expected a 2-D array, got shape {tuple(jnp.shape(x))}")
        if jnp.dtype(x.dtype) != jnp.dtype(a_t.dtype):
            raise ValueError(f"{name}: dtype {jnp.dtype(x.dtype)} must equal a_t's {jnp.dtype(a_t.dtype)}")
    (K, M), N = a_t.shape, b.shape[1]
    if b.shape[0] != K or c.shape != (M, N):
        raise ValueError(f"shapes: a_t (K, M) = {a_t.shape}, b (K, N) = {b.shape}, c (M, N) = {c.shape} do not agree")
    reason = resident_reason(M, N, K, a_t.dtype, config)
    if reason:
        raise ValueError(f"accumulate_resident: {reason}")
    m_blocks, groups, _ = _plan(M, N, config, num_sms or mu.num_sms())
    body = functools.partial(_kernel_body, config=config, mnk=(M, N, K), groups=groups)
    _, out = mu.kernel_updating(body, out_type=(), grid=(m_blocks * groups,), grid_names=("sm",), num_threads=3,
                                thread_name="wg", name="mosaic_accumulate_resident")(a_t, b, c)
    return out
