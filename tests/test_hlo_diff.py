"""hlo_inspect.diff: matching kernels across two programs by the source ops they contain."""

import jax
import jax.numpy as jnp
import pytest

import hlo_inspect
from conftest import CPU_ONLY

_REDUCER = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

UNFUSED = "HloModule a\n" + _REDUCER + """
%f_exp (p: f32[64,128]) -> f32[64,128] {
  %p = f32[64,128]{1,0} parameter(0)
  ROOT %e = f32[64,128]{1,0} exponential(%p), metadata={op_name="jit(f)/act/exp"}
}

%f_sum (p.1: f32[64,128]) -> f32[64] {
  %p.1 = f32[64,128]{1,0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[64]{0} reduce(%p.1, %z), dimensions={1}, to_apply=%add, metadata={op_name="jit(f)/sum/reduce_sum"}
}

ENTRY %main (x: f32[64,128]) -> f32[64] {
  %x = f32[64,128]{1,0} parameter(0)
  %exp_fusion = f32[64,128]{1,0} fusion(%x), kind=kLoop, calls=%f_exp
  ROOT %sum_fusion = f32[64]{0} fusion(%exp_fusion), kind=kInput, calls=%f_sum
}
"""

FUSED = "HloModule b\n" + _REDUCER + """
%f_both (p.2: f32[64,128]) -> f32[64] {
  %p.2 = f32[64,128]{1,0} parameter(0)
  %e.2 = f32[64,128]{1,0} exponential(%p.2), metadata={op_name="jit(g)/act/exp"}
  %z.2 = f32[] constant(0)
  ROOT %r.2 = f32[64]{0} reduce(%e.2, %z.2), dimensions={1}, to_apply=%add, metadata={op_name="jit(g)/sum/reduce_sum"}
}

%f_neg (p.3: f32[64]) -> f32[64] {
  %p.3 = f32[64]{0} parameter(0)
  ROOT %n = f32[64]{0} negate(%p.3), metadata={op_name="jit(g)/post/neg"}
}

ENTRY %main (x: f32[64,128]) -> f32[64] {
  %x = f32[64,128]{1,0} parameter(0)
  %exp_sum_fusion = f32[64]{0} fusion(%x), kind=kInput, calls=%f_both
  ROOT %neg_fusion = f32[64]{0} fusion(%exp_sum_fusion), kind=kLoop, calls=%f_neg
}
"""


def test_merged_and_only_b():
    d = hlo_inspect.diff(hlo_inspect.from_text(UNFUSED), hlo_inspect.from_text(FUSED))
    kinds = {m.kind: ([k.name for k in m.a], [k.name for k in m.b]) for m in d.matches}
    assert kinds == {"merged": (["exp_fusion", "sum_fusion"], ["exp_sum_fusion"]), "only_b": ([], ["neg_fusion"])}
    # the exp output no longer round-trips; the fused reduction's output now does
    assert [t.name for t in d.vanished] == ["exp_fusion"]
    assert [t.name for t in d.appeared] == ["exp_sum_fusion"]
    s = d.summary()
    assert s["kernels"] == [2, 2] and s["matches"]["merged"] == 1
    assert s["ledger_traffic_bytes"] == [2 * 64 * 128 * 4, 2 * 64 * 4]
    assert "merged" in d.table()


def test_split_is_the_mirror_of_merged():
    d = hlo_inspect.diff(hlo_inspect.from_text(FUSED), hlo_inspect.from_text(UNFUSED))
    assert {m.kind for m in d.matches} == {"split", "only_a"}


def test_changed_category():
    changed = UNFUSED.replace("kind=kLoop, calls=%f_exp", "kind=kCustom, calls=%f_exp, backend_config="
                              '{"fusion_backend_config":{"kind":"__triton"}}')
    d = hlo_inspect.diff(hlo_inspect.from_text(UNFUSED), hlo_inspect.from_text(changed))
    assert sorted(m.kind for m in d.matches) == ["changed_category", "same"]


@pytest.mark.parametrize("name", ["h100_block_grad", "cpu_block_grad", "h100_pallas"])
def test_a_program_against_itself_is_all_same(name):
    with open(f"tests/data/{name}.hlo.txt") as f:
        text = f.read()
    d = hlo_inspect.diff(hlo_inspect.from_text(text), hlo_inspect.from_text(text))
    assert {m.kind for m in d.matches} == {"same"}
    assert len(d.matches) == len(d.a.kernels)
    assert d.vanished == [] and d.appeared == []


@CPU_ONLY
def test_diff_of_compiled_blocks_f32_vs_bf16():
    """bf16 compute with f32 parameters adds weight-cast kernels in B that A does not have; nothing else differs.

    The CPU computes bf16 dots in float32 between converts that carry no op_name, so the attention output's
    transpose in B fuses them and has no scope: it pairs with A's by shape and opcodes, converts aside."""
    from jaxfuse import programs

    small = dict(batch=1, seq=32, dim=64, heads=2, kv_heads=1)
    pa = programs.build_program("block", dtype="float32", **small)
    pb = programs.build_program("block", dtype="bfloat16", **small)
    a, b = hlo_inspect.inspect(pa.fn, *pa.args), hlo_inspect.inspect(pb.fn, *pb.args)
    d = hlo_inspect.diff(a, b, label_a="f32", label_b="bf16")
    only_b = [k for m in d.matches if m.kind == "only_b" for k in m.b]
    assert only_b and all(set(k.ops) == {"convert"} for k in only_b)
    assert not [m for m in d.matches if m.kind == "only_a"]
    weight_casts = {k.scopes[0] for k in only_b if set(k.ops) == {"convert"} and k.scopes}
    assert weight_casts == {"attn/qkv_proj", "attn/out_proj", "mlp/gate_up_proj", "mlp/down_proj"}
    assert any(t.shape.dtype == "bf16" for t in d.appeared)
    data = d.to_dict()
    assert data["schema"] == "hlo_inspect.diff/1" and data["a"]["kernels"] and data["b"]["kernels"]
    assert sum(len(m["a"]) for m in data["matches"]) == len(a.kernels)
    assert sum(len(m["b"]) for m in data["matches"]) == len(b.kernels)
