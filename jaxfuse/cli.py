"""`jaxfuse VERB [flags]`: what XLA fuses in a Flax model, kernel by kernel.

    jaxfuse inspect                                  # forward pass of the default pre-norm block
    jaxfuse inspect --train-step --dtype bf16        # loss + grads of the block, bf16
    jaxfuse inspect --model lm --kernels attention=cudnn --json
    jaxfuse inspect --train-step --kernels all=pallas_triton --triton-ir   # the Triton kernels' IR, any machine
    jaxfuse diff --a attention=xla --b attention=cudnn --train-step
    jaxfuse diff --a old.hlo.txt --b new.hlo.txt
    jaxfuse passes --train-step
    jaxfuse train --kernels '' --kernels attention=pallas,loss=pallas
    jaxfuse bench --op attention --tune              # GPU: sweep block sizes (checked, then timed), then the suite
    jaxfuse bench --op rmsnorm_matmul --shapes 8192x1536x8960   # your model's shape (M, K, N), named ones or custom
    jaxfuse bench --op train_step --shapes 1b --mesh data=2 --fsdp   # several GPUs: jaxfuse.sharding
    jaxfuse inspect --train-step --mesh data=2,model=2               # one device's partitioned program

Each verb has `--help`. Flag names take '-' or '_' (`--train-step` = `--train_step`). A bad flag or input (an
implementation this machine cannot run, a file or folder that cannot be read or written, an XLA flag XLA rejects)
ends in one line naming it and exit status 2, before any long work where it can be known then; anything else in
one line and status 1. JAXFUSE_TRACEBACK=1 shows the traceback instead.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable

from absl import flags

__all__ = ["main", "run", "VERBS"]


@dataclasses.dataclass(frozen=True)
class Verb:
    summary: str
    define_flags: Callable[[flags.FlagValues], None]
    execute: Callable[[flags.FlagValues, list[str]], int]


# ---------------------------------------------------------------------------------------------------------
# inspect

_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def _define_shape_flags(fv: flags.FlagValues, defaults) -> None:
    """The model's shape flags, for every verb that builds the model (inspect, diff, passes, train); ``defaults``
    holds batch, seq, dim, heads, kv_heads, layers and seed (the verb's function's own defaults)."""
    flags.DEFINE_integer("batch", defaults["batch"], "Batch size B (sequences).", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("seq", defaults["seq"], "Sequence length T (tokens per sequence).", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("dim", defaults["dim"], "Model width D.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("heads", defaults["heads"], "Query heads N (D must be a multiple).", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("kv_heads", defaults["kv_heads"], "Key/value heads K (N a multiple of K).", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("layers", defaults["layers"], "Transformer blocks (the LM; the block program has one).",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_enum("dtype", "bf16", list(_DTYPES), "Compute dtype of activations (parameters stay float32).",
                      flag_values=fv)
    flags.DEFINE_integer("seed", defaults["seed"], "Seed of the random parameters and inputs.", flag_values=fv)


def _define_mesh_flags(fv: flags.FlagValues, batch: str) -> None:
    """--mesh and --fsdp (jaxfuse.sharding); ``batch`` says what --batch means on a mesh for this verb."""
    flags.DEFINE_string("mesh", None, "Run on a device mesh 'data=N,model=M' (axes data and model; a left-out axis "
                        "is 1; the product must equal the devices JAX sees: pick GPUs with CUDA_VISIBLE_DEVICES). "
                        f"The batch is split over data ({batch}); model > 1 is tensor parallelism: attention heads, "
                        "MLP hidden units and the LM head's vocabulary split over it. XLA partitions the program and "
                        "inserts the collectives; the Pallas sites run under shard_map.", flag_values=fv)
    flags.DEFINE_bool("fsdp", False, "With --mesh: also shard the parameters (and optimizer state) over the data "
                      "axis, each along its largest dimension the axis divides (fully-sharded data parallel: XLA "
                      "all-gathers a parameter where it is used and reduce-scatters its gradient).", flag_values=fv)


def _check_mesh_flags(fv: flags.FlagValues) -> None:
    if fv.fsdp and not fv.mesh:
        raise flags.Error("--fsdp shards over the mesh's data axis: give --mesh too (e.g. --mesh data=2 --fsdp)")


def _define_model_flags(fv: flags.FlagValues, *, kernels: bool = True) -> None:
    """The model's flags; ``kernels``: also --kernels (not for diff, whose --a and --b name each side's)."""
    import inspect

    from jaxfuse import programs

    defaults = {name: p.default for name, p in inspect.signature(programs.build_program).parameters.items()}
    flags.DEFINE_enum("model", "block", list(programs.MODELS), "Which program: one pre-norm transformer block, or "
                      "the whole language model.", flag_values=fv)
    _define_shape_flags(fv, defaults)
    if kernels:
        flags.DEFINE_string("kernels", "", "Per-site implementations, e.g. 'attention=cudnn,norm_matmul=xla' "
                            "(xla, xla_f32, pallas, pallas_triton, pallas_mosaic; cudnn for attention).",
                            flag_values=fv)
    flags.DEFINE_bool("train_step", False, "Compile the training step (loss and grads) instead of the forward.",
                      flag_values=fv)
    _define_mesh_flags(fv, "--batch is the global batch; the report is one device's partitioned program, its "
                       "collectives included")


def _model_options(fv: flags.FlagValues) -> dict:
    """The flags as build_program's keyword arguments (without kernels)."""
    _check_mesh_flags(fv)
    return dict(model=fv.model, batch=fv.batch, seq=fv.seq, dim=fv.dim, heads=fv.heads, kv_heads=fv.kv_heads,
                layers=fv.layers, dtype=_DTYPES[fv.dtype], train_step=fv.train_step, seed=fv.seed, mesh=fv.mesh,
                fsdp=fv.fsdp)


def _program(fv: flags.FlagValues):
    from jaxfuse import programs
    from jaxfuse.kernels import KernelSet

    return programs.build_program(**_model_options(fv), kernels=KernelSet.parse(fv.kernels))


def _define_inspect_flags(fv: flags.FlagValues) -> None:
    _define_model_flags(fv)
    flags.DEFINE_string("xla_flags", "", "XLA options for this compile only, e.g. "
                        "'--xla_gpu_enable_triton_gemm=false'.", flag_values=fv)
    flags.DEFINE_bool("json", False, "Print the report as JSON (schema hlo_inspect.report/1).", flag_values=fv)
    flags.DEFINE_string("html", None, "Also write a self-contained HTML page (tables, ledger, kernel graph) to "
                        "this path.", flag_values=fv)
    flags.DEFINE_bool("measure", False, "GPU: also time every kernel (CUPTI) and set it beside its roofline and "
                      "XLA's own estimate (compiled with --xla_gpu_collect_cost_model_stats); with --mesh, also "
                      "each device's profiler trace: compute, collective time, how much of it runs beside compute "
                      "and how much is exposed (jaxfuse.timeline).", flag_values=fv)
    flags.DEFINE_bool("ledger", True, "Also print the HBM round-trip ledger (tensors written by one kernel and read "
                      "back by another), costed at the device's measured bandwidth.", flag_values=fv)
    flags.DEFINE_bool("triton_ir", False, "Instead of the report: lower the program for CUDA (no GPU needed) and "
                      "summarize the Triton IR of each Pallas kernel (loops, tile dots, masked loads, library "
                      "calls); with --json, each kernel's whole IR too.", flag_values=fv)
    flags.DEFINE_bool("mosaic_ir", False, "Instead of the report: lower the program for CUDA (no GPU needed) and "
                      "summarize each Mosaic GPU kernel as lowered (grid, threads, shared memory, wgmma shapes, TMA "
                      "copies, barriers, loops); with --json, those numbers per kernel (not the module text, "
                      "megabytes a kernel: hlo_inspect.mosaic_ir.lower_kernels gives it).", flag_values=fv)


def _writable_folder(flag: str, folder: str) -> None:
    """Makes ``folder`` (and its parents) when missing, before any work: flags.Error naming ``--flag`` when it cannot
    be made or written into."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise flags.Error(f"--{flag} {folder}: cannot create the folder: {e.strerror}") from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise flags.Error(f"--{flag} {folder}: cannot write into the folder: permission denied")


def _writable_file(flag: str, path: str) -> None:
    """``_writable_folder`` for the folder of the file ``path``, then opens ``path`` for appending (and removes it
    again when it was not there): flags.Error when ``path`` is a folder or cannot be written, e.g. in /proc, whose
    folder looks writable."""
    if os.path.isdir(path):
        raise flags.Error(f"--{flag} {path}: is a folder; give a file path")
    _writable_folder(flag, os.path.dirname(os.path.abspath(path)))
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise flags.Error(f"--{flag} {path}: cannot write the file: {e.strerror}") from e
    if not existed:
        os.remove(path)


def _print_triton_kernels(fv: flags.FlagValues) -> int:
    import json

    from jaxfuse import programs

    program = _program(fv)
    kernels = programs.triton_kernels(program, progress=_progress)
    if fv.json:
        print(json.dumps([dataclasses.asdict(k) | {"dots": k.dots(), "op_counts": k.op_counts(),
                                                    "extern_calls": k.extern_calls()} for k in kernels], indent=1))
        return 0
    print(f"{program.description}: {len(kernels)} Pallas kernel(s), Triton IR as lowered for CUDA (before "
          f"Triton's own passes; tiles from the built-in tables, not a device's tuning cache)")
    for k in kernels:
        print(f"  {k.summary()}")
    return 0


def _print_mosaic_kernels(fv: flags.FlagValues) -> int:
    import json

    from jaxfuse import programs

    program = _program(fv)
    kernels = programs.mosaic_kernels(program, progress=_progress)
    if fv.json:
        print(json.dumps([dict(name=k.name, grid=k.grid, cluster=k.cluster, threads=k.threads,
                               warpgroups=k.warpgroups, smem_bytes=k.smem_bytes, wgmma=k.wgmma(),
                               tma_loads=k.tma_loads(), tma_multicast_loads=k.tma_multicast_loads(),
                               tma_stores=k.tma_stores(), tma_reduce_stores=k.tma_reduce_stores(),
                               barriers=k.barriers(), op_counts=k.op_counts()) for k in kernels], indent=1))
        return 0
    print(f"{program.description}: {len(kernels)} Mosaic GPU kernel(s) as lowered for CUDA (tiles from this "
          f"machine's tuning cache or the built-in tables)")
    for k in kernels:
        print(f"  {k.summary()}")
    return 0


def _inspect(fv: flags.FlagValues, rest: list[str]) -> int:
    if rest:
        raise flags.Error(f"unexpected arguments {rest}")
    if fv.triton_ir or fv.mosaic_ir:
        flag = "--triton_ir" if fv.triton_ir else "--mosaic_ir"
        if fv.measure or fv.html or (fv.triton_ir and fv.mosaic_ir):
            raise flags.Error(f"{flag} replaces the report: it does not combine with --measure, --html or the other "
                              f"IR flag")
        return _print_triton_kernels(fv) if fv.triton_ir else _print_mosaic_kernels(fv)
    import jax

    from jaxfuse import costmodel, programs

    if fv.measure and jax.default_backend() != "gpu":
        raise flags.Error(f"--measure times device kernels with CUPTI and needs an NVIDIA GPU; this machine runs "
                          f"{jax.default_backend()} (for CPU timings use `jaxfuse bench`)")
    if fv.html:
        _writable_file("html", fv.html)

    xla_flags = (fv.xla_flags + " --xla_gpu_collect_cost_model_stats=true").strip() if fv.measure else fv.xla_flags
    report = programs.inspect_program(_program(fv), xla_flags=xla_flags, progress=_progress)
    if fv.html:
        report.to_html(fv.html)
        _progress(f"wrote {fv.html}")
    spec = costmodel.detect()
    if fv.measure:
        from jaxfuse import measure

        _progress("timing every kernel ...")
        rows, summary = measure.measure_kernels(report, report.program.fn, report.program.args, device=spec)
        if not fv.json:
            print(measure.measured_table(rows, summary, spec))
            print()
        if report.program.layout is not None and not fv.json:  # CUPTI's sums mix the devices: a trace per device
            from jaxfuse import timeline

            _progress("tracing one call per device (jax.profiler) ...")
            print("per device, from a profiler trace (median of 3 calls): how much collective time runs beside "
                  "compute")
            print(timeline.timeline_table(timeline.device_timeline(report.program.fn, report.program.args)))
            print()
    if fv.json:
        print(report.to_json())
        return 0
    print(report.table())
    if spec is None:
        print(f"\n{costmodel.no_figures_note()}")
    saving = spec and report.fusion_saving_text(spec.name, spec.hbm_bytes_per_s, spec.bf16_flops_per_s,
                                                spec.launch_us)
    if saving:
        print(f"\n{saving}")
    if fv.ledger:
        print()
        print(report.ledger_table(hbm_bytes_per_s=spec.hbm_bytes_per_s if spec else None))
    return 0


# ---------------------------------------------------------------------------------------------------------
# diff

def _define_diff_flags(fv: flags.FlagValues) -> None:
    _define_model_flags(fv, kernels=False)
    flags.DEFINE_string("a", None, "Program A: an HLO text file, or a kernel spec for the model "
                        "('attention=xla'; '' for the defaults).", flag_values=fv)
    flags.DEFINE_string("b", None, "Program B: as --a.", flag_values=fv)
    flags.DEFINE_string("a_xla_flags", "", "XLA options for compiling A, e.g. "
                        "'--xla_gpu_enable_triton_gemm=false'.", flag_values=fv)
    flags.DEFINE_string("b_xla_flags", "", "XLA options for compiling B.", flag_values=fv)
    flags.DEFINE_bool("json", False, "Print the diff as JSON (schema hlo_inspect.diff/1).", flag_values=fv)
    flags.DEFINE_string("html", None, "Also write a self-contained HTML page (tables, ledger, kernel graph) to "
                        "this path.", flag_values=fv)


def _diff(fv: flags.FlagValues, rest: list[str]) -> int:
    import json

    from jaxfuse import programs

    if rest:
        raise flags.Error(f"unexpected arguments {rest}")
    if fv.html:
        _writable_file("html", fv.html)
    d = programs.diff_programs(fv.a, fv.b, a_xla_flags=fv.a_xla_flags, b_xla_flags=fv.b_xla_flags,
                               model=_model_options(fv), progress=_progress)
    if fv.html:
        d.to_html(fv.html)
        _progress(f"wrote {fv.html}")
    print(json.dumps(d.to_dict(), indent=1) if fv.json else d.table())
    return 0


# ---------------------------------------------------------------------------------------------------------
# passes

def _define_passes_flags(fv: flags.FlagValues) -> None:
    _define_model_flags(fv)
    flags.DEFINE_string("pass_re", ".*", "Which XLA passes to dump (xla_dump_hlo_pass_re); '.*' keeps every pass "
                        "that changed the module.", flag_values=fv)
    flags.DEFINE_string("xla_flags", "", "More XLA options for this compile.", flag_values=fv)
    flags.DEFINE_string("dump_dir", None, "Keep XLA's per-pass dump files in this folder.", flag_values=fv)
    flags.DEFINE_bool("json", False, "Print the timeline as JSON (schema hlo_inspect.passes/1).", flag_values=fv)


def _passes(fv: flags.FlagValues, rest: list[str]) -> int:
    import json

    import jax
    from hlo_inspect.formatting import parse_xla_flags
    from hlo_inspect.passes import dump_passes
    from jaxfuse import programs

    if rest:
        raise flags.Error(f"unexpected arguments {rest}")
    if fv.dump_dir:
        _writable_folder("dump-dir", fv.dump_dir)
    options = parse_xla_flags(fv.xla_flags)
    program = _program(fv)
    programs.check_kernels(program.kernels)
    foreign = programs.foreign_flags_warning(options)
    if foreign:
        _progress(foreign)
    _progress(f"compiling {program.description} on {jax.devices()[0].device_kind} with per-pass dumps ...")
    start = time.perf_counter()
    try:
        timeline = dump_passes(program.fn, *program.args, pass_re=fv.pass_re, xla_flags=fv.xla_flags,
                               dump_to=fv.dump_dir)
    except jax.errors.JaxRuntimeError as e:
        error = programs.xla_option_error(e, options)
        if error is None:
            raise
        raise error from e
    _progress(f"read {timeline.dumps_read} dumps in {time.perf_counter() - start:.1f} s")
    print(json.dumps(timeline.to_dict(), indent=1) if fv.json else timeline.table())
    return 0


# ---------------------------------------------------------------------------------------------------------
# bench

DEFAULT_BENCH_OUT = "jaxfuse-results"  # relative to the current directory; in .gitignore


def _define_bench_flags(fv: flags.FlagValues) -> None:
    from jaxfuse import suites

    flags.DEFINE_enum("op", None, list(suites.OPS), "Which op's spec to time.", flag_values=fv)
    flags.DEFINE_list("shapes", [], "Named shapes of the spec (default: its GPU shapes on a GPU, its CPU smoke shape "
                      "elsewhere; 'all' for every one this machine runs), or custom ones: the dims' sizes joined by "
                      "'x' in the spec's order (rmsnorm_matmul 8192x1536x8960 is M, K, N; a wrong one's error names "
                      "the order).", flag_values=fv)
    flags.DEFINE_list("impls", [], "Implementations to time (default: the spec's; e.g. pallas_triton,xla,xla_f32).",
                      flag_values=fv)
    flags.DEFINE_multi_string("kernels", [], "train_step: a kernel set to time, e.g. 'attention=cudnn' ('' = all "
                              "xla); repeat the flag for several (default: every set of the spec). --impls cannot "
                              "name them: it splits at commas.", flag_values=fv)
    flags.DEFINE_integer("iterations", 30, "Timed iterations per measurement (median reported).", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_bool("tune", False, "First sweep the Pallas kernels' block sizes at the shapes (default: the spec's "
                      "tune shapes): each candidate is checked against the float32 reference, then timed; the best "
                      "goes into --tuned_configs, and the suite then runs with it.", flag_values=fv)
    flags.DEFINE_string("tuned_configs", None, "Tuning cache the sweep writes (default: the package's "
                        "pallas_kernels/tuned_configs.json, which every call then uses).", flag_values=fv)
    flags.DEFINE_float("budget_s", 0.0, "Wall-clock budget in seconds (0: none); what is not started by then is "
                       "recorded as skipped.", lower_bound=0.0, flag_values=fv)
    flags.DEFINE_bool("check", True, "Compare every output with the float32 reference before timing (--nocheck "
                      "skips it: its float32 GEMMs take 20-40 s to autotune per LM-head shape on an H100; the sweep "
                      "of --tune always checks).", flag_values=fv)
    flags.DEFINE_string("out", DEFAULT_BENCH_OUT,
                        "Folder for <op>-<device tag>.json and .md (attention-h100.json on an H100), made when "
                        "missing: by default jaxfuse-results/ in the current directory (git ignores it inside the "
                        "checkout); the checkout's benchmarks/results/ only when named here; '' writes nothing.",
                        flag_values=fv)
    flags.DEFINE_bool("json", False, "Print the records as JSON instead of a table.", flag_values=fv)
    _define_mesh_flags(fv, "--op train_step only; a preset's batch is per data shard, so tokens/s against --mesh "
                       "data=1 is weak scaling; records carry the mesh, strategy, devices, tokens/s and per-device "
                       "parameter and optimizer bytes; steps are timed with the wall clock")


def _bench(fv: flags.FlagValues, rest: list[str]) -> int:
    import dataclasses as dc
    import json

    import jax
    from jaxfuse import bench, suites

    if rest:
        raise flags.Error(f"unexpected arguments {rest}")
    if not fv.op:
        raise flags.Error(f"--op is required; one of {list(suites.OPS)}")
    _check_mesh_flags(fv)
    spec = suites.get(fv.op)
    if fv.mesh:
        from jaxfuse.sharding import Layout
        from jaxfuse.suites import train_step

        if fv.op != "train_step" or fv.tune:
            raise flags.Error("--mesh runs the train step on a mesh: --op train_step, without --tune")
        layout = Layout.parse(fv.mesh, fsdp=fv.fsdp)  # a bad mesh fails before any work
        spec = train_step.on_mesh(layout)
    on_gpu = jax.default_backend() == "gpu"
    shapes = fv.shapes or None
    if fv.shapes == ["all"]:
        shapes = list(spec.shapes) if on_gpu else list(spec.cpu_shapes)
    names = suites.runner.check_shape_names(spec, shapes)  # GPU-sized shapes off a GPU: refused before any work
    if fv.mesh:  # a mesh that does not divide a preset's batch, heads or widths: refused before any work
        for name in names:
            train_step.check_mesh(spec.shapes[name], layout)
    impls = list(fv.impls)
    if fv.kernels:
        from jaxfuse.kernels import KernelSet

        if fv.op != "train_step" or impls:
            raise flags.Error("--kernels names the train step's kernel sets: --op train_step, without --impls")
        impls = [str(KernelSet.parse(k)) for k in fv.kernels]
    unknown = [impl for impl in impls if impl not in spec.implementations()]
    if unknown:
        raise flags.Error("--" + suites.runner.unknown_impls_message(spec, unknown))
    if fv.out:
        _writable_folder("out", fv.out)
    if fv.tuned_configs:
        _writable_file("tuned-configs", fv.tuned_configs)
    if not on_gpu and not fv.shapes:
        _progress(f"on {jax.default_backend()}: {fv.op}'s CPU shape{'s' if len(names) > 1 else ''} {names} "
                  f"(Pallas in interpret mode, wall-clock timing); its GPU shapes {list(spec.default_shapes)} need "
                  f"a GPU")
    deadline = time.time() + fv.budget_s if fv.budget_s else None
    start = time.time()
    _progress(f"benchmarking {fv.op} ({fv.iterations} iterations each{', tuning first' if fv.tune else ''}) ...")
    result = suites.benchmark(fv.op, shapes, impls=impls or None, iterations=fv.iterations, tune_first=fv.tune,
                              tuned_configs=fv.tuned_configs, out=fv.out or None, deadline=deadline,
                              check=fv.check, mesh=fv.mesh, fsdp=fv.fsdp,
                              progress=lambda message: _progress(f"[{time.time() - start:6.1f} s] {message}"))
    for path in result["written"]:
        _progress(f"wrote {path}")
    env, records = result["environment"], result["records"]
    if fv.json:
        print(json.dumps({"environment": env, "records": [dc.asdict(r) for r in records], "sweep": result["sweep"]},
                         indent=1, default=str))
        return 0
    if result["sweep"] is not None:
        print(suites.sweep.sweep_table(result["sweep"]) + "\n")
    print(f"{env['device']}, jax {env['jax']}, commit {env['commit']}, {records[0].method if records else ''}"
          " timing")
    print(bench.markdown_table(records))
    print()
    print(suites.summary_table(records))
    return 0


# ---------------------------------------------------------------------------------------------------------
# train

def _define_train_flags(fv: flags.FlagValues) -> None:
    from jaxfuse.train import TrainConfig

    d = TrainConfig()
    flags.DEFINE_multi_string("kernels", [""], "A kernel set to train with, e.g. 'attention=pallas,loss=pallas' "
                              "('' = all xla); repeat the flag to compare several (the first is the baseline).",
                              flag_values=fv)
    flags.DEFINE_integer("steps", d.steps, "Optimizer steps.", lower_bound=1, flag_values=fv)
    _define_shape_flags(fv, dataclasses.asdict(d))
    flags.DEFINE_float("lr", d.lr, "Peak learning rate (AdamW, warmup then cosine to lr/10).", flag_values=fv)
    flags.DEFINE_integer("warmup", None, "Warmup steps, fewer than --steps (default: min(20, steps / 2)).",
                         lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("eval_every", d.eval_every, "Steps between held-out loss measurements.", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_string("corpus", None, "A UTF-8 text file to train on (default: the toolkit's own Python source).",
                        flag_values=fv)
    flags.DEFINE_string("out", None, "Also write the runs as JSON (environment, config, loss curves, step times) "
                        "to this path.", flag_values=fv)
    flags.DEFINE_bool("json", False, "Print the runs as JSON instead of the comparison table.", flag_values=fv)
    _define_mesh_flags(fv, "--batch is the global batch, so the losses match a one-device run; the step is timed "
                       "with the wall clock")


def _train(fv: flags.FlagValues, rest: list[str]) -> int:
    import json

    import jax
    from jaxfuse import bench, programs, train
    from jaxfuse.kernels import SITES, KernelSet

    if rest:
        raise flags.Error(f"unexpected arguments {rest}")
    _check_mesh_flags(fv)
    kernel_sets = [KernelSet.parse(spec) for spec in fv.kernels]
    cfg = train.TrainConfig(steps=fv.steps, batch=fv.batch, seq=fv.seq, dim=fv.dim, heads=fv.heads,
                            kv_heads=fv.kv_heads, layers=fv.layers, dtype=_DTYPES[fv.dtype], lr=fv.lr,
                            warmup=fv.warmup, eval_every=fv.eval_every, seed=fv.seed, corpus=fv.corpus,
                            mesh=fv.mesh, fsdp=fv.fsdp)
    model_cfg = cfg.model_config()  # bad widths and head counts fail here, before any data is read
    if fv.mesh:
        from jaxfuse.sharding import Layout

        Layout.parse(fv.mesh, fsdp=fv.fsdp).check_model(model_cfg, fv.batch)  # so does a mesh that does not fit
    for ks in kernel_sets:
        programs.check_kernels(ks)
    if fv.out:
        _writable_file("out", fv.out)
    train.optimizer(cfg)  # without optax: the one-line ImportError now, not after reading the corpus
    if jax.default_backend() == "cpu" and any(getattr(ks, site).startswith("pallas") for ks in kernel_sets
                                                for site in SITES):
        _progress("note: on the CPU the Pallas kernels run in interpret mode: slow, and their step time says "
                  "nothing about a GPU")
    start = time.time()
    results = train.compare(kernel_sets, cfg,
                            progress=lambda message: _progress(f"[{time.time() - start:6.1f} s] {message}"))
    payload = {"environment": bench.environment(), "config": dataclasses.asdict(cfg),
               "runs": [r.to_dict() for r in results]}
    if fv.out:
        with open(fv.out, "w") as f:
            json.dump(payload, f, indent=1)
        _progress(f"wrote {fv.out}")
    print(json.dumps(payload, indent=1) if fv.json else train.comparison_table(results))
    return 0


VERBS = {
    "inspect": Verb("Kernel-by-kernel fusion report of the default model (forward or training step).",
                    _define_inspect_flags, _inspect),
    "diff": Verb("How two programs' fusion decisions differ (model configs, XLA flag sets or saved HLO files).",
                 _define_diff_flags, _diff),
    "passes": Verb("XLA's pass timeline: kernels and bytes after each pass that changed the program, and the pass "
                   "that created each final kernel.", _define_passes_flags, _passes),
    "bench": Verb("Time an op's implementations side by side (device-kernel time on GPU) and record them.",
                  _define_bench_flags, _bench),
    "train": Verb("Train a small byte-level LM with one or more kernel sets from the same start; compare their "
                  "loss curves and step times.", _define_train_flags, _train),
}


# ---------------------------------------------------------------------------------------------------------
# Dispatch.

def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _normalize(argv: list[str]) -> list[str]:
    """`--train-step=x` -> `--train_step=x`, `--no-ledger` -> `--noledger` (flag names only)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            if name.startswith("no-"):
                name = "no" + name[3:]
            arg = "--" + name.replace("-", "_") + eq + value
        out.append(arg)
    return out


def _out_of_memory(error: Exception, fv: flags.FlagValues) -> str | None:
    """The one-line error for XLA's RESOURCE_EXHAUSTED (the program needs more memory than the device has), or
    None for other errors."""
    import re

    said = " ".join(str(error).split())
    if "RESOURCE_EXHAUSTED" not in said:
        return None
    asked = re.search(r"(\d+) bytes", said)
    size = (f"XLA asked for {int(asked.group(1)):,} bytes, {int(asked.group(1)) / 2**30:,.1f} GiB" if asked
            else f"XLA says: {said[:200]}")
    smaller = [f"--{name}" for name in ("batch", "seq", "layers") if name in fv]
    advice = f"; try a smaller {', '.join(smaller[:-1])} or {smaller[-1]}" if len(smaller) > 1 else ""
    return f"the program needs more memory than the device has ({size}){advice}"


def _usage() -> str:
    lines = [__doc__.strip(), "", "verbs:"]
    lines += [f"  {name:10s} {verb.summary}" for name, verb in VERBS.items()]
    return "\n".join(lines)


def _flags_help(fv: flags.FlagValues) -> str:
    """A verb's flags for --help: absl's text without its per-module headers (a file path) and absl's own flags."""
    lines = fv.get_help(include_special_flags=False).splitlines()
    return "\n".join(line for line in lines if line.startswith(" ") or not line.rstrip().endswith(":")).strip("\n")


def main(argv: list[str]) -> int:
    """Run `jaxfuse` with `argv` (without the program name); returns the exit status."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    name, args = argv[0], _normalize(argv[1:])
    verb = VERBS.get(name)
    if verb is None:
        print(f"jaxfuse: unknown verb {name!r}; one of: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    fv = flags.FlagValues()
    verb.define_flags(fv)
    if any(a in ("-h", "--help", "--helpfull") for a in args):
        print(f"jaxfuse {name}: {verb.summary}\n\nflags:\n{_flags_help(fv)}")
        return 0
    try:
        rest = fv([f"jaxfuse {name}"] + args)[1:]
        return verb.execute(fv, rest)
    except (flags.Error, ValueError, OSError, ImportError) as e:
        # Bad flags and bad inputs (shapes, dtypes, kernel names, block sizes, XLA flags, HLO files) raise
        # ValueError with a message that names the constraint; a path that cannot be read or written raises
        # OSError, a missing optional package ImportError: one line is the useful answer. A ValueError from a bug
        # deep inside would lose its traceback that way, so JAXFUSE_TRACEBACK=1 re-raises it whole.
        if os.environ.get("JAXFUSE_TRACEBACK"):
            raise
        message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else e
        print(f"jaxfuse {name}: {message}\n(set JAXFUSE_TRACEBACK=1 for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxfuse {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - anything else is a bug: one line, the traceback on request
        if os.environ.get("JAXFUSE_TRACEBACK"):
            raise
        too_big = _out_of_memory(e, fv)  # a size limit, not a bug
        if too_big:
            print(f"jaxfuse {name}: {too_big}", file=sys.stderr)
            return 2
        said = " ".join(str(e).split())
        print(f"jaxfuse {name}: internal error {type(e).__name__}: {said[:500]}\n(a bug in jaxfuse, or a failure "
              "of JAX or XLA underneath; set JAXFUSE_TRACEBACK=1 for the traceback)", file=sys.stderr)
        return 1


def run() -> None:
    """Console-script entry point."""
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
