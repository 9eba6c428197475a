"""hlo_inspect.ncu: Nsight Compute's text report read back on any machine (a report as ncu printed it on the H200)."""

import json

import pytest

from hlo_inspect import ncu

# One launch as ncu printed it on the H200 (benchmarks/results/ncu_core_14336_6144-h200-9e45f8b.txt: the Mosaic core
# at 4096x4096x14336), with the profiler's and the program's own lines around it.
_CORE = """\
==PROF== Profiling "mosaic_matmul_mosaic_gpu_kernel": 0%....50%....100% - 10 passes
case core_mosaic_4096x4096x14336
  mosaic_matmul_mosaic_gpu_kernel (132, 1, 1)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Warning: Data collection happened without fixed GPU frequencies. Profiling results may be inconsistent.
    Section: Command line profiler metrics
    ---------------------------------------------------------------------- ----------- ------------
    Metric Name                                                            Metric Unit Metric Value
    ---------------------------------------------------------------------- ----------- ------------
    dram__bytes_read.sum                                                         Mbyte       583.67
    gpu__time_duration.sum                                                          us       601.18
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active           %        97.42
    ---------------------------------------------------------------------- ----------- ------------

    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    SM Frequency                    Ghz         1.59
    Elapsed Cycles                cycle      965,596
    Duration                         us       601.18
    SM Active Cycles              cycle   913,288.48
    ----------------------- ----------- ------------

    INF   This workload is utilizing greater than 80.0% of the available compute or memory performance of the device.
"""


def _launch(name: str, elapsed: int, active: float, busy: float | None = None, grid=(132, 1, 1)) -> str:
    rows = [f"  {name} ({grid[0]}, {grid[1]}, {grid[2]})x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0",
            f"    Elapsed Cycles                cycle      {elapsed:,}",
            f"    SM Active Cycles              cycle   {active:,.2f}"]
    if busy is not None:
        rows.append(f"    {ncu.TENSOR_BUSY}           %        {busy:.2f}")
    return "\n".join(rows) + "\n"


def test_a_launch_reads_back_with_its_units_and_thousands_separators():
    (core,) = ncu.parse(_CORE)
    assert (core.name, core.grid, core.block) == ("mosaic_matmul_mosaic_gpu_kernel", (132, 1, 1), (384, 1, 1))
    assert core.metrics["dram__bytes_read.sum"] == ("Mbyte", 583.67)
    assert core.metrics["Elapsed Cycles"] == ("cycle", 965596.0)
    assert core.value("SM Active Cycles") == 913288.48 and core.value("no such metric") is None
    assert "Metric Name" not in core.metrics and not any("INF" in m for m in core.metrics)


def test_cycle_shares_split_the_elapsed_cycles_and_the_tensor_share_is_the_peak_fraction():
    (core,) = ncu.parse(_CORE)
    shares = core.cycle_shares()
    assert shares["sm_idle"] == pytest.approx(1 - 913288.48 / 965596)
    assert shares["tensor"] + shares["active_other"] + shares["sm_idle"] == pytest.approx(1.0)
    # the busy tensor cycles are the GEMM's FLOPs at 4096 per SM and cycle (132 SMs) to 0.1%
    busy_cycles = shares["tensor"] * core.value("Elapsed Cycles")
    assert busy_cycles == pytest.approx(2 * 4096 * 4096 * 14336 / (132 * 4096), rel=1e-3)
    assert ncu.parse(_launch("k", 1000, 900.0))[0].cycle_shares() == pytest.approx(
        {"sm_active": 0.9, "sm_idle": 0.1})  # without the tensor metric
    timed_only = "  k (1, 1, 1)x(128, 1, 1), Context 1, Stream 7\n    Duration   us   3.5\n"
    assert ncu.parse(timed_only)[0].cycle_shares() is None


def test_summary_takes_medians_per_kernel_and_tells_one_kernel_at_two_shapes_apart():
    text = (_launch("gemm", 1000, 950.0, 97.0) + _launch("gemm", 1010, 955.0, 97.2)  # one shape
            + _launch("other", 50, 40.0, grid=(66, 2, 1))
            + _launch("gemm", 2000, 1900.0, 96.0) + _launch("gemm", 1005, 940.0, 97.4))  # another, then the first
    rows = ncu.summary(ncu.parse(text))
    assert [(r["kernel"], r["launches"]) for r in rows] == [("gemm", 3), ("other", 1), ("gemm", 1)]
    assert rows[0]["median"]["Elapsed Cycles"] == ("cycle", 1005.0)
    assert rows[0]["cycle_shares"]["sm_active"] == pytest.approx(955 / 1010)  # the median launch's share
    assert rows[1]["grid"] == (66, 2, 1)
    assert rows[1]["cycle_shares"] == pytest.approx({"sm_active": 0.8, "sm_idle": 0.2})
    assert rows[2]["median"][ncu.TENSOR_BUSY] == ("%", 96.0)


def test_the_command_prints_a_line_per_kernel_and_writes_json(tmp_path, capsys):
    report = tmp_path / "report.txt"
    report.write_text(_CORE + _CORE)
    out = tmp_path / "summary.json"
    assert ncu.main([str(report), "--json", str(out), "--meta", "device=NVIDIA H200", "--meta", "commit=9e45f8b"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("mosaic_matmul_mosaic_gpu_kernel: 2x; 601.18 us; 1.59 Ghz; 97.42 tensor %; sm_active 0.946")
    saved = json.loads(out.read_text())
    assert saved["kernels"][0]["launches"] == 2 and len(saved["launches"]) == 2
    assert saved["meta"] == {"device": "NVIDIA H200", "commit": "9e45f8b"}


def test_the_command_prints_durations_in_the_unit_ncu_printed(tmp_path, capsys):
    """A 1.34 ms kernel is printed as ms (ncu switches from us to ms past 1000 us), never as 1.34 us."""
    report = tmp_path / "report.txt"
    report.write_text(_CORE.replace("Duration                         us       601.18",
                                    "Duration                         ms         1.34"))
    assert ncu.main([str(report)]) == 0
    assert "; 1.34 ms; 1.59 Ghz;" in capsys.readouterr().out


def test_a_missing_or_empty_report_is_one_line_and_status_2(tmp_path, capsys):
    assert ncu.main([str(tmp_path / "absent.txt")]) == 2
    assert "report: cannot read" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("==PROF== Disconnected from process 1\n")
    assert ncu.main([str(empty)]) == 2
    assert "holds no profiled kernel" in capsys.readouterr().err


# One launch with the per-opcode counts as ncu printed them with --print-metric-instances details on the H200
# (benchmarks/results/ncu_fused_opcodes-h200-87a5a1a.txt, the dx kernel's list cut to its first opcodes): names and
# values wrap across lines, a name's value sometimes on the next line.
_OPCODES = """\
  rmsnorm_matmul_dx_mosaic_gpu_kernel (128, 1, 1)x(512, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: Command line profiler metrics
    ------------------------------ ----------- ------------------------------
    Metric Name                    Metric Unit                   Metric Value
    ------------------------------ ----------- ------------------------------
    sass__inst_executed_per_opcode                       103,150,000 (UIADD3:
                                                           60,368,128; UIMAD:
                                                            25,445,632; HGMMA:
                                                 16,777,216; USETMAXREG: 2,095;
                                                        CGAERRBAR: 8,192; SEL: 548,737)
    smsp__inst_executed.sum               inst                    271,689,950
    ------------------------------ ----------- ------------------------------
"""
# The same metric printed with --print-metric-instances values: no names (the core at 16384x1024x5504, cut).
_VALUES_ONLY = """\
  mosaic_matmul_mosaic_gpu_kernel (132, 1, 1)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    sass__inst_executed_per_opcode                                                            61,113,868 (14,025,888;
                                                                                                4,541,653; 4,374,480;
                                                                                                 2,640; 1,584; 1,584)
    sm__cycles_elapsed.avg.per_second                                              Ghz                           1.52
"""


def test_per_opcode_counts_read_back_with_their_names_across_wrapped_lines():
    (dx,) = ncu.parse(_OPCODES)
    counts = dx.instances[ncu.PER_OPCODE]
    assert counts == {"UIADD3": 60368128, "UIMAD": 25445632, "HGMMA": 16777216, "USETMAXREG": 2095,
                      "CGAERRBAR": 8192, "SEL": 548737}
    assert dx.value(ncu.PER_OPCODE) == 103150000 == sum(counts.values())  # the total, as printed
    assert dx.metrics["smsp__inst_executed.sum"] == ("inst", 271689950)  # the row after the list still reads
    (core,) = ncu.parse(_VALUES_ONLY)
    assert core.value(ncu.PER_OPCODE) == 61113868 and core.instances == {}
    assert core.metrics["sm__cycles_elapsed.avg.per_second"] == ("Ghz", 1.52)


def test_the_summary_takes_each_opcodes_median_and_ranks_them_per_hgmma(capsys, tmp_path):
    other = _OPCODES.replace("60,368,128", "60,368,130").replace("SEL: 548,737", "BRA: 7")
    (row,) = ncu.summary(ncu.parse(_OPCODES + other))
    counts = row["instances"][ncu.PER_OPCODE]
    assert row["launches"] == 2 and counts["UIADD3"] == 60368129 and counts["SEL"] == 548737 / 2
    lines = ncu.opcode_lines(row, top=2)
    assert lines[0].startswith("UIADD3 60.37 M (") and lines[0].endswith(", 3.60 per HGMMA)")
    assert len(lines) == 2 and lines[1].startswith("UIMAD")
    assert ncu.opcode_lines(ncu.summary(ncu.parse(_VALUES_ONLY))[0]) == []
    report = tmp_path / "report.txt"
    report.write_text(_OPCODES)
    assert ncu.main([str(report), "--json", str(tmp_path / "out.json")]) == 0
    assert "most executed: UIADD3 60.37 M" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["kernels"][0]["instances"][ncu.PER_OPCODE]["HGMMA"] == 16777216
    assert saved["launches"][0]["instances"][ncu.PER_OPCODE]["UIMAD"] == 25445632
