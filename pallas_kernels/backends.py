"""The GPU backends a Pallas kernel can have, which of them can run here, and which one a call uses.

  from pallas_kernels import backends
  backends.unavailable_reason("mosaic")   # None on an sm90 GPU (or inside lowering_for_gpu()), else why not
  with backends.lowering_for_gpu():       # lower for CUDA on a CPU-only machine: no interpret mode, GPU tiles
      text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()

Backends: "triton" (``jax.experimental.pallas.triton``: any CUDA GPU, and interpret mode on the CPU) and "mosaic"
(``jax.experimental.pallas.mosaic_gpu``: an sm90 GPU; on other machines it can be lowered for CUDA inside
``lowering_for_gpu()``, not run). A call chooses with ``backend="auto" | "triton" | "mosaic"``.

Each op package (``attention/``, ``norm_matmul/``, ``cross_entropy/``) lists its backend modules in one registry,

  BACKENDS = backends.Registry("flash_attention", {"triton": "pallas_kernels.attention.triton"}, key=tuning_key)

and adding a backend is putting ``mosaic.py`` beside ``triton.py`` and one entry in that dict (modules are imported
when first used). A backend module exposes, with ``args``/``options`` the op's validated positional arguments and
keyword options (the public signature minus ``backend`` and ``block_sizes``, ``interpret`` resolved to a bool):

  Config                                  the frozen config dataclass its kernels take (one static argument)
  default_config(*args, **options)        the tuned (tuning cache) or built-in Config for these arguments
  unsupported_reason(*args, **options)    None when it runs these arguments; else one sentence naming the
                                          constraint (used by "auto" to fall back, and in the ValueError
                                          an explicit backend gets)
  sweep_candidates(*args, **options)      (forward, backward): Config field dicts for ``jaxfuse bench --tune``,
  FORWARD_FIELDS                          the forward ones varying only FORWARD_FIELDS
  check_config(config, *args, **options)  optional: ValueError naming what of ``config`` (a given ``block_sizes``)
                                          these arguments cannot take; ``plan`` runs it too, so a plan that
                                          returns is one the call runs
  <op>(*args, **options, config)          the op itself (``flash_attention``, ``rmsnorm_matmul``, ...), returning
                                          what the public function returns: every option reaches the backend,
                                          the reduction of ``linear_cross_entropy`` included (a backend that
                                          computes gradients in its forward needs it inside its custom VJP)

"auto" takes, among the backends that can run the call, the one with the lowest tuned time for this device and
shape key in the tuning cache when each of them has one; otherwise the first of them in the registry's order (an
op lists its fastest backend first). No import-time side effects; ``lowering_for_gpu`` is a scoped context
variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import jax

__all__ = ["CHOICES", "HIGHER_DERIVATIVES", "NAMES", "Plan", "Registry", "first_derivatives_only", "lowering_for_gpu",
           "resolve_config", "resolve_interpret", "traced_with_32_bit_indices", "unavailable_reason"]

NAMES = ("triton", "mosaic")
CHOICES = ("auto", *NAMES)

_LOWERING_FOR_GPU = contextvars.ContextVar("pallas_kernels_lowering_for_gpu", default=False)


@contextlib.contextmanager
def lowering_for_gpu():
    """Within this block, kernels called with ``interpret=None`` choose their GPU lowering and GPU tiles whatever
    the default backend is, and Mosaic counts as available: for lowering a program to CUDA on a machine without a
    GPU (``hlo_inspect.triton_ir.lower_kernels``, ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``).
    Such a program can be lowered here, not run."""
    token = _LOWERING_FOR_GPU.set(True)
    try:
        yield
    finally:
        _LOWERING_FOR_GPU.reset(token)


def traced_with_32_bit_indices(call: Callable) -> Callable:
    """``call`` (a Pallas kernel call) tracing its kernel with 32-bit defaults (``jax.enable_x64(False)``) even
    where ``jax_enable_x64`` is on: the kernels' index arithmetic mixes int32 program ids with Python ints, which
    x64 would make int64 (``lax.div`` then refuses the mix). With x64 off, as by default, this changes nothing."""

    def call_with_32_bit_indices(*args, **kwargs):
        if not jax.enable_x64.value:  # the default: traced as it always was
            return call(*args, **kwargs)
        with jax.enable_x64(False):
            return call(*args, **kwargs)

    return call_with_32_bit_indices


HIGHER_DERIVATIVES = ("the Pallas kernels have first derivatives only (jax.grad, jax.vjp, jax.value_and_grad): a "
                      "derivative of a derivative (jax.hessian, jax.grad of jax.grad, jax.jvp of jax.grad) is not "
                      "supported; differentiate the xla implementation (jaxfuse.kernels) or "
                      "pallas_kernels.reference for those")


def first_derivatives_only(call: Callable) -> Callable:
    """``call`` (a Pallas kernel call: arrays in, arrays out) refusing to be differentiated, with a ValueError that
    says so. Every op's custom VJP calls its kernels on plain values, so first derivatives never reach this; a
    second derivative differentiates the VJP's kernels, where Pallas itself fails with a bare AssertionError
    (interpret mode, jax 0.10.2) or "JVP with aliasing not supported"."""

    def call_once_differentiable(*args):
        at = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]  # (others, e.g. an absent input's None, stay)

        def with_arrays(*arrays):
            full = list(args)
            for i, a in zip(at, arrays):
                full[i] = a
            return call(*full)

        differentiable = jax.custom_jvp(with_arrays)

        @differentiable.defjvp
        def _refuse(primals, tangents):
            del primals, tangents
            raise ValueError(HIGHER_DERIVATIVES)

        return differentiable(*(args[i] for i in at))

    return call_once_differentiable


def shaped(x, shape=None, dtype=None):
    """x reshaped to ``shape`` and cast to ``dtype`` (None: as it is); a ``jax.ShapeDtypeStruct`` gives a new one, so
    each op's ``plan(...)`` takes abstract arguments as well as arrays (and array-likes become arrays)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape if shape is None else shape, x.dtype if dtype is None else dtype)
    x = jax.numpy.asarray(x)
    x = x if shape is None else x.reshape(shape)
    return x if dtype is None else x.astype(dtype)


def resolve_interpret(interpret: bool | None) -> bool:
    """The caller's choice, or True exactly when the default backend is CPU (Pallas has no CPU code generator),
    except inside ``lowering_for_gpu()``."""
    if interpret is None:
        return jax.default_backend() == "cpu" and not _LOWERING_FOR_GPU.get()
    return bool(interpret)


def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run (or, inside ``lowering_for_gpu()``, be lowered) on this machine; else why
    not. Triton runs everywhere (interpret mode on CPU); Mosaic needs an sm90 (Hopper) GPU."""
    if name not in NAMES:
        raise ValueError(f"backend: expected one of {list(CHOICES)}, got {name!r}")
    if name == "triton" or _LOWERING_FOR_GPU.get():
        return None
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and str(capability) == "9.0":
        return None
    seen = f"{device.device_kind} (compute capability {capability})" if device.platform == "gpu" else device.platform
    return f"Mosaic GPU kernels need an sm90 (Hopper) GPU; this machine's default device is {seen}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a call runs: the backend's name and the resolved config."""

    backend: str
    config: Any


class Registry:
    """One op's backend modules by name, imported on first use; resolves "auto" and explicit choices."""

    def __init__(self, op: str, modules: Mapping[str, str], *, key: Callable[..., str]):
        unknown = set(modules) - set(NAMES)
        if unknown:
            raise ValueError(f"modules: unknown backends {sorted(unknown)}; allowed: {list(NAMES)}")
        self.op = op
        self._modules = dict(modules)
        self._key = key

    def __repr__(self) -> str:
        return f"Registry({self.op!r}, {list(self._modules)})"

    @property
    def names(self) -> tuple[str, ...]:
        """The backends this op implements, in order of preference when they are not all tuned."""
        return tuple(self._modules)

    def module(self, name: str) -> ModuleType:
        """The backend module ``name``; ValueError if this op does not implement it."""
        if name not in self._modules:
            raise ValueError(f"backend={name!r} is not implemented for {self.op}; implemented: "
                             f"{', '.join(repr(n) for n in self.names)}")
        return importlib.import_module(self._modules[name])

    def tuning_key(self, *args, **options) -> str:
        """The tuning-cache key of these arguments (the same for every backend)."""
        return self._key(*args, **options)

    def reason(self, name: str, *args, config=None, **options) -> str | None:
        """Why backend ``name`` cannot run these arguments here (not implemented, not on this machine, or a
        constraint of the backend), or None. ``config``: the call's own config; where it is this backend's, the
        backend checks the inputs only (``unsupported_reason(..., config=)``), not its default config's tiles: the
        call's are for ``check_config`` to weigh, naming them."""
        if name not in self._modules:
            return f"backend={name!r} is not implemented for {self.op}"
        module = self.module(name)
        if isinstance(config, module.Config):
            options = dict(options, config=config)
        return unavailable_reason(name) or module.unsupported_reason(*args, **options)

    def resolve(self, requested: str, *args, config=None, **options) -> str:
        """The backend a call with ``backend=requested`` runs; ValueError naming what can run otherwise.
        ``config``: the call's own config, if any (``reason``)."""
        if requested not in CHOICES:
            raise ValueError(f"backend: expected one of {list(CHOICES)}, got {requested!r}")
        reasons = {name: self.reason(name, *args, config=config, **options) for name in self.names}
        runnable = [name for name, reason in reasons.items() if reason is None]
        available = ", ".join(repr(n) for n in runnable) or "none"
        if requested != "auto":
            if requested not in self._modules:
                raise ValueError(f"backend={requested!r} is not implemented for {self.op}; available here: "
                                 f"{available}")
            if reasons[requested] is not None:
                raise ValueError(f"backend={requested!r} cannot run {self.op} here: {reasons[requested]}; "
                                 f"available here: {available}")
            return requested
        if not runnable:
            raise ValueError(f"backend='auto': no backend can run {self.op} here: "
                             + "; ".join(f"{name}: {reason}" for name, reason in reasons.items()))
        if len(runnable) == 1:
            return runnable[0]
        from pallas_kernels import tuning

        key = self.tuning_key(*args, **options)
        timed = {name: tuning.tuned_time_us(self.op, key, backend=name) for name in runnable}
        if any(t is None for t in timed.values()):  # a time compared with nothing says nothing: registry order
            return runnable[0]
        return min(timed, key=timed.get)

    def plan(self, requested: str, block_sizes, *args, **options) -> tuple[ModuleType, Plan]:
        """(backend module, Plan) for a call: the backend as ``resolve`` (with "auto", a config instance of one
        backend asks for that backend, and so does a mapping of fields only one backend's config has), its config
        from ``block_sizes``, checked against the arguments (the module's ``check_config``)."""
        if requested == "auto" and block_sizes is not None and not isinstance(block_sizes, Mapping):
            # a backend's own config names that backend (a FlashAttentionConfig asks for Triton)
            requested = next((name for name in self.names if isinstance(block_sizes, self.module(name).Config)),
                             requested)
        elif requested == "auto" and block_sizes:  # e.g. a Triton tuned entry's params where Mosaic is tuned faster
            takers = [name for name in self.names
                      if set(block_sizes) <= {f.name for f in dataclasses.fields(self.module(name).Config)}]
            requested = takers[0] if len(takers) == 1 else requested
        given = None if block_sizes is None or isinstance(block_sizes, Mapping) else block_sizes
        name = self.resolve(requested, *args, config=given, **options)
        module = self.module(name)
        config = resolve_config(block_sizes, module.Config, lambda: module.default_config(*args, **options))
        check = getattr(module, "check_config", None)
        if check is not None:
            check(config, *args, **options)
        return module, Plan(name, config)


def resolve_config(block_sizes, config_cls: type, default: Callable[[], Any], *, arg: str = "block_sizes"):
    """``block_sizes`` as a ``config_cls``: an instance is used as it is; None gives ``default()``; a mapping of
    some fields overrides those of ``default()``. ValueError names unknown fields and other types (and the
    argument as ``arg``)."""
    if isinstance(block_sizes, config_cls):
        return block_sizes
    if block_sizes is not None and not isinstance(block_sizes, Mapping):
        raise ValueError(f"{arg}: expected a {config_cls.__name__} or a mapping of its fields, "
                         f"got {type(block_sizes).__name__}")
    config = default()
    if not block_sizes:
        return config
    fields = [f.name for f in dataclasses.fields(config_cls)]
    unknown = set(block_sizes) - set(fields)
    if unknown:
        raise ValueError(f"{arg}: unknown fields {sorted(unknown)}; allowed: {fields}")
    return dataclasses.replace(config, **block_sizes)
