"""Stream-K: the persistent GEMM's last, part-empty round of output tiles spread over more blocks by K steps.

  plan = stream_k.plan_for(tiles=4096, blocks=132, k_iters=64)   # None where it cannot pay (see below)
  start, end = plan.unit_range(u)           # unit (block) u's K steps in the stream-K region, [start, end)
  t, k0, k1 = plan.segment(u, j)            # its j-th segment: steps [k0, k1) of stream-K tile t
  first, last = plan.sources(t)             # the units holding tile t's later segments (their partial sums)
  offset = plan.segment_offset(u, j, 2)     # where it starts among u's ring positions (2 after each owned segment)

Why: a persistent kernel with P blocks takes ceil(T / P) rounds of CTA tiles, and every round costs the same. On the
H100 (132 SMs) the core's 128x256 tiles make 4096 tiles at 32768x4096x4096: 31.03 rounds run as 32. Measured there
(``benchmarks/results/mosaic_gemm_waves-h100-700f5f5.json``, CUPTI): 1387 µs at M = 32768 (32 rounds), 1344 at
M = 32256 (31 rounds), 1395 at M = 33792 (32 whole rounds, 3% more FLOPs); 4096x4096x14336 (13.6 rounds) took as
long as 4224x4096x14336 (14). Time is rounds x round time; the last, nearly empty round costs 3% at these shapes,
all of the gap to cuBLAS at the first one.

The plan: the whole rounds run tile by tile as before (data-parallel: all blocks at the same K step, sharing
their operands' slices in L2), then each of the last round's R tiles is cut into S equal K ranges (S = split, at
most blocks // R), one unit each: unit u takes range u % S of tile u // S, so the units of one range index run in
step and share operand slices as the rounds do. The tile's *owner*, the unit of its first range, finishes it: every
other unit stores its float32 partial accumulator to a global workspace and signals a semaphore; the owner, after
its own range, waits for those signals, adds the partials and runs the epilogue. No unit waits for one that waits:
with one block per SM, all co-resident, it cannot deadlock. The kernel takes any contiguous split of the steps
(``unit_range``: a unit may cover a partial, a whole and an owned segment, in that order); the plan keeps them
aligned, for the reason below.

Measured (H100, CUPTI; ``benchmarks/results/mosaic_gemm_stream_k-h100-*.json``): at 32768x4096x4096 (R = 4,
16 units) 1376-1408 against 1395-1425 µs tile by tile (0.973-0.974x cuBLAS against 0.961); at 4096x2048x11008
(R = 56, S = 2) 241.5-244.2 against 244.4-247.3. Ranges not aligned to the tiles lose: with the last whole round
taken in too (every unit 1-2 tiles' worth of steps, as stream-K is usually drawn) 667 against 605 µs at
4096x4096x14336, and one part-empty round spread evenly over all 132 blocks (R = 76: 0.58 tile each) 299.5 against
156.7 µs at 512x16384x4864. Units at different K steps no longer read an operand slice together: each streams its
own from HBM (there, B is 160 MB and each of its column panels serves 4 tiles). Ranges starting on multiples of 4-16
steps did not bring it back (652 µs at 16). Spreading only a last round more than half full evenly over all 132
blocks (each range ~37 of 64 steps, at most two segments; H200, ``mosaic_gemm_tiles_spread-h200-5352753.json``)
saved nothing either: 588.8 against 588.0 µs at 4096x4096x14336, 506.1 against 505.4 at 8192x4096x6144 (the 0.42
round it frees is what the partial sums' round trip and two pipeline fills cost). So a last round at least half
full stays as it is.

Integer helpers take Python ints (tests, the plan's static facts) or traced int32 scalars (inside the kernel).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax import lax

__all__ = ["StreamKPlan", "emulate", "plan_for"]

MIN_ROUND_SAVED = 0.1  # plan only where the balanced schedule saves at least this fraction of a round


def _div(a, b):
    return a // b if isinstance(a, int) and isinstance(b, int) else lax.div(a, b)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else lax.min(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else lax.max(a, b)


def _mid_tile(s, k_iters: int):
    """1 where step s starts mid-tile (s % k_iters != 0), else 0."""
    return int(s % k_iters != 0) if isinstance(s, int) else lax.convert_element_type(lax.rem(s, k_iters) != 0,
                                                                                      np.int32)


@dataclasses.dataclass(frozen=True)
class StreamKPlan:
    """The static schedule of one persistent GEMM: ``tiles`` CTA tiles of ``k_iters`` K steps on ``blocks`` blocks.

    dp_rounds: rounds run tile by tile first (tiles [0, dp_rounds · blocks) in the kernel's tile order);
    units: blocks taking part in the stream-K phase (unit u = block u; the others only run the rounds).
    """

    tiles: int
    blocks: int
    k_iters: int
    dp_rounds: int
    units: int

    @property
    def dp_tiles(self) -> int:
        return self.dp_rounds * self.blocks

    @property
    def sk_tiles(self) -> int:
        """Tiles of the stream-K phase (its tile t is the kernel's tile dp_tiles + t)."""
        return self.tiles - self.dp_tiles

    @property
    def sk_steps(self) -> int:
        return self.sk_tiles * self.k_iters

    def unit_range(self, u):
        """[start, end): unit u's steps of the stream-K phase (step s is step s % k_iters of tile s // k_iters)."""
        return _div(u * self.sk_steps, self.units), _div((u + 1) * self.sk_steps, self.units)

    def unit_of(self, s):
        """The unit whose range holds stream-K step s: the largest u with u · sk_steps // units <= s."""
        return _div((s + 1) * self.units - 1, self.sk_steps)

    def num_segments(self, u):
        """Tiles unit u's range touches (one segment each)."""
        start, end = self.unit_range(u)
        return _div(end - 1, self.k_iters) - _div(start, self.k_iters) + 1

    def segment(self, u, j):
        """(t, k0, k1): unit u's j-th segment, steps [k0, k1) of stream-K tile t (j < num_segments(u)). k0 > 0
        only for j = 0: a partial sum for the tile's owner; k0 == 0 makes u the owner of tile t."""
        start, end = self.unit_range(u)
        t = _div(start, self.k_iters) + j
        return t, _max(start - t * self.k_iters, 0), _min(end - t * self.k_iters, self.k_iters)

    def segment_offset(self, u, j, owned_extra: int = 0):
        """Where unit u's j-th segment starts among the unit's positions in the stream-K phase (its steps in order,
        as the kernel's stage ring takes them): the steps of its earlier segments, plus ``owned_extra`` positions
        after each earlier owned segment's steps (a tile input the owner loads into the ring,
        ``MosaicGemmConfig.tile_input_in="ring"``: 2)."""
        start, _ = self.unit_range(u)
        t, k0, _ = self.segment(u, j)
        before = t * self.k_iters + k0 - start
        if owned_extra:  # every segment after the first is owned; the first unless it starts mid-tile
            before = before + owned_extra * _max(j - _mid_tile(start, self.k_iters), 0)
        return before

    def unit_positions(self, u, owned_extra: int = 0):
        """Unit u's positions in the stream-K phase: its steps, plus ``owned_extra`` per owned segment."""
        start, end = self.unit_range(u)
        return end - start + owned_extra * (self.num_segments(u) - _mid_tile(start, self.k_iters))

    def sources(self, t):
        """(first, last): the units after tile t's owner that hold its later segments, first..last inclusive
        (none when last < first: the owner's range holds the whole tile)."""
        return self.unit_of(t * self.k_iters) + 1, self.unit_of((t + 1) * self.k_iters - 1)

    @property
    def segment_steps(self) -> int | None:
        """The length of every unit's one segment where all have the same (the split divides k_iters: each unit
        takes one aligned range of one tile, as ``plan_for``'s plans do then), else None. A K loop that unrolls
        its steps in static groups (``gemm.Fusion.a_operand``) needs it."""
        steps, rest = divmod(self.sk_steps, self.units)
        return steps if steps and not rest and self.k_iters % steps == 0 else None

    @property
    def max_segments(self) -> int:
        return max(self.num_segments(u) for u in range(self.units))

    @property
    def rounds(self) -> float:
        """The schedule's length in rounds of whole tiles: dp_rounds plus the longest unit range."""
        return self.dp_rounds + max(e - s for s, e in map(self.unit_range, range(self.units))) / self.k_iters


def plan_for(tiles: int, blocks: int, k_iters: int, split: int = 4) -> StreamKPlan | None:
    """The stream-K schedule of ``tiles`` CTA tiles (each ``k_iters`` K steps) on ``blocks`` persistent blocks: the
    last, part-empty round's R tiles each cut into S = min(split, blocks // R) equal K ranges, one unit each; or None
    where S < 2 (a last round at least half full, or whole rounds) or too few steps to save ``MIN_ROUND_SAVED``
    of a round. split=1: the R tiles whole, one unit each (the rounds' schedule, run by the kernel's stream-K
    phase: ``MosaicGemmConfig.stream_k`` says why), where there are whole rounds and a part-empty last one."""
    if min(tiles, blocks, k_iters, split) <= 0:
        raise ValueError(f"tiles, blocks, k_iters, split: must be positive, got {tiles}, {blocks}, {k_iters}, {split}")
    full, rest = divmod(tiles, blocks)
    if split == 1:  # the last round's tiles whole, one unit each: the rounds' schedule through the stream-K phase
        return StreamKPlan(tiles, blocks, k_iters, dp_rounds=full, units=rest) if rest and full else None
    pieces = min(split, blocks // rest, k_iters) if rest else 0
    if pieces < 2 or k_iters < 2:
        return None
    plan = StreamKPlan(tiles, blocks, k_iters, dp_rounds=full, units=pieces * rest)
    if -(-tiles // blocks) - plan.rounds < MIN_ROUND_SAVED:
        return None
    return plan


def emulate(plan: StreamKPlan, a: np.ndarray, b: np.ndarray, tile_m: int, tile_n: int, tile_k: int,
            tile_index) -> np.ndarray:
    """a @ b (float64) computed the way the kernel schedules it: the rounds' tiles whole, the stream-K tiles as
    their owners' segments plus the partial sums of their sources. ``tile_index(lin) -> (m_idx, n_idx)``: the
    kernel's tile order. A check of the plan's arithmetic (every step of every tile summed once), for tests."""
    out = np.full((a.shape[0], b.shape[1]), np.nan)

    def product(lin, k0, k1):
        m, n = tile_index(lin)
        rows, cols, ks = slice(m * tile_m, (m + 1) * tile_m), slice(n * tile_n, (n + 1) * tile_n), \
            slice(k0 * tile_k, k1 * tile_k)
        return (m, n), a[rows, ks].astype(np.float64) @ b[ks, cols].astype(np.float64)

    def put(mn, value):
        m, n = mn
        assert np.isnan(out[m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n]).all(), "tile written twice"
        out[m * tile_m:(m + 1) * tile_m, n * tile_n:(n + 1) * tile_n] = value

    for lin in range(plan.dp_tiles):
        put(*product(lin, 0, plan.k_iters))
    partials = {}
    for u in range(plan.units):
        for j in range(plan.num_segments(u)):
            t, k0, k1 = plan.segment(u, j)
            if k0 > 0:
                assert j == 0 and u not in partials, "a unit stores one partial sum, from its first segment"
                partials[u] = t, product(plan.dp_tiles + t, k0, k1)[1]
    for u in range(plan.units):
        for j in range(plan.num_segments(u)):
            t, k0, k1 = plan.segment(u, j)
            if k0 == 0:
                mn, acc = product(plan.dp_tiles + t, k0, k1)
                first, last = plan.sources(t)
                assert (last >= first) == (k1 < plan.k_iters)
                for src in range(first, last + 1):
                    assert src > u, "an owner waits only for later units (which never wait before they signal)"
                    src_tile, partial = partials.pop(src)
                    assert src_tile == t, f"unit {src} holds a partial sum of tile {src_tile}, not {t}"
                    acc = acc + partial
                put(mn, acc)
    assert not partials, f"partial sums nobody added: units {sorted(partials)}"
    return out
