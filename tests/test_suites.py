"""jaxfuse.suites on CPU: the op specs, the runner, the sweep and the GPU entry point at the specs' smoke shapes.

The kernels run in Pallas interpret mode here; times are wall clock and mean nothing, the structure does. One run
per spec is shared by its tests (module fixtures).
"""

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ON_GPU
import pallas_kernels
from jaxfuse import bench, costmodel, gpu_run, kernels, suites
from jaxfuse.suites import attention as attention_spec
from jaxfuse.suites import train_step as train_step_spec
from pallas_kernels import attention, reference, tuning

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU structure tests; jaxfuse.gpu_run measures the GPU shapes")
ATTENTION = suites.get("attention")
CPU = ATTENTION.shapes["cpu"]
_QUIET = dict(progress=lambda message: None)


@pytest.fixture(scope="module")
def attention_records():
    return suites.run("attention", iterations=2, **_QUIET)


@pytest.fixture(scope="module")
def rmsnorm_records():
    return suites.run("rmsnorm_matmul", iterations=1, **_QUIET)


@pytest.fixture(scope="module")
def cross_entropy_records():
    return suites.run("cross_entropy", iterations=1, **_QUIET)


def _by(records, impl, mode, causal=None):
    (r,) = [r for r in records if r.implementation == impl and r.mode == mode
            and (causal is None or r.extra.get("causal") == causal)]
    return r


# ------------------------------------------------------------------------------------------------ specs
def test_specs_named_and_shapes_shared():
    assert set(suites.OPS) == {"attention", "rmsnorm_matmul", "cross_entropy", "train_step"}
    for op in suites.OPS:
        spec = suites.get(op)
        assert spec.name == op and set(spec.default_shapes) | set(spec.cpu_shapes) <= set(spec.shapes)
        assert not set(spec.cpu_shapes) & set(spec.default_shapes)
    main = ATTENTION.shapes["main"]
    assert (main["B"], main["T"], main["S"], main["N"], main["K"], main["H"]) == (4, 4096, 4096, 16, 16, 128)
    for name in ("1k", "8k", "gqa", "h64"):  # the variations keep the tokens B·T
        s = ATTENTION.shapes[name]
        assert s["B"] * s["T"] == 4 * 4096 and s["T"] == s["S"] and s["N"] % s["K"] == 0
    assert ATTENTION.shapes["h64"]["N"] * ATTENTION.shapes["h64"]["H"] == 16 * 128
    assert (ATTENTION.shapes["gqa"]["N"], ATTENTION.shapes["gqa"]["K"]) == (32, 8)  # anchors.md: GQA 32q/8kv
    with pytest.raises(ValueError, match="op: unknown 'nope'"):
        suites.get("nope")


def test_implementations_come_from_the_site_registry():
    """Every Pallas backend an op implements is timed under its own name; "pallas" (auto) never is."""
    for op, site in (("attention", "attention"), ("rmsnorm_matmul", "norm_matmul"), ("cross_entropy", "loss")):
        spec = suites.get(op)
        impls = spec.implementations()
        assert "pallas" not in impls
        for name, fn in kernels.REGISTRIES[site].items():
            if name != "pallas":
                assert impls[name] is fn
        defaults = spec.default_implementations()
        assert "pallas_triton" in defaults and "xla" in defaults and "xla_f32" not in defaults
        # a Mosaic backend is timed once the op registers one
        assert ("pallas_mosaic" in defaults) == ("mosaic" in pallas_kernels.BACKENDS[kernels.SITE_OPS[site]].names)
    assert suites.get("rmsnorm_matmul").default_implementations()[-4:] == [
        "xla_matmul_alone", "pallas_mosaic_matmul_alone", "xla_rowscale", "xla_f32_out"]
    assert "mosaic" in pallas_kernels.BACKENDS["flash_attention"].names


def test_cross_entropy_has_the_train_step_loss_sites():
    ce, step = suites.get("cross_entropy"), suites.get("train_step")
    for preset, name in (("small", "lm_head_small"), ("1b", "lm_head_1b")):
        p, s = step.shapes[preset], ce.shapes[name]
        assert (s["B"], s["H"], s["V"]) == (p["batch"] * p["seq"], p["dim"], p["vocab"])
    assert {ce.shapes["lm_head_small"]["V"], ce.shapes["lm_head_1b"]["V"]} == {32768, 128256}


def test_tolerance_rule_grows_with_the_square_root_of_the_reduction():
    assert suites.tolerance(jnp.bfloat16, 1000) == 1e-2 and suites.tolerance(jnp.float32, 2**16) == 1e-4
    assert suites.tolerance(jnp.bfloat16, 4 * 2**16) == pytest.approx(2e-2)
    assert ATTENTION.tolerance(ATTENTION.shapes["8k"]) == 1e-2
    with pytest.raises(ValueError, match="dtype: int32 has no tolerance"):
        suites.tolerance(jnp.int32)


def test_gpu_sized_shapes_are_refused_on_cpu_and_names_checked():
    with pytest.raises(ValueError, match=r"shapes: \['main'\] are GPU-sized; on cpu .* runs \['cpu'\]"):
        suites.run("attention", ["main"], **_QUIET)
    with pytest.raises(ValueError, match=r"shapes: unknown 'nope'; attention has \['main', .*\], or a custom shape "
                                         r"BxTxSxNxKxH \(6 positive integers joined by 'x', e.g. 4x4096x4096x16x16x128\)"):
        suites.run("attention", ["nope"], **_QUIET)
    with pytest.raises(ValueError, match=r"shapes: '1x24x24x3x2x32' \(B=1, T=24, S=24, N=3, K=2, H=32\): the kv heads "
                                         r"K must divide the query heads N"):
        suites.run("attention", ["1x24x24x3x2x32"], **_QUIET)
    with pytest.raises(ValueError, match=r"shapes: unknown '8192x1536'; rmsnorm_matmul has .* or a custom shape MxKxN"):
        suites.run("rmsnorm_matmul", ["8192x1536"], **_QUIET)
    with pytest.raises(ValueError, match=r"shapes: '0x4096x0': M=0, N=0; every dim of a custom shape MxKxN must be a "
                                         r"positive integer"):
        suites.run("rmsnorm_matmul", ["0x4096x0"], **_QUIET)
    with pytest.raises(ValueError, match=r"shapes: unknown 'big'; train_step has \['tiny', .*\]$"):
        suites.run("train_step", ["big"], **_QUIET)  # (its shapes are not all integers: no custom ones)
    with pytest.raises(ValueError, match=r"shapes: \['8192x1536x8960'\] are GPU-sized; on cpu .* runs \['cpu'\], or "
                                         r"custom ones up to 37x64x32"):
        suites.run("rmsnorm_matmul", ["8192x1536x8960"], **_QUIET)


def test_custom_shapes_run_like_named_ones():
    """A custom shape (the spec's dims joined by "x") gets the records a named one does, its label its dims."""
    records = suites.run("rmsnorm_matmul", ["33x64x16"], impls=("xla",), iterations=1, **_QUIET)
    assert {r.shape for r in records} == {"33x64x16"} and {r.mode for r in records} == {"fwd", "fwd+bwd"}
    assert all(r.extra["note"] == "custom shape" and r.extra["shape_name"] == "33x64x16" for r in records)
    assert all(r.extra["rel_error"] <= 1e-2 for r in records)
    with pytest.raises(ValueError, match=r"impls: unknown \['triton'\]"):
        suites.run("attention", impls=("triton",), **_QUIET)
    with pytest.raises(ValueError, match=r"impls: unknown \['pallas'\]; .*\('pallas' is the kernel sets' automatic "
                                         r"choice; a run times each backend by name: "
                                         r"\['pallas_triton', 'pallas_mosaic'\]\)"):
        suites.run("rmsnorm_matmul", ["33x64x16"], impls=("pallas", "xla"), **_QUIET)


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.slow
def test_attention_one_record_per_shape_causal_impl_mode(attention_records):
    keys = sorted((r.extra["causal"], r.implementation, r.mode) for r in attention_records)
    assert keys == sorted((c, i, m) for c in (False, True) for i in ATTENTION.default_implementations()
                          for m in ATTENTION.modes)
    for r in attention_records:
        assert r.op == "attention" and r.dtype == "bfloat16" and r.extra["shape_name"] == "cpu"
        assert r.shape.startswith("2x40x40 N4/K2 H32") and r.shape.endswith("causal") == r.extra["causal"]
        assert r.implementation != "pallas"  # records name the backend that ran


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_triton", "xla"])
def test_attention_measured_rows_are_sane(attention_records, impl):
    B, T, S, N, H = CPU["B"], CPU["T"], CPU["S"], CPU["N"], CPU["H"]
    for causal in (False, True):
        for mode in ATTENTION.modes:
            r = _by(attention_records, impl, mode, causal)
            assert r.method == "wall" and math.isfinite(r.time_us) and r.time_us > 0
            flops = 4.0 * B * N * T * S * H * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0)
            assert r.flops == pytest.approx(flops)
            assert r.floor_us > 0 and r.ratio_to_floor == pytest.approx(r.time_us / r.floor_us)
            assert r.tflops_per_s == pytest.approx(flops / r.time_us / 1e6)
            assert "error" not in r.extra
            assert set(r.extra["rel_errors"]) == ({"o"} if mode == "fwd" else {"o", "dq", "dk", "dv"})
            assert 0 < r.extra["rel_error"] < 2e-2  # bf16 inputs and outputs against the float32 reference
            assert isinstance(r.extra["temp_bytes"], int) and r.extra["temp_bytes"] >= 0
            assert r.extra["peak_bytes"] >= r.extra["temp_bytes"]
            assert isinstance(r.extra["per_kernel_us"], dict)  # per-kernel µs on GPU; empty with wall timing
            assert r.extra["input_sets"] == 2 and r.extra["tolerance"] == 1e-2


@pytest.mark.slow
def test_attention_pallas_records_its_backend_config_and_ratios(attention_records):
    for causal in (False, True):
        for mode in ATTENTION.modes:
            p, x = _by(attention_records, "pallas_triton", mode, causal), _by(attention_records, "xla", mode, causal)
            assert p.extra["backend"] == "triton" and p.extra["config_source"] == "default"
            assert p.extra["config"]["block_q"] >= 16
            assert p.speedup_vs == {"xla": pytest.approx(x.time_us / p.time_us)}
            assert "cudnn" not in x.speedup_vs  # cuDNN did not run


@pytest.mark.slow
def test_attention_cudnn_is_recorded_as_failed_on_cpu(attention_records):
    for causal in (False, True):
        for mode in ATTENTION.modes:
            r = _by(attention_records, "cudnn", mode, causal)
            assert r.method == "failed" and math.isnan(r.time_us) and not r.speedup_vs
            assert "cudnn" in r.extra["error"] and "cpu" in r.extra["error"]
            assert r.flops > 0  # the cost is still there for the table


@pytest.mark.slow
def test_attention_mosaic_is_recorded_as_unavailable_on_cpu(attention_records):
    for causal in (False, True):
        for mode in ATTENTION.modes:
            r = _by(attention_records, "pallas_mosaic", mode, causal)
            assert r.method == "failed" and math.isnan(r.time_us) and not r.speedup_vs
            assert "Mosaic GPU kernels need an sm90 (Hopper) GPU" in r.extra["error"]


@pytest.mark.slow
def test_results_written_and_tables(attention_records, tmp_path):
    path = bench.write_results(attention_records, str(tmp_path / "attention-cpu.json"))
    data = json.loads(open(path).read())
    assert len(data["records"]) == len(attention_records) and data["environment"]["backend"] == "cpu"
    table = suites.summary_table(attention_records).splitlines()
    assert len(table) == 2 + 4  # header, rule, (2 causal settings × 2 modes) rows
    assert "pallas_triton vs xla" in table[0] and "pallas_triton rel err" in table[0]
    assert "speedup vs xla" in bench.markdown_table(attention_records)


@pytest.mark.slow
def test_a_failing_implementation_is_recorded_not_raised():
    def broken(q, k, v, *, causal):
        raise RuntimeError("boom")

    spec = dataclasses.replace(ATTENTION, variants=({"causal": False},),
                               extra_implementations=lambda: {"broken": broken})
    got = suites.run(spec, impls=("broken",), iterations=1, **_QUIET)
    assert [(r.mode, r.method) for r in got] == [("fwd", "failed"), ("fwd+bwd", "failed")]
    assert all("RuntimeError: boom" in r.extra["error"] and math.isnan(r.time_us) for r in got)


@pytest.mark.slow
def test_xla_skipped_when_scores_too_large_and_shapes_past_deadline(monkeypatch):
    monkeypatch.setattr(attention_spec, "XLA_MAX_SCORES_BYTES", 1)
    got = suites.run("attention", impls=("xla",), iterations=1, **_QUIET)
    assert len(got) == 4 and all("float32 scores" in r.extra["error"] for r in got)
    got = suites.run("attention", iterations=1, deadline=time.time() - 1, **_QUIET)
    assert len(got) == 2 * len(ATTENTION.default_implementations()) * 2
    assert all(r.method == "failed" and "time budget" in r.extra["error"] for r in got)


@pytest.mark.slow
def test_tuned_cache_entry_is_used(tmp_path):
    q, k, v, _ = attention_spec.make_inputs(CPU["B"], CPU["T"], CPU["S"], CPU["N"], CPU["K"], CPU["H"])
    params = dict(attention.plan(q, k, v).config.to_dict(), block_q=32, block_k=16)
    path = tmp_path / "tuned.json"
    tuning.store("flash_attention", attention.tuning_key(q, k), params, time_us=1.0, path=path)
    spec = dataclasses.replace(ATTENTION, variants=({"causal": False},))
    fwd, fwd_bwd = suites.run(spec, impls=("pallas_triton",), iterations=1, cache_path=path, **_QUIET)
    for r in (fwd, fwd_bwd):
        assert r.method == "wall" and r.extra["config"] == params and r.extra["config_source"].startswith("tuned")
        assert r.extra["rel_error"] < 2e-2


@pytest.mark.slow
def test_xla_baseline_matches_reference_with_gqa_and_causal():
    q, k, v, _ = attention_spec.make_inputs(1, 24, 24, 4, 2, 32, seed=3, dtype=jnp.float32)
    for causal in (False, True):
        got = kernels.ATTENTION["xla"](q, k, v, causal=causal)
        want = reference.attention(q, k, v, causal=causal)
        assert float(jnp.max(jnp.abs(got - want))) < 1e-2


# ------------------------------------------------------------------------------------------------ rmsnorm_matmul
@pytest.mark.slow
def test_rmsnorm_one_record_per_impl_and_mode_with_errors_and_ratios(rmsnorm_records):
    spec = suites.get("rmsnorm_matmul")
    assert {(r.implementation, r.mode) for r in rmsnorm_records} == {
        (i, m) for i in spec.default_implementations() for m in spec.modes}
    mosaic = ("pallas_mosaic", "pallas_mosaic_matmul_alone")  # sm90 only: recorded as skipped here, with the reason
    for r in rmsnorm_records:
        if r.implementation in mosaic:
            assert r.method == "failed" and "sm90" in r.extra["error"], (r.implementation, r.extra.get("error"))
            continue
        assert math.isfinite(r.time_us) and r.time_us > 0, (r.implementation, r.mode, r.extra.get("error"))
        assert r.floor_us > 0 and r.flops > 0
        assert set(r.extra["rel_errors"]) == ({"y"} if r.mode == "fwd" else {"y", "dx", "dgamma", "dw"})
        if r.implementation in ("pallas_triton", "xla"):
            assert all(0 <= e < 2e-2 for e in r.extra["rel_errors"].values()), r.extra["rel_errors"]
    for mode in spec.modes:
        assert set(_by(rmsnorm_records, "pallas_triton", mode).speedup_vs) == {"xla", "xla_matmul_alone"}
    assert "xla_rowscale" in bench.markdown_table(rmsnorm_records)


@pytest.mark.slow
def test_rmsnorm_summary_is_keyed_by_the_label(rmsnorm_records):
    lines = suites.summary_table(rmsnorm_records).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert len(lines) == 4  # header, rule, fwd, fwd+bwd
    for line, mode in zip(lines[2:], ("fwd", "fwd+bwd")):
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        assert (cells["shape"], cells["mode"]) == ("37x64x32", mode)
        p, x = _by(rmsnorm_records, "pallas_triton", mode), _by(rmsnorm_records, "xla", mode)
        assert cells["pallas_triton µs"] == f"{p.time_us:.1f}" and cells["xla µs"] == f"{x.time_us:.1f}"
        assert float(cells["pallas_triton vs xla"]) == pytest.approx(x.time_us / p.time_us, abs=1e-2)


@pytest.mark.slow
def test_rowscale_baseline_matches_the_reference():
    """r ⊙ (x @ (γ ∘ w)) is the same function as rmsnorm(x) · γ @ w: forward and all gradients, bf16 tolerance."""
    from jaxfuse.suites import rmsnorm_matmul as spec_module

    x, gamma, w, dy = spec_module.make_inputs(37, 64, 48, seed=3)
    spec = spec_module.SPEC
    got = spec.program(spec_module.rowscale_rmsnorm_matmul, "fwd+bwd", {}, {})(x, gamma, w, dy)
    want = spec.program(reference.rmsnorm_matmul, "fwd+bwd", {}, {})(
        *(a.astype(jnp.float32) for a in (x, gamma, w, dy)))
    for name, g, r in zip(("y", "dx", "dgamma", "dw"), jax.tree.leaves(got), jax.tree.leaves(want)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert np.all(np.isfinite(g)) and err < 2e-2, (name, err)


# ------------------------------------------------------------------------------------------------ cross_entropy
def test_cross_entropy_records_carry_time_memory_and_error(cross_entropy_records):
    assert {(r.implementation, r.mode) for r in cross_entropy_records} == {
        (i, m) for i in ("xla", "pallas_triton") for m in ("fwd", "fwd+bwd")}
    for r in cross_entropy_records:
        assert r.method != "failed", r.extra.get("error")
        assert math.isfinite(r.time_us) and r.time_us > 0
        assert r.extra["temp_bytes"] >= 0
        assert 0 <= r.extra["rel_error"] < 1e-2, (r.implementation, r.mode, r.extra["rel_errors"])
        assert set(r.extra["rel_errors"]) == ({"loss"} if r.mode == "fwd" else {"loss", "dh", "dw"})
        if r.implementation != "xla":
            assert r.speedup_vs["xla"] > 0


@pytest.mark.slow
def test_runs_without_the_reference_check_when_asked():
    """check=False (`jaxfuse bench --nocheck`): timed and measured as usual, no reference compiled, no rel_error."""
    records = suites.run("cross_entropy", impls=["xla"], iterations=1, check=False, **_QUIET)
    assert {r.mode for r in records} == {"fwd", "fwd+bwd"}
    for r in records:
        assert r.method != "failed" and r.extra["temp_bytes"] >= 0
        assert "rel_error" not in r.extra and r.extra["rel_error_missing"] == "not checked (check=False)"


# ------------------------------------------------------------------------------------------------ train_step
@pytest.mark.slow
def test_train_step_times_every_kernel_set_from_the_same_start():
    records = suites.run("train_step", iterations=1, **_QUIET)
    names = [r.implementation for r in records]
    assert names[0] == "attention=xla,norm_matmul=xla,loss=xla" and "attention=cudnn,norm_matmul=xla,loss=xla" in names
    assert "attention=pallas_triton,norm_matmul=pallas_triton,loss=pallas_triton" in names
    assert "attention=xla,norm_matmul=pallas_mosaic,loss=xla" in names  # an op with a Mosaic backend
    assert names == list(train_step_spec.kernel_sets()) and all(r.mode == "step" for r in records)
    ran = [r for r in records if r.method != "failed"]
    assert "cudnn" in _by(records, "attention=cudnn,norm_matmul=xla,loss=xla", "step").extra["error"]
    for r in records:  # on CPU: cuDNN and every Mosaic set fail (recorded), the other 5 sets run
        assert (r.method != "failed") == ("cudnn" not in r.implementation and "mosaic" not in r.implementation)
        if "mosaic" in r.implementation:
            assert "sm90" in r.extra["error"]
    assert len(ran) == 5
    losses = [r.extra["loss"] for r in ran]
    assert all(math.isfinite(x) for x in losses) and max(losses) - min(losses) < 1e-4  # float32: same step
    for r in ran:
        assert r.extra["peak_bytes"] > r.extra["temp_bytes"] > 0 and r.flops > 0
        assert r.speedup_vs == ({} if r is ran[0] else {"attention=xla,norm_matmul=xla,loss=xla": pytest.approx(
            ran[0].time_us / r.time_us)})


def test_train_step_refuses_gpu_presets_on_cpu():
    with pytest.raises(ValueError, match=r"\['small', '1b'\] are GPU-sized; on cpu .* runs \['tiny'\]"):
        suites.run("train_step", ["small", "1b"], **_QUIET)


# ------------------------------------------------------------------------------------------------ sweep
@pytest.mark.slow
def test_sweep_checks_candidates_before_timing_and_stores_the_best(tmp_path, monkeypatch):
    """Two candidates per pass at the CPU shape; a candidate that computes the wrong thing is rejected, never timed
    and never stored."""
    path = tmp_path / "tuned.json"
    rows = suites.tune("rmsnorm_matmul", cache_path=path, limit=2, iterations=1, **_QUIET)
    assert [r["mode"] for r in rows] == ["fwd", "fwd", "fwd+bwd", "fwd+bwd"]
    assert all(r["status"] == "ok" and r["rel_error"] < 2e-2 and r["time_us"] > 0 for r in rows)
    stored = [r for r in rows if "stored" in r]
    assert len(stored) == 1 and stored[0]["mode"] == "fwd+bwd"
    assert tuning.lookup("rmsnorm_matmul", stored[0]["stored"], backend="triton", path=path) == stored[0]["params"]

    real = kernels.NORM_MATMUL["pallas_triton"]
    monkeypatch.setitem(kernels.NORM_MATMUL, "pallas_triton", lambda x, g, w, **o: 2.0 * real(x, g, w, **o))
    rows = suites.tune("rmsnorm_matmul", cache_path=tmp_path / "wrong.json", limit=1, iterations=1, **_QUIET)
    assert [r["status"] for r in rows] == ["rejected", "rejected"] and "time_us" not in rows[0]
    assert not (tmp_path / "wrong.json").exists()
    assert "REJECTED" in suites.sweep.sweep_table(rows)


@pytest.mark.slow
def test_the_sweep_rotates_input_sets_where_one_fits_in_the_l2(tmp_path, monkeypatch):
    """As the suite does: on a device whose L2 holds one input set, each candidate is timed over 3 sets in turn, so
    no timed call finds w left in the L2 by the call before; on the CPU (no L2 in its spec), one set."""
    lengths = []
    real = bench.time_kernels
    monkeypatch.setattr(bench, "time_kernels", lambda fn, sets, **kw: lengths.append(len(sets)) or real(fn, sets, **kw))
    suites.tune("rmsnorm_matmul", cache_path=tmp_path / "cpu.json", limit=1, iterations=1, **_QUIET)
    assert lengths == [1, 1]
    lengths.clear()
    monkeypatch.setattr(costmodel, "detect", lambda: costmodel.DEVICES["h200"])
    suites.tune("rmsnorm_matmul", cache_path=tmp_path / "h200.json", limit=1, iterations=1, **_QUIET)
    assert lengths == [3, 3]
    lengths.clear()
    monkeypatch.setattr(costmodel, "detect", lambda: None)  # a GPU without figures: its L2 unknown
    suites.tune("rmsnorm_matmul", cache_path=tmp_path / "unknown.json", limit=1, iterations=1, **_QUIET)
    assert lengths == [3, 3]


def test_records_of_a_device_without_figures_have_no_floor(monkeypatch):
    """costmodel.detect() None (a GPU the table does not name): times are recorded, floors and × floor left out."""
    monkeypatch.setattr(costmodel, "detect", lambda: None)
    records = suites.run("rmsnorm_matmul", ["33x64x16"], impls=("xla",), iterations=1, **_QUIET)
    assert records and all(r.time_us > 0 and r.floor_us is None and r.ratio_to_floor is None for r in records)


def test_sweep_skips_a_backend_that_cannot_run_the_shape(tmp_path, monkeypatch):
    """Mosaic cannot run the CPU shape (no sm90 GPU here; on one, decode shapes): the sweep records why, times
    nothing for it and goes on."""
    monkeypatch.setattr(kernels, "unavailable_reason", lambda site, name: None)  # as if Mosaic were available
    rows = suites.tune("rmsnorm_matmul", backends=["mosaic"], cache_path=tmp_path / "t.json", **_QUIET)
    assert [(r["backend"], r["status"]) for r in rows] == [("mosaic", "skipped")]
    assert "backend='mosaic' cannot run rmsnorm_matmul here" in rows[0]["error"]
    assert "SKIPPED" in suites.sweep.sweep_table(rows) and not (tmp_path / "t.json").exists()


# ------------------------------------------------------------------------------------------------ GPU entry point
@pytest.mark.slow
def test_gpu_run_writes_files_named_by_device_tag(tmp_path):
    out = tmp_path / "out"
    assert gpu_run.main(["--out", str(out), "--skip-tests", "--ops", "cross_entropy", "--iterations", "1",
                         "--allow-cpu"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["cross_entropy-cpu.json", "cross_entropy-cpu.md",
                                                     "summary-cpu.md"]
    assert "pallas_triton" in (out / "summary-cpu.md").read_text()


@pytest.mark.skipif(ON_GPU, reason="on a GPU it would run the whole GPU round")
def test_gpu_run_without_a_gpu_is_one_line_with_status_2(tmp_path, capsys):
    out = tmp_path / "out"
    assert gpu_run.main(["--out", str(out)]) == 2
    assert capsys.readouterr().err == ("jaxfuse.gpu_run: runs the tests and times the ops' GPU shapes, so it needs an "
                                       "NVIDIA GPU; this machine runs cpu; --allow-cpu runs it anyway\n")
    assert not out.exists()  # refused before any work


def test_run_pytest_records_status_and_output(tmp_path, monkeypatch):
    """The entry point's test step: exit status and output in a file; a run past its timeout keeps its output."""
    tests = tmp_path / "test_tiny.py"
    tests.write_text("import time\n\ndef test_ok():\n    print('tiny ran')\n\n"
                     "def test_slow():\n    time.sleep(float(__import__('os').environ.get('TINY_SLEEP', '0')))\n")
    out = tmp_path / "pytest.txt"
    monkeypatch.setenv("TINY_SLEEP", "0.5")
    start = time.perf_counter()
    status, text = gpu_run.run_pytest([str(tests)], str(out), timeout_s=120)
    # The cut run below must get past pytest's start (seconds on a loaded CI machine) into test_slow: 3x this run.
    cut_s = max(5, round(3 * (time.perf_counter() - start)))
    assert status == "exit 0" and "2 passed" in text and "test_tiny.py::test_ok PASSED" in text
    assert out.read_text().startswith("exit 0\n")
    slowest = text.split("slowest tests (setup and call, seconds):\n")[1].splitlines()
    seconds, outcome, nodeid = slowest[0].split(maxsplit=2)
    assert (outcome, nodeid) == ("passed", f"{tests}::test_slow") and 0.5 <= float(seconds) < 60
    assert slowest[1].split(maxsplit=2)[1:] == ["passed", f"{tests}::test_ok"]
    not_run = tmp_path / "pytest-not-run.txt"  # what never finished, to pass back as --tests @FILE
    assert not not_run.exists()
    monkeypatch.setenv("TINY_SLEEP", "600")
    status, text = gpu_run.run_pytest([str(tests)], str(out), timeout_s=cut_s)
    assert status == f"TIMED OUT after {cut_s} s"
    assert out.read_text().startswith(f"TIMED OUT after {cut_s} s\n")
    assert not_run.read_text() == f"{tests}::test_slow\n"
    assert f"1 tests not run, listed in {not_run} (--tests @{not_run} runs them)" in text
    (only,) = text.split("slowest tests (setup and call, seconds):\n")[1].splitlines()  # the cut test is not in it
    assert only.split(maxsplit=2)[1:] == ["passed", f"{tests}::test_ok"]
    monkeypatch.setenv("TINY_SLEEP", "0")
    assert gpu_run.run_pytest([str(tests)], str(out), timeout_s=120)[0] == "exit 0"
    assert not not_run.exists()  # the earlier run's list is gone once a run finishes


def test_progress_file_read_back_without_a_half_written_last_line(tmp_path):
    """A run killed while the plugin wrote its last line: that line is left out, the rest read back."""
    from jaxfuse import pytest_progress

    path = tmp_path / "progress.tsv"
    for cut in ("finished\t/t.py::c\tpassed\t", "fini"):
        path.write_text("collected\t/t.py::a\ncollected\t/t.py::b\ncollected\t/t.py::c\n"
                        "finished\t/t.py::a\tpassed\t1.50\nfinished\t/t.py::b\tfailed in setup\t0.25\n" + cut)
        assert pytest_progress.not_run(str(path)) == ["/t.py::c"]
        assert pytest_progress.slowest(str(path), 1) == [(1.5, "passed", "/t.py::a")]
        assert pytest_progress.slowest(str(path)) == [(1.5, "passed", "/t.py::a"),
                                                      (0.25, "failed in setup", "/t.py::b")]
    assert pytest_progress.not_run(str(tmp_path / "none.tsv")) == [] == pytest_progress.slowest(str(tmp_path / "x"))


def test_run_pytest_turns_xla_autotuning_off_unless_asked(tmp_path, monkeypatch):
    """The tests' float32 references compile without XLA's GEMM autotuning (20-40 s a shape with it), keeping the
    XLA flags already set; --test-xla-autotune leaves them as they are."""
    tests = tmp_path / "test_flags.py"
    tests.write_text("import os\n\ndef test_flags():\n    print('XLA_FLAGS=' + repr(os.environ.get('XLA_FLAGS')))\n")
    out = tmp_path / "pytest.txt"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nowhere")
    _, text = gpu_run.run_pytest([str(tests), "-s"], str(out), timeout_s=120)
    assert "XLA_FLAGS='--xla_dump_to=/tmp/nowhere --xla_gpu_autotune_level=0'" in text, text
    _, text = gpu_run.run_pytest([str(tests), "-s"], str(out), timeout_s=120, xla_autotune=True)
    assert "XLA_FLAGS='--xla_dump_to=/tmp/nowhere'" in text, text


def test_run_pytest_in_several_processes_leaves_none_behind(tmp_path):
    """--test-workers: pytest-xdist's workers, each told to allocate GPU memory as it goes and to time one CUPTI
    window at a time (one lock file for all of them); past the timeout the
    whole process group is killed, so nothing a test started is left running (on a GPU: holding its memory; e.g.
    the CLI tests' subprocesses)."""
    pid_file = tmp_path / "child.pid"
    tests = tmp_path / "test_workers.py"
    tests.write_text("import os, subprocess, sys, time\n\n"
                     "def test_memory_as_needed():\n"
                     "    assert os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'\n"
                     "    assert os.environ['XLA_FLAGS'].endswith('--xla_gpu_autotune_level=0')\n"
                     "    assert os.environ['JAXFUSE_CUPTI_LOCK'].endswith('.lock')\n\n"
                     "def test_slow():\n"
                     "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                     f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                     "    time.sleep(600)\n")
    out = tmp_path / "pytest.txt"
    start = time.perf_counter()
    status, text = gpu_run.run_pytest([f"{tests}::test_memory_as_needed"], str(out), timeout_s=120, workers=2)
    assert status == "exit 0" and "1 passed" in text and "created: 2/2 workers" in text, text
    cut_s = max(15, round(2 * (time.perf_counter() - start)))  # past the workers' start on a loaded machine
    status, _ = gpu_run.run_pytest([str(tests)], str(out), timeout_s=cut_s, workers=2)
    assert status == f"TIMED OUT after {cut_s} s"
    assert (tmp_path / "pytest-not-run.txt").read_text() == f"{tests}::test_slow\n"  # (from the workers' reports)
    assert f"passed   {tests}::test_memory_as_needed" in out.read_text()  # its duration, from a worker's report
    child = int(pid_file.read_text())
    for _ in range(50):  # the killed process is reaped by init within moments
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail(f"process {child}, started by a test, still ran after the timeout")


def test_gpu_run_takes_the_tests_from_a_file_of_node_ids(tmp_path, capsys):
    """--tests @FILE: one node id a line (ids may hold spaces: each is one argument), as a cut run lists them."""
    tests = tmp_path / "test_ids.py"
    tests.write_text("import pytest\n\n@pytest.mark.parametrize('why', ['a b', 'c'])\ndef test_id(why):\n"
                     "    pass\n\ndef test_other():\n    raise AssertionError('not asked for')\n")
    ids = tmp_path / "ids.txt"
    ids.write_text(f"{tests}::test_id[a b]\n\n{tests}::test_id[c]\n")
    out = tmp_path / "out"
    assert gpu_run.main(["--out", str(out), "--allow-cpu", "--ops", "", "--tests", f"@{ids}"]) == 0
    (log,) = out.glob("pytest-*.txt")
    assert log.read_text().startswith("exit 0\n") and "2 passed" in log.read_text()
    missing, empty = tmp_path / "none.txt", tmp_path / "empty.txt"
    empty.write_text("\n")
    for bad, message in [(missing, f"cannot read {str(missing)!r} (No such file or directory)"),
                         (empty, f"{str(empty)!r} names no test")]:
        with pytest.raises(SystemExit):
            gpu_run.main(["--out", str(out), "--allow-cpu", "--ops", "", "--tests", f"@{bad}"])
        assert f"--tests: {message}" in capsys.readouterr().err


def test_gpu_run_refuses_fewer_than_one_test_worker(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_run.main(["--out", str(tmp_path / "out"), "--allow-cpu", "--skip-tests", "--ops", "",
                      "--test-workers", "0"])
    assert "--test-workers: got 0; at least 1" in capsys.readouterr().err
