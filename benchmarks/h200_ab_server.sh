#!/usr/bin/env bash
# A/B of two versions of the server in one device command, on one pair build: `adaspec serve` of a
# baseline tree (A) and of this checkout (B) driven alternately (A, B, A, B...) by the same
# `adaspec bench sweep` settings as `MODE=server benchmarks/h200_frontier.sh`, so that both see the
# same GPU, the same pair and the same minutes (the host's speed moves by 2x within one command:
# BENCHMARKS.md, run 20). A is a directory holding another version's whole tree (its adaspec/ and
# benchmarks/; e.g. `git archive OLD adaspec benchmarks pyproject.toml | tar -x -C /tmp/old`); the
# assets it lacks are linked from this checkout. The pair must be built already (PAIR_DIR, default
# /tmp/pair: run this on a warm machine after a command that built it) or is built first.
#
#   bash benchmarks/h200_ab_server.sh OUT_DIR A_TREE [ARMS] [CONCURRENCY] [ROUNDS]
#
# A_TREE may be this checkout (.) when the sides differ by their servers' flags only: A_SERVER_ARGS
# and B_SERVER_ARGS (default: SERVER_ARGS) go to each side's servers, as SERVER_ARGS does in
# h200_frontier.sh; e.g. A_SERVER_ARGS= B_SERVER_ARGS=--api-server-count=4.
#
# Defaults: arms adaptive:7,none,fixed:7 at 32,256, T = 0 (TEMPERATURE=1 for sampled), 2 rounds of 1 repeat each, 64 output
# tokens, WAVES=4 waves of C prompts per point, given to both sides (h200_frontier.sh's own default
# changed to 16 in 3d1c191: a side's tree from before it would otherwise run shorter points). Each side's sweep gets an equal share of the time left
# (BUDGET_S, as the other scripts) and is stopped in time. Writes OUT/ab_server.json (per side,
# arm and C: every point's output throughput, median per-user speed, median TTFT and tokens per
# chunk, and B / A of their means), OUT/ab_server.txt (that table), OUT/ab_server_log.txt and
# OUT/ab_server_points.tar.gz (every point's JSON, the server logs, the manifests).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: h200_ab_server.sh OUT_DIR A_TREE [ARMS] [CONCURRENCY] [ROUNDS]}
A_TREE=$(cd "${2:?the baseline tree (a directory holding adaspec/ and benchmarks/)}" && pwd)
ARMS=${3:-adaptive:7,none,fixed:7}
CONC=${4:-32,256}
ROUNDS=${5:-2}
TEMPERATURE=${TEMPERATURE:-0}
source benchmarks/h200_common.sh  # PYTHON, say, time_left, ensure_pair, install_server_wheels
B_TREE=$PWD
for f in adaspec/__init__.py benchmarks/h200_frontier.sh; do
  if [ ! -f "$A_TREE/$f" ]; then
    echo "h200_ab_server.sh: $A_TREE lacks $f" >&2
    exit 2
  fi
done
for d in models prompts; do  # what A lacks of the assets, from this checkout
  if [ ! -e "$A_TREE/adaspec/assets/$d" ]; then mkdir -p "$A_TREE/adaspec/assets"; ln -s "$B_TREE/adaspec/assets/$d" "$A_TREE/adaspec/assets/$d"; fi
done
mkdir -p "$OUT"
install_server_wheels
ensure_pair "$OUT"
RUNS=/tmp/adaspec-ab-server
rm -rf "$RUNS"
SWEEPS=$((2 * ROUNDS))
n=0
for round in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    tree=$A_TREE
    side_args=${A_SERVER_ARGS-${SERVER_ARGS:-}}
    if [ "$side" = B ]; then tree=$B_TREE; side_args=${B_SERVER_ARGS-${SERVER_ARGS:-}}; fi
    share=$(( ($(time_left) - ${RESERVE_S:-20}) / (SWEEPS - n) ))
    n=$((n + 1))
    if [ "$share" -lt 60 ]; then
      say "round $round, $side: ${share} s left for it, too little: stopping here"
      break 2
    fi
    say "round $round, $side ($tree; server flags: ${side_args:-none}): $share s"
    # the side's own scripts and package (its h200_common.sh puts its tree first on PYTHONPATH)
    (cd "$tree" && PAIR_DIR=${PAIR_DIR:-/tmp/pair} BUDGET_S=$share RESERVE_S=5 RUNS_DIR="$RUNS/${side}_$round" MODE=server \
      SERVER_ARGS="$side_args" WAVES=${WAVES:-4} \
      bash benchmarks/h200_frontier.sh "$RUNS/${side}_${round}_out" "$ARMS" "$CONC" "$TEMPERATURE" 1) >>"$OUT/ab_server_log.txt" 2>&1 \
      || { say "round $round, $side failed:"; tail -20 "$OUT/ab_server_log.txt"; }
  done
done
"$PYTHON" - "$RUNS" "$OUT" "$TEMPERATURE" <<'EOF'
import glob, json, os, statistics as st, sys
runs, out, temperature = sys.argv[1:4]
keys = ("output_throughput", "median_per_user_tok_s", "median_ttft_ms", "mean_tokens_per_chunk")
cells = {}
for path in sorted(glob.glob(f"{runs}/*_*/server_T{temperature}/points/*.json")):
    side_round = path[len(runs) + 1:].split("/")[0]
    side = side_round.split("_")[0]
    p = json.load(open(path))
    if not p.get("complete", True):
        continue
    cell = cells.setdefault(f"{p['arm']} C={p['concurrency']}", {"A": [], "B": []})
    cell[side].append({"round": side_round, **{k: p.get(k) for k in keys}})
table = {}
lines = [f"{'arm, C':<20}{'A out tok/s':>22}{'B out tok/s':>22}{'B/A':>6}{'A TTFT p50':>12}{'B TTFT p50':>12}"
         f"{'A user p50':>12}{'B user p50':>12}{'A tok/chunk':>12}{'B tok/chunk':>12}"]
for name in sorted(cells, key=lambda n: (int(n.split("C=")[1]), n)):
    cell = cells[name]
    def mean(side, k):
        xs = [r[k] for r in cell[side] if r[k] is not None]
        return (st.mean(xs), st.stdev(xs) if len(xs) > 1 else 0.0) if xs else (None, None)
    row = {side: {k: mean(side, k) for k in keys} for side in "AB"}
    a, b = row["A"]["output_throughput"][0], row["B"]["output_throughput"][0]
    ratio = b / a if a and b else None
    table[name] = {"points": cell, "mean_std": row, "B_over_A_output_throughput": ratio}
    f = lambda side, k, d=0: "-" if row[side][k][0] is None else f"{row[side][k][0]:.{d}f}"
    fs = lambda side: "-" if row[side]["output_throughput"][0] is None else \
        f"{row[side]['output_throughput'][0]:.0f} ± {row[side]['output_throughput'][1]:.0f} (n={len(cell[side])})"
    lines.append(f"{name:<20}{fs('A'):>22}{fs('B'):>22}{'-' if ratio is None else f'{ratio:.2f}':>6}"
                 f"{f('A', 'median_ttft_ms'):>12}{f('B', 'median_ttft_ms'):>12}{f('A', 'median_per_user_tok_s'):>12}"
                 f"{f('B', 'median_per_user_tok_s'):>12}{f('A', 'mean_tokens_per_chunk', 2):>12}{f('B', 'mean_tokens_per_chunk', 2):>12}")
json.dump({"temperature": float(temperature), "A_tree": os.environ.get("A_LABEL", "A"), "B_commit": os.environ.get("ADASPEC_COMMIT", ""),
           "A_server_args": os.environ.get("A_SERVER_ARGS", os.environ.get("SERVER_ARGS", "")),
           "B_server_args": os.environ.get("B_SERVER_ARGS", os.environ.get("SERVER_ARGS", "")),
           "cells": table}, open(f"{out}/ab_server.json", "w"), indent=1)
open(f"{out}/ab_server.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
tar -czf "$OUT/ab_server_points.tar.gz" -C "$RUNS" --exclude='*_out/pair.json' --exclude='*_out/heldout_blocks.npz' --exclude='*_out/*.tar.gz' . 2>/dev/null || true
say "done in $((SECONDS - T_START)) s"
