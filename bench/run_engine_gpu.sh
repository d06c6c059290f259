#!/usr/bin/env bash
# The end-to-end engine benchmark on one H200, in one device call of at most ~5 minutes.
#   bash bench/run_engine_gpu.sh [extra bench_engine.py args]
# Writes $OUT/engine.json (rewritten after every configuration, so a killed run keeps what it
# measured) and $OUT/engine.log. bench_engine.py starts no configuration after --max-seconds;
# `timeout` is the hard stop behind it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
LOG=$OUT/engine.log
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$LOG"
timeout -k 10 300 python3 bench/bench_engine.py --max-seconds 200 --out "$OUT/engine.json" "$@" \
  2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
nvidia-smi --query-gpu=memory.used,memory.total --format=csv 2>&1 | tee -a "$LOG"
exit "$status"
