#!/usr/bin/env bash
# One device call: CUDA tests, then the offline frontier sweep of the tiny pair on the GPU.
#   bash benchmarks/gpu_check_and_sweep.sh   (writes to $OUT, or ./gpu_out)
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/models/test_parity.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
for T in 0 1; do
  timeout ${SWEEP_TIMEOUT:-200} python3 benchmarks/offline_sweep.py --model tiny --device cuda \
    --arms none,fixed:1,fixed:3,fixed:7,adaptive:7 --concurrency 1,16,64,256 --output-len 64 \
    --temperature $T --repeats 2 --out "$OUT/offline_sweep_T$T.json" 2>&1 | tail -30 | tee "$OUT/offline_sweep_T$T.txt"
done
