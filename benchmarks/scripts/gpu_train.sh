#!/usr/bin/env bash
# On a GPU machine: `jaxfuse train` end to end, one run per kernel set from the same start, into $OUT.
#   OUT=/tmp/out bash benchmarks/scripts/gpu_train.sh
# A 45M-parameter byte-level LM (4 layers, width 1024, 8 query / 2 kv heads of 128), 16 x 1024 tokens per step.
# optax must be importable (pip install -e ".[train]"). Without network: `pip download optax --no-deps -d .wheels`
# here (optax 0.2.8 needs only jax, numpy and absl), carry .wheels, and this script installs it from there.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import optax" 2>/dev/null; then
  pip install -q --no-deps .wheels/optax-*.whl || { echo "gpu_train.sh: optax is not installed" >&2; exit 1; }
fi
python3 -m jaxfuse.cli train --steps "${STEPS:-300}" --batch 16 --seq 1024 --dim 1024 --heads 8 --kv-heads 2 \
  --layers 4 --eval-every 100 \
  --kernels '' --kernels attention=cudnn --kernels attention=pallas --kernels all=pallas \
  --out "$OUT/train-h100.json" | tee "$OUT/train-h100.txt"
