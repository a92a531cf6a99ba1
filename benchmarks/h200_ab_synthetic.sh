#!/usr/bin/env bash
# A/B of two versions of the engine in one device command: the synthetic-acceptance offline sweep
# (timing only: a Qwen3 shape on random weights, acceptance drawn from the pair's measured curve)
# run alternately by a baseline tree (A) and by this checkout (B), so that both see the same GPU,
# the same minute and the same inputs. A is any directory holding another version's `adaspec/`
# package (e.g. `git archive OLD adaspec | tar -x -C /tmp/old`; the package's assets are taken
# from this checkout when A lacks them).
#
#   bash benchmarks/h200_ab_synthetic.sh OUT_DIR A_TREE [SHAPE] [ARMS] [CONCURRENCY] [ROUNDS]
#
# Defaults: qwen3-0.6b, fixed:7,adaptive:7 at 64,256, T = 0, 2 rounds (A, B, A, B; 2 repeats per
# sweep), 64 output tokens. TEMP=1 runs the requests at T = 1, with the pair's T = 1 curve (the
# drafter then samples its drafts). Writes OUT/ab_A_<round>.json, OUT/ab_B_<round>.json and OUT/ab.json
# (per arm and concurrency: A and B's mean output throughput and median per-user speed over every
# repeat, with their standard deviations, and B / A), and prints that table; the sweeps' output in
# OUT/ab_log.txt.
# A_ENV / B_ENV: environment assignments for one side's sweeps only, e.g. A_TREE=. A_ENV=ADASPEC_FUSED_MARKOV=0
# B_ENV=ADASPEC_FUSED_MARKOV=1 times one switch of this checkout against itself.
# A_LABEL / B_LABEL name the versions in the table; A_COMMIT is recorded in A's results (B's: ADASPEC_COMMIT); CURVE_FROM as in
# h200_synthetic_frontier.sh; SHAPE_OVERRIDES (e.g. '{"vocab_size": 16384}') and OFFLINE_ARGS are passed to both
# (run 12's A/B ran before the script passed SHAPE_OVERRIDES on: it timed the 151,936 vocabulary).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: h200_ab_synthetic.sh OUT_DIR A_TREE [SHAPE] [ARMS] [CONCURRENCY] [ROUNDS]}
A_TREE=$(cd "${2:?the baseline tree (a directory holding adaspec/)}" && pwd)
SHAPE=${3:-qwen3-0.6b}
ARMS=${4:-fixed:7,adaptive:7}
CONC=${5:-64,256}
ROUNDS=${6:-2}
CURVE_FROM=${CURVE_FROM:-benchmarks/results/h200/run16/frontier_T0_7443c18/pair.json}
source benchmarks/h200_common.sh  # PYTHON, PYTHONPATH, say
B_TREE=$PWD
if [ ! -f "$A_TREE/adaspec/__init__.py" ]; then
  echo "h200_ab_synthetic.sh: $A_TREE holds no adaspec/ package" >&2
  exit 2
fi
for d in models prompts; do  # what A lacks of the assets (a tree made without them), from this checkout
  if [ ! -d "$A_TREE/adaspec/assets/$d" ]; then mkdir -p "$A_TREE/adaspec/assets"; cp -r "adaspec/assets/$d" "$A_TREE/adaspec/assets/"; fi
done
mkdir -p "$OUT"
CURVE=$("$PYTHON" -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(','.join('%.4f' % x for x in d['heldout']['T=%g' % float(sys.argv[2])]['cond_acceptance']))" "$CURVE_FROM" "${TEMP:-0}")
say "A = $A_TREE${A_ENV:+ with $A_ENV} (${A_LABEL:-A}), B = $B_TREE${B_ENV:+ with $B_ENV} (${B_LABEL:-B}); T = ${TEMP:-0}, synthetic acceptance (timing only) $CURVE"
for round in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    tree=$A_TREE commit="${A_COMMIT:-unrecorded (tree $A_TREE)}" side_env=${A_ENV:-}
    if [ "$side" = B ]; then tree=$B_TREE commit="${ADASPEC_COMMIT:-}" side_env=${B_ENV:-}; fi
    say "round $round, $side"
    # the sweep script of this checkout, the engine of the side's tree (first on the path)
    # shellcheck disable=SC2086  # side_env: word-split into VAR=value assignments on purpose
    env $side_env ADASPEC_COMMIT="$commit" PYTHONPATH="$tree" "$PYTHON" benchmarks/offline_sweep.py --shape "$SHAPE" --synthetic-acceptance "$CURVE" \
      --arms "$ARMS" --concurrency "$CONC" --temperature "${TEMP:-0}" --repeats 2 --output-len 64 \
      ${SHAPE_OVERRIDES:+--shape-overrides "$SHAPE_OVERRIDES"} ${OFFLINE_ARGS:-} \
      --out "$OUT/ab_${side}_${round}.json" >>"$OUT/ab_log.txt" 2>&1 \
      || { tail -20 "$OUT/ab_log.txt"; exit 1; }
  done
done
"$PYTHON" - "$OUT" "${A_LABEL:-A}" "${B_LABEL:-B}" "${TEMP:-0}" <<'EOF'
import glob, json, os, statistics as st, sys
out, a_label, b_label = sys.argv[1:4]
vals = {}
for side in "AB":
    for f in sorted(glob.glob(f"{out}/ab_{side}_*.json")):
        for r in json.load(open(f))["rows"]:
            v = vals.setdefault((r["arm"], r["concurrency"]), {"A": ([], []), "B": ([], [])})[side]
            v[0].append(r["output_throughput"])
            v[1].append(r["median_user_speed"])
ms = lambda xs: [st.mean(xs), st.stdev(xs) if len(xs) > 1 else 0.0]
table = []
print(f"{'arm':12s} {'conc':>5s} {'A out tok/s':>18s} {'B out tok/s':>18s} {'B/A':>6s} {'A user':>8s} {'B user':>8s}")
for (arm, c), v in sorted(vals.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    if not v["A"][0] or not v["B"][0]:
        continue
    a, b = ms(v["A"][0]), ms(v["B"][0])
    au, bu = ms(v["A"][1]), ms(v["B"][1])
    table.append(dict(arm=arm, concurrency=c, n=[len(v["A"][0]), len(v["B"][0])], A_output_throughput=a,
                      B_output_throughput=b, ratio=b[0] / a[0], A_median_user_speed=au, B_median_user_speed=bu))
    print(f"{arm:12s} {c:5d} {a[0]:10.0f} ± {a[1]:5.0f} {b[0]:10.0f} ± {b[1]:5.0f} {b[0] / a[0]:6.3f} {au[0]:8.1f} {bu[0]:8.1f}")
json.dump(dict(A=a_label, B=b_label, A_env=os.environ.get("A_ENV", ""), B_env=os.environ.get("B_ENV", ""), temperature=float(sys.argv[4]), synthetic_acceptance="timing only", rows=table), open(f"{out}/ab.json", "w"), indent=1)
EOF
