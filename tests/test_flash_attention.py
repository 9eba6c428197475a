"""flash_attention: the shared tests (``base_attention``) for each backend, backend resolution, and the Triton
backend's own: its config (explicit tiles, two query chains, validation), its tables and tuning cache, its sweep
candidates. The Mosaic backend's own tests are in test_attention_mosaic.py."""

import jax
import jax.numpy as jnp
import pytest

from base_attention import SIZES, AttentionTests, qkv, tol, zeros
from conftest import ON_GPU
from pallas_kernels import FlashAttentionConfig, attention, backends, tuning
from pallas_kernels.attention import config as fa_config


class TestTriton(AttentionTests):
    backend = "triton"


class TestMosaic(AttentionTests):
    backend = "mosaic"
    forward_kernels = 1  # mosaic_attention_fwd
    train_kernels = 3  # mosaic_attention_fwd, mosaic_attention_dq, mosaic_attention_dkv


def _spec(T=64, S=64, N=2, K=2, H=64, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((1, T, N, H), dtype), jax.ShapeDtypeStruct((1, S, K, H), dtype)


@pytest.mark.skipif(ON_GPU, reason="what runs on a CPU-only machine")
def test_auto_is_triton_on_cpu_and_mosaic_names_what_runs():
    q, k, v = zeros()
    assert attention.plan(q, k, v).backend == "triton"
    with pytest.raises(ValueError, match=r"backend='mosaic' cannot run flash_attention here: Mosaic GPU kernels need "
                                         r"an sm90 \(Hopper\) GPU; .*; available here: 'triton'"):
        attention.flash_attention(q, k, v, backend="mosaic")
    with pytest.raises(ValueError, match=r"backend: expected one of \['auto', 'triton', 'mosaic'\], got 'cuda'"):
        attention.flash_attention(q, k, v, backend="cuda")


@pytest.mark.parametrize("dtype,H,backend", [(jnp.bfloat16, 128, "mosaic"), (jnp.float16, 64, "mosaic"),
                                             (jnp.float32, 64, "triton"), (jnp.bfloat16, 256, "triton"),
                                             (jnp.bfloat16, 32, "triton")])
def test_auto_prefers_mosaic_where_it_runs(dtype, H, backend):
    """For CUDA (an sm90 GPU, or lowering for one): Mosaic for bf16/fp16 at H 64 and 128, Triton for the rest, also
    at the shapes where only Triton has tuned times."""
    q, kv = _spec(T=4096, S=4096, N=16, K=16, H=H, dtype=dtype)
    with backends.lowering_for_gpu():
        assert attention.plan(q, kv, kv, causal=True).backend == backend


@pytest.mark.parametrize("q,match", [
    (_spec(dtype=jnp.float32)[0], r"bfloat16 or float16 inputs, got float32 \(float32 runs on the Triton backend\)"),
    (_spec(H=256)[0], r"head dims \(64, 128\), got H=256 \(its backward's dK and dV float32 accumulators"),
    (_spec(H=32)[0], r"head dims \(64, 128\), got H=32; available here: 'triton'"),
])
def test_explicit_mosaic_names_its_constraint(q, match):
    kv = jax.ShapeDtypeStruct((1, 64, 2, q.shape[-1]), q.dtype)
    with backends.lowering_for_gpu(), pytest.raises(ValueError, match=r"backend='mosaic' cannot run .*" + match):
        attention.plan(q, kv, kv, backend="mosaic")


def test_mosaic_refuses_interpret_mode():
    q, kv = _spec()
    with backends.lowering_for_gpu(), pytest.raises(ValueError, match=r"Mosaic backend has no interpret mode"):
        attention.plan(q, kv, kv, backend="mosaic", interpret=True)


def test_auto_compares_tuned_times_only_when_every_backend_has_one(monkeypatch):
    q, kv = _spec()
    times = {"triton": 100.0, "mosaic": None}
    monkeypatch.setattr(tuning, "tuned_time_us", lambda op, key, *, backend, **_: times[backend])
    with backends.lowering_for_gpu():
        assert attention.plan(q, kv, kv).backend == "mosaic"  # Triton's time alone: registry order
        times["mosaic"] = 120.0
        assert attention.plan(q, kv, kv).backend == "triton"  # both tuned: the faster
        times["mosaic"] = 80.0
        assert attention.plan(q, kv, kv).backend == "mosaic"


# ------------------------------------------------------------------------------------------------ Triton config
_S = SIZES
_TRITON = TestTriton()


def test_explicit_block_sizes_are_used_and_agree():
    B, T, S, N, K, H = 1, _S["long"], _S["odd_long"], 4, 2, 64
    q, k, v = qkv(B, T, S, N, K, H)
    blocks = dict(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16)
    _TRITON.check_against_reference(q, k, v, tol(q, k), causal=True, block_sizes=blocks)
    config = attention.plan(q, k, v, causal=True, block_sizes=blocks).config
    assert all(getattr(config, name) == value for name, value in blocks.items())


_CHAIN_CASES = {
    # name: (dtype, T, S, N, K, attention options); lengths odd, so the second chain of the last tile is partial
    "causal-gqa-T>S": (jnp.float32, _S["odd_long"], _S["odd_short"], 4, 2, dict(causal=True)),
    "bf16-kv-lengths": (jnp.bfloat16, _S["odd_long"], _S["odd_long"], 2, 1,
                        dict(kv_seq_lengths=jnp.array([_S["odd_short"] - 3] * _S["B"], jnp.int32))),
    "segments-causal": (jnp.float32, _S["odd_short"], _S["odd_short"], 2, 2, dict(causal=True, segment_ids=None)),
}


@pytest.mark.parametrize("case", [c if c == "causal-gqa-T>S" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in _CHAIN_CASES])
def test_two_query_chains_match_reference(case):
    dtype, T, S, N, K, options = _CHAIN_CASES[case]
    q, k, v = qkv(_S["B"], T, S, N, K, 64, dtype)
    if "segment_ids" in options:  # three packed sequences per row
        options = dict(options, segment_ids=jnp.broadcast_to(jnp.arange(T) * 3 // T, (_S["B"], T)).astype(jnp.int32))
    block_q = 128 if ON_GPU else 32  # two chains of 64 (GPU) / 16 (CPU) rows
    blocks = dict(block_q=block_q, query_chains=2)
    # query_chains is a Triton option: "auto" would plan Mosaic for bf16 on an sm90 GPU and refuse it
    config = attention.plan(q, k, v, block_sizes=blocks, backend="triton").config
    assert (config.block_q, config.query_chains) == (block_q, 2)
    _TRITON.check_against_reference(q, k, v, tol(q, k), block_sizes=blocks, **options)


@pytest.mark.slow
@pytest.mark.parametrize("masks", [dict(causal=True), dict(kv_seq_lengths=jnp.array([5], jnp.int32))])
def test_tiles_longer_than_the_sequences(masks):
    # Explicit tiles are not shrunk: every tile, forward and backward, reaches past T = 10 and S = 7.
    q, k, v = qkv(1, 10, 7, 2, 1, 64)
    blocks = dict(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32)
    _TRITON.check_against_reference(q, k, v, tol(q, k), block_sizes=blocks, **masks)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_sizes={"block_m": 64}), r"block_sizes: unknown fields \['block_m'\]"),
    (dict(block_sizes={"block_q": 48}), r"FlashAttentionConfig.block_q: must be a power of two >= 16, got 48"),
])
def test_bad_block_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        attention.flash_attention(*zeros(), **kwargs)


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
    q, k, v = zeros(T=4096, S=4096, N=16, K=16, H=128, dtype=jnp.bfloat16)
    key = attention.tuning_key(q, k, v, causal=True)
    assert key == "bfloat16[T=4096,S=4096,N=16,K=16,H=128]causal"
    assert tuning.lookup("flash_attention", key, device="H100", path=path) is None  # no file yet
    # Without a cache entry the GPU config is the table's.
    table = tuning.flash_attention_table(128, jnp.bfloat16, on_gpu=True)
    default = lambda causal: fa_config.default_config(q, k, causal=causal, on_gpu=True, device="H100",
                                                      cache_path=path)
    assert default(True).to_dict() == FlashAttentionConfig(**table).to_dict()
    tuned = dict(table, block_q=64, num_stages=4)
    tuning.store("flash_attention", key, tuned, time_us=123.456, device="H100", path=path)
    assert tuning.lookup("flash_attention", key, device="H100", path=path) == tuned
    assert tuning.lookup("flash_attention", key, device="A100", path=path) is None
    assert tuning.lookup("flash_attention", key, device="H100", backend="mosaic", path=path) is None
    assert tuning.load_cache(path)["entries"]["H100"]["triton"]["flash_attention"][key]["time_us"] == 123.46
    assert tuning.tuned_time_us("flash_attention", key, device="H100", path=path) == 123.46
    assert default(True).block_q == 64 and default(True).num_stages == 4
    # A non-causal call has another key, so it still gets the table.
    assert default(False).block_q == 128


def test_an_h200_takes_the_h100s_tuned_entries_until_it_has_its_own(tmp_path):
    path, key = tmp_path / "tuned.json", "bfloat16[M=8,K=8,N=8]"
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert tuning.SAME_CHIP[h200] == h100
    tuning.store("rmsnorm_matmul", key, {"tile_n": 128}, backend="mosaic", time_us=10.0, device=h100, path=path)
    assert tuning.lookup("rmsnorm_matmul", key, backend="mosaic", device=h200, path=path) == {"tile_n": 128}
    assert tuning.tuned_time_us("rmsnorm_matmul", key, backend="mosaic", device=h200, path=path) == 10.0
    assert tuning.lookup("rmsnorm_matmul", key, backend="triton", device=h200, path=path) is None
    assert tuning.lookup("rmsnorm_matmul", key, backend="mosaic", device="NVIDIA A100-SXM4-80GB", path=path) is None
    tuning.store("rmsnorm_matmul", key, {"tile_n": 256}, backend="mosaic", time_us=9.0, device=h200, path=path)
    assert tuning.lookup("rmsnorm_matmul", key, backend="mosaic", device=h200, path=path) == {"tile_n": 256}
    assert tuning.lookup("rmsnorm_matmul", key, backend="mosaic", device=h100, path=path) == {"tile_n": 128}


def test_table_tiles_shrink_to_short_sequences_but_explicit_sizes_do_not(tmp_path):
    q, k, v = zeros(T=20, S=40, H=128, dtype=jnp.bfloat16)
    none = tmp_path / "none.json"
    config = fa_config.default_config(q, k, on_gpu=True, device="H100", cache_path=none)
    assert (config.block_q, config.block_k, config.block_k_dkv, config.block_q_dq) == (32, 64, 64, 32)
    assert config.query_chains == 2  # the H=128 table's two chains, 16 rows each
    q_short = zeros(T=10, S=40, H=128, dtype=jnp.bfloat16)[0]
    config = fa_config.default_config(q_short, k, on_gpu=True, device="H100", cache_path=none)
    assert (config.block_q, config.query_chains) == (16, 1)  # a 16-row tile is not split
    explicit = FlashAttentionConfig(block_q=128)
    assert attention.plan(q, k, v, block_sizes=explicit).config is explicit


@pytest.mark.parametrize("T", [4096, 16])
def test_sweep_candidates_are_valid_configs(T):
    forward, backward = fa_config.sweep_candidates(128, jnp.bfloat16, T, 4096)
    assert len(forward) + len(backward) > 10
    for c in forward + backward:
        FlashAttentionConfig(**c)
    base = forward[0]
    assert backward[0] == base  # the table entry is timed first in both passes
    assert all(c[f] == base[f] for c in forward for f in c if f not in fa_config.FORWARD_FIELDS)
    assert all(c[f] == base[f] for c in backward for f in fa_config.FORWARD_FIELDS)
    # Two query chains are searched; at T = 16 the query tile shrinks to 16 rows, too short to split.
    assert {c["query_chains"] for c in forward} == ({1, 2} if T > 16 else {1})


def test_sweep_candidates_for_head_dim_256():
    forward, backward = fa_config.sweep_candidates(256, jnp.bfloat16, 2048, 2048)
    assert len(forward) > 10 and len(backward) > 5
    assert all(FlashAttentionConfig(**c).block_q <= 64 for c in forward)
