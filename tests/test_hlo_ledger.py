"""hlo_inspect ledger: the tensors that round-trip HBM between kernels."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

import hlo_inspect
from conftest import CPU_ONLY
from test_hlo_kernels import HAND_WRITTEN, WHILE_LOOP


def _trips(rep):
    return {t.name: t for t in rep.ledger.round_trips}


def test_hand_written_round_trips():
    rep = hlo_inspect.from_text(HAND_WRITTEN)
    trips = _trips(rep)
    assert set(trips) == {"loop", "cv", "twice", "upd"}
    loop = trips["loop"]
    assert [c.name for c in loop.consumers] == ["red", "sl", "cv"]
    f32 = 4
    # written once (128x256 f32), read whole by red and cv, read as a 64-row slice by sl
    assert loop.read_bytes == [128 * 256 * f32, 64 * 256 * f32, 128 * 256 * f32]
    assert loop.traffic_bytes == 128 * 256 * f32 * 3 + 64 * 256 * f32
    assert loop.producer_scopes == ["Model/norm", "Model/act"]
    assert trips["cv"].traffic_bytes == 2 * 128 * 256 * 2
    assert not any(t.is_output for t in trips.values())
    led = rep.ledger
    assert sorted(t.name for t, _ in led.inputs) == ["cache", "g", "pos", "w", "x"]
    readers_of_x = next(readers for t, readers in led.inputs if t.name == "x")
    assert [k.name for k in readers_of_x] == ["loop", "twice"]
    assert [t.name for t, _ in led.outputs] == ["red", "sl", "d", "cache.new"]
    assert led.traffic_bytes == sum(t.traffic_bytes for t in led.round_trips)
    assert led.by_scope()[0]["scope"] == "Model/norm"


def test_loop_state_is_not_a_round_trip():
    rep = hlo_inspect.from_text(WHILE_LOOP)
    assert rep.ledger.round_trips == []


@CPU_ONLY
def test_normalized_activations_round_trip_on_cpu():
    """XLA writes rmsnorm(x) to memory and the matmul reads it back: the ledger names that tensor."""

    def norm_matmul(x, g, w):
        with jax.named_scope("norm"):
            h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g
        with jax.named_scope("proj"):
            return h @ w

    m, k, n = 64, 256, 128
    keys = jax.random.split(jax.random.key(0), 3)
    rep = hlo_inspect.inspect(norm_matmul, jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (k,)),
                              jax.random.normal(keys[2], (k, n)))
    normalized = [t for t in rep.ledger.round_trips if t.shape.dims == (m, k)]
    assert len(normalized) == 1
    t = normalized[0]
    assert t.bytes == m * k * 4 and "norm" in t.producer_scopes
    assert any(s.startswith("proj") for s in t.consumer_scopes)
    assert t.producer.category == "loop" and t.consumers[0].category == "cpu_fusion"
    data = rep.to_dict()
    assert any(r["shape"].startswith(f"f32[{m},{k}]") for r in data["ledger"]["round_trips"])
    assert "HBM round trips" in rep.ledger_table(hbm_bytes_per_s=2.94e12)


def test_a_mask_from_iotas_alone_is_named_with_the_shape_its_consumer_broadcasts_it_to():
    """Captured on an H200 (jax 0.11.2): causal attention at 4x4096, 16 heads, its mask written from jnp.arange as a
    (T, S) array, and the same with the mask from iotas of the scores' shape (benchmarks/scripts/
    attention_einsum_order.py --hlo main). XLA made the first mask a kernel of its own, which the softmax fusion
    read broadcast (3604.8 against 1349.9 µs for that fusion); the ledger names it, the second has nothing to name."""
    data = os.path.join(os.path.dirname(__file__), "data")
    with open(os.path.join(data, "h200_attention_causal_arange_mask.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    [(trip, shapes)] = rep.ledger.from_constants()
    assert (trip.producer.name, str(trip.shape).split("{")[0], trip.producer.bytes_read) == (
        "loop_compare_fusion", "pred[4096,4096]", 0)
    assert [c.name for c in trip.consumers] == ["fusion.10"]
    assert [str(s).split("{")[0] for s in shapes] == ["pred[4,16,4096,4096]"]
    table = rep.ledger_table(4.3e12)
    assert "loop_compare_fusion computes pred[4096,4096] from iotas and constants alone; fusion.10 reads it " \
           "broadcast to" in table
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("loop_compare_fusion computes"))
    note = lines[start:lines.index("", start)]
    assert len(note) > 1 and all(len(line) <= 120 for line in note), note
    [entry] = json.loads(rep.to_json())["ledger"]["from_constants"]
    assert entry == {"tensor": "loop_compare_fusion", "shape": str(trip.shape), "bytes": 4096 * 4096,
                     "producer": "loop_compare_fusion", "consumers": ["fusion.10"], "broadcast_to": [str(shapes[0])],
                     "note": entry["note"]}
    assert " ".join(" ".join(note).split()) == entry["note"]
    with open(os.path.join(data, "h200_attention_causal_iota_mask.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    assert rep.ledger.from_constants() == [] and "iotas and constants" not in rep.ledger_table(4.3e12)
    assert rep.ledger.from_constants(min_bytes=0) == []  # nothing at any size: the mask is inside the softmax


def test_small_values_from_constants_are_left_out_of_the_table():
    """The block's RoPE tables and its small masks come from iotas alone too, but under 1 MiB."""
    with open(os.path.join(os.path.dirname(__file__), "data", "h100_block_grad.hlo.txt")) as f:
        rep = hlo_inspect.from_text(f.read())
    small = rep.ledger.from_constants(min_bytes=0)
    assert small and all(t.bytes < 1 << 20 and t.producer.bytes_read == 0 and not t.producer.instruction.operands
                         for t, _ in small)
    assert rep.ledger.from_constants() == [] and "iotas and constants" not in rep.ledger_table(4.3e12)


@pytest.mark.parametrize("bad", [-1, 1.5, "1MiB", True, None])
def test_from_constants_names_a_bad_min_bytes(bad):
    rep = hlo_inspect.from_text(HAND_WRITTEN)
    with pytest.raises(ValueError, match=r"min_bytes: expected an int >= 0 \(bytes\), got "):
        rep.ledger.from_constants(bad)
