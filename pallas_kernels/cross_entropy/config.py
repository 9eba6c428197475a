"""Linear cross-entropy configs: the Triton backend's LinearCrossEntropyConfig, the token-chunk rule, the
tuning-cache key, the default config of a call and the block-size sweep's candidates.

  config = for_shape(default_config(h, w), *h.shape, w.shape[1], h.dtype)   # tuned or built-in, chunk_rows resolved
  chunk_rows_for(8192, 4096, 128256, jnp.bfloat16)                          # 2048: the memory rule's Bc
  forward, backward = sweep_candidates(h, w)                                # for `jaxfuse bench --tune`
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels import tuning
from pallas_kernels.index_math import is_int

__all__ = ["FORWARD_FIELDS", "LinearCrossEntropyConfig", "chunk_rows_for", "default_config", "eval_chunk_rows_for",
           "for_shape", "shape_key", "sweep_candidates"]

OP = "linear_cross_entropy"  # the op's name in the tuning cache
# The row kernel's fields: forward sweep candidates (timed on evaluation: the statistics pass) vary these,
# backward candidates (timed on value and gradient) the others.
FORWARD_FIELDS = ("rows_per_program", "block_v", "num_warps", "num_stages")
# chunk_rows=None: temporaries at most this fraction of the plain XLA loss's. Measured on the H100 (NOTES.md,
# cross_entropy_chunks-h100-91d3ae2.json), value and gradient against plain XLA at chunk_rows sizing 5% / 10%:
# 0.93 / 1.11x at 4096x2048x256000 (512 / 1024 rows), 1.04 / 1.09x at 8192x4096x128256 (1024 / 2048), 1.00 / 1.06x
# at 16384x4096x32000 (1024 / 2048), 0.60 / 1.11x at 4096x2048x128256 (the 1b model's head: 256 / 1024). Smaller
# chunks re-read and re-write dw (H·V) more often, and below Bc·H / (2·H + Bc) ≈ 270 FLOPs per byte that update
# runs on bandwidth; ``temp_fraction=0.05`` keeps the 5% bound at that cost.
TEMP_FRACTION = 0.10
GEMM_WORKSPACE_BYTES = 32 * 2**20  # XLA's cuBLAS workspace, one temporary (s8[33554432] in the H100 programs)
# The longest chunk the memory rule takes when B does not fit whole: 16 row tiles of the logits GEMM's 128 rows, past
# which its tiles ran slower (cross_entropy_logits_order-h100-c4b6294.json): at 16384x4096x32000 within 10%, 2048
# rows (8 chunks) 1.058 / 1.055x XLA against 3328 (5 chunks) 1.047 / 1.041x in two runs (-c4b6294, -b61eb60).
MAX_CHUNK_ROWS = 2048

_CHOICES = {"dw_dtype": ("param", "float32"), "logits_dtype": ("compute", "float32"), "row_pass": ("pallas", "xla"),
            "dw_gemm": ("auto", "xla", "mosaic"), "logits_gemm": ("auto", "xla", "mosaic"),
            "dh_gemm": ("auto", "xla", "mosaic"), "fused_step": ("off", "on"), "softmax": ("auto", "rows", "epilogue")}


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyConfig:
    """Token chunks, the row kernel's tiles and the precision choices (one static, hashable argument).

    Attributes:
      chunk_rows: Bc, tokens per chunk (one chunk's (Bc, V) logits are the largest temporary); None: the memory
        rule of ``chunk_rows_for`` with temp_fraction, resolved per call (``for_shape``).
      temp_fraction: the memory rule's bound, a fraction of the plain XLA loss's temporaries (default
        TEMP_FRACTION, 10%: smaller chunks cost time, see TEMP_FRACTION).
      eval_chunk_rows: tokens per chunk of the loops that compute no gradient (evaluation, and the forward of
        reduction="none"): one GEMM per chunk and no dh, dw or (Bc, H) dh slices; None: ``eval_chunk_rows_for``.
      rows_per_program, block_v: the row kernel's tile: each program owns rows_per_program rows (a power of two)
        and walks the vocabulary in (rows_per_program, block_v) tiles.
      num_warps, num_stages: Triton launch parameters of the row kernel.
      dw_dtype: "param" accumulates dw across chunks in w's dtype (one rounding per chunk); "float32" in an
        (H, V) float32 buffer (a better dw for H·V·4 bytes more temporary memory).
      logits_dtype: "compute": the logits GEMM writes the input dtype (as XLA's plain loss does); "float32":
        float32 logits (twice the bytes; dlogits then go to a separate buffer in the input dtype).
      row_pass: "pallas" (the row kernel) or "xla" (the same math as jnp, fused by XLA as it can).
      dw_gemm: who adds each chunk's h_cᵀ·dlogits_c into dw: "xla" (cuBLAS with beta = 1, reading dw in its
        epilogue), "mosaic" (the Mosaic-GPU GEMM core with ``accumulate_into``: each dw tile is prefetched while
        the tile's K loop runs; sm90, 16-bit dw, H a multiple of 128, V of 256, Bc of 64), "auto" (default:
        mosaic where it runs and chunks have at most ``gemm.SHORT_K`` = 512 rows, its ping-pong update; else xla).
        Why (H100, value and gradient against plain XLA, benchmarks/results/NOTES.md): with 512-row chunks the
        Mosaic update ran 0.981x XLA at 4096x2048x256000 where cuBLAS's ran 0.946x, with 256-row chunks at the 1b
        head 0.669x against 0.599x; with 1024-row chunks it was as fast at 8192x4096x128256 (1.023 vs 1.017x) and
        slower at 16384x4096x32000 (0.997 vs 1.033x). The default 10% rule's chunks at the suite shapes are larger
        than 512 rows: cuBLAS's.
      logits_gemm: who computes each chunk's logits when the gradient is wanted: "xla" (cuBLAS; the row kernel
        then reads them twice, for the log-sum-exp and for dlogits), "mosaic" (the Mosaic-GPU GEMM core with the
        softmax statistics in its epilogue, ``mosaic_logits``: the row kernel reads them once; sm90, 16-bit inputs,
        no logit_soft_cap, float32 logits not asked for, whole GEMM tiles), "auto" (default: mosaic where it runs,
        else xla). Evaluation (no gradient) keeps cuBLAS and the statistics pass.
      dh_gemm: who computes each chunk's dh_c = dlogits_c·wᵀ: "xla" (its GEMM, whose (Bc, H) result a copy then
        writes into dh's rows), "mosaic" (the Mosaic-GPU GEMM core: XLA writes its result into dh's rows in place,
        a dynamic-slice fusion of the custom call; sm90, 16-bit h and w of one dtype, whole tiles: Bc a multiple
        of 128, H of 256, V of 64), "auto" (default: mosaic where it runs and its (Bc / 128)·(H / 256) output tiles
        fill at least 90% of the GPU's SMs over the waves they take, else xla: it has no split-K for short, wide
        chunks, nor stream-K for a last wave of few tiles). Measured on the H100 at 1024x4096x32000 per chunk, 16
        steps: 5152 µs against XLA's GEMM 5135 plus its copies 73; 1536-row chunks (192 tiles in two waves) made the
        loss 6% slower with it than with XLA's (``triton._DH_MIN_WAVE``).
      softmax: where the forward rule's chunks take the softmax: "rows" (the row kernel reads the logits back and
        writes dlogits over them), "epilogue" (the Mosaic logits GEMM's epilogue writes exp(z − c), c a per-chunk
        shift; GEMMs 2 and 3 scale its rows: no pass over the logits, ``epilogue_softmax``; needs the Mosaic
        logits GEMM and bf16; where a row's loss passes 80 nats or its lse lies more than 40 nats from the chunk
        before's mean, the call runs again the "rows" way), "auto" (default: "epilogue" where it can run, else
        "rows").
      fused_step: "on": the gradient's chunk loop (the forward rule of reduction "mean" / "sum"; "none"'s backward
        keeps the separate GEMMs) runs chunk c − 1's dw update and chunk c's logits GEMM (with its
        statistics) as one Mosaic-GPU kernel (``mosaic_step``; sm90, B two or more whole chunks, 16-bit h, w and
        dw of one dtype, H a multiple of chunk_rows, no logit_soft_cap; it overrides ``dw_gemm`` and
        ``logits_gemm``); "off" (default): the two GEMMs as those say. Off because it is slower: on the H100 at
        the 5% rule's chunks, 1962 µs per step against 1745 for the two kernels at 4096x2048x256000 and 4137
        against 3091 at 8192x4096x128256 (``mosaic_step``'s docstring; benchmarks/results/NOTES.md).
    """

    # Row-kernel defaults: the fastest of four tilings timed alone on the H100 at the suite's shapes
    # (benchmarks/results/cross_entropy_chunked-rows-h100.json): one row per program gives a chunk of 512-1024 rows
    # enough programs to keep loads in flight (4 rows × 2048: 345 µs per 1024×128256 chunk; 1 × 4096: 314 µs).
    chunk_rows: int | None = None
    temp_fraction: float = TEMP_FRACTION
    eval_chunk_rows: int | None = None
    rows_per_program: int = 1
    block_v: int = 4096
    num_warps: int = 4
    num_stages: int = 1
    dw_dtype: str = "param"
    logits_dtype: str = "compute"
    row_pass: str = "pallas"
    dw_gemm: str = "auto"
    logits_gemm: str = "auto"
    dh_gemm: str = "auto"
    fused_step: str = "off"
    softmax: str = "auto"

    def __post_init__(self):
        tu.check_launch_fields(self)  # block_v, num_warps, num_stages
        cls = type(self).__name__
        for name in ("chunk_rows", "eval_chunk_rows"):
            rows = getattr(self, name)
            if rows is not None and (not is_int(rows) or rows < 1):
                raise ValueError(f"{cls}.{name}: must be None or a positive int, got {rows!r}")
        if isinstance(self.temp_fraction, bool) or not isinstance(self.temp_fraction, (int, float)) \
                or not 0 < self.temp_fraction <= 1:
            raise ValueError(f"{cls}.temp_fraction: must be a number in (0, 1], got {self.temp_fraction!r}")
        r = self.rows_per_program
        if not is_int(r) or r < 1 or r & (r - 1):
            raise ValueError(f"{cls}.rows_per_program: must be a power of two >= 1, got {r!r}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{cls}.{name}: must be one of {allowed}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def shape_key(h, w) -> str:
    """Tuning-cache key: dtype, B, H, V."""
    return f"{jnp.dtype(h.dtype).name}[B={h.shape[0]},H={h.shape[1]},V={w.shape[1]}]"


def chunk_rows_for(B: int, H: int, V: int, dtype, fraction: float = TEMP_FRACTION) -> int:
    """Bc from the memory rule: one chunk's logits, its (Bc, H) slices of h and dh and XLA's 32 MiB GEMM workspace
    within ``fraction`` (default TEMP_FRACTION, 10%) of the plain XLA loss's B·V·(s + 4) bytes (compute-dtype logits
    plus their float32 copy; s the itemsize), so Bc ≈ 0.3·B·V / (V + 2·H) in bf16 at 10%, less the workspace, at
    least 128 rows. B itself when it fits; else the fewest chunks of at most that limit and MAX_CHUNK_ROWS rows, B
    split evenly and rounded up to a multiple of 128 (the last chunk takes the B − (n − 1)·Bc rows left).

    Why the fewest chunks (H100, value and gradient against plain XLA): each chunk re-reads and re-writes dw (H·V)
    and runs its own small kernels, and where the update turns bandwidth-bound (short chunks) each extra chunk costs
    a whole pass over dw. Within 5%: at the 1b model's head (4096x2048x128256) 256-row chunks (a divisor of B) ran
    0.59x and 384-row ones (11 chunks) 0.77x (cross_entropy_chunks_*-h100-5a405ac.json); at 16384x4096x32000 1024
    rows (16 chunks) 1.017-1.029x and 1536 (11, the last of 1024) 1.038-1.053x in five runs (-019d28d, -00f4e6b,
    cross_entropy_chunks_16k_32k-h100-{b61eb60,a9aae4b}.json, cross_entropy_5pct-h100-ac73455.json). Within 10% at
    the small model's head (8192x512x32768): 1024 rows 1.28x, 1664 (5 chunks) 1.33x."""
    s = jnp.dtype(dtype).itemsize
    budget = fraction * B * V * (s + 4) - GEMM_WORKSPACE_BYTES
    limit = max(128, int(budget // ((V + 2 * H) * s)) // 128 * 128)
    if B <= limit:
        return B
    limit = min(limit, MAX_CHUNK_ROWS)
    return min(limit, pl.cdiv(pl.cdiv(B, pl.cdiv(B, limit)), 128) * 128)


def eval_chunk_rows_for(B: int, chunk_rows: int) -> int:
    """Rows per chunk of the loops without gradients: the larger of chunk_rows and a quarter of B (rounded down to
    a multiple of 128), at most B: that loop's only large temporary, one chunk's logits, then stays within about a
    quarter of the (B, V) logits plain XLA's forward holds. Measured on the H100 (benchmarks/results/NOTES.md),
    evaluation against XLA's forward with chunks of 1024 / 2048 / 4096 rows: 1.00 / 1.03 / 1.03x at
    8192x4096x128256; 512 / 1024 / 2048: 0.99 / 1.04 / 1.07x at 4096x2048x256000; 1024 / 2048 / 4096: 0.96 / 1.00
    / 1.01x at 16384x4096x32000 (this rule takes 2048, 1024 and 4096 there)."""
    quarter = B // 4 // 128 * 128
    return min(B, max(chunk_rows, quarter))


def default_config(h, w, *, on_gpu: bool | None = None) -> LinearCrossEntropyConfig:
    """The config a call uses without ``block_sizes``: the tuning cache entry for this device and shape if there is
    one, else the built-in table (GPU defaults, or small tiles and chunks on CPU). chunk_rows may be None, resolved
    per call (``for_shape``)."""
    on_gpu = jax.default_backend() == "gpu" if on_gpu is None else on_gpu
    params = tuning.lookup(OP, shape_key(h, w)) if on_gpu else None
    if params is None:
        params = tuning.linear_cross_entropy_table(h.dtype, on_gpu=on_gpu)
    return LinearCrossEntropyConfig(**params)


def for_shape(config: LinearCrossEntropyConfig, B: int, H: int, V: int, dtype) -> LinearCrossEntropyConfig:
    """chunk_rows and eval_chunk_rows resolved (``chunk_rows_for`` and ``eval_chunk_rows_for`` when None), each at
    most B."""
    rows = chunk_rows_for(B, H, V, dtype, config.temp_fraction) if config.chunk_rows is None else config.chunk_rows
    eval_rows = eval_chunk_rows_for(B, rows) if config.eval_chunk_rows is None else config.eval_chunk_rows
    return dataclasses.replace(config, chunk_rows=min(rows, B), eval_chunk_rows=min(eval_rows, B))


# Sweep candidates, overrides of the default config. Forward: the row-kernel tilings of the H100's row sweep
# (cross_entropy_chunked-rows-h100.json). Backward: the same math in XLA instead of the row kernel. Neither changes
# the temporary memory (chunk_rows stays the rule's: a larger chunk would be faster and break the memory bound).
_FORWARD_OVERRIDES = [{}, {"rows_per_program": 4, "block_v": 2048, "num_warps": 8},
                      {"block_v": 8192, "num_warps": 8}, {"rows_per_program": 2, "num_warps": 8}]
_BACKWARD_OVERRIDES = [{}, {"row_pass": "xla"}]


def sweep_candidates(h, w) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidate parameter dicts at h (B, H), w (H, V): the GPU default first, forward ones
    varying only FORWARD_FIELDS, backward ones the others."""
    base = default_config(h, w, on_gpu=True).to_dict()
    return ([LinearCrossEntropyConfig(**dict(base, **o)).to_dict() for o in _FORWARD_OVERRIDES],
            [LinearCrossEntropyConfig(**dict(base, **o)).to_dict() for o in _BACKWARD_OVERRIDES])
