#!/usr/bin/env bash
# One device call: the GPU suite at this tree, then what ruled (penalties, logit_bias, min_tokens)
# and structured requests cost against plain ones (benchmarks/logits_rules_bench.py, tiny pair),
# for this tree and, in the same process order on the same machine, for an older one: the A/B that
# H100 run 46 could not make after ee62ee6 (the penalties' counts as pooled rows) for want of a machine.
#
#   git archive OLD_SHA adaspec | tar -x -C .ab/old      # here, before the call (.ab ignored;
#   rm -r .ab/old/adaspec/assets && ln -s ../../../adaspec/assets .ab/old/adaspec/assets   # 28 MB saved)
#   OLD_SHA=e6304eb NEW_SHA=$(git rev-parse --short HEAD) bash benchmarks/gpu_rules_ab.sh   # on the device,
#       carry [".whl/llg", ".ab"]
#
# DEVICE=cpu (with BENCH_ARGS="--requests 4 --max-tokens 8 --repeats 1": the rule has min_tokens 8) runs it
# here as a smoke test (tests/bench/test_gpu_scripts.py).
# Writes to $OUT: gpu.txt, gpu_suite.txt, lr_new.json/.txt, lr_old.json/.txt (at most 8 files).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/llg/llguidance*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/llg/llguidance*.whl
fi
SITE=/tmp/site
nvidia-smi --query-gpu=name,driver_version,uuid --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
# SUITE_TESTS: where the suite looks (the CPU smoke test names one file: collecting the whole tree
# there cost it most of its time)
# shellcheck disable=SC2086
PYTHONPATH=$PWD:$SITE timeout "${SUITE_S:-330}" python3 -m pytest -q -m gpu ${SUITE_TESTS:-tests} --ignore=tests/serve \
  --ignore=tests/distributed/test_tp_serve.py -p no:cacheprovider -rfE --tb=short > "$OUT/gpu_suite.txt" 2>&1
echo "GPU suite rc=$?"; grep -v -i warn "$OUT/gpu_suite.txt" | tail -4
ARGS=${BENCH_ARGS:---requests 64 --max-tokens 64 --repeats 3}
for side in new old; do
  if [ "$side" = old ]; then
    [ -d "${OLD_TREE:-.ab/old}/adaspec" ] || { echo "no ${OLD_TREE:-.ab/old}/adaspec: the old side is skipped"; break; }
    P=$PWD/${OLD_TREE:-.ab/old}; C=${OLD_SHA:-old}
  else
    P=$PWD; C=${NEW_SHA:-new}
  fi
  # shellcheck disable=SC2086
  ADASPEC_COMMIT=$C PYTHONPATH=$P:$SITE timeout "${BENCH_S:-150}" python3 benchmarks/logits_rules_bench.py \
    $ARGS --device "${DEVICE:-cuda}" --out "$OUT/lr_$side.json" > "$OUT/lr_$side.txt" 2>&1
  echo "$side ($C) rc=$?"; grep -v "^adaspec:" "$OUT/lr_$side.txt" | tail -10
done
