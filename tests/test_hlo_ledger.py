"""hlo_inspect ledger: the tensors that round-trip HBM between kernels."""

import jax
import jax.numpy as jnp

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
