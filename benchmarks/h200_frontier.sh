#!/usr/bin/env bash
# The frontier on the real pair, on one H200, in one command: build the code-0.6b pair (the GPU
# machine keeps nothing between commands, so every command that measures the pair rebuilds it),
# then sweep arms x concurrency x repeats with the offline engine and write the JSON that
# `benchmarks/offline_sweep.py` prints a table of.
#
#   bash benchmarks/h200_frontier.sh OUT_DIR [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]
#
# Defaults: none,fixed:7,adaptive:7 at 1,16,64,256, T=0, 2 repeats, 64 output tokens. Every result
# file records the held-out acceptance of the build it ran on (pair.json is copied beside it), and
# arms from different builds are never merged: one command, one build, one frontier.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: h200_frontier.sh OUT_DIR [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]}
ARMS=${2:-none,fixed:7,adaptive:7}
CONC=${3:-1,16,64,256}
TEMP=${4:-0}
REPEATS=${5:-2}
PAIR=${PAIR_DIR:-/tmp/pair}
PYTHON=${PYTHON:-$( [ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ ! -f "$PAIR/pair.json" ] || [ ! -d "$PAIR/drafter" ]; then
  bash benchmarks/build_pair_h200.sh "$PAIR" | tail -5
fi
cp "$PAIR/pair.json" "$OUT/pair.json"
"$PYTHON" benchmarks/offline_sweep.py --model "$PAIR/target" --drafter "$PAIR/drafter" --arms "$ARMS" \
  --concurrency "$CONC" --temperature "$TEMP" --repeats "$REPEATS" --output-len 64 --device cuda \
  --out "$OUT/frontier_T${TEMP}.json"
