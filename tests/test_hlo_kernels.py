"""hlo_inspect.kernels: categories, HBM bytes and FLOPs, on hand-written modules and captured text."""

import os

import pytest

import hlo_inspect

DATA = os.path.join(os.path.dirname(__file__), "data")


def read(name: str) -> str:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return f.read()


HAND_WRITTEN = """HloModule hand_written

%add_f32 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_exp (p0: f32[128,256], p1: f32[256]) -> f32[128,256] {
  %p0 = f32[128,256]{1,0} parameter(0)
  %p1 = f32[256]{0} parameter(1)
  %bc = f32[128,256]{1,0} broadcast(%p1), dimensions={1}, metadata={op_name="jit(f)/Model/norm/mul"}
  %m = f32[128,256]{1,0} multiply(%p0, %bc), metadata={op_name="jit(f)/Model/norm/mul"}
  ROOT %e = f32[128,256]{1,0} exponential(%m), metadata={op_name="jit(f)/Model/act/exp"}
}

%fused_reduce (p0.1: f32[128,256]) -> f32[128] {
  %p0.1 = f32[128,256]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[128]{0} reduce(%p0.1, %zero), dimensions={1}, to_apply=%add_f32
}

%fused_slice (p0.2: f32[128,256]) -> f32[64,256] {
  %p0.2 = f32[128,256]{1,0} parameter(0)
  %s = f32[64,256]{1,0} slice(%p0.2), slice={[0:64], [0:256]}
  ROOT %n = f32[64,256]{1,0} negate(%s)
}

%fused_update (buf: f32[1024,256], upd: f32[8,256], i: s32[]) -> f32[1024,256] {
  %buf = f32[1024,256]{1,0} parameter(0)
  %upd = f32[8,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[1024,256]{1,0} dynamic-update-slice(%buf, %upd, %i, %z)
}

ENTRY %main (x: f32[128,256], g: f32[256], w: bf16[256,512], cache: f32[1024,256], pos: s32[]) -> (f32[128], f32[64,256], f32[128,512], f32[1024,256]) {
  %x = f32[128,256]{1,0} parameter(0)
  %g = f32[256]{0} parameter(1)
  %w = bf16[256,512]{1,0} parameter(2)
  %cache = f32[1024,256]{1,0} parameter(3)
  %pos = s32[] parameter(4)
  %x.bitcast = f32[128,256]{1,0} bitcast(%x)
  %loop = f32[128,256]{1,0} fusion(%x, %g), kind=kLoop, calls=%fused_exp
  %red = f32[128]{0} fusion(%loop), kind=kInput, calls=%fused_reduce
  %sl = f32[64,256]{1,0} fusion(%loop), kind=kLoop, calls=%fused_slice
  %cv = bf16[128,256]{1,0} convert(%loop)
  %d = f32[128,512]{1,0} dot(%cv, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %twice = f32[128,256]{1,0} add(%x, %x.bitcast)
  %upd = f32[8,256]{1,0} slice(%twice), slice={[0:8], [0:256]}
  %cache.new = f32[1024,256]{1,0} fusion(%cache, %upd, %pos), kind=kLoop, calls=%fused_update
  ROOT %t = (f32[128]{0}, f32[64,256]{1,0}, f32[128,512]{1,0}, f32[1024,256]{1,0}) tuple(%red, %sl, %d, %cache.new)
}
"""


@pytest.fixture(scope="module")
def hand():
    return {k.name: k for k in hlo_inspect.kernels(hlo_inspect.parse(HAND_WRITTEN))}


def test_hand_written_kernel_list(hand):
    assert list(hand) == ["loop", "red", "sl", "cv", "d", "twice", "upd", "cache.new"]
    assert {n: k.category for n, k in hand.items()} == {
        "loop": "loop", "red": "reduction", "sl": "loop", "cv": "unfused", "d": "dot", "twice": "unfused",
        "upd": "unfused", "cache.new": "loop"}


def test_hand_written_bytes(hand):
    f32 = 4
    # loop: x (128x256 f32) + g (256 f32) in, 128x256 f32 out
    assert (hand["loop"].bytes_read, hand["loop"].bytes_written) == (128 * 256 * f32 + 256 * f32, 128 * 256 * f32)
    assert (hand["red"].bytes_read, hand["red"].bytes_written) == (128 * 256 * f32, 128 * f32)
    # a fusion parameter used only through a slice is read only for the slice
    assert (hand["sl"].bytes_read, hand["sl"].bytes_written) == (64 * 256 * f32, 64 * 256 * f32)
    assert (hand["cv"].bytes_read, hand["cv"].bytes_written) == (128 * 256 * f32, 128 * 256 * 2)
    assert (hand["d"].bytes_read, hand["d"].bytes_written) == (128 * 256 * 2 + 256 * 512 * 2, 128 * 512 * f32)
    # x and bitcast(x) are one buffer, read once
    assert hand["twice"].bytes_read == 128 * 256 * f32
    assert (hand["upd"].bytes_read, hand["upd"].bytes_written) == (8 * 256 * f32, 8 * 256 * f32)
    # in-place dynamic-update-slice: reads the update and index, writes the update, never the whole cache
    assert (hand["cache.new"].bytes_read, hand["cache.new"].bytes_written) == (8 * 256 * f32 + 4, 8 * 256 * f32)


def test_hand_written_flops(hand):
    assert (hand["loop"].flops, hand["loop"].transcendentals) == (128 * 256, 128 * 256)  # multiply; exp apart
    assert hand["red"].flops == 128 * 255  # n - 1 adds per row
    assert hand["sl"].flops == 64 * 256
    assert hand["d"].flops == 2 * 128 * 512 * 256
    assert hand["upd"].flops == 0


def test_hand_written_ops_and_scopes(hand):
    assert dict(hand["loop"].ops) == {"broadcast": 1, "multiply": 1, "exponential": 1}
    assert hand["loop"].scopes == ["Model/norm", "Model/act"]


WHILE_LOOP = """HloModule loop

%fused_sin (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %s = f32[1024]{0} sine(%p)
}

%body (state: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %state = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %v = f32[1024]{0} get-tuple-element(%state), index=1
  %one = s32[] constant(1)
  %i.next = s32[] add(%i, %one)
  %v.next = f32[1024]{0} fusion(%v), kind=kLoop, calls=%fused_sin
  ROOT %out = (s32[], f32[1024]{0}) tuple(%i.next, %v.next)
}

%cond (state.1: (s32[], f32[1024])) -> pred[] {
  %state.1 = (s32[], f32[1024]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %x)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %res = f32[1024]{0} get-tuple-element(%w), index=1
}
"""


def test_while_loop_bodies_are_walked():
    rep = hlo_inspect.from_text(WHILE_LOOP)
    by_name = {k.name: k for k in rep.kernels}
    assert set(by_name) == {"lt", "i.next", "v.next"}
    assert by_name["v.next"].loop == "body" and by_name["v.next"].launches == 5
    assert by_name["lt"].loop == "cond" and by_name["lt"].launches == 6  # the condition runs once more
    assert by_name["v.next"].transcendentals == 1024
    totals = rep.totals
    assert totals.kernels == 3 and totals.launches == 5 + 5 + 6
    assert totals.bytes_read == 5 * (4096 + 4 + 4) + 6 * (4 + 4)  # sine; i + 1; i < n


# ---- captured text -------------------------------------------------------------------------------------------

def test_h100_mlp_grad_kernels():
    rep = hlo_inspect.from_text(read("h100_mlp_grad.hlo.txt"))
    ks = {k.name: k for k in rep.kernels}
    assert len(ks) == 15
    cats = [k.category for k in rep.kernels]
    assert cats.count("triton_gemm") == 5 and cats.count("triton_reduction") == 2
    assert cats.count("reduction") == 5 and cats.count("loop") == 3
    # gemm_fusion_dot.2 reads x (bf16[64,256]) and the up kernel (f32[256,512]), writes f32[4,64,512]
    g = ks["gemm_fusion_dot.2"]
    assert g.bytes_read == 64 * 256 * 2 + 256 * 512 * 4
    assert g.bytes_written == 4 * 64 * 512 * 4
    assert g.flops == 2 * 4 * 64 * 512 * 64 + 64 * 4 * 64  # the dot and the bf16->f32 convert
    assert g.scopes == ["B/up"] and g.source_lines == ["probe.py:9"]
    # input_reduce_fusion.3 reduces f32[64,512] to f32[512]
    r = ks["input_reduce_fusion.3"]
    assert (r.bytes_read, r.bytes_written) == (64 * 512 * 4, 512 * 4)


def test_cpu_mlp_grad_kernels():
    rep = hlo_inspect.from_text(read("cpu_mlp_grad.hlo.txt"))
    cats = [k.category for k in rep.kernels]
    assert len(cats) == 25
    assert cats.count("cpu_fusion") == 11 and cats.count("loop") == 12 and cats.count("dot") == 2
    ks = {k.name: k for k in rep.kernels}
    # dot.1 = wrapped_convert (f32[64,256])ᵀ · multiply_add_fusion (f32[64,512]) -> f32[256,512]
    d = ks["dot.1"]
    assert (d.bytes_read, d.bytes_written, d.flops) == (64 * 256 * 4 + 64 * 512 * 4, 256 * 512 * 4,
                                                        2 * 256 * 512 * 64)


def test_cudnn_attention_kernel():
    rep = hlo_inspect.from_text(read("h100_cudnn_attention.hlo.txt"))
    assert len(rep.kernels) == 1
    k = rep.kernels[0]
    assert k.category == "cudnn" and k.target == "__cudnn$fmhaSoftmax"
    b, t, n, h = 2, 256, 4, 64
    assert k.bytes_read == 3 * b * t * n * h * 2
    assert k.bytes_written == b * t * n * h * 2  # the u8 workspace is not traffic
    assert k.flops == 4 * b * n * t * t * h // 2  # causal: half the tiles


def test_report_json_round_trip():
    import json
    rep = hlo_inspect.from_text(read("h100_mlp_grad.hlo.txt"))
    data = json.loads(rep.to_json())
    assert data["schema"] == "hlo_inspect.report/1"
    assert len(data["kernels"]) == 15
    assert data["totals"]["bytes_total"] == sum(k["bytes_read"] + k["bytes_written"] for k in data["kernels"])
    table = rep.table()
    assert "gemm_fusion_dot.2" in table and "Triton GEMM fusion" in table


def test_xla_reification_cost_estimate():
    text = read("h100_pallas.hlo.txt")
    assert all(k.xla_estimate_us is None for k in hlo_inspect.from_text(text).kernels)
    text = text.replace('"reification_cost":[]', '"reification_cost":[{"end_to_end_cycles":"900",'
                        '"exec_time_us":12.5,"compute_time_us":3.0,"memory_access_time_us":12.5}]', 1)
    estimates = [k.xla_estimate_us for k in hlo_inspect.from_text(text).kernels]
    assert estimates.count(12.5) == 1
