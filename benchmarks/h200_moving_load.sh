#!/usr/bin/env bash
# A load that moves, on one H200, through the real HTTP server, in one command: build the code-0.6b
# pair (~410 s; the GPU machine keeps nothing between commands), then run every arm through the
# same schedule of concurrency phases (`adaspec bench sweep --load-phases`: one `adaspec serve`
# per arm, CUDA graphs on as by default), then `adaspec bench report` (whole run and per phase:
# output throughput, per-user speed p50/p90, TTFT p50/p99, and whether each adaptive arm beats
# every other arm on throughput at equal or better median per-user speed).
#
#   bash benchmarks/h200_moving_load.sh OUT_DIR [ARMS] [PHASES] [TEMPERATURE] [REPEATS]
#
# Needs the server's wheels (benchmarks/fetch_server_wheels.sh here, then carry .whl). Give
# ADASPEC_COMMIT=<sha> so the results name the commit measured.
# The budget: the build takes ~410 s of the 600 s command, which leaves ~160 s for the arms'
# server starts (load, CUDA graph capture, the adaptive arm's cost profiling) and the runs, so the
# defaults are 4 arms, 2 repeats, short requests (64 output tokens): arms
# adaptive:7,none,fixed:3,fixed:7 (adaptive first: if time runs out, the sweep is stopped cleanly
# and it is a later arm that is missing, as the report then shows), phases
# 1x12,128x256,1x12,128x256 (low, high, low, high concurrency; 536 requests a run), T=0. A run of
# that schedule lasts ~2.5 s at T = 1 on the H200 (run 29): on a machine that found the pair built,
# give run 23's longer one, 1x24,128x768,1x24,128x768 (at T = 1, run 29, two commands of the short
# one on one build disagreed).
# A run that cannot fit is cut at the budget; give fewer arms (e.g. adaptive:7,none,fixed:7) or a
# shorter schedule for a complete table. Writes at most 6 files: OUT/pair.json,
# OUT/moving_T{T}.log, OUT/moving_T{T}_report.md, OUT/moving_T{T}_frontier.png and
# OUT/moving_T{T}.tar.gz (points with every request's numbers and phase, server logs, manifest).
# CPU smoke test (no build, the embedded tiny pair):
#   MODEL=tiny OUTPUT_LEN=8 bash benchmarks/h200_moving_load.sh /tmp/m none,adaptive:7 1x2,4x8,1x2 0 1
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: h200_moving_load.sh OUT_DIR [ARMS] [PHASES] [TEMPERATURE] [REPEATS]}
ARMS=${2:-adaptive:7,none,fixed:3,fixed:7}
PHASES=${3:-1x12,128x256,1x12,128x256}
TEMP=${4:-0}
REPEATS=${5:-2}
OUTPUT_LEN=${OUTPUT_LEN:-64}
source benchmarks/h200_common.sh
mkdir -p "$OUT"
NAME=moving_T${TEMP}
install_server_wheels
ensure_pair "$OUT"
MAXC=$("$PYTHON" -c "import sys; from adaspec.bench.phases import parse_phases; \
print(max(p.max_concurrency for p in parse_phases(sys.argv[1])))" "$PHASES")
DIR=${RUNS_DIR:-/tmp/adaspec-runs}/$NAME
rm -rf "$DIR"
EXTRA_SERVER_ARGS=()  # SERVER_ARGS="--no-engine-process": each passed to every server (the engine process is the default on CUDA since 89da045; runs up to 13 measured the thread)
for a in ${SERVER_ARGS:-}; do EXTRA_SERVER_ARGS+=("--server-arg=$a"); done
sweep_then_report "$DIR" --model "$MODEL" "${DRAFTER_ARGS[@]}" --arms "$ARMS" --load-phases "$PHASES" \
  --repeats "$REPEATS" --temperature "$TEMP" --output-len "$OUTPUT_LEN" --ignore-eos \
  --num-warmups "${NUM_WARMUPS:-8}" --server-arg=--max-num-seqs="$MAXC" "${EXTRA_SERVER_ARGS[@]}" --startup-timeout 240 2>&1 | tee "$OUT/$NAME.log"
collect "$DIR" "$OUT" "$NAME"
if [ -f "$DIR/report.md" ]; then
  sed -n '/^## Whole run/,/^## Frontier/p;/^## The moving-load question/,$p' "$DIR/report.md"
fi
say "done in $((SECONDS - T_START)) s"
