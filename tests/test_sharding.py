"""jaxfuse.sharding and jaxfuse.sharded_kernels: the mesh parser, the partition rules, and (in a subprocess on 4 virtual
CPU devices: ``tests/mesh_checks.py``) sharded losses, gradients and kernel sites against one device."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from jaxfuse import cli, sharded_kernels
from jaxfuse.sharding import Layout, parse_mesh

_CHECKS = os.path.join(os.path.dirname(__file__), "mesh_checks.py")


def test_parse_mesh_sizes_and_defaults():
    assert parse_mesh("data=2,model=2", 4) == {"data": 2, "model": 2}
    assert parse_mesh(" model=4 ", 4) == {"data": 1, "model": 4}
    assert parse_mesh("data=1") == {"data": 1, "model": 1}


@pytest.mark.parametrize("spec, n_devices, said", [
    ("pipe=2", None, "unknown axis 'pipe'"),
    ("data=0", None, "positive int, got '0'"),
    ("data=-2", None, "positive int, got '-2'"),
    ("data=two", None, "positive int, got 'two'"),
    ("data=2.0", None, "positive int, got '2.0'"),
    ("data=2,data=2", None, "given twice"),
    ("data", None, "items like 'data=2'"),
    ("", None, "axis sizes like"),
    ("data=2,model=2", 2, "has 4 devices (data=2 x model=2) but this machine has 2"),
])
def test_parse_mesh_errors_name_the_argument_what_was_seen_and_what_is_allowed(spec, n_devices, said):
    with pytest.raises(ValueError, match="^mesh: ") as e:
        parse_mesh(spec, n_devices)
    assert said in str(e.value)
    if "unknown axis" in said:
        assert "['data', 'model']" in str(e.value)


def _layout(data, model, fsdp=False):
    return Layout(AbstractMesh((data, model), ("data", "model")), fsdp=fsdp)


def test_partition_rules():
    qkv, out, emb, scale = ("blocks", "0", "attn", "qkv_proj", "kernel"), ("blocks", "0", "attn", "out_proj", "kernel"), \
        ("embed", "embedding"), ("blocks", "0", "norm1", "scale")
    dp = _layout(4, 1)
    assert dp.strategy == "dp"
    assert dp.spec(qkv, (64, 192)) == P(None, None) and dp.spec(emb, (256, 64)) == P(None, None)
    fsdp = _layout(4, 1, fsdp=True)
    assert fsdp.strategy == "fsdp"
    assert fsdp.spec(qkv, (64, 192)) == P(None, "data")  # the largest dimension the axis divides
    assert fsdp.spec(emb, (256, 64)) == P("data", None)
    assert fsdp.spec(scale, (6,)) == P(None)  # 4 does not divide 6: replicated
    tp = _layout(2, 2)
    assert tp.strategy == "dp+tp"
    assert tp.spec(qkv, (64, 192)) == P(None, "model")  # column-parallel
    assert tp.spec(out, (64, 64)) == P("model", None)  # row-parallel
    assert tp.spec(("lm_head", "kernel"), (64, 256)) == P(None, "model")  # vocabulary-parallel
    assert tp.spec(emb, (256, 64)) == P(None, None)
    both = _layout(2, 2, fsdp=True)
    assert both.strategy == "fsdp+tp"
    assert both.spec(qkv, (64, 192)) == P("data", "model")
    assert both.spec(emb, (256, 64)) == P(("data", "model"), None)  # left whole by tp: over every device
    # an optimizer-state leaf follows the parameter at the end of its path
    assert both.spec(("1", "0", "mu", "blocks", "0", "attn", "qkv_proj", "kernel"), (64, 192)) == P("data", "model")


def test_check_model_names_what_does_not_divide():
    from jaxfuse.models import Config

    cfg = Config.tiny()  # 2 kv heads, MLP 96, vocabulary 128
    _layout(2, 2).check_model(cfg, batch=4)
    with pytest.raises(ValueError, match="batch 3 is not divisible by data=2"):
        _layout(2, 2).check_model(cfg, batch=3)
    with pytest.raises(ValueError, match=r"model=4 splits the key/value heads \(2\)"):
        _layout(1, 4).check_model(cfg, batch=4)


def test_cli_refuses_fsdp_without_a_mesh_and_a_mesh_this_machine_lacks(capsys):
    assert cli.main(["inspect", "--fsdp"]) == 2
    assert "--fsdp shards over the mesh's data axis: give --mesh too" in capsys.readouterr().err
    assert cli.main(["bench", "--op", "attention", "--mesh", "data=1"]) == 2
    assert "--mesh runs the train step on a mesh: --op train_step" in capsys.readouterr().err
    assert cli.main(["train", "--mesh", "data=64", "--steps", "2"]) == 2
    assert "mesh: 'data=64' has 64 devices" in capsys.readouterr().err


def _run_checks(name: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, _CHECKS, name], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-4000:]}"
    assert done.stdout.rstrip().endswith("ok")
    return done.stdout


@pytest.mark.slow
def test_sharded_losses_and_gradients_equal_one_device():
    """dp, fsdp, dp+tp and fsdp+tp on 4 CPU devices: loss, gradients and a whole AdamW step; fsdp holds 1/4."""
    out = _run_checks("layouts")
    for strategy in ("dp", "fsdp", "dp+tp", "fsdp+tp"):
        assert f" {strategy} loss and grads: rel err" in out


@pytest.mark.slow
def test_pallas_sites_under_shard_map_equal_unsharded():
    """attention over batch and heads, norm_matmul over rows and N, the loss over tokens and a split vocabulary."""
    out = _run_checks("sites")
    for site in ("attention", "norm_matmul", "loss"):
        assert f"{site} under shard_map: value and gradients: rel err" in out


@pytest.mark.slow
def test_pallas_train_step_on_fsdp_tp_equals_one_device():
    assert "fsdp+tp step (params, optimizer state, loss)" in _run_checks("pallas_step")


def test_vocabulary_sharded_loss_refuses_options_its_log_sum_exp_recovery_does_not_hold_for():
    mesh = AbstractMesh((1, 2), ("data", "model"))
    calls = []
    loss = sharded_kernels.loss(lambda *a, **k: calls.append(k))
    h, w, labels = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.zeros((4,), jnp.int32)
    with jax.sharding.use_abstract_mesh(mesh):
        for option in (dict(z_loss=1e-4), dict(logit_soft_cap=30.0)):
            with pytest.raises(ValueError, match=rf"loss: {next(iter(option))}=.* vocabulary split over 'model'"):
                loss(h, w, labels, **option)
    assert not calls  # refused before any kernel ran
