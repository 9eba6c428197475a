"""Probes behind the epilogue softmax (``pallas_kernels/cross_entropy/epilogue_softmax.py``), H100 only. "kernels"
and "hlo" ran with this script copied into a checkout of commit 1bf450c (there ``mosaic_logits.probabilities`` is
the "prologue_load" variant and ``scaled_dlogits`` takes the ``fallback`` argument "hlo" patches):

    OUT=DIR PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_probabilities_probe.py kernels hlo
    OUT=DIR PYTHONPATH=$PWD python benchmarks/scripts/cross_entropy_probabilities_probe.py kernels_now   # at 0dbb964

(1) "kernels": the probabilities GEMM at 1024x4096x128256 under epilogue variants (the row shift loaded per tile or
a constant; the exp of the float32 accumulator or of the logits rounded to bf16 first) against the logits GEMM with
statistics; (2) "hlo": the loss at 4096x2048x256000 (512-row chunks) with the fallback as a loop of at most one
step per chunk, against the row kernel's: temporaries and whole-chunk copies in the optimized HLO, and the time of
both; (3) "kernels_now": at 0dbb964, whose kernel rounds first and reads the offset at each tile's start
("prologue_load"), against the offset read in the epilogue, at 1024 and 2048 rows (from a4e1813 on, the library
kernel itself reads it in the epilogue above 1536 rows, so there both variants read it there at 2048). Writes DIR/r/probs_exp.json."""
import json, re, sys, os
import jax, jax.numpy as jnp
from jax import lax
from jaxfuse import bench
from jaxfuse.suites.cross_entropy import make_inputs
import pallas_kernels
from pallas_kernels import gemm as mosaic_gemm
from pallas_kernels.cross_entropy import mosaic_logits as ml, epilogue_softmax as es
out = {}
F32 = jnp.float32

def fusion_variant(kind):
    def make(Bc, V, tile_n, dtype):
        stats = jax.ShapeDtypeStruct((V // tile_n, Bc), F32)
        if kind == "round_first_epilogue_load":  # the offset rows read in the epilogue, under the other K loop
            def epi(ctx, acc, carry):
                z = acc.astype(dtype).astype(F32)
                off = lax.broadcast_in_dim(ctx.load_rows(ml._OFFSET), z.shape, [0])
                e = jnp.exp(z - off).astype(dtype).astype(F32)
                return e, {ml._BLOCK_SUMEXP: jnp.sum(e, axis=1)}
            return mosaic_gemm.Fusion(inputs=(ml._OFFSET,), outputs=((ml._BLOCK_SUMEXP, stats),), epilogue=epi)
        if kind.startswith("const"):
            c = float(kind[5:])
            def epi(ctx, acc, carry):
                e = jnp.exp(acc - c).astype(dtype).astype(F32)
                return e, {ml._BLOCK_SUMEXP: jnp.sum(e, axis=1)}
            return mosaic_gemm.Fusion(outputs=((ml._BLOCK_SUMEXP, stats),), epilogue=epi)
        if kind == "round_first":
            def epi(ctx, acc, carry):
                z = acc.astype(dtype).astype(F32)
                e = jnp.exp(z - 10.0).astype(dtype).astype(F32)
                return e, {ml._BLOCK_SUMEXP: jnp.sum(e, axis=1)}
            return mosaic_gemm.Fusion(outputs=((ml._BLOCK_SUMEXP, stats),), epilogue=epi)
        if kind == "stats_exp_out":
            def epi(ctx, acc, carry):
                z, m, s = ml.tile_statistics(acc, dtype)
                e = jnp.exp(z - lax.broadcast_in_dim(m, z.shape, [0]))
                return e, {ml._BLOCK_SUMEXP: s}
            return mosaic_gemm.Fusion(outputs=((ml._BLOCK_SUMEXP, stats),), epilogue=epi)
        if kind == "no_input":
            def epi(ctx, acc, carry):
                e = jnp.exp(acc - 10.0).astype(dtype).astype(F32)
                return e, {ml._BLOCK_SUMEXP: jnp.sum(e, axis=1)}
            return mosaic_gemm.Fusion(outputs=((ml._BLOCK_SUMEXP, stats),), epilogue=epi)
        return ORIG(Bc, V, tile_n, dtype)
    return make

ORIG = ml._probabilities_fusion

def probs_fn(kind):
    def f(h_c, w, off):
        if kind == "prologue_load":
            return ml.probabilities(h_c, w, off)
        config = ml._checked_config(h_c, w)
        Bc, V = h_c.shape[0], w.shape[1]
        return mosaic_gemm.gemm(h_c, w, config=config, out_dtype=h_c.dtype,
                                fusion=fusion_variant(kind)(Bc, V, config.tile_n, h_c.dtype),
                                arrays={ml._OFFSET: off}, name="probs_" + kind.replace("-", "m"))
    return jax.jit(f)

KINDS = ("prologue_load", "no_input", "const0", "const-10", "const20", "round_first", "stats_exp_out")
if "kernels_now" in sys.argv:  # at a later commit: its probabilities kernel against the offset read in the epilogue
    KINDS = ("prologue_load", "round_first_epilogue_load", "round_first")
if "kernels" in sys.argv or "kernels_now" in sys.argv:
    for (Bc, H, V) in ((1024, 4096, 128256),) + (((2048, 4096, 128256),) if "kernels_now" in sys.argv else ()):
        h, w, _ = make_inputs(Bc * 4, H, V, seed=0)
        hs = [h[i * Bc:(i + 1) * Bc] for i in range(4)]
        off = jnp.full((Bc,), 10.0, F32)
        fns = {"stats": jax.jit(lambda h_c, w, off: ml.logits_and_lse(h_c, w))}
        for kind in KINDS:
            fns[kind] = probs_fn(kind)
        calls = [(fn, (hs[0], w, off)) for fn in fns.values()]
        ts = bench.time_interleaved(calls, iterations=20)
        out[f"{Bc}x{H}x{V}"] = {k: t.median_us for k, t in zip(fns, ts)}
        print(Bc, H, V, {k: round(t.median_us, 1) for k, t in zip(fns, ts)}, flush=True)
        del hs, h, w

def scaled_while(h_c, w, labels_c, g_c, shift, *, z_loss, fallback):
    """the fallback as a while loop of 0 or 1 steps over the buffer; the fix after it."""
    V = w.shape[1]
    rows = jnp.arange(labels_c.shape[0])
    counted = (g_c != 0) & (labels_c >= 0) & (labels_c < V)
    column = jnp.clip(labels_c, 0, V - 1)
    e, sumexp = ml.probabilities(h_c, w, jnp.where(counted, shift, jnp.finfo(F32).max))
    label_e = e[rows, column].astype(F32)
    log_sum = jnp.log(sumexp)
    lse = jnp.where(counted, shift + log_sum, 0.0)
    factor = 1.0 + 2.0 * z_loss * lse if z_loss else jnp.ones_like(lse)
    fits = (jnp.abs(log_sum) <= 40) & (jnp.log(label_e) >= -80) & (factor >= 0.5)
    fast = jnp.all(fits | ~counted)
    zy = jnp.where(counted, shift + jnp.log(label_e), 0.0)
    def body(state):
        buf, _, _, _ = state
        dl, l, z = fallback(buf)
        return dl, l, z, jnp.bool_(False)
    buf, lse_f, zy_f, _ = lax.while_loop(lambda s: s[3], body, (e, lse, zy, ~fast))
    fixed = jnp.where(counted, label_e - sumexp / factor, label_e).astype(buf.dtype)
    buf = buf.at[rows, jnp.where(fast & counted, column, V)].set(fixed, mode="drop")
    row_scale = jnp.where(fast, jnp.where(g_c == 0, 0.0, g_c * factor / jnp.where(counted, sumexp, 1.0)), 1.0)
    count = jnp.sum(counted)
    nxt = jnp.where(count > 0, jnp.sum(jnp.where(counted, lse_f, 0.0)) / jnp.maximum(count, 1), shift)
    return buf, row_scale, lse_f, zy_f, nxt

if "hlo" in sys.argv:
    B, H, V, Bc = 4096, 2048, 256000, 512
    h, w, labels = make_inputs(B, H, V, seed=0)
    ORIG_SD = es.scaled_dlogits
    for name, impl in (("while", scaled_while), ("rows", None)):
        es.scaled_dlogits = impl or ORIG_SD
        sizes = {"chunk_rows": Bc, "softmax": "rows" if impl is None else "epilogue"}
        fn = jax.jit(jax.value_and_grad(lambda h, w: pallas_kernels.linear_cross_entropy(h, w, labels, backend="triton", block_sizes=sizes), argnums=(0, 1)))
        c = fn.lower(h, w).compile()
        text = c.as_text()
        copies = [l.strip()[:300] for l in text.splitlines() if re.search(r"bf16\[512,256000\]\{1,0\} copy\(", l)]
        out[f"hlo_{name}"] = dict(temp_mib=c.memory_analysis().temp_size_in_bytes / 2**20, copies=copies)
        print(name, out[f"hlo_{name}"]["temp_mib"], copies, flush=True)
        open(os.path.join(os.environ["OUT"], f"r/hlo_{name}.txt"), "w").write(text)
        jax.block_until_ready(fn(h, w))  # traced under this variant's patch: later calls hit jit's cache
        fns_t = out.setdefault("fns", {})
        fns_t[name] = fn
    ts = bench.time_interleaved([(fn, (h, w)) for fn in out["fns"].values()], iterations=5)
    for name, t in zip(list(out["fns"]), ts):
        out[f"loss_{name}_us"] = t.median_us
        print(name, "us", t.median_us, [(k[:40], round(v)) for k, v in sorted(t.per_kernel_us.items(), key=lambda kv: -kv[1])[:7]], flush=True)
    del out["fns"]
    es.scaled_dlogits = ORIG_SD
json.dump(out, open(os.path.join(os.environ["OUT"], "r/probs_exp.json"), "w"), indent=1)
