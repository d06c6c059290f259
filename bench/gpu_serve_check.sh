#!/usr/bin/env bash
# `ddserve serve` on every GPU of the machine (the embedded default model, tp = number of GPUs, NCCL
# between Ray shard actors), then a streaming request, a small load test and /metrics, then a clean
# shutdown. Needs Ray. Logs and JSON under $OUT. Usually run as `bash bench/run.sh serve`.
#   OUT=results bash bench/gpu_serve_check.sh [ddserve serve flags, e.g. --no-cuda-graphs]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PORT=8011; URL=http://127.0.0.1:$PORT
python3 -m ddserve serve --port $PORT "$@" > "$OUT/serve.log" 2>&1 &
PID=$!
for _ in $(seq 1 180); do grep -q "serving on" "$OUT/serve.log" && break; sleep 1; done
grep -q "serving on" "$OUT/serve.log" || { echo "server did not start"; tail -50 "$OUT/serve.log"; kill -9 $PID; exit 1; }
echo "started after ${SECONDS}s"
curl -sS -N "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "ddserve-code-21m", "prompt": "def read_lines(path):", "max_tokens": 16, "stream": true, "temperature": 0}' \
  | tee "$OUT/curl_stream.txt" | tail -3
python3 -m loadtest --url "$URL" --num-prompts 32 --concurrency 8 --warmup 2 --ignore-eos \
  --input-len 32 --output-len 64 --no-progress --out "$OUT/load_gpu.json" || echo "loadtest rc=$?"
curl -sS "$URL/metrics" | grep -E '^ddserve_(steps_total|committed|accepted|kv_slots|step_seconds_(sum|count)|control)' \
  | tee "$OUT/metrics.txt"
kill -INT $PID
for _ in $(seq 1 60); do kill -0 $PID 2>/dev/null || break; sleep 1; done
if kill -0 $PID 2>/dev/null; then echo "shutdown HUNG (>60 s)"; kill -9 $PID; exit 1; else echo "shutdown clean"; fi
tail -5 "$OUT/serve.log"
