"""Per-pass HLO dumps -> how XLA's fusion decisions evolved, pass by pass.

    tl = hlo_inspect.passes.dump_passes(f, x, w)            # compile once with XLA's dump flags (needs JAX)
    tl = hlo_inspect.passes.load_pass_dumps("/tmp/dump")    # or read a folder XLA already wrote (pure Python)
    print(tl.table())                                       # kernels and bytes after each pass that changed them
    for origin in tl.provenance(): print(origin.kernel, origin.created_by.label)

How the dumps are made. XLA writes one HLO text file per pass when compiled with `xla_dump_to`,
`xla_dump_hlo_as_text` and `xla_dump_hlo_pass_re`. XLA reads the `XLA_FLAGS` environment variable once, when
the backend starts, so setting it in a running process does nothing; but the same flags are DebugOptions fields,
and `jax.jit(f).lower(...).compile(compiler_options)` applies DebugOptions to that one compile (checked on jax
0.10.2, CPU). `dump_passes` uses that: no subprocess, and `fn` need not be importable. One trap: jax leaves the
dump flags out of the persistent compilation cache key, so with the persistent cache enabled an earlier compile of
the same program is loaded from disk and nothing is dumped; `dump_passes` then raises and says so.

What XLA writes (`xla/service/dump.cc`, `xla/hlo/pass/hlo_pass_pipeline.cc`), per module:
  module_0008.jit_f.before_optimizations.txt                                 the input (one op per "kernel")
  module_0008.jit_f.0005.simplification.after_pipeline-start.before_algsimp.txt   every pipeline's start
  module_0008.jit_f.0006.simplification.after_algsimp.before_simplify-sorts.txt   after a pass (NNNN = step)
  module_0008.jit_f.0033.copy-insertion.after_adding_copies_to_resolve_interference.txt   in-pass steps
  module_0008.jit_f.cpu_after_optimizations.txt       (GPU: `sm_9.0_gpu_after_optimizations.txt`)
With `xla_dump_hlo_pass_re=.*` exactly, XLA dumps a pass only when it reports a change; with any other regex it
dumps every pass whose name, or the next pass's name, matches, changed or not (so `priority-fusion` gives the
module just before and just after priority fusion). Either way this module keeps a dump only when its text
differs from the dump before it. A kept `pipeline-start` dump means something run outside a pass pipeline (or a
pass the regex left out) changed the module since the previous dump; such steps are labelled "start of <pipeline>".

Passes to look for. CPU (jax 0.10.2): `dot-library-rewriter` (creates `__ynn_fusion` library fusions), `fusion`
(loop fusions, already named like `add_rsqrt_fusion`), `fusion-wrapper` (wraps each op left alone in a
`wrapped_<op>` fusion). GPU (seen with jax 0.11.2 on an H100; spaces in pipeline names become `_`): in pipeline
`hlo_normalization`, `triton-gemm-rewriter` (Triton GEMM fusions `gemm_fusion_dot.N`) and
`triton-softmax-rewriter` (`triton_softmax.N`); in pipeline `fusion`, `priority-fusion` (creates `fusion.N`) and
`multi_output_fusion`; in `post-fusion_optimization`, `rename_fusions` (`fusion.234` -> `input_reduce_select_fusion`,
tracked as a rename); `fusion-wrapper`; `fusion-block-level-rewriter`; `config-assigner` /
`convert_triton_gemm_config` (set Triton configs: "last changed by"). Older or other XLA versions add
`gemm-rewriter` (cuBLAS calls), `horizontal-loop-fusion` and cuDNN rewriters.

Newer XLA (jax 0.11.2's) prints a tuple element used as an operand as `%fusion.3#1` in the pass dumps (not in
`compiled.as_text()`); the parser reads those as get-tuple-element.

Provenance rule (`PassTimeline.provenance`): kernels are followed from step to step. A kernel of one step is the
same kernel as one of the step before when it has the same instruction name and opcode, or, for a fusion whose
name vanished, when its content signature is equal (fusion kind, backend kind, result shape and the multiset of
fused (opcode, shape) pairs, layouts ignored): that is a rename, as `rename_fusions` does. Anything else is a new
kernel, created by the step where it first appears. `last_changed_by` is the last step that changed the kernel's
content signature (e.g. `multi_output_fusion` growing a fusion in place). Limits: a pass that both renames and
changes a fusion looks like creation; a wrapper fusion around an op that was launched on its own is a new kernel
(the wrapper pass "created" it); ops cloned under new names (`call-inliner`, `flatten-call-graph`) count as new
ops of that pass, which matters only before fusion; with a selective `pass_re`, or after a dump that failed to
parse, a step's changes include every pass since the previous readable dump. The `*_after_optimizations` file is
kept as a last step only when it differs from the last pass dump by more than backend_config key order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Any, Callable

from hlo_inspect.kernels import Kernel, kernels as list_kernels
from hlo_inspect.parser import Instruction, Module, Shape, parse
from hlo_inspect.formatting import format_bytes, parse_xla_flags

__all__ = ["PassStep", "PassTimeline", "Origin", "dump_passes", "load_pass_dumps", "dump_options",
           "optimized_dumps", "JSON_SCHEMA"]

JSON_SCHEMA = "hlo_inspect.passes/1"

# module_0008.jit_f.0006.simplification.after_algsimp.before_simplify-sorts.txt
_STEP_RE = re.compile(r"^module_(?P<id>\d+)\.(?P<name>.+?)\.(?P<step>\d{4,})\.(?P<rest>.+)\.txt$")
_BEFORE_RE = re.compile(r"^module_(?P<id>\d+)\.(?P<name>.+?)\.before_optimizations\.txt$")
# cpu_after_optimizations.txt, sm_9.0_gpu_after_optimizations.txt; not the -buffer-assignment.txt etc. beside them
_AFTER_RE = re.compile(r"^module_(?P<id>\d+)\.(?P<name>.+?)\.(?P<platform>[\w.]*?)_?after_optimizations\.txt$")

BEFORE_OPTIMIZATIONS = "before_optimizations"
AFTER_OPTIMIZATIONS = "after_optimizations"


@dataclasses.dataclass(eq=False)
class PassStep:
    """The module as XLA dumped it after one pass (or at the start / end of the optimization).

    order: XLA's step number for this module (-1 before optimizations, one past the last step after them).
    pass_name: the pass after which the dump was taken; next_pass: the pass that runs next ('' if not named).
    kernels: `hlo_inspect.kernels` of the module: before fusion every launched op is its own "kernel".
    error: why the file could not be read or parsed ('' when it could); then module is None and kernels [].
    """

    order: int
    pipeline: str
    pass_name: str
    next_pass: str
    file: str
    module: Module | None = None
    kernels: list[Kernel] = dataclasses.field(default_factory=list, repr=False)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.module is not None

    @property
    def is_pass(self) -> bool:
        """Whether XLA dumped this after a pass (False for the before_optimizations / after_optimizations files,
        whose `order` is not a step number of XLA's)."""
        return self.pass_name not in (BEFORE_OPTIMIZATIONS, AFTER_OPTIMIZATIONS)

    @property
    def step_number(self) -> str:
        """XLA's step number as the dump file names it ('0006'), '-' before and after the optimizations."""
        return f"{self.order:04d}" if self.is_pass else "-"

    @property
    def label(self) -> str:
        """The pass, or "start of <pipeline>" for a change made outside any pass pipeline."""
        if self.pass_name == "pipeline-start":
            return f"start of {self.pipeline}"
        return self.pass_name

    @property
    def kernel_count(self) -> int | None:
        return len(self.kernels) if self.ok else None

    @property
    def bytes_read(self) -> int | None:
        return sum(k.bytes_read * k.launches for k in self.kernels) if self.ok else None

    @property
    def bytes_written(self) -> int | None:
        return sum(k.bytes_written * k.launches for k in self.kernels) if self.ok else None

    @property
    def bytes_total(self) -> int | None:
        """Estimated HBM bytes of one run, each kernel counted `launches` times (as `Report.totals`)."""
        return self.bytes_read + self.bytes_written if self.ok else None

    def ref(self) -> dict[str, Any]:
        return {"order": self.order, "pipeline": self.pipeline, "pass": self.pass_name, "label": self.label}

    def __repr__(self) -> str:
        state = f"error={self.error!r}" if self.error else f"kernels={self.kernel_count}, bytes={self.bytes_total}"
        return f"PassStep({self.step_number} {self.pipeline}/{self.label}, {state})"


@dataclasses.dataclass(frozen=True, eq=False)
class Origin:
    """Where one kernel of the final module came from.

    created_by: the step after which the kernel first exists (the first step when it was in the input program);
    last_changed_by: the last step that changed its fused content (== created_by when none did);
    former_names: earlier names, oldest first, when a pass renamed it.
    """

    kernel: str
    category: str
    created_by: PassStep
    last_changed_by: PassStep
    former_names: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "category": self.category, "created_by": self.created_by.ref(),
                "last_changed_by": self.last_changed_by.ref(), "former_names": list(self.former_names)}


@dataclasses.dataclass(eq=False)
class PassTimeline:
    """The steps of one module's optimization that changed it, in order (see the module docstring).

    dumps_read: how many per-pass files of this module were read (unchanged ones included); other_modules:
    the other modules found in the folder (`module_0009.jit_g`), ignored; pass_re: the `xla_dump_hlo_pass_re`
    the dumps were made with ('' when not known, as for a folder read by `load_pass_dumps`).
    """

    module_name: str
    steps: list[PassStep]
    folder: str = ""
    dumps_read: int = 0
    other_modules: list[str] = dataclasses.field(default_factory=list)
    pass_re: str = ""

    @property
    def good_steps(self) -> list[PassStep]:
        return [s for s in self.steps if s.ok]

    @property
    def errors(self) -> list[PassStep]:
        return [s for s in self.steps if not s.ok]

    @property
    def final(self) -> PassStep | None:
        """The last step that parsed: the optimized module."""
        good = self.good_steps
        return good[-1] if good else None

    # ---- provenance ----------------------------------------------------------------------------------------

    def _lineage(self) -> tuple[dict[int, list[str]], list[Origin]]:
        """(id(step) -> names of kernels it created, origins of the final kernels); computed once."""
        cached = getattr(self, "_lineage_cache", None)
        if cached is not None:
            return cached
        good = self.good_steps
        created: dict[int, list[str]] = {id(s): [] for s in self.steps}
        origins: list[Origin] = []
        if good:
            prev: dict[str, _Track] = {}
            for step in good:
                prev = _advance(prev, step, is_first=step is good[0])
                created[id(step)] = [name for name, t in prev.items() if t.created_by is step]
            for k in good[-1].kernels:
                t = prev[k.name]
                origins.append(Origin(kernel=k.name, category=k.category, created_by=t.created_by,
                                      last_changed_by=t.changed_by, former_names=tuple(t.names[:-1])))
        self._lineage_cache = (created, origins)
        return self._lineage_cache

    def provenance(self) -> list[Origin]:
        """For each kernel of the final module, in program order, the step that created it (see module doc)."""
        return self._lineage()[1]

    def created_at(self, step: PassStep) -> list[str]:
        """Names (at that step) of the kernels that first appear after `step`."""
        return self._lineage()[0].get(id(step), [])

    # ---- rendering -----------------------------------------------------------------------------------------

    def table(self, max_created: int = 3) -> str:
        """One row per step that changed the module: kernels and bytes after it, their change, kernels created;
        then the final kernels with the pass that created each."""
        header = ("step", "pipeline", "pass", "kernels", "Δ", "bytes", "Δ bytes", "new kernels")
        rows = []
        prev: PassStep | None = None
        for step in self.steps:
            order = step.step_number
            if not step.ok:
                rows.append((order, _clip(step.pipeline, 34), _clip(step.label, 34), "?", "", "", "",
                             _clip("unreadable: " + step.error.splitlines()[0], 60)))
                continue
            dk = "" if prev is None else _signed(step.kernel_count - prev.kernel_count)
            db = "" if prev is None else _signed_bytes(step.bytes_total - prev.bytes_total)
            new = self.created_at(step) if prev is not None else []
            shown = ", ".join(new[:max_created]) + (f" +{len(new) - max_created}" if len(new) > max_created else "")
            rows.append((order, _clip(step.pipeline, 34), _clip(step.label, 34), str(step.kernel_count), dk,
                         format_bytes(step.bytes_total), db, _clip(shown, 60)))
            prev = step
        widths = [max(len(r[c]) for r in rows + [header]) for c in range(len(header))]
        right = {3, 4, 5, 6}

        def fmt(row):
            return "  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                             for c, (cell, w) in enumerate(zip(row, widths))).rstrip()

        good = self.good_steps
        summary = (f"module {self.module_name}: {len(self.steps)} steps changed the module "
                   f"({self.dumps_read} dumps read)")
        if good:
            first, last = good[0], good[-1]
            summary += (f"; kernels {first.kernel_count} -> {last.kernel_count}, "
                        f"bytes {format_bytes(first.bytes_total)} -> {format_bytes(last.bytes_total)}")
        lines = [summary] + ([self._no_pass_dumps_note()] if self.dumps_read == 0 else [])
        lines += [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
        if self.errors:
            lines.append(f"{len(self.errors)} dump(s) could not be read; their changes count towards the next step")
        origins = self.provenance()
        if origins:
            lines += ["", "final kernels and the pass that created them:"]
            name_w = min(max(len(o.kernel) for o in origins), 40)
            for o in origins:
                created = o.created_by
                if created is good[0]:
                    where = "input program"
                else:
                    where = f"{created.label} ({created.pipeline}" + (
                        f", step {created.step_number})" if created.is_pass else ")")
                extra = []
                if o.last_changed_by is not created:
                    extra.append(f"last changed by {o.last_changed_by.label}")
                if o.former_names:
                    extra.append("was " + " -> ".join(o.former_names))
                lines.append(f"  {_clip(o.kernel, name_w).ljust(name_w)}  {o.category:12s}  {where}"
                             + (f"; {'; '.join(extra)}" if extra else ""))
        if self.other_modules:
            lines.append(f"other modules in the folder (ignored): {', '.join(self.other_modules[:5])}"
                         + (" ..." if len(self.other_modules) > 5 else ""))
        return "\n".join(lines)

    def _no_pass_dumps_note(self) -> str:
        """Why a timeline holds only the module before and after the optimizations."""
        seen = "0 per-pass dumps, only the module before and after XLA's optimizations"
        if self.pass_re:
            return f"no pass matched pass_re {self.pass_re!r} ({seen}); '.*' dumps every pass that changed it"
        return f"no pass dumps in the folder ({seen}); dump with --xla_dump_hlo_pass_re=.* to see each pass"

    def to_dict(self) -> dict[str, Any]:
        steps, prev = [], None
        for step in self.steps:
            row = {**step.ref(), "next_pass": step.next_pass, "file": step.file, "error": step.error or None,
                   "kernels": step.kernel_count, "bytes_read": step.bytes_read,
                   "bytes_written": step.bytes_written, "bytes_total": step.bytes_total,
                   "kernels_delta": None, "bytes_delta": None,
                   "created": self.created_at(step) if step.ok and prev is not None else []}
            if step.ok and prev is not None:
                row["kernels_delta"] = step.kernel_count - prev.kernel_count
                row["bytes_delta"] = step.bytes_total - prev.bytes_total
            if step.ok:
                prev = step
            steps.append(row)
        return {"schema": JSON_SCHEMA, "module": self.module_name, "folder": self.folder,
                "pass_re": self.pass_re or None, "dumps_read": self.dumps_read,
                "other_modules": self.other_modules, "steps": steps,
                "provenance": [o.to_dict() for o in self.provenance()]}


# ---------------------------------------------------------------------------------------------------------
# Following kernels from step to step.

@dataclasses.dataclass
class _Track:
    created_by: PassStep
    changed_by: PassStep
    names: list[str]
    opcode: str
    signature: tuple


def _shape_key(shape: Shape) -> tuple:
    if shape.is_tuple:
        return tuple(_shape_key(s) for s in shape.tuple_shapes)
    return (shape.dtype, shape.dims)


def _fused_signature(inst: Instruction) -> tuple:
    items = []
    for comp in inst.called_computations[:1]:
        for i in comp.instructions:
            if i.opcode == "parameter":
                continue
            items.append((i.opcode, _shape_key(i.shape),
                          _fused_signature(i) if i.opcode == "fusion" else ()))
    return tuple(sorted(items, key=repr))


def _signature(inst: Instruction) -> tuple:
    """What a kernel computes, without names or layouts: equal before and after a rename."""
    if inst.opcode == "fusion":
        return ("fusion", inst.fusion_kind, inst.backend_kind, _shape_key(inst.shape), _fused_signature(inst))
    return (inst.opcode, _shape_key(inst.shape), inst.custom_call_target)


def _advance(prev: dict[str, _Track], step: PassStep, is_first: bool) -> dict[str, _Track]:
    """The tracks of `step`'s kernels, continuing those of the step before (by name, then by fusion content)."""
    current: dict[str, _Track] = {}
    pending: list[tuple[Kernel, tuple]] = []
    for k in step.kernels:
        sig = _signature(k.instruction)
        old = prev.get(k.name)
        if old is not None and old.opcode == k.instruction.opcode:
            changed = step if sig != old.signature else old.changed_by
            current[k.name] = _Track(old.created_by, changed, old.names, k.instruction.opcode, sig)
        else:
            pending.append((k, sig))
    vanished: dict[tuple, list[_Track]] = {}
    for name, track in prev.items():
        if name not in current and track.opcode == "fusion":
            vanished.setdefault(track.signature, []).append(track)
    for k, sig in pending:
        candidates = vanished.get(sig) if k.instruction.opcode == "fusion" else None
        if candidates:
            old = candidates.pop(0)
            current[k.name] = _Track(old.created_by, old.changed_by, old.names + [k.name], "fusion", sig)
        else:
            current[k.name] = _Track(step, step, [k.name], k.instruction.opcode, sig)
    return current


# ---------------------------------------------------------------------------------------------------------
# Reading a dump folder.

@dataclasses.dataclass(frozen=True)
class _DumpFile:
    module_id: str
    module_name: str
    order: int | None  # XLA's step number; -1 before optimizations; None after them (numbered by load_pass_dumps)
    pipeline: str
    pass_name: str
    next_pass: str
    file: str


def _classify_file(filename: str) -> _DumpFile | None:
    m = _STEP_RE.match(filename)
    if m:
        rest = m.group("rest")
        pipeline, sep, after = rest.partition(".after_")
        if sep:
            pass_name, _, next_pass = after.partition(".before_")
        else:
            pipeline, _, pass_name = rest.partition(".")
            next_pass = ""
        return _DumpFile(m.group("id"), m.group("name"), int(m.group("step")), pipeline, pass_name or rest,
                         next_pass, filename)
    m = _BEFORE_RE.match(filename)
    if m:
        return _DumpFile(m.group("id"), m.group("name"), -1, "", BEFORE_OPTIMIZATIONS, "", filename)
    m = _AFTER_RE.match(filename)
    if m:
        return _DumpFile(m.group("id"), m.group("name"), None, m.group("platform"), AFTER_OPTIMIZATIONS, "",
                         filename)
    return None


# `%fusion.3#1`: XLA's dumps (since about jax 0.11) print a tuple element used as an operand this way, with the
# get-tuple-element instruction left out; `compiled.as_text()` still prints the get-tuple-element.
_TUPLE_REF_RE = re.compile(r"%([A-Za-z0-9_.\-]+)((?:#\d+)+)")
_DEFINITION_RE = re.compile(r"^(\s*)(?:ROOT\s+)?%([A-Za-z0-9_.\-]+)\s*=\s*")


def optimized_dumps(folder: str | os.PathLike) -> list[str]:
    """The optimized modules XLA dumped into ``folder`` (``--xla_dump_to``): the paths of its
    `module_NNNN.NAME.PLATFORM_after_optimizations.txt` files, by module number (not the buffer assignment or
    memory report beside them)."""
    found = [(m.group("id"), name) for name in os.listdir(folder) if (m := _AFTER_RE.match(name))]
    return [os.path.join(folder, name) for _, name in sorted(found)]


def _read_step(dump: _DumpFile, text: str | None, read_error: str) -> PassStep:
    step = PassStep(order=dump.order, pipeline=dump.pipeline, pass_name=dump.pass_name, next_pass=dump.next_pass,
                    file=dump.file)
    if read_error:
        step.error = read_error
        return step
    try:
        step.module = parse(text)
        step.kernels = list_kernels(step.module)
    except Exception as e:  # a dump we cannot read is recorded, not fatal: the other steps still tell the story
        step.module, step.kernels = None, []
        step.error = f"{type(e).__name__}: {e}"
    return step


def load_pass_dumps(folder: str | os.PathLike, module_name: str | None = None) -> PassTimeline:
    """The timeline of one module from a folder XLA dumped into (`--xla_dump_to` with `--xla_dump_hlo_as_text`).

    module_name: the module's name (`jit_f`), `module_0008.jit_f`, `module_0008` or `0008`; None picks the module
    with the most per-pass dumps (the one the compile was about; GPU autotuning can dump small helper modules).
    Keeps the dumps whose text differs from the dump before (see the module docstring). A file that cannot be
    read or parsed becomes a step with `error` set. ValueError when the folder has no dumps or no such module.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"folder: {folder!r} is not a directory")
    groups: dict[tuple[str, str], list[_DumpFile]] = {}
    for filename in os.listdir(folder):
        dump = _classify_file(filename)
        if dump is not None:
            groups.setdefault((dump.module_id, dump.module_name), []).append(dump)
    if not groups:
        raise ValueError(f"folder: no XLA HLO text dumps (module_NNNN.<name>.*.txt) in {folder!r}; compile with "
                         "--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=.*")
    labels = {key: f"module_{key[0]}.{key[1]}" for key in groups}
    candidates = list(groups)
    if module_name is not None:
        candidates = [key for key in groups if module_name in (key[1], key[0], f"module_{key[0]}", labels[key])]
        if not candidates:
            raise ValueError(f"module_name: no module {module_name!r} in {folder!r}; found "
                             f"{sorted(labels.values())}")

    def pass_orders(key) -> list[int]:
        return [d.order for d in groups[key] if d.order is not None and d.order >= 0]

    chosen = max(candidates, key=lambda key: (len(pass_orders(key)), len(groups[key]), int(key[0])))
    after_order = max(pass_orders(chosen), default=-1) + 1  # after_optimizations: one past the last step
    dumps = sorted((d if d.order is not None else dataclasses.replace(d, order=after_order) for d in groups[chosen]),
                   key=lambda d: (d.order, d.file))
    steps: list[PassStep] = []
    previous_text: str | None = None
    for dump in dumps:
        try:
            with open(os.path.join(folder, dump.file), encoding="utf-8", errors="replace") as fh:
                text, read_error = fh.read(), ""
        except OSError as e:
            text, read_error = None, f"OSError: {e.strerror or e}"
        if text is not None and previous_text is not None and _same_module(text, previous_text):
            continue  # XLA dumped an unchanged module (pipeline start, nested pipeline end, selective regex)
        steps.append(_read_step(dump, text, read_error))
        if text is not None:
            previous_text = text
    return PassTimeline(module_name=chosen[1], steps=steps, folder=folder,
                        dumps_read=len(pass_orders(chosen)),
                        other_modules=sorted(labels[k] for k in groups if k != chosen))


def _canonical_line(line: str) -> str:
    """The line with its `backend_config={...}` JSON re-serialized with sorted keys."""
    start = line.find("backend_config={")
    if start < 0:
        return line
    i = start + len("backend_config=")
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(line)):
        c = line[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                try:
                    config = json.dumps(json.loads(line[i:j + 1]), sort_keys=True)
                except ValueError:
                    return line
                return line[:i] + config + line[j + 1:]
    return line


def _same_module(a: str, b: str) -> bool:
    """Equal up to the order of keys in backend_config JSON (the final dump prints them re-serialized)."""
    la, lb = a.strip().splitlines(), b.strip().splitlines()
    if len(la) != len(lb):
        return False
    return all(x == y or _canonical_line(x) == _canonical_line(y) for x, y in zip(la, lb))


# ---------------------------------------------------------------------------------------------------------
# Compiling with the dump flags.

def dump_options(folder: str, pass_re: str = ".*") -> dict[str, Any]:
    """The XLA DebugOptions (as compiler options) that dump every pass of a compile into `folder` as text."""
    return {"xla_dump_to": folder, "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": pass_re}


def dump_passes(fn: Callable, *args, pass_re: str = ".*", xla_flags: str = "", dump_to: str | None = None,
                **kwargs) -> PassTimeline:
    """Compile `fn(*args, **kwargs)` once with XLA's per-pass dump flags and read the dumps back.

    fn: a function or an already-jitted callable (anything with `.lower`); args may be arrays or
    `jax.ShapeDtypeStruct`s. pass_re: `xla_dump_hlo_pass_re`; the default `.*` dumps only passes that changed
    the module; a narrower regex dumps just around the passes it names (e.g. `priority-fusion|multi_output`).
    xla_flags: more XLA flags for this compile only, as on a command line (`--xla_gpu_enable_triton_gemm=false`).
    dump_to: keep the dump files in this folder (created if missing); by default a temporary folder, deleted
    before returning (the timeline keeps the parsed modules).

    The flags travel as per-compile `compiler_options`, so this works in a process where JAX is already running
    (XLA_FLAGS would not: it is read once at backend start). RuntimeError when no dumps appear, which happens
    when the persistent compilation cache served the program (jax leaves dump flags out of its cache key). A
    `pass_re` that matches no pass gives a timeline of just the input and the optimized module.
    """
    import jax  # only here: reading saved dumps needs no JAX

    if not isinstance(pass_re, str) or not pass_re:
        raise ValueError(f"pass_re: expected a non-empty regular expression, got {pass_re!r}")
    try:
        re.compile(pass_re)
    except re.error as e:
        raise ValueError(f"pass_re: {pass_re!r} is not a regular expression ({e})") from None
    extra = parse_xla_flags(xla_flags)
    clash = sorted(k for k in extra if k.startswith("xla_dump_"))
    if clash:
        raise ValueError(f"xla_flags: {clash} would override the dump flags; use pass_re= and dump_to= instead")

    def run(folder: str) -> PassTimeline:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        lowered = jitted.lower(*args, **kwargs)
        compiled = lowered.compile({**extra, **dump_options(folder, pass_re)})
        name = _module_name(compiled.as_text())
        try:
            timeline = load_pass_dumps(folder, module_name=name)
        except ValueError:
            cache_dir = getattr(jax.config, "jax_compilation_cache_dir", None)
            raise RuntimeError(
                f"dump_passes: XLA wrote no dumps for {name or 'the module'} into {folder!r}. Most likely the "
                "persistent compilation cache returned a saved executable (jax excludes dump flags from its cache "
                f"key; jax_compilation_cache_dir={cache_dir!r}). Disable it with "
                "jax.config.update('jax_enable_compilation_cache', False) before the first compile, or clear "
                "it.") from None
        timeline.pass_re = pass_re
        return timeline

    if dump_to is not None:
        os.makedirs(dump_to, exist_ok=True)
        return run(os.path.abspath(dump_to))
    with tempfile.TemporaryDirectory(prefix="jaxfuse_passes_") as folder:
        return run(folder)


def _module_name(hlo_text: str) -> str | None:
    """`HloModule jit_f, entry_computation_layout=...` -> 'jit_f'."""
    m = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------------------------
# Formatting helpers.

def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _signed(n: int) -> str:
    return f"{n:+d}" if n else "0"


def _signed_bytes(n: int) -> str:
    if not n:
        return "0"
    return ("+" if n > 0 else "-") + format_bytes(abs(n))
