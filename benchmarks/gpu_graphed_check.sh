#!/usr/bin/env bash
# One device call for issue 12: the GPU tests (graphs equal eager, one sync per step), the syncs
# of one step per arm, and the decode / verify / propose / host-share benchmark on Qwen3 shapes.
# Writes $OUT/log.txt, $OUT/step_syncs.json, $OUT/decode_bench.json.
#   bash benchmarks/gpu_graphed_check.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "commit ${ADASPEC_COMMIT:-unknown}"
  timeout ${TEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/spec_decode tests/models 2>&1 | tail -25
  timeout 90 python3 benchmarks/step_syncs.py
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/decode_bench.py --shapes ${SHAPES:-qwen3-8b,qwen3-4b,qwen3-0.6b} \
    --batches 1,16,64,256 --verify-batches 1,16,64,256 --draft-layers 1,2 --steps 30 --budget-s ${BENCH_BUDGET:-240} \
    --mixed-chunk ${MIXED_CHUNK:-128}
} 2>&1 | tee "$LOG"
