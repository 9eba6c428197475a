"""hlo_inspect never crashes and never hangs: every input ends, quickly, in a report or in HloParseError.

Each case here is one that crashed (ValueError, IndexError, RecursionError, OverflowError) or hung before
issue 18; each must now end in HloParseError naming the line, or in a report that every stage can render.
"""

import time

import pytest

import hlo_inspect
from hlo_inspect import HloParseError
from hlo_inspect.fuzz import run_stages
from hlo_inspect.parser import parse_shape
from hlo_inspect.validate import MAX_CALL_DEPTH


def module(entry: str, *computations: str, entry_head: str = "ENTRY %main") -> str:
    """An HLO module: the given computations, then the entry computation with `entry` as its body."""
    return "HloModule m\n\n" + "".join(c + "\n\n" for c in computations) + f"{entry_head} {{\n{entry}\n}}\n"


def assert_parse_error(text: str, match: str, at: str | None = None, seconds: float = 2.0) -> HloParseError:
    """Every stage on `text` raises HloParseError matching `match`, within `seconds`; with `at`, the error names
    the (last) line holding `at` and shows that line."""
    start = time.perf_counter()
    with pytest.raises(HloParseError, match=match) as e:
        run_stages(text)
    assert time.perf_counter() - start < seconds
    if at is not None:
        line = text[: text.rindex(at)].count("\n") + 1
        assert e.value.line_no == line, str(e.value)
        assert e.value.line and e.value.line.strip() == text.splitlines()[line - 1].strip()
    return e.value


# ---- dimensions and indices that int() could not read (ValueError) ------------------------------------------

@pytest.mark.parametrize("dims", ["2,,3", "1e3", "2.5", "-1", "x", ",", "4,"])
def test_malformed_dimension_is_a_parse_error(dims):
    text = module(f"  ROOT %p = f32[{dims}]{{0}} parameter(0)")
    err = assert_parse_error(text, "malformed dimension", at="ROOT %p")
    assert "expected an integer, '<=N' or '?'" in err.message


def test_shape_missing_its_closing_bracket_names_the_line():
    """`f32[256,256{1,0}` (a hand edit): the shape's ']' is missing."""
    text = module("  %p = f32[256,256{1,0} parameter(0)\n  ROOT %n = f32[256,256]{1,0} negate(%p)")
    assert_parse_error(text, "malformed shape", at="%p = f32[256,256{1,0}")


def test_unbounded_dynamic_dimension_counts_zero_bytes_and_says_so():
    """`f32[?]` is XLA's unbounded dynamic dimension: no size before run time, so 0 bytes, and a warning."""
    shape = parse_shape("f32[?,8]{1,0}")
    assert shape.dims == (0, 8) and shape.unbounded_dims == (0,) and shape.size_bytes == 0
    assert str(shape) == "f32[?,8]{1,0}" and str(parse_shape("s32[<=16]{0}")) == "s32[<=16]{0}"
    rep = hlo_inspect.from_text(module("  %p = f32[?,8]{1,0} parameter(0)\n"
                                       "  ROOT %e = f32[?,8]{1,0} exponential(%p)"))
    assert [k.bytes_total for k in rep.kernels] == [0]
    assert any("unbounded dynamic dimension" in w for w in rep.warnings)
    assert "unbounded dynamic dimension" in rep.table() and rep.to_dict()["warnings"] == rep.warnings


@pytest.mark.parametrize("index", ["x", "1.5", "", "-1", "2"])
def test_bad_tuple_index_is_a_parse_error(index):
    text = module("  %p = (f32[2]{0}, f32[3]{0}) parameter(0)\n"
                  f"  ROOT %g = f32[2]{{0}} get-tuple-element(%p), index={index}")
    assert_parse_error(text, "index", at="ROOT %g")


# ---- calls that recurse (RecursionError) ---------------------------------------------------------------------

def test_fusion_calling_its_own_computation():
    fused = ("%fused (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n"
             "  ROOT %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused\n}")
    text = module("  %x = f32[4]{0} parameter(0)\n  ROOT %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused",
                  fused)
    assert_parse_error(text, "computation fused calls itself", at="ROOT %f = f32[4]{0} fusion(%p)")


def test_computations_calling_each_other():
    a = "%a (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n  ROOT %c = f32[4]{0} call(%p), to_apply=%b\n}"
    b = "%b (p: f32[4]) -> f32[4] {\n  %p = f32[4]{0} parameter(0)\n  ROOT %c = f32[4]{0} call(%p), to_apply=%a\n}"
    text = module("  %x = f32[4]{0} parameter(0)\n  ROOT %c = f32[4]{0} call(%x), to_apply=%a", a, b)
    assert_parse_error(text, r"cycle \((a -> b -> a|b -> a -> b)\)")


def test_while_whose_body_is_the_entry():
    cond = "%cond (p: f32[4]) -> pred[] {\n  %p = f32[4]{0} parameter(0)\n  ROOT %t = pred[] constant(true)\n}"
    text = module("  %x = f32[4]{0} parameter(0)\n  ROOT %w = f32[4]{0} while(%x), condition=%cond, body=%main",
                  cond, entry_head="ENTRY %main (x: f32[4]) -> f32[4]")
    assert_parse_error(text, "calls the ENTRY computation main", at="ROOT %w")


def test_call_graph_that_expands_exponentially_is_refused_quickly():
    """30 computations, each calling the next twice: 2**30 instructions to walk. Refused, not walked."""
    comps = []
    for i in range(30):
        callee = f"%c{i + 1}" if i < 29 else None
        body = ("  %p = f32[4]{0} parameter(0)\n" +
                (f"  %a = f32[4]{{0}} call(%p), to_apply={callee}\n  ROOT %b = f32[4]{{0}} call(%a), "
                 f"to_apply={callee}" if callee else "  ROOT %n = f32[4]{0} negate(%p)"))
        comps.append(f"%c{i} (p: f32[4]) -> f32[4] {{\n{body}\n}}")
    text = module("  %x = f32[4]{0} parameter(0)\n  ROOT %c = f32[4]{0} call(%x), to_apply=%c0", *comps)
    assert_parse_error(text, "visits more than 1,000,000 instructions")


def test_calls_nested_too_deep_are_refused():
    n = MAX_CALL_DEPTH + 5
    comps = [f"%c{i} (p: f32[4]) -> f32[4] {{\n  %p = f32[4]{{0}} parameter(0)\n"
             f"  ROOT %c = f32[4]{{0}} call(%p), to_apply=%c{i + 1}\n}}" for i in range(n)]
    comps.append(f"%c{n} (p: f32[4]) -> f32[4] {{\n  ROOT %p = f32[4]{{0}} parameter(0)\n}}")
    text = module("  %x = f32[4]{0} parameter(0)\n  ROOT %c = f32[4]{0} call(%x), to_apply=%c0", *comps)
    assert_parse_error(text, f"calls nest {n + 2} computations deep")


def test_deeply_nested_tuple_shape():
    depth = 5000
    text = module(f"  ROOT %p = {'(' * depth}f32[2]{')' * depth} parameter(0)")
    assert_parse_error(text, "nested more than")


def test_tuple_element_reference_nested_deeply():
    """`%x#0#0#0...` (the pass dumps' tuple-element syntax) thousands deep: an error, not a RecursionError."""
    text = module("  %p = (f32[2]{0}) parameter(0)\n  ROOT %n = f32[2]{0} negate(%p" + "#0" * 3000 + ")")
    assert_parse_error(text, "has no tuple element", at="ROOT %n")


# ---- dots and convolutions with missing operands or dimensions (IndexError) -----------------------------------

@pytest.mark.parametrize("instruction, match", [
    ("ROOT %d = f32[4,4]{1,0} dot(%a), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "dot takes 2 operands, got 1"),
    ("ROOT %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={2}, rhs_contracting_dims={0}",
     "lhs_contracting_dims names dimension 2, but %a has rank 2"),
    ("ROOT %d = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={x}, rhs_contracting_dims={0}",
     "expected a list of dimension numbers"),
    ("ROOT %d = (f32[4,4]{1,0}) dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "needs arrays, but its result is a tuple"),
    ("ROOT %c = f32[4,4]{1,0} convolution(%a), dim_labels=bf_io->bf", "at least 2 operands, got 1"),
    ("ROOT %c = f32[4,4]{1,0} convolution(%a, %b), dim_labels=b01f_01io->b01f", "do not fit its shape"),
    ("ROOT %c = f32[4,4]{1,0} convolution(%a, %b), dim_labels=bf_io->bf, feature_group_count=0",
     "expected a positive integer"),
    ("ROOT %c = f32[4,4]{1,0} add(%a)", "add takes 2 operands, got 1"),
])
def test_operand_counts_and_dimension_numbers_are_checked(instruction, match):
    text = module(f"  %a = f32[4,4]{{1,0}} parameter(0)\n  %b = f32[4,4]{{1,0}} parameter(1)\n  {instruction}")
    assert_parse_error(text, match, at=instruction[:8])


FUSED_EXP = ("%fused (p: f32[4,16]) -> f32[4,16] {\n  %p = f32[4,16]{1,0} parameter(0)\n"
             "  ROOT %e = f32[4,16]{1,0} exponential(%p)\n}")


@pytest.mark.parametrize("instruction, match", [
    ("ROOT %e = f32[4,17]{1,0} exponential(%a)",
     r"%e: exponential is elementwise, so its result has its operands' dimensions, but the result is "
     r"f32\[4,17\]\{1,0\} and operand %a is f32\[4,16\]\{1,0\}"),
    ("ROOT %e = f32[64]{0} negate(%a)", r"result is f32\[64\]\{0\} and operand %a is f32\[4,16\]"),
    ("ROOT %e = f32[<=8,16]{1,0} negate(%a)", r"result is f32\[<=8,16\]\{1,0\} and operand %a"),
    ("ROOT %s = f32[4,16]{1,0} add(%a, %row)", r"%s: add is elementwise.*operand %row is f32\[4,1\]"),
    ("ROOT %s = s32[4,16]{1,0} add(%a, %a)",
     "add keeps its operands' element type, but the result is s32 and operand %a is f32: only abs, compare, "),
    ("ROOT %f = f32[4,16]{1,0} fusion(%a), kind=kBogus, calls=%fused",
     "%f: kind=kBogus is not a fusion kind: expected one of kLoop, kInput, kOutput, kCustom"),
])
def test_elementwise_shapes_and_fusion_kinds_are_checked(instruction, match):
    text = module(f"  %a = f32[4,16]{{1,0}} parameter(0)\n  %row = f32[4,1]{{1,0}} parameter(1)\n  {instruction}",
                  FUSED_EXP)
    assert_parse_error(text, match, at=instruction[:8])


@pytest.mark.parametrize("instruction, match", [
    ("ROOT %s = f32[4,8]{1,0} slice(%a), slice={[0:4], [8:24]}",
     r"%s: slice range \[8:24:1\] of dimension 1 does not fit %a f32\[4,16\]\{1,0\}: expected 0 <= start <= limit "
     r"<= 16, stride >= 1"),
    ("ROOT %s = f32[8]{0} slice(%a), slice={[0:8]}", r"gives 1 ranges for operand %a of rank 2"),
    ("ROOT %s = f32[4,3]{1,0} slice(%a), slice={[0:4], [0:16:2]}",
     r"the result is f32\[4,3\]\{1,0\}, but slice=\{\[0:4\], \[0:16:2\]\} of f32\[4,16\]\{1,0\} makes dimensions "
     r"\[4, 8\]"),
    ("ROOT %s = f32[4,0]{1,0} slice(%a), slice={[0:4], [5:4]}", r"range \[5:4:1\] of dimension 1 does not fit"),
])
def test_slice_ranges_are_checked(instruction, match):
    text = module(f"  %a = f32[4,16]{{1,0}} parameter(0)\n  {instruction}")
    assert_parse_error(text, match, at=instruction[:8])


def test_slices_that_fit_are_read():
    """Strided, empty and bounded-dynamic slices, as XLA writes them."""
    text = module("  %a = f32[<=4,16]{1,0} parameter(0)\n  %s = f32[4,6]{1,0} slice(%a), slice={[0:4], [3:14:2]}\n"
                  "  %e = f32[0,16]{1,0} slice(%a), slice={[2:2], [0:16]}\n"
                  "  ROOT %t = (f32[4,6]{1,0}, f32[0,16]{1,0}) tuple(%s, %e)")
    assert hlo_inspect.parse(text).entry.by_name["s"].slice_bounds == [(0, 4, 1), (3, 14, 2)]


@pytest.mark.parametrize("instruction", [
    "ROOT %c = pred[4,16]{1,0} compare(%a, %a), direction=LT",
    "ROOT %c = bf16[4,16]{1,0} convert(%a)",
    "ROOT %c = f32[4,16]{1,0} abs(%z)",
    "ROOT %c = c64[4,16]{1,0} complex(%a, %a)",
    "ROOT %c = f32[4,16]{1,0} multiply(%a, %h)",  # mixed precision, as XLA's verifier allows on some backends
    "ROOT %c = f32[<=4,16]{1,0} negate(%a)",  # a bounded dimension counts as its bound
    "ROOT %c = f32[?,16]{1,0} negate(%a)",  # an unbounded one matches any size
    "ROOT %c = f32[4,16]{1,0} fusion(%a), kind=kCustom, calls=%fused",
])
def test_elementwise_ops_that_change_the_type_or_mix_precision_are_read(instruction):
    text = module("  %a = f32[4,16]{1,0} parameter(0)\n  %z = c64[4,16]{1,0} parameter(1)\n"
                  f"  %h = bf16[4,16]{{1,0}} parameter(2)\n  {instruction}", FUSED_EXP)
    run_stages(text)


def test_library_call_with_dimension_numbers_out_of_range_has_unknown_flops():
    """backend_config is opaque JSON: a cuBLAS config whose dimensions do not fit gives FLOPs None, not a crash."""
    text = module('  %a = f32[4,4]{1,0} parameter(0)\n  %b = f32[4,4]{1,0} parameter(1)\n'
                  '  ROOT %g = (f32[4,4]{1,0}, s8[64]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", '
                  'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":'
                  '["7"]}},"known_trip_count":{"n":"x"},"reification_cost":[{"exec_time_us":"fast"}]}')
    rep = hlo_inspect.from_text(text)
    assert rep.kernels[0].category == "cublas" and rep.kernels[0].flops is None
    assert rep.kernels[0].xla_estimate_us is None
    run_stages(text)


# ---- huge dimensions (OverflowError in Report.table()) ---------------------------------------------------------

def test_dimension_past_int64_is_a_parse_error():
    text = module("  ROOT %p = f32[" + "9" * 400 + "]{0} parameter(0)")
    assert_parse_error(text, "past XLA's int64 limit", at="ROOT %p")
    assert_parse_error(module("  ROOT %p = f32[4611686018427387904]{0} parameter(0)"), "more than 2\\*\\*63 bytes")


def test_largest_shapes_xla_allows_render_in_every_stage():
    """u8[2**62] and a dot of two such row vectors: every number stays finite in the table, JSON and HTML."""
    text = module("  %a = u8[1,4611686018427387904]{1,0} parameter(0)\n"
                  "  %b = u8[4611686018427387904,1]{1,0} parameter(1)\n"
                  "  ROOT %d = u8[1,1]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    rep = hlo_inspect.from_text(text)
    assert rep.kernels[0].flops == 2 * 2 ** 62
    assert "read 8388608.0 TiB" in rep.table()
    run_stages(text)


# ---- instructions that use their own result (hangs) -----------------------------------------------------------

def test_bitcast_of_itself_in_the_entry():
    text = module("  %a = f32[4]{0} parameter(0)\n  %b = f32[4]{0} bitcast(%b)\n  ROOT %n = f32[4]{0} negate(%b)")
    assert_parse_error(text, r"cycle \(%b -> %b\)", at="%b = f32[4]{0} bitcast(%b)")


def test_convert_of_itself_as_root_of_an_input_fusion():
    fused = "%fused (p: f32[]) -> f32[] {\n  %p = f32[] parameter(0)\n  ROOT %c = f32[] convert(%c)\n}"
    text = module("  %x = f32[] parameter(0)\n  ROOT %f = f32[] fusion(%x), kind=kInput, calls=%fused", fused)
    assert_parse_error(text, r"cycle \(%c -> %c\)", at="ROOT %c = f32[] convert(%c)")


def test_tuple_of_itself():
    fused = ("%fused (p: f32[]) -> (f32[], f32[]) {\n  %p = f32[] parameter(0)\n"
             "  ROOT %t = (f32[], f32[]) tuple(%t, %t)\n}")
    text = module("  %x = f32[] parameter(0)\n  ROOT %f = (f32[], f32[]) fusion(%x), kind=kInput, calls=%fused", fused)
    assert_parse_error(text, r"cycle \(%t -> %t\)", at="ROOT %t")


def test_longer_cycle_through_operands_listed_later():
    text = module("  %a = f32[4]{0} parameter(0)\n  %b = f32[4]{0} add(%a, %d)\n  %c = f32[4]{0} negate(%b)\n"
                  "  %d = f32[4]{0} negate(%c)\n  ROOT %r = f32[4]{0} negate(%d)")
    assert_parse_error(text, r"cycle \(%b -> %d -> %c -> %b\)")


def test_operands_listed_after_their_user_are_fine():
    text = module("  ROOT %r = f32[4]{0} negate(%a)\n  %a = f32[4]{0} parameter(0)")
    assert [k.name for k in hlo_inspect.from_text(text).kernels] == ["r"]


def test_tuples_sharing_operands_deeply_are_walked_once():
    """A kInput fusion whose root is tuple(t39, t39), t39 = tuple(t38, t38), ...: 2**40 paths to the reduce at
    the bottom, 40 instructions. (The tuple shapes are not checked against their operands: hostile text.)"""
    add = ("%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
           "  ROOT %s = f32[] add(%a, %b)\n}")
    lines = ["  %p = f32[8]{0} parameter(0)", "  %z = f32[] constant(0)",
             "  %t0 = f32[] reduce(%p, %z), dimensions={0}, to_apply=%add"]
    lines += [f"  %t{i} = (f32[], f32[]) tuple(%t{i - 1}, %t{i - 1})" for i in range(1, 40)]
    lines.append("  ROOT %t40 = (f32[], f32[]) tuple(%t39, %t39)")
    fused = "%fused (p: f32[8]) -> (f32[], f32[]) {\n" + "\n".join(lines) + "\n}"
    text = module("  %x = f32[8]{0} parameter(0)\n"
                  "  ROOT %f = (f32[], f32[]) fusion(%x), kind=kInput, calls=%fused", add, fused)
    start = time.perf_counter()
    rep = hlo_inspect.from_text(text)
    assert rep.kernels[0].category == "reduction"
    run_stages(text)
    assert time.perf_counter() - start < 2.0


# ---- other malformed text ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [
    (module("  %a = f32[4]{0} parameter(0)\n  %a = f32[4]{0} parameter(1)\n  ROOT %n = f32[4]{0} negate(%a)"),
     "defined twice"),
    (module("  %a = f32[4]{0} parameter(0)\n  %b = f32[4]{0} parameter(0)\n  ROOT %n = f32[4]{0} add(%a, %b)"),
     "parameter number 0 is taken twice"),
    (module("  ROOT %a = f32[4]{0} parameter(x)"), "non-negative integer parameter number"),
    (module("  ROOT %a = f32[4]{0} parameter(0)\n  ROOT %b = f32[4]{0} negate(%a)"), "two ROOT instructions"),
    (module("  %a = f32[4]{0} parameter(0)\n  ROOT %b = f32[4]{0} add(%a, , %a)"), "empty operand"),
    ("HloModule m\n%c (p: f32[]) -> f32[] {\n  ROOT %p = f32[] parameter(0)\n\n%d (p: f32[]) -> f32[] {\n"
     "  ROOT %p = f32[] parameter(0)\n}\n", "computation c \\(line 2\\) is never closed"),
    ("HloModule m\n/* an unclosed comment\nENTRY %main {\n}\n", "never closed with '\\*/'"),
])
def test_other_malformed_text(text, match):
    assert_parse_error(text, match)


def test_an_unclosed_brace_on_the_last_instruction_is_named_there():
    """The computation's closing '}' at column 0 does not continue the instruction above it: the error names the
    '{' left open, not a computation never closed."""
    text = module('  %a = f32[4]{0} parameter(0)\n  ROOT %b = f32[4]{0} negate(%a), metadata={op_name="x"')
    assert_parse_error(text, r"'\{' opened at column 42 is never closed", at="ROOT %b")
    continued = module('  %a = f32[4]{0} parameter(0)\n  ROOT %b = f32[4]{0} negate(%a), metadata={op_name="x"\n'
                       '    source_file="a.py"\n  }')  # an indented '}' still closes a continued attribute
    assert hlo_inspect.parse(continued).entry.root.name == "b"


def test_every_captured_module_still_reads():
    """The checks above reject nothing that XLA printed."""
    import glob
    import os

    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "*.hlo.txt"))):
        with open(path, encoding="utf-8") as f:
            run_stages(f.read())


def test_long_bitcast_chain_read_by_many_kernels_is_walked_once():
    """10,000 chained bitcasts, each read by its own kernel: every kernel looks through the chain to the buffer
    it reads; walking it anew for each takes 50 million steps (8 s on d8e9cf0)."""
    n = 10_000
    lines = ["  %b0 = f32[4]{0} parameter(0)"]
    lines += [f"  %b{i} = f32[4]{{0}} bitcast(%b{i - 1})" for i in range(1, n + 1)]
    lines += [f"  %n{i} = f32[4]{{0}} negate(%b{i})" for i in range(1, n + 1)]
    lines.append(f"  ROOT %r = f32[4]{{0}} negate(%b{n})")
    start = time.perf_counter()
    rep = hlo_inspect.from_text(module("\n".join(lines)))
    assert len(rep.kernels) == n + 1 and {src.name for k in rep.kernels for src, _ in k.reads} == {"b0"}
    rep.ledger
    assert time.perf_counter() - start < 2.0
