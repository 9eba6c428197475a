"""What the project knows about one op, in one place: ``OpSpec`` (implementations from the site registry, named
shapes, inputs, floor, tolerance) and the tolerance rule the tests and the sweep share.

    from jaxfuse import suites
    spec = suites.get("attention")
    args = spec.make_inputs(spec.shapes["cpu"], seed=0)   # (q, k, v, do): the op's arguments, then the cotangent
    spec.tolerance(spec.shapes["cpu"])                    # max |x − ref| / max |ref| allowed vs the float32 reference
    spec.implementations()                                # {"pallas_triton": fn, "cudnn": fn, "xla": fn, ...}

A spec is data plus a few functions; ``jaxfuse.suites.runner.run(spec, ...)`` times any spec and
``jaxfuse.suites.sweep.tune(spec, ...)`` tunes its Pallas kernels. Implementations come from the model's site
registry (``jaxfuse.kernels.REGISTRIES[spec.site]``): every Pallas backend an op implements appears there as
``pallas_<backend>`` and is timed under that name, so a record always names the backend that ran.

Tolerance rule (``tolerance``): a relative error (max |x − ref| / max |ref|) of ``BASE_TOLERANCE[dtype]`` up to
``REFERENCE_LENGTH`` summed terms, growing with the square root of the reduction length past it (as tokamax's
``atol = base · sqrt(n)``: independent rounding errors add up like a random walk). The base values are what the
kernel tests have always asserted; every test shape reduces over fewer than REFERENCE_LENGTH terms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["BASE_TOLERANCE", "MODES", "REFERENCE_LENGTH", "OpSpec", "tolerance"]

BASE_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
REFERENCE_LENGTH = 2**16
MODES = ("fwd", "fwd+bwd")


def tolerance(dtype, reduction_length: int = 1) -> float:
    """Largest relative error against the float32 reference for inputs of ``dtype`` reduced over
    ``reduction_length`` terms: BASE_TOLERANCE[dtype] · max(1, sqrt(reduction_length / REFERENCE_LENGTH))."""
    name = np.dtype(dtype).name
    if name not in BASE_TOLERANCE:
        raise ValueError(f"dtype: {name} has no tolerance; one of {sorted(BASE_TOLERANCE)}")
    return BASE_TOLERANCE[name] * max(1.0, math.sqrt(reduction_length / REFERENCE_LENGTH))


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op's benchmark and test knowledge. Shapes are dicts of named dims (plus an optional "note").

    Attributes:
      name: what ``jaxfuse bench --op`` takes ("attention").
      site: the op's model site in ``jaxfuse.kernels`` ("attention", "norm_matmul", "loss"): its registry gives the
        implementations; None for a spec with its own (``implementations_fn``).
      op: the op's name in ``pallas_kernels.BACKENDS`` and the tuning cache ("flash_attention"), or None.
      shapes, default_shapes, cpu_shapes: named shapes; what a GPU runs by default; what is small enough for the
        CPU (interpret mode), the only shapes the CPU accepts.
      make_inputs: (shape, seed) -> the op's positional arguments, then the cotangent of its output when it has
        one to draw (a scalar loss takes 1): random, in ``dtype``.
      num_args: how many of those are the op's arguments.
      grad_argnums: the arguments "fwd+bwd" differentiates.
      output_names: per mode, the names of the program's outputs (flattened), as records report their errors.
      cost: (shape, variant, mode) -> (FLOPs, bytes) of the floor: the work any implementation must do.
      reduction_length: shape -> the longest reduction, for the tolerance rule.
      label: (shape, variant) -> the record's shape string.
      variants: keyword options each shape runs with (attention: causal False and True).
      baselines: implementations every record's ``speedup_vs`` is taken against (measured in the same run).
      extra_implementations: () -> suite-only implementations beside the registry's (name -> fn).
      opt_in: registry implementations run only when asked for ("xla_f32", the float32 reference).
      skip_reason: (implementation, shape) -> why it is not run at that shape (recorded as failed), or None.
      shape_reason: custom shape -> why no implementation can run it (attention: kv heads not dividing the query
        heads), or None; ``shape`` raises it as a ValueError.
      check_rows: compare with the reference on the first rows of every input and output (axis 0) only.
      input_sets: input sets rotated while timing; None: 3 when one set fits in the L2, else 1.
      tune_shapes: the shapes ``jaxfuse bench --tune`` sweeps by default.
      modes: the program kinds timed ("fwd", "fwd+bwd").
      program_fn: (implementation fn, mode, shape, variant) -> program over the inputs; None: ``program``.
      implementations_fn: () -> {name: fn}; None: the site registry plus ``extra_implementations``.
      reference_impl: the implementation whose float32 run every record's ``rel_error`` is taken against (inputs
        upcast to float32); None: no error check.
      summarize: program outputs -> numbers a record keeps (the train step's loss); None: nothing.
      tokens: shape -> tokens one call processes (the train step's batch x seq): records then carry
        ``tokens_per_s``; None: not a token count.
      wall_time: time with the host wall clock on a GPU too (a program on several devices, where CUPTI would add up
        every device's kernels).
    """

    name: str
    site: str | None
    op: str | None
    shapes: Mapping[str, Mapping[str, Any]]
    default_shapes: tuple[str, ...]
    cpu_shapes: tuple[str, ...]
    make_inputs: Callable[[Mapping[str, Any], int], tuple]
    num_args: int
    grad_argnums: tuple[int, ...]
    output_names: Mapping[str, tuple[str, ...]]
    cost: Callable[[Mapping[str, Any], Mapping[str, Any], str], tuple[float, float]]
    reduction_length: Callable[[Mapping[str, Any]], int]
    label: Callable[[Mapping[str, Any], Mapping[str, Any]], str]
    dtype: str = "bfloat16"
    variants: tuple[Mapping[str, Any], ...] = ({},)
    baselines: tuple[str, ...] = ("xla",)
    extra_implementations: Callable[[], dict[str, Callable]] = dict
    opt_in: tuple[str, ...] = ("xla_f32",)
    skip_reason: Callable[[str, Mapping[str, Any]], str | None] = lambda impl, shape: None
    shape_reason: Callable[[Mapping[str, Any]], str | None] = lambda shape: None
    check_rows: int | None = None
    input_sets: int | None = None
    tune_shapes: tuple[str, ...] = ()
    modes: tuple[str, ...] = MODES
    program_fn: Callable | None = None
    implementations_fn: Callable[[], dict[str, Callable]] | None = None
    reference_impl: str | None = "xla_f32"
    summarize: Callable[[Any], dict[str, float]] | None = None
    tokens: Callable[[Mapping[str, Any]], int] | None = None
    wall_time: bool = False

    def implementations(self) -> dict[str, Callable]:
        """Every implementation by name: the site registry's Pallas backends first (``pallas`` itself, the "auto"
        alias, is left out: ``pallas_<backend>`` names what runs), its other entries, then the suite's extras."""
        if self.implementations_fn is not None:
            return self.implementations_fn()
        from jaxfuse import kernels

        registry = kernels.REGISTRIES[self.site]
        pallas = {name: fn for name, fn in registry.items() if name in kernels.PALLAS_BACKENDS and name != "pallas"}
        others = {name: fn for name, fn in registry.items() if name not in kernels.PALLAS_BACKENDS}
        return pallas | others | self.extra_implementations()

    def default_implementations(self) -> list[str]:
        """What a run times unless told otherwise: each Pallas backend the op implements, the registry's baselines
        and the extras; not the opt-in ones."""
        from jaxfuse import kernels

        return [name for name in self.implementations()
                if name not in self.opt_in and not kernels.unimplemented_reason(self.site, name)]

    def tolerance(self, shape: Mapping[str, Any]) -> float:
        """The tolerance rule at this shape (``tolerance(dtype, reduction_length(shape))``)."""
        return tolerance(self.dtype, self.reduction_length(shape))

    def dims(self, shape: Mapping[str, Any]) -> dict[str, Any]:
        """The shape without its note."""
        return {k: v for k, v in shape.items() if k != "note"}

    def custom_dims(self) -> tuple[str, ...]:
        """The dims a custom shape names, in order (rmsnorm_matmul: M, K, N): those of the spec's shapes when
        every shape has the same integer dims; () when its shapes cannot be written that way (train_step)."""
        keys = {tuple(self.dims(shape)) for shape in self.shapes.values()}
        if len(keys) != 1:
            return ()
        (names,) = keys
        every_int = all(isinstance(v, int) for shape in self.shapes.values() for v in self.dims(shape).values())
        return names if every_int else ()

    def shape(self, name: str) -> Mapping[str, Any]:
        """The named shape, or a custom one: its dims' sizes joined by "x" in ``custom_dims`` order
        ("8192x1536x8960": M=8192, K=1536, N=8960). ValueError naming both forms otherwise."""
        if name in self.shapes:
            return self.shapes[name]
        dims = self.custom_dims()
        sizes = name.split("x")
        if dims and len(sizes) == len(dims) and all(s.isdigit() for s in sizes) and not all(map(int, sizes)):
            zero = ", ".join(f"{d}={s}" for d, s in zip(dims, sizes) if not int(s))
            raise ValueError(f"shapes: {name!r}: {zero}; every dim of a custom shape {'x'.join(dims)} must be a "
                             f"positive integer")
        if dims and len(sizes) == len(dims) and all(s.isdigit() and int(s) > 0 for s in sizes):
            shape = dict(zip(dims, map(int, sizes)), note="custom shape")
            reason = self.shape_reason(shape)
            if reason:
                raise ValueError(f"shapes: {name!r} ({', '.join(f'{k}={v}' for k, v in self.dims(shape).items())}): "
                                 f"{reason}")
            return shape
        custom = (f", or a custom shape {'x'.join(dims)} ({len(dims)} positive integers joined by 'x', e.g. "
                  f"{'x'.join(str(v) for v in self.dims(self.shapes[self.default_shapes[0]]).values())})"
                  if dims else "")
        raise ValueError(f"shapes: unknown {name!r}; {self.name} has {list(self.shapes)}{custom}")

    def program(self, fn: Callable, mode: str, shape: Mapping[str, Any], variant: Mapping[str, Any]) -> Callable:
        """A function of the inputs (``make_inputs``'s tuple) running one implementation in one mode: "fwd" the
        output; "fwd+bwd" (output, gradients of grad_argnums) for the drawn cotangent (1 for a scalar), one
        program, the output kept alive as a training step keeps it."""
        if self.program_fn is not None:
            return self.program_fn(fn, mode, shape, variant)
        import jax
        import jax.numpy as jnp

        n = self.num_args
        if mode == "fwd":
            return lambda *inputs: fn(*inputs[:n], **variant)

        def fwd_bwd(*inputs):
            primals = list(inputs[:n])

            def differentiable(*diff):
                args = list(primals)
                for i, x in zip(self.grad_argnums, diff):
                    args[i] = x
                return fn(*args, **variant)

            out, vjp = jax.vjp(differentiable, *(primals[i] for i in self.grad_argnums))
            cotangent = inputs[n] if len(inputs) > n else jnp.ones_like(out)
            return out, vjp(cotangent)

        return fwd_bwd
