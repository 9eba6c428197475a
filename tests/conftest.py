"""What the tests share: reproducible random inputs, the tolerance rule, and assertions on compiled programs.

  from conftest import ON_GPU, assert_close, key, normal, tolerance, cuda_program, pallas_calls, tensors_with
  from conftest import eqns_outside_kernels

Keys: every test draws from its own key stream, seeded from its node id (``zlib.crc32``, stable across processes,
unlike ``hash``), so a failing test sees the same inputs when run alone (``pytest -k NAME``), in another order or
under xdist. Tolerance: ``jaxfuse.suites.spec.tolerance`` (base per dtype, growing with the square root of the
reduction length). Programs: ``cuda_program`` lowers a function for CUDA on any machine and parses the HLO with
``hlo_inspect``, so tests can count the Pallas calls and look for tensors that must not exist; ``eqns_outside_kernels``
walks a jaxpr as traced (before jit's dead-code elimination).

Markers: ``slow`` (registered in pyproject.toml): the fast subset is ``pytest -m "not slow"``. ``GPU_TIMEOUT``
marks tests that run kernels on a GPU with a per-test limit, which pytest-timeout enforces where it is installed
(the GPU machine); elsewhere the marker is registered and does nothing (CI does not depend on the plugin).

GPU interpret mode: importing this module makes jax's interpreter compile each traced kernel body once, not once
per simulated thread, block and call (``_compile_each_interpreted_kernel_body_once``: the same programs run, in a
third to a fifth of the time).
"""

from __future__ import annotations

import collections
import inspect
import os
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_inspect
from jaxfuse.suites.spec import tolerance
from pallas_kernels import backends, triton_utils

__all__ = ["CPU_ONLY", "GPU_TIMEOUT", "KERNEL_PRIMITIVES", "ON_GPU", "assert_close", "cuda_program",
           "eqns_outside_kernels", "key", "normal", "pallas_calls", "rel_err", "require", "seed", "tensors_with",
           "tolerance"]

ON_GPU = jax.default_backend() == "gpu"
# For tests whose subject is what the CPU does (its compiler's fusions, wall-clock timing, interpret mode, errors
# only a machine without a GPU raises): skipped on the GPU machine, whose own tests cover the GPU.
CPU_ONLY = pytest.mark.skipif(ON_GPU, reason="checks the CPU's behaviour; the GPU's own tests cover the GPU")
# Seconds per test on the GPU machine (pytest-timeout): 60 for each pytest-xdist worker sharing it, whose compiles
# and float32 references' autotuning run side by side with this test's.
GPU_TIMEOUT = pytest.mark.timeout(60 * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def _compile_each_interpreted_kernel_body_once() -> bool:
    """GPU interpret mode (``mosaic_utils.interpret_on_cpu``) runs each block's threads (warpgroups) through
    ``thread_map``, whose callback traces, lowers and compiles the kernel body's jaxpr again in every thread of
    every block at every call (jax 0.10.2: 8 compiles of ~1 s for one call of a 4-warpgroup kernel on 2 simulated
    SMs, most of an interpret-mode test's time; the body's size, not the arrays', sets it). The program is the
    same each time (the thread id is an argument), so this compiles it once per (jaxpr, argument types) and runs
    that executable in every thread: the same program runs the same way, once compiled. Returns whether it
    applied (False where jax's internals differ: then nothing changes)."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return False
    run = getattr(thread_map, "_run_jaxpr", None)
    if run is None or getattr(run, "_compiles_once", False) or list(inspect.signature(run).parameters) != [
            "jaxpr", "consts", "args"]:
        return False
    compiled: collections.OrderedDict = collections.OrderedDict()  # (jaxpr, types) -> executable, most recent last
    lock = threading.Lock()

    def _run(jaxpr, consts, *args):
        jax.core.eval_jaxpr(jaxpr, consts, *args)

    def _run_jaxpr(jaxpr, consts, *args):
        key = (jaxpr, tuple(jax.typeof(a) for a in jax.tree.leaves((consts, args))))
        with lock:  # the block's threads arrive together: one compiles, the others wait for its executable
            executable = compiled.get(key)
            if executable is None:
                executable = jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
                compiled[key] = executable
                if len(compiled) > 32:
                    compiled.popitem(last=False)
            else:
                compiled.move_to_end(key)
        executable(consts, *args)

    _run_jaxpr._compiles_once = True
    thread_map._run_jaxpr = _run_jaxpr
    return True


INTERPRETER_COMPILES_ONCE = _compile_each_interpreted_kernel_body_once()


class _KeyStream:
    """jax.random keys folded from one seed, one per draw."""

    def __init__(self):
        self.reset("")

    def reset(self, name: str) -> None:
        self._root = jax.random.key(zlib.crc32(name.encode()))
        self._count = 0

    def __call__(self) -> jax.Array:
        self._count += 1
        return jax.random.fold_in(self._root, self._count)


_KEYS = _KeyStream()


@pytest.fixture(autouse=True)
def _keys_of_this_test(request):
    _KEYS.reset(request.node.nodeid)
    yield


def key() -> jax.Array:
    """A fresh key from the current test's stream."""
    return _KEYS()


def seed() -> int:
    """A fresh int seed from the current test's stream (for APIs that take an int)."""
    return int(jax.random.randint(key(), (), 0, 2**16))


def normal(shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """scale · N(0, 1) in float32, rounded to dtype, from a fresh key."""
    return (scale * jax.random.normal(key(), shape, jnp.float32)).astype(dtype)


def rel_err(got, want) -> float:
    """max |got − want| / max |want|, in float64 (NaN in got gives NaN)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_close(got, want, tol: float, name: str = "") -> None:
    """Same shape, every value finite (NaN never passes), and rel_err(got, want) <= tol."""
    got32 = np.asarray(got, np.float32)
    assert got32.shape == np.shape(want), (name, got32.shape, np.shape(want))
    assert np.isfinite(got32).all(), f"{name}: non-finite values"
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def require(plan, *args, **kwargs) -> None:
    """Skips the test when ``plan(*args, **kwargs)`` (an op package's ``plan`` with ``backend=``) says that backend
    cannot run these arguments here (not implemented, not on this machine, or a constraint it declares); any other
    ValueError is the test's failure."""
    try:
        plan(*args, **kwargs)
    except ValueError as e:
        if "cannot run" in str(e) or "not implemented" in str(e):
            pytest.skip(str(e))
        raise


def cuda_program(fn, *args) -> hlo_inspect.Report:
    """``fn(*args)`` lowered for CUDA (on any machine: kernels choose their GPU lowering inside
    ``backends.lowering_for_gpu``), as an ``hlo_inspect`` report of the pre-optimization HLO. Arguments may be
    arrays or ``jax.ShapeDtypeStruct``s."""
    with backends.lowering_for_gpu(), triton_utils.quiet_triton_deprecation():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return hlo_inspect.from_text(lowered.as_text(dialect="hlo"))


def pallas_calls(report: hlo_inspect.Report) -> list[str]:
    """The Pallas kernels (Triton or Mosaic GPU custom calls) a report launches, by their pallas_call name
    ("flash_attention_fwd"; the instruction's name where the backend config has none), in program order."""
    names = []
    for k in report.kernels:
        if k.category in ("pallas", "mosaic"):
            config = k.instruction.backend_config
            names.append(config.get("name") or k.name if isinstance(config, dict) else k.name)
    return names


def tensors_with(report: hlo_inspect.Report, *dims: int) -> list[str]:
    """Every array shape in every computation of the report (tuple leaves included) that has all of ``dims``
    among its dimensions (a dim listed twice must appear twice): e.g. ``tensors_with(rep, T, S)`` finds score
    tensors, which a flash-attention program must not have outside its kernels."""
    found = []
    for inst in report.module.instructions():
        for shape in inst.shape.leaves():
            remaining = list(shape.dims)
            for d in dims:
                if d not in remaining:
                    break
                remaining.remove(d)
            else:
                found.append(f"{inst.name}: {shape}")
    return found


# The jaxpr primitives a Pallas kernel appears as: Triton's pallas_call, Mosaic GPU's mpmd_map (plgpu.kernel).
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def eqns_outside_kernels(jaxpr):
    """Every equation of a jaxpr and its sub-jaxprs (loop bodies, custom VJP rules), not descending into
    kernels (``KERNEL_PRIMITIVES``)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                inner = getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr
                if inner is not None and hasattr(inner, "eqns"):
                    yield from eqns_outside_kernels(inner)
