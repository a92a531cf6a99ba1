#!/usr/bin/env bash
# Issue 14's frontier on two H200s in one command: ONE pair build, then the same server sweep at
# tensor parallel size 1 and 2 (`adaspec serve --tensor-parallel-size N`, one server per arm and
# size, each in its own process), so both sizes' arms come from one build and may share a table.
#
#   bash benchmarks/h200x2_tp_frontier.sh OUT_DIR [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]
#
# Defaults: arms adaptive:7,none,fixed:7 (adaptive first: if time runs out a later arm is cut) at
# 1,32,256, T = 0, 2 repeats (h200_frontier.sh's server mode: 64 output tokens, 32 prompts per point
# or C when larger). Both sizes run with --cudagraph-mode FULL_DECODE_ONLY: mixed graphs exist at
# TP = 1 only, and the comparison is of tensor parallelism, not of graph modes.
# Budget: BUDGET_S (default 570) for the whole command, of which TP2_S (default 170) is kept for
# the TP = 2 sweep; each sweep is stopped in time and reports what finished. The pair build takes
# ~410 s of it, so one command holds few points per size: SIZES="1" then SIZES="2" as two calls
# issued back to back (the warm machine keeps /tmp/pair, so both use one build; the pair.json of
# each names the build) gives each size a whole command. Carry .whl (benchmarks/fetch_server_wheels.sh).
# Writes at most 6 files: OUT/pair.json, OUT/tp{1,2}.tar.gz (report, plot, log, every point),
# OUT/tp{1,2}_summary.txt, OUT/tp_summary.txt (TP = 2 against TP = 1 per arm and concurrency).
# CPU smoke test (gloo, the embedded tiny pair, no build):
#   MODEL=tiny OUTPUT_LEN=8 NUM_PROMPTS=4 BUDGET_S=400 bash benchmarks/h200x2_tp_frontier.sh /tmp/tpf none,fixed:3 1,2 0 1
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: h200x2_tp_frontier.sh OUT_DIR [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]}
ARMS=${2:-adaptive:7,none,fixed:7}
CONC=${3:-1,32,256}
TEMP=${4:-0}
REPEATS=${5:-2}
TOTAL=${BUDGET_S:-570}
START=$SECONDS
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/adaspec-tp.XXXXXX)
export MODE=server
SIZES=${SIZES:-1 2}
for tp in $SIZES; do
  if [ "$tp" = 1 ] && [ "$SIZES" != 1 ]; then budget=$((TOTAL - ${TP2_S:-170})); else budget=$((TOTAL - (SECONDS - START))); fi
  if [ -z "${MODEL:-}" ] && [ "$tp" != 1 ] && [ ! -f "${PAIR_DIR:-/tmp/pair}/pair.json" ]; then
    echo "TP = $tp: no built pair (its build failed or ran out of time): not started"; continue
  fi
  echo "[h200x2_tp_frontier.sh +$((SECONDS - START)) s] tensor parallel size $tp, budget $budget s"
  mkdir -p "$WORK/tp$tp"
  # H200_NESTED: the inner script must not pack its folder (PACK=1, h200_common.sh): this one reads it
  H200_NESTED=1 BUDGET_S=$budget RUNS_DIR="$WORK/runs$tp" RESERVE_S=${RESERVE_S:-25} \
    SERVER_ARGS="--tensor-parallel-size=$tp --cudagraph-mode=FULL_DECODE_ONLY ${SERVER_ARGS:-}" \
    bash benchmarks/h200_frontier.sh "$WORK/tp$tp" "$ARMS" "$CONC" "$TEMP" "$REPEATS" || echo "TP = $tp: exit $?"
  if [ -f "$WORK/tp$tp/pair.json" ]; then cp "$WORK/tp$tp/pair.json" "$OUT/pair.json"; fi
  if [ -f "$WORK/tp$tp/server_T${TEMP}_summary.txt" ]; then cp "$WORK/tp$tp/server_T${TEMP}_summary.txt" "$OUT/tp${tp}_summary.txt"; fi
  tar -czf "$OUT/tp$tp.tar.gz" -C "$WORK" "tp$tp"
done
PYTHON=${PYTHON:-$( [ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3 )}
PYTHONPATH="$PWD:/tmp/adaspec-site${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$WORK/runs1/server_T${TEMP}" \
  "$WORK/runs2/server_T${TEMP}" <<'EOF' | tee "$OUT/tp_summary.txt" || echo "the TP summary failed"
import os
import sys

from adaspec.bench.aggregate import aggregate, load_points

sizes = {tp: aggregate(load_points(d)) if os.path.isdir(d) else {} for tp, d in zip((1, 2), sys.argv[1:])}
print("TP = 2 against TP = 1, same build (mean over repeats; ratio = TP2 / TP1)")
print(f"{'arm':<12}{'C':>5}{'out tok/s TP1':>15}{'TP2':>10}{'ratio':>7}{'user tok/s TP1':>16}{'TP2':>8}{'ratio':>7}")
for key in sorted(set(sizes[1]) | set(sizes[2]), key=lambda k: (k[1], k[0])):
    a, b = sizes[1].get(key), sizes[2].get(key)
    def val(cell, name):
        return None if cell is None else cell.mean.get(name)
    cols = []
    for name in ("output_throughput", "median_per_user_tok_s"):
        x, y = val(a, name), val(b, name)
        cols += ["-" if x is None else f"{x:.0f}", "-" if y is None else f"{y:.0f}",
                 "-" if x is None or y is None or not x else f"{y / x:.2f}"]
    print(f"{key[0]:<12}{key[1]:>5}{cols[0]:>15}{cols[1]:>10}{cols[2]:>7}{cols[3]:>16}{cols[4]:>8}{cols[5]:>7}")
EOF
rm -rf "$WORK"
echo "[h200x2_tp_frontier.sh +$((SECONDS - START)) s] done"
