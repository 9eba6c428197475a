"""The Mosaic-GPU attention forward (``pallas_kernels.attention.mosaic``): structure on CPU, numbers on an H100.

CPU: Mosaic GPU kernels do not run here, but they lower for CUDA (``lowering_platforms=("cuda",)``): every default
config lowers at the suite's shapes and at odd ones, with every mask kind, to exactly one Mosaic kernel; the
shared-memory estimate equals Mosaic's own count (an oversize config raises Mosaic's overflow error at lowering,
with our byte count in it); configs and ``unsupported_reason`` name what they reject.
GPU (sm90 only): o and the log2-domain lse against the float32 reference at real and odd shapes, every mask kind,
GQA/MQA, bf16 and fp16, NaN in padded V, q and k scaled by 30; the tolerance grows with sqrt(S); NaN never passes.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.attention import mosaic


def _on_sm90() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


ON_SM90 = _on_sm90()
gpu_only = pytest.mark.skipif(not ON_SM90, reason="Mosaic GPU kernels run only on an sm90 GPU")
_KEYS = itertools.count(7000)
SUITE = {  # name: (B, T, S, N, K, H), as jaxfuse.suites.attention.SHAPES
    "main": (4, 4096, 4096, 16, 16, 128), "1k": (16, 1024, 1024, 16, 16, 128), "8k": (2, 8192, 8192, 16, 16, 128),
    "gqa": (4, 4096, 4096, 32, 8, 128), "h64": (4, 4096, 4096, 32, 32, 64),
}


def _spec(B, T, S, N, K, H, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((B, T, N, H), dtype), jax.ShapeDtypeStruct((B, S, K, H), dtype)


def _lower(B, T, S, N, K, H, *, dtype=jnp.bfloat16, segments=False, lengths=False, residuals=False, **kwargs):
    """The StableHLO text of the forward lowered for CUDA."""
    q, kv = _spec(B, T, S, N, K, H, dtype)
    extra = []
    if segments:
        extra += [jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32)]
    if lengths:
        extra += [jax.ShapeDtypeStruct((B,), jnp.int32)]

    def f(q, k, v, *rest):
        rest = list(rest)
        masks = {}
        if segments:
            masks.update(q_segment_ids=rest.pop(0), kv_segment_ids=rest.pop(0))
        if lengths:
            masks.update(kv_seq_lengths=rest.pop(0))
        fn = mosaic.attention_forward if residuals else mosaic.flash_attention
        return fn(q, k, v, **masks, **kwargs)

    return jax.jit(f).trace(q, kv, kv, *extra).lower(lowering_platforms=("cuda",)).as_text()


def _num_kernels(text: str) -> int:
    return text.count("stablehlo.custom_call @mosaic_gpu")


# ------------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(SUITE))
def test_default_config_lowers_at_suite_shapes(name, causal):
    B, T, S, N, K, H = SUITE[name]
    q, kv = _spec(B, T, S, N, K, H)
    assert mosaic.unsupported_reason(q, kv, kv, causal=causal) is None
    assert _num_kernels(_lower(B, T, S, N, K, H, causal=causal)) == 1


@pytest.mark.parametrize("shape,masks", [
    ((2, 1000, 1000, 4, 2, 128), dict(causal=True)),
    ((2, 1000, 777, 4, 2, 128), dict(causal=True, segments=True, lengths=True)),
    ((2, 300, 1000, 4, 4, 64), dict(lengths=True, residuals=True)),
    ((1, 1000, 300, 4, 1, 64), dict(causal=True, segments=True, residuals=True)),
    ((1, 5, 7, 2, 1, 64), dict(causal=True)),
    ((1, 100, 40, 2, 2, 256), dict(dtype=jnp.float16, scale=-0.3)),
])
def test_lowers_at_odd_shapes_with_every_mask(shape, masks):
    assert _num_kernels(_lower(*shape, **masks)) == 1


def test_lowers_under_vmap_and_checkpoint_as_one_kernel():
    q, kv = _spec(2, 256, 256, 4, 2, 64)
    stack = lambda s: jax.ShapeDtypeStruct((3, *s.shape), s.dtype)  # noqa: E731
    f = jax.vmap(lambda q, k, v: mosaic.flash_attention(q, k, v, causal=True))
    text = jax.jit(f).trace(stack(q), stack(kv), stack(kv)).lower(lowering_platforms=("cuda",)).as_text()
    assert _num_kernels(text) == 1  # the mapped axis folds into the batch: one launch
    g = jax.checkpoint(lambda q, k, v: mosaic.flash_attention(q, k, v))
    assert _num_kernels(jax.jit(g).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()) == 1


@pytest.mark.parametrize("shape,masks", [
    ((4, 4096, 4096, 16, 16, 128), {}), ((4, 4096, 4096, 32, 8, 128), dict(causal=True)),
    ((4, 4096, 4096, 32, 32, 64), dict(residuals=True)),
    ((2, 1000, 777, 4, 2, 128), dict(causal=True, segments=True, lengths=True, residuals=True)),
    ((1, 5, 7, 2, 1, 64), dict(causal=True)),
])
def test_persistent_config_lowers(shape, masks):
    config = mosaic.MosaicAttentionConfig(persistent=True)
    q, kv = _spec(*shape)
    assert mosaic.unsupported_reason(q, kv, kv, config=config) is None
    assert _num_kernels(_lower(*shape, config=config, **masks)) == 1


def test_shared_memory_estimate_is_mosaics_count():
    q, kv = _spec(1, 512, 512, 2, 2, 128)
    fits = mosaic.MosaicAttentionConfig(block_kv=128, num_stages=3)  # 230520 bytes: just under 227 KiB
    assert mosaic.unsupported_reason(q, kv, kv, config=fits) is None
    assert _num_kernels(_lower(1, 512, 512, 2, 2, 128, config=fits)) == 1
    over = mosaic.MosaicAttentionConfig(block_kv=128, num_stages=4)
    need = mosaic.shared_memory_bytes(128, jnp.bfloat16, over)
    reason = mosaic.unsupported_reason(q, kv, kv, config=over)
    assert reason is not None and f"need {need} bytes of shared memory" in reason
    with pytest.raises(ValueError, match=f"exceeds available shared memory: smem_bytes={need} "):
        _lower(1, 512, 512, 2, 2, 128, config=over)
    persistent = mosaic.MosaicAttentionConfig(block_kv=64, persistent=True)  # a separate o tile: 64 KiB more
    need = mosaic.shared_memory_bytes(256, jnp.bfloat16, persistent)
    with pytest.raises(ValueError, match=f"exceeds available shared memory: smem_bytes={need} "):
        _lower(1, 512, 512, 2, 2, 256, config=persistent)


def test_default_configs_fit_every_head_dim():
    for H, dtype in itertools.product(mosaic.SUPPORTED_HEAD_DIMS, (jnp.bfloat16, jnp.float16)):
        q, kv = _spec(1, 256, 256, 2, 2, H, dtype)
        assert mosaic.unsupported_reason(q, kv, kv) is None, H
    assert _num_kernels(_lower(1, 256, 256, 2, 2, 256, causal=True)) == 1


def test_default_config_is_persistent_only_for_short_non_causal_h128():
    q, kv = _spec(*SUITE["1k"])
    assert mosaic.default_config(q, kv, causal=False).persistent
    assert not mosaic.default_config(q, kv, causal=True).persistent
    for name in ("main", "8k", "gqa", "h64"):
        q, kv = _spec(*SUITE[name])
        assert not mosaic.default_config(q, kv, causal=False).persistent, name


def test_unsupported_reason_names_the_constraint():
    q, kv = _spec(1, 64, 64, 2, 2, 128, jnp.float32)
    assert "float32 runs on the Triton backend" in mosaic.unsupported_reason(q, kv, kv)
    q, kv = _spec(1, 64, 64, 2, 2, 32)
    assert "H=32" in mosaic.unsupported_reason(q, kv, kv)


@pytest.mark.parametrize("field,value", [("block_q", 32), ("block_kv", 100), ("num_stages", 1), ("ping_pong", 1),
                                         ("block_q", True), ("persistent", "yes")])
def test_config_rejects_bad_fields_by_name(field, value):
    with pytest.raises(ValueError, match=f"MosaicAttentionConfig.{field}"):
        mosaic.MosaicAttentionConfig(**{field: value})


# ------------------------------------------------------------------------------------------------------- GPU
def _normal(shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(next(_KEYS)), shape, jnp.float32) * scale).astype(dtype)


def _reference_lse(q, k, *, causal, scale, segment_ids, kv_seq_lengths):
    """(B, N, T) float32 log2 Σ_s exp2(score·scale·log2 e) over visible keys; +inf where none is visible."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", up(q).reshape(B, T, K, N // K, H), up(k),
                        precision=jax.lax.Precision.HIGHEST).reshape(B, N, T, S) * scale
    mask = reference.attention_mask(B, T, S, causal=causal, segment_ids=segment_ids, kv_seq_lengths=kv_seq_lengths)
    lse = jax.nn.logsumexp(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1) / math.log(2.0)
    return jnp.where(jnp.isfinite(lse), lse, jnp.inf)


def _check(q, k, v, *, causal=False, scale=None, segment_ids=None, kv_seq_lengths=None, config=None, v_ref=None):
    """o and lse of attention_forward against the float32 reference (given v_ref in place of v); returns o."""
    masks = {}
    if segment_ids is not None:
        masks.update(q_segment_ids=segment_ids[0], kv_segment_ids=segment_ids[1])
    masks.update(kv_seq_lengths=kv_seq_lengths)
    o, lse = jax.jit(functools.partial(mosaic.attention_forward, causal=causal, scale=scale, config=config))(
        q, k, v, **masks)
    scale_ = q.shape[-1] ** -0.5 if scale is None else scale
    up = lambda x: x.astype(jnp.float32)  # noqa: E731

    @jax.jit
    def expected(q, k, v, segment_ids, kv_seq_lengths):
        o = reference.attention(up(q), up(k), up(v), causal=causal, scale=scale_, segment_ids=segment_ids,
                                kv_seq_lengths=kv_seq_lengths)
        return o, _reference_lse(q, k, causal=causal, scale=scale_, segment_ids=segment_ids,
                                 kv_seq_lengths=kv_seq_lengths)

    want, want_lse = expected(q, k, v if v_ref is None else v_ref, segment_ids, kv_seq_lengths)
    o32, want, lse, want_lse = (np.asarray(x, np.float64) for x in (up(o), want, lse, want_lse))
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == want_lse.shape
    assert np.all(np.isfinite(o32)), "NaN or inf in o"
    S = k.shape[1]
    atol, rtol = {jnp.dtype(jnp.bfloat16): (2e-3, 8e-3), jnp.dtype(jnp.float16): (3e-4, 1e-3)}[jnp.dtype(q.dtype)]
    # p is rounded to q.dtype before p·v: errors scale with |v| (not |o|, which can cancel) and grow as sqrt(S).
    bound = atol * math.sqrt(max(S, 128) / 128) + rtol * np.abs(want)
    worst = np.max(np.abs(o32 - want) - bound)
    assert worst <= 0, f"o: |err| exceeds the bound by {worst:.2e}"
    rel = np.linalg.norm(o32 - want) / max(np.linalg.norm(want), 1e-30)
    assert rel <= 4 * rtol, f"o: relative norm error {rel:.2e}"
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse)), "lse: +inf exactly where no key is visible"
    finite = np.isfinite(want_lse)
    lse_err = np.max(np.abs(lse[finite] - want_lse[finite]) / (1e-3 + 1e-5 * np.abs(want_lse[finite])),
                     initial=0.0)
    assert lse_err <= 1.0, f"lse: error {lse_err:.2f}x the tolerance"
    return o


_REAL_CASES = {  # name: (dtype, causal, B, T, S, N, K, H)
    "4k": (jnp.bfloat16, False, 1, 4096, 4096, 8, 8, 128),
    "4k-causal": (jnp.bfloat16, True, 1, 4096, 4096, 8, 8, 128),
    "gqa-causal": (jnp.bfloat16, True, 2, 2048, 2048, 8, 2, 128),
    "mqa-h64": (jnp.bfloat16, False, 2, 1024, 1024, 4, 1, 64),
    "h256-causal-odd": (jnp.bfloat16, True, 1, 1000, 1000, 2, 2, 256),
    "odd-gqa": (jnp.bfloat16, False, 2, 1000, 1000, 4, 2, 128),
    "odd-gqa-causal": (jnp.bfloat16, True, 2, 1000, 1000, 4, 2, 128),
    "T<S-causal": (jnp.bfloat16, True, 2, 300, 1000, 4, 4, 64),
    "T>S-causal": (jnp.bfloat16, True, 2, 1000, 300, 4, 2, 128),
    "tiny-causal": (jnp.bfloat16, True, 1, 5, 7, 2, 1, 64),
    "fp16-causal": (jnp.float16, True, 2, 2048, 2048, 4, 4, 128),
    "fp16-h64-odd": (jnp.float16, False, 1, 777, 1000, 4, 2, 64),
}


@gpu_only
@pytest.mark.parametrize("name", list(_REAL_CASES))
def test_matches_reference(name):
    dtype, causal, B, T, S, N, K, H = _REAL_CASES[name]
    _check(_normal((B, T, N, H), dtype), _normal((B, S, K, H), dtype), _normal((B, S, K, H), dtype), causal=causal)


def _segments(B, L, num):
    """(B, L) sorted segment ids with `num` random boundaries per row (packed sequences)."""
    cuts = jax.random.randint(jax.random.key(next(_KEYS)), (B, num), 0, L)
    return jnp.sum(jnp.arange(L)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)


@gpu_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["segments", "lengths", "both"])
def test_masks_match_reference(kind, causal):
    B, T, S, N, K, H = (3, 1000, 1000, 4, 2, 128) if causal else (3, 300, 777, 4, 1, 64)
    dtype = jnp.bfloat16
    q, k, v = _normal((B, T, N, H), dtype), _normal((B, S, K, H), dtype), _normal((B, S, K, H), dtype)
    seg = lens = None
    if kind in ("segments", "both"):
        seg = _segments(B, T, 5), _segments(B, S, 5)
        if T == S:
            seg = (seg[0], seg[0])
    v_nan = v
    if kind in ("lengths", "both"):
        lens = jnp.array([0, S // 2 + 13, S], jnp.int32)  # an empty row, a length off the tile grid, everything
        padding = jnp.arange(S)[None, :, None, None] >= lens[:, None, None, None]
        v_nan = jnp.where(padding, jnp.nan, v)  # the kernel gets NaN in the padding; the reference (0·NaN) not
    o = _check(q, k, v_nan, causal=causal, segment_ids=seg, kv_seq_lengths=lens, v_ref=v)
    if lens is not None:
        assert np.all(np.asarray(o[0], np.float32) == 0), "length 0: every row is zeros"


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_magnitudes(dtype, causal):
    """q and k scaled by 30: scores up to ~4e3, near one-hot softmax rows."""
    B, T, S, N, K, H = 2, 1024, 1000, 4, 2, 128
    q, k = _normal((B, T, N, H), dtype, 30.0), _normal((B, S, K, H), dtype, 30.0)
    _check(q, k, _normal((B, S, K, H), dtype), causal=causal)


@gpu_only
@pytest.mark.parametrize("config", [mosaic.MosaicAttentionConfig(block_kv=64, num_stages=3),
                                    mosaic.MosaicAttentionConfig(ping_pong=False),
                                    mosaic.MosaicAttentionConfig(block_kv=128, num_stages=3),
                                    mosaic.MosaicAttentionConfig(persistent=True, num_stages=3)])
def test_other_configs_and_scales(config):
    B, T, S, N, K, H = 2, 1000, 1000, 4, 2, 128
    q, k, v = (_normal(s, jnp.bfloat16) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    _check(q, k, v, causal=True, scale=0.05, config=config)
    _check(q, k, v, causal=False, scale=-0.07, config=config)


@gpu_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(4, 1000, 1000, 8, 2, 128), (8, 300, 777, 8, 8, 64)])
def test_persistent_matches_reference(shape, causal):
    """More work items than SMs: each CTA carries the K/V ring and the q prefetch across items; with masks."""
    B, T, S, N, K, H = shape
    config = mosaic.MosaicAttentionConfig(persistent=True)
    q, k, v = (_normal(s, jnp.bfloat16) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    _check(q, k, v, causal=causal, config=config)
    lens = jax.random.randint(jax.random.key(next(_KEYS)), (B,), 0, S + 1)
    seg = _segments(B, T, 3), _segments(B, S, 3)
    _check(q, k, v, causal=causal, config=config, kv_seq_lengths=lens, segment_ids=seg if T != S else (seg[0],) * 2)


@gpu_only
def test_primal_under_jit_vmap_and_checkpoint():
    B, T, S, N, K, H = 2, 1000, 777, 4, 2, 64
    q = _normal((3, B, T, N, H), jnp.bfloat16)
    k, v = _normal((3, B, S, K, H), jnp.bfloat16), _normal((3, B, S, K, H), jnp.bfloat16)
    attn = lambda q, k, v: mosaic.flash_attention(q, k, v, causal=True)  # noqa: E731
    got = jax.jit(jax.vmap(attn))(q, k, v)
    got_ckpt = jax.jit(jax.checkpoint(attn))(q[1], k[1], v[1])
    want = jax.vmap(lambda q, k, v: mosaic.attention_forward(q, k, v, causal=True)[0])(q, k, v)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(got_ckpt, np.float32), np.asarray(want[1], np.float32))
