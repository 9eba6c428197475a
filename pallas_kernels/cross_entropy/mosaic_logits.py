"""GEMM 1 of a token chunk on the Mosaic-GPU core, with the softmax statistics in its epilogue.

    logits, lse = logits_and_lse(h_c, w)       # h_c (Bc, H), w (H, V) 16-bit -> (Bc, V) in h's dtype, (Bc,) float32
    e, sumexp = probabilities(h_c, w, offset)  # exp(logits − offset[:, None]) (Bc, V) in h's dtype, Σ_j e (Bc,)
    unsupported_reason(Bc, H, V, dtype)        # None, or the sentence why this chunk cannot take it

The chunk loop (``triton.py``) otherwise writes the logits with cuBLAS and its row kernel reads them twice: once
for the log-sum-exp, once to write dlogits. Here each compute warpgroup, holding a (tile_m, tile_n) float32 tile of
logits, also stores per row the tile's maximum and Σ exp(z − max) into (V / tile_n, Bc) arrays; a small XLA
reduction combines the column blocks, lse = M + log Σ_c s_c·exp(m_c − M) with M = max_c m_c, and the row kernel
only writes dlogits: per chunk one read of the logits fewer, Bc·V·s bytes (2.1 GB at 8192x128256 in bf16).

The statistics are taken over the logits rounded to the input dtype, the values the row kernel reads back for
dlogits (as on the cuBLAS path, where it computes both from them): a log-sum-exp of the unrounded float32
accumulator instead left dh 1.5x further from the float32 reference (softmax of the rounded logits no longer
summing to 1). Needs an sm90 GPU (or GPU
interpret mode on the CPU, ``mosaic_utils.interpret_on_cpu``), 16-bit inputs, and the GEMM core's whole tiles: Bc
a multiple of its block's rows (128), V of its columns (128), H of tile_k (64).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import backends
from pallas_kernels import gemm as mosaic_gemm
from pallas_kernels import mosaic_utils as mu

__all__ = ["config_for", "logits_and_lse", "lse_from_blocks", "probabilities", "tile_statistics",
           "unsupported_reason"]

_F32 = jnp.float32
_BLOCK_MAX, _BLOCK_SUMEXP, _OFFSET = "block_max", "block_sumexp", "row_offset"
_OFFSET_AT_TILE_START_MAX_ROWS = 1536  # longer chunks read the probabilities' offsets in the epilogue


# Ping-pong 128x128 tiles first: one warpgroup's epilogue (the statistics' exp and sums, the store) runs under the
# other's K loop. Per 5%-rule loss on the H100 (cross_entropy_logits_configs_5pct-h100-7aebaf1.json), the logits
# GEMMs took 5872 µs at 4096x2048x256000 (cuBLAS's plain logits 5712, the core's default stacked 64x256 tiles
# 6145), 11314 at 8192x4096x128256 (11205, 11772) and 5822 at 16384x4096x32000 (5536, 5766).
# No stream-K: its workspace (up to 17 MB) is temporary memory the loss's budget counts, and it is not measured here.
_CANDIDATES = tuple(dataclasses.replace(c, stream_k=0) for c in (mosaic_gemm.CANDIDATES[1], *mosaic_gemm.CANDIDATES))


# Tile order: runs of grid_tile_width row tiles (tile_m rows each) along the vocabulary. Runs of 8 lose where a chunk
# has more than 16 row tiles. The logits GEMM with its statistics alone at H = 4096, V = 32000, µs per 16384 rows,
# runs of 8 / 4 (benchmarks/results/cross_entropy_logits_order-h100-c4b6294.json, `python benchmarks/scripts/
# cross_entropy_logits_order.py`): 5987 / 6096 at 1024-row chunks, 5791 / 5959 at 2048, 7266 / 5951 at 3328 (26 row
# tiles); in a run before, 5711 / 5832 at 1536.
_LONG_CHUNK_ROW_TILES, _LONG_CHUNK_RUN = 16, 4


def config_for(Bc: int, H: int, V: int, dtype) -> mosaic_gemm.MosaicGemmConfig:
    """The GEMM core's config for (Bc, H) @ (H, V): ping-pong 128x128 tiles where they divide the shapes, else the
    core's default (``gemm.pick_config``), in runs of 4 row tiles where the chunk has more than 16. In GPU interpret
    mode on the CPU the default's: jax 0.10.2's interpreter rejects the ping-pong barriers at 128x128 tiles
    ("operate on barrier without indexing")."""
    del dtype
    config = mosaic_gemm.pick_config(Bc, V, H, _CANDIDATES[1:] if mu.interpreting() else _CANDIDATES)
    if Bc // config.cta_m > _LONG_CHUNK_ROW_TILES and config.grid_minor == "m":
        config = dataclasses.replace(config, grid_tile_width=min(config.grid_tile_width, _LONG_CHUNK_RUN))
    return config


def unsupported_reason(Bc: int, H: int, V: int, dtype) -> str | None:
    """None when the logits of a (Bc, H) @ (H, V) chunk can come from this kernel; else one sentence why not."""
    if not mu.interpreting():
        reason = backends.unavailable_reason("mosaic")
        if reason:
            return reason
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the Mosaic logits GEMM takes 16-bit inputs, got {jnp.dtype(dtype).name}"
    return mosaic_gemm.unsupported_reason(Bc, V, H, config_for(Bc, H, V, dtype), names=("chunk_rows", "V", "H"))


def tile_statistics(acc: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(z, max, Σ exp(z − max)) of a float32 accumulator tile (tile_m, tile_n): z the tile rounded to ``dtype``
    (what is stored; the row kernel's softmax of it sums to 1) as float32, the statistics per row (tile_m,)."""
    z = acc.astype(dtype).astype(_F32)
    block_max = jnp.max(z, axis=1)
    block_sumexp = jnp.sum(jnp.exp(z - lax.broadcast_in_dim(block_max, z.shape, [0])), axis=1)
    return z, block_max, block_sumexp


def lse_from_blocks(block_max: jax.Array, block_sumexp: jax.Array) -> jax.Array:
    """lse (Bc,) float32 of per-column-block statistics (C, Bc): M + log Σ_c s_c·exp(m_c − M), M = max_c m_c."""
    row_max = jnp.max(block_max, axis=0)
    return row_max + jnp.log(jnp.sum(block_sumexp * jnp.exp(block_max - row_max), axis=0))


def _stats_fusion(Bc: int, V: int, tile_n: int, dtype) -> mosaic_gemm.Fusion:
    """Epilogue: the tile rounded to ``dtype`` (what is stored), and per row its max and Σ exp(z − max) over those
    rounded values, into row ``col_block`` of the (V / tile_n, Bc) outputs."""
    blocks = V // tile_n

    def epilogue(ctx, acc, carry):
        del ctx, carry
        z, block_max, block_sumexp = tile_statistics(acc, dtype)
        return z, {_BLOCK_MAX: block_max, _BLOCK_SUMEXP: block_sumexp}

    stats = jax.ShapeDtypeStruct((blocks, Bc), _F32)
    return mosaic_gemm.Fusion(outputs=((_BLOCK_MAX, stats), (_BLOCK_SUMEXP, stats)), epilogue=epilogue)


def _probabilities_fusion(Bc: int, V: int, tile_n: int, dtype) -> mosaic_gemm.Fusion:
    """Epilogue: e = exp(z − offset) per row, z the tile rounded to ``dtype`` (as the statistics take it), e rounded
    to ``dtype`` (what is stored), and per row Σ e over those rounded values, into row ``col_block`` of the
    (V / tile_n, Bc) output."""
    # Where the offset rows are read, measured on the H100 (kernel alone: benchmarks/results/
    # cross_entropy_probabilities_probe-h100-0dbb964.json; in the 5% loss: cross_entropy_epilogue_softmax_5pct_*-h100-
    # {8950e5d,0a4ef9f}.json): at 2048 rows read at the tile's start (``prologue_init``) the kernel took 3403 µs, a
    # constant offset with no read 3392, the read in the epilogue 2833 (the statistics kernel 2819); at 512-1536 rows
    # in the loss the read at the tile's start was the faster, by 1-7% (8 chunks of 1024 rows: 11463 against 12284
    # µs). Why is not understood. (The exp of the unrounded accumulator ran 15% slower at 1024 rows:
    # cross_entropy_probabilities_probe-h100-1bf450c.json.)
    read_in_epilogue = Bc > _OFFSET_AT_TILE_START_MAX_ROWS

    def epilogue(ctx, acc, offset):
        z = acc.astype(dtype).astype(_F32)
        offset = ctx.load_rows(_OFFSET) if read_in_epilogue else offset
        e = jnp.exp(z - lax.broadcast_in_dim(offset, z.shape, [0])).astype(dtype).astype(_F32)
        return e, {_BLOCK_SUMEXP: jnp.sum(e, axis=1)}

    stats = jax.ShapeDtypeStruct((V // tile_n, Bc), _F32)
    return mosaic_gemm.Fusion(
        inputs=(_OFFSET,), outputs=((_BLOCK_SUMEXP, stats),), epilogue=epilogue,
        prologue_init=None if read_in_epilogue else (lambda ctx: ctx.load_rows(_OFFSET)))


def _checked_config(h_c: jax.Array, w: jax.Array) -> mosaic_gemm.MosaicGemmConfig:
    (Bc, H), V = h_c.shape, w.shape[1]
    reason = unsupported_reason(Bc, H, V, h_c.dtype)
    if reason:
        raise ValueError(f"linear_cross_entropy logits on the Mosaic GEMM: {reason}")
    return config_for(Bc, H, V, h_c.dtype)


def logits_and_lse(h_c: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits (Bc, V) in h_c's dtype, lse (Bc,) float32) of h_c (Bc, H) @ w (H, V); ValueError (naming the
    constraint) where ``unsupported_reason`` says no."""
    config = _checked_config(h_c, w)
    V = w.shape[1]
    logits, block_max, block_sumexp = mosaic_gemm.gemm(
        h_c, w, config=config, out_dtype=h_c.dtype, fusion=_stats_fusion(h_c.shape[0], V, config.tile_n, h_c.dtype),
        name="linear_cross_entropy_logits")
    return logits, lse_from_blocks(block_max, block_sumexp)


def probabilities(h_c: jax.Array, w: jax.Array, offset: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(e (Bc, V) in h_c's dtype, sumexp (Bc,) float32): e = exp(h_c @ w − offset[:, None]), the logits rounded to
    h_c's dtype first (as ``logits_and_lse`` takes them) and e rounded, and Σ_j e over the rounded values; offset
    (Bc,) float32 (a row whose offset is the float32 maximum gets e = 0). lse = offset + log(sumexp). Same
    constraints as ``logits_and_lse``."""
    config = _checked_config(h_c, w)
    (Bc, _), V = h_c.shape, w.shape[1]
    e, block_sumexp = mosaic_gemm.gemm(
        h_c, w, config=config, out_dtype=h_c.dtype, fusion=_probabilities_fusion(Bc, V, config.tile_n, h_c.dtype),
        arrays={_OFFSET: offset.astype(_F32)}, name="linear_cross_entropy_probabilities")
    return e, jnp.sum(block_sumexp, axis=0)
