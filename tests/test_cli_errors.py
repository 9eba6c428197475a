"""`jaxfuse` as a new user meets it on a CPU machine: every mistake ends in one line and exit status 2, before any
long work; nothing ends in a traceback (issue 18)."""

import json
import os
import re

import jax
import pytest

from jaxfuse import cli, kernels, programs
from jaxfuse.kernels import KernelSet

DATA = os.path.join(os.path.dirname(__file__), "data")
SMALL = ["--seq", "16", "--dim", "64", "--heads", "2", "--kv-heads", "1"]
ON_CPU = jax.default_backend() == "cpu"
cpu_only = pytest.mark.skipif(not ON_CPU, reason="what a CPU-only machine says")


def run(capsys, *argv):
    """(exit status, stdout, stderr) of `jaxfuse ARGV`."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


def one_error(err: str) -> str:
    """The error line of stderr (progress lines before it, the JAXFUSE_TRACEBACK hint after it)."""
    lines = [line for line in err.splitlines() if line.startswith("jaxfuse ")]
    assert len(lines) == 1, err
    return lines[0]


# ---- 1. implementations this machine cannot run: said before anything compiles ------------------------------

@cpu_only
def test_cudnn_on_a_cpu_is_one_line_before_compiling(capsys):
    status, _, err = run(capsys, "inspect", "--kernels", "attention=cudnn")
    assert status == 2 and "compiling" not in err
    assert one_error(err) == ("jaxfuse inspect: kernels: attention=cudnn: needs an NVIDIA GPU with cuDNN; the default "
                              "JAX backend is 'cpu'")
    status, _, err = run(capsys, "diff", "--a", "attention=xla", "--b", "attention=cudnn", "--train-step")
    assert status == 2 and "compiling" not in err  # side A is not compiled first
    assert one_error(err).startswith("jaxfuse diff: B (attention=cudnn): kernels: attention=cudnn: needs an NVIDIA GPU")
    status, _, err = run(capsys, "train", "--kernels", "", "--kernels", "attention=cudnn", "--steps", "2")
    assert status == 2 and "step 0" not in err and "attention=cudnn: needs an NVIDIA GPU" in one_error(err)


@cpu_only
def test_pallas_mosaic_on_a_cpu_is_one_line_but_lowers_for_cuda(capsys, monkeypatch):
    status, _, err = run(capsys, "inspect", "--kernels", "all=pallas_mosaic")
    assert status == 2 and "compiling" not in err and "attention=pallas_mosaic: " in one_error(err)
    # Once an op implements Mosaic, the reason on a CPU is the GPU it needs; lowering for CUDA stays allowed.
    monkeypatch.setattr(kernels, "unimplemented_reason", lambda site, name: None)
    status, _, err = run(capsys, "inspect", *SMALL, "--kernels", "norm_matmul=pallas_mosaic")
    assert status == 2 and "compiling" not in err
    assert one_error(err) == ("jaxfuse inspect: kernels: norm_matmul=pallas_mosaic: Mosaic GPU kernels need an sm90 "
                              "(Hopper) GPU; this machine's default device is cpu")
    programs.check_kernels(KernelSet(norm_matmul="pallas_mosaic"), lowering_only=True)  # no error: --triton-ir


def test_an_implementation_of_another_site_says_which_site_has_it(capsys):
    status, _, err = run(capsys, "inspect", "--kernels", "all=cudnn")
    assert status == 2 and "compiling" not in err
    assert one_error(err) == ("jaxfuse inspect: KernelSet.norm_matmul: 'cudnn' exists only for the attention site "
                              "(name it there: attention=cudnn); norm_matmul takes one of ['pallas', "
                              "'pallas_mosaic', 'pallas_triton', 'xla', 'xla_f32']")
    with pytest.raises(ValueError, match=r"KernelSet.loss: unknown implementation 'magic'; expected one of"):
        KernelSet(loss="magic")


# ---- 2. bench on a CPU: the CPU shapes, said; GPU shapes refused first; a line per record with elapsed time --

@cpu_only
def test_bench_on_a_cpu_says_it_runs_the_cpu_shapes_and_shows_progress(tmp_path, capsys):
    status, out, err = run(capsys, "bench", "--op", "rmsnorm_matmul", "--impls", "xla,xla_matmul_alone",
                           "--iterations", "1", "--out", str(tmp_path))
    assert status == 0
    assert ("on cpu: rmsnorm_matmul's CPU shape ['cpu'] (Pallas in interpret mode, wall-clock timing); its GPU "
            "shapes ['32768x4096x4096',") in err
    records = [line for line in err.splitlines() if "µs" in line]
    assert len(records) == 4 and all(re.match(r"\[ *\d+\.\d s\]   \[37x64x32\] xla", line) for line in records), err
    status, _, err = run(capsys, "bench", "--op", "cross_entropy", "--shapes", "8k_128k", "--out", str(tmp_path))
    assert status == 2 and "benchmarking" not in err
    assert "['8k_128k'] are GPU-sized; on cpu (interpret mode) cross_entropy runs ['cpu']" in one_error(err)
    status, _, err = run(capsys, "bench", "--op", "rmsnorm_matmul", "--shapes", "8192x1536", "--out", str(tmp_path))
    assert status == 2 and "benchmarking" not in err
    assert "unknown '8192x1536'; rmsnorm_matmul has ['32768x4096x4096'," in one_error(err)
    assert "or a custom shape MxKxN (3 positive integers joined by 'x', e.g. 32768x4096x4096)" in one_error(err)


# ---- 3. paths and XLA flags: checked up front, one line --------------------------------------------------

def test_html_folders_are_made_like_train_out(tmp_path, capsys):
    a, b = os.path.join(DATA, "h100_block_fwd.hlo.txt"), os.path.join(DATA, "h100_block_grad.hlo.txt")
    page = tmp_path / "missing" / "dir" / "diff.html"
    assert run(capsys, "diff", "--a", a, "--b", b, "--html", str(page))[0] == 0 and page.is_file()
    page = tmp_path / "other" / "inspect.html"
    assert run(capsys, "inspect", *SMALL, "--no-ledger", "--html", str(page))[0] == 0 and page.is_file()


def test_paths_that_cannot_be_written_are_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = str(blocker / "sub")  # a folder below a file cannot exist
    for argv, flag in ((["inspect", *SMALL, "--html", bad + "/x.html"], "--html"),
                       (["diff", "--a", "", "--b", "", "--html", bad + "/x.html"], "--html"),
                       (["passes", *SMALL, "--dump-dir", bad], "--dump-dir"),
                       (["bench", "--op", "cross_entropy", "--out", bad], "--out"),
                       (["bench", "--op", "cross_entropy", "--tune", "--tuned-configs", bad + "/t.json"],
                        "--tuned-configs"),
                       (["train", "--steps", "2", "--out", bad + "/x.json"], "--out")):
        status, _, err = run(capsys, *argv)
        assert status == 2, argv
        assert one_error(err) == f"jaxfuse {argv[0]}: {flag} {bad}: cannot create the folder: Not a directory"
        assert not re.search("compiling|benchmarking|step 0", err), err
    status, _, err = run(capsys, "inspect", *SMALL, "--html", str(tmp_path))
    assert status == 2 and f"--html {tmp_path}: is a folder" in one_error(err)


def test_a_file_path_whose_folder_exists_but_takes_no_files_is_refused_before_compiling(capsys):
    status, _, err = run(capsys, "inspect", *SMALL, "--html", "/proc/x.html")  # /proc: no new files, even for root
    assert status == 2 and "compiling" not in err
    assert one_error(err) == "jaxfuse inspect: --html /proc/x.html: cannot write the file: No such file or directory"


def test_diff_takes_each_sides_kernels_from_a_and_b_only(capsys):
    status, _, err = run(capsys, "diff", "--kernels", "bogus=1", "--a", "", "--b", "")
    assert status == 2 and one_error(err) == "jaxfuse diff: Unknown command line flag 'kernels'"
    status, out, _ = run(capsys, "diff", "--help")
    assert status == 0 and "--a:" in out and "--kernels" not in out
    status, out, _ = run(capsys, "inspect", "--help")
    assert status == 0 and "--kernels:" in out


def test_an_xla_flag_xla_rejects_is_one_line_naming_it(capsys):
    for verb in ("inspect", "passes"):
        status, _, err = run(capsys, verb, *SMALL, "--xla-flags=--xla_cpu_enable_fast_math=maybe")
        assert status == 2
        line = one_error(err)
        assert line.startswith(f"jaxfuse {verb}: xla_flags --xla_cpu_enable_fast_math=maybe: XLA says: "), line
        assert "'maybe' is not a valid bool value" in line


def test_an_unexpected_error_is_one_line_with_status_1(capsys, monkeypatch):
    def broken(fv, rest):
        raise RuntimeError("something\ndeep")

    monkeypatch.setitem(cli.VERBS, "inspect", cli.Verb("x", cli._define_inspect_flags, broken))
    status, _, err = run(capsys, "inspect")
    assert status == 1 and one_error(err) == "jaxfuse inspect: internal error RuntimeError: something deep"
    assert "JAXFUSE_TRACEBACK=1" in err
    monkeypatch.setenv("JAXFUSE_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="something"):
        cli.main(["inspect"])


def test_out_of_memory_is_a_size_limit_with_status_2(capsys, monkeypatch):
    def too_big(fv, rest):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 3843092445412 bytes.")

    monkeypatch.setitem(cli.VERBS, "train", cli.Verb("x", cli._define_train_flags, too_big))
    status, _, err = run(capsys, "train")
    assert status == 2 and err == ("jaxfuse train: the program needs more memory than the device has (XLA asked for "
                                   "3,843,092,445,412 bytes, 3,579.2 GiB); try a smaller --batch, --seq or "
                                   "--layers\n")

    def too_big_unsized(fv, rest):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of\nmemory")

    monkeypatch.setitem(cli.VERBS, "bench", cli.Verb("x", cli._define_bench_flags, too_big_unsized))
    status, _, err = run(capsys, "bench")
    assert status == 2 and err == ("jaxfuse bench: the program needs more memory than the device has (XLA says: "
                                   "RESOURCE_EXHAUSTED: out of memory)\n")


def test_a_file_error_during_the_run_is_one_line(capsys, monkeypatch):
    def unreadable(fv, rest):
        open("/nonexistent/folder/file.txt")

    monkeypatch.setitem(cli.VERBS, "inspect", cli.Verb("x", cli._define_inspect_flags, unreadable))
    status, _, err = run(capsys, "inspect")
    assert status == 2 and one_error(err) == "jaxfuse inspect: /nonexistent/folder/file.txt: No such file or directory"


# ---- 4. diff says which side is bad ---------------------------------------------------------------------------

def test_diff_errors_name_the_side(tmp_path, capsys):
    good = os.path.join(DATA, "h100_block_fwd.hlo.txt")
    bad = tmp_path / "bad.hlo.txt"
    bad.write_text("HloModule m\nENTRY %main {\n  %x = f32[4]{0} wat(1)\n}\n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"HloModule m\n\xd0\xff\x00")
    status, _, err = run(capsys, "diff", "--a", str(bad), "--b", good)
    assert status == 2 and one_error(err).startswith(f"jaxfuse diff: A ({bad}): line 3: unknown opcode 'wat'")
    status, _, err = run(capsys, "diff", "--a", good, "--b", str(binary))
    assert status == 2 and one_error(err).startswith(
        f"jaxfuse diff: B ({binary}): not UTF-8 text (byte 0xd0 at offset 12)")
    status, _, err = run(capsys, "diff", "--a", "", "--b", "", "--b-xla-flags=--foo")
    assert status == 2 and one_error(err).startswith("jaxfuse diff: B (default kernels): xla_flags: '--foo'")


def test_diff_says_a_mistyped_path_is_missing_or_a_folder(tmp_path, capsys):
    good = os.path.join(DATA, "h100_block_fwd.hlo.txt")
    missing = str(tmp_path / "missing.hlo.txt")
    for a, said in ((missing, "no such file"), ("old.hlo.txt", "no such file"),
                    (str(tmp_path), "is a folder without an optimized module (module_*.*after_optimizations.txt, "
                                    "as --xla_dump_to writes them); expected an HLO text file or a kernel spec like "
                                    "'attention=cudnn'"),
                    ("attention", "'attention' is neither an HLO text file nor a kernel spec like 'attention=cudnn'")):
        status, _, err = run(capsys, "diff", "--a", a, "--b", good)
        assert status == 2 and one_error(err) == f"jaxfuse diff: A ({a}): {said}"


def test_diff_says_a_dump_folder_cannot_be_read(tmp_path, capsys, monkeypatch):
    from hlo_inspect import passes

    def denied(folder):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(passes.os, "listdir", denied)
    status, _, err = run(capsys, "diff", "--a", str(tmp_path), "--b", os.path.join(DATA, "h100_block_fwd.hlo.txt"))
    assert status == 2 and one_error(err) == f"jaxfuse diff: A ({tmp_path}): cannot read the folder: Permission denied"


def test_diff_takes_the_optimized_module_of_a_dump_folder(tmp_path, capsys):
    good = os.path.join(DATA, "h100_block_fwd.hlo.txt")
    with open(good) as f:
        text = f.read()
    (tmp_path / "module_0007.jit_block.sm_9.0_gpu_after_optimizations.txt").write_text(text)
    status, out, _ = run(capsys, "diff", "--a", str(tmp_path), "--b", good, "--json")
    matches = json.loads(out)["matches"] if status == 0 else []
    assert matches and all(row["kind"] == "same" for row in matches)  # the folder's module is the file itself
    (tmp_path / "module_0002.jit_iota.sm_9.0_gpu_after_optimizations.txt").write_text(text)
    status, _, err = run(capsys, "diff", "--a", str(tmp_path), "--b", good)
    assert status == 2 and one_error(err) == (
        f"jaxfuse diff: A ({tmp_path}): holds 2 optimized modules; pass one of them: "
        "module_0002.jit_iota.sm_9.0_gpu_after_optimizations.txt, module_0007.jit_block.sm_9.0_gpu_after_optimizations"
        ".txt; expected an HLO text file or a kernel spec like 'attention=cudnn'")


# ---- 5. --measure and other platforms' XLA flags on a CPU ------------------------------------------------------

@cpu_only
def test_measure_on_a_cpu_is_refused_before_compiling(capsys):
    status, _, err = run(capsys, "inspect", *SMALL, "--measure")
    assert status == 2 and "compiling" not in err
    assert one_error(err) == ("jaxfuse inspect: --measure times device kernels with CUPTI and needs an NVIDIA GPU; "
                              "this machine runs cpu (for CPU timings use `jaxfuse bench`)")


def test_other_platforms_xla_flags_get_a_warning():
    gpu_only = {"xla_gpu_enable_triton_gemm": False, "xla_cpu_enable_fast_math": True}
    assert programs.foreign_flags_warning(gpu_only, "cpu") == (
        "warning: --xla_gpu_enable_triton_gemm only affects GPU compiles; on this cpu machine it has no effect")
    assert programs.foreign_flags_warning(gpu_only, "gpu") == (
        "warning: --xla_cpu_enable_fast_math only affects CPU compiles; on this gpu machine it has no effect")
    assert programs.foreign_flags_warning({"xla_disable_hlo_passes": "a"}, "cpu") is None


@cpu_only
def test_inspect_warns_about_gpu_flags_on_a_cpu(capsys):
    status, _, err = run(capsys, "inspect", *SMALL, "--json", "--xla-flags=--xla_gpu_enable_triton_gemm=false")
    assert status == 0 and "warning: --xla_gpu_enable_triton_gemm only affects GPU compiles" in err


# ---- 7, 10. what the report says: interpret mode, warnings in text and JSON, the README's keys ------------------

@cpu_only
def test_interpret_mode_is_a_warning_of_the_report(capsys):
    status, out, _ = run(capsys, "inspect", *SMALL, "--kernels", "norm_matmul=pallas", "--json")
    assert status == 0
    warnings = json.loads(out)["warnings"]
    assert warnings and warnings[0].startswith("interpret mode: the Pallas kernels (norm_matmul) ran in interpret "
                                               "mode on the CPU")
    status, out, _ = run(capsys, "inspect", *SMALL, "--kernels", "norm_matmul=pallas", "--no-ledger")
    assert "\nwarning: interpret mode: the Pallas kernels (norm_matmul)" in out
    saving = next(line for line in out.splitlines() if line.startswith("fusion saving"))
    assert "while-loop bodies counted once on both sides" in saving


@cpu_only
def test_a_pallas_site_the_program_never_calls_brings_no_interpret_mode_warning(capsys):
    """The block has no loss site (only the LM's train step calls it): loss=pallas changes nothing there, so the
    report says nothing of interpret mode."""
    status, out, err = run(capsys, "inspect", *SMALL, "--kernels", "loss=pallas", "--json")
    assert status == 0 and not json.loads(out)["warnings"] and "interpret mode" not in err
    assert programs.build_program(model="lm", train_step=True, seq=16, dim=64, heads=2, kv_heads=1,
                                  layers=1, vocab=256).sites == ("attention", "norm_matmul", "loss")


def test_diff_shows_each_sides_warnings(tmp_path, capsys):
    text = open(os.path.join(DATA, "cpu_while_loop.hlo.txt"), encoding="utf-8").read()
    two = tmp_path / "two_modules.hlo.txt"
    two.write_text(text + "\n" + text)
    status, out, _ = run(capsys, "diff", "--a", os.path.join(DATA, "cpu_while_loop.hlo.txt"), "--b", str(two))
    assert status == 0 and "\nwarning (B): the text holds 2 HLO modules" in out and "warning (A)" not in out
    status, out, _ = run(capsys, "diff", "--a", os.path.join(DATA, "cpu_while_loop.hlo.txt"), "--b", str(two),
                         "--json")
    assert json.loads(out)["b"]["warnings"][0].startswith("the text holds 2 HLO modules")


def test_inspect_json_keys_are_the_readmes_schema(capsys):
    from test_hlo_formatting import _keys, _schema_keys

    status, out, _ = run(capsys, "inspect", *SMALL, "--json")
    assert status == 0
    missing = _keys(json.loads(out)) - _schema_keys()
    assert not missing, f"JSON keys the README's schema does not list: {sorted(missing)}"


# ---- 8. bench writes outside the source tree by default -------------------------------------------------------

@cpu_only
def test_bench_writes_into_jaxfuse_results_of_the_current_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = run(capsys, "bench", "--op", "rmsnorm_matmul", "--impls", "xla", "--iterations", "1")
    assert status == 0 and "wrote jaxfuse-results/rmsnorm_matmul-cpu.json" in err
    assert sorted(p.name for p in (tmp_path / "jaxfuse-results").iterdir()) == ["rmsnorm_matmul-cpu.json",
                                                                               "rmsnorm_matmul-cpu.md"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, ".gitignore")) as f:
        assert "jaxfuse-results/" in f.read().split()  # run inside the checkout, it stays out of git status
    status, out, _ = run(capsys, "bench", "--help")
    assert "jaxfuse-results/ in the current directory" in " ".join(out.split())
