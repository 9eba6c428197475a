"""Where the train step's time goes on each GPU of a mesh: compute, collectives, their overlap (``jaxfuse.timeline``).

    PYTHONPATH=$PWD python benchmarks/scripts/train_step_timeline.py --out $OUT --mesh data=2 \
        [--preset 1b] [--fsdp] [--kernels attention=cudnn] [--tag NAME] [--calls 3] [--iterations 20]

One process times one configuration; XLA options come from the environment (``XLA_FLAGS``), which the record
keeps, so that runs with different schedulers or combine thresholds sit side by side. For the suite's step
(``jaxfuse.suites.train_step``: forward, backward, AdamW) of ``--preset`` with its batch per data shard:

  - the wall clock of a blocked step (median of ``--iterations``) and the tokens per second it gives;
  - per device, from profiler traces of ``--calls`` steps: span, compute, collective, overlapped and exposed
    collective time, idle (``jaxfuse.timeline``);
  - the compiled program's collectives (hlo_inspect): opcode, element types, payload and bytes sent per device,
    in program order, and their totals by element type.

Writes ``train_step_timeline-<device>-<tag>.json`` (tag: the mesh, "-fsdp", then ``--tag``) and the optimized HLO
(``.hlo.txt.gz``) beside it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import sys
import time

import jax

import hlo_inspect
from jaxfuse import bench, timeline
from jaxfuse.kernels import KernelSet
from jaxfuse.sharding import Layout
from jaxfuse.suites import train_step

_ELEMENT_TYPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[")


def collectives(report) -> list[dict]:
    """The report's collective kernels in program order: name, opcode, element types, bytes."""
    rows = []
    for k in report.kernels:
        if not k.collective:
            continue
        types = sorted(set(_ELEMENT_TYPE.findall(str(k.instruction.shape))))
        rows.append({"name": k.name, "opcode": k.collective.opcode, "element_types": types,
                     "payload_bytes": k.collective.payload_bytes, "bytes_sent": k.bytes_sent,
                     "group_size": k.collective.group_size})
    return rows


def by_element_type(rows: list[dict]) -> dict[str, int]:
    """Payload bytes per element-type combination ("bf16", "f32", "bf16+f32")."""
    totals: dict[str, int] = {}
    for row in rows:
        key = "+".join(row["element_types"]) or "?"
        totals[key] = totals.get(key, 0) + row["payload_bytes"]
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--mesh", default="data=1")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--preset", default="1b", choices=sorted(train_step.PRESETS))
    parser.add_argument("--kernels", default="attention=cudnn")
    parser.add_argument("--tag", default="")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)

    layout = Layout.parse(args.mesh, fsdp=args.fsdp)
    preset = dict(train_step.PRESETS[args.preset])
    preset["batch"] *= layout.data
    kernels = KernelSet.parse(args.kernels)
    start = time.perf_counter()
    inputs = train_step._make_inputs(preset, 0, layout=layout)
    step = jax.jit(train_step._program(kernels, "step", preset, None, layout=layout))
    hlo_text = step.lower(*inputs).compile().as_text()
    report = hlo_inspect.from_text(hlo_text)
    compile_s = time.perf_counter() - start
    wall = bench.time_kernels(step, [inputs], iterations=args.iterations, wall=True)
    tokens = preset["batch"] * preset["seq"]
    per_device = timeline.device_timeline(step, inputs, calls=args.calls) if jax.default_backend() == "gpu" else []
    rows = collectives(report)

    env = bench.environment()
    tag = "-".join(filter(None, [args.mesh.replace("=", "").replace(",", ""), "fsdp" if args.fsdp else "",
                                 args.tag]))
    record = {**env, "preset": args.preset, "mesh": str(layout), "strategy": layout.strategy,
              "devices": layout.devices, "kernels": str(kernels), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "tokens_per_step": tokens, "step_wall_us": wall.median_us, "step_wall_samples_us": list(wall.samples_us),
              "tokens_per_s": tokens / (wall.median_us * 1e-6), "compile_s": compile_s,
              "timeline": [t.to_json() for t in per_device], "collectives": rows,
              "collective_payload_bytes_by_type": by_element_type(rows)}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"train_step_timeline-{bench.device_tag(env['device'])}-{tag}")
    with open(base + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with gzip.open(base + ".hlo.txt.gz", "wt") as f:
        f.write(hlo_text)
    print(f"{args.preset} {layout} ({layout.strategy}) {kernels} XLA_FLAGS={record['xla_flags']!r}: step "
          f"{wall.median_us / 1e3:.1f} ms wall (spread {min(wall.samples_us) / 1e3:.1f}-"
          f"{max(wall.samples_us) / 1e3:.1f}), "
          f"{record['tokens_per_s'] / 1e3:.1f}k tokens/s")
    print(f"collectives: {len(rows)}, payload by element type: "
          + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in record["collective_payload_bytes_by_type"].items()))
    if per_device:
        print(timeline.timeline_table(per_device))
    print(f"wrote {base}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
