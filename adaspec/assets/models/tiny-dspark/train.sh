#!/usr/bin/env bash
# How the shipped tiny-dspark drafter was made (run from the repository root, one GPU).
# Every size is an environment variable, so the very same script runs at micro size on a CPU.
#   self-distill -> train (time-boxed) -> calibrate (STS at T=1 and T=0, val-split prompts) -> eval (eval-code)
set -euo pipefail
PY=${PY:-python3}
TARGET=${TARGET:-tiny}
CORPUS=${CORPUS:-runs/corpus}      # `adaspec train corpus` output; only tokens/{train,val}.npy are read
WORK=${WORK:-/tmp/tiny-dspark}
SD_SEQS=${SD_SEQS:-12288}          # self-distilled sequences
CORPUS_FRAC=${CORPUS_FRAC:-0.25}   # share of each batch from corpus text (real code, as in prompts)
LR=${LR:-1e-3}
SD_BATCH=${SD_BATCH:-2048}
SEQ_LEN=${SEQ_LEN:-512}
BATCH=${BATCH:-64}
ANCHORS=${ANCHORS:-64}
LAYERS=${LAYERS:-2}
RANK=${RANK:-64}
STEPS=${STEPS:-20000}              # upper bound; --max-minutes decides
MAX_MIN=${MAX_MIN:-3.5}
CAL_N=${CAL_N:-400}
EVAL_N=${EVAL_N:-500}
GEN=${GEN:-128}
EVAL_BATCH=${EVAL_BATCH:-32}
mkdir -p "$WORK"
$PY -m adaspec.cli train drafter --target "$TARGET" --corpus "$CORPUS" --self-distill --sd-num-seqs "$SD_SEQS" \
  --sd-prompt-len 64 --sd-batch "$SD_BATCH" --sd-greedy-frac 0.25 --corpus-frac "$CORPUS_FRAC" --out "$WORK" --block-size 7 --layers "$LAYERS" \
  --markov-rank "$RANK" --seq-len "$SEQ_LEN" --batch-size "$BATCH" --anchors-per-seq "$ANCHORS" --steps "$STEPS" \
  --max-minutes "$MAX_MIN" --lr "$LR" --log-every 100 --save-every 1000
# held-out calibration prompts: windows of the corpus's val split (the eval prompts come from test)
$PY -c "import numpy as np; from adaspec.train.drafter_data import prompt_windows as w; \
np.save('$WORK/calib-prompts.npy', w(np.load('$CORPUS/tokens/val.npy'), $CAL_N, 128, seed=1).numpy())"
$PY -m adaspec.cli train calibrate --target "$TARGET" --drafter "$WORK" --prompts "$WORK/calib-prompts.npy" \
  --num-prompts "$CAL_N" --gen-len "$GEN" --temperature 1 --batch-size "$EVAL_BATCH"
# a second set for greedy requests (their acceptance is an argmax match, not 1 - TV)
$PY -m adaspec.cli train calibrate --target "$TARGET" --drafter "$WORK" --prompts "$WORK/calib-prompts.npy" \
  --num-prompts "$CAL_N" --gen-len "$GEN" --temperature 0 --batch-size "$EVAL_BATCH"
$PY -m adaspec.cli eval drafter --target "$TARGET" --drafter "$WORK" --prompts eval-code --num-prompts "$EVAL_N" \
  --gen-len "$GEN" --batch-size "$EVAL_BATCH" --json "$WORK/eval.json"
