#!/usr/bin/env bash
# Build the code-0.6b target and its DSpark drafter on one H200, from nothing, in one command.
#
#   bash benchmarks/build_pair_h200.sh DIR [FIGURES] [-- extra `adaspec train pair` arguments]
#
# DIR receives the whole build (corpus, tokenizer, DIR/target, DIR/drafter, manifests, pair.json,
# build.log); the pair is then usable in the same command:
#   LLM("DIR/target", speculative_config={"method": "dspark", "model": "DIR/drafter"})
# FIGURES (optional, e.g. "$OUT/pair" under the device tool) receives the small files only: pair.json
# (settings, stage timings, held-out acceptance, target loss), both model cards, eval / calibration /
# training figures and the log; the weights (~1 GB) stay in DIR. Extra arguments after `--` go to
# `adaspec train pair`, e.g. `-- --set target.layers=12`.
#
# The GPU machine keeps nothing between commands, so a command that measures the pair rebuilds it
# first (sized for ~5 minutes: adaspec/train/pair_presets.py has the arithmetic). Runs under the
# machine's /opt/torch/.venv/bin/python3 (torch 2.11) with this checkout on PYTHONPATH; needs
# nothing that is not there (no fastapi/uvicorn: the train path does not import the server).
# PRESET / DEVICE (default code-0.6b / cuda) exist so the script itself can be tested on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: build_pair_h200.sh DIR [FIGURES] [-- extra args]}
shift
FIGS=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then FIGS=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PYTHON=/opt/torch/.venv/bin/python3; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PRESET=${PRESET:-code-0.6b}
DEVICE=${DEVICE:-cuda}
mkdir -p "$DIR"

# fail in seconds, not minutes, when the machine is not what the build needs
DEVICE=$DEVICE "$PYTHON" - <<'EOF'
import importlib, os, sys
missing = [m for m in ("torch", "numpy", "tokenizers", "safetensors", "tqdm", "matplotlib")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"build_pair_h200: missing Python packages: {', '.join(missing)}")
import torch
cuda = os.environ["DEVICE"].startswith("cuda")
if cuda and not torch.cuda.is_available():
    sys.exit("build_pair_h200: torch sees no CUDA device")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"{torch.cuda.get_device_name(0) if cuda else 'cpu'}", flush=True)
EOF

T0=$SECONDS
set +e
"$PYTHON" -m adaspec.cli train pair --preset "$PRESET" --out "$DIR" --device "$DEVICE" "$@" 2>&1 | tee "$DIR/build.log"
RC=${PIPESTATUS[0]}
set -e
echo "build_pair_h200: exit $RC after $((SECONDS - T0)) s"

if [ -n "$FIGS" ]; then
  mkdir -p "$FIGS"
  for f in pair.json recipe.txt build.log target/MODEL_CARD.md target/train_stats.json drafter/MODEL_CARD.md \
           drafter/config.json drafter/eval.json drafter/calibration.json drafter/calibration-greedy.json \
           drafter/calibration.png drafter/calibration-greedy.png drafter/train_log.jsonl corpus/stats.json; do
    if [ -f "$DIR/$f" ]; then mkdir -p "$FIGS/$(dirname "$f")"; cp "$DIR/$f" "$FIGS/$f"; fi
  done
  cp -r "$DIR/manifest" "$FIGS/" 2>/dev/null || true
fi

if [ -f "$DIR/pair.json" ]; then
  # the last lines: stage timings and held-out figures (also printed by the command itself)
  "$PYTHON" -c "import json, sys; from adaspec.train.pair import format_summary; \
print(format_summary(json.load(open(sys.argv[1]))))" "$DIR/pair.json"
fi
exit "$RC"
