#!/usr/bin/env bash
# On a machine with 2 GPUs: where the 1b data-parallel step's time goes (jaxfuse.timeline: compute, collectives,
# their overlap) under XLA's default schedule and with the latency-hiding scheduler, into $OUT:
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu_overlap.sh
# The 2-GPU step ran 13.7 ms longer than the 1-GPU one (1.63x tokens/s, NOTES.md "Multi-GPU"): about the time the
# gradients' all-reduce takes, as if none of it overlapped the backward. XLA's GPU default is
# xla_gpu_enable_latency_hiding_scheduler=false (debug_options_flags.cc). One process per configuration (XLA_FLAGS
# is read once per process); each writes train_step_timeline-<device>-<mesh>-<tag>.json and its optimized HLO.
# optax must be importable (see gpu_train.sh for installing it offline from .wheels).
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import optax" 2>/dev/null; then
  pip install -q --no-deps .wheels/optax-*.whl || { echo "multi_gpu_overlap.sh: optax is not installed" >&2; exit 1; }
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/multi_gpu_overlap-devices.txt" || true
env | grep '^NCCL_' | sort >> "$OUT/multi_gpu_overlap-devices.txt" || true
script=benchmarks/scripts/train_step_timeline.py
lhs=--xla_gpu_enable_latency_hiding_scheduler=true
run() {  # tag, XLA_FLAGS, visible GPUs, script arguments...
  local tag=$1 flags=$2 gpus=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus XLA_FLAGS="$flags" timeout 300 python3 "$script" --out "$OUT" --tag "$tag" "$@" 2>&1 \
    | grep -v "Warning\|warn(" | tail -8 | tee -a "$OUT/multi_gpu_overlap-log.txt"
}
run default "" 0 --mesh data=1
run default "" 0,1 --mesh data=2
run lhs "$lhs" 0,1 --mesh data=2
run lhs "$lhs" 0 --mesh data=1
run lhs-ar256m "$lhs --xla_gpu_all_reduce_combine_threshold_bytes=268435456" 0,1 --mesh data=2
run lhs "$lhs" 0,1 --mesh data=2 --fsdp
