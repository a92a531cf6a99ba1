#!/usr/bin/env bash
# Drafter recipe variants on one build of the pair, on one H200: which change to the drafter's
# recipe buys held-out acceptance, with the target, the corpus and the eval prompts held fixed.
#
#   VARIANTS="LABEL=SECTION.KEY=VALUE,SECTION.KEY=VALUE;LABEL2=..." \
#     bash benchmarks/h200_drafter_variants.sh OUT [-- extra `adaspec train pair` arguments]
#
# BASE (default /tmp/pair) is the build the variants start from: built by build_pair_h200.sh when
# absent (a device call issued within ~30 s of the previous one lands on the same warm machine and
# still has it). Each variant is a copy of BASE in VARIANT_ROOT/LABEL (default /tmp/pair-LABEL),
# rebuilt with `adaspec train pair --restart-from STAGE --set ...` from the first stage its settings
# touch: selfdistill when a key is one the self-distilled data depend on (adaspec/train/pair.py,
# SELF_DISTILL_KEYS), else drafter (only drafter.* keys are accepted: a target change is a new build).
# Every later stage runs as the preset has it (calibration, the held-out eval on the same 250
# eval-code prompts, the cards), so a variant is exactly what the preset would build with its sets.
# A variant that would not finish in the command's budget (BUDGET_S, default 570; EST_S per
# variant, default 230) is skipped and said so. The variants stay on the machine for a following
# command, e.g. `PAIR_DIR=/tmp/pair-LABEL bash benchmarks/h200_frontier.sh $OUT`.
#
# Writes OUT/variants.json (BASE and each variant: its sets, stage seconds, held-out tau, decoding
# walk, conditional acceptance and ECE per temperature, the drafter's steps, final loss and training
# acceptance), OUT/variants.txt (the table, also printed) and OUT/variants_logs.tar.gz (each build's
# pair.json, log, held-out eval and training log). Two builds of the same preset differ
# by ~3% in held-out tau (BENCHMARKS.md, run 8): a smaller difference between variants is noise.
# REQUIRE_PAIR=1: exit 4 at once when BASE holds no build, rather than building it (a command sized
# for the variants alone). PRESET / DEVICE (default code-0.6b / cuda) let the script run on a CPU
# at micro size (its test).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: VARIANTS="LABEL=SECTION.KEY=VALUE,...;..." h200_drafter_variants.sh OUT [-- extra train pair args]}
shift
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
: "${VARIANTS:?VARIANTS is empty: give LABEL=SECTION.KEY=VALUE[,SECTION.KEY=VALUE...] items separated by ;}"
source benchmarks/h200_common.sh
BASE=${BASE:-/tmp/pair}
ROOT=${VARIANT_ROOT:-/tmp}
EST_S=${EST_S:-230}
PRESET=${PRESET:-code-0.6b}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"

# check every variant before the minutes of a build are spent
SELF_DISTILL_KEYS=$("$PYTHON" -c "from adaspec.train.pair import SELF_DISTILL_KEYS; print(' '.join(SELF_DISTILL_KEYS))")
declare -a LABELS=() STARTS=() SETS=()
IFS=';' read -r -a ITEMS <<< "$VARIANTS"
for item in "${ITEMS[@]}"; do
  [ -n "$item" ] || continue
  label=${item%%=*}
  sets=${item#*=}
  if [ "$label" = "$item" ] || [ -z "$label" ] || [ -z "$sets" ] || [[ ! "$label" =~ ^[A-Za-z0-9_.-]+$ ]]; then
    echo "h200_drafter_variants: variant '$item': expected LABEL=SECTION.KEY=VALUE[,...] (LABEL of letters, digits, _ . -)" >&2
    exit 2
  fi
  start=drafter
  IFS=',' read -r -a KV <<< "$sets"
  for kv in "${KV[@]}"; do
    key=${kv%%=*}
    if [[ "$key" != drafter.* ]] || [ "$key" = "$kv" ]; then
      echo "h200_drafter_variants: variant $label: '$kv' is not drafter.KEY=VALUE (a change before the drafter is a new build)" >&2
      exit 2
    fi
    for sd in $SELF_DISTILL_KEYS; do [ "${key#drafter.}" = "$sd" ] && start=selfdistill; done
  done
  LABELS+=("$label"); STARTS+=("$start"); SETS+=("$sets")
done

if [ ! -f "$BASE/pair.json" ] || [ ! -d "$BASE/drafter" ]; then
  # REQUIRE_PAIR=1 (h200_common.sh): a command sized for variants only landed on a fresh machine
  # (H200 run 33: a call sent at once after the build still got one, rebuilt the base for 400 s
  # and was killed at its limit with nothing returned)
  if [ "${REQUIRE_PAIR:-}" = 1 ]; then
    echo "h200_drafter_variants: no built pair in $BASE (a fresh machine?): REQUIRE_PAIR=1 stops here" \
      "instead of spending ~450 s on a base build the command was not sized for" >&2
    exit 4
  fi
  say "building the base pair in $BASE"
  PRESET=$PRESET DEVICE=$DEVICE bash benchmarks/build_pair_h200.sh "$BASE" -- "$@" | tail -4
fi
"$PYTHON" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['complete'] else 1)" "$BASE/pair.json" \
  || { echo "h200_drafter_variants: $BASE/pair.json: the base build is not complete" >&2; exit 3; }

DONE=("base=$BASE")
for i in "${!LABELS[@]}"; do
  label=${LABELS[$i]}; dir=$ROOT/pair-$label
  if [ "$(time_left)" -lt "$EST_S" ]; then
    say "variant $label skipped: $(time_left) s left, a variant takes ~$EST_S s"
    continue
  fi
  rm -rf "$dir"
  cp -a "$BASE" "$dir"
  args=()
  IFS=',' read -r -a KV <<< "${SETS[$i]}"
  for kv in "${KV[@]}"; do args+=(--set "$kv"); done
  say "variant $label: ${SETS[$i]} (from stage ${STARTS[$i]}) in $dir"
  if "$PYTHON" -m adaspec.cli train pair --preset "$PRESET" --out "$dir" --device "$DEVICE" \
       --restart-from "${STARTS[$i]}" "${args[@]}" "$@" > "$dir/variant.log" 2>&1; then :
  else
    say "variant $label FAILED (exit $?); the last lines of its log:"; tail -5 "$dir/variant.log"
  fi
  DONE+=("$label=$dir")  # tabled either way: a failed build's pair.json names the failed stage
  say "variant $label done"
done

"$PYTHON" - "$OUT" "$VARIANTS" "${DONE[@]}" <<'EOF'
import json, sys
from pathlib import Path

out, spec, entries = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
sets = {it.split("=", 1)[0]: it.split("=", 1)[1] for it in spec.split(";") if it}
rows, lines = [], []
hdr = (f"{'variant':<12} {'sets':<44} {'steps':>6} {'loss':>6} {'build s':>8} "
       f"{'tau T0':>7} {'walk T0':>7} {'tau T1':>7} {'walk T1':>7} {'ECE T0/T1':>11} {'rows s1 h/t':>11}  "
       "cond. acceptance T0")
lines.append(hdr)
for e in entries:
    label, d = e.split("=", 1)
    s = json.loads((Path(d) / "pair.json").read_text())
    h, dr = s.get("heldout") or {}, s.get("drafter") or {}
    rec = {"variant": label, "sets": sets.get(label, "(the preset)"), "dir": d, "complete": s["complete"],
           "failed": s.get("failed"), "stage_seconds": s["stage_seconds"], "drafter": dr,
           "heldout": h, "target_val_loss": (s.get("target") or {}).get("val_loss")}
    rows.append(rec)
    t0, t1 = h.get("T=0", {}), h.get("T=1", {})
    f = lambda r, k: f"{r[k]:.3f}" if r.get(k) is not None else "-"
    sec = sum(v for k, v in s["stage_seconds"].items()) if label == "base" else \
        sum(v for k, v in s["stage_seconds"].items() if k not in ("corpus", "tokenizer", "target"))
    ece = f"{t0.get('ece_calibrated', float('nan')):.3f}/{t1.get('ece_calibrated', float('nan')):.3f}"
    # --heldout-rows: slot 1's soft acceptance on held-out against training self-distilled rows
    rows_s1 = (f"{dr['rows_heldout']['accept'][0]:.2f}/{dr['rows_train']['accept'][0]:.2f}"
               if dr.get("rows_heldout") else "-")
    lines.append(f"{label:<12} {rec['sets'][:44]:<44} {dr.get('steps', '-'):>6} "
                 f"{dr.get('final_loss', float('nan')):>6.3f} {sec:>8.0f} {f(t0, 'tau'):>7} {f(t0, 'tau_walk'):>7} "
                 f"{f(t1, 'tau'):>7} {f(t1, 'tau_walk'):>7} {ece:>11} {rows_s1:>11}  "
                 + " ".join(f"{a:.2f}" for a in t0.get("cond_acceptance", []))
                 + ("" if s["complete"] else f"  INCOMPLETE ({(s.get('failed') or {}).get('stage', '?')})"))
lines.append("rows s1 h/t: slot 1's soft acceptance on held-out / training self-distilled rows (--heldout-rows)")
lines.append("build s: the whole build for base, the stages rebuilt for a variant; target val loss "
             f"{rows[0]['target_val_loss']}; two builds of one preset differ by ~3% in tau")
(out / "variants.json").write_text(json.dumps(rows, indent=2) + "\n")
(out / "variants.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

# each build's own files, small: pair.json, logs, the held-out eval (and its walk's blocks) and the training log
STAGE=$(mktemp -d)
for e in "${DONE[@]}"; do
  label=${e%%=*}; dir=${e#*=}
  for f in pair.json variant.log build.log drafter/eval.json drafter/heldout_blocks.npz drafter/train_log.jsonl; do
    if [ -f "$dir/$f" ]; then mkdir -p "$STAGE/$label/$(dirname "$f")"; cp "$dir/$f" "$STAGE/$label/$f"; fi
  done
done
tar czf "$OUT/variants_logs.tar.gz" -C "$STAGE" .
rm -rf "$STAGE"
