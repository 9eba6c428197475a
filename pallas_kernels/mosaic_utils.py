"""Small helpers shared by the Pallas Mosaic-GPU (Hopper) kernels, and the one jax-version shim.

  from pallas_kernels import mosaic_utils as mu
  call = mu.kernel(body, out_type=..., grid=(mu.num_sms(),), grid_names=("sm",), num_threads=3,
                   thread_name="wg", name="gemm")             # Lane lowering semantics, set explicitly
  tile = mu.load(x_smem, layout=mu.TILE)                       # a tile in the wgmma accumulator layout
  rows = mu.load(r_gmem.at[pl.ds(m0, 128)], layout=mu.ROWS, optimized=False)   # one value per accumulator row
  transforms = mu.smem_transforms(64, jnp.bfloat16)            # (8, 64) tiling + 128-byte swizzle for TMA/wgmma

One source runs on jax 0.10.2 (CPU, CI: lowering only) and 0.11.2 (the H100). What differs between them and
is used here, handled in this module only:
  - ``plgpu.load(ref, idx, *, layout)``: 0.10.2 requires ``idx``; 0.11 deprecates it (index the ref with
    ``ref.at[...]`` first). ``load`` passes ``()`` only where the signature has no default for it.
  - ``CompilerParams.lowering_semantics`` defaults to Lane in 0.10.2 and Warpgroup in 0.11: ``compiler_params``
    always sets it, Lane unless asked (explicit layouts: ``TILE``, ``ROWS``, ``COLS``; the layouts are hints under
    Warpgroup semantics, which infers them: ``semantics="warpgroup"``, what jax's Hopper GEMM example uses).
  - ``plgpu.kernel`` takes ``out_type=`` / ``scratch_types=`` (0.11.2 removed ``out_shape``); both versions
    take ``kernel_name``.
  - GPU interpret mode (kernels run on the CPU, threads and shared memory simulated): ``InterpretGPUParams`` is
    private in 0.10.2 (``jax._src.pallas.mosaic_gpu.interpret``) and ``plgpu.InterpretGPUParams`` in 0.11. It
    implements neither ``plgpu.load`` nor ``layout_cast``, and 0.10.2's cannot feed a transposed ref to wgmma:
    inside ``interpret_on_cpu()`` (tests, small shapes) ``load`` and ``layout_cast`` here become plain reads /
    no-ops, which is all the layouts mean there, and callers materialize transposed operands (``interpreting``).
  - A zeroed global buffer that kernels add into (``kernel_accumulating``): a ``jax.new_ref`` through ``pl.kernel``,
    discharged in place with jax's private ``discharge_state`` (same call in both versions), since ``custom_vmap``
    (the attention backend's batching rule) has no state-discharge rule.
Everything else used by the kernels (``emit_pipeline_warp_specialized``, ``nd_loop``, ``WarpMesh``, ``wgmma``,
``ref.transpose``, TMA copies, barriers) has the same signature in both versions (0.11 deprecates
``plgpu.transpose_ref``: the kernels call ``ref.transpose(...)``).

Nothing here is kernel-specific; no import-time side effects.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.backends import first_derivatives_only, traced_with_32_bit_indices

__all__ = ["COLS", "H100_SMEM_BYTES", "H100_SMS", "ROWS", "SEMANTICS", "TILE", "TILE_TRANSPOSED", "compiler_params",
           "interpret_on_cpu", "interpreting", "is_hopper", "kernel", "kernel_accumulating", "layout_cast", "load",
           "num_sms", "profiling", "region", "smem_transforms"]

# Register layouts (Lane semantics): the wgmma accumulator layout of a (64·i, 8·j) tile, and the layouts of its
# row vectors (one value per accumulator row: a reduction over axis 1) and column vectors.
TILE = plgpu.Layout.WGMMA
TILE_TRANSPOSED = plgpu.Layout.WGMMA_TRANSPOSED  # a (rows, cols) tile read from SMEM stored (cols, rows): to TILE by
# one shuffle and one byte permute a register (``gemm.mosaic._Shape.load_a``)
ROWS = plgpu.Layout.WGMMA.reduce(1)
COLS = plgpu.Layout.WGMMA.reduce(0)

H100_SMS = 132  # streaming multiprocessors of an H100 SXM: the persistent grid when lowering without a GPU
H100_SMEM_BYTES = 227 * 1024  # shared memory one block may use on sm90 (232448 bytes)

# Number of simulated SMs while interpreting on the CPU (None: compile for the GPU).
_INTERPRET_SMS = contextvars.ContextVar("pallas_kernels_mosaic_interpret_sms", default=None)
# (directory, ranges, region names or None, kernel names or None) while kernels are built with Mosaic GPU's on-device
# profiler (``profiling``).
_PROFILE = contextvars.ContextVar("pallas_kernels_mosaic_profile", default=None)


@contextlib.contextmanager
def interpret_on_cpu(num_sms: int = 2):
    """Within this block, Mosaic kernels built with ``kernel`` run in GPU interpret mode on ``num_sms`` simulated
    SMs (a persistent grid that small still walks several tiles per block). Slow: for tests at small shapes."""
    token = _INTERPRET_SMS.set(num_sms)
    try:
        yield
    finally:
        _INTERPRET_SMS.reset(token)


@contextlib.contextmanager
def profiling(directory: str, ranges: int = 64, regions: tuple[str, ...] | None = None,
              kernels: tuple[str, ...] | None = None):
    """Within this block, Mosaic kernels built with ``kernel`` (those named in ``kernels``, where given) run Mosaic
    GPU's on-device profiler: each warpgroup's lane 0 records the SM clock (cycles) at the start and end of every
    ``region`` of the kernel body it runs (of ``regions``, where given), up to ``ranges`` regions per warpgroup (16
    bytes of shared memory each, beside the kernel's own; a kernel recording more fails when its trace is written),
    and every call writes a Perfetto trace, ``<kernel>-<ns>-trace.json``, into ``directory``
    (``hlo_inspect.mosaic_trace`` reads it). Only functions traced inside the block are affected (a jit traced
    before keeps its kernels). Kernels that use all of shared memory may not fit the profiler's buffer: fewer
    regions take less; ``kernels`` leaves the others of a program (its forward beside the backward's) as they are."""
    if not isinstance(ranges, int) or isinstance(ranges, bool) or ranges < 1:
        raise ValueError(f"ranges: must be a positive int (regions per warpgroup), got {ranges!r}")
    if not directory:
        raise ValueError("directory: must name the folder the traces go to, got an empty string")
    for arg, names in (("regions", regions), ("kernels", kernels)):
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"{arg}: must be None or a tuple of {arg[:-1]} names, got {names!r}")
    token = _PROFILE.set((str(directory), ranges, None if regions is None else tuple(regions),
                          None if kernels is None else tuple(kernels)))
    try:
        yield
    finally:
        _PROFILE.reset(token)


def region(name: str):
    """A named region of a kernel body (``jax.named_scope``) where ``profiling`` records it; else nothing (the
    kernel is the same either way)."""
    profile = _PROFILE.get()
    if profile is None or _INTERPRET_SMS.get() is not None or (profile[2] is not None and name not in profile[2]):
        return contextlib.nullcontext()
    return jax.named_scope(name)


def _interpret_params():
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:  # jax 0.10.x
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


@functools.lru_cache(maxsize=None)
def _load_needs_index() -> bool:
    """True on jax 0.10.x, where ``plgpu.load``'s ``idx`` argument has no default."""
    idx = inspect.signature(plgpu.load).parameters["idx"]
    return idx.default is inspect.Parameter.empty


def load(ref, *, layout=None, optimized: bool = True) -> jax.Array:
    """The whole of ``ref`` as a register array in ``layout``. SMEM tiles load with vectorized (optimized)
    transfers; pass ``optimized=False`` for GMEM refs (row / column vectors), which Mosaic reads element-wise."""
    if _INTERPRET_SMS.get() is not None:
        return ref[...]
    if optimized and layout is not None:  # a read of the ref that Lane lowering gives the layout that follows it
        return plgpu.layout_cast(ref[...], layout)
    if _load_needs_index():
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def interpreting() -> bool:
    """Whether kernels built now run in GPU interpret mode (inside ``interpret_on_cpu``)."""
    return _INTERPRET_SMS.get() is not None


def layout_cast(value: jax.Array, layout) -> jax.Array:
    """``plgpu.layout_cast`` (a no-op under ``interpret_on_cpu``)."""
    if _INTERPRET_SMS.get() is not None:
        return value
    return plgpu.layout_cast(value, layout)


SEMANTICS = ("lane", "warpgroup")


def compiler_params(semantics: str = "lane", kernel_name: str | None = None, **kwargs) -> plgpu.CompilerParams:
    """Mosaic-GPU compiler parameters with the lowering semantics set explicitly (the default changed in 0.11):
    ``semantics`` "lane" (default) or "warpgroup"; the profiler's where ``profiling`` names this kernel."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics: must be one of {SEMANTICS}, got {semantics!r}")
    mode = plgpu.LoweringSemantics.Lane if semantics == "lane" else plgpu.LoweringSemantics.Warpgroup
    profile = _PROFILE.get()
    if profile is not None and _INTERPRET_SMS.get() is None and (  # (``profiling``)
            profile[3] is None or kernel_name in profile[3]):
        kwargs = dict(kwargs, profile_dir=profile[0], profile_space=profile[1])
    return plgpu.CompilerParams(lowering_semantics=mode, **kwargs)


def kernel(body, *, out_type, scratch_types=(), grid, grid_names, num_threads, thread_name, name: str,
           semantics: str = "lane", cluster=(), cluster_names=(), **params):
    """``plgpu.kernel`` with the arguments both supported jax versions accept (``cluster``: blocks per cluster,
    named ``cluster_names``); ``semantics`` and ``params`` go to ``compiler_params``. The kernel traces with
    32-bit indices where ``jax_enable_x64`` is on (``backends.traced_with_32_bit_indices``); a derivative of the
    call is refused by name (``backends.first_derivatives_only``)."""
    interpret = _interpret_params() if _INTERPRET_SMS.get() is not None else None
    return first_derivatives_only(traced_with_32_bit_indices(plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names, cluster=cluster,
        cluster_names=cluster_names, num_threads=num_threads, thread_name=thread_name,
        compiler_params=compiler_params(semantics, name, **params), kernel_name=name, interpret=interpret)))


def kernel_accumulating(body, *, accumulator: jax.ShapeDtypeStruct, out_type, scratch_types=(), grid, grid_names,
                        num_threads, thread_name, name: str, semantics: str = "lane", **params):
    """Like ``kernel``, plus one zero-initialized global buffer that programs may add into (TMA reduce-add:
    ``plgpu.copy_smem_to_gmem(..., reduction_op="add")``). ``body(*inputs, acc_ref, *outputs, *scratch)``; the
    returned function gives ``(outputs, accumulated)``. XLA's memset is the buffer's only other cost
    (``kernel_updating``). No interpret mode: jax's GPU interpreter implements no TMA reductions."""
    if _INTERPRET_SMS.get() is not None:
        raise NotImplementedError(f"{name}: TMA reduce-add has no GPU interpret mode")
    update = kernel_updating(body, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names,
                             num_threads=num_threads, thread_name=thread_name, name=name, semantics=semantics,
                             **params)
    return lambda *inputs: update(*inputs, jnp.zeros(accumulator.shape, accumulator.dtype))


def kernel_updating(body, *, out_type, scratch_types=(), grid, grid_names, num_threads, thread_name, name: str,
                    semantics: str = "lane", cluster=(), cluster_names=(), buffers: int = 1, **params):
    """Like ``kernel``, plus ``buffers`` global buffers the kernel reads and writes in place: the returned function
    takes ``(*inputs, *buffers)`` and gives ``(outputs, updated buffer)`` (a tuple of them when buffers > 1);
    ``body(*inputs, *buffer_refs, *outputs, *scratch)``.

    Each buffer is a ``jax.new_ref`` passed to ``pl.kernel``, which aliases it in and out of the kernel
    (``plgpu.kernel`` takes no refs): where the caller's buffer is dead afterwards (a loop carry), XLA updates it
    without a copy. The refs are discharged right here (``_discharged``): callers may run this under
    ``custom_vmap``, which has no state-discharge rule. No interpret mode."""
    if _INTERPRET_SMS.get() is not None:
        raise NotImplementedError(f"{name}: a kernel updating a buffer in place has no GPU interpret mode here")
    from jax.experimental import pallas as pl

    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, cluster=cluster, cluster_names=cluster_names,
                      num_threads=num_threads, thread_name=thread_name, kernel_name=name)

    def with_refs(*inputs_and_buffers):
        inputs, values = inputs_and_buffers[:-buffers], inputs_and_buffers[-buffers:]
        refs = [jax.new_ref(v) for v in values]

        def scoped(*kernel_refs):
            pl.run_scoped(functools.partial(body, *kernel_refs), *scratch_types, collective_axes=thread_name)

        scoped.__name__ = name  # the kernel's name where pl.kernel takes the body's (jax 0.10.2)
        kernel_params = compiler_params(semantics, name, **params)
        outs = pl.kernel(scoped, out_type=out_type, mesh=mesh, compiler_params=kernel_params, name=name)(*inputs, *refs)
        updated = tuple(jax.freeze(r) for r in refs)
        return outs, (updated[0] if buffers == 1 else updated)

    return first_derivatives_only(traced_with_32_bit_indices(_discharged(with_refs)))


def _discharged(fn):
    """``fn`` (creating and freezing refs inside) as a pure function: its jaxpr with the refs discharged into
    values (``pl.kernel``'s ref arguments become input-output aliases). jax-version shim: ``discharge_state``
    and ``jaxpr_as_fun`` are private; both supported versions take ``discharge_state(closed_jaxpr)``."""
    from jax._src.core import jaxpr_as_fun
    from jax._src.state.discharge import discharge_state

    def pure(*args):
        closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = jaxpr_as_fun(discharge_state(closed))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shapes), outs)

    return pure


def is_hopper(device=None) -> bool:
    """Whether ``device`` (default: the first device) is an NVIDIA GPU of compute capability 9.x (sm90)."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9")


def num_sms() -> int:
    """SMs of the default GPU (the size of a persistent grid); the H100's 132 when there is no GPU (lowering for
    CUDA on a CPU machine); the simulated count under ``interpret_on_cpu``."""
    if _INTERPRET_SMS.get() is not None:
        return _INTERPRET_SMS.get()
    device = jax.devices()[0]
    if device.platform == "gpu":
        return int(device.core_count)
    return H100_SMS


def smem_transforms(minor_elems: int, dtype) -> tuple:
    """TMA/wgmma shared-memory transforms for a tile whose minor (contiguous) dimension is ``minor_elems`` long:
    (8, s) tiling and an s-element swizzle, s = the largest swizzle (32, 64 or 128 bytes) the minor dim fills."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)
