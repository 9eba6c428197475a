"""hlo_inspect reads everything XLA prints: every opcode of hlo_opcode.h, the printers' comments and trailers,
instructions over several lines, async collectives with and without syntax sugar, several modules, escaped
strings; and says what StableHLO is when it is given by mistake."""

import json
import os

import pytest

import hlo_inspect
from hlo_inspect import HloParseError
from hlo_inspect.fuzz import run_stages
from hlo_inspect.opcodes import ARITY, OPCODES, async_parts, is_known_opcode

DATA = os.path.join(os.path.dirname(__file__), "data")


def read(name: str) -> str:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return f.read()


def kernel_summary(rep) -> list[tuple]:
    return [(k.name, k.category, k.bytes_read, k.bytes_written, k.flops, k.launches) for k in rep.kernels]


# ---- opcodes -----------------------------------------------------------------------------------------------

def _instruction(opcode: str, i: int) -> str:
    """One instruction of `opcode` with as many operands as it takes (variadic: one)."""
    literal = {"parameter": "9", "constant": "0", "iota": "", "partition-id": "", "replica-id": "",
               "rng-get-and-update-state": ""}
    if opcode in literal:
        shape = "u32[]" if opcode in ("partition-id", "replica-id") else "f32[4]{0}"
        return f"  %i{i} = {shape} {opcode}({literal[opcode]})" + (", iota_dimension=0" if opcode == "iota" else "")
    if opcode == "get-tuple-element":
        return f"  %i{i} = f32[4]{{0}} get-tuple-element(%t), index=1"
    n = ARITY[opcode] if ARITY[opcode] is not None else 2 if opcode == "convolution" else 1
    operands = ", ".join(["%p"] * n)
    if opcode in ("dot", "ragged-dot", "scaled-dot"):
        return f"  %i{i} = f32[] {opcode}({operands}), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}"
    return f"  %i{i} = f32[4]{{0}} {opcode}({operands})"


def test_every_opcode_of_hlo_opcode_h_reads_and_reports():
    lines = ["  %p = f32[4]{0} parameter(0)", "  %t = (f32[4]{0}, f32[4]{0}) parameter(1)"]
    lines += [_instruction(op, i) for i, op in enumerate(sorted(OPCODES))]
    lines.append("  ROOT %r = f32[4]{0} negate(%p)")
    text = "HloModule every_opcode\n\nENTRY %main {\n" + "\n".join(lines) + "\n}\n"
    module = hlo_inspect.parse(text)
    assert {i.opcode for i in module.entry.instructions} == OPCODES
    run_stages(text)  # kernels, table, JSON, ledger, HTML, diff, counterfactual


def test_opcode_names_and_arities_are_xlas():
    assert len(OPCODES) == 136  # xla/hlo/ir/hlo_opcode.h's HLO_OPCODE_LIST at openxla/xla 0725a3a9
    assert "count-leading-zeros" in OPCODES and "clz" not in OPCODES
    assert {"acos", "acosh", "asin", "asinh", "atan", "atanh", "cosh", "sinh", "mulhi", "scan"} <= OPCODES
    assert "optimization-barrier" not in OPCODES and "opt-barrier" in OPCODES
    assert (ARITY["dot"], ARITY["clamp"], ARITY["ragged-all-to-all"], ARITY["batch-norm-grad"]) == (2, 3, 6, 5)
    assert ARITY["fusion"] is None and ARITY["parameter"] == 0
    with pytest.raises(HloParseError, match="unknown opcode 'clz'"):
        hlo_inspect.parse("HloModule m\nENTRY %main {\n  %p = s32[4]{0} parameter(0)\n"
                          "  ROOT %c = s32[4]{0} clz(%p)\n}\n")


def test_async_opcode_names():
    assert async_parts("reduce-scatter-start") == ("reduce-scatter", "start")
    assert async_parts("all-to-all-done") == ("all-to-all", "done")
    assert async_parts("custom-call-update") == ("custom-call", "update")
    assert async_parts("all-reduce-start") == ("all-reduce", "start")
    assert async_parts("async-start") == ("", "start")
    assert async_parts("add") == ("", "") and async_parts("frobnicate-start") == ("", "")
    assert is_known_opcode("fusion-start") and not is_known_opcode("all-reduce-start-done")


def test_count_leading_zeros_on_cpu_inspects():
    """`jax.lax.clz` compiles to `count-leading-zeros`, which the parser refused before (it knew `clz`)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    rep = hlo_inspect.inspect(jax.lax.clz, jnp.arange(8, dtype=jnp.int32))
    assert sum(k.ops["count-leading-zeros"] for k in rep.kernels) == 1
    assert rep.totals.flops == 8


# ---- what the printers write around instructions -------------------------------------------------------------

def test_computation_name_comment_after_closing_brace():
    """`} // name` after each computation (XLA's dumps, mid-2023 to early 2025)."""
    text = read("h100_while_loop.hlo.txt")
    commented, current = [], None
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        commented.append(f"}} // {current}" if line == "}" else line)
    assert commented != text.splitlines()
    assert kernel_summary(hlo_inspect.from_text("\n".join(commented))) == kernel_summary(hlo_inspect.from_text(text))


@pytest.mark.parametrize("comment", [
    "/* Begin: optimized HLO of jit_f */",
    "/*\n * Module dumped by XLA\n * after optimizations\n */",
])
def test_comment_lines_before_the_module(comment):
    text = read("cpu_while_loop.hlo.txt")
    rep = hlo_inspect.from_text(comment + "\n" + text)
    assert kernel_summary(rep) == kernel_summary(hlo_inspect.from_text(text))
    line = text.splitlines()[3]
    with pytest.raises(HloParseError) as e:
        hlo_inspect.parse(comment + "\n" + text.replace(line, line + " garbage", 1))
    assert e.value.line_no == comment.count("\n") + 5  # line numbers still count the comment's lines


# What `HloModule::ToString()` prints (default options: syntax sugar for async ops, operand shapes, the
# execution thread after a computation) for a module with each async collective, written after XLA's own
# printer tests (xla/hlo/ir/hlo_instruction_test.cc, StringifyAsyncOps*).
ASYNC_SUGAR = """HloModule collectives, entry_computation_layout={(f32[20]{0})->f32[10]{0}}

%add (p0: f32[], p1: f32[]) -> f32[] {
  %p0 = f32[] parameter(0)
  %p1 = f32[] parameter(1)
  ROOT %add = f32[] add(f32[] %p0, f32[] %p1)
}, execution_thread="parallel_thread"

ENTRY %main (x: f32[20]) -> f32[10] {
  %x = f32[20]{0} parameter(0)
  %all-reduce-start = f32[20]{0} all-reduce-start(f32[20]{0} %x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done = f32[20]{0} all-reduce-done(f32[20]{0} %all-reduce-start)
  %reduce-scatter-start = ((f32[20]{0}), f32[10]{0}) reduce-scatter-start(f32[20]{0} %all-reduce-done), async_execution_thread="parallel_thread", replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  %reduce-scatter-update = ((f32[20]{0}), f32[10]{0}) reduce-scatter-update(((f32[20]{0}), f32[10]{0}) %reduce-scatter-start)
  %reduce-scatter-done = f32[10]{0} reduce-scatter-done(((f32[20]{0}), f32[10]{0}) %reduce-scatter-update)
  %all-gather-start = (f32[10]{0}, f32[20]{0}) all-gather-start(f32[10]{0} %reduce-scatter-done), channel_id=2, replica_groups={{0,1}}, dimensions={0}
  %all-gather-done = f32[20]{0} all-gather-done((f32[10]{0}, f32[20]{0}) %all-gather-start)
  %collective-permute-start = (f32[20]{0}, f32[20]{0}, u32[], u32[]) collective-permute-start(f32[20]{0} %all-gather-done), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[20]{0} collective-permute-done((f32[20]{0}, f32[20]{0}, u32[], u32[]) %collective-permute-start)
  %all-to-all-start = ((f32[20]{0}), f32[20]{0}) all-to-all-start(f32[20]{0} %collective-permute-done), replica_groups={{0,1}}, dimensions={0}
  %all-to-all-done = f32[20]{0} all-to-all-done(((f32[20]{0}), f32[20]{0}) %all-to-all-start)
  ROOT %slice = f32[10]{0} slice(f32[20]{0} %all-to-all-done), slice={[0:10]}
}
"""


def test_async_collectives_with_syntax_sugar_are_collective_kernels():
    rep = hlo_inspect.from_text(ASYNC_SUGAR)
    assert rep.module.computations["add"].execution_thread == "parallel_thread"
    assert [(k.name, k.category, k.bytes_read, k.bytes_written) for k in rep.kernels] == [
        ("all-reduce-start", "collective", 80, 80),
        ("reduce-scatter-start", "collective", 80, 40),
        ("all-gather-start", "collective", 40, 80),
        ("collective-permute-start", "collective", 80, 80),
        ("all-to-all-start", "collective", 80, 80),
        ("slice", "unfused", 40, 40),
    ]
    assert [k.flops for k in rep.kernels] == [20, 0, 0, 0, 0, 0]  # an all-reduce: 1 per element, as XLA counts
    assert rep.module.entry.by_name["reduce-scatter-start"].async_wrapped_opcode == "reduce-scatter"
    assert "5 collective" in rep.table()
    run_stages(ASYNC_SUGAR)


def test_async_collective_without_sugar_is_one_kernel_named_by_its_start():
    text = """HloModule m

%add (p0: f32[], p1: f32[]) -> f32[] {
  %p0 = f32[] parameter(0)
  %p1 = f32[] parameter(1)
  ROOT %add = f32[] add(%p0, %p1)
}, execution_thread="parallel_thread"

%wrapped_reduce-scatter (p: f32[20]) -> f32[10] {
  %p = f32[20]{0} parameter(0)
  ROOT %reduce-scatter = f32[10]{0} reduce-scatter(%p), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
}, execution_thread="parallel_thread"

ENTRY %main (x: f32[20]) -> f32[10] {
  %x = f32[20]{0} parameter(0)
  %start = ((f32[20]{0}), f32[10]{0}, u32[]) async-start(%x), async_execution_thread="parallel_thread", calls=%wrapped_reduce-scatter
  ROOT %done = f32[10]{0} async-done(%start)
}
"""
    rep = hlo_inspect.from_text(text)
    assert [(k.name, k.category, k.bytes_read, k.bytes_written) for k in rep.kernels] == [
        ("start", "collective", 80, 40)]
    assert rep.kernels[0].done is rep.module.entry.by_name["done"]
    assert rep.kernels[0].ops == {"reduce-scatter": 1}  # the wrapped op, as a fusion shows what it fuses


def test_instruction_continued_over_several_lines():
    text = """HloModule m

ENTRY %main (x: f32[2,3]) -> f32[2,3] {
  %x = f32[2,3]{1,0} parameter(0)
  %c = f32[2,3]{1,0} constant({
    { 1, 2, 3 },
    { 4, 5, 6 }
  })
  ROOT %a = f32[2,3]{1,0} add(%x, %c),
      metadata={op_name="jit(f)/Dense/add"
                source_file="/home/u/model.py" source_line=7},
      backend_config={"operation_queue_id": "0",
                      "wait_on_operation_queues": []}
}
"""
    rep = hlo_inspect.from_text(text)
    c, a = rep.module.entry.by_name["c"], rep.module.entry.by_name["a"]
    assert c.literal.replace(" ", "") == "{{1,2,3},{4,5,6}}" and c.line_no == 5
    assert a.metadata.source_line == 7 and a.backend_config["operation_queue_id"] == "0" and a.line_no == 9
    assert [(k.name, k.scopes, k.source_lines) for k in rep.kernels] == [("a", ["Dense"], ["/home/u/model.py:7"])]
    # cut short inside the continued instruction: the error names the line it starts on
    with pytest.raises(HloParseError, match="never closed") as e:
        hlo_inspect.parse(text[: text.index("    { 4, 5, 6 }")])
    assert e.value.line_no == 5


def test_several_modules_in_one_text_reads_the_first_and_says_so():
    first, second = read("cpu_while_loop.hlo.txt"), read("h100_pallas.hlo.txt")
    rep = hlo_inspect.from_text(first + "\n" + second + "\n" + first)
    assert kernel_summary(rep) == kernel_summary(hlo_inspect.from_text(first))
    assert rep.warnings == [f"the text holds 3 HLO modules: read the first (jit_f), ignored everything from line "
                            f"{first.count(chr(10)) + 2} on"]
    assert "warning: the text holds 3 HLO modules" in rep.table()
    assert json.loads(rep.to_json())["warnings"] == rep.warnings


STABLEHLO = """module @jit_f attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4xf32>) -> (tensor<4xf32> {jax.result_info = ""}) {
    %0 = stablehlo.exponential %arg0 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""


def test_stablehlo_given_by_mistake_says_so():
    with pytest.raises(HloParseError, match=r"this is StableHLO .*\.compile\(\)\.as_text\(\)") as e:
        hlo_inspect.parse(STABLEHLO)
    assert e.value.line_no == 1


def test_stablehlo_from_jax_says_so():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    text = jax.jit(jnp.exp).lower(jnp.ones(4)).as_text()
    with pytest.raises(HloParseError, match="this is StableHLO"):
        hlo_inspect.parse(text)


UNOPTIMIZED_WARNING = "looks like HLO before XLA's optimizations"


def test_hlo_before_optimizations_from_jax_says_so():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    lowered = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=-1)).lower(jnp.ones((8, 16)), jnp.ones((16, 5)))
    rep = hlo_inspect.from_text(lowered.as_text(dialect="hlo"))
    warning, = [w for w in rep.warnings if UNOPTIMIZED_WARNING in w]
    assert "`jax.jit(f).lower(*args).compile().as_text()`" in warning and f"warning: {warning}" in rep.table()
    assert not [w for w in hlo_inspect.from_text(lowered.compile().as_text()).warnings if UNOPTIMIZED_WARNING in w]


@pytest.mark.parametrize("header, root, warned", [
    ("HloModule m", "negate(%x)", True),
    ("HloModule m, is_scheduled=true", "negate(%x)", False),  # compiled: XLA schedules every program it compiles
    ("HloModule m", "fusion(%x), kind=kLoop, calls=%fused", False),
])
def test_hlo_before_optimizations_is_told_by_its_header_and_fusions(header, root, warned):
    text = (f"{header}\n\n%fused (p: f32[4]) -> f32[4] {{\n  %p = f32[4]{{0}} parameter(0)\n"
            f"  ROOT %n = f32[4]{{0}} negate(%p)\n}}\n\nENTRY %main {{\n  %x = f32[4]{{0}} parameter(0)\n"
            f"  ROOT %r = f32[4]{{0}} {root}\n}}\n")
    assert any(UNOPTIMIZED_WARNING in w for w in hlo_inspect.from_text(text).warnings) == warned


def test_captured_compiled_programs_do_not_look_unoptimized():
    names = sorted(n for n in os.listdir(DATA) if n.endswith(".hlo.txt"))
    assert any(n.startswith("h100_") for n in names) and any(n.startswith("cpu") for n in names)
    for name in names:
        assert not [w for w in hlo_inspect.from_text(read(name)).warnings if UNOPTIMIZED_WARNING in w], name


# ---- escaped strings ---------------------------------------------------------------------------------------

def test_octal_escapes_decode_to_utf8_everywhere():
    text = r"""HloModule m

FileNames
1 "/home/u/caf\303\251/model.py"

FunctionNames
1 "Caf\303\251.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%x), metadata={op_name="jit(f)/caf\303\251/\"q\"/exp" stack_frame_id=1}, frontend_attributes={note="na\303\257ve"}, custom_call_target="x\\y"
}
"""
    rep = hlo_inspect.from_text(text)
    e = rep.module.entry.by_name["e"]
    assert e.metadata.op_name == 'jit(f)/café/"q"/exp'
    assert e.frontend_attributes == {"note": "naïve"} and e.custom_call_target == "x\\y"
    assert rep.module.source.file_names[1] == "/home/u/café/model.py"
    assert rep.module.source.function_names[1] == "Café.__call__"
    k = rep.kernels[0]
    assert k.scopes == ['café/"q"'] and k.source_lines == ["/home/u/café/model.py:3"]
    assert "café" in rep.table() and json.loads(rep.to_json())["kernels"][0]["scopes"] == ['café/"q"']
    assert "café" in rep.to_html()


def test_conditionals_and_loops_of_unknown_trip_count_are_warned_about():
    """Every branch of a conditional is listed and counted though one runs, and a while loop whose trip count the
    HLO does not give is counted once: both are said (a CPU compile of lax.switch and of a while_loop bounded by an
    argument); a fori_loop of known trip count is not."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    x = jnp.ones((64, 64), jnp.float32)
    switch = hlo_inspect.inspect(lambda i, a: lax.switch(i, [lambda a: a @ a, jnp.cos, jnp.tanh], a), 1, x)
    assert any(w.startswith("1 conditional: the kernels of every branch are listed and counted")
               for w in switch.warnings), switch.warnings
    loop = hlo_inspect.inspect(lambda n, a: lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ c[0], c[1] + 1),
                                                           (a, 0))[0], 50, x)
    assert any(w.startswith("1 while loop with a trip count the HLO does not give") for w in loop.warnings), \
        loop.warnings
    known = hlo_inspect.inspect(lambda a: lax.fori_loop(0, 8, lambda i, c: c @ c, a), x)
    assert not any("while loop" in w or "conditional" in w for w in known.warnings), known.warnings
