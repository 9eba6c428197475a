"""Checks that need several devices, run by tests/test_sharding.py in a subprocess on 4 virtual CPU devices (XLA_FLAGS
must be set before jax starts): ``python tests/mesh_checks.py CHECK`` prints one line per comparison and exits 1 on
the first mismatch.

  layouts      the train step's loss and gradients on every strategy (dp, fsdp, dp+tp, fsdp+tp) equal one device's
  sites        each Pallas kernel site under shard_map equals the unsharded kernel: value and gradients
  pallas_step  the train step with every site Pallas on fsdp+tp equals one device's
"""

from __future__ import annotations

import contextlib
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxfuse import kernels, train  # noqa: E402
from jaxfuse.kernels import KernelSet  # noqa: E402
from jaxfuse.models import Config, Transformer  # noqa: E402
from jaxfuse.sharding import Layout, bytes_per_device  # noqa: E402

TOLERANCE = 1e-5  # float32: max |sharded − one device| / max |one device|


def _check(name: str, got, want, tolerance: float = TOLERANCE) -> None:
    err = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
              / max(float(np.max(np.abs(np.asarray(w, np.float64)))), 1e-30)
              for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print(f"{name}: rel err {err:.2e}", flush=True)
    if not err <= tolerance:  # NaN fails
        sys.exit(f"{name}: sharded differs from one device by {err:.2e} > {tolerance:.0e}")


def _model(kernel_set: KernelSet):
    """A tiny LM (head dim 32, as the Pallas attention takes), its AdamW, a batch of 4 x 32 tokens."""
    cfg = Config.from_width(64, 2, 2, n_layers=1, vocab=256, max_seq=32)
    graphdef, params = nnx.split(Transformer(cfg, kernels=kernel_set, rngs=nnx.Rngs(0)))
    opt, optax = train.optimizer(train.TrainConfig())
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab)
    return graphdef, params, opt, optax, tokens[:, :-1], tokens[:, 1:]


def _step_on(layouts, kernel_set: KernelSet) -> None:
    graphdef, params, opt, optax, x, y = _model(kernel_set)
    step, loss_of = train.step_functions(graphdef, opt, optax)
    want = jax.jit(jax.value_and_grad(loss_of))(params, x, y)
    want_step = jax.jit(step)(params, opt.init(params), x, y)
    for spec, fsdp in layouts:
        layout = Layout.parse(spec, fsdp=fsdp)
        step, loss_of = train.step_functions(graphdef, opt, optax, layout)
        p, o = train.place(layout, params, opt.init(params))
        xs, ys = (jax.device_put(a, layout.batch_sharding()) for a in (x, y))
        _check(f"{layout} {layout.strategy} loss and grads", jax.jit(jax.value_and_grad(loss_of))(p, xs, ys), want)
        got_step = jax.jit(step)(p, o, xs, ys)
        _check(f"{layout} {layout.strategy} step (params, optimizer state, loss)", got_step, want_step)
        kept = [a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(
            jax.tree.leaves(got_step[:2]), jax.tree.leaves(layout.shardings(got_step[:2])))]
        if not all(kept):
            sys.exit(f"{layout} {layout.strategy}: the step's outputs lost the layout's shardings")
        if fsdp:  # 1/devices of every parameter that divides: within 1.1x of 1/devices of the whole
            whole = sum(a.nbytes for a in jax.tree.leaves(params))
            held = bytes_per_device(got_step[0])
            print(f"{layout} {layout.strategy}: parameters per device {held} of {whole} bytes", flush=True)
            if held > 1.1 * whole / layout.devices:
                sys.exit(f"{layout}: a device holds {held} of {whole} parameter bytes, over 1.1 / {layout.devices}")


def layouts() -> None:
    _step_on([("data=4", False), ("data=4", True), ("data=2,model=2", False), ("data=2,model=2", True)], KernelSet())


def pallas_step() -> None:
    _step_on([("data=2,model=2", True)], KernelSet.parse("all=pallas_triton"))


def sites() -> None:
    """Each site's Pallas kernel traced on a data=2,model=2 mesh (shard_map) against the same kernel unsharded."""
    layout = Layout.parse("data=2,model=2")
    keys = iter(jax.random.split(jax.random.key(0), 12))
    normal = lambda shape, scale=1.0: scale * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    q, k, v = normal((2, 16, 4, 32)), normal((2, 16, 2, 32)), normal((2, 16, 2, 32))
    x, gamma, w = normal((4, 8, 64)), 1.0 + normal((64,), 0.1), normal((64, 96), 0.125)
    h, w_head = normal((24, 64)), normal((64, 256), 0.125)
    labels = jax.random.randint(next(keys), (24,), 0, 256).at[3].set(-100)  # one ignored row
    cases = {
        "attention": (lambda q, k, v: kernels.ATTENTION["pallas_triton"](q, k, v, causal=True), (q, k, v)),
        "norm_matmul": (lambda x, g, w: kernels.NORM_MATMUL["pallas_triton"](x, g, w), (x, gamma, w)),
        "loss": (lambda h, w: kernels.LOSS["pallas_triton"](h, w, labels), (h, w_head)),
    }
    for name, (fn, args) in cases.items():
        def value_and_grads(*args, fn=fn, traced_on=None):
            def scalar(*args):
                with traced_on.tracing() if traced_on else contextlib.nullcontext():
                    out = fn(*args)
                return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))) if out.ndim else out

            return jax.value_and_grad(scalar, argnums=tuple(range(len(args))))(*args)

        want = jax.jit(value_and_grads)(*args)
        args = jax.device_put(args, NamedSharding(layout.mesh, PartitionSpec()))  # a program on the mesh's devices
        got = jax.jit(lambda *a: value_and_grads(*a, traced_on=layout))(*args)
        _check(f"{name} under shard_map: value and gradients", got, want)
        hlo = jax.jit(lambda *a: value_and_grads(*a, traced_on=layout)).lower(*args).as_text()
        if "manual_computation" not in hlo and "SPMDFullToShardShape" not in hlo:  # Shardy or GSPMD
            sys.exit(f"{name}: the kernel did not run under shard_map")


if __name__ == "__main__":
    if len(jax.devices()) != 4:
        sys.exit(f"expected 4 virtual CPU devices, got {jax.devices()}: XLA_FLAGS was set too late")
    checks = {"layouts": layouts, "sites": sites, "pallas_step": pallas_step}
    for name in sys.argv[1:] or checks:
        checks[name]()
    print("ok", flush=True)
