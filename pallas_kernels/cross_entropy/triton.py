"""The Triton backend of linear_cross_entropy: token chunks, gradients computed in the forward, 3 GEMMs, no (B, V)
buffer.

Shape notation: B tokens, H hidden size, V vocabulary, Bc tokens per chunk (``config.chunk_rows``), s the input
itemsize. Liger-Kernel's design, with XLA's GEMMs (cuBLAS on GPU) and one Pallas-Triton kernel per chunk for the
vocabulary-wide row work (``triton_rows.py``):

  per chunk c of Bc rows:  logits_c = h_c @ w                       (Bc, V) input dtype, GEMM 1
                           lse, label logit; dlogits_c in place      the row kernel
                           dh[c] = dlogits_c @ wᵀ                    (Bc, H), GEMM 2, written once (``dh_gemm``:
                                                                     on the Mosaic core, straight into dh's rows)
                           dw += h_cᵀ @ dlogits_c                    (H, V), GEMM 3, accumulated over chunks

With ``logits_gemm`` (default "auto": on sm90 where the tiles divide the shapes) the forward rule's chunks take
their logits from the Mosaic GEMM core, whose epilogue also stores per-row softmax statistics
(``mosaic_logits.py``): the lse comes from them, and the row kernel only writes dlogits (one read of the chunk's
logits fewer). With ``softmax`` (default "auto": bf16 chunks on those) the epilogue writes
exp(z − c) instead, c a per-chunk shift, and no kernel reads the logits back (``epilogue_softmax.py``): GEMM 2
scales its output rows and GEMM 3 its h_c rows by dlogits' row scale; a call with a row out of that path's range
runs again the row kernel's way.

``fused_step="on"`` (off by default: measured slower) runs chunk c − 1's dw update and chunk c's logits GEMM as one
Mosaic-GPU kernel (``mosaic_step.py``), the logits written over chunk c − 1's dlogits.

Paths. ``reduction="mean"|"sum"`` is a scalar ``custom_vjp``: its primal (evaluation, no gradient) runs GEMM 1 and
the statistics pass only (1 GEMM, like XLA's forward); its forward rule runs the GEMMs with dlogits_c already
scaled by the row weight (1/count or 1, 0 for ignored rows) and keeps dh (B, H) and dw (H, V) as residuals; the
backward rule multiplies them by the scalar cotangent (a constant 1 under ``value_and_grad``, which XLA folds
away). The rule sees which inputs are differentiated (``symbolic_zeros``): with w not differentiated (a frozen LM
head) GEMM 3 is never traced, with h not differentiated GEMM 2 (under jit, dead-code elimination would also drop
the unused GEMM; outside jit it would run). ``reduction="none"`` needs the per-row
cotangent inside the GEMMs: its forward rule is the 1-GEMM path keeping lse (B,), its backward recomputes logits_c
(4 GEMMs in all).

Cost model (F = 2·B·H·V FLOPs, one GEMM of the problem; n = B / Bc chunks):
  evaluation: 1 F. HBM: w read n times (L2 absorbs little), logits written once and read once (2·B·V·s).
  value and gradient: 3 F. The row kernel reads each chunk's logits twice and writes dlogits over them: 3·B·V·s
  bytes (2·B·V·s with the statistics from the Mosaic logits GEMM, none with the epilogue's softmax: the logits
  GEMM writes B·V·s, GEMMs 2 and 3 read it). The dw GEMM reads and writes dw (H·V·s each)
  at every chunk but the first (XLA folds the add into the cuBLAS call as beta = 1): 2·(n − 1)·H·V·s bytes,
  overlapped with its 2·Bc·H·V FLOPs when Bc·H / (2·H + Bc) exceeds the machine's FLOP/byte ratio (about 270 on an
  H100), i.e. Bc >~ 600 at H = 4096.
Stored (temporaries): one chunk's logits Bc·V·s (dlogits overwrite them), the chunk's (Bc, H) slices of h and dh,
per-row statistics, XLA's 32 MiB GEMM workspace; dh and dw are the outputs themselves (updated in place). dw
accumulates in w's dtype by default: each chunk's GEMM adds in float32 and rounds once, so a bf16 dw carries about
sqrt(n) bf16 roundings (``dw_dtype="float32"``: an H·V·4 accumulator instead). ``chunk_rows=None`` takes Bc from
``config.chunk_rows_for``: temporaries within ``temp_fraction`` (default 10%) of the plain XLA loss's. The loops
without gradients (evaluation) take chunks of ``eval_chunk_rows`` (default: a quarter of B where that is larger).

Measured (H100, bf16, CUPTI, XLA in the same run; benchmarks/results/NOTES.md, "Linear cross-entropy"): with
temp_fraction=0.05 (512, 1024 and 1536-row chunks, 4.97-4.99% of XLA's temporaries) and the epilogue's softmax,
fwd+bwd 1.098-1.105x at 4096x2048x256000, 1.084-1.108x at 8192x4096x128256, 1.076-1.096x at 16384x4096x32000 in
two runs (the row kernel's way 1.019-1.026 / 1.031-1.062 / 1.041-1.057x in the same runs;
cross_entropy_epilogue_softmax_5pct_*-h100-{8950e5d,a4e1813}.json); with the default 10% rule 1.24x, 1.14x and
1.11x (cross_entropy-h100-a4e1813.md). Evaluation 1.02-1.05x.

Why not the earlier design (one Pallas kernel for the forward's online log-sum-exp over vocabulary tiles, a
backward recomputing the logits: 4 GEMMs, Pallas-Triton GEMMs 15-20% below cuBLAS; in the history up to commit
e9abf09): it was 0.68-0.73x XLA's forward+backward at every suite shape. Its one advantage was memory (a forward
with ~1 MiB of temporaries, forward+backward 2.3-3.6% of XLA's at two shapes but 10.3% at the third); this design
meets a 5% bound at all three when asked (temp_fraction=0.05) and is faster than XLA with 10%, so the old one was
removed rather than kept as an option;
its lessons are in NOTES.md.

Chunks: the last chunk, the B − (n − 1)·Bc rows after n − 1 whole chunks, runs first, outside the loop (its dw
GEMM initializes dw: no memset, no read), so no row is computed twice. Only where the config asks for a Mosaic GEMM
that those rows do not tile does it take Bc rows, sharing some with the chunk before, which get weight 0 there.

Reached through ``pallas_kernels.linear_cross_entropy(..., backend="triton")``, which validates the inputs and
resolves the config; the backend-module contract is in ``pallas_kernels.backends``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backends
from pallas_kernels import triton_utils as tu
from pallas_kernels import gemm as mosaic_gemm
from pallas_kernels import mosaic_utils as mu
from pallas_kernels.cross_entropy import config as _config
from pallas_kernels.cross_entropy import epilogue_softmax, mosaic_logits, mosaic_step
from pallas_kernels.cross_entropy.triton_rows import RowOptions, row_pass

__all__ = ["Config", "FORWARD_FIELDS", "default_config", "linear_cross_entropy", "sweep_candidates",
           "unsupported_reason"]

Config = _config.LinearCrossEntropyConfig
FORWARD_FIELDS = _config.FORWARD_FIELDS


def default_config(h, w, labels, *, interpret: bool, **_) -> Config:
    """The tuned or built-in config for h (B, H) and w (H, V) (``config.default_config``), chunk_rows resolved
    (so ``plan`` and the benchmark records show the chunk that runs); eval_chunk_rows stays as configured (None:
    derived from the chunk_rows that runs, which block_sizes may change)."""
    B, H = h.shape
    config = _config.default_config(h, w, on_gpu=not interpret)
    resolved = _config.for_shape(config, B, H, w.shape[1], h.dtype)
    return dataclasses.replace(resolved, eval_chunk_rows=config.eval_chunk_rows)


def unsupported_reason(h, w, labels, **_) -> str | None:
    """None: this backend runs every input the public function accepts (all dtypes, reductions and options)."""
    return None


def check_config(config: Config, h, w, labels, *, reduction: str, ignore_index: int, z_loss: float,
                 logit_soft_cap: float | None, interpret: bool) -> None:
    """ValueError where ``config`` asks for a kernel these arguments cannot run (a "mosaic" GEMM, the epilogue
    softmax, the fused chunk step), as the call raises once it is differentiated: so ``plan`` and ``jaxfuse bench``
    say it before any kernel runs. The chunk each choice is checked at is the loop's (the first chunk falls back to
    a whole overlapping one where its rows would not tile)."""
    del labels
    st = _static(config, h, w, reduction, ignore_index, z_loss, logit_soft_cap, interpret)
    wanted = _Wanted(dh=True, dw=True)
    forward = reduction != "none"  # "none" recomputes only the dlogits in its backward (no logits GEMM choice)
    if forward and _fused_step(h, w, st, wanted):
        return
    _chunk_paths(h, w, st, wanted, forward, st.chunk_rows, first=False)


def sweep_candidates(h, w, labels, **_) -> tuple[list[dict], list[dict]]:
    """(forward, backward) candidates at h (B, H), w (H, V) (``config.sweep_candidates``)."""
    return _config.sweep_candidates(h, w)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call; rows.config.chunk_rows is resolved (<= B)."""

    rows: RowOptions
    reduction: str
    ignore_index: int

    @property
    def chunk_rows(self) -> int:
        return self.rows.config.chunk_rows


def _static(config: Config, h, w, reduction: str, ignore_index: int, z_loss: float, logit_soft_cap,
            interpret: bool) -> _Static:
    """The call's static options, chunk_rows resolved for h (B, H) and w (H, V)."""
    B, H = h.shape
    config = _config.for_shape(config, B, H, w.shape[1], h.dtype)
    return _Static(rows=RowOptions(config=config, z_loss=z_loss, logit_soft_cap=logit_soft_cap, interpret=interpret),
                   reduction=reduction, ignore_index=ignore_index)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
    """Which gradients a forward rule's caller differentiates (a residual with no arrays in it)."""

    dh: bool
    dw: bool


# ---------------------------------------------------------------------------------------------------------------
# Chunk loops
# ---------------------------------------------------------------------------------------------------------------
def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _logits(h_c, w, st: _Static):
    """GEMM 1: (Bc, H) @ (H, V) -> (Bc, V) in the input dtype (or float32), float32 accumulation."""
    dtype = jnp.float32 if st.rows.config.logits_dtype == "float32" else h_c.dtype
    return lax.dot_general(h_c, w, (((1,), (0,)), ((), ())), precision=_precision(h_c.dtype),
                           preferred_element_type=dtype)


def _label_status(labels, V: int, ignore_index: int):
    """(valid, bad) (B,) bool: rows that count, and counted rows whose label lies outside [0, V)."""
    valid = labels != ignore_index
    return valid, valid & ((labels < 0) | (labels >= V))


def _row_loss(lse, zy, st: _Static):
    return lse - zy + st.rows.z_loss * lse * lse if st.rows.z_loss else lse - zy


def _row_losses_forward(h, w, labels, st: _Static):
    """Per-row losses (B,) float32 (0 for ignored rows, NaN for bad labels) and lse (B,): GEMM 1 and the statistics
    pass per chunk; the last chunk (its B − (n − 1)·Bc rows) runs first, outside the loop."""
    B, V = h.shape[0], w.shape[1]
    Bc = st.rows.config.eval_chunk_rows

    def step(start, rows, carry):
        row_loss, lses = carry
        y_c = lax.dynamic_slice_in_dim(labels, start, rows)
        _, lse, zy = row_pass(_logits(lax.dynamic_slice_in_dim(h, start, rows), w, st), y_c, None, None, st.rows,
                              dl_dtype=h.dtype)
        return (lax.dynamic_update_slice_in_dim(row_loss, _row_loss(lse, zy, st), start, 0),
                lax.dynamic_update_slice_in_dim(lses, lse, start, 0))

    n = pl.cdiv(B, Bc)
    zeros = jnp.zeros((B,), jnp.float32)
    carry = step((n - 1) * Bc, B - (n - 1) * Bc, (zeros, zeros))
    row_loss, lse = lax.fori_loop(0, n - 1, lambda i, c: step(i * Bc, Bc, c), carry)
    valid, bad = _label_status(labels, V, st.ignore_index)
    return jnp.where(bad, jnp.nan, jnp.where(valid, row_loss, 0.0)), lse


def _mosaic_dw_reason(h, w, st: _Static, Bc: int) -> str | None:
    """None when the Mosaic GEMM core can add a Bc-row chunk's (H, V) dw update in place; else the sentence why
    not."""
    if st.rows.interpret:
        return "interpret mode runs no Mosaic-GPU kernel"
    reason = backends.unavailable_reason("mosaic")
    if reason:
        return reason
    if st.rows.config.dw_dtype != "param" or jnp.dtype(w.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                                          jnp.dtype(jnp.float16)):
        return f"dw accumulates in {st.rows.config.dw_dtype} / {jnp.dtype(w.dtype)}; the Mosaic GEMM adds into " \
               "a 16-bit dw only"
    H, V = w.shape
    config = mosaic_gemm.default_config(H, V, Bc, h.dtype, accumulate_dtype=w.dtype)
    return mosaic_gemm.unsupported_reason(H, V, Bc, config, names=("H", "V", "chunk_rows"))


def _runs_on_mosaic(field: str, choice: str, reason) -> bool:
    """Whether a config choice ("auto" / "xla" / "mosaic", of ``field``) runs the Mosaic kernel; ``reason()`` is
    None where it can run, else why not (a ValueError for "mosaic", the XLA path for "auto")."""
    if choice == "xla":
        return False
    why = reason()
    if why and choice == "mosaic":
        raise ValueError(f"linear_cross_entropy: {field}='mosaic' cannot run here: {why}")
    return why is None


def _mosaic_dw(h, w, st: _Static, Bc: int) -> bool:
    """Whether a Bc-row chunk's dw update runs on the Mosaic GEMM core (config.dw_gemm; ValueError when "mosaic"
    cannot)."""
    choice = st.rows.config.dw_gemm
    if choice == "auto" and Bc > mosaic_gemm.SHORT_K:
        return False
    return _runs_on_mosaic("dw_gemm", choice, lambda: _mosaic_dw_reason(h, w, st, Bc))


def _mosaic_runtime_reason(st: _Static) -> str | None:
    """None where this call can run Mosaic-GPU kernels (an sm90 GPU, or GPU interpret mode inside
    ``mosaic_utils.interpret_on_cpu``); else the sentence why not."""
    if mu.interpreting():
        return None
    if st.rows.interpret:
        return "interpret mode runs no Mosaic-GPU kernel (outside mosaic_utils.interpret_on_cpu)"
    return backends.unavailable_reason("mosaic")


def _mosaic_logits_reason(h, w, st: _Static, Bc: int) -> str | None:
    """None when a Bc-row chunk's logits and log-sum-exp can come from the Mosaic GEMM core's statistics epilogue
    (``mosaic_logits``); else the sentence why not."""
    reason = _mosaic_runtime_reason(st)
    if reason:
        return reason
    if st.rows.logit_soft_cap is not None:
        return "logit_soft_cap is applied by the row kernel, after the statistics the epilogue would take"
    if st.rows.config.logits_dtype == "float32":
        return "logits_dtype='float32': the Mosaic logits GEMM writes the input dtype"
    return mosaic_logits.unsupported_reason(Bc, h.shape[1], w.shape[1], h.dtype)


def _mosaic_logits(h, w, st: _Static, Bc: int) -> bool:
    """Whether the forward rule's Bc-row chunks take their logits and lse from the Mosaic GEMM core
    (config.logits_gemm; ValueError when "mosaic" cannot)."""
    return _runs_on_mosaic("logits_gemm", st.rows.config.logits_gemm, lambda: _mosaic_logits_reason(h, w, st, Bc))


# "auto": the Mosaic dh GEMM where its output tiles fill at least this fraction of the SMs over the waves they take
# (it has no split-K or stream-K: a last wave of few tiles leaves SMs idle). H100, 16384x4096x32000 (benchmarks/
# results/cross_entropy_chunks_dh_5pct-h100-019d28d.json): 1024-row chunks, 128 tiles on 132 SMs, 1.027x XLA against
# cuBLAS's dh 1.021x; 1536 rows, 192 tiles in two waves (73%), 0.983x against 1.043x.
_DH_MIN_WAVE = 0.9


def _dh_config(Bc: int, H: int, V: int, dtype) -> mosaic_gemm.MosaicGemmConfig:
    """The Mosaic dh GEMM's config: the core's default tiles, tile by tile (no stream-K: its float32 workspace, up
    to 17 MB, would be temporary memory the loss's budget counts; not measured in the loss)."""
    return dataclasses.replace(mosaic_gemm.default_config(Bc, H, V, dtype), stream_k=0)


def _mosaic_dh_reason(h, w, st: _Static, Bc: int) -> str | None:
    """None when the Mosaic GEMM core can compute a Bc-row chunk's dh_c = dlogits_c·wᵀ; else the sentence why
    not."""
    reason = _mosaic_runtime_reason(st)
    if reason:
        return reason
    if jnp.dtype(h.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or w.dtype != h.dtype:
        return f"the Mosaic dh GEMM takes 16-bit h and w of one dtype, got {h.dtype} and {w.dtype}"
    H, V = w.shape
    return mosaic_gemm.unsupported_reason(Bc, H, V, _dh_config(Bc, H, V, h.dtype), names=("chunk_rows", "H", "V"))


def _mosaic_dh(h, w, st: _Static, Bc: int) -> bool:
    """Whether a Bc-row chunk's dh_c runs on the Mosaic GEMM core (config.dh_gemm; ValueError when "mosaic"
    cannot)."""
    choice = st.rows.config.dh_gemm
    if choice == "auto":
        H, V = w.shape
        config = _dh_config(Bc, H, V, h.dtype)
        tiles, sms = (Bc // config.cta_m) * (H // config.cta_n), mu.num_sms()
        if tiles < _DH_MIN_WAVE * pl.cdiv(tiles, sms) * sms:
            return False
    return _runs_on_mosaic("dh_gemm", choice, lambda: _mosaic_dh_reason(h, w, st, Bc))


def _label_logit(logits, labels):
    """logits[r, labels[r]] (R,) float32, 0 for a label outside [0, V) (as the row kernel's: the caller marks such
    rows through their weights)."""
    V = logits.shape[1]
    column = jnp.clip(labels, 0, V - 1)[:, None]
    zy = jnp.take_along_axis(logits, column, axis=1)[:, 0].astype(jnp.float32)
    return jnp.where((labels >= 0) & (labels < V), zy, 0.0)


@dataclasses.dataclass(frozen=True)
class _ChunkPaths:
    """Which GEMMs of one chunk size run on the Mosaic core (the rest on XLA's)."""

    dw: bool
    dh: bool
    logits: bool
    softmax_in_epilogue: bool


def _softmax_in_epilogue(h, st: _Static, logits_on_mosaic: bool) -> bool:
    """Whether the forward rule's chunks take their softmax from the Mosaic logits GEMM's epilogue (config.softmax;
    ValueError when "epilogue" cannot). H100, value and gradient against plain XLA: with 512 / 1024 / 1536-row
    chunks 1.10 / 1.08-1.11 / 1.08-1.10x against the row kernel's 1.02-1.03 / 1.03-1.06 / 1.04-1.06x at
    4096x2048x256000 / 8192x4096x128256 / 16384x4096x32000, with 2048 rows 1.15 / 1.10x against 1.09 / 1.06x at
    the last two (benchmarks/results/cross_entropy_epilogue_softmax_*-h100-*.json)."""
    choice = st.rows.config.softmax
    if choice == "rows":
        return False
    why = None if logits_on_mosaic else "it needs the Mosaic logits GEMM (logits_gemm), which does not run here"
    why = why or epilogue_softmax.unsupported_reason(h.dtype)
    if why and choice == "epilogue":
        raise ValueError(f"linear_cross_entropy: softmax='epilogue' cannot run here: {why}")
    return why is None


def _chunk_paths(h, w, st: _Static, wanted: _Wanted, forward: bool, Bc: int, first: bool) -> _ChunkPaths:
    """The paths of a Bc-row chunk (ValueError where the config asks for "mosaic" and Bc does not allow it); the
    first chunk's dw GEMM initializes dw (XLA's, never an update)."""
    logits = forward and _mosaic_logits(h, w, st, Bc)
    return _ChunkPaths(dw=wanted.dw and not first and _mosaic_dw(h, w, st, Bc),
                       dh=wanted.dh and _mosaic_dh(h, w, st, Bc), logits=logits,
                       softmax_in_epilogue=forward and _softmax_in_epilogue(h, st, logits))


_ROW_SCALED = mosaic_gemm.Fusion(
    inputs=("row_scale",), prologue_init=lambda ctx: ctx.load_rows("row_scale"),
    epilogue=lambda ctx, acc, scale: (acc * lax.broadcast_in_dim(scale, acc.shape, [0]), {}))


def _dh_chunk(dl, w, on_mosaic: bool, dtype, row_scale=None):
    """GEMM 2: a chunk's dh_c (rows, H) = diag(row_scale)·dl·wᵀ in ``dtype`` (row_scale (rows,) float32 or None),
    on the Mosaic core (w read transposed in SMEM, the rows scaled in its epilogue; XLA stores the result in dh's
    rows in place) or XLA's (its bf16 product rounded, scaled and rounded again)."""
    if on_mosaic:
        H, V = w.shape
        config = _dh_config(dl.shape[0], H, V, dtype)
        if row_scale is None:
            return mosaic_gemm.matmul(dl, w, transpose_b=True, config=config)
        return mosaic_gemm.gemm(dl, w, transpose_b=True, config=config, out_dtype=dtype, fusion=_ROW_SCALED,
                                arrays={"row_scale": row_scale}, name="linear_cross_entropy_dh")[0]
    dh = lax.dot_general(dl, w, (((1,), (1,)), ((), ())), precision=_precision(dtype), preferred_element_type=dtype)
    return dh if row_scale is None else (dh.astype(jnp.float32) * row_scale[:, None]).astype(dtype)


def _fused_step_reason(h, w, st: _Static) -> str | None:
    """None when the forward rule can run each chunk's dw update beside the next chunk's logits in one kernel
    (``mosaic_step``); else the sentence why not."""
    B, H = h.shape
    Bc = st.chunk_rows
    if B % Bc or B // Bc < 2:
        return f"B={B} is not two or more whole chunks of chunk_rows={Bc}"
    if st.rows.config.dw_dtype != "param" or w.dtype != h.dtype:
        return f"dw accumulates in {st.rows.config.dw_dtype} / {w.dtype}; the fused step adds into a dw of h's dtype"
    return _mosaic_logits_reason(h, w, st, Bc) or mosaic_step.unsupported_reason(Bc, H, w.shape[1], h.dtype)


def _fused_step(h, w, st: _Static, wanted: _Wanted) -> bool:
    """Whether the forward rule takes the fused chunk steps (config.fused_step "on"; ValueError where it cannot)."""
    if st.rows.config.fused_step == "off" or not wanted.dw:
        return False
    reason = _fused_step_reason(h, w, st)
    if reason:
        raise ValueError(f"linear_cross_entropy: fused_step='on' cannot run here: {reason}")
    return True


def _chunk_gradients_fused(h, w, labels, g, st: _Static, wanted: _Wanted):
    """(total, dh, dw) as ``_chunk_gradients`` (forward rule, dw wanted), n = B / Bc whole chunks: chunk 0's logits
    on the Mosaic logits GEMM, then per chunk s >= 1 one kernel adding chunk s − 1 into dw and writing chunk s's
    logits over chunk s − 1's dlogits (``mosaic_step``), and chunk n − 1's update alone at the end. Each chunk's
    dh rows are computed from its dlogits before the next kernel overwrites them."""
    B = h.shape[0]
    Bc = st.chunk_rows
    n = B // Bc
    on_dh = wanted.dh and _mosaic_dh(h, w, st, Bc)
    chunk = lambda a, s: lax.dynamic_slice_in_dim(a, s * Bc, Bc)  # noqa: E731

    def finish(s, logits_c, lse_c, total, dh):
        """Chunk s's dlogits (over its logits), its weighted loss added to total, its dh rows written."""
        y_c, g_c = chunk(labels, s), chunk(g, s)
        zy = _label_logit(logits_c, y_c)
        dl, _, _ = row_pass(logits_c, y_c, g_c, lse_c, st.rows, dl_dtype=h.dtype)
        total = total + jnp.sum(g_c * _row_loss(lse_c, zy, st))
        if wanted.dh:
            dh = lax.dynamic_update_slice_in_dim(dh, _dh_chunk(dl, w, on_dh, h.dtype), s * Bc, 0)
        return dl, total, dh

    dh = lax.empty(h.shape, h.dtype) if wanted.dh else None  # every row is written (see _chunk_gradients)
    dl, total, dh = finish(0, *mosaic_logits.logits_and_lse(chunk(h, 0), w), jnp.float32(0.0), dh)
    logits, dw, lse = mosaic_step.update_and_logits(chunk(h, 0), dl, chunk(h, 1), w)
    dl, total, dh = finish(1, logits, lse, total, dh)

    def step(s, carry):
        total, dh, dw, dl = carry
        logits, dw, lse = mosaic_step.update_and_logits(chunk(h, s - 1), dl, chunk(h, s), w, dw)
        dl, total, dh = finish(s, logits, lse, total, dh)
        return total, dh, dw, dl

    total, dh, dw, dl = lax.fori_loop(2, n, step, (total, dh, dw, dl))
    last = chunk(h, n - 1)
    if st.rows.config.dw_gemm != "xla" and _mosaic_dw_reason(h, w, st, Bc) is None:  # in place: XLA's dot and add
        dw = mosaic_gemm.matmul(last, dl, transpose_a=True, accumulate_into=dw)  # here held a second (H, V) buffer
    else:
        dw = dw + lax.dot_general(last, dl, (((0,), (0,)), ((), ())), precision=_precision(h.dtype),
                                  preferred_element_type=w.dtype)
    return total, dh, dw


def _chunk_gradients(h, w, labels, g, lse, st: _Static, wanted: _Wanted):
    """(total, dh, dw): total = Σ g·row loss (float32; 0 when lse is given), dh (B, H) in h's dtype and dw (H, V)
    in w's dtype (None where ``wanted`` says the caller does not differentiate that input: its GEMM never runs), for
    row weights g (B,) float32. lse None: the forward rule (statistics and dlogits from one kernel per chunk); lse
    (B,) given: the "none" backward (the kernel's dlogits pass only).

    The last chunk runs first, outside the loop, on its B − (n − 1)·Bc rows; where the config asks for a Mosaic
    GEMM that those rows do not tile, it takes Bc rows instead, the ones it shares with the chunk before weighted 0
    there (that chunk counts them)."""
    if lse is None and _fused_step(h, w, st, wanted):
        return _chunk_gradients_fused(h, w, labels, g, st, wanted)
    B = h.shape[0]
    Bc = st.chunk_rows
    n = pl.cdiv(B, Bc)
    dw_dtype = jnp.float32 if st.rows.config.dw_dtype == "float32" else w.dtype
    prec = _precision(h.dtype)
    paths = functools.partial(_chunk_paths, h, w, st, wanted, lse is None)
    loop_paths = paths(Bc, first=False)
    first_rows = B - (n - 1) * Bc
    try:
        first_paths = paths(first_rows, first=True)
    except ValueError:  # "mosaic" asked for and not possible at first_rows: a whole chunk, overlapping
        first_rows, first_paths = Bc, paths(Bc, first=True)
    shared = first_rows - (B - (n - 1) * Bc)  # leading rows of the first step that the loop's last chunk covers

    def step(start, rows, carry, first: bool):
        on = first_paths if first else loop_paths
        h_c = lax.dynamic_slice_in_dim(h, start, rows)  # (rows, H)
        y_c, g_c = (lax.dynamic_slice_in_dim(a, start, rows) for a in (labels, g))
        if shared and first:
            g_c = jnp.where(jnp.arange(rows) >= shared, g_c, 0.0)  # counted by the loop's last step
        lse_c = None if lse is None else lax.dynamic_slice_in_dim(lse, start, rows)
        row_scale = None  # dlogits = diag(row_scale)·dl where the softmax ran in GEMM 1's epilogue

        # the epilogue softmax's shift (the last chunk's mean lse) and whether every chunk stayed in its range
        shift, fits = (jnp.float32(0.0), jnp.bool_(True)) if first else carry[3:]
        if on.softmax_in_epilogue:  # no pass over the logits (``epilogue_softmax``)
            dl, row_scale, lse_c, zy, shift, chunk_fits = epilogue_softmax.scaled_dlogits(
                h_c, w, y_c, g_c, shift, z_loss=st.rows.z_loss)
            fits = fits & chunk_fits
        elif on.logits:  # lse from GEMM 1's epilogue: the row kernel only writes dlogits
            logits_c, lse_c = mosaic_logits.logits_and_lse(h_c, w)
            zy = _label_logit(logits_c, y_c)
            dl, _, _ = row_pass(logits_c, y_c, g_c, lse_c, st.rows, dl_dtype=h.dtype)
        else:
            dl, lse_c, zy = row_pass(_logits(h_c, w, st), y_c, g_c, lse_c, st.rows, dl_dtype=h.dtype)  # (rows, V)
        total = jnp.float32(0.0) if zy is None else jnp.sum(g_c * _row_loss(lse_c, zy, st))
        dh, dw = (None, None) if first else carry[1:3]
        if wanted.dh:
            # the first step's buffer is uninitialized (XLA's AllocateBuffer, zeros off the GPU): the steps write
            # every row, [B - rows, B) first and [0, (n - 1)·Bc) in the loop; zeros would cost a (B, H) write
            dh = lax.dynamic_update_slice_in_dim(lax.empty(h.shape, h.dtype) if first else dh,
                                                 _dh_chunk(dl, w, on.dh, h.dtype, row_scale), start, 0)
        if row_scale is not None:  # dwᵀ rows: (diag(row_scale)·h_c)ᵀ·dl, sliced from h again once dh is written:
            # the (Bc, H) operand then takes memory the dh GEMM's split-K partial sums held (XLA made it beside
            # them, 2 MiB over the 5% rule's budget at 4096x2048x256000)
            h_again, row_scale, dh = lax.optimization_barrier((h, row_scale, dh))
            h_c = (lax.dynamic_slice_in_dim(h_again, start, rows).astype(jnp.float32)
                   * row_scale[:, None]).astype(h.dtype)
        if wanted.dw and on.dw:  # dw += h_cᵀ dl in place, h_c read transposed in SMEM
            dw = mosaic_gemm.matmul(h_c, dl, transpose_a=True, accumulate_into=dw)
        elif wanted.dw:
            dw_c = lax.dot_general(h_c, dl, (((0,), (0,)), ((), ())), precision=prec,
                                   preferred_element_type=dw_dtype)  # (H, V) = h_cᵀ dl
            dw = dw_c if first else dw + dw_c
        return (total if first else carry[0] + total), dh, dw, shift, fits

    carry = step(B - first_rows, first_rows, None, first=True)
    total, dh, dw, _, fits = lax.fori_loop(0, n - 1, lambda i, c: step(i * Bc, Bc, c, first=False), carry)
    if (dh is None) == wanted.dh or (dw is None) == wanted.dw:  # a None here would reach jax as a zero gradient
        raise AssertionError(f"linear_cross_entropy: gradients {wanted}, but computed dh: {dh is not None}, "
                             f"dw: {dw is not None}")
    result = total, dh, None if dw is None else dw.astype(w.dtype)
    if not (first_paths.softmax_in_epilogue or loop_paths.softmax_in_epilogue):
        return result
    # some row left the epilogue softmax's range: all again, the row kernel's way (a loop of at most one step
    # updates dh and dw in place; one host round trip per call)
    rows_only = dataclasses.replace(st, rows=dataclasses.replace(
        st.rows, config=dataclasses.replace(st.rows.config, softmax="rows")))
    again = lambda state: (*_chunk_gradients(h, w, labels, g, lse, rows_only, wanted), jnp.bool_(False))  # noqa
    return lax.while_loop(lambda state: state[-1], again, (*result, ~fits))[:3]


# ---------------------------------------------------------------------------------------------------------------
# custom VJPs
# ---------------------------------------------------------------------------------------------------------------
def _row_weights(labels, V: int, st: _Static, scale):
    """g (B,) float32: scale for counted rows, 0 for ignored ones, NaN for bad labels (never a plausible value)."""
    valid, bad = _label_status(labels, V, st.ignore_index)
    return jnp.where(bad, jnp.nan, jnp.where(valid, scale, 0.0)).astype(jnp.float32)


def _reduction_scale(labels, st: _Static):
    if st.reduction == "sum":
        return jnp.float32(1.0)
    count = jnp.sum(labels != st.ignore_index)
    return 1.0 / jnp.maximum(count, 1).astype(jnp.float32)


def _unpack(h, w, labels):
    """The forward rule's primals (``symbolic_zeros``): values, and which of h and w are differentiated."""
    return h.value, w.value, labels.value, _Wanted(dh=h.perturbed, dw=w.perturbed)


def _scaled(x, ct):
    return None if x is None else (x * ct).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _reduced_loss(h, w, labels, st: _Static):
    """Scalar mean/sum loss; evaluation costs 1 GEMM per chunk (this primal), gradients up to 3 (the forward
    rule)."""
    row_loss, _ = _row_losses_forward(h, w, labels, st)
    return jnp.sum(row_loss) * _reduction_scale(labels, st)


def _reduced_loss_fwd(h, w, labels, st: _Static):
    h, w, labels, wanted = _unpack(h, w, labels)
    g = _row_weights(labels, w.shape[1], st, _reduction_scale(labels, st))
    total, dh, dw = _chunk_gradients(h, w, labels, g, None, st, wanted)
    return total, (dh, dw)


def _reduced_loss_bwd(st: _Static, residuals, ct):
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return None, None, None
    dh, dw = residuals
    ct = ct.astype(jnp.float32)  # a constant 1 under value_and_grad: XLA removes both products
    return _scaled(dh, ct), _scaled(dw, ct), None


_reduced_loss.defvjp(_reduced_loss_fwd, _reduced_loss_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _row_losses(h, w, labels, st: _Static):
    """(B,) per-row losses; gradients recompute the logits chunk by chunk with the per-row cotangent (4 GEMMs)."""
    return _row_losses_forward(h, w, labels, st)[0]


def _row_losses_fwd(h, w, labels, st: _Static):
    h, w, labels, wanted = _unpack(h, w, labels)
    row_loss, lse = _row_losses_forward(h, w, labels, st)
    return row_loss, (h, w, labels, lse, wanted)


def _row_losses_bwd(st: _Static, residuals, ct):
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return None, None, None
    h, w, labels, lse, wanted = residuals
    g = _row_weights(labels, w.shape[1], st, ct.astype(jnp.float32))
    _, dh, dw = _chunk_gradients(h, w, labels, g, lse, st, wanted)
    return dh, dw, None


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd, symbolic_zeros=True)


def linear_cross_entropy(h, w, labels, *, reduction: str, ignore_index: int, z_loss: float,
                         logit_soft_cap: float | None, interpret: bool, config: Config) -> jax.Array:
    """h (B, H), w (H, V), labels (B,) int32, validated -> the loss in float32: a scalar for "mean" (over counted
    rows, 0 if none) and "sum", (B,) for "none" (0 for ignored rows). Labels outside [0, V) give NaN (that row's
    loss, so the mean or sum, and the gradients)."""
    st = _static(config, h, w, reduction, ignore_index, z_loss, logit_soft_cap, interpret)
    with tu.quiet_triton_deprecation():
        if reduction == "none":
            return _row_losses(h, w, labels, st)
        return _reduced_loss(h, w, labels, st)
