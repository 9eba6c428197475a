"""`hlo-inspect` on input a new user gives it: one line and exit status 2, never a traceback."""

import os
import subprocess
import sys

import pytest

from hlo_inspect import cli

DATA = os.path.join(os.path.dirname(__file__), "data")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, stdin: bytes = b"", module: str = "hlo_inspect.cli") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("JAXFUSE_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, env=env,
                          timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    err = proc.stderr.decode("utf-8")
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err and err.startswith("hlo-inspect: "), err
    for needle in needles:
        assert needle in err, err
    return err


def test_python_dash_m_hlo_inspect_is_the_same_command():
    path = os.path.join(DATA, "cpu_while_loop.hlo.txt")
    proc = run_cli(path, "--json", module="hlo_inspect")
    assert proc.returncode == 0 and proc.stdout.startswith(b"{"), proc.stderr
    assert proc.stdout == run_cli(path, "--json").stdout
    assert_one_line_error(run_cli(path + ".missing", module="hlo_inspect"), "cannot read")


def test_binary_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(bytes(range(256)) * 8)
    assert_one_line_error(run_cli(str(path)), "not UTF-8 text (byte 0x80 at offset 128)", "compile().as_text()")


def test_malformed_shape(tmp_path):
    path = tmp_path / "edited.hlo.txt"
    path.write_text("HloModule m\n\nENTRY %main {\n  %p = f32[256,256{1,0} parameter(0)\n"
                    "  ROOT %n = f32[256,256]{1,0} negate(%p)\n}\n")
    err = assert_one_line_error(run_cli(str(path)), "line 4: malformed shape")
    assert err.count("\n") == 2  # the message, then the offending line


def test_stablehlo_on_standard_input():
    text = b"module @jit_f {\n  func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {\n  }\n}\n"
    assert_one_line_error(run_cli("-", stdin=text), "this is StableHLO")


def test_html_into_a_missing_folder_makes_it(tmp_path, capsys):
    out = tmp_path / "missing" / "dir" / "x.html"
    assert cli.main([os.path.join(DATA, "h100_while_loop.hlo.txt"), "--html", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert "kernels" in capsys.readouterr().out


@pytest.mark.parametrize("target", ["/proc/nope/x.html", "{tmp}"])
def test_html_that_cannot_be_written(tmp_path, target):
    proc = run_cli(os.path.join(DATA, "h100_while_loop.hlo.txt"), "--html", target.format(tmp=tmp_path))
    assert_one_line_error(proc, "cannot write the HTML report to")


def test_a_folder_as_input(tmp_path):
    """A folder is read as XLA's dump folder: without an optimized module in it, the error says what was looked
    for (test_cli.py reads one that has one)."""
    assert_one_line_error(run_cli(str(tmp_path)), "is a folder without an optimized module",
                          "after_optimizations.txt", "--xla_dump_to")


def test_an_unexpected_error_is_one_line_with_the_traceback_on_request(monkeypatch, capsys, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "from_text", broken)
    path = os.path.join(DATA, "h100_while_loop.hlo.txt")
    assert cli.main([path]) == 1
    err = capsys.readouterr().err
    assert "internal error RuntimeError: boom" in err and "JAXFUSE_TRACEBACK=1" in err
    monkeypatch.setenv("JAXFUSE_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main([path])
