"""flash_attention against the float32 reference: forward and the three gradients, masks, transforms, errors.

On CPU the kernels run in Pallas interpret mode at tiny shapes (the table's 16-row tiles still give several tiles
per sequence). On a GPU the same tests run the Triton kernels at real shapes (``_SIZES`` picks the set).
The lowering tests lower for CUDA even on CPU and assert on the program: one Triton kernel per pass, nothing of
size T x S.
"""

import importlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import FlashAttentionConfig, flash_attention, reference, tuning

fa_module = importlib.import_module("pallas_kernels.flash_attention")

ON_GPU = jax.default_backend() == "gpu"
# Named shape sizes: (short, long, odd_short, odd_long) sequence lengths and the batch.
_SIZES = (dict(B=2, short=256, long=1024, odd_short=300, odd_long=777) if ON_GPU
          else dict(B=1, short=17, long=40, odd_short=17, odd_long=33))
_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
_KEYS = itertools.count(1000)


def _key():
    return jax.random.key(next(_KEYS))


def _normal(shape, dtype=jnp.float32):
    return jax.random.normal(_key(), shape, jnp.float32).astype(dtype)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _fwd_bwd(fn, q, k, v, do):
    """(o, dq, dk, dv) of fn under one jit."""

    @jax.jit
    def run(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    return run(q, k, v, do)


def _check_against_reference(q, k, v, tol, **kwargs):
    do = _normal(q.shape, q.dtype)
    got = _fwd_bwd(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v, do)
    attn_kwargs = {name: value for name, value in kwargs.items() if name != "block_sizes"}
    up = lambda x: x.astype(jnp.float32)
    want = _fwd_bwd(lambda q, k, v: reference.attention(q, k, v, **attn_kwargs), up(q), up(k), up(v), up(do))
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.dtype == q.dtype, name
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        err = _rel_err(g, w)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
    return got


# ------------------------------------------------------------------------------------------------ correctness
_S = _SIZES
_CASES = {
    # name: (dtype, causal, T, S, N, K, H)
    "fp32": (jnp.float32, False, _S["long"], _S["long"], 2, 2, 64),
    "fp32-causal-gqa": (jnp.float32, True, _S["long"], _S["long"], 4, 2, 64),
    "fp32-causal-mqa-T<S": (jnp.float32, True, _S["odd_short"], _S["long"], 2, 1, 64),
    "fp32-causal-T>S": (jnp.float32, True, _S["long"], _S["odd_short"], 2, 2, 64),
    "fp32-H128-odd": (jnp.float32, False, _S["odd_long"], _S["odd_short"], 2, 1, 128),
    "bf16-causal-mqa": (jnp.bfloat16, True, _S["long"], _S["long"], 4, 1, 64),
    "bf16-one-query": (jnp.bfloat16, False, 1, _S["odd_short"], 2, 2, 64),
    "bf16-H256-causal": (jnp.bfloat16, True, _S["odd_short"], _S["odd_short"], 2, 2, 256),
    "fp16-H32-causal-odd": (jnp.float16, True, _S["odd_long"], _S["odd_long"], 4, 2, 32),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_matches_reference(case):
    dtype, causal, T, S, N, K, H = _CASES[case]
    B = _S["B"]
    q, k, v = _normal((B, T, N, H), dtype), _normal((B, S, K, H), dtype), _normal((B, S, K, H), dtype)
    _check_against_reference(q, k, v, _TOL[dtype], causal=causal)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_segment_ids_single_array(dtype):
    B, T, N, K, H = _S["B"], _S["long"], 4, 2, 64
    q, k, v = _normal((B, T, N, H), dtype), _normal((B, T, K, H), dtype), _normal((B, T, K, H), dtype)
    # Three packed sequences of uneven length per row.
    cuts = np.sort(np.random.default_rng(next(_KEYS)).choice(np.arange(1, T), size=2, replace=False))
    seg = jnp.asarray(np.broadcast_to(np.searchsorted(cuts, np.arange(T), side="right"), (B, T)), jnp.int32)
    _check_against_reference(q, k, v, _TOL[dtype], causal=True, segment_ids=seg)


def test_segment_ids_pair_with_lengths():
    B, T, S, N, K, H = 2, _S["odd_short"], _S["long"], 2, 1, 64
    q, k, v = _normal((B, T, N, H)), _normal((B, S, K, H)), _normal((B, S, K, H))
    q_seg = jax.random.randint(_key(), (B, T), 0, 3)
    kv_seg = jax.random.randint(_key(), (B, S), 0, 3)
    lengths = jnp.array([S, S // 2 + 1], jnp.int32)
    _check_against_reference(q, k, v, 1e-4, segment_ids=(q_seg, kv_seg), kv_seq_lengths=lengths)


@pytest.mark.parametrize("causal,dtype", [(True, jnp.float32), (False, jnp.bfloat16)])
def test_kv_seq_lengths(causal, dtype):
    B, T, S, N, K, H = 2, _S["long"], _S["long"], 2, 2, 64
    q, k, v = _normal((B, T, N, H), dtype), _normal((B, S, K, H), dtype), _normal((B, S, K, H), dtype)
    lengths = jnp.array([S, 7], jnp.int32)
    _, _, dk, dv = _check_against_reference(q, k, v, _TOL[dtype], causal=causal, kv_seq_lengths=lengths)
    # Padded keys get exactly zero gradient.
    np.testing.assert_array_equal(np.asarray(dk[1, 7:], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(dv[1, 7:], np.float32), 0.0)


def test_rows_without_visible_keys_are_zero():
    B, T, S, N, K, H = 2, _S["odd_short"], _S["odd_short"], 2, 1, 64
    q, k, v = _normal((B, T, N, H)), _normal((B, S, K, H)), _normal((B, S, K, H))
    lengths = jnp.array([0, S], jnp.int32)  # batch 0: nothing to attend to
    q_seg = jnp.ones((B, T), jnp.int32).at[1, 3].set(7)  # query 3 of batch 1: a segment with no keys
    kv_seg = jnp.ones((B, S), jnp.int32)
    o, dq, dk, dv = _check_against_reference(q, k, v, 1e-4, segment_ids=(q_seg, kv_seg), kv_seq_lengths=lengths)
    np.testing.assert_array_equal(o[0], 0.0)
    np.testing.assert_array_equal(o[1, 3], 0.0)
    np.testing.assert_array_equal(dq[0], 0.0)
    np.testing.assert_array_equal(dq[1, 3], 0.0)
    np.testing.assert_array_equal(dk[0], 0.0)
    assert np.all(np.abs(np.asarray(o[1, :3])) > 0)


def test_explicit_block_sizes_are_used_and_agree():
    B, T, S, N, K, H = 1, _S["long"], _S["odd_long"], 4, 2, 64
    q, k, v = _normal((B, T, N, H)), _normal((B, S, K, H)), _normal((B, S, K, H))
    blocks = dict(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16)
    _check_against_reference(q, k, v, 1e-4, causal=True, block_sizes=blocks)
    config = fa_module._resolve_config(q, k, True, blocks, on_gpu=ON_GPU)
    assert all(getattr(config, name) == value for name, value in blocks.items())


_CHAIN_CASES = {
    # name: (dtype, T, S, N, K, attention options); lengths odd, so the second chain of the last tile is partial
    "causal-gqa-T>S": (jnp.float32, _S["odd_long"], _S["odd_short"], 4, 2, dict(causal=True)),
    "bf16-kv-lengths": (jnp.bfloat16, _S["odd_long"], _S["odd_long"], 2, 1,
                        dict(kv_seq_lengths=jnp.array([_S["odd_short"] - 3] * _S["B"], jnp.int32))),
    "segments-causal": (jnp.float32, _S["odd_short"], _S["odd_short"], 2, 2, dict(causal=True, segment_ids=None)),
}


@pytest.mark.parametrize("case", list(_CHAIN_CASES))
def test_two_query_chains_match_reference(case):
    dtype, T, S, N, K, options = _CHAIN_CASES[case]
    B, H = _S["B"], 64
    q, k, v = _normal((B, T, N, H), dtype), _normal((B, S, K, H), dtype), _normal((B, S, K, H), dtype)
    if "segment_ids" in options:  # three packed sequences per row
        options = dict(options, segment_ids=jnp.broadcast_to(jnp.arange(T) * 3 // T, (B, T)).astype(jnp.int32))
    block_q = 128 if ON_GPU else 32  # two chains of 64 (GPU) / 16 (CPU) rows
    blocks = dict(block_q=block_q, query_chains=2)
    config = fa_module._resolve_config(q, k, False, blocks, on_gpu=ON_GPU)
    assert (config.block_q, config.query_chains) == (block_q, 2)
    _check_against_reference(q, k, v, _TOL[dtype], block_sizes=blocks, **options)


@pytest.mark.parametrize("masks", [dict(causal=True), dict(kv_seq_lengths=jnp.array([5], jnp.int32))])
def test_tiles_longer_than_the_sequences(masks):
    # Explicit tiles are not shrunk: every tile, forward and backward, reaches past T = 10 and S = 7.
    B, T, S, N, K, H = 1, 10, 7, 2, 1, 64
    q, k, v = _normal((B, T, N, H)), _normal((B, S, K, H)), _normal((B, S, K, H))
    blocks = dict(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32)
    _check_against_reference(q, k, v, 1e-4, block_sizes=blocks, **masks)


@pytest.mark.parametrize("scale", [0.37, -0.2])
def test_scale(scale):
    B, T, N, H = 1, _S["odd_short"], 2, 64
    q, k, v = _normal((B, T, N, H)), _normal((B, T, N, H)), _normal((B, T, N, H))
    o = _check_against_reference(q, k, v, 1e-4, causal=True, scale=scale)[0]
    assert _rel_err(o, reference.attention(q, k, v, causal=True)) > 1e-2  # the scale matters


# ------------------------------------------------------------------------------------------------ transforms
def test_vmap_jit_grad():
    V, T, N, H = 2, _S["odd_short"], 2, 64
    q, k, v = _normal((V, 1, T, N, H)), _normal((V, 1, T, N, H)), _normal((V, 1, T, N, H))

    def loss(attn, q, k, v):
        o = jax.vmap(lambda q, k, v: attn(q, k, v, causal=True))(q, k, v)  # (V, 1, T, N, H)
        return jnp.sum(o * jnp.cos(o))

    grads = jax.jit(jax.grad(lambda *a: loss(flash_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: loss(reference.attention, *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want):
        assert _rel_err(g, w) <= 1e-4


def test_inside_nnx_module():
    class Attention(nnx.Module):
        def __init__(self, dim, heads, *, rngs):
            self.heads = heads
            # Full float32 projection: on a GPU the default precision would round its inputs to TF32, and
            # jit and eager can round differently by an ulp of TF32 (~1e-4 relative) on either side of the kernel.
            self.qkv = nnx.Linear(dim, 3 * dim, precision=jax.lax.Precision.HIGHEST, rngs=rngs)

        def __call__(self, x, attn):
            B, T, D = x.shape
            q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.heads, D // self.heads), 3, axis=2)
            return attn(q, k, v, causal=True).reshape(B, T, D)  # (B, T, N, H) -> (B, T, D)

    model = Attention(128, 2, rngs=nnx.Rngs(0))
    x = _normal((1, _S["odd_short"], 128))
    loss = lambda model, attn: jnp.mean(model(x, attn) ** 2)
    grads = nnx.jit(nnx.grad(lambda m: loss(m, flash_attention)))(model)
    want = nnx.grad(lambda m: loss(m, reference.attention))(model)
    assert _rel_err(grads.qkv.kernel[...], want.qkv.kernel[...]) <= 1e-4


# ------------------------------------------------------------------------------------------------ lowering
def _lower_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype,H,causal,masks", [(jnp.bfloat16, 128, True, True), (jnp.float32, 256, False, False),
                                                  (jnp.float16, 64, False, True)])
def test_lowers_to_triton_kernels_without_score_buffers(dtype, H, causal, masks):
    B, T, S, N, K = 2, 300, 177, 4, 2  # odd lengths: tails masked in every kernel
    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    kv = jax.ShapeDtypeStruct((B, S, K, H), dtype)
    extra = dict(segment_ids=(jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)),
                 kv_seq_lengths=jnp.full((B,), S, jnp.int32)) if masks else {}
    attn = lambda q, k, v: flash_attention(q, k, v, causal=causal, interpret=False, **extra)
    fwd = _lower_for_cuda(attn, q, kv, kv)
    assert fwd.count("__gpu$xla.gpu.triton") == 1
    train = _lower_for_cuda(jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)), q, kv, kv)
    assert train.count("__gpu$xla.gpu.triton") == 3  # forward, dK/dV, dQ
    for text in (fwd, train):  # no tensor with both a T and an S dimension
        shapes = re.findall(r"tensor<([0-9x]+)x[a-z]+[0-9]*>", text)
        assert not [s for s in shapes if {str(T), str(S)} <= set(s.split("x"))], shapes


# ------------------------------------------------------------------------------------------------ errors
def _arrays(B=1, T=8, S=8, N=2, K=2, H=64, dtype=jnp.float32):
    return jnp.zeros((B, T, N, H), dtype), jnp.zeros((B, S, K, H), dtype), jnp.zeros((B, S, K, H), dtype)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), r"q: expected rank 4 \(B, T, N, H\), got shape \(8, 2, 64\)"),
    (lambda q, k, v: (q, k[..., :32], v[..., :32]), r"k: head dim 32 .* q's head dim 64"),
    (lambda q, k, v: (q, k, v[:, :4]), r"k, v: shapes must match"),
    (lambda q, k, v: (q[:, :, :, :48], k[..., :48], v[..., :48]), r"head dim H=48 .* allowed: \(32, 64, 128, 256\)"),
    (lambda q, k, v: (jnp.zeros((1, 8, 3, 64)), k, v), r"kv heads K=2 .* must divide q's heads N=3"),
    (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), r"dtypes must match, got q float32, k bfloat16"),
    (lambda q, k, v: (q.astype(jnp.int32), k, v), r"q: dtype int32 not supported"),
    (lambda q, k, v: (q, jnp.zeros((2, 8, 2, 64)), jnp.zeros((2, 8, 2, 64))), r"k: batch 2 .* q's batch 1"),
])
def test_bad_inputs(mutate, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*mutate(*_arrays()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(segment_ids=jnp.zeros((1, 9), jnp.int32)), r"segment_ids: q_segment_ids must have shape"),
    (dict(segment_ids=(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 5), jnp.int32))), r"kv_segment_ids .* \(1, 8\)"),
    (dict(kv_seq_lengths=jnp.zeros((2,), jnp.int32)), r"kv_seq_lengths: expected shape \(B,\) = \(1,\), got \(2,\)"),
    (dict(kv_seq_lengths=jnp.zeros((1,))), r"kv_seq_lengths: must be integers"),
    (dict(block_sizes={"block_m": 64}), r"block_sizes: unknown fields \['block_m'\]"),
    (dict(block_sizes={"block_q": 48}), r"FlashAttentionConfig.block_q: must be a power of two >= 16, got 48"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*_arrays(), **kwargs)


def test_segment_ids_single_array_needs_equal_lengths():
    q, k, v = _arrays(T=8, S=12)
    with pytest.raises(ValueError, match=r"segment_ids: a single array is allowed only when T == S"):
        flash_attention(q, k, v, segment_ids=jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize("field,value", [("num_warps", 3), ("num_stages", 0), ("block_k_dq", 8), ("block_q", True),
                                         ("query_chains", 3), ("query_chains", True)])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"FlashAttentionConfig.{field}:"):
        FlashAttentionConfig(**{field: value})


def test_query_chains_need_16_rows_each():
    with pytest.raises(ValueError, match=r"block_q / query_chains must be >= 16 .* block_q=16, query_chains=2"):
        FlashAttentionConfig(block_q=16, query_chains=2)


# ------------------------------------------------------------------------------------------------ tuning
def test_tuning_cache_round_trip_and_lookup_order(tmp_path):
    path = tmp_path / "tuned.json"
    q, k, _ = _arrays(T=4096, S=4096, N=16, K=16, H=128, dtype=jnp.bfloat16)
    key = fa_module._shape_key(q, k, True)
    assert key == "bfloat16[T=4096,S=4096,N=16,K=16,H=128]causal"
    assert tuning.lookup("flash_attention", key, device="H100", path=path) is None  # no file yet
    # Without a cache entry the GPU config is the table's.
    table = tuning.flash_attention_table(128, jnp.bfloat16, on_gpu=True)
    assert fa_module.default_config(q, k, causal=True, on_gpu=True, device="H100", cache_path=path).to_dict() == table
    tuned = dict(table, block_q=64, num_stages=4)
    tuning.store("flash_attention", key, tuned, time_us=123.456, device="H100", path=path)
    assert tuning.lookup("flash_attention", key, device="H100", path=path) == tuned
    assert tuning.lookup("flash_attention", key, device="A100", path=path) is None
    assert tuning.load_cache(path)["entries"]["H100"]["flash_attention"][key]["time_us"] == 123.46
    config = fa_module.default_config(q, k, causal=True, on_gpu=True, device="H100", cache_path=path)
    assert config.block_q == 64 and config.num_stages == 4
    # A non-causal call has another key, so it still gets the table.
    assert fa_module.default_config(q, k, causal=False, on_gpu=True, device="H100", cache_path=path).block_q == 128


def test_table_tiles_shrink_to_short_sequences_but_explicit_sizes_do_not(tmp_path):
    q, k, _ = _arrays(T=20, S=40, H=128, dtype=jnp.bfloat16)
    config = fa_module.default_config(q, k, on_gpu=True, device="H100", cache_path=tmp_path / "none.json")
    assert (config.block_q, config.block_k, config.block_k_dkv, config.block_q_dq) == (32, 64, 64, 32)
    assert config.query_chains == 2  # the H=128 table's two chains, 16 rows each
    q_short = _arrays(T=10, S=40, H=128, dtype=jnp.bfloat16)[0]
    config = fa_module.default_config(q_short, k, on_gpu=True, device="H100", cache_path=tmp_path / "none.json")
    assert (config.block_q, config.query_chains) == (16, 1)  # a 16-row tile is not split
    explicit = FlashAttentionConfig(block_q=128)
    assert fa_module._resolve_config(q, k, False, explicit, on_gpu=True) is explicit


@pytest.mark.parametrize("T", [4096, 16])
def test_autotune_candidates_are_valid_configs(T):
    cands = fa_module._candidates(128, jnp.bfloat16, T, 4096)
    assert len(cands) > 10
    for c in cands:
        FlashAttentionConfig(**c)
    # Two query chains are searched; at T = 16 the query tile shrinks to 16 rows, too short to split.
    assert {c["query_chains"] for c in cands} == ({1, 2} if T > 16 else {1})


@pytest.mark.skipif(not ON_GPU, reason="autotuning times real GPU kernels")
def test_autotune_writes_cache(tmp_path):
    q, k, v = (_normal((1, 512, 4, 64), jnp.bfloat16) for _ in range(3))
    path = tmp_path / "tuned.json"
    table = tuning.flash_attention_table(64, jnp.bfloat16, on_gpu=True)
    candidates = [table, dict(table, block_q=64, num_stages=2), dict(table, block_q_dkv=64, block_k_dkv=64)]
    best, timings = fa_module.autotune(q, k, v, causal=True, cache_path=path, iters=2, candidates=candidates)
    assert timings["forward"] and timings["forward+backward"]
    key = fa_module._shape_key(q, k, True)
    assert tuning.lookup("flash_attention", key, path=path) == best.to_dict()
