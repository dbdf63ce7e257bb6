#!/usr/bin/env bash
# One prepared GPU check (< 5 min, one H200, no network): parity of the 1-process engines on CUDA against the CPU
# reference, then tokens/s and MFU of llama-1b. Run from the repository root:  bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-.}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 270 $PY bench/gpu_bench.py --steps 8 --seq 2048 --micro 4 | tee "$OUT/gpu_check.jsonl"
