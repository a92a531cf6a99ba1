#!/usr/bin/env bash
# CPU A/B of the engine thread vs the engine process, tiny model, greedy, streaming, closed loop
cd /work/main
export PYTHONPATH=$PWD
for rep in 1 2; do
for mode in thread process; do
  extra=""; [ $mode = process ] && extra="--engine-process"
  port=$((18000 + RANDOM % 1000))
  python3 -m adaspec.cli serve tiny --device cpu --port $port --max-num-seqs 64 --disable-uvicorn-access-log --disable-log-requests --log-level warning $extra > /tmp/epbench/server_$mode.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.5; done
  python3 -m adaspec.cli bench serve --base-url http://127.0.0.1:$port --num-prompts 256 --max-concurrency 64 --output-len 64 --ignore-eos --temperature 0 --disable-tqdm --num-warmups 8 --save-result --result-dir /tmp/epbench --result-filename ${mode}_$rep.json > /tmp/epbench/bench_${mode}_$rep.log 2>&1
  kill -TERM $pid; wait $pid
  python3 -c "import json; d=json.load(open('/tmp/epbench/${mode}_$rep.json')); print('$mode', $rep, round(d['output_throughput']), round(d.get('median_itl_ms',0),1), round(d.get('median_ttft_ms',0)))"
done
done
