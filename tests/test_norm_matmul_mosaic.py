"""What only the Mosaic (Hopper) backend of rmsnorm_matmul has; the shared tests are ``TestMosaic`` in
``test_rmsnorm_matmul.py``.

On any machine: which suite shapes it takes, its config, and the CUDA lowering at the suite shapes (one Mosaic kernel
forward and three forward + backward within shared memory, the statistics warpgroup, every sweep candidate, no
normalized (M, K) tensor in the HLO). On an sm90 GPU (per-test timeout): numbers at real shapes with the default
and the statistics-warpgroup configs, float16, extreme magnitudes, NaN. On the CPU (slow): the same numbers in GPU
interpret mode at tiny shapes, through the backend module (the registry runs Mosaic on an sm90 GPU only).
"""

import dataclasses
import hashlib
import re
import types

import jax
import jax.numpy as jnp
import pytest

from base_norm_matmul import NormMatmulTests, inputs
from conftest import GPU_TIMEOUT, assert_close, normal, tolerance
from hlo_inspect import mosaic_ir, ptxas
from pallas_kernels import backends, mosaic_utils, norm_matmul, reference, tuning
from pallas_kernels.gemm import MosaicGemmConfig, smem_bytes, stream_k
from pallas_kernels.gemm.config import BARRIER_BYTES
from pallas_kernels.norm_matmul import config as nm_config
from pallas_kernels.norm_matmul import mosaic as nm

ON_SM90 = mosaic_utils.is_hopper()
cpu_only = pytest.mark.skipif(jax.default_backend() == "gpu", reason="structure / interpret-mode checks")
S = jax.ShapeDtypeStruct
SUITE_SHAPES = [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144), (16384, 1024, 5504),
               (4096, 2048, 128256)]  # (M, K, N); the last: the 1b preset's lm_head (row_dot "k")
Config = nm_config.MosaicRMSNormMatmulConfig


def gpu_only(test):
    """Runs on an sm90 GPU only, within GPU_TIMEOUT."""
    return pytest.mark.skipif(not ON_SM90, reason="Mosaic-GPU kernels run on an sm90 GPU")(GPU_TIMEOUT(test))


@pytest.fixture(autouse=True)
def _built_in_tables_where_untuned(request, monkeypatch):
    """The tests here name the forms they check: a shape no tuned entry covers takes the built-in tables, on every
    device. The tests of the rule that gives such shapes another entry's forms (``test_untuned_*``) keep it."""
    if not request.node.name.startswith("test_untuned"):
        monkeypatch.setattr(nm_config, "UNTUNED_DEVICES", ())


class _Mosaic(NormMatmulTests):  # the shared checks, through the public function (not collected: no Test prefix)
    backend = "mosaic"


class _Interpreted(NormMatmulTests):
    """The shared checks on the backend module itself, for GPU interpret mode on the CPU (``interpret_on_cpu``),
    at tiny tiles (several tiles along every axis)."""

    backend = "mosaic"
    sizes = dict(odd=128, K=128, N=256)
    tiles = MosaicGemmConfig(tile_m=64, tile_n=64, tile_k=32, num_stages=2, epi_tile_n=32)

    def rmsnorm_matmul(self, x, gamma, w, *, residual=None, eps=1e-6, block_sizes=None):
        config = block_sizes or Config(forward=self.tiles, dx=self.tiles, dw=self.tiles)
        return nm.rmsnorm_matmul(x, gamma, w, eps=eps, residual=residual, out_dtype=x.dtype, interpret=False,
                                 config=config)

    def require(self, *args, **kwargs):
        pass


# ---------------------------------------------------------------------------------------------------------------
# Shapes and config
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M, K, N, message", [
    (16, 4096, 4096, "M=16 is below 24 rows"),
    (1, 1040, 4096, "one row (M=1): K=1040 is not a multiple of 512"),
    (1, 4096, 4112, "one row (M=1): N=4112 is not a positive multiple of the rows"),
    (1024, 4100, 1024, "K=4100 is not a positive multiple of tile_k=64"),
    (1024, 1024, 1000, "N=1000 is not a positive multiple of the columns"),
])
def test_decode_and_untiled_shapes_are_unsupported_naming_the_constraint(M, K, N, message):
    x, g, w = S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)
    reason = nm.unsupported_reason(x, g, w)
    assert reason is not None and message in reason


def test_one_row_takes_bfloat16_only_and_a_gemv_config():
    x, g, w = S((1, 4096), jnp.float16), S((4096,), jnp.float16), S((4096, 14336), jnp.float16)
    assert "bfloat16 only" in nm.unsupported_reason(x, g, w)
    x, g, w = S((1, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16), S((4096, 14336), jnp.bfloat16)
    assert nm.unsupported_reason(x, g, w) is None
    config = nm.default_config(x, g, w, residual=None)
    assert config.forward.tile_n == config.forward.cta_n == nm_config.ONE_ROW_PADDED
    cooperative = dataclasses.replace(config, forward=dataclasses.replace(config.forward, schedule="cooperative"))
    with pytest.raises(ValueError, match=r"one row \(M=1\): .* needs tile_n=16 and schedule='pingpong' or "
                                         r"wg_split='m'"):
        nm.check_config(cooperative, x, g, w)


def test_one_row_shapes_the_gemv_cannot_take_fall_back_to_triton_or_name_why():
    x, g, w = (jnp.zeros(s, jnp.bfloat16) for s in ((1, 1040), (1040,), (1040, 4096)))
    with backends.lowering_for_gpu():
        assert norm_matmul.plan(x, g, w).backend == "triton"
        with pytest.raises(ValueError, match=r"backend='mosaic' cannot run rmsnorm_matmul here: one row \(M=1\): "
                                             r"K=1040 is not a multiple of 512"):
            norm_matmul.plan(x, g, w, backend="mosaic")
        x16, g16, w16 = (a.astype(jnp.float16) for a in (x, g, w))
        with pytest.raises(ValueError, match=r"x: dtype float16 at one row \(M=1\).*bfloat16 only"):
            norm_matmul.rmsnorm_matmul(x16, g16, w16, backend="mosaic")


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("M, K, N", SUITE_SHAPES)
def test_the_suite_shapes_are_supported(M, K, N, residual):
    x, g, w = S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)
    assert nm.unsupported_reason(x, g, w, residual=x if residual else None) is None


def test_config_takes_gemm_configs_or_their_fields(monkeypatch):
    with pytest.raises(ValueError, match="MosaicRMSNormMatmulConfig.dx: must be a MosaicGemmConfig or a mapping"):
        Config(forward=MosaicGemmConfig(), dx=[64], dw=MosaicGemmConfig())
    with pytest.raises(ValueError, match="MosaicGemmConfig.tile_m"):
        Config(forward=MosaicGemmConfig(), dx={"tile_m": 96}, dw=MosaicGemmConfig())
    config = nm_config.mosaic_default_config(4096, 4096, 14336)
    assert Config(**config.to_dict()) == config  # tuned entries are stored as dicts
    monkeypatch.setattr(tuning, "device_kind", lambda: "cpu")  # the built-in config, not this GPU's tuned entry
    built_in = nm_config.mosaic_default_config(4096, 4096, 14336)
    assert (built_in.forward.pipeline, built_in.forward.grid_tile_width, built_in.stats_in_kernel) == ("own", 8, False)


@pytest.mark.parametrize("fields", [dict(pipeline="pallas_steady"), dict(wg_split="m", tile_m=64),
                                    dict(schedule="pingpong")])
def test_the_statistics_warpgroup_needs_our_k_loop_and_shared_rows(fields):
    forward = MosaicGemmConfig(**fields)
    with pytest.raises(ValueError, match="stats_in_kernel: the statistics need the forward config's pipeline='own' "
                                         "and schedule='cooperative', and wg_split='n' in a fourth warpgroup"):
        Config(forward=forward, dx=MosaicGemmConfig(), dw=MosaicGemmConfig(), stats_in_kernel=True)
    stacked = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", prologue_in="memory")
    assert Config(forward=stacked, dx=stacked, dw=stacked, stats_in_kernel=True).forward.prologue_in == "memory"


def test_block_sizes_override_single_kernels():
    x, g, w = (jnp.zeros(s, jnp.bfloat16) for s in ((4096, 4096), (4096,), (4096, 4096)))
    with backends.lowering_for_gpu():
        plan = norm_matmul.plan(x, g, w, backend="mosaic", block_sizes={"dw": {"tile_m": 64, "wg_split": "m"}})
    default = nm_config.mosaic_default_config(4096, 4096, 4096)
    assert plan.config.dw == MosaicGemmConfig(tile_m=64, wg_split="m") and plan.config.forward == default.forward


# ---------------------------------------------------------------------------------------------------------------
# Structure (lowered for CUDA; no GPU needed)
# ---------------------------------------------------------------------------------------------------------------
def _fwd_bwd(M, K, N, residual, config=None):
    def fwd_bwd(x, g, w, dy, *r):
        def fn(x, g, w, *r):
            return norm_matmul.rmsnorm_matmul(x, g, w, residual=r[0] if r else None, backend="mosaic",
                                              block_sizes=config)

        out, vjp = jax.vjp(fn, x, g, w, *r)
        return out, vjp((x, dy) if r else dy)

    dt = jnp.bfloat16
    args = [S((M, K), dt), S((K,), dt), S((K, N), dt), S((M, N), dt)] + ([S((M, K), dt)] if residual else [])
    return fwd_bwd, args


_KERNELS_OF = {}  # sha256 of a traced program's jaxpr (as text) -> its Mosaic kernels lowered for CUDA


def _lowered_kernels(fn, *args):
    """``mosaic_ir.lower_kernels(fn, *args)`` (inside ``backends.lowering_for_gpu``), lowered once per distinct
    traced program in this module: the sweep's candidates share programs (a forward-only program does not depend
    on the dx and dw fields: the backward candidates share the base forward), and lowering costs most of
    ``_check_kernels``' time. The caller's assertions still run for every config."""
    traced = jax.jit(fn).trace(*args)
    key = hashlib.sha256(str(traced.jaxpr).encode()).hexdigest()
    if key not in _KERNELS_OF:
        _KERNELS_OF[key] = mosaic_ir.lower_kernels(types.SimpleNamespace(trace=lambda *_: traced), *args)
    return _KERNELS_OF[key]


def _check_kernels(M, K, N, residual, config=None, forward_only=True):
    """The forward + backward program's kernels (names, shared memory, warpgroups, wgmma and TMA), and with
    ``forward_only`` a forward-only program's one kernel (a backward candidate's forward is another's)."""
    fn, args = _fwd_bwd(M, K, N, residual, config)
    with backends.lowering_for_gpu():
        kernels = _lowered_kernels(fn, *args)
        alone = _lowered_kernels(lambda x, g, w: norm_matmul.rmsnorm_matmul(
            x, g, w, backend="mosaic", block_sizes=config), *args[:3]) if forward_only else None
    resolved = config or nm_config.mosaic_default_config(M, K, N, residual=residual)
    dw_kernel = [] if resolved.dw_by_xla(K, N) else ["rmsnorm_matmul_dw"]
    backward = [] if resolved.backward_in_xla else ["rmsnorm_matmul_dx", *dw_kernel]
    assert [k.name for k in kernels] == ["rmsnorm_matmul_fwd", *backward]
    statistics_warpgroup = (config is not None and config.stats_in_kernel is True
                            and config.forward.prologue_in == "fourth")
    epilogue_warpgroup = resolved.dx.epilogue_in == "fourth"  # (the dx kernel's epilogue in a fourth warpgroup)
    for k, warpgroups in zip(kernels, (4 if statistics_warpgroup else 3, 4 if epilogue_warpgroup else 3, 3)):
        assert k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES and k.warpgroups == warpgroups
        assert k.wgmma() and k.tma_loads() >= 2
    assert alone is None or [k.name for k in alone] == ["rmsnorm_matmul_fwd"]


@cpu_only
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("M, K, N", SUITE_SHAPES)
def test_three_kernels_within_shared_memory_at_the_suite_shapes(M, K, N, residual):
    _check_kernels(M, K, N, residual)


def _statistics_config(M: int, K: int, N: int, where: str):
    """The default config with r summed in the forward kernel: by the MMA warpgroups ("mma": whole tiles, one wgmma
    group in flight) or by the memory warpgroup ("memory": the stacked 64x256 tiles, prologue_in "memory")."""
    if where == "mma":
        config = nm_config.mosaic_default_config(M, K, N, stats_in_kernel="mma")
        assert (config.forward.delay_release, config.forward.stream_k) == (1, 0)
        return config
    base = nm_config.mosaic_default_config(M, K, N)
    forward = dataclasses.replace(base.forward, prologue_in="memory", stream_k=0)
    return dataclasses.replace(base, forward=forward, stats_in_kernel=True, gamma_on="w")


@cpu_only
@pytest.mark.parametrize("where", ["mma", "memory"])
@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (4096, 4096, 14336)])
def test_the_kernels_statistics_fit_in_three_warpgroups(M, K, N, where):
    """r summed by the MMA warpgroups or the memory warpgroup: three warpgroups, within shared memory, γ on w, and
    the forward program has no XLA pass over x (the kernel outputs r)."""
    config = _statistics_config(M, K, N, where)
    assert config.gamma_side(M, N, jnp.bfloat16) == "w"
    _check_kernels(M, K, N, False, config)
    with backends.lowering_for_gpu():
        program = jax.jit(lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=config)
                          ).trace(S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert _mk_producers(program, M, K) == []


@cpu_only
@pytest.mark.parametrize("M, K, N, residual", [(32768, 4096, 4096, False), (16384, 1024, 5504, True)])
def test_the_statistics_warpgroup_fits(M, K, N, residual):
    config = nm_config.mosaic_default_config(M, K, N, residual=residual, stats_in_kernel=True)
    assert config.forward.wg_split == "n"
    _check_kernels(M, K, N, residual, config)


def test_row_dot_side_is_k_unless_named():
    tiles = MosaicGemmConfig()
    with pytest.raises(ValueError, match="row_dot: must be None, 'n' or 'k', got 'm'"):
        Config(forward=tiles, dx=tiles, dw=tiles, row_dot="m")
    assert Config(forward=tiles, dx=tiles, dw=tiles).row_dot_side() == "k"
    assert Config(forward=tiles, dx=tiles, dw=tiles, row_dot="n").row_dot_side() == "n"


def test_gamma_side_is_x_for_bfloat16_where_m_is_below_2n_unless_named():
    tiles = MosaicGemmConfig()
    auto = Config(forward=tiles, dx=tiles, dw=tiles)
    assert [auto.gamma_side(M, N, jnp.bfloat16) for M, N in ((4096, 128256), (8192, 4097), (8192, 4096))] == [
        "x", "x", "w"]
    assert auto.gamma_side(4096, 128256, jnp.float16) == "w"
    assert dataclasses.replace(auto, stats_in_kernel=True).gamma_side(4096, 128256, jnp.bfloat16) == "w"
    assert Config(forward=tiles, dx=tiles, dw=tiles, gamma_on="w").gamma_side(4096, 128256, jnp.bfloat16) == "w"


@pytest.mark.parametrize("changes, match", [
    (dict(row_dot="k"), "row_dot_in_dx: must be False, True, 'prefetch' or 'tma', not False only with row_dot='n' .* "
                        "row_dot='k'"),
    (dict(row_dot_in_dx="always"), "must be False, True, 'prefetch' or 'tma'"),
    (dict(row_dot=None), "not False only with row_dot='n'"),
    (dict(dx=MosaicGemmConfig(stream_k=4)), "row_dot_in_dx: the dx kernel's first tile of each row block passes the "
                                            "row dot to its others; .* stream_k=4"),
    (dict(dx=MosaicGemmConfig(schedule="pingpong")), "schedule='pingpong'")])
def test_the_row_dot_from_the_dx_kernel_needs_the_n_side_and_whole_cooperative_tiles(changes, match):
    tiles = MosaicGemmConfig()
    with pytest.raises(ValueError, match=match):
        Config(**dict(dict(forward=tiles, dx=tiles, dw=tiles, row_dot="n", row_dot_in_dx=True), **changes))
    assert Config(forward=tiles, dx=tiles, dw=tiles, row_dot="n", row_dot_in_dx=True).to_dict()["row_dot_in_dx"]
    if "stream_k" in match:  # y by TMA keeps stream-K: its tiles never run the a_observe
        Config(**dict(dict(forward=tiles, dx=tiles, dw=tiles, row_dot="n", row_dot_in_dx="tma"), **changes))


@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (8192, 4096, 6144)])
def test_y_by_tma_fits_beside_the_dx_stages_only_without_a_residual_and_the_x_tile_in_the_ring(M, K, N):
    """row_dot_in_dx="tma" on the N side at two suite shapes (the H200 entries' dx tiles at 3 stages; both entries
    are on the K side, 32768x4096x4096 since the forty-third session, 8192x4096x6144 since the fiftieth): with the
    x tile through the B stages the y stages and dyr's staging fit; with a fourth stage, the x tile in a buffer of
    its own, or a residual (x and dh tiles), the XLA pass takes the row dot (and dyr still comes from the dx kernel
    where it fits)."""
    entries = tuning.load_cache()["entries"]["NVIDIA H200"]["mosaic"]["rmsnorm_matmul"]
    entry = Config(**entries[nm_config.shape_key(M, K, N, jnp.bfloat16)]["params"])
    entry = dataclasses.replace(entry, row_dot="n", dyr_in_dx=None, dx_in_kernel=False, xr_in_dx=False,
                                row_dot_in_dx=False)  # (both entries are on the K side since the fiftieth session)
    ring = dataclasses.replace(entry, row_dot_in_dx="tma", dx=dataclasses.replace(_stacked_dx(entry),
                                                                                  tile_input_in="ring", stream_k=0,
                                                                                  num_stages=3))
    assert ring.row_dot_by_dx(jnp.bfloat16, False) == "tma" and ring.dyr_by_dx(jnp.bfloat16, False)
    four = dataclasses.replace(ring, dx=dataclasses.replace(ring.dx, num_stages=4))
    assert four.row_dot_by_dx(jnp.bfloat16, False) is False
    assert ring.row_dot_by_dx(jnp.bfloat16, True) is False
    assert ring.dx_config(False) == ring.dx  # with a residual: x and dh in buffers, 2 of the 3 stages beside them
    assert ring.dx_config(True) == dataclasses.replace(ring.dx, tile_input_in="buffer", num_stages=2)
    buffer = dataclasses.replace(ring, dx=dataclasses.replace(ring.dx, tile_input_in="buffer"))
    assert buffer.row_dot_by_dx(jnp.bfloat16, False) is False and buffer.dyr_by_dx(jnp.bfloat16, False)


@cpu_only
def test_y_by_tma_beside_dy_in_the_dx_kernel_lowers_with_a_third_stage_buffer():
    """row_dot_in_dx="tma" at 32768x4096x4096 with the H200 entry's dx tiles at 3 stages (the x tile through the B
    stages; y's stages take the room of the entry's fourth), whole tiles: no XLA reduction over an (M, N) tensor,
    and the dx kernel within shared memory with y's stages beside the others."""
    M, K, N = 32768, 4096, 4096
    entries = tuning.load_cache()["entries"]["NVIDIA H200"]["mosaic"]["rmsnorm_matmul"]
    entry = Config(**entries[nm_config.shape_key(M, K, N, jnp.bfloat16)]["params"])
    config = dataclasses.replace(entry, row_dot="n", dyr_in_dx=None, dx_in_kernel=False, xr_in_dx=False,
                                 row_dot_in_dx="tma",
                                 dx=dataclasses.replace(_stacked_dx(entry), tile_input_in="ring", stream_k=0,
                                                        num_stages=3))
    fn, args = _fwd_bwd(M, K, N, residual=False, config=config)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        kernels = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}
    assert not [line for line in program.splitlines() if "stablehlo.reduce" in line and f"tensor<{M}x{N}x" in line]
    dx = kernels["rmsnorm_matmul_dx"]
    assert dx.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    plain = dataclasses.replace(config, row_dot_in_dx=False)
    fn, args = _fwd_bwd(M, K, N, residual=False, config=plain)
    with backends.lowering_for_gpu():
        plain_dx = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}["rmsnorm_matmul_dx"]
    y_stages = config.dx.num_stages * config.dx.cta_m * config.dx.tile_k * 2
    assert dx.smem_bytes - plain_dx.smem_bytes >= y_stages


@cpu_only
def test_the_row_dot_from_the_dx_kernel_leaves_no_xla_pass_over_dy():
    """row_dot_in_dx in the CUDA lowering: no XLA reduction over an (M, N) tensor (M, K, N distinct here); the dx
    kernel takes y as an input and lowers within shared memory."""
    M, K, N = 1024, 2048, 4096
    base = nm_config.mosaic_default_config(M, K, N)
    config = dataclasses.replace(base, row_dot="n", row_dot_in_dx=True, dw_in_xla=False)
    fn, args = _fwd_bwd(M, K, N, residual=False, config=config)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        kernels = mosaic_ir.lower_kernels(fn, *args)
    assert [k.name for k in kernels] == ["rmsnorm_matmul_fwd", "rmsnorm_matmul_dx", "rmsnorm_matmul_dw"]
    assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels)
    assert not [line for line in program.splitlines() if "stablehlo.reduce" in line and f"tensor<{M}x{N}x" in line]
    without = dataclasses.replace(config, row_dot_in_dx=False)
    fn, args = _fwd_bwd(M, K, N, residual=False, config=without)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert [line for line in program.splitlines() if "stablehlo.reduce" in line and f"tensor<{M}x{N}x" in line]


@pytest.mark.parametrize("fields", [dict(schedule="pingpong", tile_m=128, tile_n=128), dict(cluster="m")])
def test_r_shared_from_each_row_blocks_first_tile_needs_cooperative_tiles(fields):
    forward = MosaicGemmConfig(**dict(dict(tile_m=64, tile_n=256, wg_split="m", delay_release=1), **fields))
    with pytest.raises(ValueError, match="stats_in_kernel: 'mma_shared' passes r from each row block's first tile "
                                         "to its others; the forward config needs schedule='cooperative'"):
        Config(forward=forward, dx=MosaicGemmConfig(), dw=MosaicGemmConfig(), stats_in_kernel="mma_shared")


def test_gamma_on_x_needs_xla_statistics_and_bfloat16():
    tiles = MosaicGemmConfig()
    with pytest.raises(ValueError, match="gamma_on: must be None, 'w', 'x' or 'a', got 'b'"):
        Config(forward=tiles, dx=tiles, dw=tiles, gamma_on="b")
    with pytest.raises(ValueError, match="gamma_on: 'x' feeds the kernel x ⊙ gamma, .* stats_in_kernel=False"):
        Config(forward=tiles, dx=tiles, dw=tiles, stats_in_kernel=True, gamma_on="x")
    with pytest.raises(ValueError, match="gamma_on: 'x' feeds the kernel x ⊙ gamma, .* stats_in_kernel=False"):
        Config(forward=tiles, dx=tiles, dw=tiles, stats_in_kernel="mma", gamma_on="x")
    with pytest.raises(ValueError, match="stats_in_kernel: must be False, True, 'mma', 'mma_rows' or 'mma_shared', "
                                         "got 'warpgroup'"):
        Config(forward=tiles, dx=tiles, dw=tiles, stats_in_kernel="warpgroup")
    with pytest.raises(ValueError, match="stats_in_kernel: 'mma' .* needs pipeline='own', got 'pallas'"):
        Config(forward=dataclasses.replace(tiles, pipeline="pallas"), dx=tiles, dw=tiles, stats_in_kernel="mma")
    Config(forward=dataclasses.replace(tiles, stream_k=4), dx=tiles, dw=tiles, stats_in_kernel="mma")  # partial sums
    registers = Config(forward=tiles, dx=tiles, dw=tiles, stats_in_kernel="mma")  # the kernel squares its A: x
    assert registers.gamma_side(512, 4096, jnp.bfloat16) == "w"
    config = Config(forward=tiles, dx=tiles, dw=tiles, gamma_on="x")
    x, g, w = (jax.ShapeDtypeStruct(s, jnp.float16) for s in ((512, 512), (512,), (512, 512)))
    with backends.lowering_for_gpu(), pytest.raises(ValueError, match="gamma_on='x' rounds x ⊙ gamma to x's dtype, "
                                                                      "bfloat16 only \\(x is float16"):
        jax.eval_shape(lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=config),
                       x, g, w)


def test_gamma_on_a_needs_our_k_loop_bfloat16_and_no_statistics_warpgroup():
    tiles = MosaicGemmConfig(delay_release=1)
    with pytest.raises(ValueError, match="gamma_on: 'a' multiplies the x blocks in the MMA warpgroups' registers: .* "
                                         "got pipeline='own', stats_in_kernel=True"):
        Config(forward=tiles, dx=tiles, dw=tiles, stats_in_kernel=True, gamma_on="a")
    with pytest.raises(ValueError, match="gamma_on: 'a' .* got pipeline='pallas', stats_in_kernel=False"):
        Config(forward=dataclasses.replace(tiles, pipeline="pallas"), dx=tiles, dw=tiles, gamma_on="a")
    for stats in (False, "mma"):
        assert Config(forward=tiles, dx=tiles, dw=tiles, stats_in_kernel=stats, gamma_on="a").gamma_side(
            512, 4096, jnp.bfloat16) == "a"
    x, g, w = (jax.ShapeDtypeStruct(s, jnp.float16) for s in ((512, 512), (512,), (512, 512)))
    config = Config(forward=tiles, dx=tiles, dw=tiles, gamma_on="a")
    with backends.lowering_for_gpu(), pytest.raises(ValueError, match="gamma_on='a' rounds x ⊙ gamma to x's dtype, "
                                                                      "bfloat16 only \\(x is float16"):
        jax.eval_shape(lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=config),
                       x, g, w)


@cpu_only
@pytest.mark.parametrize("stats_in_kernel", [False, "mma"])
def test_gamma_on_a_makes_no_tensor_for_gamma_and_with_mma_no_pass_over_x(stats_in_kernel):
    """gamma_on="a" in the CUDA lowering: the forward kernel takes x and w as they are and gamma's (K,) slices with
    its stages (a third TMA load); no (M, K) or (K, N) tensor is made outside the kernels, and with r from the MMA
    warpgroups ("mma") the forward reads x only in its kernel (no XLA reduction over x)."""
    M, K, N = 1024, 2048, 4096
    base = nm_config.mosaic_default_config(M, K, N)
    forward = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", delay_release=1)
    config = dataclasses.replace(base, forward=forward, gamma_on="a", stats_in_kernel=stats_in_kernel,
                                 dw_in_xla=False, row_dot="n", dyr_in_dx=False)
    fn, args = _fwd_bwd(M, K, N, residual=False, config=config)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (forward_kernel,) = mosaic_ir.lower_kernels(
            lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=config), *args[:3])
    assert program.count("mosaic_gpu_v2") == 3
    assert forward_kernel.tma_loads() == 3 and forward_kernel.wgmma() == {"m64n256k16 f32 += bf16 x bf16": 8}
    assert not _mk_producers(program, M, K, "bf16")  # neither x ⊙ gamma nor the normalized x
    assert not [line for line in program.splitlines() if "= stablehlo." in line and "custom_call" not in line
                and line.rstrip().endswith(f"tensor<{K}x{N}xbf16>")]  # no w_γ
    reductions_over_x = [line for line in program.splitlines() if "stablehlo.reduce" in line
                         and f"tensor<{M}x{K}x" in line]
    assert bool(reductions_over_x) == (stats_in_kernel is False)


@cpu_only
def test_gamma_on_x_writes_x_times_gamma_and_no_w_gamma():
    """gamma_on="x" in the CUDA lowering: one (M, K) bf16 tensor made outside the kernels (x ⊙ gamma, the forward's
    A operand) and no (K, N) one (no w_γ: the forward and dx kernels read w itself)."""
    M, K, N = 1024, 2048, 4096
    config = dataclasses.replace(nm_config.mosaic_default_config(M, K, N), gamma_on="x", dw_in_xla=False)
    fn, args = _fwd_bwd(M, K, N, residual=False, config=config)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert program.count("mosaic_gpu_v2") == 3
    assert {op for op, _ in _mk_producers(program, M, K, "bf16")} == {"convert"}  # (x ⊙ gamma) rounded
    assert not [line for line in program.splitlines() if "= stablehlo." in line and "custom_call" not in line
                and line.rstrip().endswith(f"tensor<{K}x{N}xbf16>")]


@cpu_only
@pytest.mark.parametrize("M, K, N, tried", [(8192, 512, 2816, True), (4096, 4096, 14336, False)])
def test_the_sweep_tries_the_dw_finish_kernel_where_xla_runs_the_dw_gemm(M, K, N, tried):
    x, g, w = (jnp.zeros(s, jnp.bfloat16) for s in ((M, K), (K,), (K, N)))
    with backends.lowering_for_gpu():
        _, backward = norm_matmul.sweep_candidates(x, g, w, backend="mosaic")
    assert any(c["dw_finish_kernel"] for c in backward) == tried


@cpu_only
@pytest.mark.slow
def test_every_sweep_candidate_lowers_within_shared_memory():
    M, K, N = SUITE_SHAPES[1]
    x, g, w = (jnp.zeros(s, jnp.bfloat16) for s in ((M, K), (K,), (K, N)))
    with backends.lowering_for_gpu():
        forward, backward = norm_matmul.sweep_candidates(x, g, w, backend="mosaic")
    assert len(forward) >= 5 and len(backward) >= 4 and any(c["stats_in_kernel"] is True for c in forward)
    assert any(c["stats_in_kernel"] == "mma" for c in forward)
    assert any(c["forward"]["schedule"] == "pingpong" for c in forward)
    assert any(c["dx"]["schedule"] == "pingpong" and c["dw"]["schedule"] == "pingpong" for c in backward)
    assert any(c["forward"]["stream_k"] for c in forward) and any(c["dx"]["stream_k"] for c in backward)
    assert any(c["row_dot_in_dx"] == "tma" and c["dx"]["tile_input_in"] == "ring" for c in backward)
    assert any(c["dx_in_kernel"] and c["xr_in_dx"] for c in backward)
    assert any(c["dx_in_kernel"] and c["xr_in_dx"] and c["dx"]["epilogue_in"] == "fourth" for c in backward)
    assert any(c["dx_in_kernel"] and c["dyr_in_dx"] for c in backward)
    assert any(c["forward"]["epilogue_store"] == "split" and c["forward"]["stream_k"] for c in forward)
    assert any(c["forward"]["memory_warps"] == 1 for c in forward)
    assert any(c["dw"]["memory_warps"] == 1 and c["dx"]["memory_warps"] == 4 for c in backward)
    assert any(c["dx"]["memory_warps"] == 1 and c["dx"]["epilogue_in"] == "fourth" for c in backward)
    for params in forward:
        _check_kernels(M, K, N, False, Config(**params))
    for params in backward:
        _check_kernels(M, K, N, False, Config(**params), forward_only=False)


@cpu_only
@pytest.mark.parametrize("K, N", [(4096, 14336), (1024, 2816)])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_one_row_forward_is_one_mosaic_kernel_and_no_xla_reduction(K, N, residual):
    """The one-row forward: the transposed GEMV (r from x inside it, gamma on w's blocks in its registers where its
    tiles make one round, as at both shapes; with a residual one XLA fusion writes h): no reduction but the sum of
    its K loop's parts where it runs in parts (at 1024x2816), and no padded x in a forward-only program. Its
    gradients: the Triton backward (the decode table's dx kernel writing dw too), beside the one Mosaic forward
    kernel."""
    x, g, w = S((1, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)
    args = (x, g, w, x) if residual else (x, g, w)

    def fn(x, g, w, r=None):
        out = norm_matmul.rmsnorm_matmul(x, g, w, residual=r, backend="mosaic")
        return out if r is None else out[1]

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32) ** 2)

    with backends.lowering_for_gpu():
        fwd = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        train = jax.jit(jax.grad(loss, tuple(range(len(args))))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    parts = nm_config.mosaic_default_config(1, K, N).forward.k_parts
    reductions = [line for line in fwd.splitlines() if "stablehlo.reduce" in line]
    assert len(reductions) == (parts > 1) and all(f"tensor<{parts}x{N}xf32>" in line for line in reductions)
    assert fwd.count("@mosaic_gpu") == 1 and "triton" not in fwd
    assert "rmsnorm_matmul_fwd_gemv" in fwd and "stablehlo.pad" not in fwd
    assert train.count("@mosaic_gpu") == 1 and train.count("__gpu$xla.gpu.triton") == 1  # dw from the dx kernel


@pytest.mark.parametrize("K, N, gamma_on, in_registers", [
    (4096, 14336, None, True),  # 112 tiles of 128 rows: one round
    (8192, 28672, None, False),  # 448 tiles of 64 rows
    (4096, 14336, "x", False), (8192, 28672, "a", True)])
def test_one_row_gamma_goes_in_the_registers_where_the_gemv_is_one_round(K, N, gamma_on, in_registers):
    config = dataclasses.replace(nm_config.mosaic_default_config(1, K, N), gamma_on=gamma_on)
    assert config.one_row_gamma_in_registers(N) == in_registers


@cpu_only
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_one_row_forward_with_gamma_in_registers_reads_x_itself(residual):
    """gamma "a" at one row: w's blocks times gamma in the registers wgmma reads as A (a step input beside each
    stage: three TMA loads a step), and B is x itself, so no XLA op makes a (16, K) tensor. Without a residual the
    forward is the kernel alone; with one, XLA writes only h = x + residual."""
    K, N = 4096, 14336
    x, g, w = S((1, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)
    config = dataclasses.replace(nm.default_config(x, g, w, residual=x if residual else None), gamma_on="a")

    def fn(x, g, w, r=None):
        out = norm_matmul.rmsnorm_matmul(x, g, w, residual=r, backend="mosaic", block_sizes=config)
        return out if r is None else out[1]

    args = (x, g, w, x) if residual else (x, g, w)
    with backends.lowering_for_gpu():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (kernel,) = mosaic_ir.lower_kernels(jax.jit(fn), *args)
    assert text.count("@mosaic_gpu") == 1 and "stablehlo.pad" not in text and "x16xbf16>" not in text
    assert ("stablehlo.add" in text) == residual
    assert kernel.tma_loads() == 3 and kernel.text.count("prmt.b32") >= 32  # w's block, x's, gamma's slice


@cpu_only
@pytest.mark.slow
def test_one_row_sweep_candidates_lower_within_shared_memory():
    K, N = 4096, 14336
    x, g, w = S((1, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)
    with backends.lowering_for_gpu():
        forward, backward = nm.sweep_candidates(x, g, w)
        assert len(forward) >= 4 and len(backward) == 1
        assert any(c["forward"]["stream_k"] for c in forward) and any(c["forward"]["k_parts"] > 1 for c in forward)
        for params in forward:
            fn = lambda x, g, w, c=Config(**params): norm_matmul.rmsnorm_matmul(x, g, w, block_sizes=c,
                                                                                 backend="mosaic")
            assert "@mosaic_gpu" in jax.jit(fn).trace(x, g, w).lower(lowering_platforms=("cuda",)).as_text()


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gamma_on", ["x", "a"], ids=["xg_by_xla", "gamma_in_registers"])  # (None: "a" here)
def test_one_row_in_interpret_mode(residual, gamma_on):
    """The one-row forward (two 64-row tiles of w's N per simulated SM) and the Triton backward after it, against
    the float32 reference; x at 1e3 and 1e-3 too (r from the kernel's own sum of squares). gamma "a": on w's blocks
    in the registers wgmma reads as A, B x itself."""
    K, N = 512, 256
    config = Config(forward=dataclasses.replace(nm_config.ONE_ROW_FORWARD[0], tile_k=128, num_stages=2),
                    dx=_Interpreted.tiles, dw=_Interpreted.tiles, gamma_on=gamma_on)
    checks, programs = _Interpreted(), {}  # the three scales run one compiled forward + backward
    for scale in (1.0, 1e3, 1e-3):
        x, g, w, res = inputs(1, K, N, jnp.bfloat16, residual=residual)
        x, res = x * scale, None if res is None else res * scale
        with mosaic_utils.interpret_on_cpu(num_sms=2):
            checks.check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, K), programs=programs,
                                           block_sizes=config)


@cpu_only
@pytest.mark.parametrize("gamma_on", ["x", "a"], ids=["xg_by_xla", "gamma_in_registers"])
def test_one_row_forward_in_k_parts(gamma_on):
    """The one-row forward's K loop in 2 parts (each range's r-scaled row sums, summed by XLA): in interpret mode
    against the float32 reference (gamma on w's blocks in registers: its step slices per range), and lowered at
    1x4096x4096 with its (2, 4096) float32 parts."""
    K, N = 512, 256
    forward = dataclasses.replace(nm_config.ONE_ROW_FORWARD[0], tile_k=128, num_stages=2, k_parts=2)
    config = Config(forward=forward, dx=_Interpreted.tiles, dw=_Interpreted.tiles, gamma_on=gamma_on)
    x, g, w, _ = inputs(1, K, N, jnp.bfloat16)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        y = jax.jit(lambda x, g, w: _Interpreted().rmsnorm_matmul(x, g, w, block_sizes=config))(x, g, w)
    want = reference.rmsnorm_matmul(x.astype(jnp.float32), g.astype(jnp.float32), w.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16
    assert_close(y, want, tolerance(jnp.bfloat16, K), "y")  # NaN fails
    base = nm_config.mosaic_default_config(1, 4096, 4096, jnp.bfloat16)
    big = dataclasses.replace(base, forward=dataclasses.replace(base.forward, k_parts=2), gamma_on=gamma_on)
    args = (S((1, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16), S((4096, 4096), jnp.bfloat16))
    fn = lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, block_sizes=big, backend="mosaic")  # noqa: E731
    with backends.lowering_for_gpu():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (kernel,) = _lowered_kernels(fn, *args)
    assert kernel.name == "rmsnorm_matmul_fwd_gemv" and "tensor<2x4096xf32>" in text


@gpu_only
@pytest.mark.parametrize("gamma_on", ["x", "a"], ids=["xg_by_xla", "gamma_in_registers"])
@pytest.mark.parametrize("K, N, parts", [(4096, 4096, 2), (2048, 8192, 4)])
def test_one_row_forward_in_k_parts_on_the_gpu(K, N, parts, gamma_on):
    """The one-row forward with its K loop in parts, against the float32 reference (and its Triton backward)."""
    base = nm_config.mosaic_default_config(1, K, N, jnp.bfloat16)
    config = dataclasses.replace(base, forward=dataclasses.replace(base.forward, k_parts=parts), gamma_on=gamma_on)
    x, g, w, _ = inputs(1, K, N, jnp.bfloat16)
    _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, K), block_sizes=config)


def _mk_producers(program: str, M: int, K: int, dtype: str = "") -> list[str]:
    """Ops other than custom calls (the kernels) whose result is an (M, K) tensor (of ``dtype``, e.g. "bf16"),
    in StableHLO text, as (op name, line)."""
    found = []
    for line in program.splitlines():
        if "= stablehlo." not in line or "custom_call" in line:
            continue
        result = line.rsplit("->", 1)[1] if "->" in line else line.rsplit(": ", 1)[-1]
        if result.strip().startswith(f"tensor<{M}x{K}x{dtype}"):
            found.append((line.split("= stablehlo.", 1)[1].split()[0], line.strip()))
    return found


def _custom_call_operands(program: str) -> set[str]:
    """The SSA names (%12, %arg0) the custom calls (the kernels) of a StableHLO text take."""
    names = set()
    for line in program.splitlines():
        if "stablehlo.custom_call" in line:
            names.update(n.strip() for n in line.split("(", 1)[1].split(")", 1)[0].split(","))
    return names


@cpu_only
@pytest.mark.parametrize("stats_in_kernel, dw_in_xla, row_dot", [(False, False, "n"), (True, False, "n"),
                                                                  (False, None, "n"), (False, False, "k"),
                                                                  ("mma", False, "n")])
def test_no_normalized_activations_outside_the_kernels(stats_in_kernel, dw_in_xla, row_dot):
    """In the CUDA lowering no (M, K) tensor in the MMA dtype made outside the kernels feeds one (the normalized
    activations would, to feed a GEMM); the only (M, K) ops are XLA's row statistics squaring x in float32 (none
    with the statistics warpgroup) and, with row_dot "k", the row fusion that turns the dx kernel's float32 u into
    dx (the one (M, K) bf16 tensor: the gradient itself). With dw's GEMM in XLA (the default where its output has
    few tiles, as here: 8 x 3), cuBLAS reads x as it is."""
    from jaxfuse import kernels

    M, K, N = 2048, 1024, 768  # M, K, N distinct: an (M, K) tensor is recognizable by its shape
    config = dataclasses.replace(nm_config.mosaic_default_config(M, K, N, stats_in_kernel=stats_in_kernel),
                                 dw_in_xla=dw_in_xla, row_dot=row_dot, dw_finish_kernel=row_dot == "k")
    assert config.dw_by_xla(K, N) == (dw_in_xla is None)
    fn, args = _fwd_bwd(M, K, N, residual=False, config=config)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert program.count("mosaic_gpu_v2") == (2 if dw_in_xla is None else 3)
    # with dw_finish_kernel, dw and dgamma from cuBLAS's float32 halves by one Triton kernel (norm_matmul.dw_finish)
    assert ("rmsnorm_matmul_dw_finish" in program) == (dw_in_xla is None and config.dw_finish_kernel)
    made = _mk_producers(program, M, K, "bf16")
    if row_dot == "n":
        assert made == []  # dx (M, K) comes out of the dx kernel
    else:  # dx = u − (r² / K) · Σ_K(u ⊙ x) · x rounded, read by no kernel
        assert [op for op, _ in made] == ["convert"]
        assert made[0][1].split(" = ")[0] not in _custom_call_operands(program)
    ops = {op for op, _ in _mk_producers(program, M, K)}
    row_fusion = {"broadcast_in_dim", "subtract"} if row_dot == "k" else set()
    assert ops == (set() if stats_in_kernel else {"convert", "multiply"} | row_fusion)
    # the check sees them where they exist: XLA's norm + matmul rounds rmsnorm(x) to bf16 for its GEMM
    xla = jax.jit(lambda x, g, w, dy: jax.vjp(kernels.NORM_MATMUL["xla"], x, g, w)[1](dy)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert len(_mk_producers(xla, M, K, "bf16")) >= 1


# the dx kernel's tiles where the dyr copy fits beside 3 stages and the x tile (the H100's tuned entries' dx tiles)
_DYR_DX = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", num_stages=3)


def _stacked_dx(entry: Config) -> MosaicGemmConfig:
    """The entry's dx tiles as stacked 64x256 accumulators with the epilogue in the MMA warpgroups (the
    32768x4096x4096 H200 entry's dx kernel has its epilogue in a fourth warpgroup since the fifty-first session, on
    128x128 accumulators side by side, which the forms built from it here do not take)."""
    return dataclasses.replace(entry.dx, epilogue_in="mma", tile_m=64, tile_n=256, wg_split="m", epi_tile_n=64)


@cpu_only
@pytest.mark.parametrize("row_dot, stream_k_split", [("n", 0), ("n", 4), ("k", 0)])
def test_dyr_from_the_dx_kernel_leaves_xla_only_the_row_dot(row_dot, stream_k_split):
    """dyr_in_dx: the dx kernel also stores dyr by TMA from its own shared memory (a second copy to global memory)
    within shared memory, and the backward program makes no (M, N) tensor outside the kernels: on the N side XLA's
    pass over dy and y only reduces, on the K side no XLA pass reads dy. Without it, XLA writes dyr."""
    M, K, N = 16384, 2048, 4096  # K != N: the K side's XLA pass makes dx, (M, K)
    base = dataclasses.replace(nm_config.mosaic_default_config(M, K, N), row_dot=row_dot,
                               dx=dataclasses.replace(_DYR_DX, stream_k=stream_k_split))
    stores = {}
    for in_dx in (False, True):
        fn, args = _fwd_bwd(M, K, N, False, dataclasses.replace(base, dyr_in_dx=in_dx))
        with backends.lowering_for_gpu():
            (dx_kernel,) = [k for k in mosaic_ir.lower_kernels(fn, *args) if k.name == "rmsnorm_matmul_dx"]
            program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert dx_kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
        stores[in_dx] = dx_kernel.tma_stores()
        made = [op for op, _ in _mk_producers(program, M, N, "bf16")]
        assert (made == []) if in_dx else ("convert" in made), made
    assert stores[True] > stores[False]


@cpu_only
def test_dgamma_from_u_leaves_the_dw_kernel_no_w_tile_and_room_for_a_fourth_stage():
    """dgamma_from="u" (the K side, gamma on x's side): the dx kernel stores u before gamma, one Pallas-Triton
    kernel (``dx_finish``) finishes dx and sums dgamma from u and x, and the dw kernel loads nothing but its A and B
    blocks (one TMA load fewer per tile: no w tile), so 4 stages of 64x256 blocks fit beside its output staging,
    which with the w tile they do not. The program still makes no (M, N) tensor outside the kernels."""
    M, K, N = 4096, 2048, 11008  # the 1b preset's MLP projection
    dw4 = dataclasses.replace(_DYR_DX, num_stages=4)
    base = Config(forward=_DYR_DX, dx=_DYR_DX, dw=dw4, gamma_on="x", row_dot="k", dyr_in_dx=True)
    for dgamma_from, fits in (("u", True), ("dw", False)):
        fn, args = _fwd_bwd(M, K, N, False, dataclasses.replace(base, dgamma_from=dgamma_from))
        with backends.lowering_for_gpu():
            if not fits:
                with pytest.raises(ValueError, match="shared memory"):
                    mosaic_ir.lower_kernels(fn, *args)
                continue
            kernels = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}
            program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert kernels["rmsnorm_matmul_dw"].smem_bytes <= mosaic_utils.H100_SMEM_BYTES
        assert _mk_producers(program, M, N, "bf16") == []
    three = {}  # the dw kernel at 3 stages, with and without the w tile
    for dgamma_from in ("u", "dw"):
        fn, args = _fwd_bwd(M, K, N, False, dataclasses.replace(base, dw=_DYR_DX, dgamma_from=dgamma_from))
        with backends.lowering_for_gpu():
            three[dgamma_from] = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}["rmsnorm_matmul_dw"]
    assert three["dw"].tma_loads() > three["u"].tma_loads()
    assert three["dw"].smem_bytes - three["u"].smem_bytes >= 2 * 64 * 256 * 2 - 2 * 2 * 64 * 64 * 2  # w tile gone


def test_dgamma_from_u_needs_the_k_side_and_gamma_off_w():
    tiles = MosaicGemmConfig()
    with pytest.raises(ValueError, match=r"dgamma_from: must be None, 'dw' or 'u', 'u' only with row_dot='k' .*"
                                         r"got dgamma_from='u', row_dot='n'"):
        Config(forward=tiles, dx=tiles, dw=tiles, row_dot="n", dgamma_from="u")
    with pytest.raises(ValueError, match=r"dgamma_from: .* got dgamma_from='x'"):
        Config(forward=tiles, dx=tiles, dw=tiles, dgamma_from="x")
    config = Config(forward=tiles, dx=tiles, dw=tiles, row_dot="k", gamma_on="w", dgamma_from="u")
    assert config.to_dict()["dgamma_from"] == "u" and Config(**config.to_dict()) == config
    x, g, w = (jnp.zeros(s, jnp.bfloat16) for s in ((4096, 4096), (4096,), (4096, 4096)))
    with pytest.raises(ValueError, match=r"rmsnorm_matmul \(mosaic\): dgamma_from='u' needs the dx GEMM to read w "
                                         r"itself \(gamma_on 'x' or 'a'\); with gamma on w"):
        nm.rmsnorm_matmul(x, g, w, eps=1e-6, residual=None, out_dtype=x.dtype, interpret=False, config=config)
    assert Config(forward=tiles, dx=tiles, dw=tiles).dgamma_source(4096, 4096, jnp.bfloat16) == "dw"


def test_dyr_in_dx_is_a_bool_and_by_default_taken_on_the_n_side_where_it_fits():
    tiles = MosaicGemmConfig()  # 128x128 accumulators side by side: a 32 KiB copy buffer that does not fit
    with pytest.raises(ValueError, match=r"dyr_in_dx: must be None or a bool; got dyr_in_dx='yes'"):
        Config(forward=tiles, dx=tiles, dw=tiles, dyr_in_dx="yes")
    assert Config(forward=tiles, dx=tiles, dw=tiles, row_dot="n", dyr_in_dx=True).to_dict()["dyr_in_dx"] is True
    assert Config(forward=tiles, dx=_DYR_DX, dw=tiles, row_dot="k", dyr_in_dx=True).dyr_by_dx(jnp.bfloat16, True)
    # the K side adds dh outside the dx kernel: with a residual its copy still fits beside x's tile alone
    assert Config(forward=tiles, dx=_DYR_DX, dw=tiles, row_dot="k").dyr_smem_reason(jnp.bfloat16, True) is None
    by_dx = {(dx, row_dot, residual): Config(forward=tiles, dx=dx, dw=tiles, row_dot=row_dot).dyr_by_dx(
        jnp.bfloat16, residual) for dx in (tiles, _DYR_DX) for row_dot in ("n", "k") for residual in (False, True)}
    assert [key for key, value in by_dx.items() if value] == [(_DYR_DX, "n", False)]
    assert Config(forward=tiles, dx=_DYR_DX, dw=tiles, row_dot="n", dyr_in_dx=False).dyr_by_dx(jnp.bfloat16, False) \
        is False
    x, g, w, _ = (jnp.zeros(s, jnp.bfloat16) for s in ((4096, 4096), (4096,), (4096, 4096), ()))
    with pytest.raises(ValueError, match=r"rmsnorm_matmul \(mosaic\): dyr_in_dx=True: the dx kernel would need 246784 "
                                         r"bytes of shared memory with the dyr copy's 32768-byte staging \(at most "
                                         r"232448\); take dx tiles stacked along M"):
        nm.rmsnorm_matmul(x, g, w, eps=1e-6, residual=None, out_dtype=x.dtype, interpret=False,
                          config=Config(forward=tiles, dx=dataclasses.replace(tiles, num_stages=3), dw=tiles,
                                        row_dot="n", dyr_in_dx=True))


# ---------------------------------------------------------------------------------------------------------------
# Numbers: sm90 GPU; CPU interpret mode (slow)
# ---------------------------------------------------------------------------------------------------------------
_NUMBERS_CASES = [  # (M, K, N, dtype, stats_in_kernel or a variant, row_dot) of the GPU's forward and gradients
    (4096, 4096, 4096, jnp.bfloat16, False, "n"), (4096, 4096, 4096, jnp.bfloat16, True, "k"),
    (2048, 4096, 8192, jnp.bfloat16, "gamma_on_x", "n"),  # x ⊙ gamma as A, no w_γ
    (2048, 2048, 8192, jnp.bfloat16, "gamma_on_x", "k"),
    (2048, 2048, 1536, jnp.float16, False, "n"),  # dw's GEMM in XLA (96 output tiles)
    (2048, 1024, 4096, jnp.float16, False, "k"),
    (8192, 512, 2816, jnp.bfloat16, False, None),  # the 'small' preset's MLP projection: tuned ping-pong tiles
    (4096, 2048, 11008, jnp.bfloat16, "gamma_on_x", None),  # the 1b MLP's: tuned forward and dw with stream-K
    (4096, 4096, 4096, jnp.bfloat16, "mma", "k"), (2048, 1024, 4096, jnp.float16, "mma", "n"),  # r from the MMA wgs
    (4096, 4096, 4096, jnp.bfloat16, "gamma_on_a", "n"), (2048, 2048, 8192, jnp.bfloat16, "gamma_on_a_mma", "k"),
    (4096, 4096, 14336, jnp.bfloat16, "gamma_on_a_mma", "n"),  # gamma (and r) in the MMA warpgroups' registers
    (4096, 4096, 4096, jnp.bfloat16, "mma_rows", "n"), (2048, 1024, 4096, jnp.float16, "mma_rows", "k"),
    (2048, 2048, 8192, jnp.bfloat16, "gamma_on_a_mma_rows", "n"),  # r's squares summed per row at each step
    (4096, 4096, 4096, jnp.bfloat16, "mma_shared", "n"), (2048, 1024, 4096, jnp.float16, "mma_shared", "k"),
    (8192, 4096, 6144, jnp.bfloat16, "gamma_on_a_mma_shared", "n"),  # r from each row block's first tile
    (32768, 1024, 1024, jnp.bfloat16, "gamma_on_a_mma_shared", "k"),  # 256 row blocks: two rounds of first tiles
    (8192, 4096, 6144, jnp.bfloat16, "gamma_on_a_mma_shared_operand", "n"),  # the squares from the a_operand's
    (4096, 4096, 14336, jnp.bfloat16, "gamma_on_a_mma_operand", "k"),  # registers: in the first tiles, or in all
    (2048, 2048, 8192, jnp.bfloat16, "gamma_on_a_mma_rows_operand", "n"),
    (8192, 512, 2816, jnp.bfloat16, False, "k_dyr"), (2048, 1024, 4096, jnp.float16, False, "k_dyr"),  # A = dy,
    (4096, 2048, 11008, jnp.bfloat16, "gamma_on_x", "k_dyr"),  # dyr written by the dx kernel
    (8192, 512, 2816, jnp.bfloat16, "gamma_on_x", None),  # the H200's entry there: stacked dx tiles beside the copy
    (4096, 2048, 11008, jnp.bfloat16, "gamma_on_x", "k_dyr_dgu"), (2048, 2048, 8192, jnp.bfloat16, "gamma_on_a",
                                                                    "k_dgu"),  # dgamma from u, dw at 4 stages
    (8192, 512, 2816, jnp.bfloat16, "gamma_on_x", "k_dyr_dgu")]  # (dw's GEMM in XLA there)


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, stats_in_kernel, row_dot", _NUMBERS_CASES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_forward_and_gradients_on_the_gpu(M, K, N, dtype, stats_in_kernel, row_dot, residual):
    x, g, w, res = inputs(M, K, N, dtype, residual=residual)
    config = _numbers_config(M, K, N, dtype, residual, stats_in_kernel, row_dot)
    _Mosaic().check_against_reference(x, g, w, res, tolerance(dtype, max(M, K, N)), block_sizes=config)


@pytest.mark.parametrize("device", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_the_gpu_cases_configs_hold_on_the_cpu(device, residual, monkeypatch):
    """Every config the GPU's forward-and-gradients, xr and dx-in-kernel cases build on each GPU (its tuned entries
    with a form replaced) is one the config and ``check_config`` accept: an entry that gained a field a form
    excludes shows here, not on the GPU (dw_finish_kernel beside dgamma_from="u" did)."""
    monkeypatch.setattr(tuning, "device_kind", lambda: device)
    cases = [((M, K, N, dtype), _numbers_config(M, K, N, dtype, residual, variant, row_dot))
             for M, K, N, dtype, variant, row_dot in _NUMBERS_CASES]
    cases += [(case[:4], _xr_config(*case, residual)) for case in _XR_CASES]
    cases += [(case[:4], _dx_config(*case, residual)) for case in _DX_CASES]
    if device == "NVIDIA H200":  # (the cases name its entries; elsewhere an entry may refuse a form: skipped)
        assert all(config is not None for _, config in cases)
    for (M, K, N, dtype), config in cases:
        if config is None:
            continue
        x, g, w = S((M, K), dtype), S((K,), dtype), S((K, N), dtype)
        nm.check_config(config, x, g, w, residual=S((M, K), dtype) if residual else None, out_dtype=dtype)


# stacked 128-row one-row tiles split by stream-K: 32 tiles in 128 units (whole K loops: parts take no stream-K)
_ONE_ROW_STREAM_K = dict(schedule="cooperative", wg_split="m", tile_k=128, num_stages=6, stream_k=4, k_parts=1)


@gpu_only
@pytest.mark.parametrize("K, N, forward", [(4096, 14336, None), (1024, 2816, None), (8192, 8192, None),
                                           (4096, 4096, _ONE_ROW_STREAM_K)])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gamma_on", [None, "x", "a"], ids=["gamma_default", "gamma_x", "gamma_a"])
def test_one_row_on_the_gpu(K, N, forward, residual, gamma_on):
    """The one-row forward (transposed GEMV, r from the kernel; stream-K's partial sums through the workspace) and
    the Triton backward after it: forward and gradients against the float32 reference, x at three magnitudes.
    gamma "x": x ⊙ gamma padded by XLA; "a": gamma on w's blocks in the registers wgmma reads, B x itself (TMA's
    zero fill for its other 15 rows); None: the default."""
    x, g, w, res = inputs(1, K, N, jnp.bfloat16, residual=residual)
    config = dataclasses.replace(nm.default_config(x, g, w, residual=res), gamma_on=gamma_on)
    if forward:
        config = dataclasses.replace(config, forward=dataclasses.replace(config.forward, **forward))
    for scale in (1.0, 1e3, 1e-3):
        x, g, w, res = inputs(1, K, N, jnp.bfloat16, residual=residual)
        x, res = x * scale, None if res is None else res * scale
        _Mosaic().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, max(K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, variant", [
    (4096, 4096, 4096, jnp.bfloat16, False), (2048, 1024, 4096, jnp.float16, False),
    (32768, 1024, 1024, jnp.bfloat16, "gamma_on_a_mma_shared"),  # 256 row blocks, r shared in the forward too
    (4096, 4096, 14336, jnp.bfloat16, "gamma_on_a")])  # 224 steps of dy · y per first tile
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("in_dx", [True, "prefetch", "tma"])
def test_the_row_dot_from_the_dx_kernel_on_the_gpu(M, K, N, dtype, variant, residual, in_dx):
    """Σ_N(dy · y) summed by the dx kernel's first tile of each row block and shared with the others
    (``row_dot_in_dx``): gradients against the float32 reference, two calls (the counts end each at zero). "tma":
    the x tile through the dx kernel's B stages (a second view of them: B is w read transposed), 64x256 stacked
    tiles; with a residual the XLA pass takes the row dot."""
    config = _numbers_config(M, K, N, dtype, residual, variant, "n")
    dx = dataclasses.replace(config.dx, stream_k=0)
    if in_dx == "tma":
        dx = dataclasses.replace(_DYR_DX, tile_input_in="ring")
    config = dataclasses.replace(config, row_dot_in_dx=in_dx, dx=dx)
    x, g, w, res = inputs(M, K, N, dtype, residual=residual)
    for _ in range(2):
        _Mosaic().check_against_reference(x, g, w, res, tolerance(dtype, max(M, K, N)), block_sizes=config)


def _numbers_config(M, K, N, dtype, residual, variant, row_dot):
    """The default config of a shape with the forward's variant: False / True / "mma" (where r comes from, gamma
    on w), "gamma_on_x", "gamma_on_a" (r from XLA) or "gamma_on_a_mma" (gamma and r in the MMA warpgroups'
    registers, stacked 64x256 forward tiles with one wgmma group in flight). row_dot "n", "k", None (the config's) or
    "k_dyr" (the K side with dyr from the dx kernel, its stages fewer where the copy needs the room); "_dgu" at the
    end: dgamma from u (``dgamma_from="u"``), the dw kernel at 4 stages of 64x256 stacked tiles (no w tile)."""
    stats, gamma_on = _variant_fields(variant)
    config = nm_config.mosaic_default_config(M, K, N, dtype, residual=residual, stats_in_kernel=stats)
    config = dataclasses.replace(config, backward_in_xla=False)  # (our backward kernels, where the few-row rule
    # takes XLA's: their forms are what these tests run)
    if gamma_on == "a":
        config = dataclasses.replace(config, forward=dataclasses.replace(
            nm_config._MMA_STATS_FORWARD[0], grid_minor="m"))
    if row_dot and row_dot[0] == "n" and config.dgamma_from == "u":  # a K-side entry taking dgamma from u: from
        # the dw kernel instead, its w tile through its B stages
        config = dataclasses.replace(config, dgamma_from=None, dw=dataclasses.replace(config.dw, tile_input_in="ring"))
    if row_dot and row_dot[0] == "n":  # (the H200's suite entries are on the K side, the dx kernel writing xr and dx)
        config = dataclasses.replace(config, xr_in_dx=False, dx_in_kernel=False, dx=_stacked_dx(config)
                                     if config.dx.epilogue_in == "fourth" else config.dx)
    config = dataclasses.replace(config, gamma_on=gamma_on, row_dot=row_dot and row_dot[0],
                                 squares_from=_squares_from(variant))
    if row_dot and row_dot.endswith("_dgu"):
        config = dataclasses.replace(config, dgamma_from="u", dx_in_kernel=False, dw_finish_kernel=False,
                                     dw=dataclasses.replace(_DYR_DX, num_stages=4))  # (dgamma not from dw's side)
    if row_dot and "_dyr" in row_dot:  # (dyr from the dx kernel replaces the entry's xr, e.g. at 4096x2048x11008)
        return dataclasses.replace(config, xr_in_dx=False).with_dyr_from_dx(dtype, residual)
    return config


def _variant_fields(variant) -> tuple:
    """(stats_in_kernel, gamma_on) of a test variant: False / True / "mma" / "mma_rows" (gamma on w), "gamma_on_x",
    "gamma_on_a", "gamma_on_a_mma", "gamma_on_a_mma_rows" (and "..._operand": ``_squares_from``)."""
    if variant in (True, *nm_config.MMA_STATS):
        return variant, "w"
    if isinstance(variant, str) and variant.startswith("gamma_on_a_"):
        return variant[len("gamma_on_a_"):].removesuffix("_operand"), "a"
    return False, {"gamma_on_x": "x", "gamma_on_a": "a"}.get(variant, "w")


def _squares_from(variant) -> str:
    """The config's squares_from of a test variant: "operand" for "gamma_on_a_mma..._operand" (the squares from the
    registers the a_operand multiplies by gamma), else "observe"."""
    return "operand" if isinstance(variant, str) and variant.endswith("_operand") else "observe"


@gpu_only
@pytest.mark.parametrize("M, K, N, variant", [
    (32768, 1024, 4096, "mma_shared"),  # 4096 tiles: 4 left over, each on 4 units; r shared by the first column
    (32768, 1024, 4096, "gamma_on_a_mma_shared"),  # beside gamma in the registers: one kernel, no XLA pass
    (32768, 1024, 4096, "gamma_on_a"),  # gamma in the registers, r from XLA
    (4352, 2048, 4096, "gamma_on_a_mma_shared"),  # 544 tiles: 16 left over
    (4352, 2048, 4096, "gamma_on_a_mma_shared_operand"),  # the squares from the a_operand's registers: stream-K
    (32768, 1024, 4096, "gamma_on_a_mma_operand")])  # segments pass their partial sums on (every tile its own r)
def test_forward_with_stream_k_beside_shared_r_or_gamma_in_registers_on_the_gpu(M, K, N, variant):
    """The forward's last round cut by K steps (stream_k=4) where r comes from each row block's first tile
    (``gemm.Fusion.share_rows``) or gamma multiplies the x blocks in registers (``gemm.Fusion.a_operand``): forward
    and gradients against the float32 reference, two calls (the row counts end each at zero)."""
    config = _numbers_config(M, K, N, jnp.bfloat16, False, variant, "n")  # stacked 64x256 forward tiles
    config = dataclasses.replace(config, forward=dataclasses.replace(config.forward, stream_k=4))
    x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
    for _ in range(2):
        _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("M, K, N, variant", [
    (4096, 4096, 4096, "mma"), (4096, 4096, 4096, "mma_rows"), (4096, 4096, 14336, "gamma_on_a"),
    (2048, 2048, 8192, "gamma_on_a_mma"),
    (32768, 1024, 1024, "mma_shared"), (8192, 4096, 6144, "gamma_on_a_mma_shared_operand"),  # r shared: the output
    # carried from the first column's tile loop into the others'
    (256, 1024, 4096, False)])  # 16 or 32 forward tiles on 132 blocks: one tile per block, or none
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_forward_stored_under_the_next_tile_on_the_gpu(M, K, N, variant, residual):
    """The forward's output tile kept in registers and stored under the next tile's first wgmma
    (epilogue_store="next_tile"), with r from XLA, the MMA warpgroups or each row block's first tile and gamma on w
    or in the registers."""
    config = _numbers_config(M, K, N, jnp.bfloat16, residual, variant, "n")
    forward = config.forward if not config.forward.pingpong else MosaicGemmConfig()
    config = dataclasses.replace(config, forward=dataclasses.replace(forward, epilogue_store="next_tile", stream_k=0))
    x, g, w, res = inputs(M, K, N, jnp.bfloat16, residual=residual)
    _Mosaic().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("M, K, N, variant, stream_k", [
    (32768, 1024, 4096, "gamma_on_a_mma_shared_operand", 4),  # the H200 entries' form, 4 tiles cut by K steps
    (8192, 4096, 6144, "gamma_on_a_mma_shared_operand", 0),
    (4096, 4096, 4096, "gamma_on_a", 0), (2048, 2048, 8192, "mma", 0), (256, 1024, 4096, False, 0)])
def test_forward_with_its_output_split_on_the_gpu(M, K, N, variant, stream_k):
    """epilogue_store="split": each tile's left half stored at its end, its right half under the next tile's first
    wgmma (beside r shared, gamma in the registers, r from XLA or the MMA warpgroups): forward and gradients against
    the float32 reference, two calls."""
    config = _numbers_config(M, K, N, jnp.bfloat16, False, variant, "n")
    forward = config.forward if not config.forward.pingpong else MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m")
    if forward.tile_n < 2 * forward.epi_tile_n:  # (the few-row rule's 64-wide tiles: one output piece, the split
        forward = dataclasses.replace(forward, tile_n=128)  # store needs two)
    config = dataclasses.replace(config, forward=dataclasses.replace(forward, epilogue_store="split",
                                                                     stream_k=stream_k))
    x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
    for _ in range(2):
        _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


def _dw_in_the_ring(config, num_stages=4):
    """The config with the dw kernel's w tile loaded into its B stages (``tile_input_in="ring"``): 64x256 tiles
    stacked along M (the tuned entries' dw tiles), whole."""
    return dataclasses.replace(config, dw=dataclasses.replace(
        config.dw, tile_m=64, tile_n=256, tile_k=64, wg_split="m", schedule="cooperative", tile_input_in="ring",
        stream_k=0, num_stages=num_stages))


@cpu_only
def test_the_dw_kernel_with_its_w_tile_in_the_ring_takes_a_fourth_stage():
    """Lowered for CUDA at 4096x4096x14336: the dw kernel with 4 stages of 64x256 (48 KiB each) and no w buffer
    fits where the buffer (64 KiB) leaves room for 3."""
    fn, args = _fwd_bwd(4096, 4096, 14336, False, _dw_in_the_ring(nm_config.mosaic_default_config(
        4096, 4096, 14336, jnp.bfloat16)))
    with backends.lowering_for_gpu():
        kernels = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}
    dw = kernels["rmsnorm_matmul_dw"]
    assert 4 * 48 * 1024 <= dw.smem_bytes <= 4 * 48 * 1024 + 1024


@gpu_only
@pytest.mark.parametrize("M, K, N", [(4096, 4096, 14336), (8192, 4096, 6144), (4096, 2048, 11008),
                                     (2048, 1024, 4096)])
def test_gradients_with_the_dw_kernels_w_tile_in_the_ring_on_the_gpu(M, K, N):
    """dw and dgamma from the dw kernel whose w tile arrives through its B stages, against the float32 reference,
    two calls."""
    config = _dw_in_the_ring(nm_config.mosaic_default_config(M, K, N, jnp.bfloat16))
    x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
    for _ in range(2):
        _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("M, K, N, kernel", [
    (4096, 2048, 11008, "dw"),  # the 1b MLP: 688 dw tiles, 28 left over; its w tile through the ring at 4 stages
    (8704, 4096, 2048, "dx"),  # 1088 dx tiles, 32 left over; the x tile through the ring
    (8704, 4096, 2048, "row_dot_tma")])  # and y's blocks beside dy's for the row dot (first tiles, never stream-K)
def test_gradients_with_a_ring_tile_input_beside_stream_k_on_the_gpu(M, K, N, kernel):
    """The dw or dx kernel's tile input through its B stages with the last round cut by K steps (stream_k=4):
    gradients against the float32 reference, two calls."""
    config = nm_config.mosaic_default_config(M, K, N, jnp.bfloat16)
    if kernel == "dw":
        config = dataclasses.replace(_dw_in_the_ring(config), dw=dataclasses.replace(
            _dw_in_the_ring(config).dw, stream_k=4))
    else:
        config = dataclasses.replace(_numbers_config(M, K, N, jnp.bfloat16, False, False, "n"),
                                     row_dot_in_dx="tma" if kernel == "row_dot_tma" else False,
                                     dx=dataclasses.replace(_DYR_DX, tile_input_in="ring", stream_k=4))
    x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
    for _ in range(2):
        _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144),
                                     (8192, 512, 2816), (4096, 2048, 11008), (8192, 512, 768), (4096, 2048, 3072),
                                     (16384, 1024, 5504)])
def test_the_suite_shapes_tuned_entries_on_the_gpu(M, K, N):
    """Forward and gradients of the suite shapes with this device's tuned entries (no block_sizes), against the
    float32 reference, two calls (the shared r's counts end each at zero)."""
    x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
    for _ in range(2):
        _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)))


@pytest.mark.parametrize("dtype, dgamma_given", [(jnp.bfloat16, True), (jnp.bfloat16, False), (jnp.float16, True),
                                                 (jnp.float16, False)])
def test_dw_by_cublas_against_the_float32_reference(dtype, dgamma_given):
    """Where XLA runs the dw GEMM (few (K, N) tiles; the XLA side of the backward, so it runs on the CPU): dw = gamma ·
    s ⊙ (aᵀ @ b) in w's dtype and dgamma = s · Σ_N w ⊙ g, or the dgamma given (from u) as it is; bfloat16 with
    dgamma given puts gamma on A's columns (cuBLAS writes dw at once)."""
    M, K, N = 96, 40, 72
    a, b, w = normal((M, K), dtype), normal((M, N), dtype), normal((K, N), dtype)
    gamma = normal((K,), jnp.float32, scale=2.0)
    scale = jnp.asarray(1.0 if dtype == jnp.bfloat16 else 0.37, jnp.float32)  # s = max r for float16
    given = normal((K,), jnp.float32) if dgamma_given else None
    dw, dgamma = nm._dw_by_cublas(a, b, gamma, w, scale, given, finish_kernel=False)
    g = jnp.matmul(a.astype(jnp.float32).T, b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    assert dw.dtype == w.dtype
    assert_close(dw, g * (gamma * scale)[:, None], tolerance(dtype, M), "dw")
    if dgamma_given:
        assert dgamma is given
    else:
        assert_close(dgamma, scale * jnp.sum(g * w.astype(jnp.float32), axis=1), tolerance(dtype, M * N), "dgamma")


@pytest.mark.parametrize("dtype, residual", [(jnp.bfloat16, False), (jnp.bfloat16, True), (jnp.float16, False)])
def test_backward_by_xla_against_the_float32_reference(dtype, residual):
    """``backward_in_xla`` (XLA's ops only, so it runs on the CPU): dx (+ dh), dgamma and dw from the forward's r
    against the float32 reference's VJP, at odd sizes, with dy and dh of magnitudes far apart."""
    M, K, N = 37, 88, 56
    x, w = normal((M, K), dtype, scale=30.0), normal((K, N), dtype, scale=0.1)
    dy_scale = 1e3 if dtype == jnp.bfloat16 else 10.0  # (float16's dw tops out at 65504)
    gamma, dy = normal((K,), jnp.float32, scale=2.0), normal((M, N), dtype, scale=dy_scale)
    dh = normal((M, K), dtype, scale=5.0) if residual else None
    eps = 1e-5
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=1) + eps)
    dx, dgamma, dw = nm._backward_by_xla(x, gamma, w, rstd, dy, dh)
    assert (dx.dtype, dgamma.dtype, dw.dtype) == (dtype, gamma.dtype, w.dtype)
    f32 = [a.astype(jnp.float32) for a in (x, gamma, w)]
    _, vjp = jax.vjp(lambda *a: reference.rmsnorm_matmul(*a, eps=eps), *f32)
    want_dx, want_dgamma, want_dw = vjp(dy.astype(jnp.float32))
    if residual:  # the residual's cotangent dh reaches dx (h = x + residual)
        want_dx = want_dx + dh.astype(jnp.float32)
    assert_close(dx, want_dx, tolerance(dtype, N), "dx")
    assert_close(dgamma, want_dgamma, tolerance(dtype, M * N), "dgamma")
    assert_close(dw, want_dw, tolerance(dtype, M), "dw")


def test_backward_in_xla_takes_shapes_our_backward_kernels_cannot_tile():
    """With ``backward_in_xla`` only the forward's tiles must divide the shape: K = 576 (9 steps of 64) takes the
    built-in forward, where the dx kernel's 256-column tiles would not tile it; ours refuses, naming that kernel. The
    call weighs its own config's tiles, not the default config's (which cannot tile K either)."""
    M, K, N = 256, 576, 1024
    ours = nm_config.mosaic_builtin_config(256, 512, 1024)
    assert ours.dx.cta_n == 256 and "(dx kernel)" in ours.unsupported_reason(M, K, N)
    config = dataclasses.replace(ours, backward_in_xla=True)
    assert config.unsupported_reason(M, K, N) is None
    fn, args = _fwd_bwd(M, K, N, False, config)
    with backends.lowering_for_gpu():
        assert [k.name for k in _lowered_kernels(fn, *args)] == ["rmsnorm_matmul_fwd"]
        with pytest.raises(ValueError, match=r"rmsnorm_matmul \(mosaic\): K=576 .*\(dx kernel\)"):
            jax.jit(_fwd_bwd(M, K, N, False, ours)[0]).trace(*args)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("residual", [False, True])
def test_backward_in_xla_where_our_backward_kernels_cannot_tile_in_interpret_mode(residual):
    """The fused forward (interpret mode) and XLA's backward at K = 160, which the forward's 32-deep K steps tile
    and the dx kernel's 64-column tiles do not: forward and gradients against the float32 reference."""
    tiles = _Interpreted.tiles
    config = Config(forward=tiles, dx=tiles, dw=tiles, backward_in_xla=True)
    x, g, w, res = inputs(128, 160, 256, jnp.bfloat16, residual=residual)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _Interpreted().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, 256), block_sizes=config)


@pytest.mark.parametrize("residual", [False, True])
def test_backward_in_xla_lowers_the_forward_kernel_alone(residual):
    """``backward_in_xla``: forward + backward lowered for CUDA holds the forward's Mosaic kernel and no other."""
    config = dataclasses.replace(nm_config.mosaic_builtin_config(256, 512, 1024), backward_in_xla=True)
    fn, args = _fwd_bwd(256, 512, 1024, residual, config)
    with backends.lowering_for_gpu():
        assert [k.name for k in _lowered_kernels(fn, *args)] == ["rmsnorm_matmul_fwd"]


@pytest.mark.parametrize("row_dot", ["n", "k"])
def test_backward_in_xla_keeps_no_y_for_the_backward(row_dot):
    """The forward's residuals for XLA's backward: x, gamma, w and r, not y (which only our row dot over N reads)."""
    config = dataclasses.replace(nm_config.mosaic_builtin_config(256, 512, 1024), row_dot=row_dot,
                                 backward_in_xla=True)
    static = nm._Static(config=config, eps=1e-6, out_dtype=jnp.dtype(jnp.bfloat16), one_row_backward=None)
    args = (S((256, 512), jnp.bfloat16), None, S((512,), jnp.bfloat16), S((512, 1024), jnp.bfloat16))
    with backends.lowering_for_gpu():
        _, saved = jax.eval_shape(lambda x, g, w: nm._rmsnorm_matmul_fwd(x, None, g, w, static), args[0], *args[2:])
    assert saved[4] is None
    ours = dataclasses.replace(static, config=dataclasses.replace(config, backward_in_xla=False))
    with backends.lowering_for_gpu():
        _, saved = jax.eval_shape(lambda x, g, w: nm._rmsnorm_matmul_fwd(x, None, g, w, ours), args[0], *args[2:])
    assert (saved[4] is not None) == (row_dot == "n")  # (our row dot over N reads y)


@gpu_only
@pytest.mark.parametrize("M, K, N, residual", [(256, 2048, 8192, False), (128, 1024, 1024, True),
                                               (384, 1024, 768, False)])
def test_backward_in_xla_on_the_gpu(M, K, N, residual):
    """The fused forward with XLA's backward (``backward_in_xla``) on the shape's default forms: forward and
    gradients against the float32 reference."""
    config = dataclasses.replace(nm_config.mosaic_default_config(M, K, N, jnp.bfloat16, residual=residual),
                                 backward_in_xla=True)
    x, g, w, res = inputs(M, K, N, jnp.bfloat16, residual=residual)
    _Mosaic().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("residual", [False, True])
def test_backward_in_xla_where_our_backward_kernels_cannot_tile_on_the_gpu(residual):
    """The built-in forward with XLA's backward at K = 576, which our dx kernel's tiles do not divide (the CPU tests'
    shape, ``test_backward_in_xla_takes_shapes_our_backward_kernels_cannot_tile``): forward and gradients against the
    float32 reference."""
    M, K, N = 256, 576, 1024
    config = dataclasses.replace(nm_config.mosaic_builtin_config(M, 512, N, residual=residual), backward_in_xla=True)
    x, g, w, res = inputs(M, K, N, jnp.bfloat16, residual=residual)
    _Mosaic().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


def _untuned_from_entry() -> Config:
    """The H200's tuned entry at ``nm_config.UNTUNED_FROM``."""
    key = nm_config.shape_key(*nm_config.UNTUNED_FROM, jnp.bfloat16)
    return Config(**tuning.lookup(nm_config.OP, key, backend="mosaic", device="NVIDIA H200"))


def test_untuned_shapes_take_the_h200_entry_where_it_fits(monkeypatch):
    """On an H200, a shape no tuned entry covers takes the entry at UNTUNED_FROM where its tiles and forms fit (the
    forms measured faster than the built-in tables at seven such shapes); a residual, float16, tiles that do not
    fit, one row, and other devices keep the built-in tables; a tuned shape keeps its own entry."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    entry = _untuned_from_entry()
    assert entry.gamma_on == "a" and entry.xr_in_dx and entry.dx_in_kernel  # (what it brings: NOTES.md)
    for M, K, N, dw_stream_k in [(8192, 4096, 11008, 4), (8192, 2048, 5632, 0), (2048, 4096, 4096, 0),
                                 (16384, 3072, 8192, 0)]:
        expected = _untuned_expected(M, K, entry.dx.tile_n, dw_stream_k)  # (the dw split: below)
        assert nm_config.mosaic_default_config(M, K, N) == expected, (M, K, N)
        x, g, w = S((M, K), jnp.bfloat16), S((K,), jnp.float32), S((K, N), jnp.bfloat16)
        with backends.lowering_for_gpu():
            assert norm_matmul.plan(x, g, w, backend="mosaic").config == expected
    builtin = nm_config.mosaic_builtin_config
    assert nm_config.mosaic_default_config(8192, 2048, 5632, residual=True) == builtin(8192, 2048, 5632,
                                                                                       residual=True)
    assert nm_config.mosaic_default_config(8192, 2048, 5632, jnp.float16) == builtin(8192, 2048, 5632)
    assert nm_config.mosaic_default_config(8192, 2048, 5696) == builtin(8192, 2048, 5696)  # N: 22.25 tiles of 256
    assert nm_config.mosaic_default_config(1, 4096, 11008) == builtin(1, 4096, 11008)
    # a form that would raise in the kernels: a row of 160 dx tiles (its row sums take at most 132)
    assert nm_config.mosaic_default_config(4096, 40960, 5632) == builtin(4096, 40960, 5632)
    # the entry's tiles narrowed where its own do not divide the shape: at N = 256, 256 row blocks of one 256-wide
    # forward tile each would put half of the first tiles (which share r) in the stream-K phase, so 128-wide ones
    # (3 whole rounds hold them); K = 896 (Qwen2-0.5B's) takes 224-wide dx tiles (and the short-K rule's 128-wide
    # ping-pong forward tiles)
    for M, K, N, fwd_tile_n, dx_tile_n in [(32768, 4096, 256, 128, 256), (4096, 896, 4864, 128, 224),
                                           (4096, 896, 1152, 128, 224)]:
        config = nm_config.mosaic_default_config(M, K, N)
        assert (config.forward.tile_n, config.dx.tile_n) == (fwd_tile_n, dx_tile_n), (M, K, N)
        assert config.dx_in_kernel and config.xr_in_dx and config.unsupported_reason(M, K, N) is None
    tuned = Config(**tuning.lookup(nm_config.OP, nm_config.shape_key(4096, 2048, 11008, jnp.bfloat16),
                                   backend="mosaic"))
    assert nm_config.mosaic_default_config(4096, 2048, 11008) == tuned != entry
    for device in ("NVIDIA H100 80GB HBM3", "cpu"):
        monkeypatch.setattr(tuning, "device_kind", lambda device=device: device)
        assert nm_config.mosaic_default_config(8192, 2048, 5632) == builtin(8192, 2048, 5632)


@pytest.mark.parametrize("device", ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "cpu"])
def test_untuned_rule_gives_every_shape_a_config_or_a_reason(monkeypatch, device):
    """The default config of any shape, on a device with tuned entries or none: a config whose kernels take the
    shape or name why not, never an exception from inside the rules. Fewer rows than a forward tile (2-127) raised
    ValueError from the stream-K planner on the H200 (0caff27 to 1338ab9), and with it every backend's call,
    Triton's too: the backends ask each one whether it takes the shape (bench at 16x4096x4096, 71st session)."""
    monkeypatch.setattr(tuning, "device_kind", lambda: device)
    for M in (1, 2, 16, 63, 64, 100, 127, 128, 200, 1000, 4096):
        for K, N in [(64, 64), (96, 200), (576, 1536), (1000, 4096), (1024, 128), (4096, 4096), (4096, 14336)]:
            for dtype, residual in [(jnp.bfloat16, False), (jnp.bfloat16, True), (jnp.float16, False)]:
                config = nm_config.mosaic_default_config(M, K, N, dtype, residual=residual)
                reason = config.unsupported_reason(M, K, N)
                assert reason is None or isinstance(reason, str) and reason, (M, K, N, dtype, residual)


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_untuned_few_rows_on_an_h200_lower_on_the_triton_backend(monkeypatch, backend):
    """16 rows on an H200 (a decode batch): "triton" and "auto" lower the Triton kernels for CUDA, forward and
    gradients; Mosaic refuses the shape with its reason."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    M, K, N = 16, 4096, 4096
    x, g, w = S((M, K), jnp.bfloat16), S((K,), jnp.float32), S((K, N), jnp.bfloat16)

    def forward_backward(x, g, w):
        y, vjp = jax.vjp(lambda *a: norm_matmul.rmsnorm_matmul(*a, backend=backend), x, g, w)
        return y, vjp(jnp.ones_like(y))
    with backends.lowering_for_gpu():
        assert norm_matmul.plan(x, g, w, backend=backend).backend == "triton"
        text = jax.jit(forward_backward).trace(x, g, w).lower(lowering_platforms=("cuda",)).as_text()
        with pytest.raises(ValueError, match="backend='mosaic' cannot run rmsnorm_matmul here: .*M=16"):
            norm_matmul.plan(x, g, w, backend="mosaic")
    assert "__gpu$xla.gpu.triton" in text and "mosaic_gpu" not in text


# ---------------------------------------------------------------------------------------------------------------
# Rows the tiles do not divide: the last row of forward and dx tiles, and the dw kernel's last K step, past M
# ---------------------------------------------------------------------------------------------------------------
def _cuda_program(fn, args) -> str:
    with backends.lowering_for_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _pads_in_cuda_program(fn, args) -> list[str]:
    """The result types of the ``stablehlo.pad`` ops of fn lowered for CUDA (e.g. "256xf32"); an edge pad
    (``jnp.pad(mode="edge")``) lowers to a concatenation instead."""
    return re.findall(r"stablehlo\.pad .*-> tensor<([^>]*)>", _cuda_program(fn, args))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("M", [200, 1000, 4104])
def test_rows_past_the_tiles_lower_padding_only_row_vectors(M, residual):
    """M a multiple of 8 but not of the tiles: the built-in tables take their first (widest) tiles, the last row of
    them past M; forward + backward lowers for CUDA as the three kernels within shared memory, and no (M, K) or (M, N)
    tensor is padded (TMA loads zeros past M and stores nothing there): only (M,) row vectors are."""
    K, N = 4096, 2048  # (256 dw tiles: the dw kernel runs, not XLA's GEMM)
    config = nm_config.mosaic_builtin_config(M, K, N, residual=residual)
    whole = nm_config.mosaic_builtin_config(-(-M // 128) * 128, K, N, residual=residual)  # (whole 128-row tiles)
    assert (config.forward, config.dx, config.dw) == (whole.forward, whole.dx, whole.dw)
    assert M % config.forward.cta_m and config.unsupported_reason(M, K, N) is None
    fn, args = _fwd_bwd(M, K, N, residual, config)
    with backends.lowering_for_gpu():
        kernels = _lowered_kernels(fn, *args)
    assert sorted(k.name for k in kernels) == ["rmsnorm_matmul_dw", "rmsnorm_matmul_dx", "rmsnorm_matmul_fwd"]
    assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels)
    pads = _pads_in_cuda_program(fn, args)
    assert pads and all(re.fullmatch(r"\d+xf32", p) for p in pads), pads


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rows_not_a_multiple_of_8_run_the_forward_as_they_are_and_pad_the_backward(residual):
    """1001 rows: the forward kernel takes them as they are (A's blocks and y's pieces through untiled views of
    shared memory: ``gemm.config.any_rows_reason``), so a forward pads only row vectors; the dx and dw kernels take
    whole 8-row tiles, so the backward pads x (and r) with copies of the last row and dy with zeros to 1008 rows,
    and slices dx back."""
    M, K, N = 1001, 4096, 2048
    x, g, w = S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)
    assert nm_config.kernel_rows(M) == 1008 and nm_config.kernel_rows(1) == 1 and nm_config.kernel_rows(1000) == 1000
    assert nm.unsupported_reason(x, g, w, residual=x if residual else None) is None
    config = nm_config.mosaic_builtin_config(M, K, N, residual=residual)
    assert config == nm_config.mosaic_builtin_config(1008, K, N, residual=residual)
    assert nm_config.forward_takes_any_rows(config, jnp.bfloat16, jnp.bfloat16)
    fn, args = _fwd_bwd(M, K, N, residual, config)
    with backends.lowering_for_gpu():
        kernels = _lowered_kernels(fn, *args)
        outs = jax.eval_shape(jax.jit(fn), *args)
    assert sorted(k.name for k in kernels) == ["rmsnorm_matmul_dw", "rmsnorm_matmul_dx", "rmsnorm_matmul_fwd"]
    assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels)
    assert [o.shape for o in jax.tree.leaves(outs)][:2 + residual] == [(M, K)] * residual + [(M, N), (M, K)]
    text = _cuda_program(fn, args)
    assert "tensor<1008x4096xbf16>" in text and "tensor<1008x2048xbf16>" in text  # x and dy, for the backward

    def forward(x, g, w, *r):
        return norm_matmul.rmsnorm_matmul(x, g, w, residual=r[0] if r else None, backend="mosaic",
                                          block_sizes=config)

    text = _cuda_program(forward, [x, g, w] + ([x] if residual else []))
    assert "1008x" not in text and "tensor<1001x2048xbf16>" in text  # (only the (M,) sums, padded to 1024)


@pytest.mark.parametrize("device_kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
@pytest.mark.parametrize("M, K, N", [(1001, 4096, 2048), (16401, 1024, 5504), (8201, 4096, 6144)])
def test_rows_not_a_multiple_of_8_take_xlas_backward_by_default(monkeypatch, device_kind, M, K, N):
    """Without block_sizes, rows not a multiple of 8 take XLA's backward after our unpadded forward (padding for our
    backward kernels cost more: ``mosaic_default_config``): the program lowered for CUDA holds no padded tensor."""
    monkeypatch.setattr(tuning, "device_kind", lambda: device_kind)
    config = nm_config.mosaic_default_config(M, K, N)
    whole = nm_config.mosaic_default_config(M - M % 8, K, N)
    assert config.backward_in_xla and config.forward == whole.forward
    fn, args = _fwd_bwd(M, K, N, False)
    with backends.lowering_for_gpu():
        kernels = _lowered_kernels(fn, *args)
    assert [k.name for k in kernels] == ["rmsnorm_matmul_fwd"]
    assert f"{nm_config.kernel_rows(M)}x" not in _cuda_program(fn, args)


def test_rows_not_a_multiple_of_8_pad_whole_where_the_forward_cannot_take_them():
    """A forward config whose A blocks are two swizzled rows wide (tile_k 128) cannot take 1001 rows as they are:
    x is padded to 1008 rows before the forward, as before untiled views."""
    M, K, N = 1001, 4096, 2048
    config = nm_config.mosaic_builtin_config(M, K, N)
    wide = dataclasses.replace(config, forward=dataclasses.replace(config.forward, tile_k=128, num_stages=2))
    assert not nm_config.forward_takes_any_rows(wide, jnp.bfloat16, jnp.bfloat16)
    x, g, w = S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16)

    def forward(x, g, w):
        return norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=wide)

    assert "tensor<1008x4096xbf16>" in _cuda_program(forward, [x, g, w])


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("dtype, residual", [(jnp.bfloat16, False), (jnp.bfloat16, True), (jnp.float16, False)],
                         ids=["bf16-plain", "bf16-residual", "fp16-plain"])
def test_rows_not_a_multiple_of_8_in_interpret_mode(dtype, residual):
    """75 rows on 64-row tiles (the backward's padded to 80 with copies of the last), eps = 0: forward and gradients
    against the float32 reference, none NaN (float16: the dw GEMM's dyr scaled by s = max r)."""
    tiles = _Interpreted.tiles
    config = Config(forward=tiles, dx=tiles, dw=tiles)
    x, g, w, res = inputs(75, 128, 256, dtype, residual=residual)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _Interpreted().check_against_reference(x, g, w, res, tolerance(dtype, 256), block_sizes=config, eps=0.0)


def test_rows_past_the_tiles_need_our_k_loop_and_the_error_names_it():
    """A last row of tiles past M needs the K loop "own" (jax's pipeline slices its blocks itself): a config with
    another is refused at 1000 rows, naming the loop and the kernel, and taken at 1024."""
    config = nm_config.mosaic_builtin_config(1000, 4096, 2048)
    steady = dataclasses.replace(config, forward=dataclasses.replace(config.forward, pipeline="pallas_steady"))
    assert steady.unsupported_reason(1000, 4096, 2048) == (
        "M=1000 is not a multiple of 128: a last row of tiles past it needs the K loop pipeline='own', got "
        "'pallas_steady' (forward kernel)")
    assert steady.unsupported_reason(1024, 4096, 2048) is None and config.unsupported_reason(1000, 4096, 2048) is None
    x, g, w = (jnp.zeros(s, jnp.bfloat16) for s in ((1000, 4096), (4096,), (4096, 2048)))
    with pytest.raises(ValueError, match=r"rmsnorm_matmul \(mosaic\): M=1000 is not a multiple of 128: .*K loop"):
        nm.check_config(steady, x, g, w)


@pytest.mark.parametrize("M", [16400, 16448, 24576])
def test_rows_past_a_tuned_power_of_two_take_its_entry(monkeypatch, M):
    """On an H200, rows no entry is keyed for (the key rounds M up to 32768) take the entry at the power of two
    below (16384x1024x5504's), its last row of tiles past M where its tiles do not divide M."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    K, N = 1024, 5504
    entry = Config(**tuning.lookup(nm_config.OP, nm_config.shape_key(16384, K, N, jnp.bfloat16), backend="mosaic"))
    assert tuning.lookup(nm_config.OP, nm_config.shape_key(M, K, N, jnp.bfloat16), backend="mosaic") is None
    assert nm_config.mosaic_default_config(M, K, N) == entry
    assert nm_config.mosaic_default_config(M, K, N, residual=True) != entry  # (no entry with a residual)


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rows_past_the_tiles_in_interpret_mode(residual):
    """72 rows on 64-row tiles (the second row block 8 rows real; the dw kernel's K loop 3 steps of 32, the last 8
    real): forward and gradients against the float32 reference (the interpreter runs on operands padded to whole
    tiles, as TMA would load them)."""
    tiles = _Interpreted.tiles
    config = Config(forward=tiles, dx=tiles, dw=tiles)
    x, g, w, res = inputs(72, 128, 256, jnp.bfloat16, residual=residual)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _Interpreted().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, 256), block_sizes=config)


def _h200_entry_shapes() -> list[tuple[int, int, int]]:
    """(M, K, N) of the H200's Mosaic rmsnorm_matmul entries (bfloat16, no residual, beyond one row)."""
    keys = tuning.load_cache()["entries"]["NVIDIA H200"]["mosaic"][nm_config.OP]
    shapes = [tuple(int(v) for v in re.findall(r"[MKN]=(\d+)", key)) for key in keys if key.startswith("bfloat16[")
              and not key.endswith("+res")]
    return sorted(shape for shape in shapes if shape[0] > 1)


@pytest.mark.parametrize("M, K, N", _h200_entry_shapes())
def test_untuned_rows_past_each_h200_entry_lower_for_cuda(monkeypatch, M, K, N):
    """On an H200, 8 rows fewer than an entry's M (its own key, the last row of tiles past M) and 8 rows more (the
    next power of two's key, so the entry of the power of two below): forward + backward lowers for CUDA on the
    default configs, so none of the kernels' own checks (stream-K beside shared r, sum_rows' rounds) refuses a config
    that ``unsupported_reason`` took."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    for rows in (M - 8, M + 8):
        assert nm_config.mosaic_default_config(rows, K, N).unsupported_reason(rows, K, N) is None
        fn, args = _fwd_bwd(rows, K, N, False)
        with backends.lowering_for_gpu():
            kernels = _lowered_kernels(fn, *args)
        assert "rmsnorm_matmul_fwd" in {k.name for k in kernels}, (rows, K, N)
        assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels)


@gpu_only
@pytest.mark.parametrize("M, K, N", [(200, 2048, 5632), (1000, 4096, 14336), (4000, 2048, 8192), (4104, 4096, 4096),
                                     (16400, 1024, 5504), (16448, 1024, 5504), (100, 2048, 8192), (1001, 2048, 5632)])
@pytest.mark.parametrize("tables", [False, True], ids=["default", "tables"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_untuned_rows_past_the_tiles_on_the_gpu(M, K, N, tables, residual):
    """Rows the tiles do not divide, on the device's own configs (H200: its entries and the untuned rule) and on the
    built-in tables (our backward kernels at every size): forward and gradients against the float32 reference."""
    x, g, w, res = inputs(M, K, N, jnp.bfloat16, residual=residual)
    config = nm_config.mosaic_builtin_config(M, K, N, residual=residual) if tables else None
    _Mosaic().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


@pytest.mark.parametrize("M, K, N", [(8192, 2048, 5632), (8192, 4096, 6144), (16384, 1024, 5504), (8192, 512, 2816),
                                     (256, 2048, 8192)])
def test_untuned_and_tuned_shapes_sweep_around_the_h200_entry(monkeypatch, M, K, N):
    """``jaxfuse bench --tune`` on an H200: the candidates around the config a call takes (the entry at
    UNTUNED_FROM at an untuned shape, the shape's own entry at a tuned one) leave out the changes that entry cannot
    take (the pallas_steady K loop beside stream-K or ping-pong tiles raised, and the sweep skipped Mosaic as if it
    could not run the shape); the backward ones hold XLA's backward and ours (``backward_in_xla``), and vary our
    kernels even where the base takes XLA's (few rows)."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    base = nm_config.mosaic_default_config(M, K, N)
    forward, backward = nm_config.mosaic_sweep_candidates(M, K, N)
    assert base.to_dict() in forward and base.to_dict() in backward and len(forward) > 5 and len(backward) > 5
    assert all(Config(**c).unsupported_reason(M, K, N) is None for c in forward + backward)
    assert all(Config(**c).dgamma_reason(M, N, jnp.bfloat16) is None for c in forward + backward)
    assert all(c["forward"]["pipeline"] == "own" for c in forward)  # (none of them took pallas_steady)
    # a candidate widening the forward's tiles beside a deep ring (the few-row rule's, 8192x512x2816's entry) takes
    # fewer stages: as built, 2 or 3 of them overflowed shared memory there
    assert all(smem_bytes(MosaicGemmConfig(**c["forward"]), jnp.bfloat16, jnp.bfloat16) + BARRIER_BYTES
               <= mosaic_utils.H100_SMEM_BYTES for c in forward)
    assert base.backward_in_xla == (M <= 512)  # (the few-row shape's dx tiles fill at most half the grid)
    ours = [c for c in backward if not c["backward_in_xla"]]
    assert len(ours) == len(backward) - 1 > 5 and len({(str(c["dx"]), str(c["dw"])) for c in ours}) > 5


def test_sweep_candidates_with_gamma_on_w_take_dgamma_from_dw_beside_a_base_taking_it_from_u(monkeypatch):
    """A forward candidate putting gamma on w beside a base whose dgamma comes from u (needing gamma on x's side)
    takes dgamma from dw's side: as built, rmsnorm_matmul raised on it (4 of 34 candidates at 256x2048x8192 while
    the untuned rule took dgamma from u there)."""
    M, K, N = 256, 2048, 8192
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    from_u = dataclasses.replace(nm_config.mosaic_default_config(M, K, N), dgamma_from="u", dx_in_kernel=False,
                                 xr_in_dx=False)
    monkeypatch.setattr(nm_config, "mosaic_default_config", lambda *a, **k: from_u)
    forward, backward = nm_config.mosaic_sweep_candidates(M, K, N)
    assert any(c["gamma_on"] == "w" and c["dgamma_from"] is None for c in forward)
    assert all(Config(**c).dgamma_reason(M, N, jnp.bfloat16) is None for c in forward + backward)


# Shapes of more than UNTUNED_FEW_ROWS rows where the untuned rule's short-K forms take ping-pong forward tiles
# (``_untuned_short_k``: K below 1024, N wider)
_SHORT_K_SHAPES = {(4096, 896, 1152), (2048, 896, 1152), (2048, 896, 4864), (4096, 768, 3072), (8192, 768, 3072),
                   (4096, 512, 4096), (4096, 960, 2560)}


def _untuned_expected(M: int, K: int, dx_tile_n: int, dw_stream_k: int = 0, fwd_store: str = "split",
                      fwd_tile_n: int = 256, xla_backward: bool = False, fwd_stages: int | None = None,
                      N: int | None = None) -> Config:
    """The entry at UNTUNED_FROM with the dx kernel's tiles dx_tile_n wide (``norm_matmul.config._untuned_dx``), the
    dw kernel's stream-K split (``_untuned_dw``), the forward's epilogue_store and tile width (``_untuned_forward``);
    at M <= UNTUNED_FEW_ROWS r and gamma from XLA's pass and the forward ring fwd_stages deep (``_untuned_deep_ring``;
    None: the entry's), and with xla_backward XLA's backward (``_untuned_backward``); at (M, K, N) of _SHORT_K_SHAPES
    r and gamma from XLA's pass and the ping-pong forward tiles (``_untuned_short_k``)."""
    entry = _untuned_from_entry()
    assert entry.forward.epilogue_store == "split"
    epi = entry.dx.epi_tile_n if dx_tile_n % entry.dx.epi_tile_n == 0 else 32
    expected = dataclasses.replace(entry, dx=dataclasses.replace(entry.dx, tile_n=dx_tile_n, epi_tile_n=epi),
                                   dw=dataclasses.replace(entry.dw, stream_k=dw_stream_k),
                                   forward=dataclasses.replace(entry.forward, epilogue_store=fwd_store,
                                                               tile_n=fwd_tile_n))
    if M <= nm_config.UNTUNED_FEW_ROWS:
        expected = dataclasses.replace(expected, gamma_on="x", stats_in_kernel=False, squares_from="observe")
    if (M, K, N) in _SHORT_K_SHAPES:
        expected = dataclasses.replace(expected, gamma_on="x", stats_in_kernel=False, squares_from="observe",
                                       forward=dataclasses.replace(expected.forward,
                                                                   **nm_config.UNTUNED_PINGPONG_FORWARD))
    if fwd_stages is not None:
        expected = dataclasses.replace(expected, forward=dataclasses.replace(expected.forward, num_stages=fwd_stages))
    return dataclasses.replace(expected, backward_in_xla=xla_backward)


@pytest.mark.parametrize("M, K, N, xla_backward, fwd_stages", [
    (256, 2048, 8192, True, 6),  # 64 dx tiles of 128x64 on 132 blocks; the forward's K loop 32 steps
    (512, 1024, 4096, True, 4),  # (16 steps: the entry's ring)
    (128, 1024, 1024, True, 4),  # 16 dx tiles
    (512, 4096, 4096, True, 6),  # 128 dx tiles of 128x128, but 64 at the entry's 128x256: XLA's backward
    (512, 2048, 2048, True, 8),  # 128 dx tiles, but XLA runs the dw GEMM ((K, N): few tiles); 64-wide forward
    # tiles: 8 stages fit
    (1024, 1024, 4096, True, 4),
    (1024, 2048, 5632, True, 6),
    (1024, 4096, 4096, False, 4),  # 128 dx tiles at 128x256: our kernels; 256-wide forward tiles: 6 stages would
    # not fit (nor 5)
    (4096, 512, 4096, False, 6),  # (not few rows: 64 dx tiles at 128x256 but 128 at the rule's 128x128; the
    # short-K rule's ping-pong forward, 6 stages)
    (2048, 4096, 4096, False, None)])
def test_untuned_few_rows_take_r_from_xla_a_deeper_ring_and_xla_backward_where_dx_tiles_are_few(
        monkeypatch, M, K, N, xla_backward, fwd_stages):
    """At M <= UNTUNED_FEW_ROWS the forward takes r and x ⊙ gamma from XLA's pass (r shared by the first tiles made
    one or two rounds wait) and a ring UNTUNED_DEEP_RING_STAGES deep where its K loop is long and the stages fit;
    where the entry's dx kernel's tiles would fill at most half the grid, or XLA runs the dw GEMM anyway, the backward
    is XLA's; 2048 rows keep the entry's forms."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(mosaic_utils, "num_sms", lambda: 132)
    config = nm_config.mosaic_default_config(M, K, N)
    entry = _untuned_from_entry()
    from_xla = M <= nm_config.UNTUNED_FEW_ROWS or (M, K, N) in _SHORT_K_SHAPES
    assert (config.gamma_on, config.stats_in_kernel) == (("x", False) if from_xla else (entry.gamma_on,
                                                                                          entry.stats_in_kernel))
    assert config.backward_in_xla == xla_backward
    assert config.forward.num_stages == (entry.forward.num_stages if fwd_stages is None else fwd_stages)
    assert config == _untuned_expected(M, K, config.dx.tile_n, config.dw.stream_k, config.forward.epilogue_store,
                                       config.forward.tile_n, xla_backward, fwd_stages, N)
    if fwd_stages in nm_config.UNTUNED_DEEP_RING_STAGES:  # (what fits: smem_bytes, within a barrier's margin)
        assert smem_bytes(config.forward, jnp.bfloat16, jnp.bfloat16) + BARRIER_BYTES <= mosaic_utils.H100_SMEM_BYTES


@pytest.mark.parametrize("M, K, N, form", [
    (4096, 960, 2560, "pingpong"),  # 15 K steps: 640 forward tiles of 128x128 on 132 blocks
    (2048, 768, 3072, "pingpong"), (4096, 896, 1152, "pingpong"),
    (8192, 768, 3072, "pingpong"), (4096, 896, 4864, "pingpong"),  # (5.8 and 4.6 rounds of 128x256 tiles)
    (2048, 1024, 2048, "whole"),  # K = 1024 (16 steps): 128 tiles of 128x256, one round
    (8192, 1024, 4096, None),  # K = 1024, 7.8 rounds
    (4096, 1024, 1024, None), (4096, 768, 768, None),  # N = K
    (2048, 2048, 4096, None),  # K = 2048
    (1024, 768, 3072, None)])  # (few rows: r from XLA there anyway, the split rule's forward tiles)
def test_untuned_short_k_takes_r_from_xla_and_pingpong_or_whole_forward_tiles(monkeypatch, M, K, N, form):
    """Beyond UNTUNED_FEW_ROWS rows, where N is wider than K, the forward takes r and x ⊙ gamma from XLA's pass and:
    below K = UNTUNED_SHORT_K the ping-pong 128x128 tiles, at any number of rounds; at it whole tiles where they make
    at most UNTUNED_SHORT_K_ROUNDS rounds. Elsewhere the entry's r shared by the first tiles (and its stream-K
    split)."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(mosaic_utils, "num_sms", lambda: 132)
    config, entry = nm_config.mosaic_default_config(M, K, N), _untuned_from_entry()
    fwd = config.forward
    assert config != nm_config.mosaic_builtin_config(M, K, N)
    if form is not None:
        assert (config.gamma_on, config.stats_in_kernel, fwd.stream_k) == ("x", False, 0)
        assert (fwd.schedule, fwd.cta_m, fwd.cta_n) == (("pingpong", 128, 128) if form == "pingpong" else
                                                        ("cooperative", entry.forward.cta_m, entry.forward.cta_n))
    elif M <= nm_config.UNTUNED_FEW_ROWS:  # the few-row forms: r from XLA, the forward's K loop split where long
        assert (config.gamma_on, fwd.stream_k) == ("x", entry.forward.stream_k)
    else:
        assert (config.gamma_on, config.stats_in_kernel) == (entry.gamma_on, entry.stats_in_kernel)
        assert (fwd.schedule, fwd.stream_k) == (entry.forward.schedule, entry.forward.stream_k)


@pytest.mark.parametrize("M, K, N, xla_backward", [
    (1000, 4096, 14336, True), (768, 4096, 11008, True), (1024, 3584, 18944, True),  # N >= 2.5 K
    (1000, 4096, 11008, True), (1024, 4096, 11008, True),
    (512, 4096, 14336, True), (1024, 2048, 5632, True),  # (XLA's before the rule: the entry's dx tiles, dw by XLA)
    (1024, 4096, 4096, False),  # N = K: our kernels
    (2048, 4096, 14336, False)])  # (not few rows)
def test_untuned_few_rows_take_xlas_backward_where_n_is_wide(monkeypatch, M, K, N, xla_backward):
    """At M <= UNTUNED_FEW_ROWS, XLA's backward also where N is at least UNTUNED_XLA_BWD_N_OVER_K times K (the dx
    kernel's few output tiles, each a long K loop over N: XLA's ran 3-12% faster at five such shapes)."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(mosaic_utils, "num_sms", lambda: 132)
    assert nm_config.mosaic_default_config(M, K, N).backward_in_xla == xla_backward


@pytest.mark.parametrize("M, K, N, fwd_stream_k", [
    (256, 4096, 1024, 4),  # 32 forward tiles of 128x64 on 132 blocks, 64 K steps: split in 4
    (512, 4096, 1024, 4), (256, 8192, 2048, 4),  # 64 tiles (64 and 128 steps)
    (256, 1024, 4096, 1),  # 64 tiles, but 16 steps: whole tiles
    (256, 2048, 8192, 1),  # 128 tiles
    (1000, 4096, 14336, 4), (1024, 3584, 18944, 4),  # 448 and 592 tiles: last rounds of 52 and 64, 64 and 56 steps
    (1024, 2048, 5632, 1),  # a last round of 88 tiles (128 wide), 32 steps
    (1000, 4096, 11008, 1),  # a last round of 80
    (2048, 4096, 1024, 1), (2048, 4096, 14336, 1)])  # (not few rows)
def test_untuned_few_rows_split_a_long_forward_k_loop_over_a_half_empty_grid(monkeypatch, M, K, N, fwd_stream_k):
    """At M <= UNTUNED_FEW_ROWS, where the forward's tiles fill at most half the grid and its K loop has at least
    UNTUNED_SPLIT_FORWARD_STEPS steps, or fill more than a round with the last at most half full and its K loop has
    at least UNTUNED_SPLIT_TAIL_STEPS, stream-K splits that loop in UNTUNED_SPLIT_FORWARD."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(mosaic_utils, "num_sms", lambda: 132)
    config = nm_config.mosaic_default_config(M, K, N)
    assert config.forward.stream_k == fwd_stream_k


@pytest.mark.parametrize("M, K, N", [(64, 4096, 14336), (64, 2048, 8192), (64, 1024, 3072), (96, 2048, 8192)])
def test_untuned_rows_below_the_entrys_tiles_take_the_tables_kernels_and_xla_backward(monkeypatch, M, K, N):
    """On an H200, fewer rows than one row of the entry's 128-row forward tiles: the built-in tables' kernels with
    XLA's backward, whose GEMMs beat our dx and dw kernels on a few blocks (``config._untuned_below_entry``). With a
    residual, another device, or rows the kernels do not take (20: below FEWEST_ROWS), the tables as they are."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    builtin = nm_config.mosaic_builtin_config(M, K, N)
    assert nm_config.mosaic_default_config(M, K, N) == dataclasses.replace(builtin, backward_in_xla=True)
    assert nm_config.mosaic_default_config(M, K, N, residual=True) == nm_config.mosaic_builtin_config(
        M, K, N, residual=True)
    assert nm_config.mosaic_default_config(20, K, N) == nm_config.mosaic_builtin_config(20, K, N)
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert nm_config.mosaic_default_config(M, K, N) == builtin


@pytest.mark.parametrize("M, K, N", [(192, 2048, 8192), (200, 2048, 5632), (1000, 4096, 14336)])
def test_untuned_rows_past_a_row_of_the_entrys_tiles_take_its_forms(monkeypatch, M, K, N):
    """On an H200, more rows than one row of the entry's forward tiles, not a multiple of them: the entry's tiles, the
    last row of them past M (192x2048x8192: 17.6 / 62.1 µs forward / forward + backward, where the tables' 64-row
    tiles with XLA's backward took 23.5 / 68.0: rmsnorm_matmul-ragged_rows_few-h200-f099cf2.json)."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    entry = Config(**tuning.lookup(nm_config.OP, nm_config.shape_key(*nm_config.UNTUNED_FROM, jnp.bfloat16),
                                   backend="mosaic"))
    config = nm_config.mosaic_default_config(M, K, N)
    assert config.forward.cta_m == entry.forward.cta_m == 128 and M % 128
    assert config != nm_config.mosaic_builtin_config(M, K, N)


@gpu_only
@pytest.mark.parametrize("M, K, N", [(256, 4096, 1024), (256, 8192, 2048), (384, 2048, 2048), (64, 2048, 8192),
                                     (192, 2048, 8192)])
def test_untuned_few_row_forms_on_the_gpu(M, K, N):
    """Shapes of few rows no tuned entry covers, without block_sizes (on an H200 the forward split by stream-K at the
    first two, XLA's backward at the first and third; the tables' kernels and XLA's backward below the entry's 128-row
    forward tiles, the last two): forward and gradients against the float32 reference."""
    x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
    _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)))


@pytest.mark.parametrize("M, K, N, fwd_tile_n", [
    (512, 4096, 4096, 128),  # 256 wide: 64 tiles on 132 blocks; 128: 128 tiles, one round either way
    (256, 2048, 8192, 128), (512, 1024, 4096, 128),  # (64: 256 tiles, 2 rounds)
    (256, 1024, 4096, 64), (128, 1024, 1024, 64),  # 128: 64 and 8 tiles; 64: 128 and 16, one round either way
    (1024, 2048, 5632, 128),  # 256: 176 tiles, 2 rounds; 128: 352, 3 rounds (3 x 1.3 < 2 x 2)
    (1024, 4096, 14336, 256),  # 256: 448 tiles, 4 rounds; 128: 896, 7 (measured 13% slower)
    (2048, 2048, 8192, 256), (8192, 4096, 11008, 256)])
def test_untuned_forward_tiles_narrow_where_rounds_come_out_fuller(monkeypatch, M, K, N, fwd_tile_n):
    """The forward kernel's tile width at an untuned shape: the least rounds x width x UNTUNED_FORWARD_COLUMN_COST on
    132 blocks, the entry's 256 where they tie."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(mosaic_utils, "num_sms", lambda: 132)
    assert nm_config.mosaic_default_config(M, K, N).forward.tile_n == fwd_tile_n


@pytest.mark.parametrize("M, K, N, fwd_store", [
    (2048, 3584, 1536, "end"),  # 96 forward tiles of 128x256 on 132 blocks: one round, no stream-K phase
    (1024, 4096, 4096, "end"),  # 128: one round
    (4224, 4096, 2048, "end"),  # 33 x 8 = 264: 2 whole rounds
    (2048, 4096, 4096, "split"),  # 256: a round and 124 tiles, through the stream-K phase
    (8192, 4096, 11008, "split")])
def test_untuned_forward_stores_at_the_tile_end_without_a_stream_k_phase(monkeypatch, M, K, N, fwd_store):
    """The entry's split store (half the output under the next tile's first wgmma) keeps its wgmma unserialized
    beside γ's registers only where the forward kernel has a stream-K phase; where stream-K plans none the untuned
    rule stores at the tile's end."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    assert nm_config.mosaic_default_config(M, K, N).forward.epilogue_store == fwd_store


@pytest.mark.parametrize("M, K, N, split", [
    (8192, 1536, 8960, 4),  # 420 dw tiles: 3 rounds of 132 and 24
    (8192, 2560, 10240, 4),  # 800: 6 rounds and 8
    (2048, 1536, 8960, 4),  # (the dw tiles do not depend on M)
    (8192, 4096, 11008, 4),  # 1376: 10 rounds and 56 (stream-K cuts those in 2)
    (4096, 5120, 13824, 4),  # 2160: 16 rounds and 48
    (8192, 2048, 5632, 0),  # 352: 2 rounds and 88, over half: stream-K plans none
    (8192, 3584, 18944, 0),  # 2072: 15 rounds and 92
    (2048, 4096, 4096, 0)])
def test_untuned_dw_splits_a_last_round_at_most_half_full(M, K, N, split):
    entry = _untuned_from_entry()
    assert entry.dw.stream_k == 0
    assert nm_config._untuned_dw(M, K, N, entry.dw, 132) == dataclasses.replace(entry.dw, stream_k=split)


@pytest.mark.parametrize("M, K, dx_tile_n", [
    (8192, 768, 192),  # 256 wide: 64 row blocks of 3 tiles, 192 tiles on 120 blocks, 2 rounds; 192: 256 on 128
    (4096, 1536, 192),  # 256: 192 tiles of 6 a row on 132, 2 rounds; 192: 256 tiles on 128, 2 rounds
    (4096, 5120, 160),  # 256: 640 tiles on 120 blocks, 6 rounds; 160: 1024 on 128, 8 full rounds
    (4096, 2560, 160),  # 256: 320 tiles on 130, 3 rounds; 160: 512 on 128, 4
    (8192, 5120, 256),  # 256: 11 rounds (10.7); 160: 16, costlier per column
    (256, 2048, 64),  # 128: 32 tiles, one round; 64: 64, one round, costlier per column but narrower
    (512, 1024, 64), (512, 4096, 128),  # (64 there: 2 rounds of 256 tiles)
    (8192, 3584, 224),  # 256: 896 tiles of 14 a row on 126 blocks, 8 rounds; 224: 1024 on 128, 8 full rounds
    (8192, 7168, 224),  # 256: 1792 of 28 a row on 112, 16 rounds; 224: 2048 on 128, 16
    (16384, 3072, 256), (8192, 2048, 256), (2048, 4096, 256), (8192, 2560, 256), (8192, 1536, 256)])
def test_untuned_dx_tiles_narrow_where_rounds_come_out_fuller(M, K, dx_tile_n):
    """The dx kernel's tile width at an untuned shape: the least rounds x width x UNTUNED_DX_COLUMN_COST on 132
    blocks, 256 where they tie."""
    entry = _untuned_from_entry()
    assert nm_config._untuned_dx(M, K, entry.dx, 132) == _untuned_expected(M, K, dx_tile_n).dx


def test_untuned_sweep_tries_the_dx_tile_widths_the_rule_weighs(monkeypatch):
    """At 8192x768x3072 the untuned rule takes 192-wide dx tiles; ``--tune`` also times 256, 128 and 64 (160 and 224
    do not tile K = 768), each with the rest of the config as taken."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    base = nm_config.mosaic_default_config(8192, 768, 3072)
    _, backward = nm_config.mosaic_sweep_candidates(8192, 768, 3072)
    widths = {c["dx"]["tile_n"]: c for c in backward if dict(c, dx=base.to_dict()["dx"]) == base.to_dict()}
    assert base.dx.tile_n == 192 and set(widths) == {64, 128, 192, 256}, sorted(widths)


@cpu_only
@pytest.mark.parametrize("M, K, N, dx_tile_n, dw_stream_k, fwd_store, fwd_tile_n, xla_backward, fwd_stages", [
    (8192, 2048, 5632, 256, 0, "split", 256, False, None), (2048, 4096, 4096, 256, 0, "split", 256, False, None),
    (8192, 768, 3072, 192, 0, "end", 128, False, None), (4096, 1536, 4096, 192, 4, "split", 256, False, None),
    (4096, 2560, 8192, 160, 0, "split", 256, False, None), (4096, 5120, 13824, 160, 4, "split", 256, False, None),
    (8192, 1536, 8960, 256, 4, "split", 256, False, None), (8192, 3584, 18944, 224, 0, "split", 256, False, None),
    (2048, 3584, 1536, 224, 4, "end", 256, False, None), (512, 4096, 4096, 128, 0, "end", 128, True, 6),
    (256, 2048, 8192, 64, 0, "end", 128, True, 6), (128, 1024, 1024, 64, 4, "end", 64, True, 4),
    (512, 2048, 2048, 64, 0, "end", 64, True, 8),
    (4096, 896, 1152, 224, 4, "end", 128, False, None), (32768, 1024, 256, 256, 4, "split", 128, False, None),
    (4096, 960, 2560, 160, 0, "end", 128, False, None)])
def test_untuned_shapes_entry_lowers_within_shared_memory(M, K, N, dx_tile_n, dw_stream_k, fwd_store, fwd_tile_n,
                                                          xla_backward, fwd_stages, monkeypatch):
    """The entry taken at shapes no tuned entry covers (rows of 3 to 20 dx tiles: the row sums' grid cut in snake
    runs or row by row; dx tiles 256 to 64 wide; the dw kernel with stream-K or not; the forward's tiles 256, 128 or
    64 wide, its output stored split or at the tile's end; at few rows r from XLA, a deeper forward ring and XLA's
    backward; below K = 1024 ping-pong forward tiles): its kernels lower for CUDA there within shared memory, with
    their warpgroups, and it is what a call takes there on an H200."""
    monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
    expected = _untuned_expected(M, K, dx_tile_n, dw_stream_k, fwd_store, fwd_tile_n, xla_backward, fwd_stages, N)
    assert nm_config.mosaic_default_config(M, K, N) == expected
    _check_kernels(M, K, N, False, expected)


@gpu_only
@pytest.mark.parametrize("M, K, N, dx_tile_n, dw_stream_k, fwd_store, fwd_tile_n, xla_backward, fwd_stages", [
    (8192, 2048, 5632, 256, 0, "split", 256, False, None), (2048, 4096, 4096, 256, 0, "split", 256, False, None),
    (4096, 768, 3072, 192, 0, "end", 128, False, None), (2048, 2560, 4096, 160, 4, "split", 256, False, None),
    (2048, 1536, 8960, 192, 4, "split", 256, False, None), (2048, 3584, 1536, 224, 4, "end", 256, False, None),
    (512, 4096, 4096, 128, 0, "end", 128, True, 6), (256, 2048, 8192, 64, 0, "end", 128, True, 6),
    (128, 1024, 1024, 64, 4, "end", 64, True, 4), (512, 2048, 2048, 64, 0, "end", 64, True, 8),
    (2048, 896, 1152, 128, 4, "end", 128, False, None), (2048, 896, 4864, 128, 4, "end", 128, False, None),
    (4096, 960, 2560, 160, 0, "end", 128, False, None)])
def test_untuned_shapes_on_the_gpu(M, K, N, dx_tile_n, dw_stream_k, fwd_store, fwd_tile_n, xla_backward, fwd_stages):
    """Shapes no tuned entry covers, without block_sizes (on an H200: the entry at UNTUNED_FROM, its dx tiles
    dx_tile_n wide, its dw kernel's stream-K split dw_stream_k, its forward's output stored fwd_store and its tiles
    fwd_tile_n wide, at few rows r from XLA, the forward ring fwd_stages deep and XLA's backward with
    xla_backward; at _SHORT_K_SHAPES the ping-pong forward): forward and gradients against the float32 reference, two
    calls; the forward kernel unspilled, its wgmma not serialized."""
    config = nm_config.mosaic_default_config(M, K, N, jnp.bfloat16)
    if tuning.device_kind() == "NVIDIA H200":
        assert config == _untuned_expected(M, K, dx_tile_n, dw_stream_k, fwd_store, fwd_tile_n, xla_backward,
                                           fwd_stages, N)
    x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
    for _ in range(2):
        _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)))
    args = (S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16))
    forward = lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=5e-6, residual=None, out_dtype=x.dtype,  # noqa: E731
                                                interpret=False, config=config)
    (kernel,) = ptxas.compile_report(forward, *args)
    assert not kernel.spills and not kernel.serialized_wgmma, kernel


@gpu_only
@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144),
                                     (4096, 2048, 3072)])  # (the 1b QKV projection's H200 entry takes their form)
def test_the_tuned_forward_keeps_its_wgmma_unserialized_and_unspilled_on_the_gpu(M, K, N):
    """ptxas's report on the suite shapes' tuned forward kernels (built with eps=3e-6, a kernel no other test compiles
    first: Mosaic builds each once per process; the shape itself, since its tile count decides whether the kernel
    has a stream-K phase, and ptxas keeps the split store's wgmma unserialized only beside one): no spills, no
    serialized wgmma (warning C7513). Gamma in the registers with the whole output stored under the next tile's
    first wgmma does serialize (measured 15% slower)."""
    config = nm_config.mosaic_default_config(M, K, N, jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K,), jnp.bfloat16),
            jax.ShapeDtypeStruct((K, N), jnp.bfloat16))

    def forward(c):
        return lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=3e-6, residual=None, out_dtype=x.dtype,
                                                 interpret=False, config=c)

    (kernel,) = ptxas.compile_report(forward(config), *args)
    assert kernel.name == "rmsnorm_matmul_fwd_mosaic_gpu_kernel" and not kernel.spills, kernel
    assert not kernel.serialized_wgmma, kernel.warnings
    if config.gamma_on == "a":  # (r from XLA, whole tiles: the form measured serialized)
        storing_later = dataclasses.replace(  # (r's squares from XLA: "observe", the only form without statistics)
            config, stats_in_kernel=False, squares_from="observe",
            forward=dataclasses.replace(config.forward, epilogue_store="next_tile", stream_k=0))
        (kernel,) = ptxas.compile_report(forward(storing_later), *args)
        assert kernel.serialized_wgmma, kernel.warnings


@gpu_only
@pytest.mark.parametrize("M, K, N, residual", [(4352, 1024, 4096, False), (4352, 2048, 2048, True)])
def test_mma_statistics_with_stream_k_on_the_gpu(M, K, N, residual):
    """r from the MMA warpgroups with the last round's tiles split by K steps: their partial sums of squares are
    added like the accumulators (34 x 16 and 34 x 8 tiles of 128x256 on 132 blocks: a last round of 16 and 8)."""
    config = nm_config.mosaic_default_config(M, K, N, residual=residual, stats_in_kernel="mma")
    config = dataclasses.replace(config, forward=dataclasses.replace(config.forward, stream_k=4))
    assert stream_k.plan_for(M // config.forward.cta_m * (N // config.forward.cta_n), mosaic_utils.num_sms(),
                             K // config.forward.tile_k, 4) is not None
    x, g, w, res = inputs(M, K, N, jnp.bfloat16, residual=residual)
    _Mosaic().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, residual", [
    (4096, 4096, 4096, jnp.bfloat16, False), (2048, 1024, 4096, jnp.float16, False),
    (4352, 2048, 2048, jnp.bfloat16, True), (1024, 256, 4096, jnp.bfloat16, False)])  # 4 steps: lag over tiles
@pytest.mark.parametrize("delay_release", [0, 1])
def test_statistics_from_the_memory_warpgroup_on_the_gpu(M, K, N, dtype, residual, delay_release):
    """r summed by the memory warpgroup between its loads (prologue_in "memory"), stacked 64x256 tiles."""
    base = nm_config.mosaic_default_config(M, K, N, dtype, residual=residual)
    forward = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", prologue_in="memory",
                               delay_release=delay_release)
    config = dataclasses.replace(base, forward=forward, stats_in_kernel=True, gamma_on="w")
    x, g, w, res = inputs(M, K, N, dtype, residual=residual)
    _Mosaic().check_against_reference(x, g, w, res, tolerance(dtype, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, residual, dx", [
    (4096, 4096, 4096, jnp.bfloat16, False, _DYR_DX),  # 32 x 16 dx tiles: every column block writes 4 of 64 steps
    (4352, 2048, 2048, jnp.bfloat16, True, None),  # the residual's dx tiles (128x64, both warpgroups on all rows)
    (4352, 2048, 4096, jnp.bfloat16, False, dataclasses.replace(_DYR_DX, stream_k=4)),  # 34 x 8 dx tiles: stream-K
    (2048, 1024, 4096, jnp.float16, False, _DYR_DX)])  # dyr = (r / max r) ⊙ dy; 4 column blocks of 64 steps
def test_dyr_from_the_dx_kernel_on_the_gpu(M, K, N, dtype, residual, dx):
    config = nm_config.mosaic_default_config(M, K, N, dtype, residual=residual)
    config = dataclasses.replace(config, row_dot="n", dyr_in_dx=True, gamma_on="w", dx=dx or config.dx)
    x, g, w, res = inputs(M, K, N, dtype, residual=residual)
    _Mosaic().check_against_reference(x, g, w, res, tolerance(dtype, max(M, K, N)), block_sizes=config)


@pytest.mark.parametrize("flag, changes, match", [
    ("dx_in_kernel", dict(row_dot="n"), "dx_in_kernel: must be a bool; True .* needs row_dot='k', .* got "
                                        "dx_in_kernel=True, row_dot='n'"),
    ("dx_in_kernel", dict(dgamma_from="u"), "dgamma_from='u'"),
    ("dx_in_kernel", dict(dx=MosaicGemmConfig(stream_k=4)), "stream_k=4"),
    ("dx_in_kernel", dict(dx=MosaicGemmConfig(schedule="pingpong")), "schedule='pingpong'"),
    ("dx_in_kernel", dict(dx_in_kernel="yes"), "dx_in_kernel: must be a bool"),
    ("xr_in_dx", dict(row_dot="n"), "xr_in_dx: .* needs row_dot='k'"),
    ("xr_in_dx", dict(dyr_in_dx=True), "dyr_in_dx not True"),
    ("xr_in_dx", dict(xr_in_dx="yes"), "xr_in_dx: must be a bool"),
    ("dw_finish_kernel", dict(dgamma_from="u"), "dw_finish_kernel: .* not dgamma_from='u'"),
    ("dw_finish_kernel", dict(dw_finish_kernel=1), "dw_finish_kernel: must be a bool")])
def test_the_dx_kernels_k_side_forms_are_bools_with_their_constraints(flag, changes, match):
    """dx_in_kernel needs the K side and whole cooperative dx tiles; xr_in_dx the K side and no dyr;
    dw_finish_kernel dgamma from dw's side. All are stored in the tuned entries' dicts."""
    tiles = MosaicGemmConfig()
    with pytest.raises(ValueError, match=match):
        Config(**dict(dict(forward=tiles, dx=tiles, dw=tiles, row_dot="k", **{flag: True}), **changes))
    config = Config(forward=tiles, dx=tiles, dw=tiles, **{flag: True})  # (row_dot None: the K side)
    assert Config(**config.to_dict()) == config and config.to_dict()[flag] is True


@pytest.mark.parametrize("a_operand, unit_scale, rows", [
    ("xr", True, ("dyr_scale",)), ("dyr", True, ("dyr_scale",)), ("dyr_by_xla", True, ("dx_x_coef",)),
    ("xr", False, ("dx_u_scale", "dx_x_coef", "dyr_scale")), ("dyr_by_xla", False, ("dx_u_scale", "dx_x_coef"))])
def test_the_dx_finish_takes_only_the_row_vectors_it_needs(a_operand, unit_scale, rows):
    """dx_in_kernel's (M,) float32 inputs: with s = 1 (bfloat16) no unit scale a, and where A is dy the coefficient
    b comes from r in the kernel, so no XLA kernel makes either (measured: toggle_ab_dx_unit_scale-h200-7590466)."""
    M, K, N = 2048, 1024, 768
    cfg = MosaicGemmConfig(tile_m=128, tile_n=128)
    operand = {"xr": dict(xr=jax.ShapeDtypeStruct((M, K), jnp.bfloat16)),
               "dyr": dict(dyr=jax.ShapeDtypeStruct((M, N), jnp.bfloat16)), "dyr_by_xla": {}}[a_operand]
    fusion = nm._dx_partial_fusion(M, K, cfg, True, in_kernel=True, unit_scale=unit_scale, **operand)
    assert fusion.inputs == (*rows, "gamma")


@cpu_only
@pytest.mark.parametrize("M, K, N, xr", [(8192, 512, 2816, True), (8192, 512, 768, False)])
def test_xr_from_the_forwards_sums_leaves_no_rsqrt_to_xla(M, K, N, xr):
    """At the H200 entries of 8192x512x2816 (xr from the dx kernel) and 8192x512x768 (dyr from its K loop), with r
    from XLA's sums in the forward (bfloat16), the dx kernel forms r from the forward's sums of squares itself: the
    lowered program has no rsqrt outside the kernels (taking r instead, XLA formed it in a kernel of its own)."""
    entry = Config(**tuning.lookup("rmsnorm_matmul", nm_config.shape_key(M, K, N, jnp.bfloat16), backend="mosaic",
                                   device="NVIDIA H200"))
    assert entry.xr_in_dx == xr and entry.dyr_in_dx != xr and not entry.stats_in_kernel
    fn, args = _fwd_bwd(M, K, N, False, entry)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.rsqrt" not in program


@cpu_only
@pytest.mark.parametrize("M, K, N", [(8192, 512, 2816), (32768, 4096, 4096), (16384, 1024, 5504)])
def test_a_bfloat16_gamma_reaches_the_kernels_unconverted(M, K, N):
    """The dx kernel reads gamma's column slices and the dw kernel its rows in gamma's own dtype, converting as they
    load them: at the H200 entries the lowered forward and backward convert gamma to float32 only in the forward's
    x ⊙ gamma (gamma on x: inside XLA's pass over x, no kernel of its own)."""
    entry = Config(**tuning.lookup("rmsnorm_matmul", nm_config.shape_key(M, K, N, jnp.bfloat16), backend="mosaic",
                                   device="NVIDIA H200"))
    fn, args = _fwd_bwd(M, K, N, False, entry)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert program.count(f"(tensor<{K}xbf16>) -> tensor<{K}xf32>") == (entry.gamma_on == "x")


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("a_copy", ["xr", "dyr"])
def test_xr_with_r_from_the_sums_in_interpret_mode(residual, a_copy):
    """xr (or dyr) from the dx kernel with r formed there from the forward's sums (bfloat16, gamma on x, r from
    XLA): forward and gradients against the float32 reference (in interpret mode XLA finishes dx from u)."""
    tiles = _Interpreted.tiles
    config = Config(forward=tiles, dx=tiles, dw=tiles, gamma_on="x", row_dot="k", xr_in_dx=a_copy == "xr",
                    dyr_in_dx=a_copy == "dyr" or None, dw_in_xla=False)
    x, g, w, res = inputs(128, 128, 256, jnp.bfloat16, residual=residual)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _Interpreted().check_against_reference(x, g, w, res, tolerance(jnp.bfloat16), block_sizes=config)


@cpu_only
@pytest.mark.parametrize("dw_operand", ["xr", "dyr", "dyr_by_xla"])
def test_dx_from_the_dx_kernel_leaves_no_xla_pass_over_u(dw_operand):
    """dx_in_kernel in the CUDA lowering at the H200 entry of 16384x1024x5504 (the K side, gamma on x), beside each
    of the dw GEMM's operands (xr from the dx kernel, the entry's; dyr from it; dyr from XLA): the dx kernel counts
    its part among its row block's 4 column blocks and writes dx itself, so no XLA op reads an (M, K) tensor after
    it except to return it; without, XLA's finish reads u and x. With a residual, XLA's finish as before."""
    M, K, N = 16384, 1024, 5504
    entries = tuning.load_cache()["entries"]["NVIDIA H200"]["mosaic"]["rmsnorm_matmul"]
    entry = Config(**entries[nm_config.shape_key(M, K, N, jnp.bfloat16)]["params"])
    entry = dataclasses.replace(entry, xr_in_dx=dw_operand == "xr",
                                dyr_in_dx={"xr": None, "dyr": True, "dyr_by_xla": False}[dw_operand])

    def lowered(config, residual=False):
        fn, args = _fwd_bwd(M, K, N, residual=residual, config=config)
        with backends.lowering_for_gpu():
            program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            dx = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}["rmsnorm_matmul_dx"]
        finish = [line for line in program.splitlines() if "stablehlo.subtract" in line and f"tensor<{M}x{K}x" in line]
        return finish, dx

    finish, dx = lowered(dataclasses.replace(entry, dx_in_kernel=True))
    assert not finish and dx.text.count("red.release.gpu.global.add.u32") == 1  # (gemm.mosaic._sum_row_parts)
    finish, dx = lowered(dataclasses.replace(entry, dx_in_kernel=False))
    assert finish and "red.release.gpu.global.add" not in dx.text
    finish, dx = lowered(dataclasses.replace(entry, dx_in_kernel=True), residual=True)
    assert finish and "red.release.gpu.global.add" not in dx.text


def _mosaic_calls(program: str) -> list[tuple[str, list[str], list[str]]]:
    """(name, operands, result types) of each Mosaic-GPU custom call in a lowered StableHLO program, in program
    order: its results' SSA name ("%23"), its operands' ("%arg3" for an argument, "%23#1" for another call's second
    result) and its results' tensor types."""
    calls = []
    for line in program.splitlines():
        if "stablehlo.custom_call @mosaic_gpu" in line:
            name = line.split("=", 1)[0].strip().split(":")[0]  # "%23:4" -> "%23"
            operands = line.split("(", 1)[1].split(")", 1)[0].split(", ")
            calls.append((name, operands, line.rsplit(" -> ", 1)[1].strip("() ").split(", ")))
    return calls


@cpu_only
@pytest.mark.parametrize("M, K, N, xr_in_dx", [(16384, 1024, 5504, True), (16384, 1024, 5504, False),
                                              (32768, 4096, 4096, True), (8192, 4096, 6144, True),
                                              (4096, 4096, 14336, True)])
def test_xr_from_the_dx_kernel_feeds_the_dw_kernel_with_dy(M, K, N, xr_in_dx):
    """xr_in_dx in the CUDA lowering at the H200 entries that take it (the MLP's 16384x1024x5504 since the
    forty-fourth session, the three large suite shapes since the fiftieth): the dx kernel returns dx and xr, both
    (M, K), and no (M, N) tensor; the dw kernel reads that xr and dy itself (the program's argument); every kernel
    fits shared memory. With dyr from the dx kernel instead, the dx kernel returns an (M, N) dyr, which the dw kernel
    reads."""
    entries = tuning.load_cache()["entries"]["NVIDIA H200"]["mosaic"]["rmsnorm_matmul"]
    entry = Config(**entries[nm_config.shape_key(M, K, N, jnp.bfloat16)]["params"])
    assert entry.xr_in_dx and entry.dx_in_kernel
    config = entry if xr_in_dx else dataclasses.replace(entry, xr_in_dx=False, dyr_in_dx=True)
    fn, args = _fwd_bwd(M, K, N, residual=False, config=config)
    with backends.lowering_for_gpu():
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        kernels = mosaic_ir.lower_kernels(fn, *args)
    assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels), [(k.name, k.smem_bytes) for k in kernels]
    _, (dx_name, dx_operands, dx_results), (_, dw_operands, _) = _mosaic_calls(program)  # forward, dx, dw
    dy = dx_operands[0]
    assert dy.startswith("%arg")  # A of the dx kernel: dy as it came in
    if xr_in_dx:
        assert dx_results[:2] == [f"tensor<{M}x{K}xbf16>"] * 2
        assert N == K or f"tensor<{M}x{N}xbf16>" not in dx_results  # (with N == K, dx and xr have dyr's shape)
        assert dw_operands[:2] == [f"{dx_name}#1", dy]
    else:
        assert dx_results[:2] == [f"tensor<{M}x{K}xbf16>", f"tensor<{M}x{N}xbf16>"]
        assert dw_operands[1] == f"{dx_name}#1"


@cpu_only
def test_the_dx_kernels_epilogue_parts_are_profiler_regions(monkeypatch):
    """Under ``mosaic_utils.profiling`` with the epilogue's parts named, the dx kernel of the H200 entry at
    8192x512x2816 (x tile through the ring, dx finished in the kernel, xr copied) records each once in its program
    text: its tile input's wait, the row sum's wait and the two stores' waits (xr's before dx takes the buffer, dx's
    before the ring slot is released), beside Init; two shared-memory records per region. (Lowered for CUDA; the
    trace's host callback, which a CPU backend cannot lower, replaced by a no-op.)"""
    monkeypatch.setattr(jax.debug, "callback", lambda *args, **kwargs: None)
    M, K, N = 8192, 512, 2816
    entries = tuning.load_cache()["entries"]["NVIDIA H200"]["mosaic"]["rmsnorm_matmul"]
    config = Config(**entries[nm_config.shape_key(M, K, N, jnp.bfloat16)]["params"])
    assert config.xr_in_dx and config.dx_in_kernel and config.dx.tile_input_in == "ring"
    fn, args = _fwd_bwd(M, K, N, residual=False, config=config)
    jax.clear_caches()
    with backends.lowering_for_gpu(), mosaic_utils.profiling("/tmp/traces", ranges=16,
                                                            regions=("tile_inputs", "sum_rows", "store_wait")):
        dx = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}["rmsnorm_matmul_dx"]
    assert dx.text.count("st.shared.v2.u32") == 2 * (1 + 1 + 1 + 2)


@cpu_only
@pytest.mark.slow
def test_xr_from_the_dx_kernel_in_interpret_mode():
    """xr_in_dx with float16 (xr = (r / max r) ⊙ x), gamma on w and a residual (XLA's finish from x): the three
    kernels against the reference; dw and dgamma come from xr and dy alone. (A wrong xr fails dgamma and dw.)"""
    tiles = _Interpreted.tiles
    config = Config(forward=tiles, dx=tiles, dw=tiles, gamma_on="w", row_dot="k", xr_in_dx=True)
    x, g, w, res = inputs(128, 128, 256, jnp.float16, residual=True)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        _Interpreted().check_against_reference(x, g, w, res, tolerance(jnp.float16), block_sizes=config)


def _dx_epilogue_apart(M: int, K: int, N: int) -> Config:
    """The H200 entry at a suite shape with its dx kernel's epilogue in a fourth warpgroup (the x tile's slices
    loaded there instead of through the ring; 3 stages beside the accumulators' buffer; 128x128 accumulators side
    by side: ptxas compiles four warpgroups for 128 registers, too few for a m64n256 wgmma)."""
    entry = Config(**tuning.lookup("rmsnorm_matmul", nm_config.shape_key(M, K, N, jnp.bfloat16), backend="mosaic",
                                   device="NVIDIA H200"))
    return dataclasses.replace(entry, dx=dataclasses.replace(entry.dx, epilogue_in="fourth", tile_input_in="buffer",
                                                             num_stages=3, tile_m=128, tile_n=128, wg_split="n"))


@cpu_only
@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (8192, 4096, 6144)])
def test_the_dx_epilogue_apart_lowers_within_shared_memory(M, K, N):
    """The dx kernel with its epilogue in a fourth warpgroup (xr and dx from it, the row sum over the row's
    tiles): four warpgroups, within shared memory, xr and dx its (M, K) outputs; the other kernels as the entry's."""
    config = _dx_epilogue_apart(M, K, N)
    fn, args = _fwd_bwd(M, K, N, False, config)
    with backends.lowering_for_gpu():
        kernels = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    dx = kernels["rmsnorm_matmul_dx"]
    assert dx.threads == 512 and dx.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert (kernels["rmsnorm_matmul_fwd"].threads, kernels["rmsnorm_matmul_dw"].threads) == (384, 384)
    _, (_, _, dx_results), _ = _mosaic_calls(program)
    assert dx_results[:2] == [f"tensor<{M}x{K}xbf16>"] * 2


@gpu_only
@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (8192, 4096, 6144)])
def test_the_dx_epilogue_apart_on_the_gpu(M, K, N):
    """Forward and gradients with the dx kernel's epilogue in a fourth warpgroup, against the float32 reference,
    two calls on fresh inputs (the row sums' counts start each at zero)."""
    config = _dx_epilogue_apart(M, K, N)
    for _ in range(2):
        x, g, w, _ = inputs(M, K, N, jnp.bfloat16, residual=False)
        _Mosaic().check_against_reference(x, g, w, None, tolerance(jnp.bfloat16, max(M, K, N)), block_sizes=config)


_XR_CASES = [  # (M, K, N, dtype, variant (None: the device's entry), row_dot, dx_in_kernel)
    (16384, 1024, 5504, jnp.bfloat16, None, None, True),  # the H200 entry: gamma on x, 4 column blocks
    (32768, 4096, 4096, jnp.bfloat16, None, None, True),  # gamma in the registers, the x tile through the ring
    (4096, 4096, 14336, jnp.bfloat16, "gamma_on_a", "k_dgu", False),  # dgamma from u (the finish kernel)
    (4096, 2048, 11008, jnp.bfloat16, "gamma_on_x", "k", True),  # 8 column blocks
    (2048, 1024, 4096, jnp.float16, False, "k", True),  # xr = (r / max r) ⊙ x, gamma on w
    (2048, 2048, 8192, jnp.bfloat16, "gamma_on_x", "k", False)]  # XLA's finish from x


def _xr_config(M, K, N, dtype, variant, row_dot, dx_in_kernel, residual):
    """A case of ``_XR_CASES``: its variant's config with xr written by the dx kernel (and dx finished there);
    None where the case is this device's entry and the config refuses the form on it (the H100's entry at 32768
    takes its row dot on the N side)."""
    config = _case_config(M, K, N, dtype, variant, row_dot, residual)
    return _entry_form(variant is None, config, xr_in_dx=True, dyr_in_dx=None, dx_in_kernel=dx_in_kernel,
                       dx=dataclasses.replace(config.dx, stream_k=0) if dx_in_kernel else config.dx)


def _case_config(M, K, N, dtype, variant, row_dot, residual):
    """This device's config of the shape (variant None: its tuned entry) or ``_numbers_config``'s variant."""
    if variant is None:
        return nm_config.mosaic_default_config(M, K, N, dtype, residual=residual)
    return _numbers_config(M, K, N, dtype, residual, variant, row_dot)


def _entry_form(of_entry: bool, config, **form):
    """config with ``form``'s fields; where config is this device's tuned entry (``of_entry``) and the config
    refuses the form on it, None (the case is skipped there: it names another device's entry)."""
    try:
        return dataclasses.replace(config, **form)
    except ValueError:
        if of_entry:
            return None
        raise


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, variant, row_dot, dx_in_kernel", _XR_CASES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_xr_from_the_dx_kernel_on_the_gpu(M, K, N, dtype, variant, row_dot, dx_in_kernel, residual):
    """xr_in_dx: forward and gradients against the float32 reference, two calls, with the dx kernel finishing dx
    (from xr in the x tile's buffer) or XLA (from x), with a residual (XLA's finish)."""
    config = _xr_config(M, K, N, dtype, variant, row_dot, dx_in_kernel, residual)
    if config is None:
        pytest.skip("this device's tuned entry cannot take the xr form (the case names the H200's)")
    for _ in range(2):
        x, g, w, res = inputs(M, K, N, dtype, residual=residual)
        _Mosaic().check_against_reference(x, g, w, res, tolerance(dtype, max(M, K, N)), block_sizes=config)


_DX_CASES = [  # (M, K, N, dtype, variant (None: the device's entry), row_dot)
    (16384, 1024, 5504, jnp.bfloat16, None, None),  # the H200 entry (gamma on x, dyr from dx): 4 column blocks
    (8192, 512, 2816, jnp.bfloat16, None, None),  # the H200 entry: 2 column blocks
    (4096, 2048, 11008, jnp.bfloat16, "gamma_on_x", "k_dyr"),  # 8 column blocks: row blocks across rounds
    (2048, 1024, 4096, jnp.float16, False, "k_dyr"),  # dyr = (r / max r) ⊙ dy, gamma on w
    (2048, 2048, 8192, jnp.bfloat16, "gamma_on_x", "k")]  # A = dyr from XLA


def _dx_config(M, K, N, dtype, variant, row_dot, residual):
    """A case of ``_DX_CASES``: its variant's config with dx finished by the dx kernel; None where the case is this
    device's entry and the config refuses the form on it (the H100's entry at 8192x512x2816 has ping-pong dx
    tiles)."""
    config = _case_config(M, K, N, dtype, variant, row_dot, residual)
    return _entry_form(variant is None, config, dx_in_kernel=True, dx=dataclasses.replace(config.dx, stream_k=0))


@gpu_only
@pytest.mark.parametrize("M, K, N, dtype, variant, row_dot", _DX_CASES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_dx_from_the_dx_kernel_on_the_gpu(M, K, N, dtype, variant, row_dot, residual):
    """dx_in_kernel: the dx kernel sums its row dot over each row's tiles and writes dx (with a residual, XLA's
    finish): forward and gradients against the float32 reference, two calls (the counts end each at zero)."""
    config = _dx_config(M, K, N, dtype, variant, row_dot, residual)
    if config is None:
        pytest.skip("this device's tuned entry cannot take dx from the dx kernel (the case names the H200's)")
    for _ in range(2):
        x, g, w, res = inputs(M, K, N, dtype, residual=residual)
        _Mosaic().check_against_reference(x, g, w, res, tolerance(dtype, max(M, K, N)), block_sizes=config)


@gpu_only
@pytest.mark.parametrize("dtype, scale", [(jnp.bfloat16, 1e3), (jnp.float16, 30.0)])
def test_large_magnitudes_on_the_gpu(dtype, scale):
    x, g, w, _ = inputs(512, 1024, 768, dtype)
    _Mosaic().check_against_reference((x.astype(jnp.float32) * scale).astype(dtype), g, w, None, tolerance(dtype))


@gpu_only
def test_nan_never_passes():
    x, gamma, w, _ = inputs(512, 512, 512, jnp.bfloat16)
    y = jax.jit(lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic"))(
        x.at[7, 3].set(jnp.nan), gamma, w)
    assert bool(jnp.all(jnp.isnan(y[7]))) and not bool(jnp.any(jnp.isnan(jnp.delete(y, 7, axis=0))))


@cpu_only
@pytest.mark.slow
@pytest.mark.parametrize("dtype, residual, stats_in_kernel, dw_in_xla, row_dot", [  # each form at least once,
    # both dtypes, residuals and dw's GEMM in XLA beside several (CI time: about 11 s a case on 2 cores)
    (jnp.float16, False, True, False, "n"), (jnp.bfloat16, True, "mma", False, "k"),
    (jnp.float16, False, False, True, "n"),
    (jnp.float16, True, False, True, "n_dyr"), (jnp.bfloat16, True, "gamma_on_x", False, "n_dyr"),
    (jnp.bfloat16, False, "gamma_on_a", False, "n"), (jnp.bfloat16, True, "gamma_on_a_mma", False, "k"),
    (jnp.bfloat16, False, "gamma_on_a_mma_rows", False, "n"),
    (jnp.bfloat16, True, "mma_shared", False, "n"), (jnp.bfloat16, False, "gamma_on_a_mma_shared", False, "k"),
    (jnp.bfloat16, False, "gamma_on_a_mma_shared", False, "n_dyr_dx"),
    (jnp.bfloat16, True, False, False, "n_dx_prefetch"), (jnp.bfloat16, True, "gamma_on_x", False, "k_dyr"),
    (jnp.bfloat16, False, "gamma_on_a_mma", False, "k_dyr_dgu"),
    (jnp.bfloat16, False, "gamma_on_x", True, "k_dgu")])
def test_forward_and_gradients_in_interpret_mode(dtype, residual, stats_in_kernel, dw_in_xla, row_dot):
    """The three kernels (or dw's GEMM in XLA) against the reference; float16 also checks the scale s of dyr;
    "gamma_on_x": x ⊙ gamma as the forward's A operand, gamma on dx's columns; both sides of the row dot; "mma": r
    from the MMA warpgroups' squares of the x blocks they load (stacked tiles: each warpgroup its own rows);
    "gamma_on_a": x ⊙ gamma formed in the MMA warpgroups' registers, wgmma reading A from there ("_mma": r from the
    x blocks loaded again after each wgmma's issue; "_operand": from those registers); "mma_rows": those squares
    summed per row at each step;
    "mma_shared": r from the squares of each row block's first tile only (in interpret mode, without semaphores,
    every tile sums its own); "n_dyr" / "k_dyr": dyr from the dx kernel (``dyr_in_dx``; stacked dx tiles without
    the residual); "n_dx": Σ_N(dy · y) from the dx kernel (``row_dot_in_dx``; "n_dyr_dx" with dyr from it too;
    "n_dx_prefetch" each y block loaded a step ahead; y by TMA: test_the_row_dot_by_tma_in_interpret_mode); "_dgu":
    dgamma from u (``dgamma_from="u"``: the dw kernel without its w tile, or dw's GEMM in XLA)."""
    tiles = _Interpreted.tiles
    stats, gamma_on = _variant_fields(stats_in_kernel)
    forward = dataclasses.replace(tiles, wg_split="m", delay_release=1) if stats in nm_config.MMA_STATS \
        or gamma_on == "a" else tiles
    dyr_in_dx = row_dot[1:].startswith("_dyr")
    dx = dataclasses.replace(tiles, wg_split="m") if dyr_in_dx and not residual else tiles
    config = Config(forward=forward, dx=dx, dw=tiles, stats_in_kernel=stats, dw_in_xla=dw_in_xla,
                    dw_finish_kernel=dw_in_xla and residual,  # (one of each: dw and dgamma by norm_matmul.dw_finish)
                    gamma_on=gamma_on, row_dot=row_dot[:1], dyr_in_dx=dyr_in_dx,
                    row_dot_in_dx="prefetch" if row_dot.endswith("_prefetch") else row_dot.endswith("_dx"),
                    dgamma_from="u" if row_dot.endswith("_dgu") else None,
                    squares_from=_squares_from(stats_in_kernel))
    x, g, w, res = inputs(128, 128, 256, dtype, residual=residual)
    with mosaic_utils.interpret_on_cpu(num_sms=2):  # 2 blocks walk 2-4 output tiles each
        _Interpreted().check_against_reference(x, g, w, res, tolerance(dtype), block_sizes=config)


@cpu_only
@pytest.mark.slow
def test_the_row_dot_by_tma_in_interpret_mode():
    """row_dot_in_dx="tma" (y's blocks beside dy's, the x tile through the dx kernel's B stages), with gamma and r
    in the forward's registers and dyr from the dx kernel (the 8192x4096x6144 H200 entry's form): forward and
    gradients against the float32 reference. Called op by op: jax's GPU
    interpreter hung inside one jit of forward and backward with those B stages and the row dot or dyr's copy on
    this 2-core machine, where each kernel called alone finishes (with a residual the row dot is XLA's: on the GPU,
    test_the_row_dot_from_the_dx_kernel_on_the_gpu)."""
    tiles, dtype = _Interpreted.tiles, jnp.bfloat16
    forward = dataclasses.replace(tiles, wg_split="m", delay_release=1)
    dx = dataclasses.replace(tiles, wg_split="m", tile_k=tiles.tile_m, tile_input_in="ring")
    config = Config(forward=forward, dx=dx, dw=tiles, stats_in_kernel="mma_shared", dw_in_xla=False, gamma_on="a",
                    row_dot="n", dyr_in_dx=True, row_dot_in_dx="tma")
    assert config.row_dot_by_dx(dtype, False) == "tma"
    x, g, w, _ = inputs(128, 128, 256, dtype)
    dy = normal((128, 256), dtype)
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        got, vjp = jax.vjp(lambda x, g, w: nm.rmsnorm_matmul(x, g, w, eps=1e-6, residual=None, out_dtype=dtype,
                                                             interpret=False, config=config), x, g, w)
        got_grads = vjp(dy)
    want, ref_vjp = jax.vjp(lambda x, g, w: reference.rmsnorm_matmul(x, g, w), x, g, w)
    for name, a, b in zip(("y", "dx", "dgamma", "dw"), (got, *got_grads), (want, *ref_vjp(dy))):
        assert_close(a, b.astype(jnp.float32), tolerance(dtype), name)


@cpu_only
@pytest.mark.slow
def test_float16_near_1e_6_in_interpret_mode():
    """The shared test of float16 x at 1e-6 and 1e-7 (as accurate as the unfused computation), which runs on the GPU
    for ``TestMosaic``: the A operand is x itself (measured 3.7e-4 / 3.9e-4 relative error in y at 128x256x256,
    unfused fp16 3.5e-4 / 4.1e-4)."""
    with mosaic_utils.interpret_on_cpu(num_sms=2):
        for scale in (1e-6, 1e-7):
            _Interpreted().test_float16_near_1e_6_is_as_accurate_as_the_unfused_computation(scale)


def test_one_row_keeps_its_own_tuning_key():
    """One row's Mosaic forward is a GEMV of its own form: its entries (and times) are not those of 2-16 rows."""
    assert nm_config.shape_key(1, 4096, 14336, jnp.bfloat16) == "bfloat16[M=1,K=4096,N=14336]"
    assert nm_config.shape_key(2, 4096, 14336, jnp.bfloat16) == "bfloat16[M=16,K=4096,N=14336]"
    assert nm_config.shape_key(17, 4096, 14336, jnp.bfloat16, residual=True) == "bfloat16[M=32,K=4096,N=14336]+res"


def test_the_h200_one_row_entries_choose_triton_where_gemv_tiles_are_few():
    """Both backends are tuned at 1x4096x4096 on the H200 (rmsnorm_matmul-sweep_one_row-h200-f3e2adb-log.txt), where
    64 GEMV tiles leave half the SMs idle, so "auto" takes Triton's lower forward + backward time there; at
    1x4096x14336 only Triton is tuned (its one-row sweep), so "auto" takes Mosaic, first in the registry, with the
    built-in 128-row tiles (``config.one_row_forward``: a sweep at one buffer placement does not rank its tiles)."""
    key = nm_config.shape_key(1, 4096, 4096, jnp.bfloat16)
    times = {b: tuning.tuned_time_us("rmsnorm_matmul", key, backend=b, device="NVIDIA H200")
             for b in ("mosaic", "triton")}
    assert None not in times.values() and min(times, key=times.get) == "triton", times
    params = tuning.lookup("rmsnorm_matmul", key, backend="mosaic", device="NVIDIA H200")
    assert Config(**params).unsupported_reason(1, 4096, 4096) is None
    key = nm_config.shape_key(1, 4096, 14336, jnp.bfloat16)
    assert tuning.tuned_time_us("rmsnorm_matmul", key, backend="triton", device="NVIDIA H200") is not None
    assert tuning.lookup("rmsnorm_matmul", key, backend="mosaic", device="NVIDIA H200") is None


@pytest.mark.parametrize("K, N, tile_m, parts", [
    (4096, 14336, 128, 1), (8192, 28672, 64, 1), (2048, 8192, 64, 1), (4096, 4096, 64, 2), (1024, 2816, 64, 2),
    (4096, 2048, 64, 4), (4096, 12672, 128, 1), (4096, 12544, 64, 1)])
def test_one_row_tiles_are_128_rows_where_they_make_one_round_filling_most_sms(K, N, tile_m, parts):
    """128-row tiles where they make one round of at least 3/4 of the SMs (12672 / 128 = 99 = 3/4 of 132), else
    64 rows, their K loop in parts where their N / 64 tiles fill at most half the SMs (``gemm.gemv_config``)."""
    forward = nm_config.one_row_forward(K, N)
    assert (forward.tile_m, forward.k_parts) == (tile_m, parts)
    assert nm_config.one_row_reason(K, N, forward) is None


@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144)])
def test_the_h100_entries_of_the_suite_shapes_write_dyr_from_the_dx_kernel(M, K, N):
    """Their row dot is on the N side and their dx tiles leave room for the copy: the measured default."""
    entries = tuning.load_cache()["entries"]["NVIDIA H100 80GB HBM3"]["mosaic"]["rmsnorm_matmul"]
    config = Config(**entries[nm_config.shape_key(M, K, N, jnp.bfloat16)]["params"])
    assert config.row_dot_side() == "n" and config.dyr_by_dx(jnp.bfloat16, residual=False)


@cpu_only
@pytest.mark.parametrize("M, K, N", [(32768, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 6144)])
def test_the_h200_entries_of_the_suite_shapes_run_the_forward_as_one_kernel(M, K, N):
    """The H200's own entries (rmsnorm_matmul_configs_{stream_k_shared,stream_k_shared_fwd_bwd,shared_r}-h200-
    1bb672a.json): gamma in the
    MMA warpgroups' registers and r from each row block's first tile, so the forward is one kernel and XLA makes no
    (M, K) tensor and reads no (K, N) one for w_γ; at 32768x4096x4096 its last round of tiles is cut by K steps."""
    params = tuning.lookup("rmsnorm_matmul", nm_config.shape_key(M, K, N, jnp.bfloat16), backend="mosaic",
                           device="NVIDIA H200")
    config = Config(**params)
    assert (config.gamma_on, config.stats_in_kernel) == ("a", "mma_shared")
    # r's squares from the a_operand's registers (..._squares_operand_entry-h200-f0be594.json,
    # ..._squares_operand_32768_run{1,2}-h200-e9e205c.json: faster forwards on the entries as they are)
    assert config.squares_from == "operand"
    # the output's right half leaves under the next tile's first wgmma (rmsnorm_matmul_configs_split{,_entry}-h200-
    # {8c7f73e,73cba3c}.json). ptxas serializes that form's wgmma where the kernel has no stream-K phase
    # (mosaic_ptxas_registers_split-h200-8c7f73e.json); the other two take one with their last round's tiles whole
    # (stream_k=1: rmsnorm_matmul_configs_split_sk1{,_6144}-h200-{0359f79,6e6c1cd}.json, 606.9 against 612.4 µs
    # at 4096x4096x14336, 523.3 against 524.2 and 521.1 against 523.3 at 8192x4096x6144)
    assert (config.forward.epilogue_store, config.forward.stream_k) == ("split", 4 if M == 32768 else 1)
    assert (config.dw.tile_input_in, config.dw.num_stages) == ("ring", 4)  # ..._dw_ring-h200-98795b6
    # the dx kernel's x tile through the ring (a fourth stage in its buffer's room; rmsnorm_matmul_configs_ring_
    # stream_k_32768-h200-6ed694e.json: the dx kernel 1450.2 against 1462.1 µs at 32768x4096x4096), on the K side
    # (32768x4096x4096 since the forty-third session: rmsnorm_matmul_configs_k_dx_in_kernel_one_phase-h200-
    # 181f0ee.json), the dx kernel finishing dx over whole tiles and writing xr for the dw GEMM, dgamma from the dw
    # kernel's w tile (all three since the fiftieth session: ..._xr_in_dx_snake{,_repeat}-h200-d431860.json,
    # ..._k_xr_ring4_6144-h200-0f72617.json, ..._k_xr_14336-h200-fb24c05.json); at 32768x4096x4096 the dx kernel's
    # epilogue in a fourth warpgroup, on 128x128 accumulators side by side at 3 stages, its slices 32 columns wide
    # (since the fifty-first session: rmsnorm_matmul_configs_dx_epilogue_apart_{e32,shapes}-h200-c7b77b4.json)
    if M == 32768:
        assert (config.dx.epilogue_in, config.dx.tile_input_in, config.dx.num_stages, config.dx.epi_tile_n,
                config.dx.tile_m, config.dx.tile_n, config.dx.wg_split) == ("fourth", "buffer", 3, 32, 128, 128, "n")
    else:
        assert (config.dx.epilogue_in, config.dx.tile_input_in, config.dx.num_stages) == ("mma", "ring", 4)
    assert config.dx.stream_k == 0
    assert (config.row_dot, config.xr_in_dx, config.dx_in_kernel, config.dgamma_from) == ("k", True, True, None)
    args = (S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16))
    fn = lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=config)  # noqa: E731
    with backends.lowering_for_gpu():
        (kernel,) = mosaic_ir.lower_kernels(fn, *args)
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert kernel.smem_bytes <= mosaic_utils.H100_SMEM_BYTES
    assert _mk_producers(program, M, K) == [] and _mk_producers(program, K, N) == []


@cpu_only
def test_dgamma_from_u_at_4096x4096x14336_finishes_dx_and_dgamma_in_one_pass_over_u_and_x():
    """The backward with dgamma from u (the H200's entry there until the fiftieth session: dyr from the dx kernel,
    the x tile in a buffer of its own): the Mosaic dx and dw kernels, the dw kernel with no tile input, and one
    Pallas-Triton kernel finishing dx and summing dgamma's parts; no XLA op makes an (M, N), (M, K) or (K, N)
    tensor of bf16 (u and dx come out of kernels; XLA only sums the small row-dot and dgamma parts)."""
    M, K, N = 4096, 4096, 14336
    entry = Config(**tuning.lookup("rmsnorm_matmul", nm_config.shape_key(M, K, N, jnp.bfloat16), backend="mosaic",
                                   device="NVIDIA H200"))
    config = dataclasses.replace(entry, dgamma_from="u", dx_in_kernel=False, xr_in_dx=False, dyr_in_dx=True,
                                 dx=dataclasses.replace(entry.dx, tile_input_in="buffer", num_stages=3),
                                 dw=dataclasses.replace(entry.dw, tile_input_in="buffer"))
    fn, args = _fwd_bwd(M, K, N, False, config)
    with backends.lowering_for_gpu():
        kernels = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels.values())
    assert "rmsnorm_matmul_dx_finish" in program
    assert [_mk_producers(program, *dims, "bf16") for dims in ((M, N), (M, K), (K, N))] == [[], [], []]
    fn, args = _fwd_bwd(M, K, N, False, dataclasses.replace(config, dgamma_from="dw", dw=dataclasses.replace(
        config.dw, tile_input_in="ring")))  # the same form with dgamma from the dw kernel: w through its ring
    with backends.lowering_for_gpu():
        dw_with_w = {k.name: k for k in mosaic_ir.lower_kernels(fn, *args)}["rmsnorm_matmul_dw"]
    assert kernels["rmsnorm_matmul_dw"].tma_loads() < dw_with_w.tma_loads()


@cpu_only
@pytest.mark.parametrize("M, K, N", [(4096, 2048, 11008), (8192, 512, 2816), (8192, 512, 768), (4096, 2048, 3072)])
def test_the_h200_entries_of_the_model_shapes_read_dy_only_in_the_dx_kernel(M, K, N):
    """The H200's own entries at the model's MLP and QKV projections (measured: rmsnorm_matmul_configs_{1b,small}_
    k_dyr-h200-c795e44.json, ..._qkv_{small,1b}-h200-7c5fd33.json) take the row dot over K with the dx kernel
    finishing dx, and dyr from it at the QKV projections (N small) or xr at the MLP's (N >> K; rmsnorm_matmul_configs_
    xr_dx_in_kernel_model_shapes-h200-da1d152.json): their dx kernels fit shared memory, and no XLA op makes an
    (M, N) tensor."""
    params = tuning.lookup("rmsnorm_matmul", nm_config.shape_key(M, K, N, jnp.bfloat16), backend="mosaic",
                           device="NVIDIA H200")
    config = Config(**params)
    assert config.row_dot_side() == "k" and config.dx_in_kernel
    assert config.xr_in_dx if N > 2 * K else config.dyr_by_dx(jnp.bfloat16, residual=False)
    # the dx kernel's x tile through a fourth stage's ring (rmsnorm_matmul_configs_dx_ring4_models-h200-d079d58.json:
    # the dx kernel 38.9 against 40.9 µs at 8192x512x2816, 235.0 against 239.4 at 4096x2048x11008)
    assert (config.dx.tile_input_in, config.dx.num_stages, config.dx.stream_k) == ("ring", 4, 0)
    if (M, K, N) == (4096, 2048, 11008):  # 688 dw tiles, 28 left over: the w tile through the ring beside stream-K
        # (rmsnorm_matmul_configs_ring_stream_k_1b-h200-6ed694e.json: the dw kernel 244.3 against 249.2 µs)
        assert (config.dw.tile_input_in, config.dw.num_stages, config.dw.stream_k) == ("ring", 4, 4)
    if K == 512:  # ping-pong forward and dw tiles, 64x256 dx tiles stacked along M (the 8192x512x768 entry: 60.4
        # against 65.2 µs for the H100's, a fourth warpgroup for r and the Pallas pipeline)
        assert (config.forward.schedule, config.dw.schedule, config.dx.tile_n) == ("pingpong", "pingpong", 256)
    if (M, K, N) == (4096, 2048, 3072):  # the large shapes' forward: gamma in the registers, r shared, 64x256 tiles,
        # the split store beside a stream-K phase (rmsnorm_matmul_configs_qkv_large_form{,_repeat}-h200-76ad550.json:
        # forward 74.3 against 77.6 µs, forward + backward 231.0 against 234.8; NOTES.md, fifty-eighth session)
        assert (config.gamma_on, config.stats_in_kernel, config.squares_from) == ("a", "mma_shared", "operand")
        assert (config.forward.cta_m, config.forward.cta_n, config.forward.stream_k,
                config.forward.epilogue_store) == (128, 256, 1, "split")
    fn, args = _fwd_bwd(M, K, N, False, config)
    with backends.lowering_for_gpu():
        kernels = mosaic_ir.lower_kernels(fn, *args)
        program = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert all(k.smem_bytes <= mosaic_utils.H100_SMEM_BYTES for k in kernels), [(k.name, k.smem_bytes) for k in kernels]
    assert _mk_producers(program, M, N, "bf16") == []


@cpu_only
@pytest.mark.parametrize("gamma_on", ["w", "a"])
def test_r_from_xlas_sums_of_squares_is_formed_after_the_tiles_first_wgmma(gamma_on):
    """With r from XLA's sums of squares, the forward loads each tile's rows of them at the tile's start and takes
    their rsqrt in the epilogue: an rsqrt before the K loop would hold the tile's first wgmma until the load is
    back from L2."""
    M, K, N = 4096, 1024, 4096
    config = dataclasses.replace(nm_config.mosaic_default_config(M, K, N, jnp.bfloat16), stats_in_kernel=False,
                                 gamma_on=gamma_on, squares_from="observe")
    args = (S((M, K), jnp.bfloat16), S((K,), jnp.bfloat16), S((K, N), jnp.bfloat16))
    with backends.lowering_for_gpu():
        (kernel,) = mosaic_ir.lower_kernels(lambda x, g, w: nm.rmsnorm_matmul(
            x, g, w, eps=1e-6, residual=None, out_dtype=x.dtype, interpret=False, config=config), *args)
    assert kernel.text.index("math.rsqrt") > kernel.text.index("nvvm.wgmma.commit")


def test_squares_from_the_operand_needs_gamma_in_the_registers_and_mma_statistics():
    tiles = MosaicGemmConfig(delay_release=1)
    for fields in (dict(gamma_on="w", stats_in_kernel="mma"), dict(gamma_on="a", stats_in_kernel=False)):
        with pytest.raises(ValueError, match="squares_from: must be one of \\('observe', 'operand'\\), 'operand' only "
                                             "with gamma_on='a' and stats_in_kernel one of"):
            Config(forward=tiles, dx=tiles, dw=tiles, squares_from="operand", **fields)
    with pytest.raises(ValueError, match="squares_from: must be one of .* got squares_from='registers'"):
        Config(forward=tiles, dx=tiles, dw=tiles, squares_from="registers")
    config = Config(forward=tiles, dx=tiles, dw=tiles, gamma_on="a", stats_in_kernel="mma_shared",
                    squares_from="operand")
    assert Config(**{**config.to_dict()}).squares_from == "operand"


@cpu_only
def test_shared_r_compiles_a_k_loop_for_the_first_column_and_one_for_the_rest():
    """Under "mma_shared" the forward kernel runs its first-column tiles (which sum r's squares) and the others in
    tile loops of their own (``gemm.TileContext.first_column``): twice the K loop's wgmma instructions of a kernel
    where every tile sums its own, and no step branches on the kind of tile."""
    M, K, N = 4096, 1024, 4096
    forward = MosaicGemmConfig(tile_m=64, tile_n=256, wg_split="m", grid_minor="m", delay_release=1)
    base = dataclasses.replace(nm_config.mosaic_default_config(M, K, N), forward=forward)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((M, K), (K,), (K, N))]

    def wgmma(**fields):
        config = dataclasses.replace(base, **fields)
        with backends.lowering_for_gpu():
            (kernel,) = mosaic_ir.lower_kernels(
                lambda x, g, w: norm_matmul.rmsnorm_matmul(x, g, w, backend="mosaic", block_sizes=config), *args)
        return sum(kernel.wgmma().values())

    assert wgmma(stats_in_kernel="mma_shared", gamma_on="w") == 2 * wgmma(stats_in_kernel="mma", gamma_on="w")
    assert wgmma(stats_in_kernel="mma_shared", gamma_on="a", squares_from="operand") == 2 * wgmma(
        stats_in_kernel="mma", gamma_on="a", squares_from="operand")
