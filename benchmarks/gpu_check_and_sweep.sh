#!/usr/bin/env bash
# One device call: CUDA tests, the offline frontier sweep of the tiny pair (T=0 and T=1), and
# `adaspec demo` through the real HTTP server, all on the GPU. Writes at most 8 files to $OUT.
#   bash benchmarks/gpu_check_and_sweep.sh
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
LOG="$OUT/gpu_log.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/models/test_parity.py 2>&1 | tail -5
} 2>&1 | tee "$LOG"
for T in 0 1; do
  timeout ${SWEEP_TIMEOUT:-170} python3 benchmarks/offline_sweep.py --model tiny --device cuda \
    --arms none,fixed:1,fixed:3,fixed:7,adaptive:7 --concurrency 1,16,64,256 --output-len 64 \
    --temperature $T --repeats 2 --out "$OUT/offline_sweep_T$T.json" 2>&1 | tail -24 | tee -a "$LOG"
done
if python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  timeout ${DEMO_TIMEOUT:-200} python3 -m adaspec.cli demo --out /tmp/demo 2>&1 | tail -30 | tee -a "$LOG"
  cp /tmp/demo/report.md /tmp/demo/frontier.png /tmp/demo/manifest.json "$OUT"/ 2>/dev/null
fi
