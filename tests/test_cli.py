"""The two command-line tools end to end on CPU: `hlo-inspect FILE` and `jaxfuse inspect`."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import CPU_ONLY
from hlo_inspect import cli as hlo_cli
from jaxfuse import cli as jaxfuse_cli
from pallas_kernels.norm_matmul import config as nm_config

DATA = os.path.join(os.path.dirname(__file__), "data")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hlo_inspect_table(capsys):
    assert hlo_cli.main([os.path.join(DATA, "h100_mlp_grad.hlo.txt")]) == 0
    out = capsys.readouterr().out
    assert "15 kernels" in out and "gemm_fusion_dot.2" in out and "B/up" in out


def test_hlo_inspect_json(capsys):
    assert hlo_cli.main([os.path.join(DATA, "h100_cudnn_attention.hlo.txt"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [k["category"] for k in data["kernels"]] == ["cudnn"]


def test_hlo_inspect_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("HloModule m\nENTRY %main {\n  %x = f32[4]{0} wat(1)\n}\n")
    assert hlo_cli.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "unknown opcode 'wat'" in err
    assert hlo_cli.main([str(tmp_path / "missing.txt")]) == 2
    assert hlo_cli.main([]) == 2


def test_hlo_inspect_reads_the_optimized_module_of_a_dump_folder(tmp_path, capsys):
    """A folder XLA_FLAGS=--xla_dump_to wrote: its one optimized module is read; with several, they are listed;
    with none, the message says what it looked for."""
    with open(os.path.join(DATA, "cpu_mlp_grad.hlo.txt")) as f:
        text = f.read()
    (tmp_path / "module_0004.jit_step.before_optimizations.txt").write_text("HloModule jit_step\n")
    (tmp_path / "module_0004.jit_step.cpu_after_optimizations-buffer-assignment.txt").write_text("not HLO\n")
    assert hlo_cli.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "without an optimized module" in err and "--xla_dump_to" in err
    (tmp_path / "module_0004.jit_step.cpu_after_optimizations.txt").write_text(text)
    assert hlo_cli.main([str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["kernels"] and "holds one optimized module: module_0004.jit_step" in err
    (tmp_path / "module_0001.jit_iota.sm_9.0_gpu_after_optimizations.txt").write_text(text)
    assert hlo_cli.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds 2 optimized modules; pass one of them" in err
    assert err.index("module_0001.jit_iota") < err.index("module_0004.jit_step")  # by module number


def test_hlo_inspect_says_a_dump_folder_cannot_be_read(tmp_path, capsys, monkeypatch):
    from hlo_inspect import passes

    def denied(folder):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(passes.os, "listdir", denied)
    assert hlo_cli.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"hlo-inspect: cannot read the folder {tmp_path}: Permission denied\n"


def test_hlo_inspect_help(capsys):
    assert hlo_cli.main(["--help"]) == 0
    assert "--json" in capsys.readouterr().out


def test_jaxfuse_help_lists_verbs(capsys):
    assert jaxfuse_cli.main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    assert jaxfuse_cli.main(["inspect", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--batch", "--seq", "--dim", "--dtype", "train_step", "json", "--kernels"):
        assert flag in out
    assert ".py:" not in out and "--flagfile" not in out  # no module header (a file path), no absl flags


def test_jaxfuse_bad_flags(capsys):
    assert jaxfuse_cli.main(["frobnicate"]) == 2
    assert "unknown verb" in capsys.readouterr().err
    assert jaxfuse_cli.main(["inspect", "--dtype", "f64"]) == 2
    assert jaxfuse_cli.main(["inspect", "--kernels", "attention=magic"]) == 2
    assert "attention" in capsys.readouterr().err


def test_jaxfuse_traceback_env_reraises(monkeypatch, capsys):
    assert jaxfuse_cli.main(["inspect", "--kernels", "attention=magic"]) == 2
    assert "JAXFUSE_TRACEBACK=1" in capsys.readouterr().err
    monkeypatch.setenv("JAXFUSE_TRACEBACK", "1")
    with pytest.raises(ValueError, match="magic"):
        jaxfuse_cli.main(["inspect", "--kernels", "attention=magic"])


@CPU_ONLY
def test_jaxfuse_inspect_forward_json(capsys):
    assert jaxfuse_cli.main(["inspect", "--seq", "16", "--dim", "64", "--heads", "2", "--kv-heads", "1",
                             "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["platform"] == "cpu" and data["kernels"]
    scopes = {s for k in data["kernels"] for s in k["scopes"]}
    assert any(s.startswith("attn") for s in scopes) and any(s.startswith("mlp") for s in scopes)
    # on CPU, with no custom calls, our totals equal XLA's cost analysis
    for row in data["comparison"]:
        assert row["ours"] == pytest.approx(row["xla"], rel=1e-6), row
    assert "interpret mode" not in capsys.readouterr().err


def test_jaxfuse_inspect_without_device_figures_says_so(monkeypatch, capsys):
    """A device costmodel has no figures for: the table and the ledger's bytes, no predicted times, and how to
    give the figures."""
    from jaxfuse import costmodel

    monkeypatch.setattr(costmodel, "detect", lambda: None)
    assert jaxfuse_cli.main(["inspect", "--seq", "16", "--dim", "64", "--heads", "2", "--kv-heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "no roofline figures for" in out and "JAXFUSE_DEVICE=hbm=" in out
    assert "fusion saving on" not in out and "HBM round trips" in out


@pytest.mark.skipif(__import__("jax").default_backend() != "gpu", reason="--measure times kernels on a GPU")
def test_jaxfuse_inspect_measure_on_a_mesh_adds_the_device_timeline(capsys):
    """On a mesh, --measure also prints the per-device trace table (one GPU: data=1, no collective)."""
    assert jaxfuse_cli.main(["inspect", "--model", "lm", "--train-step", "--batch", "2", "--seq", "128", "--dim",
                             "256", "--heads", "4", "--kv-heads", "2", "--mesh", "data=1", "--measure",
                             "--no-ledger"]) == 0
    out = capsys.readouterr().out
    assert "per device, from a profiler trace" in out
    row = next(line for line in out.splitlines() if line.startswith("| /device:GPU:0 |"))
    span, compute, collective = (float(v) for v in row.split("|")[2:5])
    assert 0 < compute <= span and collective == 0.0


@CPU_ONLY
def test_jaxfuse_inspect_pallas_on_cpu_says_interpret_mode(capsys):
    assert jaxfuse_cli.main(["inspect", "--seq", "16", "--dim", "64", "--heads", "2", "--kv-heads", "1",
                             "--kernels", "norm_matmul=pallas", "--json", "--no-ledger"]) == 0
    err = capsys.readouterr().err
    assert "Pallas kernels (norm_matmul) run in interpret mode" in err


def test_jaxfuse_inspect_triton_ir_on_cpu(capsys):
    small = ["--seq", "64", "--dim", "128", "--heads", "2", "--kv-heads", "1", "--train-step"]
    assert jaxfuse_cli.main(["inspect", *small, "--kernels", "attention=pallas_triton", "--triton-ir", "--json"]) == 0
    kernels = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in kernels] == ["flash_attention_fwd", "flash_attention_dkdv", "flash_attention_dq"]
    assert all(k["text"].lstrip().startswith("module") and k["op_counts"]["tt.dot"] >= 2 for k in kernels)
    assert jaxfuse_cli.main(["inspect", *small, "--kernels", "norm_matmul=pallas_triton", "--triton-ir"]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm_matmul_fwd: grid" in out and "rmsnorm_matmul_dx: grid" in out and "flash" not in out
    assert jaxfuse_cli.main(["inspect", *small, "--triton-ir"]) == 2
    assert "no site runs a Pallas kernel" in capsys.readouterr().err


def test_triton_ir_names_the_sites_that_lower_as_mosaic(capsys):
    """'pallas' (auto) lowers norm_matmul as Mosaic GPU where its tiles divide the shape, attention at head dim 64
    but not 32 (as Triton there): said per site, as resolved."""
    small = ["--seq", "64", "--dim", "128", "--heads", "2", "--kv-heads", "1"]
    assert jaxfuse_cli.main(["inspect", *small, "--kernels", "all=pallas", "--triton-ir"]) == 2
    err = capsys.readouterr().err
    assert ("jaxfuse inspect: triton_ir: no Triton kernel to show: attention=pallas, norm_matmul=pallas lower for "
            "CUDA as Mosaic GPU kernels ('pallas' takes Mosaic where it runs these shapes, as on an H100), not "
            "Triton: name pallas_triton") in err and "see them with --mosaic-ir" in err
    assert jaxfuse_cli.main(["inspect", *small, "--kernels", "attention=pallas", "--triton-ir"]) == 2
    err = capsys.readouterr().err
    assert "jaxfuse inspect: triton_ir: no Triton kernel to show: attention=pallas lowers for CUDA as Mosaic" in err
    assert jaxfuse_cli.main(["inspect", *small, "--heads", "4", "--kv-heads", "2", "--kernels", "all=pallas",
                             "--triton-ir"]) == 0  # head dim 32: Mosaic does not take it, so 'pallas' is Triton
    out, err = capsys.readouterr()
    assert "flash_attention_fwd: grid" in out and "rmsnorm_matmul" not in out
    assert ("note: left out: norm_matmul=pallas lowers for CUDA as Mosaic GPU kernels" in err
            and "attention=" not in err.split("left out:")[1])


def test_jaxfuse_inspect_mosaic_ir_on_cpu(capsys, monkeypatch):
    """--mosaic-ir lowers for CUDA on any machine and summarizes each Mosaic GPU kernel; the Triton sites are left
    out and named; without a Mosaic kernel, or with --triton-ir too, a clear error (exit 2). The built-in tables'
    forms on any machine: an H200's untuned rule runs XLA's backward at these few rows, with no dx kernel."""
    monkeypatch.setattr(nm_config, "UNTUNED_DEVICES", ())
    small = ["--seq", "64", "--dim", "128", "--heads", "2", "--kv-heads", "1"]
    argv = ["inspect", *small, "--train-step", "--kernels", "norm_matmul=pallas_mosaic", "--mosaic-ir", "--json"]
    assert jaxfuse_cli.main(argv) == 0
    kernels = json.loads(capsys.readouterr().out)
    names = [k["name"] for k in kernels]
    assert "rmsnorm_matmul_fwd" in names and "rmsnorm_matmul_dx" in names  # (dw by XLA: its output has few tiles)
    assert all(sum(k["wgmma"].values()) > 0 and k["tma_loads"] > 0 and 0 < k["smem_bytes"] <= 232448
               and k["warpgroups"] >= 2 for k in kernels)
    argv = ["inspect", *small, "--kernels", "attention=pallas_triton,norm_matmul=pallas_mosaic", "--mosaic-ir"]
    assert jaxfuse_cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "Mosaic GPU kernel(s) as lowered for CUDA" in out and "rmsnorm_matmul_fwd: grid" in out
    assert "flash" not in out and "note: left out: attention=pallas_triton lowers for CUDA as Triton" in err
    assert jaxfuse_cli.main(["inspect", *small, "--kernels", "all=pallas_triton", "--mosaic-ir"]) == 2
    err = capsys.readouterr().err
    assert ("mosaic_ir: no Mosaic GPU kernel to show: attention=pallas_triton, norm_matmul=pallas_triton lower for "
            "CUDA as Triton kernels: see them with --triton-ir") in err
    assert jaxfuse_cli.main(["inspect", *small, "--mosaic-ir"]) == 2
    assert "no site runs a Pallas kernel" in capsys.readouterr().err
    assert jaxfuse_cli.main(["inspect", *small, "--kernels", "all=pallas", "--mosaic-ir", "--triton-ir"]) == 2
    assert "does not combine with --measure, --html or the other IR flag" in capsys.readouterr().err


def test_triton_ir_counts_the_mosaic_kernels_a_triton_op_runs_itself(capsys):
    """The Triton-backend loss runs its chunks' GEMMs on the Mosaic core when lowered for Hopper: those kernels are
    left out of the Triton IR and counted in the note."""
    argv = ["inspect", "--model", "lm", "--train-step", "--seq", "64", "--dim", "128", "--heads", "2",
            "--kv-heads", "1", "--layers", "1", "--kernels", "loss=pallas_triton", "--triton-ir"]
    assert jaxfuse_cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "Pallas kernel(s)" in out
    note = re.search(r"note: left out: (\d+) Mosaic GPU kernel calls? that Triton-backend ops make themselves", err)
    assert note and int(note.group(1)) >= 1, err


def test_triton_ir_errors_without_a_pallas_site_get_no_mosaic_hint(capsys):
    argv = ["inspect", "--dim", "8", "--heads", "4", "--kv-heads", "2", "--kernels", "all=pallas_triton",
            "--triton-ir"]
    assert jaxfuse_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "must be a positive multiple of 16" in err and "Mosaic" not in err and "pallas_triton to see" not in err


@pytest.mark.slow
@pytest.mark.parametrize("args", [["inspect", "--train-step", "--seq", "16", "--dim", "64", "--heads", "2",
                                   "--kv-heads", "2", "--dtype", "f32"]])
def test_jaxfuse_console_script(args):
    """As a user runs it: a separate process through the module entry point."""
    proc = subprocess.run([sys.executable, "-m", "jaxfuse.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "train_step" in proc.stdout and "kernels by category" in proc.stdout
    assert "compiling" in proc.stderr  # progress goes to stderr, the report to stdout


def test_jaxfuse_diff_saved_files(capsys):
    a, b = os.path.join(DATA, "h100_block_fwd.hlo.txt"), os.path.join(DATA, "h100_block_grad.hlo.txt")
    assert jaxfuse_cli.main(["diff", "--a", a, "--b", b, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["kernels"] == [21, 61]
    assert sum(len(m["b"]) for m in data["matches"]) == 61


def test_jaxfuse_diff_xla_flags_errors(capsys):
    small = ["--seq", "16", "--dim", "64", "--heads", "2", "--kv-heads", "1"]
    assert jaxfuse_cli.main(["diff", "--a", "", "--b", "", "--b-xla-flags=--xla_no_such_option=1", *small]) == 2
    assert "xla_no_such_option" in capsys.readouterr().err
    assert jaxfuse_cli.main(["diff", "--a", "nonsense", "--b", "", *small]) == 2
    assert "neither an HLO text file nor a kernel spec" in capsys.readouterr().err


def test_parse_xla_flags():
    from hlo_inspect.formatting import parse_xla_flags

    assert parse_xla_flags("--xla_gpu_enable_triton_gemm=false --xla_disable_hlo_passes=a,b --xla_x") == {
        "xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "a,b", "xla_x": True}
    with pytest.raises(ValueError, match="not an XLA flag"):
        parse_xla_flags("--foo=1")


def test_jaxfuse_passes(capsys):
    small = ["--seq", "16", "--dim", "64", "--heads", "2", "--kv-heads", "1"]
    assert jaxfuse_cli.main(["passes", *small, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "hlo_inspect.passes/1" and len(data["steps"]) > 2
    assert jaxfuse_cli.main(["passes", *small]) == 0
    out = capsys.readouterr().out
    assert "final kernels and the pass that created them" in out


def test_flag_spelling():
    assert jaxfuse_cli._normalize(["--train-step", "--no-ledger", "--kv-heads=2", "x-y"]) == [
        "--train_step", "--noledger", "--kv_heads=2", "x-y"]


@CPU_ONLY
def test_bench_writes_json_and_markdown_and_prints_the_table(tmp_path, capsys):
    """`jaxfuse bench` on the CPU at the suite's smoke shape: <op>-cpu.json and .md (the tag mapping itself is
    test_bench.test_device_tag_names_result_files), and the table."""
    assert jaxfuse_cli.main(["bench", "--op", "cross_entropy", "--shapes", "cpu", "--iterations", "1",
                             "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cross_entropy-cpu.json", "cross_entropy-cpu.md"]
    records = json.load(open(tmp_path / "cross_entropy-cpu.json"))["records"]
    assert {(r["implementation"], r["mode"]) for r in records} >= {("pallas_triton", "fwd+bwd"),
                                                                    ("xla", "fwd+bwd")}
    assert "| cross_entropy | 64x64x1000 |" in capsys.readouterr().out


@CPU_ONLY
def test_bench_refuses_gpu_sized_shapes_on_cpu(capsys):
    assert jaxfuse_cli.main(["bench", "--op", "train_step", "--shapes", "small", "--out", ""]) == 2
    assert "['small'] are GPU-sized; on cpu (interpret mode) train_step runs ['tiny']" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_tune_writes_the_sweep_and_the_tuned_configs(tmp_path, capsys):
    """`jaxfuse bench --tune` on the smoke shape (on any device): every candidate checked, the winner in
    --tuned-configs, the suite run with it; the files named by the device ("cpu", "h200")."""
    import jax

    from jaxfuse import bench

    tag = bench.device_tag(jax.devices()[0].device_kind)
    tuned = tmp_path / "tuned.json"
    assert jaxfuse_cli.main(["bench", "--op", "cross_entropy", "--shapes", "cpu", "--tune", "--tuned-configs",
                             str(tuned), "--iterations", "1", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"cross_entropy-{tag}.json", f"cross_entropy-{tag}.md",
                                                          f"cross_entropy-sweep-{tag}.json", "tuned.json"]
    rows = json.load(open(tmp_path / f"cross_entropy-sweep-{tag}.json"))["rows"]
    assert rows and all(r["status"] == "ok" for r in rows)
    records = json.load(open(tmp_path / f"cross_entropy-{tag}.json"))["records"]
    pallas = [r for r in records if r["implementation"] == "pallas_triton"]
    assert pallas and all(r["extra"]["config_source"] == f"tuned ({tuned})" for r in pallas)
    assert "stored as" in capsys.readouterr().out


def test_cli_functions_take_plain_arguments_and_return_data():
    from jaxfuse import models, programs, train

    a, b = os.path.join(DATA, "h100_block_fwd.hlo.txt"), os.path.join(DATA, "h100_block_grad.hlo.txt")
    assert programs.diff_programs(a, b).to_dict()["summary"]["kernels"] == [21, 61]
    program = programs.build_program(seq=16, dim=64, heads=2, kv_heads=1)
    report = programs.inspect_program(program, progress=lambda message: None)
    assert report.program is program and program.description in report.title
    text = report.fusion_saving_text("cpu", 50e9, 1e12, 1.0)
    assert text.startswith("fusion saving on cpu (roofline + 1 µs per launch): ") and "× from fusion" in text
    with pytest.raises(ValueError, match="no site runs a Pallas kernel"):
        programs.triton_kernels(program)
    # The default model shape is defined once (Config.block_default) and read by the program, training and CLI.
    default = models.Config.block_default()
    assert (programs.DEFAULT_MODEL.dim, train.TrainConfig().dim, train.TrainConfig().layers) == (
        default.dim, default.dim, default.n_layers)
