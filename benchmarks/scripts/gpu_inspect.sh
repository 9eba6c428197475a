#!/usr/bin/env bash
# On a GPU machine: capture the HLO test data and the `jaxfuse inspect` reports into $OUT.
#   OUT=/tmp/out bash benchmarks/scripts/gpu_inspect.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
mkdir -p "$OUT/data"
python3 tests/data/capture.py --out "$OUT/data" 2>&1 | grep -v Warning
python3 -m jaxfuse.cli inspect > "$OUT/inspect_fwd.txt"
python3 -m jaxfuse.cli inspect --train-step > "$OUT/inspect_train.txt"
python3 -m jaxfuse.cli inspect --train-step --kernels attention=cudnn > "$OUT/inspect_train_cudnn.txt"
python3 -m jaxfuse.cli inspect --train-step --json > "$OUT/inspect_train.json"
cd "$OUT/data" && tar czf ../data.tgz . && cd - >/dev/null && rm -rf "$OUT/data"
tail -n 8 "$OUT"/inspect_*.txt
