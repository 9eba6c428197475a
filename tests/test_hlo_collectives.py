"""Collectives in SPMD-partitioned programs: kernels of their own category with the bytes each device sends
and receives (hlo_inspect.collectives), in the table, JSON, ledger and diff.

The CPU programs are tests/data/cpu4_*.hlo.txt, captured on 4 virtual devices by tests/data/capture_collectives.py
(each program's docstring there gives its per-device shapes). Every expected byte count below is worked out by
hand from those shapes and the ring model: all-reduce 2(n-1)/n·S, all-gather (n-1)·S of the shard,
reduce-scatter and all-to-all (n-1)/n·S, collective-permute S per pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import hlo_inspect
from hlo_inspect import collectives
from hlo_inspect.cli import main as hlo_inspect_main
from hlo_inspect.collectives import parse_replica_groups, parse_source_target_pairs
from hlo_inspect.parser import HloParseError

DATA = os.path.join(os.path.dirname(__file__), "data")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name: str) -> str:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return f.read()


def collective_kernels(rep) -> list[tuple]:
    return [(k.collective.opcode, k.collective.group_size, k.bytes_sent, k.bytes_received)
            for k in rep.kernels if k.category == "collective"]


# ---- captured CPU programs (4 virtual devices) ----------------------------------------------------------

@pytest.mark.parametrize("name, expected, hbm", [
    # x f32[8,16] = 512 B per device, psum over 4: 2·3/4·512 = 768.
    ("psum", ("all-reduce", 4, 768, 768), (512, 512)),
    # x f32[4,32] = 512 B, psum over 'b' of a (2, 2) mesh: groups {0,1},{2,3}, 2·1/2·512 = 512.
    ("psum_groups", ("all-reduce", 2, 512, 512), (512, 512)),
    # bf16[2,64] (converted to f32[2,64] = 512 B on the CPU) gathered over 4: 3·512 = 1536 (= 3/4 of 2 KiB).
    ("all_gather", ("all-gather", 4, 1536, 1536), (512, 2048)),
    # f32[32,8] = 1024 B scattered over 4: 3/4·1024 = 768.
    ("psum_scatter", ("reduce-scatter", 4, 768, 768), (1024, 256)),
    # four f32[4,4] chunks = 256 B, all-to-all over 4: each device keeps one chunk and sends 3·64 = 192.
    ("all_to_all", ("all-to-all", 4, 192, 192), (256, 256)),
    # f32[4,8] = 128 B around the ring {0,1},{1,2},{2,3},{3,0}: every device sends and receives 128.
    ("ppermute", ("collective-permute", 4, 128, 128), (128, 128)),
    # The partitioner's all-reduce of the partial products f32[16,32] = 2048 B over 4 (replica_groups in the
    # mesh-axes form mesh['axis_0'=1,'axis_1'=4] {'axis_1'}): 2·3/4·2048 = 3072.
    ("sharded_matmul", ("all-reduce", 4, 3072, 3072), (2048, 2048)),
])
def test_captured_collectives_bytes(name, expected, hbm):
    rep = hlo_inspect.from_text(read(f"cpu4_{name}.hlo.txt"))
    assert collective_kernels(rep) == [expected]
    (k,) = [k for k in rep.kernels if k.collective]
    assert (k.bytes_read, k.bytes_written) == hbm  # the local HBM traffic stays the kernel's own
    # XLA's cost analysis counts an all-reduce 1 FLOP per output element, the other collectives 0.
    assert k.flops == (k.instruction.shape.num_elements if expected[0] == "all-reduce" else 0)
    assert k.collective.note == "" and not rep.warnings
    assert rep.totals.collectives == 1 and rep.totals.bytes_sent == expected[2]


def test_captured_groups_are_read_as_xla_prints_them():
    rep = hlo_inspect.from_text(read("cpu4_psum_groups.hlo.txt"))
    (k,) = rep.kernels
    assert k.collective.num_groups == 2 and k.collective.replica_groups == "{{0,1},{2,3}}"
    rep = hlo_inspect.from_text(read("cpu4_sharded_matmul.hlo.txt"))
    ar = next(k for k in rep.kernels if k.collective)
    assert ar.collective.replica_groups.startswith("mesh[") and ar.collective.num_groups == 1
    # The all-reduce sits between the GEMM and the tanh: both tensors are round trips through it.
    trips = {(t.producer.name, tuple(c.name for c in t.consumers)) for t in rep.ledger.round_trips}
    assert ("ynn_fusion", ("all-reduce",)) in trips and ("all-reduce", ("wrapped_tanh",)) in trips


def test_table_and_json_show_sent_and_received():
    rep = hlo_inspect.from_text(read("cpu4_psum.hlo.txt"))
    table = rep.table()
    header = next(line for line in table.splitlines() if line.startswith("#"))
    assert "sent" in header and "received" in header
    assert "collective (all-reduce ×4)" in table and "768 B" in table
    assert "collectives: 1 all-reduce; per device 768 B sent, 768 B received per run" in table
    data = json.loads(rep.to_json())
    (k,) = data["kernels"]
    assert (k["bytes_sent"], k["bytes_received"]) == (768, 768)
    assert k["collective"]["opcode"] == "all-reduce" and k["collective"]["group_size"] == 4
    assert data["totals"]["bytes_sent"] == 768 and data["totals"]["collectives"] == 1
    # A program without collectives keeps its table as it was: no network columns.
    plain = hlo_inspect.from_text(read("cpu_while_loop.hlo.txt"))
    assert "sent" not in plain.table().splitlines()[2] and plain.totals.bytes_sent == 0


def test_diff_lists_collectives_that_changed():
    a = hlo_inspect.from_text(read("cpu4_psum.hlo.txt"))
    b = hlo_inspect.from_text(read("cpu4_psum_groups.hlo.txt"))
    d = hlo_inspect.diff(a, b)
    s = d.summary()
    assert s["collectives"] == [1, 1] and s["bytes_sent"] == [768, 512] and s["bytes_received"] == [768, 512]
    table = d.table()
    assert "psum.7 (all-reduce ×4) -> psum.7 (all-reduce ×2)  [768 B -> 512 B]" in table
    c = hlo_inspect.diff(a, hlo_inspect.from_text(read("cpu4_all_gather.hlo.txt")))
    kinds = {(m.kind, tuple(k.collective.opcode for k in m.a + m.b if k.collective)) for m in c.matches
             if m.has_collective}
    assert kinds == {("only_a", ("all-reduce",)), ("only_b", ("all-gather",))}
    assert c.to_dict()["summary"]["bytes_sent"] == [768, 1536]
    # Programs without collectives: no collective rows in the summary.
    plain = hlo_inspect.from_text(read("cpu_while_loop.hlo.txt"))
    assert "collectives" not in hlo_inspect.diff(plain, plain).summary()


# ---- asynchronous forms, hand-written after XLA's printer ------------------------------------------------
# Hand-written, not captured: CPU programs have synchronous collectives only. They follow what XLA prints for a
# GPU program (HloModule::ToString(), xla/hlo/ir/hlo_instruction_test.cc StringifyAsyncOpsWithReduceScatter):
# all-reduce-start / all-gather-start / collective-permute-start are opcodes of their own; reduce-scatter and
# all-to-all run through async-start, printed with the syntax sugar (`reduce-scatter-start`) or without it
# (`async-start(...), calls=%wrapped`).

_ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}
"""
_HEADER = ("HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8,256]{1,0}, f32[1024]{0}, "
           "f32[4,64]{1,0})->(bf16[32,256]{1,0}, f32[256]{0}, bf16[8,256]{1,0}, f32[4,64]{1,0})}, num_partitions=4\n")
_PARAMS = """ENTRY %main (p0: bf16[8,256], p1: f32[1024], p2: f32[4,64]) -> (bf16[32,256], f32[256], bf16[8,256], f32[4,64]) {
  %p0 = bf16[8,256]{1,0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  %p2 = f32[4,64]{1,0} parameter(2)
"""
_OWN_OPCODES = """  %all-gather-start = (bf16[8,256]{1,0}, bf16[32,256]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/layer/all_gather"}
  %all-gather-done = bf16[32,256]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = f32[1024]{0} all-reduce-start(%p1), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/layer/psum"}
  %all-reduce-done = f32[1024]{0} all-reduce-done(%all-reduce-start)
"""
_PERMUTE = """  %collective-permute-start = (bf16[8,256]{1,0}, bf16[8,256]{1,0}) collective-permute-start(%p0), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3}}
  %collective-permute-done = bf16[8,256]{1,0} collective-permute-done(%collective-permute-start)
  ROOT %tuple = (bf16[32,256]{1,0}, f32[256]{0}, bf16[8,256]{1,0}, f32[4,64]{1,0}) tuple(%all-gather-done, %reduce-scatter-done, %collective-permute-done, %all-to-all-done)
}
"""
ASYNC_SUGAR = _HEADER + "\n" + _ADD + "\n" + _PARAMS + _OWN_OPCODES + """\
  %reduce-scatter-start = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-start(%all-reduce-done), channel_id=3, replica_groups={{0,1,2,3}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %reduce-scatter-update = ((f32[1024]{0}), f32[256]{0}) reduce-scatter-update(%reduce-scatter-start)
  %reduce-scatter-done = f32[256]{0} reduce-scatter-done(%reduce-scatter-update)
  %all-to-all-start = ((f32[4,64]{1,0}), f32[4,64]{1,0}) all-to-all-start(%p2), channel_id=5, replica_groups={{0,1},{2,3}}, dimensions={0}
  %all-to-all-done = f32[4,64]{1,0} all-to-all-done(%all-to-all-start)
""" + _PERMUTE
ASYNC_GENERIC = _HEADER + "\n" + _ADD + """
%wrapped_reduce_scatter (pasync: f32[1024]) -> f32[256] {
  %pasync = f32[1024]{0} parameter(0)
  ROOT %reduce-scatter = f32[256]{0} reduce-scatter(%pasync), channel_id=3, replica_groups={{0,1,2,3}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

%wrapped_all_to_all (pa2a: f32[4,64]) -> f32[4,64] {
  %pa2a = f32[4,64]{1,0} parameter(0)
  ROOT %all-to-all = f32[4,64]{1,0} all-to-all(%pa2a), channel_id=5, replica_groups={{0,1},{2,3}}, dimensions={0}
}

""" + _PARAMS + _OWN_OPCODES + """\
  %reduce-scatter-start = ((f32[1024]{0}), f32[256]{0}) async-start(%all-reduce-done), calls=%wrapped_reduce_scatter
  %reduce-scatter-update = ((f32[1024]{0}), f32[256]{0}) async-update(%reduce-scatter-start)
  %reduce-scatter-done = f32[256]{0} async-done(%reduce-scatter-update)
  %all-to-all-start = ((f32[4,64]{1,0}), f32[4,64]{1,0}) async-start(%p2), calls=%wrapped_all_to_all
  %all-to-all-done = f32[4,64]{1,0} async-done(%all-to-all-start)
""" + _PERMUTE

# By hand: all-gather of bf16[8,256] (4096 B) over [1,4]<=[4] (4 devices): 3·4096 = 12288 each way.
# all-reduce of f32[1024] (4096 B) over [2,2]<=[2,2]T(1,0) = {0,2},{1,3}: 2·1/2·4096 = 4096.
# reduce-scatter of f32[1024] (4096 B) over 4: 3/4·4096 = 3072.
# all-to-all of f32[4,64] (1024 B) in groups of 2 (channel_id, no global ids: partitions {0,1},{2,3}): 1/2 = 512.
# collective-permute of bf16[8,256] (4096 B) along 0->1->2->3: device 1 and 2 send and receive 4096.
ASYNC_EXPECTED = [
    ("all-gather-start", "all-gather", 4, 12288, 12288, 4096, 16384),
    ("all-reduce-start", "all-reduce", 2, 4096, 4096, 4096, 4096),
    ("reduce-scatter-start", "reduce-scatter", 4, 3072, 3072, 4096, 1024),
    ("all-to-all-start", "all-to-all", 2, 512, 512, 1024, 1024),
    ("collective-permute-start", "collective-permute", 4, 4096, 4096, 4096, 4096),
]


@pytest.mark.parametrize("text", [ASYNC_SUGAR, ASYNC_GENERIC], ids=["sugar", "generic"])
def test_async_start_and_done_are_one_kernel(text):
    rep = hlo_inspect.from_text(text)
    assert [(k.name, k.collective.opcode, k.collective.group_size, k.bytes_sent, k.bytes_received, k.bytes_read,
             k.bytes_written) for k in rep.kernels] == ASYNC_EXPECTED
    entry = rep.module.entry.by_name
    assert [k.done for k in rep.kernels] == [entry[k.name.replace("-start", "-done")] for k in rep.kernels]
    assert all(k.category == "collective" for k in rep.kernels)
    assert [k.flops for k in rep.kernels] == [0, 1024, 0, 0, 0]  # the all-reduce: one add per output element
    assert rep.totals.bytes_sent == 12288 + 4096 + 3072 + 512 + 4096
    assert rep.kernels[0].scopes == ["layer"]  # op_name jit(step)/layer/all_gather, the primitive stripped
    # The all-reduce's result reaches the reduce-scatter through their dones: one round trip between them.
    (trip,) = rep.ledger.round_trips
    assert (trip.producer.name, [c.name for c in trip.consumers], trip.bytes) == (
        "all-reduce-start", ["reduce-scatter-start"], 4096)
    assert trip.tensor.instruction is entry["all-reduce-done"]
    writers = {t.name: (k.name if k else None) for t, k in rep.ledger.outputs}
    assert writers == {"all-gather-done": "all-gather-start", "reduce-scatter-done": "reduce-scatter-start",
                       "collective-permute-done": "collective-permute-start", "all-to-all-done": "all-to-all-start"}


def test_sugar_and_generic_forms_diff_as_the_same_program():
    d = hlo_inspect.diff(hlo_inspect.from_text(ASYNC_SUGAR), hlo_inspect.from_text(ASYNC_GENERIC))
    assert d.count("same") == 5 and d.summary()["bytes_sent"] == [24064, 24064]
    assert "collectives that changed" not in d.table()


def test_collective_in_a_loop_counts_every_trip():
    text = """HloModule m, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%body (s: (s32[], f32[64])) -> (s32[], f32[64]) {
  %s = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[64]{0} get-tuple-element(%s), index=1
  %r = f32[64]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %r)
}

%cond (c: (s32[], f32[64])) -> pred[] {
  %c = (s32[], f32[64]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[64])) -> (s32[], f32[64]) {
  %a = (s32[], f32[64]{0}) parameter(0)
  ROOT %w = (s32[], f32[64]{0}) while(%a), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""
    rep = hlo_inspect.from_text(text)
    (k,) = [k for k in rep.kernels if k.collective]
    assert (k.bytes_sent, k.launches) == (256, 5)  # f32[64] = 256 B over 2: 2·1/2·256 per trip
    assert rep.totals.bytes_sent == 5 * 256


# ---- replica groups, pairs and group modes --------------------------------------------------------------

def test_replica_groups_forms():
    assert parse_replica_groups("{{0,1},{2,3}}").groups == ((0, 1), (2, 3))
    assert parse_replica_groups("{}").group_size == 0
    assert parse_replica_groups("[2,2]<=[4]").groups == ((0, 1), (2, 3))
    assert parse_replica_groups("[2,2]<=[2,2]T(1,0)").groups == ((0, 2), (1, 3))
    # [2,4]<=[2,2,2]T(2,1,0): iota(8) as (2,2,2), reversed axes: device (i,j,k) -> 4i+2j+k read as k,j,i.
    assert parse_replica_groups("[2,4]<=[2,2,2]T(2,1,0)").groups == ((0, 4, 2, 6), (1, 5, 3, 7))
    assert parse_replica_groups("[1,4]<=[4]").groups == ((0, 1, 2, 3),)
    uneven = parse_replica_groups("{{0,1,2},{3}}")
    assert (uneven.num_groups, uneven.group_size) == (2, 3)  # the largest group: the busiest device
    mesh = parse_replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}")
    assert (mesh.num_groups, mesh.group_size) == (2, 4)
    sub = parse_replica_groups("mesh['axis_0'=8,'axis_1'=8,'axis_2'=16] {'axis_0':(2)4,'axis_1':(2)4}")
    assert (sub.num_groups, sub.group_size) == (64, 16)  # XLA's GetMeshAxesPartitionGroupsAcrossTargetDims test
    plain = parse_replica_groups("mesh[x=2,y=2] {x,y}")
    assert (plain.num_groups, plain.group_size) == (1, 4)
    assert parse_source_target_pairs("{{0,1},{1,0}}") == [(0, 1), (1, 0)]
    assert parse_source_target_pairs("{}") == []


@pytest.mark.parametrize("text, message", [
    ("{{0,x}}", "non-negative integers"),
    ("{{0,1},{}}", "a group with no devices"),
    ("[2,3]<=[4]", "as many devices as the iota"),
    ("[2,2]<=[2,2]T(0,0)", "not a permutation"),
    ("mesh['x'=2] {'y'}", "not one of the mesh's axes"),
    ("mesh['x'=4] {'x':(3)2}", "does not divide"),
    ("[1,4294967296]<=[4294967296]", "more than the"),
    ("all", "expected a list"),
])
def test_malformed_replica_groups_are_a_parse_error_naming_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_replica_groups(text)
    module = f"""HloModule m, num_partitions=4

{_ADD}
ENTRY %e (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  ROOT %r = f32[8]{{0}} all-reduce(%x), channel_id=1, replica_groups={text}, to_apply=%add
}}
"""
    with pytest.raises(HloParseError) as e:
        hlo_inspect.parse(module)
    assert message in str(e.value) and "%r" in str(e.value) and e.value.line_no == 11


def test_malformed_pairs_in_cli_name_the_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.hlo.txt"
    path.write_text(f"""HloModule m, num_partitions=2

ENTRY %e (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  ROOT %p = f32[8]{{0}} collective-permute(%x), channel_id=1, source_target_pairs={{{{0,1,2}}}}
}}
""")
    assert hlo_inspect_main([str(path)]) == 2
    message, text = capsys.readouterr().err.strip().splitlines()  # the message, then the line as written
    assert "line 5: %p: source_target_pairs" in message and "not a (source, target) pair" in message
    assert text.strip().startswith("ROOT %p")


def _one_collective(attrs: str, header: str = "", op: str = "all-reduce", shape: str = "f32[16]{0}") -> object:
    text = f"""HloModule m{header}

{_ADD}
ENTRY %e (x: f32[16]) -> f32[16] {{
  %x = f32[16]{{0}} parameter(0)
  ROOT %r = {shape} {op}(%x){attrs}
}}
"""
    rep = hlo_inspect.from_text(text)
    return rep, rep.kernels[0]


@pytest.mark.parametrize("attrs, header, n", [
    # No replica_groups and no channel: every replica (replica_count).
    (", to_apply=%add", ", replica_count=4", 4),
    # channel_id without use_global_device_ids: each replica group spans all partitions (1 replica x 4).
    (", channel_id=1, replica_groups={{0}}, to_apply=%add", ", num_partitions=4", 4),
    # The same with global ids: the group is the devices listed.
    (", channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add", ", num_partitions=4", 2),
    # Empty groups with a channel: every device, replicas x partitions.
    (", channel_id=1, replica_groups={}, to_apply=%add", ", replica_count=2, num_partitions=2", 4),
    # A mesh with explicit device ids (Mesh::ToString of a non-iota mesh): groups along 'b', 2 devices.
    (", channel_id=1, replica_groups=mesh['a'=2,'b'=2], device_ids=([0,2,1,3]) {'b'}, use_global_device_ids=true, "
     "to_apply=%add", ", num_partitions=4", 2),
])
def test_group_size_follows_xla_group_modes(attrs, header, n):
    rep, k = _one_collective(attrs, header)
    assert k.collective.group_size == n
    assert k.bytes_sent == 2 * (n - 1) * 64 // n  # f32[16] = 64 B


def test_missing_groups_without_device_counts_is_one_device_and_a_warning():
    rep, k = _one_collective(", to_apply=%add")  # as XLA's printer test writes it, no replica_count
    assert (k.collective.group_size, k.bytes_sent, k.bytes_received) == (1, 0, 0)
    assert any("no replica_groups and no replica_count" in w for w in rep.warnings)
    assert "no replica_groups" in rep.table()


def test_other_collectives_have_a_model_or_say_why_not():
    rep, k = _one_collective(", channel_id=1, replica_groups={{0,1,2,3}}", op="collective-broadcast")
    assert (k.collective.group_size, k.bytes_sent, k.bytes_received) == (4, 64, 64)  # S forwarded along a chain
    rep, k = _one_collective(", replica_groups={{0,1}}, to_apply=%add", op="collective-reduce")
    assert k.bytes_sent == 0 and any("no byte model" in w for w in rep.warnings)
    rep, k = _one_collective(", channel_id=1, source_target_pairs={{0,0},{1,1}}", op="collective-permute")
    assert k.bytes_sent == 0  # a pair whose source is its target moves nothing
    assert collectives.collective(rep.module.entry.by_name["x"], {}) is None


# ---- the CLI and the live jax -----------------------------------------------------------------------------

def test_hlo_inspect_cli_shows_collectives(tmp_path, capsys):
    html = tmp_path / "r.html"
    assert hlo_inspect_main([os.path.join(DATA, "cpu4_psum_scatter.hlo.txt"), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "collective (reduce-scatter ×4)" in out and "768 B" in out
    page = html.read_text()
    assert '"bytes_sent":768' in page and "sent per device" in page
    assert hlo_inspect_main([os.path.join(DATA, "cpu4_psum_scatter.hlo.txt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kernels"][0]["bytes_received"] == 768


def test_live_jax_still_prints_parseable_collectives():
    """Regenerates every program on 4 virtual CPU devices in a subprocess (XLA_FLAGS must be set before jax
    starts) and checks each still shows its collective, with our bytes and FLOPs equal to XLA's cost analysis."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(DATA, "capture_collectives.py"), "--check"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = {line.split()[0]: line.split()[1:] for line in proc.stdout.strip().splitlines()}
    assert {name: words[0] for name, words in found.items()} == {
        "psum": "all-reduce", "psum_groups": "all-reduce", "all_gather": "all-gather",
        "psum_scatter": "reduce-scatter", "all_to_all": "all-to-all", "ppermute": "collective-permute",
        "sharded_matmul": "all-reduce"}
    for name, words in found.items():  # flops only where XLA counts any (ratio of 0 to 0 is not printed)
        assert "bytes=1.000" in words and set(words[1:]) <= {"bytes=1.000", "flops=1.000"}, (name, words)


def test_jaxfuse_diff_of_saved_spmd_dumps(tmp_path, capsys):
    from jaxfuse import cli as jaxfuse_cli

    a, b = os.path.join(DATA, "cpu4_psum.hlo.txt"), os.path.join(DATA, "cpu4_psum_scatter.hlo.txt")
    html = tmp_path / "diff.html"
    assert jaxfuse_cli.main(["diff", "--a", a, "--b", b, "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "bytes_sent                      768 B -> 768 B" in out  # 2·3/4·512 and 3/4·1024
    assert "psum.7 (all-reduce ×4) -> -" in out and "- -> reduce_scatter.7 (reduce-scatter ×4)" in out
    assert '"sent_b":768' in html.read_text()
