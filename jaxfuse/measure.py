"""Measured kernel times beside the report's predictions (GPU): `jaxfuse inspect --measure`.

    rows, summary = measure_kernels(report, program.fn, program.args, device=costmodel.detect())

Every device kernel of one call is timed by CUPTI (`bench.time_kernels`, median over iterations). CUPTI names a
kernel as the HLO names its fusion with '.' written '_' (`input_reduce_fusion.1` -> `input_reduce_fusion_1`), a
Pallas kernel by its `pallas_call` name (a Mosaic GPU one as `NAME_mosaic_gpu_kernel`, NAME its named scope), and a
library call by the library's kernel (`nvjet_sm90_...`, `cudnn_...`), a collective by NCCL's kernel
(`ncclDevKernel_AllReduce_Sum_f32_RING_LL`); those are matched to the report's cuBLAS / cuDNN / Pallas /
collective kernels in program order. Device kernels that match nothing
(memsets, a library's second kernel) are listed as unattributed.

Each row: measured µs, achieved bandwidth, and the roofline prediction max(bytes / BW, FLOPs / peak) with its
ratio to the measurement. A collective's bandwidth is its interconnect bytes sent per device over its time
(what NCCL's tests call bus bandwidth), and it has no HBM roofline: the link bounds it. The summary sets the sum of the per-kernel medians beside the program's device time
(median over iterations of all its kernels) and beside the wall clock of a blocked call (which adds launch gaps
and 0.1-0.3 ms of host work per call).

    launch_cost()      # the per-kernel cost the seed model calls K, measured here (device time and wall clock)
    wall_us(fn, [(x,)]) # median wall clock of a blocked call, µs
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Any, Sequence

from hlo_inspect.kernels import Kernel
from hlo_inspect.formatting import format_bytes
from hlo_inspect.report import Report
from jaxfuse import bench
from jaxfuse.costmodel import DeviceSpec

__all__ = ["MeasuredKernel", "launch_cost", "measure_kernels", "measured_table", "wall_us"]

_UNIQUE_SUFFIX_RE = re.compile(r"__\d+$")  # the second kernel of one name launches as NAME__1
_LIBRARY_PREFIXES = {"cublas": ("nvjet", "sm90_xmma", "sm80_xmma", "cutlass", "gemm", "gemv", "ampere", "sm90_"),
                     "cudnn": ("cudnn", "fmha", "sm90_fmha", "flash"), "collective": ("nccl",)}
MOSAIC_SUFFIX = "_mosaic_gpu_kernel"  # Mosaic GPU launches kernel NAME (its named scope) as NAME_mosaic_gpu_kernel


@dataclasses.dataclass(frozen=True)
class MeasuredKernel:
    kernel: Kernel | None  # None: a device kernel no report kernel accounts for
    device_names: tuple[str, ...]
    measured_us: float
    predicted_us: float | None

    @property
    def achieved_bytes_per_s(self) -> float | None:
        if self.kernel is None or not self.measured_us:
            return None
        moved = self.kernel.bytes_sent if self.kernel.collective else self.kernel.bytes_total
        return moved / (self.measured_us * 1e-6)


def _device_name(kernel: Kernel) -> str:
    cfg = kernel.instruction.backend_config
    if kernel.category == "pallas" and isinstance(cfg, dict) and cfg.get("name"):
        return str(cfg["name"])
    if kernel.category == "mosaic" and kernel.scopes:  # its custom call sits in the kernel's named scope
        return kernel.scopes[-1].split("/")[-1] + MOSAIC_SUFFIX
    return kernel.name.replace(".", "_").replace("-", "_")


def match(kernels: Sequence[Kernel], launches: Sequence[tuple[str, float]]
          ) -> tuple[dict[int, list[int]], list[int]]:
    """Align the report's kernels (program order = execution order of a scheduled module) with the device
    kernels of one call (launch order): report kernel index -> launch indices, and the launches left over.

    A fusion or Pallas kernel matches the next launch with its name, or, when no launch ahead has its name, the
    next launch if that bears an earlier kernel's name (XLA compiles identical fusions once, and the later ones
    launch under the first one's name); a cuBLAS / cuDNN call takes the library launches that follow until the
    next launch that another report kernel names. Launch names are compared without the ``__N`` suffix that
    tells apart two kernels of one name (two call sites of the same Pallas kernel: ``rmsnorm_matmul_fwd__1``).
    """
    names = [_device_name(k) for k in kernels]
    named = set(names)
    launch_names = [_UNIQUE_SUFFIX_RE.sub("", name) for name, _ in launches]
    assigned: dict[int, list[int]] = {}
    unmatched: list[int] = []
    j = 0
    for i, k in enumerate(kernels):
        if k.category in _LIBRARY_PREFIXES:
            taken = []
            while j < len(launches) and launch_names[j] not in named:
                if launches[j][0].lower().startswith(_LIBRARY_PREFIXES[k.category]) or not taken:
                    taken.append(j)
                else:
                    unmatched.append(j)
                j += 1
            if taken:
                assigned[i] = taken
            continue
        look = j
        while look < len(launches) and launch_names[look] != names[i]:
            look += 1
        if look < len(launches):
            unmatched.extend(range(j, look))
            assigned[i] = [look]
            j = look + 1
        elif j < len(launches) and launch_names[j] in names[:i] and k.category == kernels[names.index(
                launch_names[j])].category:
            # XLA compiles identical fusions once: a later one launches under the first one's name.
            assigned[i] = [j]
            j += 1
        elif k.category == "mosaic":  # its scope does not name it: the next Mosaic launch no other kernel names
            look = next((n for n in range(j, len(launches)) if launch_names[n].endswith(MOSAIC_SUFFIX)
                         and launch_names[n] not in named), None)
            if look is not None:
                unmatched.extend(range(j, look))
                assigned[i] = [look]
                j = look + 1
    unmatched.extend(range(j, len(launches)))
    return assigned, unmatched


def measure_kernels(report: Report, fn, args: tuple, *, device: DeviceSpec | None, iterations: int = 30,
                    arg_sets: Sequence[tuple] | None = None) -> tuple[list[MeasuredKernel], dict[str, Any]]:
    """Time `fn(*args)` kernel by kernel and set each report kernel's measurement beside its roofline.

    `arg_sets`: input sets of args' shapes to cycle through instead of args alone, so that inputs smaller than
    the L2 cache (a decode step's weights) are read from HBM on every call, as the roofline assumes. `device`
    None (no figures for this GPU, `costmodel.detect`): measurements without rooflines."""
    import jax

    if jax.default_backend() != "gpu":
        raise ValueError("--measure times device kernels with CUPTI and needs a GPU; on CPU use `jaxfuse bench`")
    timing = bench.time_kernels(fn, arg_sets or [args], iterations=iterations)
    launches = timing.launches or tuple(timing.per_kernel_us.items())  # names differ between calls: best effort
    assigned, unmatched = match(report.kernels, launches)
    rows = []
    for i, k in enumerate(report.kernels):
        idx = assigned.get(i, [])
        measured = sum(launches[j][1] for j in idx)
        predicted = None if device is None else max(
            device.memory_us(k.bytes_total), device.compute_us(k.flops or 0)) * k.launches
        rows.append(MeasuredKernel(k, tuple(launches[j][0] for j in idx), measured,
                                   predicted if idx and not k.collective else None))
    rows += [MeasuredKernel(None, (launches[j][0],), launches[j][1], None) for j in unmatched]
    kernel_sum = sum(r.measured_us for r in rows)
    summary = {"program_device_us": timing.median_us, "sum_of_kernels_us": kernel_sum,
               "program_wall_us": wall_us(fn, [args], iterations=iterations),
               "sum_over_program": kernel_sum / timing.median_us if timing.median_us else None,
               "matched": len(assigned), "kernels": len(report.kernels), "unattributed": len(unmatched),
               "spread": timing.spread, "iterations": iterations}
    return rows, summary


def wall_us(fn, arg_sets: Sequence[tuple], *, iterations: int = 30, warmup: int = 2, jit: bool = True) -> float:
    """Median wall-clock µs of ``jax.block_until_ready(fn(*args))``, rotating through ``arg_sets``: host dispatch,
    launches, gaps between kernels and the kernels themselves. ``jit=False`` calls fn as it is (eagerly)."""
    import jax

    if not arg_sets:
        raise ValueError("arg_sets: need at least one tuple of arguments")
    call = jax.jit(fn) if jit and not hasattr(fn, "lower") else fn
    for args in arg_sets:
        for _ in range(warmup):
            jax.block_until_ready(call(*args))
    samples = []
    for i in range(iterations):
        args = arg_sets[i % len(arg_sets)]
        start = time.perf_counter()
        jax.block_until_ready(call(*args))
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def launch_cost(*, ops: int = 16, elements: int = 8192, iterations: int = 50) -> dict[str, float | None]:
    """What one more kernel costs when it has (almost) nothing to do: ``ops`` chained multiplies by a scalar over a
    bf16 vector of ``elements`` (16 KiB by default), jitted as one kernel and run eagerly as ``ops`` dispatches.

    Returns (µs): ``device_us`` the CUPTI device time of the one-kernel program (None off GPU: the floor a kernel
    pays on the device), ``eager_device_us_per_op`` the eager chain's device time per op (None off GPU),
    ``jit_wall_us`` the wall clock of one blocked jitted call, ``eager_wall_us_per_op`` the wall clock of the
    eager chain per op (Python, JAX dispatch, launch and the kernel)."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (elements,), jnp.bfloat16)
    c = jnp.asarray(1.0, jnp.bfloat16)

    def chain(x, c, n):
        for _ in range(n):
            x = x * c
        return x

    one = jax.jit(lambda x, c: chain(x, c, 1))
    eager = lambda x, c: chain(x, c, ops)  # noqa: E731
    on_gpu = jax.default_backend() == "gpu"
    device = bench.time_kernels(one, [(x, c)], iterations=iterations).median_us if on_gpu else None
    eager_device = (bench.time_kernels(eager, [(x, c)], iterations=iterations, jit=False).median_us / ops
                    if on_gpu else None)
    return {"device_us": device, "eager_device_us_per_op": eager_device,
            "jit_wall_us": wall_us(one, [(x, c)], iterations=iterations),
            "eager_wall_us_per_op": wall_us(eager, [(x, c)], iterations=iterations, jit=False) / ops}


def measured_table(rows: list[MeasuredKernel], summary: dict[str, Any], device: DeviceSpec | None) -> str:
    header = ("kernel", "category", "bytes", "measured µs", "GB/s", "roofline µs", "roofline/measured",
              "XLA est µs")
    lines = []
    for r in rows:
        k = r.kernel
        gbs = f"{r.achieved_bytes_per_s / 1e9:.0f}" if r.achieved_bytes_per_s else ""
        pred = f"{r.predicted_us:.1f}" if r.predicted_us is not None else ""
        ratio = f"{r.predicted_us / r.measured_us:.2f}" if r.predicted_us and r.measured_us else ""
        xla = f"{k.xla_estimate_us:.1f}" if k is not None and k.xla_estimate_us is not None else ""
        lines.append((k.name if k else "(unattributed) " + r.device_names[0][:40], k.label if k else "",
                      format_bytes(k.bytes_total) if k else "", f"{r.measured_us:.1f}", gbs, pred, ratio, xla))
    widths = [max(len(x[c]) for x in lines + [header]) for c in range(len(header))]
    fmt = lambda row: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    if device is None:
        import jax

        name = f"{jax.devices()[0].device_kind} (no roofline figures)"
    else:
        name = device.name
    out = [f"measured on {name} (CUPTI device-kernel time, median of {summary['iterations']})",
           fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(x) for x in lines]
    out.append(f"sum of kernels {summary['sum_of_kernels_us']:.1f} µs vs program device time "
               f"{summary['program_device_us']:.1f} µs (ratio {summary['sum_over_program']:.3f}); "
               f"(wall clock of a blocked call, launch gaps and host included: {summary['program_wall_us']:.1f} µs); "
               f"{summary['matched']}/{summary['kernels']} kernels matched, {summary['unattributed']} device "
               f"kernels unattributed; run-to-run spread {summary['spread']:.1%}")
    return "\n".join(out)
