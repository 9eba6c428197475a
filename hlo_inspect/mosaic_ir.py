"""The structure of Pallas Mosaic-GPU (Hopper) kernels, on any machine: lower for CUDA, decode each kernel's module.

    from hlo_inspect import mosaic_ir
    for k in mosaic_ir.lower_kernels(fn, *args):       # args: arrays or jax.ShapeDtypeStruct
        print(k.name, k.grid, k.threads, k.smem_bytes)  # launch: blocks, threads per block, dynamic shared memory
        print(k.summary())                              # wgmma instructions, TMA loads / stores, barriers, loops
        print(k.text)                                   # the whole kernel module (MLIR: gpu, nvvm, llvm dialects)

jax lowers a Mosaic-GPU kernel (``plgpu.kernel`` / a Pallas call with Mosaic-GPU compiler params) to a custom call
``mosaic_gpu_v2`` whose backend_config carries the kernel's MLIR module as serialized bytecode (``module``). It is
already lowered to the gpu / nvvm / llvm dialects: one ``gpu.launch`` with the grid, the block size and the
dynamic shared memory, TMA copies as ``nvvm.cp.async.bulk.tensor`` ops, mbarriers as ``nvvm.mbarrier`` ops and
each wgmma as inline PTX (``wgmma.mma_async...m64nNk16``). Reading it back needs the Mosaic-GPU dialect registered
and its ``mosaic_gpu-serde`` pass run in reverse (``serialize=false``), as jax itself does; both exist in jax 0.10.2
and 0.11. Counts are static (ops in the program text: an op inside a loop counts once). Lowering raises the
shared-memory overflow error a GPU would (more than the 227 KiB a Hopper block may use).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable

from hlo_inspect.triton_ir import _custom_calls, _strip_locations  # the same walk and clean-up as for Triton

__all__ = ["MOSAIC_CALL_TARGET", "MosaicKernel", "lower_kernels"]

MOSAIC_CALL_TARGET = "mosaic_gpu_v2"
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.([a-z0-9]+)\.([a-z0-9]+)\.([a-z0-9]+)")
_OP = re.compile(r"^\s*(?:%[^=]+=\s*)?\"?([a-z_]+\.[a-z_0-9.]+)")
_LAUNCH = re.compile(r"gpu\.launch .*blocks\(.*\) in \(%\w+ = (%\w+), %\w+ = (%\w+), %\w+ = (%\w+)\) "
                     r"threads\(.*\) in \(%\w+ = (%\w+), %\w+ = %\w+, %\w+ = %\w+\) "
                     r"dynamic_shared_memory_size (%\w+)")
_CLUSTER = re.compile(r"gpu\.launch .*clusters\(.*\) in \(%\w+ = (%\w+), %\w+ = (%\w+), %\w+ = (%\w+)\) blocks")
_TMA_LOAD = "nvvm.cp.async.bulk.tensor.shared.cluster.global"
_TMA_STORE = "nvvm.cp.async.bulk.tensor.global.shared.cta"
_TMA_REDUCE = "cp.reduce.async.bulk.tensor"  # a TMA store that reduces into global memory (inline PTX)


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    """One Mosaic-GPU kernel: launch parameters and its module as text (locations stripped).

    name: the kernel's name (``kernel_name``); grid: blocks (x, y, z); threads: per block (128 per warpgroup);
    smem_bytes: dynamic shared memory per block, bytes; cluster: blocks per cluster (x, y, z), (1, 1, 1) without."""

    name: str
    grid: tuple[int, int, int]
    threads: int
    smem_bytes: int
    text: str
    cluster: tuple[int, int, int] = (1, 1, 1)

    @property
    def warpgroups(self) -> int:
        return self.threads // 128

    def op_counts(self) -> dict[str, int]:
        """How many of each op the module holds, by name, e.g. {"nvvm.mbarrier.init": 9, "scf.for": 4, ...}."""
        counts = collections.Counter()
        for line in self.text.splitlines():
            match = _OP.match(line)
            if match:
                counts[match.group(1)] += 1
        return dict(counts)

    def wgmma(self) -> dict[str, int]:
        """wgmma instructions by shape and types, e.g. {"m64n128k16 f32 += bf16 x bf16": 8}."""
        return dict(collections.Counter(f"{shape} {acc} += {a} x {b}" for shape, acc, a, b in _WGMMA.findall(self.text)))

    def tma_loads(self) -> int:
        """TMA copies global -> shared memory."""
        return self.op_counts().get(_TMA_LOAD, 0)

    def tma_multicast_loads(self) -> int:
        """TMA copies global -> shared memory of every block of a cluster (a multicast mask)."""
        return sum(1 for line in self.text.splitlines() if _TMA_LOAD in line and "multicast_mask" in line)

    def tma_stores(self) -> int:
        """TMA copies shared -> global memory."""
        return self.op_counts().get(_TMA_STORE, 0)

    def tma_reduce_stores(self) -> dict[str, int]:
        """TMA copies shared -> global memory that reduce into the destination, by operation, e.g. {"add": 4}."""
        ops = re.findall(re.escape(_TMA_REDUCE) + r"\.\w+\.global\.shared::cta\.(\w+)\.", self.text)
        return dict(collections.Counter(ops))

    def barriers(self) -> int:
        """mbarriers initialized (one per slot of each barrier array)."""
        return self.op_counts().get("nvvm.mbarrier.init", 0)

    def summary(self) -> str:
        """One paragraph: launch, shared memory, wgmma shapes, TMA copies, barriers, loops."""
        ops = self.op_counts()
        wgmma = "; ".join(f"{n}× {k}" for k, n in self.wgmma().items()) or "none"
        cluster = f" in clusters of {self.cluster}" if self.cluster != (1, 1, 1) else ""
        multicast = f" ({self.tma_multicast_loads()} multicast)" if self.tma_multicast_loads() else ""
        reduce = "".join(f", {n} reduce-{op}" for op, n in self.tma_reduce_stores().items())
        warpgroups = _count(self.warpgroups, "warpgroup")
        return (f"{self.name}: grid {self.grid}{cluster}, {self.threads} threads ({warpgroups}), "
                f"{self.smem_bytes} B shared memory; wgmma: {wgmma}; TMA: {_count(self.tma_loads(), 'load')}"
                f"{multicast}, {_count(self.tma_stores(), 'store')}{reduce}; {_count(self.barriers(), 'mbarrier')}; "
                f"{_count(ops.get('scf.for', 0), 'loop')}")


def _count(n: int, noun: str) -> str:
    """'1 load', '2 loads'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _constant(text: str, name: str) -> int:
    """The value of an integer arith.constant named ``name`` (e.g. %c384) in the module text."""
    match = re.search(rf"{re.escape(name)} = arith\.constant (-?\d+)", text)
    if match is None:
        raise ValueError(f"mosaic_ir: no integer constant {name} in the kernel module")
    return int(match.group(1))


def _decode(module_bytes: bytes) -> str:
    """The kernel module's text from its serialized bytecode."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir, passmanager
    from jax.experimental.mosaic import gpu as mgpu

    context = mlir.make_ir_context()
    mgpu.dialect.register_dialect(context)
    context.allow_unregistered_dialects = True
    with context:
        module = ir.Module.parse(module_bytes)
        passmanager.PassManager.parse("builtin.module(mosaic_gpu-serde{serialize=false})").run(module.operation)
        return str(module)


def _kernel_name(module_name: str, location: str) -> str:
    """A kernel's name: its module's, except where jax 0.10.2 names the module of a kernel that updates a ref in
    place after the function it wraps the kernel in ("new_body"); the custom call's location then carries the name
    the kernel was given (``loc("mosaic_matmul_accumulate/mpmd_map"(...))``)."""
    if module_name != "new_body":
        return module_name
    given = re.match(r'loc\("([^"/]+)', location)
    return given.group(1) if given else module_name


def lower_kernels(fn: Callable, *args, **kwargs) -> list[MosaicKernel]:
    """The Mosaic-GPU kernels of ``jax.jit(fn)(*args, **kwargs)``, lowered for CUDA (no GPU needed), in program
    order. Raises ValueError when the lowering holds none."""
    import jax
    from jax._src.lib.mlir import ir

    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    calls = [op for op in _custom_calls(lowered.compiler_ir("stablehlo").operation, [])
             if ir.StringAttr(op.attributes["call_target_name"]).value == MOSAIC_CALL_TARGET]
    if not calls:
        raise ValueError("fn: its CUDA lowering holds no Mosaic-GPU kernel (custom call mosaic_gpu_v2)")
    kernels = []
    for op in calls:
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        text = _strip_locations(_decode(ir.StringAttr(config["module"]).value_bytes))
        name_match = re.search(r"^module @\"?([\w.$-]+)", text, re.M)
        launch = _LAUNCH.search(text)
        if launch is None:
            raise ValueError("mosaic_ir: the kernel module holds no gpu.launch")
        gx, gy, gz, threads, smem = (_constant(text, v) for v in launch.groups())
        cluster = _CLUSTER.search(text)
        cx, cy, cz = (_constant(text, v) for v in cluster.groups()) if cluster else (1, 1, 1)
        name = _kernel_name(name_match.group(1) if name_match else "", str(op.location))
        kernels.append(MosaicKernel(name=name, grid=(gx, gy, gz),
                                    threads=threads, smem_bytes=smem, text=text, cluster=(cx, cy, cz)))
    return kernels
