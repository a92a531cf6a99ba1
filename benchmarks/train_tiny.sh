#!/usr/bin/env bash
# The recipe of adaspec's embedded default model `tiny` (adaspec/assets/models/tiny).
#
#   bash benchmarks/train_tiny.sh prepare        # CPU machine: corpus from THIS python's stdlib, tokenizer
#                                                #   (kept if committed), token cache, eval-code prompts
#   bash benchmarks/train_tiny.sh gpu OUT        # GPU machine: train a few token budgets / learning rates
#                                                #   side by side on one GPU, keep the best validation loss,
#                                                #   write it to OUT/tiny and the comparison to OUT/sweep.json
#   bash benchmarks/train_tiny.sh ship OUT/tiny  # copy the chosen model into the package, write MODEL_CARD.md
#
# The GPU stage needs only runs/tiny/gpu-corpus (token cache + corpus stats, ~16 MB) and the
# committed tokenizer: carry that folder to the GPU machine. Overrides: WORK, BUDGET (seconds
# per arm), ARMS ("name:tokens:lr ..."), EXTRA (arguments appended to every `train target`).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/tiny}
TINY=adaspec/assets/models/tiny
PY=${PYTHON:-python3}
A="$PY -m adaspec.cli"
SHAPE="--arch qwen3 --layers 6 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64 --intermediate 768 --max-position 2048"
OPT="--seq-len 512 --batch-size 128 --warmup 150 --weight-decay 0.1 --grad-clip 1.0 --min-lr-ratio 0.1"

case "${1:-}" in
prepare)
  $A train corpus --out "$WORK/corpus"
  if [ ! -f "$TINY/tokenizer.json" ] || [ "${RETRAIN_TOKENIZER:-0}" = 1 ]; then
    $A train tokenizer --corpus "$WORK/corpus" --vocab-size 8192 --out "$TINY"
  fi
  $PY -c "from adaspec.train.data import load_tokens as f; f('$WORK/corpus', '$TINY', ('train', 'val'))"
  rm -rf "$WORK/gpu-corpus" && mkdir -p "$WORK/gpu-corpus/tokens"
  cp "$WORK/corpus/stats.json" "$WORK/gpu-corpus/"
  cp "$WORK/corpus/tokens/"* "$WORK/gpu-corpus/tokens/"
  $A train prompts --corpus "$WORK/corpus" --tokenizer "$TINY" --out adaspec/assets/prompts/eval-code.jsonl
  du -sh "$WORK/gpu-corpus"
  ;;
gpu)
  OUT=${2:?usage: train_tiny.sh gpu OUT}
  SWEEP=${SWEEP:-/tmp/tiny-sweep}
  mkdir -p "$SWEEP" "$OUT"
  T0=$SECONDS
  CORPUS=${CORPUS:-$WORK/gpu-corpus}
  for arm in ${ARMS:-a:60e6:2e-3 b:120e6:2e-3 c:240e6:2e-3 d:120e6:4e-3}; do
    IFS=: read -r name tokens lr <<<"$arm"
    # shellcheck disable=SC2086
    $A train target --corpus "$CORPUS" --tokenizer "$TINY" --out "$SWEEP/$name" $SHAPE $OPT \
      --tokens "$tokens" --lr "$lr" --eval-every 200 --eval-tokens 262144 --compile --seed 0 \
      --save-dtype bfloat16 --time-budget "${BUDGET:-300}" ${EXTRA:-} >"$SWEEP/$name.log" 2>&1 &
  done
  wait || true
  export SWEEP_WALL_S=$((SECONDS - T0))
  for f in "$SWEEP"/*.log; do echo "== $f"; tr '\r' '\n' <"$f" | grep -E "^(step|done|--time|compiled|torch|Traceback|[A-Za-z]*Error)" || tail -5 "$f"; done
  $PY - "$SWEEP" "$OUT" <<'EOF'
import json, shutil, sys
from pathlib import Path
sweep, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {d.name: json.loads((d / "train_stats.json").read_text()) for d in sorted(sweep.iterdir())
        if (d / "train_stats.json").is_file()}
if not runs:
    sys.exit("no arm finished")
keys = ("val_loss", "val_ppl", "train_eval_loss", "kept_step", "steps", "tokens_seen", "epochs", "wall_time_s",
        "tokens_per_s", "compiled", "device", "command")
summary = {n: {k: s[k] for k in keys} | {"lr": s["hyperparameters"]["lr"]} for n, s in runs.items()}
best = min(runs, key=lambda n: runs[n]["val_loss"])
(out / "tiny").mkdir(parents=True, exist_ok=True)
for f in (sweep / best).iterdir():
    if f.is_file() and f.name != "checkpoint.pt":
        shutil.copyfile(f, out / "tiny" / f.name)
import os
(out / "sweep.json").write_text(json.dumps({"chosen": best, "rule": "lowest validation loss", "arms": summary,
                                            "sweep_wall_s": int(os.environ["SWEEP_WALL_S"])}, indent=2) + "\n")
for n, s in summary.items():
    print(f"{'*' if n == best else ' '} {n}: lr {s['lr']} tokens {s['tokens_seen'] / 1e6:.0f}M ({s['epochs']:.1f} ep) "
          f"val {s['val_loss']:.4f} ppl {s['val_ppl']:.2f} train {s['train_eval_loss']:.4f} "
          f"kept {s['kept_step']}/{s['steps']} {s['wall_time_s']:.0f}s {s['tokens_per_s']:,} tok/s "
          f"{'compiled' if s['compiled'] else 'eager'} {s['device']}")
EOF
  ;;
ship)
  SRC=${2:?usage: train_tiny.sh ship DIR}
  cmp "$SRC/tokenizer.json" "$TINY/tokenizer.json"
  for f in config.json model.safetensors generation_config.json train_stats.json; do cp "$SRC/$f" "$TINY/$f"; done
  RECIPE=$(mktemp)
  {
    echo "bash benchmarks/train_tiny.sh prepare        # corpus, tokenizer, token cache, prompts (CPU)"
    echo "bash benchmarks/train_tiny.sh gpu OUT        # the sweep below, best validation loss kept (1 GPU)"
    echo "bash benchmarks/train_tiny.sh ship OUT/tiny  # into adaspec/assets/models/tiny, this card"
    if [ -f "$SRC/../sweep.json" ]; then
      $PY -c "
import json, sys
s = json.load(open(sys.argv[1]))
print('# sweep, run side by side on one GPU; chosen by', s['rule'] + ':', s['chosen'])
if 'sweep_wall_s' in s:
    print(f\"#   whole sweep: {s['sweep_wall_s']} s on the GPU (all arms at once, compile included)\")
for n, a in s['arms'].items():
    print(f\"#   {n}: lr {a['lr']}, {a['tokens_seen'] / 1e6:.0f}M tokens -> val {a['val_loss']:.4f} (kept step {a['kept_step']}/{a['steps']})\")
" "$SRC/../sweep.json"
    fi
  } >"$RECIPE"
  $A train card --model "$TINY" --name tiny --recipe "$RECIPE"
  rm -f "$RECIPE"
  du -sh "$TINY"
  ;;
*)
  sed -n '2,14p' "$0"
  exit 2
  ;;
esac
