#!/usr/bin/env bash
# On a machine with 2 or 4 GPUs: the 1b train step on one mesh, records into $OUT; one command per mesh:
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu.sh data=1                  # one GPU: the baseline
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu.sh data=2                  # data parallel (target >= 1.8x tokens/s)
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu.sh data=2 --fsdp           # fully sharded (param+opt bytes ~1/2)
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu.sh model=2                 # tensor parallel
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu.sh data=4                  # 4 GPUs (target >= 3.4x)
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu.sh data=4 --fsdp
#   OUT=/tmp/out bash benchmarks/scripts/multi_gpu.sh data=2,model=2 --fsdp
# The mesh's size n picks the first n visible GPUs (CUDA_VISIBLE_DEVICES). The 1b preset's batch (2 x 2048 tokens) is
# per data shard, so tokens/s against data=1 is weak scaling. Records: train_step-<device>-<strategy>-data<d>-model<m>.json
# (mesh, strategy, devices, tokens_per_s, param_bytes_per_device, opt_bytes_per_device, peak_bytes per device, loss);
# then the partitioned LM train step's fusion report (collectives listed once hlo_inspect knows them).
# The machine's NCCL variables (NCCL_NVLS_ENABLE=0 among them) are left as they are. optax must be importable (see
# gpu_train.sh for installing it offline from .wheels). KERNELS="attention=cudnn" times one kernel set instead of
# the three (all XLA, cuDNN attention, Mosaic attention): about a third of the time per mesh.
set -euo pipefail
mesh=${1:?usage: OUT=DIR bash benchmarks/scripts/multi_gpu.sh data=2[,model=2] [--fsdp]}
shift
n=1
for item in ${mesh//,/ }; do n=$((n * ${item#*=})); done
visible=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 63)}
export CUDA_VISIBLE_DEVICES=$(echo "$visible" | cut -d, -f1-"$n")
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import optax" 2>/dev/null; then
  pip install -q --no-deps .wheels/optax-*.whl || { echo "multi_gpu.sh: optax is not installed" >&2; exit 1; }
fi
tag="${mesh//[=,]/}${1:+-fsdp}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/multi_gpu-$tag-devices.txt" || true
env | grep '^NCCL_' | sort >> "$OUT/multi_gpu-$tag-devices.txt" || true
if [ -n "${KERNELS+x}" ]; then read -ra sets <<< "$KERNELS"; else sets=("" attention=cudnn attention=pallas_mosaic); fi
kernel_flags=()
for set in "${sets[@]}"; do kernel_flags+=(--kernels "$set"); done
python3 -m jaxfuse.cli bench --op train_step --shapes 1b --mesh "$mesh" "$@" --iterations 20 \
  "${kernel_flags[@]}" --out "$OUT" 2>&1 | tee "$OUT/train_step-$tag-log.txt"
python3 -m jaxfuse.cli inspect --model lm --train-step --batch 8 --mesh "$mesh" "$@" --no-ledger 2>&1 \
  | tee "$OUT/inspect_lm_train-$tag.txt"
