#!/usr/bin/env bash
# The device runner: one mode per thing measured, all results under $OUT (JSON per part, a .log per
# command, and $OUT/log with the machine, versions and each command's tail). Run from anywhere:
#   OUT=results bash bench/run.sh MODE [extra arguments for the mode's main script]
#   DRY=1 bash bench/run.sh MODE     # print the commands, run nothing
# Modes (bench/README.md says what each script measures):
#   tests       pytest tests/gpu (kernels vs references, the engine on CUDA, NCCL with 2 GPUs)
#   exactness   DDTree == AR: engine check (bf16, batch-invariant), layer-by-layer probe, and
#               through HTTP when Ray is importable (serve_exactness.py, tp = number of GPUs;
#               extra args go to `ddserve serve`)
#   moe         the INT4 MoE: v3 and v2 at K2.6 shapes (+ kernel breakdown), expert alignment
#   attention   tree-verify attention (plain and invariant vs SDPA) and the tree builder
#   dense       batch-invariant dense ops vs torch, and their offline sm_90 compile report
#   engine      the K2.6 rank step (bench_engine.py; extra args replace its defaults below)
#   profile     where one K2.6 rank forward's time goes, per category (profile_step.py)
#   serve       `ddserve serve` on every GPU (needs Ray): streaming curl, load test, /metrics,
#               clean shutdown; extra args go to `ddserve serve`
#   serve-ab    DDTree against --no-speculative through HTTP (serve_ab.sh, needs Ray): the
#               held-out headers at concurrencies $SWEEP; extra args go to both `ddserve serve`s
#   pair        the embedded target + drafter: its GPU tests, then eval_pair.py
#   step        one call after a step-kernel change: the PDL/router/fused/dense/engine/MoE GPU
#               tests, then the forward profile under each variant in $VARIANTS (default:
#               default,no-prefetch,no-pdl; extra args: pytest -k); the engine bench is `engine`
#               mode
#   drafter     a K2.5-DFlash-sized drafter as one rank's tp = 8 shard: its draft, commit and block
#               commit (bench_drafter.py); its ring attention's launch sweep
#               (bench_drafter_attn.py); the engine's DDTree step paying its work, by variant
#               (profile_drafter_step.py: default, commit-after-step, that + eager-commit,
#               gathered) and against AR (bench_engine.py --drafter dflash); then the
#               drafter's GPU tests and DDTree == AR with DFlash drafters (gpu_engine_check.py)
# Nsight Compute of the MoE is separate: bash bench/ncu_moe.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
MODES="tests exactness moe attention dense engine profile serve serve-ab pair step drafter"
MODE=${1:-}
is_help() { [ -z "$MODE" ] || [ "$MODE" = -h ] || [ "$MODE" = --help ]; }
if is_help || [[ " $MODES " != *" $MODE "* ]]; then
  sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  is_help && exit 0
  echo "unknown mode: $MODE" >&2; exit 2
fi
shift
OUT=${OUT:-results}; [ -n "${DRY:-}" ] || mkdir -p "$OUT"; OUT=$(realpath -m "$OUT")
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} RAY_AUTH_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
LOG=$OUT/log
status=0

# step NAME SECONDS CMD...: run CMD under a time limit, full output in $OUT/NAME.log, tail in $LOG
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${DRY:-}" ]; then echo "$*"; return 0; fi
  echo "\$ $*" >>"$LOG"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -30 "$OUT/$name.log" >>"$LOG"
  [ $rc -eq 0 ] || { echo "[$name: exit $rc]" >>"$LOG"; status=1; }
}
has_ray() { python3 -c "import ray" 2>/dev/null; }
# need_ray MODE: a mode that serves needs Ray (on the device machines: the device bundle)
need_ray() {
  [ -n "${DRY:-}" ] || has_ray || { echo "$1: Ray is not importable" | tee -a "$LOG"; exit 2; }
}

[ -n "${DRY:-}" ] || { date -u; nvidia-smi -L
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} >>"$LOG" 2>&1

case "$MODE" in
  tests)
    step pytest 500 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf "$@"
    ;;
  exactness)
    step engine_check 200 python3 bench/gpu_engine_check.py --batch-invariant --dtypes bfloat16 \
      --out "$OUT/engine_check_bf16_invariant.json"
    step probe 150 python3 bench/exactness_probe.py --out "$OUT/exactness_probe.json"
    if [ -n "${DRY:-}" ] || has_ray; then
      step serve_exactness 250 python3 bench/serve_exactness.py --out "$OUT/serve_exactness.json" \
        -- "$@"
    fi
    ;;
  moe)
    step moe 300 python3 bench/bench_moe.py --breakdown --out "$OUT/moe.json" "$@"
    step align 300 python3 bench/bench_align.py --budget 150 --out "$OUT/align.json"
    ;;
  attention)
    step tree_attn 300 python3 bench/bench_tree_attn.py --prefixes 1024,8192,32768 \
      --out "$OUT/tree_attn.json" "$@"
    step tree_build 120 python3 bench/bench_tree_build.py --out "$OUT/tree_build.json"
    ;;
  dense)
    step dense 200 python3 bench/bench_dense.py --budget 170 --out "$OUT/dense.json" "$@"
    step aot_dense 200 python3 bench/aot_dense.py --json "$OUT/aot_dense.json"
    ;;
  engine)
    [ $# -gt 0 ] || set -- --batches 1,5,10 --budgets 8,16 --corrupt 0,0.3 --cuda-graphs
    step engine 420 python3 bench/bench_engine.py --max-seconds 330 --out "$OUT/engine.json" "$@"
    ;;
  profile)
    step profile 400 python3 bench/profile_step.py --out "$OUT/profile.json" "$@"
    ;;
  serve)
    need_ray serve
    step serve_check 300 bash bench/gpu_serve_check.sh "$@"
    ;;
  serve-ab)
    need_ray serve-ab
    step serve_ab 500 bash bench/serve_ab.sh "$@"
    ;;
  pair)
    pair_tests="test_invariant_gpu or test_engine_gpu or test_warmup_gpu or test_ddtree_nosync"
    step pytest_pair 200 python3 -m pytest tests/gpu -q -p no:cacheprovider -rf \
      -k "$pair_tests or test_prefill_phase_gpu"
    step eval_pair 380 python3 bench/eval_pair.py --max-minutes 5.5 \
      --out "$OUT/eval_pair_h200.json" \
      --plot "$OUT/eval_pair_h200.png" "$@"
    ;;
  step)
    step pytest_step 250 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_pdl_gpu.py \
      tests/gpu/test_router_gpu.py tests/gpu/test_fused_gpu.py tests/gpu/test_invariant_gpu.py \
      tests/gpu/test_side_stream_gpu.py \
      tests/gpu/test_engine_gpu.py tests/gpu/test_moe_v3.py tests/gpu/test_tree_attn_triton.py \
      ${1:+-k "$1"}
    # one forward per configuration under each variant (by default the launch variants: PDL with
    # and without its L2 prefetches, plain launches), same weights and inputs: compare the
    # replays' wall times
    step profile 300 python3 bench/profile_step.py --batches 1,10 \
      --variants "${VARIANTS:-default,no-prefetch,no-pdl}" --out "$OUT/profile.json"
    ;;
  drafter)
    step drafter_tp8 200 python3 bench/bench_drafter.py --batches 1,5,10 --tp 8 --profile \
      --out "$OUT/drafter_tp8.json" "$@"
    # the default launch (auto splits, 8 warps, 64-key tiles) against the one it replaced; the
    # whole sweep (the script's defaults) takes ~4 min
    step drafter_attn 150 python3 bench/bench_drafter_attn.py --splits 256,auto --warps 4,8 \
      --block-n 64 --out "$OUT/drafter_attn.json"
    step drafter_attn_half 100 python3 bench/bench_drafter_attn.py --live 0.5 --splits 256,auto \
      --warps 8 --block-n 64 --out "$OUT/drafter_attn_half.json"
    variants=default,commit-after-step,commit-after-step+eager-commit,gathered
    step profile_drafter 400 python3 bench/profile_drafter_step.py --batches 1,10 --budgets 16 \
      --steps 8 --out "$OUT/profile_drafter.json" --variants "$variants"
    step engine_dflash 300 python3 bench/bench_engine.py --cuda-graphs --batches 1,5,10 \
      --budgets 16 --corrupt 0.19 --steps 12 --drafter dflash --out "$OUT/engine_dflash.json"
    step pytest_drafter 200 python3 -m pytest -q -p no:cacheprovider -rf tests/core/test_dflash.py \
      tests/core/test_dflash_engine.py tests/gpu/test_dflash_commit_gpu.py \
      tests/gpu/test_drafter_attn_gpu.py \
      tests/gpu/test_engine_gpu.py tests/gpu/test_warmup_gpu.py
    step engine_check_dflash 200 python3 bench/gpu_engine_check.py --dtypes bfloat16 \
      --drafters dflash --out "$OUT/engine_check_dflash.json"
    ;;
esac
[ -n "${DRY:-}" ] || tail -c 11000 "$LOG"
exit $status
