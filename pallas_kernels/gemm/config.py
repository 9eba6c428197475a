"""The Mosaic-GPU GEMM core's configuration: tiles, schedule and K loop of one kernel, and what they allow.

  cfg = MosaicGemmConfig(tile_m=128, tile_n=128, tile_k=64, num_stages=4, wg_split="n")   # CTA tile 128x256
  unsupported_reason(M, N, K, cfg)            # None, or the sentence naming the tile the shape does not divide
  smem_bytes(cfg, jnp.bfloat16, jnp.bfloat16) # shared memory of one block (bytes, barriers excluded)

Why the defaults (one H100, jax 0.11.2, CUPTI, cuBLAS in the same run; benchmarks/results/mosaic_gemm-decide-h100.md,
commit d7404fb). The tile order is the lever: at 32768x4096x4096, runs of ``grid_tile_width=8`` output tiles along
N took 1420 µs against 1631 µs at width 1 (cuBLAS 1350: 0.951x against 0.828x); width 8 or 4 along M came within
1.1% of it, width 16 took 1542 µs. The widths were measured only there and only with the "pallas_steady" K loop under
warpgroup semantics. At width 1 the three K loops and both semantics were within 3.2% of each other at every shape,
and "own" under lane semantics was the fastest or within 0.3% of the fastest at each (1636 vs 1631 µs at
32768x4096x4096, 545 at 8192x4096x6144, 296 at 16384x1024x5504 where jax's loop took 302-305); the fused
rmsnorm_matmul kernels also ran fastest on it, at all four suite shapes. So the defaults are "own", "lane" and width
8 along N; that combination, and the width at any other shape, is not measured yet. ``delay_release=1`` measured no
faster (1658 vs 1636 µs at the largest shape, equal at the others); 3 stages and 128-wide K steps were slower (1715
and 1816 µs against 1631, jax's loop at width 1). They stay options for a sweep. Which tiles ``matmul`` picks per
shape (``gemm.CANDIDATES``) came later, from sweeps against cuBLAS (``mosaic_gemm_tiles-h100-*.json``).

The ping-pong schedule (``schedule="pingpong"``, 2026-11-24, ``mosaic_gemm_tiles-h100-561a317.json`` and
``-1f83762.json``): with one warpgroup issuing wgmma at a time, releasing each stage only after its wgmma completes
(delay_release=0) starves the tensor cores (0.52-0.81x cuBLAS); one group in flight (delay_release=1) brings 128x128
tiles to 0.936 / 0.948 / 0.939x at 32768x4096x4096 / 4096x4096x14336 / 8192x4096x6144, below the cooperative
0.956-0.981x, but to 0.997-1.016x at 16384x1024x5504, where a 16-step K loop makes the epilogue matter; two groups
in flight and 64x256 tiles were slower. It wins where K is short: the rmsnorm_matmul forward and backward at the
small preset's 8192x512x2816 and the cross-entropy's dw updates over 512-row chunks (``gemm.default_config``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import mosaic_utils as mu

__all__ = ["BARRIER_BYTES", "CLUSTERS", "EPILOGUE_PLACES", "EPILOGUE_STORES", "PIPELINES", "PROLOGUE_PLACES",
           "SCHEDULES", "TILE_INPUT_PLACES", "MosaicGemmConfig", "operand_swizzle_elems", "smem_bytes",
           "unsupported_reason"]

PIPELINES = ("own", "pallas", "pallas_steady")
SCHEDULES = ("cooperative", "pingpong")
EPILOGUE_PLACES = ("mma", "fourth")
EPILOGUE_STORES = ("end", "next_tile", "split")
CLUSTERS = ("none", "m", "n")
PROLOGUE_PLACES = ("fourth", "memory")
TILE_INPUT_PLACES = ("buffer", "ring")
BARRIER_BYTES = 1024  # shared memory a kernel's barriers may take beyond ``smem_bytes`` (measured: 64 bytes)


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
    """Tiles and schedule of one Mosaic GEMM kernel (hashable: a static argument).

    Attributes:
      tile_m, tile_n: the float32 accumulator of one compute warpgroup, (tile_m, tile_n): tile_m a multiple of 64
        (wgmma's M), tile_n a multiple of epi_tile_n up to 256; tile_m · tile_n <= 128 · 256 (<= 256 registers
        per thread).
      tile_k: contraction slice per pipeline step, 16 <= tile_k, a multiple of 16.
      num_stages: A/B tiles in flight in shared memory, >= 2.
      wg_split: "m": the two compute warpgroups stack along M (CTA tile (2·tile_m, tile_n), each owns its rows of
        the A tile); "n": along N (CTA tile (tile_m, 2·tile_n), both read all rows of the A tile).
      epi_tile_m, epi_tile_n: pieces the accumulator is stored in (two SMEM slots per warpgroup).
      grid_minor, grid_tile_width: planar-snake tile order: runs of grid_tile_width tiles along grid_minor.
      delay_release: 0: wait for each step's wgmma before releasing its slot; 1 or 2: keep that many wgmma groups
        in flight (a single warpgroup issuing wgmma, as under "pingpong", needs them to keep the tensor cores fed).
      semantics: Mosaic lowering semantics, "lane" (explicit layouts) or "warpgroup" (jax's GEMM example's).
      pipeline: the K loop, "own" (ours, ``gemm.specialized``), "pallas" or "pallas_steady" (jax's
        ``emit_pipeline_warp_specialized``; ``gemm.mosaic``). A fusion with a prologue needs "own" (its prologue runs
        in a fourth warpgroup) and wg_split "n".
      mma_registers: registers per thread of each MMA warpgroup under pipeline "own" (0: 232 with three
        warpgroups, 208 with a prologue warpgroup, 184 with the epilogue one; the memory warpgroup keeps 40, the
        fourth the rest). setmaxnreg raises it from the launch's 168 (three warpgroups) or 128 (four) and lowers the
        others, so it is at least 168, and 176 with a fourth warpgroup (``gemm.specialized.registers``).
      schedule: "cooperative": both compute warpgroups share each CTA tile (``wg_split``) and reach its epilogue
        together; "pingpong" (pipeline "own", no prologue): each compute warpgroup owns whole CTA tiles of
        (tile_m, tile_n), the block's tiles alternating between them, so one warpgroup's epilogue runs while the
        other's wgmma stream keeps the tensor cores busy (``wg_split`` does not apply).
      cluster: "none", or two blocks of a cluster taking neighbouring CTA tiles along "m" (they share B's tiles:
        each block's memory warpgroup loads half of each B tile and TMA multicasts it into both blocks' shared
        memory) or along "n" (they share A's). Halves the L2 reads of the shared operand; a stage is refilled only
        once both blocks' consumers have released it (a cluster barrier). Pipeline "own" only.
      stream_k: 0 (off), or where the tiles leave the persistent grid's last round part-empty, run that round's
        tiles spread over up to stream_k blocks each by K steps (``gemm.stream_k``: partial sums through a float32
        workspace and global semaphores). Pipeline "own", schedule "cooperative", no cluster. 1: that round's
        tiles whole, one per block, through the stream-K phase: the schedule of 0, but ptxas keeps the wgmma of an
        a_operand beside ``epilogue_store="split"`` unserialized only where the kernel has a stream-K phase
        (H200, 4096x4096x14336: 606.9 against 612.4 µs; NOTES.md, thirty-seventh session).
      prologue_in: where a ``Fusion.prologue_step`` runs: "fourth", a fourth warpgroup (wg_split "n": with four
        warpgroups ptxas compiles for 128 registers, too few for a 64x256 wgmma); "memory", the memory warpgroup,
        on each stage num_stages - 1 loads after issuing it (any wg_split; no cluster): free as a protocol, but
        its work delays the loads (row sums of each A block: 1.22x the plain core; ``gemm.specialized``).
      epilogue_store: where the cooperative warpgroups store a tile's output: "end", right after its epilogue, the
        tensor cores idle meanwhile; "next_tile", kept in registers (out_dtype, tile_m · tile_n / 128 values per
        thread) and stored under the next tile's first wgmma (the block's last whole tile after their loop, before
        any stream-K segments, which store as "end"). Pipeline "own", schedule "cooperative", and a fusion without
        ``store_in``. Measured on the H100 (NOTES.md, 2026-11-28, twenty-second session): 0.1-0.7% faster for the
        plain core (``gemm.PLAIN_EPILOGUE_STORE``); slower in the rmsnorm_matmul forward (1.4% with r's sums, 15%
        with an ``a_operand``, whose wgmma ptxas then serializes: ``hlo_inspect.ptxas``, warning C7513).
        "split": the left half of the tile's pieces stored at its end (into the two slots, which are free then:
        no wait for an earlier store's read), the right half (tile_n / 2 columns, half the registers of
        "next_tile") kept and stored under the next tile's first wgmma. The same conditions, and an even number of
        pieces across tile_n. Measured on the H200 (NOTES.md, thirty-fourth session): the rmsnorm_matmul forward
        with gamma in the registers 1364.1 against 1377.1 µs at 32768x4096x4096 (its entry now; ptxas: no spill,
        where "next_tile" spills), 16% slower at 4096x4096x14336 and 8192x4096x6144 (C7513) until the kernel has a
        stream-K phase there (``stream_k=1``; their entries now); the plain core equal to "next_tile".
      shared_rows_wait: under a ``Fusion.share_rows``, how many K steps before a tile's K loop ends a tile that
        does not compute the shared row vector waits for it and loads it: right after issuing that step's wgmma,
        so the poll's and the load's round trips to L2 run beside the wgmma in flight (0: after the K loop). On
        the H100 (rmsnorm_matmul forward) 4 and 8 measured within 0.2% of each other
        (rmsnorm_matmul_configs_mma_shared_poll-h100-8bada7c.json), and 0, 4 and 8 within 1% with an earlier
        compare-and-swap wait (..._mma_shared_wait-h100-37feb47.json).
      tile_input_in: where a fusion's tile input (``Fusion.tile_inputs``: one, its ``store_in``) waits for the
        epilogue: "buffer", its own SMEM (2 · tile_m · tile_n elements), prefetched at each tile's start; "ring",
        two slots of the B stages, which the memory warpgroup fills with the warpgroups' halves after the tile's
        last K step and the epilogue frees once the output stored from them has left: no SMEM of its own, so a
        stage more fits (a 64x256 bfloat16 tile input takes 64 KiB, a 64x256 B stage 32 KiB). The warpgroups'
        tile must be the B block's shape (tile_m == tile_k, wg_split "m", cooperative), on pipeline "own" without
        a cluster; with stream-K a tile's owner takes the input into the two positions after its own segment's
        steps. Where B is read transposed (its stages (cta_n, tile_k) blocks) the halves go into a
        second view of the same memory (``plgpu.RefUnion``).
      memory_warps: the warps of the memory warpgroup (pipeline "own") that run its loads and waits: 4, all of
        them (each thread arrives on a stage's barrier for its share of the bytes); 1, the first only (as the TMA
        warp of jax's Blackwell GEMM example: its threads arrive for all four), the other three idle, so fewer
        instructions are issued per K step under the chip's power limit. Pipeline "own", not with prologue_in
        "memory" (a prologue there needs every thread).
      epilogue_in: which warpgroups run a tile's epilogue: "mma", the MMA warpgroups after their K loop, the tensor
        cores idle meanwhile; "fourth", a fourth warpgroup (``gemm.specialized``): the MMA warpgroups write their
        accumulators in out_dtype into a shared buffer (2 · tile_m · tile_n elements) and go on to the next tile's
        K loop once the fourth has read the previous tile's; the fourth walks each accumulator in (tile_m,
        epi_tile_n) column slices, each tile input's slice TMA-loaded into a slot of its own, runs the fusion's
        hooks on them and stores the output from the buffer. The accumulator is rounded to out_dtype before the
        epilogue, and so is the epilogue's tile before a ``Fusion.sum_rows`` finish. Pipeline "own", schedule
        "cooperative", no cluster or stream-K, epilogue_store "end", tile_input_in "buffer", and tile_n <= 128:
        ptxas compiles four warpgroups for 128 registers a thread, too few for a m64n256 wgmma (C7602, measured on
        the H200). First measured at 32768x4096x4096 (the rmsnorm_matmul dx kernel on 128x128 accumulators side by
        side, 3 stages): 1488.6 against the entry's 1493.6 µs (NOTES.md, fiftieth session); that entry takes it
        with 32-column slices since the fifty-first (1471.6 → 1453.0 µs), slower at the suite's other shapes,
        whose longer K loops leave the epilogue a smaller share than the side-by-side accumulators cost. Three
        warpgroups without the memory one (the MMA warpgroups issuing their own loads under each wgmma) compile for
        168 registers and took 64x256 accumulators there, 0.5-1.4% slower at best (NOTES.md, fifty-sixth session;
        tag mma-loads-measured-e99a0ac).
      k_parts: 1, or each output tile's K loop cut into k_parts equal ranges that the persistent loop runs as
        tiles of their own (more blocks where few output tiles meet a long K loop: ``gemm.gemv`` at N / 64 tiles
        under the SMs). The plain product stores each range's float32 tile into its part of a (k_parts, M, N)
        buffer that ``gemm`` sums; a fusion (an epilogue linear in the accumulator, no output tile:
        ``Fusion.store_tile`` False, no hooks along K but an a_operand whose carry passes through unchanged)
        stores each range's row vectors into its own part of its
        (k_parts · C, M) row outputs (part p: rows p · C to (p + 1) · C), which the caller sums. K a multiple of
        k_parts · tile_k. Pipeline "own", no stream-K or cluster.
    The defaults are the H100 measurements' winners (module docstring).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    num_stages: int = 4
    wg_split: str = "n"
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    grid_minor: str = "n"
    grid_tile_width: int = 8
    delay_release: int = 0
    semantics: str = "lane"
    pipeline: str = "own"
    mma_registers: int = 0
    schedule: str = "cooperative"
    cluster: str = "none"
    stream_k: int = 0
    prologue_in: str = "fourth"
    epilogue_store: str = "end"
    shared_rows_wait: int = 4
    tile_input_in: str = "buffer"
    memory_warps: int = 4
    epilogue_in: str = "mma"
    k_parts: int = 1

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
            ("delay_release", self.delay_release in (0, 1, 2), "0, 1 or 2"),
            ("semantics", self.semantics in mu.SEMANTICS, f"one of {mu.SEMANTICS}"),
            ("pipeline", self.pipeline in PIPELINES, f"one of {PIPELINES}"),
            ("mma_registers", self.mma_registers == 0 or (self.mma_registers % 8 == 0
                                                          and 168 <= self.mma_registers <= 232),
             "0 (automatic) or a multiple of 8 in [168, 232]"),
            ("schedule", self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
            ("cluster", self.cluster in CLUSTERS, f"one of {CLUSTERS}"),
            ("prologue_in", self.prologue_in in PROLOGUE_PLACES, f"one of {PROLOGUE_PLACES}"),
            ("epilogue_store", self.epilogue_store in EPILOGUE_STORES, f"one of {EPILOGUE_STORES}"),
            ("tile_input_in", self.tile_input_in in TILE_INPUT_PLACES, f"one of {TILE_INPUT_PLACES}"),
            ("memory_warps", self.memory_warps in (1, 4), "1 or 4"),
            ("epilogue_in", self.epilogue_in in EPILOGUE_PLACES, f"one of {EPILOGUE_PLACES}"),
            ("k_parts", self.k_parts >= 1, ">= 1"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{cls}.{name}: must be {allowed}, got {getattr(self, name)!r}")
        if self.tile_m * self.tile_n > 128 * 256:
            raise ValueError(f"{cls}.tile_m, tile_n: the accumulator {self.tile_m}x{self.tile_n} exceeds 128x256 "
                             "(256 float32 registers per thread)")
        if self.delay_release >= self.num_stages:
            raise ValueError(f"{cls}.delay_release: must be < num_stages={self.num_stages}")
        if self.schedule == "pingpong" and self.pipeline != "own":
            raise ValueError(f"{cls}.schedule: 'pingpong' runs on pipeline 'own', got pipeline={self.pipeline!r}")
        if self.cluster != "none" and self.pipeline != "own":
            raise ValueError(f"{cls}.cluster: {self.cluster!r} runs on pipeline 'own', got pipeline={self.pipeline!r}")
        if self.stream_k and (self.pipeline, self.schedule, self.cluster) != ("own", "cooperative", "none"):
            raise ValueError(f"{cls}.stream_k: runs on pipeline 'own', schedule 'cooperative', cluster 'none'; got "
                             f"pipeline={self.pipeline!r}, schedule={self.schedule!r}, cluster={self.cluster!r}")
        if self.k_parts > 1 and (self.pipeline, self.stream_k, self.cluster) != ("own", 0, "none"):
            raise ValueError(f"{cls}.k_parts: {self.k_parts} parts run on pipeline 'own' without stream-K or a "
                             f"cluster; got pipeline={self.pipeline!r}, stream_k={self.stream_k}, "
                             f"cluster={self.cluster!r}")
        if self.prologue_in == "memory" and (self.pipeline, self.schedule, self.cluster) != ("own", "cooperative",
                                                                                            "none"):
            raise ValueError(f"{cls}.prologue_in: 'memory' runs on pipeline 'own', schedule 'cooperative', cluster "
                             f"'none'; got pipeline={self.pipeline!r}, schedule={self.schedule!r}, "
                             f"cluster={self.cluster!r}")

        if self.tile_input_in == "ring" and (
                (self.pipeline, self.schedule, self.cluster, self.wg_split) != ("own", "cooperative", "none", "m")
                or self.tile_m != self.tile_k):
            raise ValueError(f"{cls}.tile_input_in: 'ring' puts each warpgroup's (tile_m, tile_n) tile input in a B "
                             f"stage (tile_k, tile_n): it needs tile_m == tile_k, wg_split 'm', pipeline 'own', "
                             f"schedule 'cooperative' and no cluster; got tile_m={self.tile_m}, "
                             f"tile_k={self.tile_k}, wg_split={self.wg_split!r}, pipeline={self.pipeline!r}, "
                             f"schedule={self.schedule!r}, cluster={self.cluster!r}")
        if self.memory_warps == 1 and (self.pipeline != "own" or self.prologue_in == "memory"):
            raise ValueError(f"{cls}.memory_warps: 1 runs on pipeline 'own' with prologue_in 'fourth' (a prologue in "
                             f"the memory warpgroup needs all its threads); got pipeline={self.pipeline!r}, "
                             f"prologue_in={self.prologue_in!r}")
        if self.stores_later and (self.pipeline, self.schedule) != ("own", "cooperative"):
            raise ValueError(f"{cls}.epilogue_store: {self.epilogue_store!r} runs on pipeline 'own', schedule "
                             f"'cooperative'; got pipeline={self.pipeline!r}, schedule={self.schedule!r}")
        if self.epilogue_in == "fourth" and (
                (self.pipeline, self.schedule, self.cluster, self.stream_k, self.epilogue_store,
                 self.tile_input_in) != ("own", "cooperative", "none", 0, "end", "buffer")
                or self.tile_n > 128):
            raise ValueError(f"{cls}.epilogue_in: 'fourth' runs on pipeline 'own', schedule 'cooperative', no "
                             f"cluster or stream-K, epilogue_store 'end', tile_input_in 'buffer' and tile_n <= 128 "
                             f"(with four warpgroups ptxas compiles for 128 registers, too few for a m64n256 wgmma); "
                             f"got pipeline={self.pipeline!r}, schedule={self.schedule!r}, cluster={self.cluster!r}, "
                             f"stream_k={self.stream_k}, epilogue_store={self.epilogue_store!r}, "
                             f"tile_input_in={self.tile_input_in!r}, tile_n={self.tile_n}")
        if self.epilogue_store == "split" and (self.tile_n // self.epi_tile_n) % 2:
            raise ValueError(f"{cls}.epilogue_store: 'split' stores half of the tile's {self.tile_n // self.epi_tile_n}"
                             f" pieces across tile_n={self.tile_n} at its end and half later: it needs an even number "
                             f"(epi_tile_n={self.epi_tile_n})")

    @property
    def stores_later(self) -> bool:
        """Whether part of each tile's output waits in registers for the next tile's first wgmma."""
        return self.epilogue_store != "end"

    @property
    def pingpong(self) -> bool:
        return self.schedule == "pingpong"

    @property
    def cta_m(self) -> int:
        """Rows of one CTA tile: a warpgroup's tile_m, or two stacked (cooperative, wg_split "m")."""
        return self.tile_m * (2 if self.wg_split == "m" and not self.pingpong else 1)

    @property
    def wg_rows(self) -> int:
        """Rows of the A block one compute warpgroup multiplies: tile_m when the cooperative warpgroups stack along
        M, else the whole block's cta_m."""
        return self.tile_m if self.wg_split == "m" and not self.pingpong else self.cta_m

    @property
    def cta_n(self) -> int:
        """Columns of one CTA tile: a warpgroup's tile_n, or two side by side (cooperative, wg_split "n")."""
        return self.tile_n * (2 if self.wg_split == "n" and not self.pingpong else 1)

    @property
    def cluster_size(self) -> int:
        """Blocks per cluster: 1, or 2 sharing one operand's tiles (``cluster``)."""
        return 1 if self.cluster == "none" else 2

    @property
    def cluster_m(self) -> int:
        """Rows of the output one cluster covers per tile step (two CTA tiles with cluster "m")."""
        return self.cta_m * (2 if self.cluster == "m" else 1)

    @property
    def cluster_n(self) -> int:
        """Columns of the output one cluster covers per tile step (two CTA tiles with cluster "n")."""
        return self.cta_n * (2 if self.cluster == "n" else 1)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PARTIAL_COLUMNS_MULTIPLE = 64  # elements: 128-byte swizzle atoms of 16-bit operands, 64-element ones of the output
PARTIAL_ROWS_MULTIPLE = 8  # rows: TMA copies through tiled SMEM take whole 8-row tiles of the GMEM array


def unsupported_reason(M: int, N: int, K: int, config: MosaicGemmConfig, *, names=("M", "N", "K"),
                       partial_columns: bool = False, any_columns: bool = False, partial_rows: bool = False,
                       partial_k: bool = False, any_rows: bool = False) -> str | None:
    """None when the kernel takes an (M, K) @ (K, N) product with this config; else one sentence naming the
    constraint: no partial tiles (M, N, K multiples of the CTA tile, two of them along the ``cluster`` axis, and
    tile_k). ``partial_columns``: the caller takes a last column of tiles that runs past N
    (``Fusion.partial_columns``: TMA loads zeros there and stores nothing), so N need only be a multiple of
    PARTIAL_COLUMNS_MULTIPLE (a TMA descriptor's rows hold whole swizzle atoms of up to 128 bytes), with cluster
    "none"; ``any_columns`` (B read transposed, its rows past N zero-filled, and no output tile stored), any
    positive N. ``partial_rows`` (A read as stored: ``gemm``'s ``partial_rows``): M need only be a multiple of
    PARTIAL_ROWS_MULTIPLE, the last row of tiles running past it; ``partial_k`` (A read transposed, B as stored:
    ``gemm``'s ``partial_k``): K the same, or fewer than 8 (one 8-row tile of shared memory, part-filled: TMA takes
    an outer axis shorter than its tile), the last K step running past it; ``any_rows`` (with partial_rows, where
    ``any_rows_reason`` is None): any positive M. With ``k_parts`` > 1, K a multiple of k_parts · tile_k (no last
    step past it). ``names``: what the caller calls M, N and K."""
    if config.k_parts > 1 and (K <= 0 or K % (config.k_parts * config.tile_k)):
        return (f"{names[2]}={K} is not a positive multiple of k_parts · tile_k = {config.k_parts} · "
                f"{config.tile_k} (the K loop cut into k_parts equal ranges of whole steps)")
    whose = "a cluster's two output tiles" if config.cluster_size > 1 else "a block's output tile"
    ragged = partial_columns and config.cluster == "none"
    for dim, size, tile, what in ((names[0], M, config.cluster_m, "rows"), (names[1], N, config.cluster_n, "columns"),
                                  (names[2], K, config.tile_k, "tile_k")):
        if size % tile and ((dim == names[0] and partial_rows) or (dim == names[2] and partial_k)):
            last = "row of tiles" if dim == names[0] else "step"
            if size <= 0 or (size % PARTIAL_ROWS_MULTIPLE and not (any_rows and dim == names[0])
                             and not (dim == names[2] and size < PARTIAL_ROWS_MULTIPLE)):
                return (f"{dim}={size} is not a positive multiple of {PARTIAL_ROWS_MULTIPLE} (TMA's 8-row tiles; "
                        f"the last {last} may run past it)")
            if config.pipeline != "own":
                return (f"{dim}={size} is not a multiple of {tile}: a last {last} past it needs the K loop "
                        f"pipeline='own', got {config.pipeline!r}")
            continue
        if dim == names[1] and ragged and size % tile:
            if size > 0 and any_columns:
                continue
            if size <= 0 or size % PARTIAL_COLUMNS_MULTIPLE:
                return (f"{dim}={size} is not a positive multiple of {PARTIAL_COLUMNS_MULTIPLE} (TMA's swizzled "
                        f"rows; tiles may run past it)")
            continue
        if size <= 0 or size % tile:
            what = "tile_k" if what == "tile_k" else f"the {what} of {whose}"
            return f"{dim}={size} is not a positive multiple of {what}={tile}"
    return None


def any_rows_reason(config: MosaicGemmConfig, dtype, out_dtype, transpose_b: bool = False) -> str | None:
    """None when ``gemm``'s partial_rows takes any row count M with this config, not only multiples of
    PARTIAL_ROWS_MULTIPLE; else the sentence naming why not. TMA through 8-row tiles of shared memory needs the
    GMEM array's rows in whole tiles too; so at such M, A's blocks load and the output's pieces store through
    untiled views of their shared memory, rows of one swizzle atom each, the same bytes as the 8-row tiles wgmma
    reads and the epilogue writes. That holds where tile_k and epi_tile_n are each one swizzled row (64 elements
    of a 16-bit dtype), on pipeline "own" with the epilogue in the MMA warpgroups. (The fusion's part: ``gemm``.)"""
    a_bytes, out_bytes = (config.tile_k * jnp.dtype(dtype).itemsize,
                          config.epi_tile_n * jnp.dtype(out_dtype).itemsize)
    if config.pipeline != "own" or config.epilogue_in == "fourth":
        return (f"rows past whole 8-row tiles load and store in the MMA warpgroups of the K loop pipeline='own', got "
                f"pipeline={config.pipeline!r}, epilogue_in={config.epilogue_in!r}")
    if a_bytes not in (32, 64, 128) or operand_swizzle_elems(config, dtype, transpose_b) != config.tile_k:
        return (f"rows past whole 8-row tiles need A's blocks one swizzled row wide (tile_k of 32, 64 or 128 bytes "
                f"and the operands' swizzle), got tile_k={config.tile_k} ({a_bytes} bytes), tile_n={config.tile_n}")
    if out_bytes not in (32, 64, 128):
        return (f"rows past whole 8-row tiles need the output's pieces one swizzled row wide (epi_tile_n of 32, 64 "
                f"or 128 bytes), got epi_tile_n={config.epi_tile_n} of {jnp.dtype(out_dtype)} ({out_bytes} bytes)")
    return None


def operand_swizzle_elems(config: MosaicGemmConfig, dtype, transpose_b: bool = False) -> int:
    """Elements per swizzled row of the A and B stage tiles (one swizzle for both: wgmma takes one): the largest of
    128, 64 or 32 bytes whose elements divide tile_k and, with B read as stored (N minor), tile_n. A 160-column
    tile (wave quantization: ``partial_columns``) swizzles 64 bytes of bf16."""
    itemsize = jnp.dtype(dtype).itemsize
    for swizzle in (128, 64, 32):
        elems = swizzle // itemsize
        if config.tile_k % elems == 0 and (transpose_b or config.tile_n % elems == 0):
            return elems
    raise ValueError(f"tile_k={config.tile_k}, tile_n={config.tile_n}: no swizzle of 32, 64 or 128 bytes "
                     f"({jnp.dtype(dtype)}) divides both")


def sum_rows_grid(config: MosaicGemmConfig, row_tiles: int, grid: int) -> tuple[int, bool, int]:
    """(``Fusion.sum_rows``) The blocks of the persistent grid, whether its tiles follow the planar snake, and its
    runs' width: whole runs of it (width row blocks times their row_tiles tiles each, ``grid_minor`` "m") a round
    where such a run fits the grid, else row-major rows. Each round then holds whole rows. The snake's runs took the
    dx kernel of rmsnorm_matmul from 1567.1 to 1541.0 µs at 32768x4096x4096 on the H200 and left four smaller shapes
    within 0.6 µs, on 128 blocks where row-major had 132 at three of them (``toggle_ab_sum_rows_snake-h200-094a30a
    .json``). Where config.grid_tile_width's runs leave more than an eighth of the grid idle (96 of 132 blocks at
    12 tiles a row, 80 at 10), the width keeping the most blocks takes its place, the widest of those (11 at 12
    tiles a row: one run a round): the dx kernel at 16384x3072x8192 1382.1 → 1092.3 µs on the H200, where width 1
    took 1110.4 (``rmsnorm_matmul_configs_dx_grid-h200-1b2644e.json``); forward + backward on the H200 3415.6 →
    3147.7 µs there, 1907.7 → 1683.2 at 8192x2560x10240 (10 tiles a row), 973.0 → 916.3 at 8192x1536x8960 (6)
    (``toggle_ab_sum_rows_widen-h200-cda668d.json``). At 120 of 132 blocks (3 tiles a row, width 8) the 132 of
    widths 1, 4 or 11 were 1.3-1.5 µs slower (both rounds needed either way), so a smaller loss keeps the width."""
    def kept(width: int) -> tuple[int, bool]:  # (blocks a round, snake) with runs of width row blocks
        run = width * row_tiles
        snake = config.grid_minor == "m" and run <= grid
        return grid - grid % (run if snake else row_tiles), snake

    width = config.grid_tile_width
    if config.grid_minor == "m" and kept(width)[0] < grid - grid // 8:
        width = max(range(1, grid // row_tiles + 1), key=lambda w: (kept(w)[0], w))
    return (*kept(width), width)


def smem_bytes(config: MosaicGemmConfig, dtype, out_dtype, *, tile_input_dtypes: tuple = (),
               store_in_tile: bool = False, scratch_bytes: int = 0) -> int:
    """Shared memory one block allocates (bytes; barriers and Mosaic's reduction scratch excluded): the
    pipeline's A/B tiles, the output staging, prefetched tile inputs and the hooks' scratch."""
    size = jnp.dtype(dtype).itemsize
    per_stage = (config.cta_m + config.cta_n) * config.tile_k * size
    pieces = (config.tile_m // config.epi_tile_m) * (config.tile_n // config.epi_tile_n)
    staging = 0 if store_in_tile else 2 * min(2, pieces) * config.epi_tile_m * config.epi_tile_n * jnp.dtype(
        out_dtype).itemsize
    tiles = 0 if config.tile_input_in == "ring" else sum(
        2 * config.tile_m * config.tile_n * jnp.dtype(d).itemsize for d in tile_input_dtypes)
    if config.epilogue_in == "fourth":  # the accumulators' buffer; a column slice of each tile input
        staging = 2 * config.tile_m * config.tile_n * jnp.dtype(out_dtype).itemsize
        tiles = sum(config.tile_m * config.epi_tile_n * jnp.dtype(d).itemsize for d in tile_input_dtypes)
    return config.num_stages * per_stage + staging + tiles + scratch_bytes
