#!/usr/bin/env bash
# The frontier of a Qwen3 shape on random weights with SYNTHETIC acceptance (timing only), on one
# H200: the speculative arms use "method": "synthetic" (a 1-layer DSpark drafter on random weights
# proposes; acceptance per position is drawn from the conditional-acceptance curve measured on the
# real code-0.6b pair), so the step costs are the shape's and the acceptance is the pair's.
#
#   bash benchmarks/h200_synthetic_frontier.sh OUT_DIR [SHAPE] [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]
#
# Defaults: qwen3-8b, none,fixed:7,adaptive:7 at 1,16,64,256, T=0, 2 repeats, 64 output tokens (the
# real frontier's settings, benchmarks/h200_frontier.sh). The curve is read from $CURVE_FROM
# (default: the pair.json of the run 16 frontier: the 2-layer preset, eval-code calibration), at the same temperature; pair.json is copied
# beside the result. Every row of the result says "synthetic acceptance: timing only".
# Engine options: OFFLINE_ARGS (offline_sweep.py flags, e.g. "--cudagraph-mode FULL"; "--step-trace"
# records every step of every point: where a point's time went, step by step, H200 runs 43-45). The sweep is
# stopped after SWEEP_S seconds (default 540; the JSON keeps the points that finished, "partial": true).
# CPU smoke test of the same path: DEVICE=cpu SHAPE_OVERRIDES='{"num_hidden_layers": 2, ...}'.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: h200_synthetic_frontier.sh OUT_DIR [SHAPE] [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]}
SHAPE=${2:-qwen3-8b}
ARMS=${3:-none,fixed:7,adaptive:7}
CONC=${4:-1,16,64,256}
TEMP=${5:-0}
REPEATS=${6:-2}
CURVE_FROM=${CURVE_FROM:-benchmarks/results/h200/run16/frontier_T0_7443c18/pair.json}
source benchmarks/h200_common.sh  # PYTHON, PYTHONPATH, say, offline_sweep_in_time
mkdir -p "$OUT"
CURVE=$("$PYTHON" -c "
import json, sys
d = json.load(open(sys.argv[1]))
t = 'T=%g' % float(sys.argv[2])
print(','.join('%.4f' % x for x in d['heldout'][t]['cond_acceptance']))" "$CURVE_FROM" "$TEMP")
echo "synthetic acceptance (timing only) from $CURVE_FROM at T=$TEMP: $CURVE"
cp "$CURVE_FROM" "$OUT/pair.json"
offline_sweep_in_time "${SWEEP_S:-540}" "$OUT/frontier_synthetic_${SHAPE}_T${TEMP}.json" \
  "$PYTHON" benchmarks/offline_sweep.py --shape "$SHAPE" --synthetic-acceptance "$CURVE" --arms "$ARMS" \
  --concurrency "$CONC" --temperature "$TEMP" --repeats "$REPEATS" --output-len 64 --device "${DEVICE:-cuda}" \
  ${SHAPE_OVERRIDES:+--shape-overrides "$SHAPE_OVERRIDES"} ${OFFLINE_ARGS:-} \
  --out "$OUT/frontier_synthetic_${SHAPE}_T${TEMP}.json"
