"""The Mosaic-GPU attention backend's own tests (the shared ones are ``TestMosaic`` in test_flash_attention.py).

CPU: the kernels do not run here, but they lower for CUDA inside ``backends.lowering_for_gpu()``: every default
config at the attention suite's shapes lowers, forward and backward, to the three kernels with three warpgroups
each, within an sm90 block's shared memory and at the sizes the backend's estimates give (an oversize config is the
public function's ValueError, and Mosaic's own overflow error when the kernel is lowered directly); sequences
shorter than a tile and vmap lower too; the config, its table and its sweep candidates validate.
GPU (sm90): configs other than the defaults (backward tiles, no ping-pong, persistent with more work items than
SMs and every mask, negative scales), sequences shorter than a tile, and vmap / jit / grad / checkpoint in bf16
against the float32 reference, through the public function. The fused backward (``fused_bwd``, an option): one
backward kernel with a TMA reduce-add, its shared memory counted, on the CPU; its numbers, with every mask and under
vmap / checkpoint, on the GPU.
"""

import jax
import jax.numpy as jnp
import pytest

from base_attention import AttentionTests, qkv, tol
from conftest import assert_close, key, normal
from hlo_inspect import mosaic_ir
from jaxfuse.suites.attention import SHAPES
from pallas_kernels import attention, backends, mosaic_utils, reference, tuning
from pallas_kernels.attention import config as fa_config
from pallas_kernels.attention import mosaic, mosaic_bwd, mosaic_bwd_kernels, mosaic_fwd

pytestmark = pytest.mark.timeout(120)  # enforced where pytest-timeout is installed (the GPU machine)

ON_SM90 = mosaic_utils.is_hopper()
gpu_only = pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU only")
Config = fa_config.MosaicAttentionConfig
KERNELS = ["mosaic_attention_fwd", "mosaic_attention_dq", "mosaic_attention_dkv"]


class _Mosaic(AttentionTests):  # the shared checks, for this module's own cases (not collected: no Test prefix)
    backend = "mosaic"


def _spec(B, T, S, N, K, H, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((B, T, N, H), dtype), jax.ShapeDtypeStruct((B, S, K, H), dtype),
            jax.ShapeDtypeStruct((B, S, K, H), dtype))


def _train_kernels(q, k, v, **options) -> list[mosaic_ir.MosaicKernel]:
    """The Mosaic kernels of forward + backward through the public function, lowered for CUDA."""
    def loss(q, k, v):
        return attention.flash_attention(q, k, v, backend="mosaic", **options).astype(jnp.float32).sum()

    with backends.lowering_for_gpu():
        return mosaic_ir.lower_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)


# ------------------------------------------------------------------------------------------------------- CPU
_SUITE = [pytest.param(name, causal, marks=() if name == "main" else pytest.mark.slow)
          for name in ("main", "1k", "8k", "gqa", "h64") for causal in (False, True)]


@pytest.mark.parametrize("name,causal", _SUITE)
def test_default_configs_lower_within_shared_memory_at_suite_shapes(name, causal):
    s = SHAPES[name]
    q, k, v = _spec(*(s[x] for x in "BTSNKH"))
    with backends.lowering_for_gpu():
        plan = attention.plan(q, k, v, causal=causal)
    assert plan.backend == "mosaic"  # "auto" picks it here
    config = plan.config
    fwd, dq, dkv = _train_kernels(q, k, v, causal=causal)
    assert [fwd.name, dq.name, dkv.name] == KERNELS
    assert {kernel.warpgroups for kernel in (fwd, dq, dkv)} == {3}  # one TMA warpgroup, two compute warpgroups
    H = s["H"]
    assert fwd.smem_bytes == mosaic_fwd.shared_memory_bytes(H, jnp.bfloat16, config)
    dq_bytes, dkv_bytes = mosaic_bwd.shared_memory_bytes(config, H)
    assert dq.smem_bytes <= dq_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert dkv.smem_bytes <= dkv_bytes <= mosaic_utils.H100_SMEM_BYTES


@pytest.mark.parametrize("shape,options", [
    ((1, 5, 7, 2, 1, 64), dict(causal=True)),  # shorter than one tile: padded rows
    pytest.param((2, 1, 77, 2, 2, 64), dict(scale=-0.3), marks=pytest.mark.slow),  # one query, negative scale
    pytest.param((2, 300, 1000, 4, 4, 128), dict(kv_seq_lengths=jnp.array([0, 999], jnp.int32)),
                 marks=pytest.mark.slow),
])
def test_lowers_at_odd_shapes(shape, options):
    assert [k.name for k in _train_kernels(*_spec(*shape), **options)] == KERNELS


def test_vmap_folds_into_the_batch_axis():
    q, k, v = _spec(2, 256, 256, 4, 2, 64)
    stack = lambda s: jax.ShapeDtypeStruct((3, *s.shape), s.dtype)  # noqa: E731
    f = jax.vmap(lambda q, k, v: attention.flash_attention(q, k, v, causal=True, backend="mosaic"))
    with backends.lowering_for_gpu():
        kernels = mosaic_ir.lower_kernels(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)),
                                          stack(q), stack(k), stack(v))
        plain = [k.grid for k in _train_kernels(q, k, v, causal=True)]
    assert [k.name for k in kernels] == KERNELS  # one launch each, the mapped axis folded into the batch
    assert [int(jnp.prod(jnp.array(k.grid))) for k in kernels] == [3 * int(jnp.prod(jnp.array(g))) for g in plain]


def test_shared_memory_estimates_match_the_lowering():
    q, k, v = _spec(1, 512, 512, 2, 2, 128)
    fits = Config(num_stages=3)  # 230536 bytes: just under the 232448 (227 KiB) an sm90 block can have
    assert mosaic.config_reason(q, fits, segments=False) is None
    assert _train_kernels(q, k, v, block_sizes=fits)[0].smem_bytes == 230536
    over = Config(num_stages=4)
    need = mosaic_fwd.shared_memory_bytes(128, jnp.bfloat16, over)
    with backends.lowering_for_gpu(), pytest.raises(ValueError, match=rf"block_sizes: the Mosaic backend's forward "
                                                                      rf"kernel needs {need} bytes"):
        attention.flash_attention(*(jnp.zeros(x.shape, x.dtype) for x in (q, k, v)), block_sizes=over)
    call = lambda q, k, v: mosaic_fwd.kernel_call(q, k, v, None, None, None, cfg=over, causal=False,  # noqa: E731
                                                  scale=0.1, residuals=False)[0]
    with pytest.raises(ValueError, match=f"exceeds available shared memory: smem_bytes={need} "):
        jax.jit(call).trace(q, k, v).lower(lowering_platforms=("cuda",))
    # The backward: 128x128 dQ tiles four deep are over the estimate, and over Mosaic's count too.
    over = Config(block_q_dq=128, block_kv_dq=128, num_stages_dq=4)
    assert "dQ kernel needs" in mosaic.config_reason(q, over, segments=False)
    problem = mosaic_bwd_kernels.Problem(B=1, T=512, S=512, N=2, K=2, H=128, T_pad=512, S_pad=512, causal=False,
                                         scale=1.0, has_segments=False, has_lengths=False)
    dq = lambda q, k, v, do, lse, delta: mosaic_bwd_kernels.dq_call(  # noqa: E731
        q, k, v, do, lse, delta, None, None, None, p=problem, block_q=128, block_kv=128, compute_wgs=2, num_stages=4)
    rows = jax.ShapeDtypeStruct((1, 2, 512), jnp.float32)
    with pytest.raises(Exception, match="(?i)shared memory"):
        jax.jit(dq).trace(q, k, v, q, rows, rows).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("field,value", [("block_q", 32), ("block_kv", 100), ("num_stages", 1), ("ping_pong", 1),
                                         ("persistent", "yes"), ("block_q_dq", 32), ("block_kv_dkv", 96),
                                         ("compute_wgs_dq", 3), ("num_stages_dkv", 0), ("block_kv_dq", True)])
def test_config_rejects_bad_fields_by_name(field, value):
    with pytest.raises(ValueError, match=f"MosaicAttentionConfig.{field}: must be"):
        Config(**{field: value})


def test_block_sizes_override_fields_of_the_default_config():
    q, k, v = _spec(1, 4096, 4096, 16, 16, 128)
    with backends.lowering_for_gpu():
        config = attention.plan(q, k, v, causal=True, block_sizes={"ping_pong": False, "block_kv_dq": 128,
                                                                    "num_stages_dq": 2}).config
        assert (config.ping_pong, config.block_kv_dq, config.num_stages_dkv) == (False, 128, 4)  # 4: the table's
        with pytest.raises(ValueError, match=r"block_sizes: unknown fields \['block_k'\]; allowed: \['block_q', "):
            attention.plan(q, k, v, block_sizes={"block_k": 64}, backend="mosaic")
        with pytest.raises(ValueError, match=r"block_sizes: the Mosaic backend's dQ kernel needs 266240 bytes of "
                                             r"shared memory"):  # (plan returned it; only the call refused it)
            attention.plan(q, k, v, causal=True, block_sizes={"ping_pong": False, "block_kv_dq": 128})


def test_default_config_table_and_tuning_cache(tmp_path):
    def config(name, causal, path=tmp_path / "none.json"):
        s = SHAPES[name]
        q, k, _ = _spec(*(s[x] for x in "BTSNKH"))
        return fa_config.mosaic_default_config(q, k, causal=causal, device="H100", cache_path=path)

    assert config("1k", False).persistent and not config("1k", True).persistent  # short non-causal H=128 only
    assert not any(config(name, False).persistent for name in ("main", "8k", "gqa", "h64"))
    assert (config("main", False).block_kv_dq, config("main", True).num_stages_dkv) == (128, 4)
    path = tmp_path / "tuned.json"
    s = SHAPES["main"]
    key = attention.tuning_key(*_spec(*(s[x] for x in "BTSNKH")), causal=True)
    tuning.store("flash_attention", key, Config(num_stages=3).to_dict(), backend="mosaic", device="H100", path=path)
    assert config("main", True, path).num_stages == 3 and config("main", False, path).num_stages == 2


@pytest.mark.parametrize("H,causal,S", [(128, False, 4096), (128, True, 1024), (64, False, 4096)])
def test_sweep_candidates_fit_and_vary_only_their_kernels_fields(H, causal, S):
    q, k, v = _spec(1, S, S, 2, 2, H)
    with backends.lowering_for_gpu():
        forward, backward = attention.sweep_candidates(q, k, v, causal=causal, backend="mosaic")
    assert len(forward) >= 5 and len(backward) >= 4
    base = forward[0]
    assert backward[0] == base == Config(**tuning.flash_attention_mosaic_table(H, causal=causal,
                                                                                kv_len=S)).to_dict()
    for c in forward + backward:
        assert mosaic.config_reason(q, Config(**c), segments=False) is None
    assert all(c[f] == base[f] for c in forward for f in c if f not in mosaic.FORWARD_FIELDS)
    assert all(c[f] == base[f] for c in backward for f in mosaic.FORWARD_FIELDS)
    assert any(c["persistent_dq"] != base["persistent_dq"] for c in backward)  # the persistent schedule toggled


# ------------------------------------------------------------------------------------------------------- GPU
_CONFIGS = {  # name: (config overrides, (B, T, S, N, K, H), masks, scale)
    "kv64-3-stages": (dict(block_kv=64, num_stages=3), (2, 1000, 1000, 4, 2, 128), "causal", 0.07),
    "no-ping-pong": (dict(ping_pong=False), (2, 1000, 777, 4, 2, 128), "lengths", -0.2),  # max(s)·c != max(s·c)
    "persistent-masks": (dict(persistent=True), (4, 1000, 1000, 8, 2, 128), "everything", 0.07),  # 256 items
    "persistent-h64": (dict(persistent=True, num_stages=3), (8, 300, 777, 8, 8, 64), "segments", 0.07),
    "persistent-causal-3-rounds": (dict(persistent=True), (6, 1000, 1000, 8, 2, 128), "causal", 0.07),  # 384 items
    "bwd-tiles": (dict(block_kv_dq=128, num_stages_dq=3, num_stages_dkv=4), (2, 777, 1000, 4, 1, 64), "causal",
                  0.07),
    "bwd-one-warpgroup": (dict(compute_wgs_dq=1, compute_wgs_dkv=1), (2, 1000, 1000, 4, 2, 128), "everything",
                          -0.1),
    "overlap-ping-pong": (dict(overlap=True, ping_pong=True), (2, 1000, 777, 4, 2, 128), "everything", 0.07),
    "overlap-causal": (dict(overlap=True, ping_pong=False), (2, 777, 1000, 4, 1, 128), "causal", -0.1),
    "fwd-h64-128-row-queries": (dict(block_q=128), (2, 1000, 777, 8, 2, 64), "everything", -0.1),
    "bwd-h64-128-row-queries": (dict(block_q_dkv=128, block_q_dq=128, block_kv_dq=64), (2, 1000, 777, 8, 2, 64),
                                "everything", 0.07),
    # 320 dQ and 160 dK/dV programs on 132 SMs: 2 or 3 chained pipelines per CTA (80 CTAs of 2 for dK/dV)
    "persistent-bwd-segments": (dict(persistent_dq=True, persistent_dkv=True), (10, 1000, 1000, 4, 2, 128), "segments", 0.07),
    "persistent-bwd-h64-tails": (dict(persistent_dq=True, persistent_dkv=True, block_kv_dq=128, num_stages_dkv=4),
                                 (3, 1000, 1000, 8, 8, 64), "none", -0.1),
}


def _masks(kind, B, T, S):
    """Options for a mask kind: "causal", "lengths" (an empty row, one off the tile grid, all, all but 7),
    "segments" (three sorted segments per row) or "everything"."""
    options = {}
    if kind in ("causal", "everything"):
        options["causal"] = True
    if kind in ("lengths", "everything"):
        options["kv_seq_lengths"] = jnp.array([(0, S // 2 + 13, S, S - 7)[b % 4] for b in range(B)], jnp.int32)
    if kind in ("segments", "everything"):
        options["segment_ids"] = tuple(jnp.sort(jax.random.randint(key(), (B, L), 0, 3), axis=1) for L in (T, S))
    return options


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_CONFIGS))
def test_other_configs_lower(name):
    """The GPU cases below, lowered here: the three kernels, the mask kinds and configs accepted."""
    overrides, (B, T, S, N, K, H), kind, scale = _CONFIGS[name]
    kernels = _train_kernels(*_spec(B, T, S, N, K, H), block_sizes=overrides, scale=scale, **_masks(kind, B, T, S))
    assert [k.name for k in kernels] == KERNELS
    assert kernels[0].warpgroups == 3 and kernels[1].warpgroups == 1 + overrides.get("compute_wgs_dq", 2)


@pytest.mark.parametrize("causal", [False, True])
def test_persistent_backward_lowers_to_one_cta_per_sm_where_its_steps_are_static(causal):
    """persistent_dq / persistent_dkv: both backward kernels on a grid of one CTA per SM (at most half their programs) without a
    causal mask; causal (a dynamic step count per program) keeps one CTA per program."""
    B, T, S, N, K, H = 2, 1000, 1000, 8, 2, 128
    kernels = _train_kernels(*_spec(B, T, S, N, K, H), block_sizes=dict(persistent_dq=True, persistent_dkv=True), causal=causal)
    by_name = {k.name: k for k in kernels}
    dq, dkv = by_name["mosaic_attention_dq"], by_name["mosaic_attention_dkv"]
    cfg = Config(**tuning.flash_attention_mosaic_table(H, causal=causal, kv_len=S))
    dq_programs = (-(-T // (cfg.compute_wgs_dq * cfg.block_q_dq)), N, B)
    dkv_programs = (-(-S // (cfg.compute_wgs_dkv * cfg.block_kv_dkv)), K, B)
    if causal:
        assert sorted(dq.grid) == sorted(dq_programs) and sorted(dkv.grid) == sorted(dkv_programs)  # any order
    else:
        for kernel, programs in ((dq, dq_programs), (dkv, dkv_programs)):
            items = programs[0] * programs[1] * programs[2]
            assert kernel.grid == (min(mosaic_utils.H100_SMS, items // 2), 1, 1)
    assert all(k.warpgroups == 3 for k in kernels)


def test_persistent_schedule_needs_static_steps_that_fill_the_stages():
    ctas = mosaic_bwd_kernels.persistent_ctas
    assert ctas(2048, 8, 2) == mosaic_utils.H100_SMS and ctas(100, 8, 2) == 50
    assert ctas(2048, 9, 2) == 0 and ctas(2048, None, 2) == 0 and ctas(1, 8, 2) == 0


@gpu_only
@pytest.mark.parametrize("name", list(_CONFIGS))
def test_other_configs_match_reference(name):
    _check_case(*_CONFIGS[name])


def _check_case(overrides, shape, kind, scale):
    """A case of _CONFIGS or _FUSED through the public function against the float32 reference (bf16, gradients)."""
    B, T, S, N, K, H = shape
    q, k, v = qkv(B, T, S, N, K, H, jnp.bfloat16)
    _Mosaic().check_against_reference(q, k, v, tol(q, k), block_sizes=overrides, scale=scale,
                                      **_masks(kind, B, T, S))


@gpu_only
@pytest.mark.parametrize("T,S,causal", [(5, 7, True), (1, 9, False), (70, 3, True), (130, 60, False)])
def test_sequences_shorter_than_a_tile(T, S, causal):
    q, k, v = qkv(2, T, S, 2, 1, 64, jnp.float16)
    _Mosaic().check_against_reference(q, k, v, tol(q, k), causal=causal)


@gpu_only
def test_vmap_jit_grad_and_checkpoint_match_reference():
    """The base's transform tests run in float32, which this backend leaves to Triton: the same in bf16."""
    V, B, T, N, H = 3, 2, 777, 4, 64
    q, k, v = (normal((V, B, T, N, H), jnp.bfloat16) for _ in range(3))

    def loss(attn, q, k, v):
        o = jax.vmap(attn)(q, k, v)  # (V, B, T, N, H)
        return jnp.sum(o.astype(jnp.float32) * jnp.cos(o.astype(jnp.float32)))

    def grads(attn, *args):
        return jax.jit(jax.grad(lambda *a: loss(attn, *a), argnums=(0, 1, 2)))(*args)

    mosaic_attn = lambda q, k, v: attention.flash_attention(q, k, v, causal=True, backend="mosaic")  # noqa: E731
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    got, remat = grads(mosaic_attn, q, k, v), grads(jax.checkpoint(mosaic_attn), q, k, v)
    want = grads(lambda q, k, v: reference.attention(q, k, v, causal=True), up(q), up(k), up(v))
    for name, g, r, w in zip(("dq", "dk", "dv"), got, remat, want):
        assert_close(g, w, tol(q[0], k[0]), name)
        assert_close(r, w, tol(q[0], k[0]), name + " (checkpoint)")


# ------------------------------------------------------------------------------- fused backward (config.fused_bwd)
_FUSED = {  # name: (config overrides, (B, T, S, N, K, H), masks, scale); dq_split "heads" at H=128, else "own"
    "fused-heads": (dict(fused_bwd=True, num_stages_dkv=2), (2, 1000, 777, 4, 2, 128), "everything", 0.07),
    "fused-own-h64": (dict(fused_bwd=True, num_stages_dkv=2), (2, 777, 1000, 8, 2, 64), "causal", -0.1),
    "fused-one-warpgroup": (dict(fused_bwd=True, compute_wgs_dkv=1, num_stages_dkv=2), (2, 1000, 1000, 4, 4, 128), "lengths", 0.07),
}


@pytest.mark.parametrize("name", list(_FUSED))
def test_fused_backward_lowers_to_one_kernel_adding_into_dq(name):
    overrides, (B, T, S, N, K, H), kind, scale = _FUSED[name]
    table = tuning.flash_attention_mosaic_table(H, causal=kind in ("causal", "everything"), kv_len=S, groups=N // K)
    config = Config(**dict(table, **overrides))  # what the call runs: the table entry with the overrides
    kernels = _train_kernels(*_spec(B, T, S, N, K, H), block_sizes=overrides, scale=scale, **_masks(kind, B, T, S))
    assert len(kernels) == 2 and kernels[0].name == "mosaic_attention_fwd"  # no dQ kernel
    fused = kernels[1]
    assert fused.warpgroups == 1 + config.compute_wgs_dkv
    assert fused.tma_reduce_stores().get("add", 0) >= 1  # dQ by TMA reduce-add
    segments = kind in ("segments", "everything")
    assert fused.smem_bytes <= mosaic_bwd.fused.shared_memory_bytes(config, H, segments=segments)
    assert mosaic_bwd.fused.dq_split_for(H, config.compute_wgs_dkv) == ("heads" if name == "fused-heads" else "own")


def test_fused_backward_shared_memory_is_checked():
    q = _spec(1, 512, 512, 2, 2, 128)[0]
    assert mosaic.config_reason(q, Config(fused_bwd=True), segments=False) is None
    reason = mosaic.config_reason(q, Config(fused_bwd=True, num_stages_dkv=3), segments=False)
    assert "fused backward kernel needs" in reason  # the dSᵀ ring and float32 dQ tiles leave room for 2 stages


def test_fused_backward_has_no_interpret_mode():
    with mosaic_utils.interpret_on_cpu(), pytest.raises(NotImplementedError, match="reduce-add"):
        mosaic_utils.kernel_accumulating(lambda *refs: None, accumulator=jax.ShapeDtypeStruct((8,), jnp.float32),
                                         out_type=(), grid=(1,), grid_names=("x",), num_threads=1,
                                         thread_name="wg", name="k")


@gpu_only
@pytest.mark.parametrize("name", list(_FUSED))
def test_fused_backward_matches_reference(name):
    _check_case(*_FUSED[name])


@gpu_only
def test_fused_backward_under_vmap_and_checkpoint():
    V, B, T, N, H = 2, 2, 500, 4, 128
    q, k, v = (normal((V, B, T, N, H), jnp.bfloat16) for _ in range(3))
    fused = Config(fused_bwd=True)
    attn = lambda q, k, v: attention.flash_attention(q, k, v, causal=True, backend="mosaic",  # noqa: E731
                                                     block_sizes=fused)
    loss = lambda f: lambda *a: jnp.sum(jax.vmap(f)(*a).astype(jnp.float32) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(loss(jax.checkpoint(attn)), argnums=(0, 1, 2)))(q, k, v)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = jax.jit(jax.grad(loss(lambda q, k, v: reference.attention(q, k, v, causal=True)), argnums=(0, 1, 2)))(
        up(q), up(k), up(v))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, tol(q[0], k[0]), name)
