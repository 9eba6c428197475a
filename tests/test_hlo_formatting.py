"""How hlo_inspect's tables and JSON write numbers, units, plurals, missing scopes and source paths."""

import json
import os
import re

import numpy as np
import pytest

import hlo_inspect
from hlo_inspect.kernels import MAX_FLOPS
from hlo_inspect.ledger import NO_SCOPE
from hlo_inspect.report import _format_us, _scientific

DATA = os.path.join(os.path.dirname(__file__), "data")
README = os.path.join(os.path.dirname(DATA), "..", "README.md")


def read(name: str) -> str:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return f.read()


ONE_KERNEL = """HloModule one, is_scheduled=true

FileNames
1 "{root}/model.py"

FunctionNames
1 "f"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=12 end_line=12 column=1 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}

ENTRY %main (x: f32[1024]) -> f32[1024] {{
  %x = f32[1024]{{0}} parameter(0)
  %e = f32[1024]{{0}} exponential(%x), metadata={{op_name="jit(f)/exp" stack_frame_id=1}}
  ROOT %n = f32[1024]{{0}} negate(%e), metadata={{op_name="jit(f)/neg" stack_frame_id=1}}
}}
"""


def test_flops_with_a_space_before_the_unit():
    table = hlo_inspect.from_text(read("h100_mlp_grad.hlo.txt")).table()
    total = next(line for line in table.splitlines() if line.startswith("total:"))
    assert re.search(r", \d+\.\d [KMGT]FLOP$", total), total
    assert "MFLOP" not in total.replace(" MFLOP", "")


def test_counts_of_one_are_singular():
    rep = hlo_inspect.from_text(ONE_KERNEL.format(root="/src"))
    assert len(rep.kernels) == 2
    assert "module one: 2 kernels, 2 launches per run" in rep.table()
    ledger = rep.ledger_table(3.35e12)
    assert "HBM round trips: 1 tensor," in ledger and "1 tensors" not in ledger
    assert re.search(r"\(no scope\)\s+1 tensor,", ledger)
    single = hlo_inspect.from_text("HloModule s\nENTRY %m {\n  %x = f32[4]{0} parameter(0)\n"
                                   "  ROOT %n = f32[4]{0} negate(%x)\n}\n")
    assert "1 kernel, 1 launch per run" in single.table()


def test_durations_in_a_readable_unit():
    assert [_format_us(x) for x in (0.5, 12.345, 4_567.0, 2_567_421_223.9)] == [
        "0.50 µs", "12.35 µs", "4.6 ms", "2567.4 s"]
    rep = hlo_inspect.from_text(read("h100_block_grad.hlo.txt"))
    slow = rep.ledger_table(hbm_bytes_per_s=1e3)  # a bandwidth this low makes seconds
    assert re.search(r"\(\d+\.\d s at 0\.00 TB/s\)", slow.splitlines()[0]), slow.splitlines()[0]
    assert not re.search(r"\d{5,}\.\d+ µs", slow)


def test_huge_flop_counts_are_clamped_and_print_without_overflow():
    assert _scientific(10 ** 400) == "1.0e400" and _scientific(4_200_000_000_000_000_000) == "4.2e18"
    window = "x".join(["999999999999"] * 40)
    text = ("HloModule w\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
            "  ROOT %s = f32[] add(%a, %b)\n}\n\nENTRY %m {\n  %x = f32[4]{0} parameter(0)\n  %z = f32[] constant(0)\n"
            f"  ROOT %r = f32[4]{{0}} reduce-window(%x, %z), window={{size={window}}}, to_apply=%add\n}}\n")
    rep = hlo_inspect.from_text(text)
    assert rep.kernels[0].flops == MAX_FLOPS  # (10**12)**40 per output element, clamped
    assert "1.7e38 FLOP" in rep.table()
    json.loads(rep.to_json())
    rep.to_html()


def test_diff_writes_counts_with_separators():
    a = hlo_inspect.from_text(read("h100_mlp_grad.hlo.txt"))
    b = hlo_inspect.from_text(read("cpu_mlp_grad.hlo.txt"))
    table = hlo_inspect.diff(a, b).table()
    flops = next(line for line in table.splitlines() if line.strip().startswith("flops"))
    assert f"{a.totals.flops:,}" in flops and f"{b.totals.flops:,}" in flops


def test_a_missing_scope_reads_the_same_everywhere():
    rep = hlo_inspect.from_text(ONE_KERNEL.format(root="/src"))
    assert all(not k.scopes for k in rep.kernels)
    table, ledger = rep.table(), rep.ledger_table()
    assert NO_SCOPE in table and "(no scope) -> (no scope)" in ledger
    assert " ? " not in ledger and "? ->" not in ledger
    diff = hlo_inspect.diff(rep, hlo_inspect.from_text(read("cpu_while_loop.hlo.txt"))).table()
    assert NO_SCOPE in diff and "()" not in diff


def test_source_paths_read_the_same_in_table_and_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rep = hlo_inspect.from_text(ONE_KERNEL.format(root=str(tmp_path)))
    assert rep.kernels[0].source_lines == [f"{tmp_path}/model.py:12"]  # the Kernel keeps what XLA printed
    assert "model.py:12" in rep.table() and str(tmp_path) not in rep.table()
    assert json.loads(rep.to_json())["kernels"][0]["source_lines"] == ["model.py:12"]
    elsewhere = hlo_inspect.from_text(ONE_KERNEL.format(root="/somewhere/else"))
    assert json.loads(elsewhere.to_json())["kernels"][0]["source_lines"] == ["/somewhere/else/model.py:12"]


def _schema_keys() -> set[str]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    block = text.split("## JSON schema", 1)[1].split("```", 2)[1]
    return set(re.findall(r'"([a-z_ ]+)"', block))


def _keys(value, ignore_values_of=("ops", "xla_cost_analysis")) -> set[str]:
    """Every object key in a JSON value, except inside objects keyed by data (opcode counts, XLA's own dict)."""
    keys = set()
    if isinstance(value, dict):
        for k, v in value.items():
            keys.add(k)
            if k not in ignore_values_of:
                keys |= _keys(v)
    elif isinstance(value, list):
        for v in value:
            keys |= _keys(v)
    return keys


@pytest.mark.parametrize("name", ["h100_block_grad.hlo.txt", "cpu_while_loop.hlo.txt",
                                  "h200_attention_causal_arange_mask.hlo.txt"])
def test_json_keys_are_the_readmes_schema(name):
    data = json.loads(hlo_inspect.from_text(read(name)).to_json())
    missing = _keys(data) - _schema_keys()
    assert not missing, f"JSON keys the README's schema does not list: {sorted(missing)}"


@pytest.mark.parametrize("call, match", [
    (lambda rep: rep.ledger_table("3e12"), r"hbm_bytes_per_s: expected a finite number > 0 .* got '3e12' \(str\)"),
    (lambda rep: rep.ledger_table(0), r"hbm_bytes_per_s: expected a finite number > 0 .* got 0 \(int\)"),
    (lambda rep: rep.ledger_table(float("nan")), r"hbm_bytes_per_s: .* got nan"),
    (lambda rep: rep.ledger_table(limit=2.5), r"limit: expected an int >= 0, got 2.5 \(float\)"),
    (lambda rep: rep.ledger_table(limit=-1), r"limit: expected an int >= 0, got -1"),
    (lambda rep: rep.fusion_saving(3.35e12, "989e12", 2.0), r"flops_per_s: expected a finite number > 0 .* '989e12'"),
    (lambda rep: rep.fusion_saving(-1.0, 989e12, 2.0), r"hbm_bytes_per_s: .* got -1.0 \(float\)"),
    (lambda rep: rep.fusion_saving_text("H100", 3.35e12, 989e12, None), r"launch_us: expected a number >= 0"),
])
def test_rates_and_limits_that_are_not_numbers_name_the_argument(call, match):
    """(A string such as '3e12' was a bare TypeError from the division inside.)"""
    rep = hlo_inspect.from_text(read("h100_block_grad.hlo.txt"))
    with pytest.raises(ValueError, match=match):
        call(rep)
    assert rep.ledger_table(3e12, limit=0).startswith("HBM round trips")  # numbers of any real type still work
    assert "HBM round trips" in rep.ledger_table(np.float64(3e12), limit=np.int64(3))
