"""Capture the optimized HLO text the tests read, on whatever backend is present.

    PYTHONPATH=$PWD python tests/data/capture.py --out tests/data        # CPU here; on a GPU machine the same

Writes `<prefix>_<program>.hlo.txt` (prefix `cpu`, or the GPU's short name such as `h100`) and
`<prefix>_manifest.json` with jax's version, the device and XLA's `cost_analysis()` of each program, so tests can
compare our totals with XLA's without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import jax
import jax.numpy as jnp


def _prefix() -> str:
    if jax.default_backend() == "cpu":
        return "cpu"
    kind = jax.devices()[0].device_kind.lower()
    for name in ("h200", "h100", "a100", "l4", "b200"):
        if name in kind:
            return name
    return kind.replace(" ", "_")


def _while_loop_program():
    """A fori_loop with a matmul and an elementwise update inside: exercises nested control flow."""

    def body(i, carry):
        x, w = carry
        return jnp.tanh(x @ w) + 0.5 * x, w

    def f(x, w):
        return jax.lax.fori_loop(0, 4, body, (x, w))[0]

    keys = jax.random.split(jax.random.key(1), 2)
    return f, (jax.random.normal(keys[0], (128, 256)), jax.random.normal(keys[1], (256, 256)) / 16)


def _pallas_program():
    """A Pallas elementwise kernel between two XLA ops (Triton backend on GPU, interpret mode on CPU)."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, y_ref, o_ref):
        x, y = x_ref[...].astype(jnp.float32), y_ref[...].astype(jnp.float32)  # Triton has no bf16 divide
        o_ref[...] = (x * jax.nn.sigmoid(y)).astype(o_ref.dtype)

    def swish_gate(x, y):
        block = (64, 128)
        params = {}
        if jax.default_backend() == "gpu":
            from jax.experimental.pallas import triton as plgpu
            params = dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(x.shape[0] // block[0], x.shape[1] // block[1]),
            in_specs=[pl.BlockSpec(block, lambda i, j: (i, j))] * 2,
            out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
            interpret=jax.default_backend() == "cpu", **params)(x, y)

    def f(x, y):
        return jnp.sum(swish_gate(x * 2.0, y), axis=-1)

    keys = jax.random.split(jax.random.key(2), 2)
    return f, (jax.random.normal(keys[0], (256, 512), jnp.bfloat16),
               jax.random.normal(keys[1], (256, 512), jnp.bfloat16))


def _cudnn_attention_program():
    def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    keys = jax.random.split(jax.random.key(3), 3)
    shape = (2, 256, 4, 64)
    return f, tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in keys)


def _block_program(train_step: bool):
    from jaxfuse import programs
    from jaxfuse.kernels import KernelSet

    p = programs.build_program(model="block", train_step=train_step, kernels=KernelSet())  # the CLI's default
    return p.fn, p.args


def programs_to_capture() -> dict:
    progs = {
        "block_fwd": lambda: _block_program(False),
        "block_grad": lambda: _block_program(True),
        "while_loop": _while_loop_program,
        "pallas": _pallas_program,
    }
    if jax.default_backend() == "gpu":
        progs["cudnn_attention"] = _cudnn_attention_program
    return progs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = parser.parse_args()
    prefix = _prefix()
    manifest = {"jax": jax.__version__, "backend": jax.default_backend(),
                "device": jax.devices()[0].device_kind, "programs": {}}
    for name, make in programs_to_capture().items():
        fn, fn_args = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            compiled = jax.jit(fn).lower(*fn_args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        path = os.path.join(args.out, f"{prefix}_{name}.hlo.txt")
        with open(path, "w") as f:
            f.write(compiled.as_text())
        manifest["programs"][name] = {
            "file": os.path.basename(path),
            "cost_analysis": {k: float(v) for k, v in (cost or {}).items()
                              if k in ("flops", "transcendentals", "bytes accessed")},
        }
        print(f"wrote {path}")
    with open(os.path.join(args.out, f"{prefix}_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
