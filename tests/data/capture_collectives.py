"""Capture SPMD-partitioned HLO with collectives on 4 virtual CPU devices, for hlo_inspect's collective tests.

    PYTHONPATH=$PWD python tests/data/capture_collectives.py --out tests/data

Sets `XLA_FLAGS=--xla_force_host_platform_device_count=4` before jax starts (run it as a program, not from a
process that already imported jax). Writes `cpu4_<program>.hlo.txt`, the optimized HLO of each program below
(`compiled.as_text()`), with a first comment line naming this script, jax's version and the program. Each
program's docstring says which collective it makes and the per-device shapes; tests/test_hlo_collectives.py
computes the bytes they send by hand from those shapes.

`--check` compiles every program and prints, per program, the collective opcodes hlo_inspect finds and our
totals over XLA's `cost_analysis()` (`bytes=1.000 flops=1.000`), writing nothing (the live-jax test).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ["JAX_PLATFORMS"] = "cpu"  # the virtual devices are CPU ones, on a GPU machine too

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

try:
    from jax import shard_map as _shard_map  # jax >= 0.8
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map


def _mesh(shape=(4,), names=("x",)) -> Mesh:
    import numpy as np

    return Mesh(np.array(jax.devices()[:4]).reshape(shape), names)


def _smap(f, mesh, in_specs, out_specs):
    # check_vma=False: an all_gather's result is replicated, which the check cannot infer.
    return jax.jit(_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def psum_program():
    """all-reduce: x f32[8,16] per device (global (32, 16) over 'x'), psum over all 4 devices."""
    mesh = _mesh()
    f = _smap(lambda x: jax.lax.psum(x, "x"), mesh, P("x"), P())
    return f, (jax.ShapeDtypeStruct((32, 16), jnp.float32),)


def psum_groups_program():
    """all-reduce in groups of 2: mesh (2, 2) ('a', 'b'), x f32[4,32] per device, psum over 'b' only."""
    mesh = _mesh((2, 2), ("a", "b"))
    f = _smap(lambda x: jax.lax.psum(x, "b"), mesh, P(("a", "b")), P("a"))
    return f, (jax.ShapeDtypeStruct((16, 32), jnp.float32),)


def all_gather_program():
    """all-gather: x bf16[2,64] per device, gathered over 4 devices into bf16[8,64]."""
    mesh = _mesh()
    f = _smap(lambda x: jax.lax.all_gather(x, "x", tiled=True), mesh, P("x"), P())
    return f, (jax.ShapeDtypeStruct((8, 64), jnp.bfloat16),)


def psum_scatter_program():
    """reduce-scatter: x f32[32,8] per device (replicated input), psum_scatter over 4 devices into f32[8,8]."""
    mesh = _mesh()
    f = _smap(lambda x: jax.lax.psum_scatter(x, "x", tiled=True), mesh, P(), P("x"))
    return f, (jax.ShapeDtypeStruct((32, 8), jnp.float32),)


def all_to_all_program():
    """all-to-all: x f32[4,16] per device (global (16, 16) over 'x'), split axis 1 into 4, concat on axis 0."""
    mesh = _mesh()
    f = _smap(lambda x: jax.lax.all_to_all(x, "x", split_axis=1, concat_axis=0, tiled=True), mesh, P("x"), P("x"))
    return f, (jax.ShapeDtypeStruct((16, 16), jnp.float32),)


def ppermute_program():
    """collective-permute: x f32[4,8] per device, shifted one device to the right around the ring of 4."""
    mesh = _mesh()
    perm = [(i, (i + 1) % 4) for i in range(4)]
    f = _smap(lambda x: jax.lax.ppermute(x, "x", perm), mesh, P("x"), P("x"))
    return f, (jax.ShapeDtypeStruct((16, 8), jnp.float32),)


def sharded_matmul_program():
    """jit with NamedSharding (no shard_map): x f32[16,64] sharded over its contracting dim on 4 devices,
    w f32[64,32] sharded the same way; the partitioner's all-reduce sums the partial products f32[16,32]."""
    mesh = _mesh()
    xs = NamedSharding(mesh, P(None, "x"))
    ws = NamedSharding(mesh, P("x", None))
    f = jax.jit(lambda x, w: jnp.tanh(x @ w), in_shardings=(xs, ws), out_shardings=NamedSharding(mesh, P()))
    return f, (jax.ShapeDtypeStruct((16, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32))


PROGRAMS = {
    "psum": psum_program, "psum_groups": psum_groups_program, "all_gather": all_gather_program,
    "psum_scatter": psum_scatter_program, "all_to_all": all_to_all_program, "ppermute": ppermute_program,
    "sharded_matmul": sharded_matmul_program,
}


def compiled_text(name: str) -> str:
    f, args = PROGRAMS[name]()
    return f.lower(*args).compile().as_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--check", action="store_true", help="compile and list collectives; write nothing")
    args = parser.parse_args()
    if len(jax.devices()) < 4:
        raise SystemExit(f"need 4 devices, have {len(jax.devices())}: was jax imported before XLA_FLAGS was set?")
    for name in PROGRAMS:
        if args.check:
            import hlo_inspect

            f, inputs = PROGRAMS[name]()
            rep = hlo_inspect.inspect(f, *inputs)
            ratios = " ".join(f"{row['quantity'].split()[0]}={row['ratio']:.3f}" for row in rep.comparison()
                              if row["quantity"] in ("bytes accessed", "flops") and row["ratio"] is not None)
            print(name, " ".join(k.collective.opcode for k in rep.kernels if k.collective), ratios)
            continue
        text = compiled_text(name)
        header = (f"// captured by tests/data/capture_collectives.py, jax {jax.__version__}, "
                  f"{jax.default_backend()} x4: {name}\n")
        path = os.path.join(args.out, f"cpu4_{name}.hlo.txt")
        with open(path, "w") as f:
            f.write(header + text)
        print(path, len(text))


if __name__ == "__main__":
    main()
