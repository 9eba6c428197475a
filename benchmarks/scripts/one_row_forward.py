"""The one-row (M = 1) rmsnorm_matmul on both Pallas backends against XLA, forward and forward + backward, in one run:
the Mosaic backend's transposed GEMV (``norm_matmul.mosaic_gemv``) at each of its sweep candidates' tiles, the
Triton backend's config for the shape (tuned entry or table), and XLA's norm + matmul.

    PYTHONPATH=$PWD python benchmarks/scripts/one_row_forward.py --out $OUT [--shapes 1x4096x14336,1x2048x8192]

CUPTI medians over ``--iterations`` calls, as many input sets rotated as the suite rotates (``runner.input_sets``);
every form's outputs (and gradients) checked against the float32 reference first. ``--repeats`` runs each shape
again on fresh inputs (new seeds, new buffers): at 1x4096x14336 on the H200 the Mosaic GEMV moved by up to 2.2 µs
between three sets of buffers in one call, XLA's GEMV by up to 0.5 (one_row_forward_repeats-h200-*.json). The
Mosaic forms share the Triton backward, so only the default tiles run forward + backward: the others differ by the
forward alone. Writes ``one_row_forward.json`` (µs, relative errors, the largest kernels of each program).
"""

from __future__ import annotations

import argparse
import json
import os
import re

import jax

import pallas_kernels
from jaxfuse import bench, costmodel
from jaxfuse.suites import rmsnorm_matmul as suite
from jaxfuse.suites.runner import input_sets, reference_outputs

SHAPES = ("1x4096x14336", "1x2048x8192", "1x4096x4096", "1x8192x8192", "1x1024x2816", "1x8192x28672")


def _tiles(spec: str) -> dict:
    """"m128k64s6" -> the forward config's changes {tile_m: 128, tile_k: 64, num_stages: 6}; a leading "c" takes
    the cooperative schedule with both warpgroups' tile_m rows stacked in one block ("cm64k128s6": 128-row blocks),
    a trailing "d<n>" n wgmma groups in flight (delay_release), then "p<n>" the K loop in n parts (k_parts)."""
    c, m, k, s, d, p = re.fullmatch(r"(c?)m(\d+)k(\d+)s(\d+)(?:d(\d))?(?:p(\d))?", spec).groups()
    stacked = dict(schedule="cooperative", wg_split="m") if c else {}
    delay = {} if d is None else dict(delay_release=int(d))
    parts = {} if p is None else dict(k_parts=int(p))
    return dict(stacked, **delay, **parts, tile_m=int(m), tile_k=int(k), num_stages=int(s))


def _forms(x, gamma, w, gammas=("",), candidates=None, tiles=()) -> dict:
    """name -> fn(x, gamma, w): XLA, Triton's config, and each Mosaic sweep candidate (the first is the default;
    ``candidates``: the first that many), then the default with each of ``tiles``' changes, each with gamma where
    each of ``gammas`` puts it ("": the candidate's own, "x": x ⊙ gamma by XLA, "a": on w's blocks in the kernel's
    registers; the name then ends "_g" + it)."""
    forms = {"xla": suite.SPEC.implementations()["xla"],
             "triton": lambda x, g, w: pallas_kernels.rmsnorm_matmul(x, g, w, backend="triton")}
    forward, _ = pallas_kernels.norm_matmul.sweep_candidates(x, gamma, w, backend="mosaic")
    forward = forward[:candidates] + [dict(forward[0], forward=dict(forward[0]["forward"], **_tiles(t)))
                                      for t in tiles]
    for params, gamma_on in [(p, g) for p in forward for g in gammas]:
        f = params["forward"]
        name = (f"mosaic_{f['schedule'][:2]}_m{f['tile_m']}_k{f['tile_k']}_s{f['num_stages']}_d{f['delay_release']}"
                f"_sk{f['stream_k']}" + (f"_kp{f['k_parts']}" if f.get("k_parts", 1) > 1 else "")
                + (f"_g{gamma_on}" if gamma_on else ""))
        if gamma_on:
            params = dict(params, gamma_on=gamma_on)
        forms[name] = lambda x, g, w, _p=params: pallas_kernels.rmsnorm_matmul(x, g, w, backend="mosaic",
                                                                               block_sizes=_p)
    return forms


def _rel_error(got, want) -> float:
    return bench.max_difference(zip(got, want), relative=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--gammas", default="",
                        help="comma-separated gamma placements for each Mosaic form: x (x ⊙ gamma by XLA), a (on w's "
                             "blocks in the registers); empty: the config's own")
    parser.add_argument("--candidates", type=int, default=None, help="time only the first this many Mosaic tiles")
    parser.add_argument("--tiles", default="", help="comma-separated forward tiles to time besides, on the default "
                                                    "config: [c]m<tile_m>k<tile_k>s<num_stages>[d<delay>], e.g. "
                                                    "m128k64s8 (c: cooperative, both warpgroups' rows stacked)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="times each shape runs, with fresh inputs (new seeds, new buffers) each time")
    args = parser.parse_args()
    dev = costmodel.detect()
    rows = []
    for name, repeat in [(n, r) for n in args.shapes.split(",") for r in range(args.repeats)]:
        M, K, N = map(int, name.split("x"))
        shape = dict(M=M, K=K, N=N)
        first = repeat * 10  # the seeds of this repeat's input sets
        sets = [suite.make_inputs(M, K, N, seed=first + i) for i in range(len(input_sets(suite.SPEC, shape, dev)))]
        for mode in args.modes.split(","):
            mode_sets = [s[:3] for s in sets] if mode == "fwd" else sets
            want = reference_outputs(suite.SPEC, sets[0], mode, shape, {})
            gammas = tuple(args.gammas.split(","))
            forms = list(_forms(*sets[0][:3], gammas=gammas, candidates=args.candidates,
                                tiles=[t for t in args.tiles.split(",") if t]).items())
            if mode != "fwd":  # the Mosaic forms share the Triton backward: the default's tiles stand for them
                forms = forms[:2 + len(gammas)]
            for form, fn in forms:
                program = jax.jit(suite.SPEC.program(fn, mode, shape, {}))
                try:
                    err = _rel_error(jax.tree.leaves(program(*mode_sets[0])), want)
                    timing = bench.time_kernels(program, mode_sets, iterations=args.iterations)
                except Exception as e:  # noqa: BLE001 -- a form that does not compile is reported, the rest run
                    print(name, mode, form, "ERROR", str(e)[:300], flush=True)
                    continue
                kernels = sorted(((k, round(v, 2)) for k, v in timing.per_kernel_us.items()), key=lambda kv: -kv[1])
                rows.append(dict(shape=name, mode=mode, form=form, repeat=repeat, us=round(timing.median_us, 2),
                                 rel_error=err, kernels=kernels[:5]))
                print(json.dumps(rows[-1]), flush=True)
            jax.clear_caches()
    path = os.path.join(args.out, "one_row_forward.json")
    with open(path, "w") as f:
        json.dump(dict(environment=bench.environment(), rows=rows, input_sets="runner.input_sets"), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
