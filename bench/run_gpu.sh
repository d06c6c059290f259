#!/usr/bin/env bash
# One device call: GPU tests, then the three benchmarks. JSON and one log under $OUT.
#   bash bench/run_gpu.sh [--sweep]     (--sweep also times the tile-config variants)
#   ATTN_ARGS=" " bash bench/run_gpu.sh --sweep   (sweep the MoE only)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
LOG=$OUT/log
status=0
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$LOG"
python3 -m pytest tests/gpu -q --timeout 300 -p no:cacheprovider 2>&1 | tee -a "$LOG" || status=1
(cd bench && python3 bench_moe.py --out "$OUT/moe.json" "$@") 2>&1 | tee -a "$LOG" || status=1
(cd bench && python3 bench_tree_build.py --out "$OUT/tree_build.json") 2>&1 | tee -a "$LOG" || status=1
(cd bench && python3 bench_tree_attn.py --out "$OUT/tree_attn.json" ${ATTN_ARGS:-"$@"}) 2>&1 | tee -a "$LOG" || status=1
exit $status
