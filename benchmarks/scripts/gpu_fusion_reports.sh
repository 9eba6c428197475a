#!/usr/bin/env bash
# On a GPU machine: the fusion reports the issues quote, written to $OUT.
#   OUT=/tmp/out bash benchmarks/scripts/gpu_fusion_reports.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
J="python3 -m jaxfuse.cli"
BIG="--batch 8 --seq 2048 --dim 2048 --heads 16 --kv-heads 4"
$J inspect > "$OUT/inspect_fwd.txt" 2>/dev/null
$J inspect --train-step > "$OUT/inspect_train.txt" 2>/dev/null
$J diff --a attention=xla --b attention=cudnn --train-step --html "$OUT/diff_cudnn.html" > "$OUT/diff_xla_cudnn.txt" 2>/dev/null
$J diff --a attention=xla --b attention=pallas --train-step > "$OUT/diff_xla_pallas_attention.txt" 2>/dev/null
$J diff --a norm_matmul=xla --b norm_matmul=pallas --train-step > "$OUT/diff_xla_pallas_norm.txt" 2>/dev/null
$J inspect --train-step --kernels attention=pallas,norm_matmul=pallas --no-ledger --html "$OUT/pallas_block.html" > /dev/null 2>&1
$J inspect --train-step --kernels attention=pallas,norm_matmul=pallas > "$OUT/inspect_train_pallas.txt" 2>/dev/null
$J inspect --train-step --measure $BIG > "$OUT/measure_train_big.txt" 2>"$OUT/measure_err.txt"
$J inspect --measure $BIG > "$OUT/measure_fwd_big.txt" 2>>"$OUT/measure_err.txt"
$J inspect --train-step --measure --kernels attention=pallas,norm_matmul=pallas $BIG \
  > "$OUT/measure_train_big_pallas.txt" 2>>"$OUT/measure_err.txt"
if python3 -c "import hlo_inspect.passes" 2>/dev/null; then $J passes --train-step > "$OUT/passes_train.txt" 2>"$OUT/passes_err.txt"; fi
for f in "$OUT"/*.txt; do echo "== $f"; tail -n 6 "$f"; done
