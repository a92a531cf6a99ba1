#!/usr/bin/env bash
# The frontier on the real pair, on one H200, in one command: build the code-0.6b pair (the GPU
# machine keeps nothing between commands, so every command that measures the pair rebuilds it,
# ~410 s in the H200 runs, 334 s in H100 run 53), then sweep arms x concurrency x repeats, either with the offline engine (MODE=offline,
# the default) or through the real HTTP server (MODE=server: one `adaspec serve` per arm, CUDA
# graphs on as by default, driven by `adaspec bench sweep`, then `adaspec bench report`).
#
#   bash benchmarks/h200_frontier.sh OUT_DIR [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]
#   MODE=server bash benchmarks/h200_frontier.sh OUT_DIR [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]
#
# One temperature per command. Every result records the held-out acceptance of the build it ran on
# (pair.json is copied beside it), and arms from different builds are never merged: one command,
# one build, one frontier. Give ADASPEC_COMMIT=<sha> so the results name the commit measured.
#
# MODE=offline: every arm's engine is loaded at once with the same 16 GiB KV cache and each repeat
#   visits the arms in a rotated order (offline_sweep.py --interleave; INTERLEAVE_ARGS= turns it off,
#   e.g. for shapes whose engines do not fit together). Defaults none,fixed:7,adaptive:7 at 1,16,64,256, T=0, 2 repeats, 64 output tokens
#   (after a build only ~120-140 s are left: run 18 loaded five engines and measured 29 points in 141 s,
#   run 19 spent all of its 122 s loading four, and since a40b25f every engine also runs its startup
#   warm-up requests, ~17 s for an adaptive one in run 26; a later command on the warm machine that finds
#   the pair built has the whole budget for the sweep),
#   WAVES=4 waves of C prompts per point (at least 8 prompts; with 2 waves a point at C = 256 lasted
#   under a second and its ramps outweighed its steady state: BENCHMARKS.md, run 12);
#   writes OUT/pair.json and OUT/frontier_T{T}.json (benchmarks/summarize_sweep.py tables it). A
#   grid that does not fit is stopped in time; the JSON then holds the points that finished
#   ("partial": true) and their table is printed.
# MODE=server: needs the server's wheels (benchmarks/fetch_server_wheels.sh here, then carry .whl).
#   The budget: the build takes ~410 s of the 600 s command (355-444 s measured), and on a fresh
#   machine the adaptive arm's server took 97-112 s to start at --max-num-seqs 256 (H200 run 27: load,
#   65 plain and 315 speculative CUDA graphs, the cost profiling, the startup warm-up requests), fixed
#   ones ~42 s, no-spec ~31 s: after a build there may be no time for a single point (run 27 measured
#   none). Measure one concurrency per command (the servers then capture graphs up to it only: at
#   C = 64, H200 run 28, adaptive:7 started in 69 s on the fresh machine and 37 s once the compile
#   caches held its kernels, fixed:3 in 30-35 s, no-spec in 27 s, and the 122 s a 433 s build left
#   measured two arms x 3 repeats); a later command cannot count on the build (run 27's next command
#   got a fresh machine; run 28's two next commands, sent within seconds, found it). The
#   defaults were set before that:
#   3 arms x 3 concurrencies x 2 repeats of short requests: arms adaptive:7,none,fixed:7
#   (adaptive first: if time runs out it is a later arm that is missing), concurrency 1,32,256,
#   T=0, 2 repeats, 64 output tokens, max(32, WAVES x C) eval-code prompts per point, 8 warm-up
#   requests. WAVES=16 (4 until run 29: through the server in run 17 one wave at C = 256 lasted under a
#   second, mostly ramp; in run 29, 4 waves at T = 1 still lasted 0.45 s at C = 16 and 0.8 s at 64,
#   and the spreads of 3-4 repeats reached +-10%: server starts, not points, take a command's time).
#   The sweep is stopped in time (SIGTERM: it stops its server, keeps every finished point) and
#   the report covers what finished. Writes at most 6 files: OUT/pair.json, OUT/server_T{T}.log,
#   OUT/server_T{T}_report.md, OUT/server_T{T}_frontier.png, OUT/server_T{T}.tar.gz (points, server
#   logs, manifest) and OUT/server_T{T}_summary.txt.
# The servers run their engine in a process of its own (the default on CUDA since 89da045; runs up to 13
# measured an engine thread: SERVER_ARGS="--no-engine-process" for that).
# One HTTP server process per server unless SERVER_ARGS="--api-server-count=4": at 256 streams one
#   process was the bound (BENCHMARKS.md, run 22: four made adaptive:7 1.32x at C = 256, the same at 1 and 32).
#   Since 9272dca more than one also moves the text's decoding to the API processes (--api-detokenize;
#   runs 22-30 decoded in the engine): SERVER_ARGS="--api-server-count=4 --no-api-detokenize" for
#   the old way, e.g. as the A side of h200_ab_server.sh (A_TREE=. with A_SERVER_ARGS / B_SERVER_ARGS).
# Output lengths spread over [L(1 - r), L(1 + r)] instead of all L (without it the no-spec arm runs
#   in waves that end on one step, BENCHMARKS.md run 18): OFFLINE_ARGS="--random-range-ratio 0.5" or
#   SWEEP_ARGS="--random-range-ratio 0.5" (every `bench sweep` the H200 scripts run: MODE=server here,
#   h200_moving_load.sh, h200_server_synthetic.sh). The offline sweep takes several, each a condition
#   measured by the same engines on one build: OFFLINE_ARGS="--random-range-ratio 0,0.5" (H100 run 72:
#   with 0.5 no-spec lost the most, 0.78x its fixed-length throughput at 256 requests on another build).
# Where a point's time goes: OFFLINE_ARGS="--profile adaptive:7@256,none@256" runs those points once more
#   under torch.profiler after the sweep (not among the points) and records kernel busy time against
#   wall time and the top kernels under the JSON's `profiles` (H200 run 38: at 256 requests the
#   speculative arms spent 84% of a point in steps with a prefill chunk, 14 ms each; on the same shape on
#   random weights the adaptive arm's kernels filled ~97% of its point: GPU-bound there).
# Engine options: OFFLINE_ARGS (offline_sweep.py flags, e.g. "--cudagraph-mode FULL_DECODE_ONLY") and SERVER_ARGS
#   (server flags, e.g. "--cudagraph-mode=FULL_DECODE_ONLY --disable-log-requests", each given to every server).
# CPU smoke test (no build, the embedded tiny pair):
#   MODEL=tiny MODE=server OUTPUT_LEN=8 NUM_PROMPTS=4 bash benchmarks/h200_frontier.sh /tmp/f none,adaptive:7 1,2 0 1
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: [MODE=offline|server] h200_frontier.sh OUT_DIR [ARMS] [CONCURRENCY] [TEMPERATURE] [REPEATS]}
MODE=${MODE:-offline}
TEMP=${4:-0}
REPEATS=${5:-2}
OUTPUT_LEN=${OUTPUT_LEN:-64}
source benchmarks/h200_common.sh
mkdir -p "$OUT"

case "$MODE" in
  offline)
    ARMS=${2:-none,fixed:7,adaptive:7}
    CONC=${3:-1,16,64,256}
    ensure_pair "$OUT"
    # stopped in time if the grid does not fit: the JSON is rewritten after every point (partial: true)
    LEFT=$(( $(time_left) - ${RESERVE_S:-15} ))
    offline_sweep_in_time "$LEFT" "$OUT/frontier_T${TEMP}.json" "$PYTHON" benchmarks/offline_sweep.py --model "$MODEL" \
      "${DRAFTER_ARGS[@]}" --arms "$ARMS" --concurrency "$CONC" --temperature "$TEMP" --repeats "$REPEATS" \
      --output-len "$OUTPUT_LEN" --device "${DEVICE:-cuda}" ${INTERLEAVE_ARGS---interleave --kv-cache-gib 16} \
      --prompts-per-concurrency "${WAVES:-4}" ${OFFLINE_ARGS:-} --out "$OUT/frontier_T${TEMP}.json"
    ;;
  server)
    ARMS=${2:-adaptive:7,none,fixed:7}
    CONC=${3:-1,32,256}
    NAME=server_T${TEMP}
    install_server_wheels
    ensure_pair "$OUT"
    MAXC=$(echo "$CONC" | tr ',' '\n' | sort -n | tail -1)
    EXTRA_SERVER_ARGS=()  # SERVER_ARGS="--cudagraph-mode=FULL --disable-log-requests": each passed to every server
    for a in ${SERVER_ARGS:-}; do EXTRA_SERVER_ARGS+=("--server-arg=$a"); done
    DIR=${RUNS_DIR:-/tmp/adaspec-runs}/$NAME
    rm -rf "$DIR"
    sweep_then_report "$DIR" --model "$MODEL" "${DRAFTER_ARGS[@]}" --arms "$ARMS" --concurrency "$CONC" \
      --repeats "$REPEATS" --temperature "$TEMP" --output-len "$OUTPUT_LEN" --ignore-eos \
      --num-prompts "${NUM_PROMPTS:-32}" --prompts-per-concurrency "${WAVES:-16}" --num-warmups "${NUM_WARMUPS:-8}" \
      --server-arg=--max-num-seqs="$MAXC" "${EXTRA_SERVER_ARGS[@]}" --startup-timeout 240 2>&1 | tee "$OUT/$NAME.log"
    collect "$DIR" "$OUT" "$NAME"
    if [ -f "$DIR/report.md" ]; then
      "$PYTHON" - "$DIR" > "$OUT/${NAME}_summary.txt" <<'EOF'
import sys
from adaspec.bench.aggregate import aggregate, load_points
cells = aggregate(load_points(sys.argv[1]))
print(f"{'arm':<12}{'C':>5}{'n':>3}{'out tok/s':>18}{'user tok/s p50':>18}{'accepted len':>14}")
for (arm, c), cl in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    f = lambda k: "-" if cl.mean.get(k) is None else f"{cl.mean[k]:.1f} ± {cl.std[k]:.1f}"
    print(f"{arm:<12}{c:>5}{cl.n:>3}{f('output_throughput'):>18}{f('median_per_user_tok_s'):>18}"
          f"{f('spec_mean_accepted_length'):>14}")
EOF
      cat "$OUT/${NAME}_summary.txt"
    fi
    ;;
  *)
    echo "h200_frontier.sh: MODE must be offline or server, got $MODE" >&2
    exit 2
    ;;
esac
say "done in $((SECONDS - T_START)) s"
