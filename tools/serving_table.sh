#!/usr/bin/env bash
# The serving table of docs/benchmarks.md, in one command:
#   tools/serving_table.sh [PORT]
# Starts `kvd serve` with the bundled SmolLM2-135M-Instruct (default dtype),
# sweeps request rates 1, 2, 4 and inf with kvd-loadgen (random dataset,
# 128-token prompts, 32-token answers, 32 requests per rate), then prints the
# markdown rows and draws the CDFs under results/serving/.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8765}
OUT=results/serving
mkdir -p "$OUT"
rm -f "$OUT"/rate-*.json
.venv/bin/kvd serve --port "$PORT" > "$OUT/kvd.log" 2>&1 &
KVD=$!
trap 'kill $KVD 2>/dev/null; wait $KVD 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $KVD 2>/dev/null || { cat "$OUT/kvd.log"; exit 1; }
  sleep 1
done
for rate in 1 2 4 inf; do
  .venv/bin/kvd-loadgen --base-url "http://127.0.0.1:$PORT" --dataset-name random \
    --random-input-len 128 --random-output-len 32 --num-prompts 32 --request-rate "$rate" \
    --ignore-eos --seed 0 --metric-percentiles 50,99 --percentile-metrics ttft,tpot,itl,e2el \
    --goodput ttft:2000 tpot:200 --save-detailed --result-dir "$OUT" \
    --result-filename "rate-$rate.json" --disable-tqdm > "$OUT/rate-$rate.txt"
done
.venv/bin/kvd-loadgen table "$OUT"/rate-1.json "$OUT"/rate-2.json "$OUT"/rate-4.json "$OUT"/rate-inf.json
.venv/bin/kvd-loadgen plot "$OUT"/rate-*.json -o "$OUT/rates" > /dev/null
