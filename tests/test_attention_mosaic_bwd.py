"""The Mosaic-GPU flash-attention backward (pallas_kernels/attention/mosaic_bwd.py).

On CPU: config validation, unsupported_reason_bwd, and the lowering for CUDA (``lowering_platforms=("cuda",)``) of
the backward with its default config at every attention-suite shape and at odd shapes: two Mosaic kernels, no
(T, S) buffer, shared memory within the H100's limit (the lowering raises the GPU's own overflow error, and the
estimate ``smem_bytes_bwd`` agrees with it). On an sm90 GPU: dq, dk, dv against the float32 reference's vjp for
every mask kind, GQA/MQA, bf16/fp16, odd shapes; NaN/inf in padded K/V; rows with no visible key; saturated
softmax against a float64 reference. o and lse come from ``mb.reference_residuals`` (float32 jnp; the Mosaic forward is
separate). Tolerances grow with the square root of the reduction length; NaN never passes.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse.suites.attention import SHAPES
from pallas_kernels import reference
from pallas_kernels.attention import mosaic_bwd as mb
from pallas_kernels.attention import mosaic_bwd_kernels as mbk

ON_SM90 = jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
_KEYS = itertools.count(7000)
_BASE_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}  # at a reduction length of 128


def _normal(shape, dtype=jnp.float32, scale=1.0):
    return (jax.random.normal(jax.random.key(next(_KEYS)), shape, jnp.float32) * scale).astype(dtype)


def _backward_fn(causal, scale, config):
    def f(q, k, v, o, lse, do, q_seg, kv_seg, lens):
        return mb.attention_backward(q, k, v, o, lse, do, causal=causal, scale=scale, q_segment_ids=q_seg,
                                     kv_segment_ids=kv_seg, kv_seq_lengths=lens, config=config)
    return f


# ---------------------------------------------------------------------------------------------------------------
# CPU: config, reasons, lowering
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("block_q_dq", 32), ("block_kv_dkv", 96), ("compute_wgs_dq", 3),
                                         ("num_stages_dkv", 0), ("block_kv_dq", True)])
def test_config_rejects_bad_fields(field, value):
    with pytest.raises((ValueError, TypeError), match=f"MosaicAttentionBwdConfig.{field}"):
        mb.MosaicAttentionBwdConfig(**{field: value})


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype,H,N,K,match", [(jnp.float32, 128, 4, 4, "Triton"), (jnp.bfloat16, 256, 4, 4, "256"),
                                               (jnp.float16, 32, 4, 4, "head dim 32"),
                                               (jnp.bfloat16, 64, 4, 3, "must divide")])
def test_unsupported_reasons(dtype, H, N, K, match):
    q, k = _spec((1, 128, N, H), dtype), _spec((1, 128, K, H), dtype)
    reason = mb.unsupported_reason_bwd(q, k, k)
    assert reason is not None and match in reason


def test_supported_at_suite_shapes():
    for name in ("main", "1k", "8k", "gqa", "h64"):
        s = SHAPES[name]
        q, k = _spec((s["B"], s["T"], s["N"], s["H"])), _spec((s["B"], s["S"], s["K"], s["H"]))
        assert mb.unsupported_reason_bwd(q, k, k, segments=True) is None, name


def _lower(B, T, S, N, K, H, *, causal, segments=False, lengths=False, config=None, dtype=jnp.bfloat16):
    q, k = _spec((B, T, N, H), dtype), _spec((B, S, K, H), dtype)
    config = mb.default_config_bwd(q, k, causal=causal) if config is None else config
    args = (q, k, k, _spec(q.shape, jnp.float32), _spec((B, N, T), jnp.float32), q,
            _spec((B, T), jnp.int32) if segments else None, _spec((B, S), jnp.int32) if segments else None,
            _spec((B,), jnp.int32) if lengths else None)
    f = jax.jit(_backward_fn(causal, H**-0.5, config))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


_LOWERING_CASES = [(name, causal) for name in ("main", "1k", "8k", "gqa", "h64") for causal in (False, True)]


@pytest.mark.parametrize("name,causal", _LOWERING_CASES)
def test_lowers_at_suite_shapes(name, causal):
    s = SHAPES[name]
    text = _lower(*(s[x] for x in "BTSNKH"), causal=causal)
    assert text.count("custom_call @mosaic_gpu") == 2  # the dQ kernel and the dK/dV kernel
    T, S = s["T"], s["S"]
    assert f"x{T}x{S}x" not in text and f"x{S}x{T}x" not in text and f"<{T}x{S}x" not in text  # no (T, S) buffer


@pytest.mark.parametrize("T,S,N,K,H,causal,segments,lengths", [
    (1000, 1000, 4, 2, 128, True, False, False),
    (300, 523, 4, 1, 64, True, False, True),  # T, S not multiples of 8 (padded rows), MQA
    (523, 300, 2, 2, 128, False, True, True),
    (1, 77, 2, 2, 64, False, False, False),
])
def test_lowers_at_odd_shapes(T, S, N, K, H, causal, segments, lengths):
    text = _lower(2, T, S, N, K, H, causal=causal, segments=segments, lengths=lengths, dtype=jnp.float16)
    assert text.count("custom_call @mosaic_gpu") == 2


@pytest.mark.parametrize("H", [64, 128])
def test_shared_memory_estimate_matches_lowering(H):
    """A config just inside the estimate lowers; one the estimate rejects raises the lowering's own overflow."""
    fits = mb.MosaicAttentionBwdConfig(block_kv_dq=128, num_stages_dq=2 if H == 128 else 4, num_stages_dkv=3)
    q, k = _spec((1, 512, 2, H)), _spec((1, 512, 2, H))
    assert mb.unsupported_reason_bwd(q, k, k, config=fits) is None
    _lower(1, 512, 512, 2, 2, H, causal=False, config=fits)
    over = mb.MosaicAttentionBwdConfig(block_q_dq=128, block_kv_dq=128, num_stages_dq=4)
    reason = mb.unsupported_reason_bwd(q, k, k, config=over) if H == 128 else "skip"
    if H == 128:
        assert reason is not None and "shared memory" in reason
        problem = mbk.Problem(B=1, T=512, S=512, N=2, K=2, H=H, T_pad=512, S_pad=512, causal=False, scale=1.0,
                              has_segments=False, has_lengths=False)
        call = lambda q, k, v, do, lse, delta: mbk.dq_call(  # noqa: E731
            q, k, v, do, lse, delta, None, None, None, p=problem, block_q=128, block_kv=128, compute_wgs=2,
            num_stages=4)
        lse = _spec((1, 2, 512), jnp.float32)
        with pytest.raises(Exception, match="(?i)shared memory"):
            jax.jit(call).trace(q, k, k, q, lse, lse).lower(lowering_platforms=("cuda",))


def test_attention_backward_validates_arguments():
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 64), jnp.float32)
    f = _backward_fn(False, 0.125, mb.MosaicAttentionBwdConfig())
    with pytest.raises(ValueError, match="lse"):
        f(q, q, q, q, lse.astype(jnp.bfloat16), q, None, None, None)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        f(q, q, q, q, lse, q, jnp.zeros((1, 64), jnp.int32), None, None)
    with pytest.raises(ValueError, match="Triton"):
        f(*(x.astype(jnp.float32) for x in (q, q, q, q)), lse, q.astype(jnp.float32), None, None, None)


# ---------------------------------------------------------------------------------------------------------------
# GPU (sm90): numbers
# ---------------------------------------------------------------------------------------------------------------
def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite gradient"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _inputs(B, T, S, N, K, H, dtype, *, segments, lengths):
    q, k, v, do = (_normal(s, dtype) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)))
    segs = None
    if segments:
        segs = tuple(jnp.sort(jax.random.randint(jax.random.key(next(_KEYS)), (B, n), 0, 3), axis=1)
                     for n in (T, S))
    lens = jnp.array([S * 2 // 3 + 1, S - 7, 0, S][:B], jnp.int32) if lengths else None
    if lengths:  # garbage where nothing may read it
        padded = jnp.arange(S)[None, :, None, None] >= lens[:, None, None, None]
        k, v = jnp.where(padded, jnp.nan, k).astype(dtype), jnp.where(padded, jnp.inf, v).astype(dtype)
    return q, k, v, do, segs, lens


_GPU_CASES = {
    # name: (B, T, S, N, K, H, dtype, causal, segments, lengths)
    "bf16": (2, 1024, 1024, 4, 4, 128, jnp.bfloat16, False, False, False),
    "bf16-causal-gqa": (2, 1024, 1024, 8, 2, 128, jnp.bfloat16, True, False, False),
    "fp16-causal-mqa-T<S": (2, 300, 1000, 4, 1, 64, jnp.float16, True, False, False),
    "bf16-causal-T>S-odd": (2, 1001, 523, 2, 2, 128, jnp.bfloat16, True, False, False),
    "bf16-segments": (2, 777, 777, 4, 2, 64, jnp.bfloat16, False, True, False),
    "fp16-lengths-nan": (4, 500, 520, 4, 2, 128, jnp.float16, False, False, True),
    "bf16-causal-everything": (3, 640, 640, 4, 2, 64, jnp.bfloat16, True, True, True),
}


@pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU only")
@pytest.mark.parametrize("case", list(_GPU_CASES))
def test_gradients_match_reference(case):
    B, T, S, N, K, H, dtype, causal, segments, lengths = _GPU_CASES[case]
    q, k, v, do, segs, lens = _inputs(B, T, S, N, K, H, dtype, segments=segments, lengths=lengths)
    scale = H**-0.5
    residuals = jax.jit(lambda q, k, v, segs, lens: mb.reference_residuals(  # one program, not op-by-op dispatch
        q, k, v, causal=causal, scale=scale, segment_ids=segs, kv_seq_lengths=lens))
    o, lse = residuals(q, k, v, segs, lens)
    q_seg, kv_seg = (None, None) if segs is None else segs
    config = mb.default_config_bwd(q, k, causal=causal)
    got = jax.jit(_backward_fn(causal, scale, config))(q, k, v, o, lse, do, q_seg, kv_seg, lens)

    @jax.jit
    def want_fn(q, k, v, do, segs, lens):
        clean = lambda x: jnp.where(jnp.isfinite(x), x, 0).astype(jnp.float32)  # noqa: E731
        ref = lambda q, k, v: reference.attention(q, k, v, causal=causal, scale=scale,  # noqa: E731
                                                  segment_ids=segs, kv_seq_lengths=lens)
        _, vjp = jax.vjp(ref, q.astype(jnp.float32), clean(k), clean(v))
        return vjp(do.astype(jnp.float32))

    want = want_fn(q, k, v, do, segs, lens)
    lengths_of = {"dq": S, "dk": T * N // K, "dv": T * N // K}  # reduction length of each gradient
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        tol = _BASE_TOL[dtype] * math.sqrt(max(lengths_of[name], 128) / 128)
        err = _rel_err(g, w)
        assert err <= tol, f"{case} {name}: relative error {err:.2e} > {tol:.1e}"
    if lens is not None:  # keys past the length get exactly zero gradient, whatever K and V hold there
        padded = np.arange(S)[None, :] >= np.asarray(lens)[:, None]
        for g in got[1:]:
            assert np.all(np.asarray(g, np.float32)[padded] == 0)
        empty = np.asarray(lens) == 0  # rows with no visible key
        assert np.all(np.asarray(got[0], np.float32)[empty] == 0)


@pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU only")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_saturated_softmax_against_float64(dtype):
    """q and k scaled by 30: near one-hot rows. With the forward's float32 o, dq/dk/dv stay within 2e-2."""
    B, T, N, H = 1, 512, 4, 128
    q, k = _normal((B, T, N, H), dtype, 30.0), _normal((B, T, N, H), dtype, 30.0)
    v, do = _normal((B, T, N, H), dtype), _normal((B, T, N, H), dtype)
    scale = H**-0.5
    o, lse = jax.jit(lambda q, k, v: mb.reference_residuals(q, k, v, causal=False, scale=scale))(q, k, v)
    config = mb.default_config_bwd(q, k, causal=False)
    got = jax.jit(_backward_fn(False, scale, config))(q, k, v, o, lse, do, None, None, None)
    for name, g, w in zip(("dq", "dk", "dv"), got, mb.float64_grads(q, k, v, do, scale)):
        err = _rel_err(g, w)
        assert err <= 2e-2, f"{name}: relative error {err:.2e} against float64"
