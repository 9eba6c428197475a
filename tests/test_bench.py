"""jaxfuse.bench and jaxfuse.costmodel on CPU."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import CPU_ONLY
from jaxfuse import bench, costmodel


@CPU_ONLY
def test_time_kernels_on_cpu_is_wall_time():
    x = jax.random.normal(jax.random.key(0), (256, 256))
    timing = bench.time_kernels(lambda a: a @ a, [(x,), (x + 1,)], iterations=5)
    assert timing.method == "wall" and len(timing.samples_us) == 5 and timing.median_us > 0


def test_time_kernels_runs_eagerly_when_asked():
    x = jax.random.normal(jax.random.key(1), (64, 64))
    calls = []

    def fn(a):
        calls.append(a)
        return jnp.tanh(a) * 2.0

    bench.time_kernels(fn, [(x,)], iterations=2, warmup=1, jit=False)
    assert len(calls) == 3 and all(c is x for c in calls)  # called as it is, every time: eager
    calls.clear()
    bench.time_kernels(fn, [(x,)], iterations=2, warmup=1)
    assert len(calls) == 1 and calls[0] is not x  # traced once by jit, then the compiled program runs


def test_a_function_compiled_ahead_of_time_is_timed_as_it_is():
    x = jax.random.normal(jax.random.key(2), (64, 64))
    compiled = jax.jit(lambda a: a @ a).lower(x).compile()  # jax.jit over it would fail: it takes no tracers
    assert bench.time_kernels(compiled, [(x,)], iterations=2).median_us > 0
    (timing,) = bench.time_interleaved([(compiled, (x,))], iterations=2)
    assert len(timing.samples_us) == 2


class _Slow:
    """A callable that looks jitted (has ``lower``), records its calls and sleeps ``seconds`` per call."""

    def __init__(self, name: str, calls: list, seconds: float = 0.0):
        self.name, self.calls, self.seconds = name, calls, seconds

    def lower(self, *args):  # noqa: D102 - only its presence matters
        raise NotImplementedError

    def __call__(self, x):
        import time

        self.calls.append(self.name)
        time.sleep(self.seconds)
        return x


def test_time_interleaved_takes_turns_and_keeps_to_its_budget():
    x = jnp.ones(4)
    calls = []
    timings = bench.time_interleaved([(_Slow("a", calls), (x,)), (_Slow("b", calls), (x,))], iterations=6,
                                     warmup=1, wall=True)  # (sleeps: no kernel for CUPTI to time on a GPU)
    assert calls == ["a", "b"] + ["a", "b"] * 6  # warmup, then one call of each per round
    assert [len(t.samples_us) for t in timings] == [6, 6] and all(t.method == "wall" for t in timings)
    calls.clear()
    timings = bench.time_interleaved([(_Slow("a", calls, 0.02), (x,)), (_Slow("b", calls, 0.02), (x,))],
                                     iterations=1000, warmup=0, budget_s=0.15, min_iterations=2, wall=True)
    rounds = len(timings[0].samples_us)
    assert 2 <= rounds <= 8 and len(timings[1].samples_us) == rounds and timings[0].median_us >= 2e4


class _Seen:
    """A callable that looks jitted and records which input set (its argument) each call took."""

    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def lower(self, *args):  # noqa: D102 - only its presence matters
        raise NotImplementedError

    def __call__(self, x):
        self.seen.append((self.name, int(x[0])))
        return x


def test_time_interleaved_rotates_input_sets_over_all_calls():
    """With n sets per call, the k-th timed call over all calls and rounds takes set k mod n: a set comes back
    only after n - 1 calls that read the others (the L2 rotation ``time_kernels`` does for one fn)."""
    sets = [(jnp.full(4, s),) for s in range(3)]
    seen = []
    bench.time_interleaved([(_Seen("a", seen), sets), (_Seen("b", seen), sets)], iterations=3, warmup=1)
    assert seen[:6] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]  # warmup: every set
    assert seen[6:] == [("a", 0), ("b", 1), ("a", 2), ("b", 0), ("a", 1), ("b", 2)]
    with pytest.raises(ValueError, match=r"calls\[1\]: its list of input sets is empty"):
        bench.time_interleaved([(_Seen("a", seen), sets), (_Seen("b", seen), [])])


def test_time_kernels_needs_arguments():
    with pytest.raises(ValueError, match="arg_sets"):
        bench.time_kernels(lambda a: a, [])


def test_records_written_with_environment(tmp_path):
    rec = bench.Record(op="matmul", shape="256x256x256", dtype="f32", implementation="xla", mode="fwd",
                       time_us=10.0, method="wall", flops=2 * 256**3, bytes_moved=3 * 256 * 256 * 4,
                       floor_us=5.0, speedup_vs={"other": 1.5}).finish()
    assert rec.tflops_per_s == pytest.approx(2 * 256**3 / 10e-6 / 1e12)
    assert rec.ratio_to_floor == 2.0
    path = bench.write_results([rec], str(tmp_path / "r.json"))
    data = json.load(open(path))
    assert {"device", "jax", "commit", "date"} <= set(data["environment"])
    assert data["records"][0]["speedup_vs"] == {"other": 1.5}
    assert "speedup vs other" in open(tmp_path / "r.md").read()


def test_the_tables_header_names_the_timing_of_the_records_that_ran(tmp_path):
    """A skipped implementation's record (method "failed", NaN time) first in the list leaves the header naming the
    method that timed the others, not "failed"."""
    common = dict(op="matmul", shape="16x4096x4096", dtype="bf16", mode="fwd", flops=1.0, bytes_moved=1.0,
                  floor_us=1.0)
    skipped = bench.Record(implementation="pallas_mosaic", time_us=float("nan"), method="failed", **common)
    timed = bench.Record(implementation="xla", time_us=10.0, method="cupti", **common)
    bench.write_results([skipped.finish(), timed.finish()], str(tmp_path / "r.json"))
    assert "(cupti timing)." in open(tmp_path / "r.md").read()


@pytest.mark.parametrize("device,tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("cpu", "cpu"),
                                        ("NVIDIA GeForce RTX 4090", "nvidia_geforce_rtx_4090"), ("", "unknown")])
def test_device_tag_names_result_files(device, tag):
    assert bench.device_tag(device) == tag


def test_roofline():
    h100 = costmodel.device("H100")
    assert h100.hbm_bytes_per_s == 2.94e12  # measured ceiling preferred over the datasheet
    # 2 GiB read + written: memory-bound
    t = h100.roofline_us(2 * 2**31, flops=0, launches=1)
    assert t == pytest.approx(2 * 2**31 / 2.94e12 * 1e6 + h100.launch_us)
    # 8192³ matmul: compute-bound
    assert h100.roofline_us(3 * 8192**2 * 2, 2 * 8192**3, launches=0) == pytest.approx(2 * 8192**3 / 805e12 * 1e6)
    unfused, fused = h100.fusion_saving_us(2**20, n_ops=4)
    assert unfused == pytest.approx(4 * fused)
    with pytest.raises(ValueError, match="unknown 'tpu'"):
        costmodel.device("tpu")
    # "cpu" here; "NVIDIA H200" on an H200, whose device kind is "NVIDIA H200"
    assert costmodel.detect().name.lower() in jax.devices()[0].device_kind.lower()


@pytest.mark.parametrize("kind, key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100_pcie"), ("NVIDIA H100 NVL", "h100_nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200_nvl"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100_40gb"), ("NVIDIA A100-PCIE-40GB", "a100_40gb"),
    ("NVIDIA A100 80GB PCIe", "a100_pcie"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA A10", "a10"),
    ("TPU v4", "tpu_v4"), ("TPU v5 lite", "tpu_v5e"), ("TPU v5e", "tpu_v5e"), ("TPU v5", "tpu_v5p"),
    ("TPU v5p", "tpu_v5p"), ("TPU v6 lite", "tpu_v6e"), ("cpu", "cpu"),
    # no figures here: another part's would mislead (the GH200's memory, the A10G's clocks, the L40's)
    ("NVIDIA GH200 480GB", None), ("NVIDIA A10G", None), ("NVIDIA L40", None), ("NVIDIA GeForce RTX 4090", None),
    ("Tesla T4", None), ("", None),
])
def test_lookup_takes_each_part_by_its_device_kind(kind, key):
    assert costmodel.lookup(kind) is (costmodel.DEVICES[key] if key else None)


def test_h100_pcie_is_not_the_sxm_part():
    """The PCIe card's bandwidth is 1.7x below the SXM part's: a report with the SXM figures would say so wrong."""
    pcie, sxm = costmodel.lookup("NVIDIA H100 PCIe"), costmodel.lookup("NVIDIA H100 80GB HBM3")
    assert sxm.hbm_bytes_per_s / pcie.hbm_bytes_per_s == pytest.approx(2.94e12 / 2.0e12)


def test_device_figures_from_text_and_what_is_wrong_with_them():
    spec = costmodel.from_figures("hbm=1.008e12, bf16=165e12, fp32=82.6e12, launch_us=3, l2=75e6, name=RTX 4090")
    assert (spec.name, spec.hbm_bytes_per_s, spec.bf16_flops_per_s, spec.fp32_flops_per_s, spec.launch_us,
            spec.l2_bytes) == ("RTX 4090", 1.008e12, 165e12, 82.6e12, 3.0, 75_000_000)
    for text, match in [("hbm=1e12", "needs bf16="), ("bf16=1e12", "needs hbm="), ("hbm=fast,bf16=1", "hbm='fast'"),
                        ("hbm=0,bf16=1", "hbm='0' must be a positive"), ("hbm=1,bf16=inf", "bf16='inf'"),
                        ("hbm=1,bf16=2,clock=3", "'clock=3' is not one of"), ("h100x", "'h100x' is not one of")]:
        with pytest.raises(ValueError, match=match):
            costmodel.from_figures(text)


def test_detect_reads_the_environment_then_the_device_kind(monkeypatch):
    class Device:
        platform, device_kind = "gpu", "NVIDIA GeForce RTX 4090"

    monkeypatch.setattr(jax, "devices", lambda: [Device()])
    monkeypatch.delenv(costmodel.DEVICE_ENV, raising=False)
    assert costmodel.detect() is None  # no figures for this part: nothing guessed
    assert "no roofline figures for 'NVIDIA GeForce RTX 4090'" in costmodel.no_figures_note()
    monkeypatch.setenv(costmodel.DEVICE_ENV, "hbm=1.008e12,bf16=165e12")
    assert costmodel.detect().hbm_bytes_per_s == 1.008e12
    monkeypatch.setenv(costmodel.DEVICE_ENV, "H200")
    assert costmodel.detect() is costmodel.DEVICES["h200"]
    monkeypatch.setenv(costmodel.DEVICE_ENV, "b300")
    with pytest.raises(ValueError, match="JAXFUSE_DEVICE: 'b300' is not one of"):
        costmodel.detect()
    monkeypatch.delenv(costmodel.DEVICE_ENV)
    Device.device_kind = "NVIDIA H100 PCIe"
    assert costmodel.detect() is costmodel.DEVICES["h100_pcie"]


def test_shape_args_parse_sizes_and_name_what_is_wrong(capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="script")
    parser.add_argument("--shape", type=bench.shape_arg("MxKxN"), default="32768x4096x4096")
    parser.add_argument("--shapes", type=bench.shapes_arg("MxK"), default="4096x4096,8192x4096")
    args = parser.parse_args([])
    assert args.shape == (32768, 4096, 4096) and args.shapes == [(4096, 4096), (8192, 4096)]
    for argv, message in ((["--shape", "12x"], "expected MxKxN (3 positive integers joined by 'x'), got '12x'"),
                          (["--shape", "4096x0x4096"], "got '4096x0x4096'"),
                          (["--shapes", "4096x4096,8192"], "expected MxK (2 positive integers joined by 'x'), got "
                                                           "'8192'"),
                          (["--shapes", ","], "expected one or more MxK joined by ',', got ','")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert "usage: script" in err and message in err and "Traceback" not in err


def test_max_difference_keeps_a_nan_wherever_it_comes():
    """The largest difference between two programs' outputs, as the A/B scripts report it: a NaN in any output (the
    second, the last) comes back NaN, where Python's max over the pairs read max(0.0, nan) as 0.0."""
    x = jnp.asarray([1.0, -2.0, 3.0], jnp.bfloat16)
    y = jnp.asarray([1.0, -2.5, 3.0], jnp.float32)
    nan = jnp.asarray([1.0, jnp.nan, 3.0], jnp.float32)
    assert bench.max_difference([(x, x), (x, y)]) == 0.5
    assert bench.max_difference([(x, y)], relative=True) == pytest.approx(0.5 / 3.0)
    assert bench.max_difference([(x, x), (x, nan)]) != bench.max_difference([(x, x), (x, nan)])  # NaN
    assert bench.max_difference([(nan, x), (x, x)]) != bench.max_difference([(nan, x), (x, x)])
    assert bench.max_difference([(jnp.zeros((0,)), jnp.zeros((0,))), (x, x)]) == 0.0
    # the suite's rel_error over the outputs and the training comparison's loss gap take the same rule
    assert bench.worst([1e-3, float("nan"), 2e-3]) != bench.worst([1e-3, float("nan"), 2e-3])
    assert bench.worst(v for v in (1e-3, 2e-3)) == 2e-3
    assert bench.worst([]) != bench.worst([]) and bench.worst([], default=0.0) == 0.0


def test_cupti_concurrency_script_times_in_several_processes_at_once(tmp_path):
    """benchmarks/scripts/cupti_concurrency.py: 2 processes timing a matmul together, with CUPTI detached after each
    window and not, each one's exit status, calls and median recorded (on a GPU by CUPTI: the question it asks; here
    by the wall clock)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "scripts", "cupti_concurrency.py")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--processes", "2", "--seconds", "1",
                           "--detach", "never,each", "--allow-cpu"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = tmp_path.iterdir()
    rows = json.loads(path.read_text())["timings"]
    assert [(r["detach"], r["processes"]) for r in rows] == [("never", 2), ("each", 2)]
    for row in rows:
        assert row["exit_codes"] == [0] * row["processes"], row["stderr_tails"]
        assert all(c >= 1 for c in row["calls"]) and all(m > 0 for m in row["median_us"])
        assert set(row["method"]) == {"cupti" if jax.default_backend() == "gpu" else "wall"}
    bad = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--processes", "0", "--allow-cpu"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "--processes: each count must be at least 1, got '0'" in bad.stderr
    bad = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--detach", "sometimes", "--allow-cpu"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "--detach: expected never, each or both (comma-separated), got 'sometimes'" \
        in bad.stderr
    attention = subprocess.run([sys.executable, script, "--out", str(tmp_path / "attention"), "--processes", "1",
                                "--seconds", "1", "--detach", "never", "--program", "attention", "--allow-cpu"],
                               capture_output=True, text=True, timeout=300, env=env)
    assert attention.returncode == 0, attention.stderr[-2000:]
    (row,) = json.loads(next((tmp_path / "attention").iterdir()).read_text())["timings"]
    assert row["program"] == "attention" and row["exit_codes"] == [0] and row["calls"][0] >= 1


class _FakeCupti:
    """jax's CUPTI extension as time_kernels calls it: records each window's detach argument."""

    def __init__(self):
        self.detached = []

    def _cupti_init(self):
        pass

    def _cupti_get_timings(self, finalize):
        self.detached.append(finalize)
        return [("gemm", 0.01)]


@pytest.mark.parametrize("setting,detached", [(None, False), ("never", False), ("each", True)])
def test_cupti_stays_attached_between_windows_unless_asked(monkeypatch, setting, detached):
    """Each timed call is a CUPTI window; CUPTI is detached after each only with JAXFUSE_CUPTI_DETACH=each."""
    fake = _FakeCupti()
    monkeypatch.setattr(bench, "_cupti_ext", lambda: fake)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    if setting is None:
        monkeypatch.delenv("JAXFUSE_CUPTI_DETACH", raising=False)
    else:
        monkeypatch.setenv("JAXFUSE_CUPTI_DETACH", setting)
    timing = bench.time_kernels(jax.jit(lambda a: a + 1), [(jnp.ones(4),)], iterations=3, warmup=1)
    assert fake.detached == [detached] * 3
    assert timing.method == "cupti" and timing.median_us == pytest.approx(10.0)


def _locked_elsewhere(path) -> bool:
    """Whether another open file's non-blocking exclusive flock on ``path`` is refused (someone holds it)."""
    import fcntl

    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_each_cupti_window_holds_the_lock_file_when_one_is_named(monkeypatch, tmp_path):
    """JAXFUSE_CUPTI_LOCK: every window (CUPTI attached, the call, the flush) holds an exclusive lock on that file,
    released between windows; without the variable no lock is taken."""
    lock = tmp_path / "cupti.lock"
    held = []

    class Checking(_FakeCupti):
        def _cupti_init(self):
            held.append(_locked_elsewhere(lock))

        def _cupti_get_timings(self, finalize):
            held.append(_locked_elsewhere(lock))
            return super()._cupti_get_timings(finalize)

    monkeypatch.setattr(bench, "_cupti_ext", lambda: Checking())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("JAXFUSE_CUPTI_LOCK", str(lock))
    bench.time_kernels(jax.jit(lambda a: a + 1), [(jnp.ones(4),)], iterations=2, warmup=0)
    assert held == [True] * 4 and not _locked_elsewhere(lock)
    monkeypatch.delenv("JAXFUSE_CUPTI_LOCK")
    held.clear()
    bench.time_interleaved([(jax.jit(lambda a: a * 2), (jnp.ones(4),))], iterations=2, warmup=0)
    assert held == [False] * 4


def test_cupti_detach_setting_is_checked_before_anything_runs(monkeypatch):
    monkeypatch.setenv("JAXFUSE_CUPTI_DETACH", "sometimes")
    monkeypatch.setattr(bench, "_cupti_ext", lambda: _FakeCupti())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    calls = []
    with pytest.raises(ValueError, match="JAXFUSE_CUPTI_DETACH: expected 'never' or 'each', got 'sometimes'"):
        bench.time_kernels(lambda a: calls.append(a) or a, [(jnp.ones(4),)], iterations=1, jit=False)
    assert calls == []  # not even the warmup ran


@pytest.mark.parametrize("iterations, warmup", [(0, 2), (-1, 2), (3, -1)])
def test_timing_refuses_no_iterations(iterations, warmup):
    with pytest.raises(ValueError, match=f"need iterations >= 1 and warmup >= 0, got {iterations}, {warmup}"):
        bench.time_kernels(lambda a: a, [(jnp.ones(4),)], iterations=iterations, warmup=warmup)
    with pytest.raises(ValueError, match=f"need iterations >= 1 and warmup >= 0, got {iterations}, {warmup}"):
        bench.time_interleaved([(lambda a: a, (jnp.ones(4),))], iterations=iterations, warmup=warmup)


def test_interleaved_timing_checks_the_detach_setting_before_anything_runs(monkeypatch):
    monkeypatch.setenv("JAXFUSE_CUPTI_DETACH", "sometimes")
    monkeypatch.setattr(bench, "_cupti_ext", lambda: _FakeCupti())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    calls = []
    fn = jax.jit(lambda a: a + 1)
    with pytest.raises(ValueError, match="JAXFUSE_CUPTI_DETACH: expected 'never' or 'each', got 'sometimes'"):
        bench.time_interleaved([(lambda a: calls.append(a) or fn(a), (jnp.ones(4),))])
    assert calls == []
