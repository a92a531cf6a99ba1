#!/usr/bin/env bash
# How much the server loses to the GIL on a GPU, in one device command (no pair build: the shipped
# tiny model, whose steps are short, so the host side dominates). For each GIL switch interval
# (ADASPEC_GIL_SWITCH_INTERVAL; "default" = Python's 5 ms): start `adaspec serve tiny`, run
# `adaspec bench serve` at concurrency C (streaming completions, NUM prompts, 64 tokens each,
# ignore_eos, T = 0), stop the server. Then the offline engine on the same load
# (benchmarks/offline_sweep.py, arm none): what the engine does without the server around it.
# Writes $OUT/gil_<interval>.json (bench serve results), $OUT/offline_tiny.json, $OUT/gil_check.txt.
#   bash benchmarks/serve_gil_check.sh [INTERVALS] [C] [NUM]     e.g. "default 0.0005 0.0001" 256 1024
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
INTERVALS=${1:-default 0.0005 0.0001}
C=${2:-256}
NUM=${3:-1024}
PYTHON=${PYTHON:-$( [ -x /opt/torch/.venv/bin/python3 ] && echo /opt/torch/.venv/bin/python3 || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/gil_check.txt"
PORT=8127
echo "commit ${ADASPEC_COMMIT:-unknown}; C=$C prompts=$NUM" | tee "$LOG"
for si in $INTERVALS; do
  env_si=(); [ "$si" != default ] && env_si=(ADASPEC_GIL_SWITCH_INTERVAL="$si")
  env "${env_si[@]}" "$PYTHON" -m adaspec.cli serve tiny --port $PORT --max-num-seqs "$C" --disable-log-requests \
    --disable-uvicorn-access-log --no-engine-process > "$OUT/server_$si.log" 2>&1 &
  sp=$!
  for _ in $(seq 180); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
  timeout 120 "$PYTHON" -m adaspec.cli bench serve --base-url "http://127.0.0.1:$PORT" --dataset eval-code \
    --output-len 64 --ignore-eos --temperature 0 --disable-tqdm --num-prompts "$NUM" --max-concurrency "$C" \
    --num-warmups 16 --save-result --result-dir "$OUT" --result-filename "gil_$si.json" --label "switch interval $si" \
    > "$OUT/bench_$si.txt" 2>&1
  kill "$sp"; wait "$sp" 2>/dev/null
  "$PYTHON" - "$OUT/gil_$si.json" "$si" <<'EOF' | tee -a "$LOG"
import json, sys
try:
    r = json.load(open(sys.argv[1]))
    print(f"switch interval {sys.argv[2]:>8}: output {r['output_throughput']:8.0f} tok/s, median ITL "
          f"{r.get('median_itl_ms', float('nan')):6.1f} ms, median TTFT {r.get('median_ttft_ms', float('nan')):7.1f} ms")
except Exception as e:
    print(f"switch interval {sys.argv[2]}: no result ({e})")
EOF
done
timeout 150 "$PYTHON" benchmarks/offline_sweep.py --model tiny --arms none --concurrency "$C" --repeats 2 \
  --num-prompts "$NUM" --out "$OUT/offline_tiny.json" 2>&1 | tail -4 | tee -a "$LOG"
