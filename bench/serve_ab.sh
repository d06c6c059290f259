#!/usr/bin/env bash
# DDTree against plain decoding through the HTTP API: `ddserve serve` (the embedded trained pair
# unless flags say otherwise, tp = every GPU) is started twice, once as it runs by default and
# once with --no-speculative, and each time the load generator sends the held-out function
# headers (bench/heldout_prompts.json, temperature 0, 128 tokens) at each concurrency of $SWEEP
# (default 1,5,10; $NUM requests per run, default 32). Needs Ray. Under $OUT: load_ddtree.json
# and load_plain.json (one run per concurrency each), both servers' logs, and texts_*.txt (one
# greedy completion per mode, which must be equal). $PORT: the servers' port (default 8012).
# $MODES: which of the two runs (default "ddtree plain").
#   OUT=results bash bench/serve_ab.sh [ddserve serve flags for both runs, e.g. --budgets auto]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}; mkdir -p "$OUT"
SWEEP=${SWEEP:-1,5,10}; NUM=${NUM:-32}; PORT=${PORT:-8012}; URL=http://127.0.0.1:$PORT
MODES=${MODES:-ddtree plain}
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pid=
# stop: SIGTERM (ddserve serve then stops the Ray it started), SIGKILL only if it hangs
stop() {
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || { pid=; return 0; }; sleep 1; done
  echo "shutdown hung (>60 s)"; kill -9 "$pid"; pid=; return 1
}
trap stop EXIT
python3 - "$OUT/heldout.jsonl" <<'EOF'
import json, sys
rows = json.load(open("bench/heldout_prompts.json"))["prompts"]
with open(sys.argv[1], "w") as f:
    for r in rows:
        f.write(json.dumps({"prompt": r["prompt"], "max_tokens": 128}) + "\n")
EOF
status=0
for mode in $MODES; do
  flags=(); [ $mode = plain ] && flags=(--no-speculative)
  python3 -m ddserve serve --port $PORT "${flags[@]}" "$@" > "$OUT/serve_$mode.log" 2>&1 &
  pid=$!; t0=$SECONDS
  for _ in $(seq 1 240); do
    grep -q "serving on" "$OUT/serve_$mode.log" && break
    kill -0 "$pid" 2>/dev/null || break  # it exited: its log says why
    sleep 1
  done
  if ! grep -q "serving on" "$OUT/serve_$mode.log"; then
    echo "$mode: server did not start"; tail -30 "$OUT/serve_$mode.log"; exit 1
  fi
  echo "$mode: serving after $((SECONDS - t0)) s"
  curl -fsS --max-time 60 "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "def read_lines(path):", "max_tokens": 64, "temperature": 0}' \
    > "$OUT/completion_$mode.json" \
    && python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])' \
      < "$OUT/completion_$mode.json" > "$OUT/texts_$mode.txt" \
    || { echo "$mode: the greedy completion failed"; status=1; }
  python3 -m loadtest --url "$URL" --dataset jsonl --dataset-path "$OUT/heldout.jsonl" \
    --sweep "$SWEEP" --num-prompts "$NUM" --warmup 4 --no-progress --out "$OUT/load_$mode.json" \
    || { echo "$mode: loadtest rc=$?"; status=1; }
  stop || status=1
done
if [ "$MODES" != "ddtree plain" ]; then :  # one mode: nothing to compare
elif [ -s "$OUT/texts_ddtree.txt" ] && cmp -s "$OUT/texts_ddtree.txt" "$OUT/texts_plain.txt"; then
  echo "same text in both modes"
else echo "TEXTS DIFFER (or one is missing)"; status=1; fi
exit $status
