"""What ptxas says about Mosaic-GPU kernels: registers, spills, and whether it serialized their wgmma.

    from hlo_inspect import ptxas
    for k in ptxas.compile_report(fn, *args):   # on an sm90 GPU: compiles fn (not run) and reads ptxas's log
        print(k.name, k.registers, k.spill_store_bytes, k.serialized_wgmma)
    kernels = ptxas.parse(log_text)              # any machine: the same numbers from a saved log

``mosaic_ir`` shows a kernel's structure from its lowering on any machine; some costs appear only when ptxas turns
the PTX into SASS. Two matter most for wgmma kernels: spills (local-memory loads and stores where registers ran
out) and warning C7513, "wgmma.mma_async instructions are serialized": ptxas found a non-wgmma instruction writing
a register a wgmma in flight reads, and waits for each wgmma before the next, so the tensor cores stop overlapping
(measured on the H100: the rmsnorm_matmul forward with gamma in the registers and its output stored under the next
tile's first wgmma ran 15% slower, with this warning; benchmarks/results/NOTES.md, 2026-11-28). C7519
("warpgroup.arrive is injected") is benign. ``compile_report`` sets Mosaic's ``MOSAIC_GPU_DUMP_PTXAS`` switch, which
prints ptxas's log to the process's stdout, and captures file descriptor 1 while compiling. Mosaic compiles a
kernel once per process: one built earlier (same module) prints nothing, and ``compile_report`` then raises. With
setmaxnreg (warp-specialized kernels) "Used N registers" is the launch's allocation per thread, not a warpgroup's
share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Callable

__all__ = ["PtxasKernel", "compile_report", "parse"]

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_WARNING = re.compile(r"\((C\d{4})\) (.*?) in (?:the )?function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
SERIALIZED_WGMMA = "C7513"  # ptxas: wgmma.mma_async instructions are serialized


@dataclasses.dataclass(frozen=True)
class PtxasKernel:
    """ptxas's report on one entry function (kernel).

    registers: per thread, as allocated at launch; stack_frame_bytes, spill_store_bytes, spill_load_bytes: local
    memory per thread; barriers: named barriers used; warnings: (code, message) of every "(Cnnnn)" line about it.
    """

    name: str
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    barriers: int = 0
    warnings: tuple[tuple[str, str], ...] = ()

    @property
    def serialized_wgmma(self) -> bool:
        """Whether ptxas serialized this kernel's wgmma instructions (warning C7513)."""
        return any(code == SERIALIZED_WGMMA for code, _ in self.warnings)

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def parse(log: str) -> list[PtxasKernel]:
    """Every kernel ptxas compiled in ``log`` (its verbose output), in order. Warnings printed before a kernel's
    "Compiling entry function" line (ptxas prints them first) are matched to it by name."""
    warnings: dict[str, list[tuple[str, str]]] = {}
    for code, message, name in _WARNING.findall(log):
        warnings.setdefault(name, []).append((code, message.strip()))
    kernels = []
    for match in _ENTRY.finditer(log):
        name = match.group(1)
        rest = log[match.end():]
        following = _ENTRY.search(rest)
        section = rest[:following.start()] if following else rest
        frame, used = _FRAME.search(section), _USED.search(section)
        if frame is None or used is None:
            raise ValueError(f"ptxas log: no register or stack-frame line for kernel {name!r}")
        kernels.append(PtxasKernel(name=name, registers=int(used.group(1)),
                                   stack_frame_bytes=int(frame.group(1)), spill_store_bytes=int(frame.group(2)),
                                   spill_load_bytes=int(frame.group(3)), barriers=int(used.group(2) or 0),
                                   warnings=tuple(warnings.get(name, ()))))
    return kernels


@contextlib.contextmanager
def _captured_stdout():
    """Everything written to file descriptor 1 (C++ included) while inside, as the yielded list's one string."""
    sys.stdout.flush()
    saved = os.dup(1)
    text: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield text
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            f.seek(0)
            text.append(f.read())


def compile_report(fn: Callable, *args, **kwargs) -> list[PtxasKernel]:
    """Compiles ``jax.jit(fn)`` for ``args`` (arrays or jax.ShapeDtypeStruct) on this machine's GPU, without
    running it, and returns ptxas's report on each Mosaic-GPU kernel built. Needs an sm90 GPU (ValueError naming
    the device otherwise) and kernels not yet built in this process (ValueError when ptxas printed nothing)."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu" or not str(getattr(device, "compute_capability", "")).startswith("9"):
        raise ValueError(f"compile_report: ptxas runs when Mosaic-GPU kernels compile for an sm90 GPU; this "
                         f"machine's first device is {device.device_kind!r} ({device.platform})")
    previous = os.environ.get("MOSAIC_GPU_DUMP_PTXAS")
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    try:
        with _captured_stdout() as text:
            jax.jit(fn).lower(*args, **kwargs).compile()
    finally:
        if previous is None:
            del os.environ["MOSAIC_GPU_DUMP_PTXAS"]
        else:
            os.environ["MOSAIC_GPU_DUMP_PTXAS"] = previous
    kernels = parse(text[0])
    if not kernels:
        raise ValueError("compile_report: ptxas printed nothing; no Mosaic-GPU kernel was compiled (none in fn, or "
                         "each was built earlier in this process: Mosaic compiles a kernel once per process)")
    return kernels
