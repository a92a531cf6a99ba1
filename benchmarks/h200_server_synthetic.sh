#!/usr/bin/env bash
# Server variants compared on a Qwen3 shape with SYNTHETIC acceptance (timing only), without a pair
# build: every variant is a set of `adaspec serve` flags (e.g. the engine in a thread against
# `--engine-process`), and each runs `adaspec bench sweep` through real servers on random weights
# (load_format "dummy"; the tiny tokenizer turns the eval-code prompts into ids, so the shape's
# vocabulary must hold them), the speculative arms drawing acceptance from a measured curve.
#
#   bash benchmarks/h200_server_synthetic.sh OUT_DIR [SHAPE] [ARMS] [CONCURRENCY] [REPEATS]
#
# VARIANTS: "label=flag flag;label=flag" (default "thread=--no-engine-process;process=--engine-process"). Variants
# run in rounds (each variant's sweep once per round, ROUNDS default 1), each sweep given an equal
# share of the time left (BUDGET_S as in h200_common.sh). CURVE_FROM and SHAPE_OVERRIDES as in
# h200_synthetic_frontier.sh (default overrides: {"vocab_size": 16384}, the pair's vocabulary).
# OUTPUT_LEN (64), NUM_PROMPTS (at least C are sent), NUM_WARMUPS (8) as in h200_frontier.sh.
# Needs the server's wheels (benchmarks/fetch_server_wheels.sh, carry .whl). Writes
# OUT/<label>_r<round>.tar.gz (each sweep's points, server logs, report), OUT/variants.json and
# OUT/variants.txt (per variant, arm and concurrency: output tok/s and median per-user tok/s, mean
# ± std over repeats), and OUT/log.txt.
# CPU smoke test: DEVICE=cpu SHAPE_OVERRIDES='{"num_hidden_layers": 2, "hidden_size": 128, ...}'.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: h200_server_synthetic.sh OUT_DIR [SHAPE] [ARMS] [CONCURRENCY] [REPEATS]}
SHAPE=${2:-qwen3-0.6b}
ARMS=${3:-none,adaptive:7}
CONC=${4:-1,64,256}
REPEATS=${5:-2}
VARIANTS=${VARIANTS:-thread=--no-engine-process;process=--engine-process}
CURVE_FROM=${CURVE_FROM:-benchmarks/results/h200/run13/frontier_T0_afddb24/pair.json}
source benchmarks/h200_common.sh  # PYTHON, PYTHONPATH, say, time_left, install_server_wheels, sweep_then_report, collect
mkdir -p "$OUT"
install_server_wheels
MODEL_DIR=$("$PYTHON" - "$SHAPE" "${SHAPE_OVERRIDES:-{\"vocab_size\": 16384\}}" <<'EOF'
import json, sys, tempfile
sys.path.insert(0, "benchmarks")
from qwen3_shapes import write_shape
d = write_shape(sys.argv[1], tempfile.mkdtemp(prefix="adaspec-shape-"))
cfg = json.loads((d / "config.json").read_text())
cfg.update(json.loads(sys.argv[2]))
(d / "config.json").write_text(json.dumps(cfg, indent=2))
print(d)
EOF
)
SYN=$("$PYTHON" - "$CURVE_FROM" <<'EOF'
import json, sys
curve = json.load(open(sys.argv[1]))["heldout"]["T=0"]["cond_acceptance"]
print(json.dumps({"method": "synthetic", "synthetic_acceptance": [round(x, 4) for x in curve]}))
EOF
)
cp "$CURVE_FROM" "$OUT/pair.json"
MAXC=$(echo "$CONC" | tr ',' '\n' | sort -n | tail -1)
IFS=';' read -r -a VARS <<< "$VARIANTS"
RESERVE_S=${RESERVE_S:-40}  # what sweep_then_report keeps back, and the share below adds back
export RESERVE_S
RUNS=${RUNS_DIR:-/tmp/adaspec-runs}
for v in "${VARS[@]}"; do
  if [[ "$v" != *=* || -z "${v%%=*}" ]]; then
    echo "h200_server_synthetic.sh: each variant is LABEL=FLAGS (FLAGS may be empty), got '$v' in VARIANTS" >&2
    exit 2
  fi
  rm -rf "$RUNS/${v%%=*}"_r*  # an earlier run's rounds (a warm machine keeps /tmp) must not join this table
done
say "shape $SHAPE at $MODEL_DIR; $SYN (timing only); variants: ${VARS[*]}"
ROUNDS=${ROUNDS:-1}
N_SWEEPS=$(( ROUNDS * ${#VARS[@]} ))
i=0
for round in $(seq 1 "$ROUNDS"); do
  for v in "${VARS[@]}"; do
    label=${v%%=*}
    flags=${v#*=}
    args=()
    for f in $flags; do args+=("--server-arg=$f"); done
    # an equal share of what is left for each sweep still to run (the last gets the rest)
    share=$(( ($(time_left) - RESERVE_S) / (N_SWEEPS - i) + RESERVE_S ))
    dir=$RUNS/${label}_r${round}
    rm -rf "$dir"
    say "round $round, variant $label ($flags), ~$share s"
    BUDGET_S=$(( SECONDS - T_START + share )) sweep_then_report "$dir" --model "$MODEL_DIR" --tokenizer tiny \
      --arms "$ARMS" --concurrency "$CONC" --repeats "$REPEATS" --temperature 0 \
      --output-len "${OUTPUT_LEN:-64}" --ignore-eos --num-prompts "${NUM_PROMPTS:-32}" --num-warmups "${NUM_WARMUPS:-8}" \
      --speculative-config-extra "$SYN" --server-arg=--load-format=dummy --server-arg=--tokenizer=tiny \
      --server-arg=--max-num-seqs="$MAXC" --server-arg=--device="${DEVICE:-cuda}" "${args[@]}" \
      --startup-timeout 240 >>"$OUT/log.txt" 2>&1
    collect "$dir" "$OUT" "${label}_r${round}"
    rm -f "$OUT/${label}_r${round}_report.md" "$OUT/${label}_r${round}_frontier.png"  # both inside the tar
    i=$((i + 1))
  done
done
"$PYTHON" - "$RUNS" "$OUT" "$VARIANTS" <<'EOF' | tee "$OUT/variants.txt"
import json, sys
from pathlib import Path
from adaspec.bench.aggregate import aggregate, load_points
runs, out, variants = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
labels = [v.split("=", 1)[0] for v in variants.split(";")]
keys = ("output_throughput", "median_per_user_tok_s", "spec_mean_accepted_length")
rows = []
for label in labels:  # every round of a variant pooled: its repeats
    points = [p for d in sorted(runs.glob(f"{label}_r*")) for p in load_points(d)]
    for (arm, c), cell in aggregate(points).items():
        rows.append(dict(variant=label, arm=arm, concurrency=c, n=cell.n, failed=cell.failed,
                         **{k: [cell.mean.get(k), cell.std.get(k)] for k in keys}))
rows.sort(key=lambda r: (r["arm"], r["concurrency"], labels.index(r["variant"])))
f = lambda v, d=1: "-" if v[0] is None else f"{v[0]:.{d}f} ± {(v[1] or 0):.{d}f}"
print(f"{'variant':10s} {'arm':12s} {'C':>5s} {'n':>3s} {'out tok/s':>20s} {'user tok/s p50':>18s} {'acc len':>14s}")
for r in rows:
    print(f"{r['variant']:10s} {r['arm']:12s} {r['concurrency']:5d} {r['n']:3d} {f(r['output_throughput']):>20s} "
          f"{f(r['median_per_user_tok_s']):>18s} {f(r['spec_mean_accepted_length'], 2):>14s}")
json.dump(dict(synthetic_acceptance="timing only", variants=variants, rows=rows), open(out / "variants.json", "w"), indent=1)
EOF
say "done in $((SECONDS - T_START)) s"
