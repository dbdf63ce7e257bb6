#!/usr/bin/env bash
# One prepared GPU check (<= 8 min by its own timing, one H100/H200, no network): grouped GEMM vs the loop, async
# checkpoint save + reload bitwise, GPU-vs-CPU parity of the engines (eager and compiled), eager vs compiled
# tokens/s, MFU and peak memory (vs the planner) of a 1B and an 8B-shaped model at seq 4096, and a calibration JSON
# for the planner. Writes $OUT/gpu_check.json after every phase (bench/gpu_bench.py docstring).
#   bash bench/gpu_check.sh            # on the GPU machine, from anywhere
#   bash bench/gpu_check.sh --dry      # CPU, tiny shapes, no inductor (the CI test, tests/parallel/test_gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-.}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)
export GPU_CHECK_T0=$start  # gpu_bench.py's budget counts from here, as the hard timeout below does
if [[ "${1:-}" != "--dry" ]]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# The script starts a phase only while its estimate fits in 450 s (--budget-s) and reports each row as it ends;
# the hard stop leaves the shell's own seconds (nvidia-smi, torch's import) inside 480. The dry run (a CI test on
# a CPU that may be loaded) gets 600 s: it checks that every phase runs, not how long a GPU takes.
limit=465
[[ "${1:-}" == "--dry" ]] && limit=600
rc=0
timeout "$limit" $PY bench/gpu_bench.py --out "$OUT/gpu_check.json" --calibration "$OUT/gpu_calibration.json" "$@" || rc=$?
took=$(( $(date +%s) - start ))
echo "gpu_check: ${took} s in all (limit 480), exit ${rc}; results in $OUT/gpu_check.json"
if [[ "${1:-}" != "--dry" ]] && (( took > 480 )); then echo "gpu_check: over the 8-minute budget" >&2; exit 3; fi
exit "$rc"
