"""jaxfuse.suites.attention on CPU at the "cpu" smoke shape: records produced, fields sane, failures recorded.

The kernels run in Pallas interpret mode here; times are wall clock and mean nothing, the structure does. One suite
run is shared by the module (``records``); the other tests run one implementation or skip everything.
"""

import importlib.util
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import pytest

from jaxfuse import bench, suites
from jaxfuse.suites import attention as suite
from pallas_kernels import reference, tuning

ON_GPU = jax.default_backend() == "gpu"
pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU structure tests; the GPU script measures the real shapes")
CPU = suite.SHAPES["cpu"]


@pytest.fixture(scope="module")
def records():
    return suite.run(["cpu"], iterations=2)


def _by(records, impl, mode, causal):
    (r,) = [r for r in records if r.implementation == impl and r.mode == mode and r.extra.get("causal") == causal]
    return r


def test_registered_and_shapes_named():
    assert suites.get("attention") is suite
    assert set(suite.DEFAULT_SHAPES) <= set(suite.SHAPES) and "cpu" not in suite.DEFAULT_SHAPES
    main = suite.SHAPES["main"]
    assert (main["B"], main["T"], main["S"], main["N"], main["K"], main["H"]) == (4, 4096, 4096, 16, 16, 128)
    for name in ("1k", "8k", "gqa", "h64"):  # the variations keep the tokens B·T
        s = suite.SHAPES[name]
        assert s["B"] * s["T"] == 4 * 4096 and s["T"] == s["S"] and s["N"] % s["K"] == 0
    assert suite.SHAPES["h64"]["N"] * suite.SHAPES["h64"]["H"] == 16 * 128
    assert (suite.SHAPES["gqa"]["N"], suite.SHAPES["gqa"]["K"]) == (32, 8)  # anchors.md: GQA 32q/8kv


def test_one_record_per_shape_causal_impl_mode(records):
    keys = sorted((r.extra["causal"], r.implementation, r.mode) for r in records)
    assert keys == sorted((c, i, m) for c in (False, True) for i in suite.IMPLEMENTATIONS for m in suite.MODES)
    for r in records:
        assert r.op == "attention" and r.dtype == "bfloat16" and r.extra["shape_name"] == "cpu"
        assert r.shape.startswith("2x40x40 N4/K2 H32") and r.shape.endswith("causal") == r.extra["causal"]


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_measured_rows_are_sane(records, impl):
    B, T, S, N, H = CPU["B"], CPU["T"], CPU["S"], CPU["N"], CPU["H"]
    for causal in (False, True):
        for mode in suite.MODES:
            r = _by(records, impl, mode, causal)
            assert r.method == "wall" and math.isfinite(r.time_us) and r.time_us > 0
            flops = 4.0 * B * N * T * S * H * (0.5 if causal else 1.0) * (3.5 if mode == "fwd+bwd" else 1.0)
            assert r.flops == pytest.approx(flops)
            assert r.floor_us > 0 and r.ratio_to_floor == pytest.approx(r.time_us / r.floor_us)
            assert r.tflops_per_s == pytest.approx(flops / r.time_us / 1e6)
            assert "error" not in r.extra
            want = {"o"} if mode == "fwd" else {"o", "dq", "dk", "dv"}
            assert set(r.extra["rel_errors"]) == want
            assert 0 < r.extra["rel_error"] < 2e-2  # bf16 inputs and outputs against the float32 reference
            assert isinstance(r.extra["temp_bytes"], int) and r.extra["temp_bytes"] >= 0
            assert isinstance(r.extra["top_kernels"], dict)  # per-kernel µs on GPU; empty with wall timing
            assert r.extra["input_sets"] == 2


def test_pallas_records_its_config_and_the_ratios(records):
    for causal in (False, True):
        for mode in suite.MODES:
            p, x = _by(records, "pallas", mode, causal), _by(records, "xla", mode, causal)
            assert p.extra["config_source"] == "default" and p.extra["config"]["block_q"] >= 16
            assert p.speedup_vs == {"xla": pytest.approx(x.time_us / p.time_us)}
            assert "cudnn" not in x.speedup_vs  # cuDNN did not run


def test_cudnn_is_recorded_as_failed_on_cpu(records):
    for causal in (False, True):
        for mode in suite.MODES:
            r = _by(records, "cudnn", mode, causal)
            assert r.method == "failed" and math.isnan(r.time_us) and not r.speedup_vs
            assert "cudnn" in r.extra["error"] and "cpu" in r.extra["error"]
            assert r.flops > 0  # the cost is still there for the table


def test_results_written_and_tables(records, tmp_path):
    path = bench.write_results(records, str(tmp_path / "attention-cpu.json"))
    data = json.loads(open(path).read())
    assert len(data["records"]) == len(records) and data["environment"]["backend"] == "cpu"
    table = suite.summary_table(records)
    assert table.count("\n") == 2 + 4 - 1  # header, rule, (2 causal settings × 2 modes) rows
    assert "speedup vs xla" in bench.markdown_table(records)


def test_a_failing_implementation_is_recorded_not_raised(monkeypatch):
    def broken(q, k, v, *, causal):
        raise RuntimeError("boom")

    monkeypatch.setattr(suite, "_xla_attention", broken)
    got = suite.run(["cpu"], iterations=1, causal=(False,), impls=("xla",), progress=lambda m: None)
    assert [(r.mode, r.method) for r in got] == [("fwd", "failed"), ("fwd+bwd", "failed")]
    assert all("RuntimeError: boom" in r.extra["error"] and math.isnan(r.time_us) for r in got)


def test_xla_skipped_when_scores_too_large_and_shapes_past_deadline():
    got = suite.run(["cpu"], iterations=1, causal=(True,), impls=("xla",), xla_max_scores_bytes=1,
                    progress=lambda m: None)
    assert len(got) == 2 and all("float32 scores" in r.extra["error"] for r in got)
    got = suite.run(["cpu"], iterations=1, deadline=time.time() - 1, progress=lambda m: None)
    assert len(got) == 2 * len(suite.IMPLEMENTATIONS) * 2
    assert all(r.method == "failed" and "time budget" in r.extra["error"] for r in got)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="shape_names"):
        suite.run(["nope"])
    with pytest.raises(ValueError, match="impls"):
        suite.run(["cpu"], impls=("triton",))


def test_big_shapes_are_skipped_on_cpu():
    messages = []
    assert suite.run(["main"], progress=messages.append) == []
    assert "skipped" in messages[0]


def test_tuned_cache_entry_is_used(tmp_path):
    from pallas_kernels import attention

    q, k, _, _ = suite.make_inputs(CPU["B"], CPU["T"], CPU["S"], CPU["N"], CPU["K"], CPU["H"], seed=0)
    params = dict(attention.plan(q, k, k).config.to_dict(), block_q=32, block_k=16)
    path = tmp_path / "tuned.json"
    tuning.store("flash_attention", attention.tuning_key(q, k), params, time_us=1.0, path=path)
    (fwd, fwd_bwd) = suite.run(["cpu"], iterations=1, causal=(False,), impls=("pallas",), cache_path=path,
                               progress=lambda m: None)
    for r in (fwd, fwd_bwd):
        assert r.method == "wall" and r.extra["config"] == params and r.extra["config_source"].startswith("tuned")
        assert r.extra["rel_error"] < 2e-2


def test_xla_baseline_matches_reference_with_gqa_and_causal():
    q, k, v, _ = suite.make_inputs(1, 24, 24, 4, 2, 32, seed=3, dtype=jnp.float32)
    for causal in (False, True):
        got = suite._xla_attention(q, k, v, causal=causal)
        want = reference.attention(q, k, v, causal=causal)
        assert float(jnp.max(jnp.abs(got - want))) < 1e-2


def test_gpu_script_runs_on_cpu(tmp_path):
    """The H100 script end to end at the smoke shape, without tests and sweep (those need the GPU's time)."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "scripts", "gpu_attention.py")
    spec = importlib.util.spec_from_file_location("gpu_attention", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "out"
    assert script.main(["--out", str(out), "--skip-tests", "--skip-tune", "--shapes", "cpu", "--iterations", "1",
                        "--budget-s", "120"]) == 0
    data = json.loads((out / "attention-cpu.json").read_text())  # named by bench.device_tag
    assert len(data["records"]) == 2 * len(suite.IMPLEMENTATIONS) * 2
    assert (out / "attention-cpu.md").exists()
