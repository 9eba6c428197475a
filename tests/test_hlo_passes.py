"""hlo_inspect.passes: per-pass XLA dumps -> kernels and bytes after each pass, and where each kernel came from."""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import pytest

import hlo_inspect
from hlo_inspect.passes import _classify_file, dump_passes, load_pass_dumps

SHAPES = {"x": (6, 48), "gamma": (48,), "w": (48, 20)}  # odd sizes on purpose


def _is_fusion_pass(name):
    """CPU: fusion, fusion-wrapper, dot-library-rewriter; GPU: priority-fusion, triton-gemm-rewriter, ..."""
    return "fusion" in name or "rewriter" in name


def _biggest_drop(timeline):
    """The step after which the kernel count fell most: CPU's `fusion` (GPU: a Triton rewriter or priority-fusion)."""
    steps = timeline.steps
    return max(steps[1:], key=lambda s: steps[steps.index(s) - 1].kernel_count - s.kernel_count)


def rmsnorm_matmul_tanh(x, gamma, w):
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gamma  # (M, K)
    return jnp.tanh(y @ w)  # (M, N)


def _inputs(seed):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return tuple(jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, SHAPES.values()))


@pytest.fixture(scope="module")
def dump_folder(tmp_path_factory):
    """One compile's dumps, kept on disk, shared by the tests that read a folder."""
    folder = tmp_path_factory.mktemp("xla_dump")
    dump_passes(rmsnorm_matmul_tanh, *_inputs(1), dump_to=str(folder))
    return folder


@pytest.fixture(scope="module")
def timeline():
    return dump_passes(rmsnorm_matmul_tanh, *_inputs(0))


def test_timeline_has_several_steps_in_order(timeline):
    assert len(timeline.steps) >= 3
    assert all(s.ok for s in timeline.steps), [s.error for s in timeline.steps]
    orders = [s.order for s in timeline.steps]
    assert orders == sorted(orders)
    assert timeline.steps[0].pass_name == "before_optimizations"
    assert timeline.dumps_read >= len(timeline.steps) - 1


def test_kernel_count_falls_through_fusion(timeline):
    first, final = timeline.steps[0], timeline.final
    assert first.kernel_count > final.kernel_count
    assert first.bytes_total > final.bytes_total
    fusion = _biggest_drop(timeline)
    before = timeline.steps[timeline.steps.index(fusion) - 1]
    assert fusion.kernel_count < before.kernel_count
    assert _is_fusion_pass(fusion.pass_name), fusion
    if jax.default_backend() == "cpu":
        assert fusion.pass_name == "fusion"


def test_final_step_matches_inspect(timeline):
    rep = hlo_inspect.inspect(rmsnorm_matmul_tanh, *_inputs(2))
    assert [k.name for k in timeline.final.kernels] == [k.name for k in rep.kernels]
    assert timeline.final.bytes_total == rep.totals.bytes_total


def test_provenance_names_a_fusion_pass_for_each_fusion(timeline):
    origins = timeline.provenance()
    assert [o.kernel for o in origins] == [k.name for k in timeline.final.kernels]
    fusions = [o for o, k in zip(origins, timeline.final.kernels) if k.instruction.opcode == "fusion"]
    assert fusions
    for o in fusions:
        assert _is_fusion_pass(o.created_by.pass_name), (o.kernel, o.created_by)
    if jax.default_backend() == "cpu":  # on GPU this program becomes two Triton fusions, no loop fusion
        assert {o.created_by.pass_name for o in origins if o.category == "loop"} == {"fusion", "fusion-wrapper"}
    assert any(o.created_by is _biggest_drop(timeline) for o in origins)


def test_table_mentions_passes_and_totals(timeline):
    text = timeline.table()
    for name in ("before_optimizations", _biggest_drop(timeline).pass_name, "jit_rmsnorm_matmul_tanh"):
        assert name in text
    assert f"kernels {timeline.steps[0].kernel_count} -> {timeline.final.kernel_count}" in text


def test_to_dict_is_json(timeline):
    d = json.loads(json.dumps(timeline.to_dict()))
    assert d["schema"] == "hlo_inspect.passes/1"
    assert len(d["steps"]) == len(timeline.steps)
    assert d["steps"][0]["kernels_delta"] is None
    assert sum(s["kernels_delta"] or 0 for s in d["steps"]) == timeline.final.kernel_count - \
        timeline.steps[0].kernel_count
    assert len(d["provenance"]) == timeline.final.kernel_count
    fusion = d["steps"][timeline.steps.index(_biggest_drop(timeline))]
    assert fusion["created"] and fusion["kernels_delta"] < 0


def test_load_pass_dumps_from_folder(dump_folder, timeline):
    loaded = load_pass_dumps(dump_folder)
    assert [(s.label, s.kernel_count) for s in loaded.steps] == [(s.label, s.kernel_count) for s in timeline.steps]
    assert loaded.module_name == "jit_rmsnorm_matmul_tanh"
    by_id = next(n for n in os.listdir(dump_folder) if n.startswith("module_")).split(".")[0]
    assert load_pass_dumps(dump_folder, module_name=by_id).module_name == loaded.module_name
    with pytest.raises(ValueError, match="module_name"):
        load_pass_dumps(dump_folder, module_name="jit_nothing")


def test_malformed_dump_is_recorded_not_raised(dump_folder, tmp_path):
    folder = tmp_path / "dump"
    shutil.copytree(dump_folder, folder)
    fusion_file = _biggest_drop(load_pass_dumps(folder)).file
    (folder / fusion_file).write_text("HloModule broken\n\nENTRY %main {\n  %x = f32[4 parameter(0)\n}\n")
    (folder / "notes.txt").write_text("not a dump")
    tl = load_pass_dumps(folder)
    broken = [s for s in tl.steps if not s.ok]
    assert [s.file for s in broken] == [fusion_file]
    assert "HloParseError" in broken[0].error
    assert tl.final.ok and tl.provenance()  # the steps after it still tell the story
    assert "unreadable" in tl.table()
    assert json.dumps(tl.to_dict())


def test_rename_keeps_the_creating_pass(dump_folder, tmp_path):
    """A later pass that only renames a fusion (as GPU's rename_fusions does) does not become its creator."""
    folder = tmp_path / "dump"
    shutil.copytree(dump_folder, folder)
    tl = load_pass_dumps(folder)
    final = tl.final
    fusion = _biggest_drop(tl)
    old = next(o for o in tl.provenance() if o.created_by is fusion).kernel
    prefix = final.file.split(".")[0] + "." + tl.module_name
    renamed = open(folder / final.file).read().replace(f"%{old} ", f"%loop_{old} ").replace(f"%{old})", f"%loop_{old})")
    renamed = renamed.replace(f"%{old},", f"%loop_{old},")
    (folder / f"{prefix}.9000.post-fusion_optimization.after_rename_fusions.before_x.txt").write_text(renamed)
    for name in os.listdir(folder):
        if name.endswith("_after_optimizations.txt"):
            os.remove(folder / name)
    origins = {o.kernel: o for o in load_pass_dumps(folder).provenance()}
    assert f"loop_{old}" in origins and old not in origins
    assert origins[f"loop_{old}"].created_by.pass_name == fusion.pass_name
    assert origins[f"loop_{old}"].former_names == (old,)


def test_selective_pass_re_dumps_around_named_passes(timeline):
    name = _biggest_drop(timeline).pass_name
    tl = dump_passes(rmsnorm_matmul_tanh, *_inputs(3), pass_re=f"^{re.escape(name)}$")
    assert name in [s.pass_name for s in tl.steps]
    assert tl.steps[0].kernel_count > tl.final.kernel_count


def test_pass_re_matching_no_pass_says_so_and_shows_no_step_number(tmp_path):
    """Only the input and the optimized module are dumped: the table names the regex that matched nothing and
    shows '-' and the stage name where a step number would be (not the order used to sort the files)."""
    tl = dump_passes(rmsnorm_matmul_tanh, *_inputs(5), pass_re="nonexistent_pass", dump_to=str(tmp_path))
    before, after = tl.steps
    assert (before.pass_name, after.pass_name, tl.dumps_read) == ("before_optimizations", "after_optimizations", 0)
    assert (before.order, after.order) == (-1, 0)  # after the optimizations: one past the last (no) step
    text = tl.table()
    lines = text.splitlines()
    assert lines[1].startswith("no pass matched pass_re 'nonexistent_pass' (0 per-pass dumps")
    assert [row.split()[0] for row in lines[4:6]] == ["-", "-"]
    created = [line for line in lines if line.endswith(f"after_optimizations ({after.pipeline})")]
    assert created and not re.search(r"step \d", text), text
    assert tl.to_dict()["pass_re"] == "nonexistent_pass" and tl.to_dict()["steps"][1]["order"] == 0
    assert load_pass_dumps(tmp_path).table().splitlines()[1].startswith("no pass dumps in the folder")


# Multi-output fusion results as XLA's newer dumps print them: `%mof#1`, with no get-tuple-element.
TUPLE_REFS = """HloModule m, is_scheduled=true

%fused (p: f32[4]) -> (f32[4], (f32[4], f32[4])) {
  %p = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p)
  %n = f32[4]{0} negate(%p)
  %inner = (f32[4]{0}, f32[4]{0}) tuple(%n, %e)
  ROOT %t = (f32[4]{0}, (f32[4]{0}, f32[4]{0})) tuple(%e, %inner)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %mof = (f32[4]{0}, (f32[4]{0}, f32[4]{0})) fusion(%x), kind=kLoop, calls=%fused
  ROOT %add = f32[4]{0} add(%mof#0, %mof#1#0)
}
"""


def test_tuple_element_references_are_read(tmp_path):
    module = hlo_inspect.parse(TUPLE_REFS)
    add = module.entry.by_name["add"]
    assert [o.opcode for o in add.operands] == ["get-tuple-element"] * 2
    assert [o.tuple_index for o in add.operands] == [0, 0]
    assert add.operands[1].operands[0].operands[0].name == "mof"
    assert [k.name for k in hlo_inspect.kernels(module)] == ["mof", "add"]
    with pytest.raises(hlo_inspect.HloParseError, match="no tuple element 7"):
        hlo_inspect.parse(TUPLE_REFS.replace("%mof#1#0", "%mof#1#7"))
    (tmp_path / "module_0001.m.0001.fusion.after_multi_output_fusion.before_dce.txt").write_text(TUPLE_REFS)
    step, = load_pass_dumps(tmp_path).steps
    assert step.ok and step.kernel_count == 2


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="pass_re"):
        dump_passes(rmsnorm_matmul_tanh, *_inputs(4), pass_re="(")
    with pytest.raises(ValueError, match="xla_flags"):
        dump_passes(rmsnorm_matmul_tanh, *_inputs(4), xla_flags=f"--xla_dump_to={tmp_path}")
    with pytest.raises(ValueError, match="folder"):
        load_pass_dumps(tmp_path)


@pytest.mark.parametrize("filename, expected", [
    ("module_0008.jit_f.0006.simplification.after_algsimp.before_simplify-sorts.txt",
     ("jit_f", 6, "simplification", "algsimp", "simplify-sorts")),
    ("module_0001.jit_f.0123.fusion.after_priority-fusion.before_multi_output_fusion.txt",
     ("jit_f", 123, "fusion", "priority-fusion", "multi_output_fusion")),
    ("module_0008.jit_f.0033.copy-insertion.after_adding_copies_to_resolve_interference.txt",
     ("jit_f", 33, "copy-insertion", "adding_copies_to_resolve_interference", "")),
    ("module_0042.gemm_fusion_dot.1.0000.x.after_y.before_z.txt", ("gemm_fusion_dot.1", 0, "x", "y", "z")),
    ("module_0001.jit_f.before_optimizations.txt", ("jit_f", -1, "", "before_optimizations", "")),
    ("module_0001.jit_f.sm_9.0_gpu_after_optimizations.txt",
     ("jit_f", None, "sm_9.0_gpu", "after_optimizations", "")),  # numbered by load_pass_dumps
    ("module_0001.jit_f.sm_9.0_gpu_after_optimizations-buffer-assignment.txt", None),
    ("module_0001.jit_f.ir-no-opt.ll", None),
])
def test_dump_file_names(filename, expected):
    d = _classify_file(filename)
    got = None if d is None else (d.module_name, d.order, d.pipeline, d.pass_name, d.next_pass)
    assert got == expected
