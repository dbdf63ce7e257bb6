#!/usr/bin/env bash
# One prepared GPU check (<= 5 min by its own timing, one H200, no network): GPU-vs-CPU parity of the engines
# (eager and compiled), eager vs compiled tokens/s, MFU and peak memory (vs the planner) of a 1B and an 8B-shaped
# model, and a calibration JSON for the planner. Writes $OUT/gpu_check.json after every phase.
#   bash bench/gpu_check.sh            # on the GPU machine, from anywhere
#   bash bench/gpu_check.sh --dry      # CPU, tiny shapes, no inductor (the CI test, tests/parallel/test_gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-.}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
if [[ "${1:-}" != "--dry" ]]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# 290 s hard stop; the script itself skips phases that would not fit in 280 s and reports each one as it ends.
timeout 290 $PY bench/gpu_bench.py --out "$OUT/gpu_check.json" --calibration "$OUT/gpu_calibration.json" "$@"
echo "gpu_check: $(( $(date +%s) - start )) s in all; results in $OUT/gpu_check.json"
